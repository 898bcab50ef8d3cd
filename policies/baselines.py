"""Named policies: the baselines today's systems use, and the live broker's default, as pipelines.

Every policy is the same filter chain as heliotrope's profiles (health, region, latency objective, refused,
quota, GPU fit) followed by its scorers; they differ only in how they rank the sites that can take a job
now. A job's hard constraints (allowed regions, latency objective) bind the baselines as they bind the
profiles: today's brokers honour a placement constraint the submitter states (SkyPilot's region list,
MultiKueue's and Karmada's cluster affinities), and a schedule that breaks them is not one a user would
accept, so comparing against it would flatter the baseline. No baseline waits: a job that fits nowhere
stays queued until capacity frees. ``heliotrope simulate --policy NAME`` takes these names;
``--compare all`` runs every one but ``default``.

- ``baseline-round-robin``: the next site in turn (``round_robin``).
- ``baseline-least-loaded``: the largest free share, i.e. the earliest start (Slurm federation, MultiKueue
  all-at-once) (``least_loaded``).
- ``baseline-cheapest-first``: the cheapest site with room, then the next (SkyPilot's optimizer)
  (``cheapest``).
- ``baseline-spillover``: a fixed site order (MultiKueue incremental, Karmada ordered affinities)
  (``spillover``).
- ``baseline-carbon-greedy``: the lowest grid intensity at submit time, no waiting (``carbon_now``).
- ``default``: the live broker's pipeline of this release (most free GPUs).
- ``balanced``, ``green``, ``cheap``, ``fast``: heliotrope's own profiles (``policies/profiles.py``), with
  their time-shifting (``policies/timeshift.py``): they may defer a job with slack, and take the queue in
  urgency order.
"""

from __future__ import annotations

from collections.abc import Callable

from policies.pipeline import Pipeline, Weighted, default_pipeline
from policies.profiles import BUILTIN, filters, profile_pipeline
from policies.scorers import Scorer
from policies.scorers.carbon_now import CarbonNowScorer
from policies.scorers.cheapest import CheapestScorer
from policies.scorers.least_loaded import LeastLoadedScorer
from policies.scorers.round_robin import RoundRobinScorer
from policies.scorers.spillover import SpilloverScorer


def _one(scorer: Scorer) -> Callable[[], Pipeline]:
    def build() -> Pipeline:
        return Pipeline(
            filters=filters(),
            scorers=(Weighted(scorer, 1.0),),
        )
    return build


POLICIES: dict[str, Callable[[], Pipeline]] = {
    "baseline-round-robin": _one(RoundRobinScorer()),
    "baseline-least-loaded": _one(LeastLoadedScorer()),
    "baseline-cheapest-first": _one(CheapestScorer()),
    "baseline-spillover": _one(SpilloverScorer()),
    "baseline-carbon-greedy": _one(CarbonNowScorer()),
    "default": default_pipeline,
}
for _name in BUILTIN:  # heliotrope's own profiles, under their names
    POLICIES[_name] = (lambda name: lambda: profile_pipeline(name))(_name)


COMPARED: tuple[str, ...] = tuple(n for n in POLICIES if n != "default")
"""What ``--compare all`` runs: the baselines and heliotrope's profiles. ``default`` ranks sites as
``baseline-least-loaded`` does on one-model federations (most free GPUs), so it runs only by name."""


class UnknownPolicy(ValueError):
    """A policy name that is neither a baseline nor a profile; the message lists the known ones."""


def policy(name: str) -> Pipeline:
    try:
        return POLICIES[name]()
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
