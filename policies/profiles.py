"""Profiles: named weightings of the scorers, chosen per federation and overridable per job within limits.

A profile is a set of scorer weights (each finite and >= 0; 0 or absent turns a scorer off). Every profile
runs the same filters: health, cordon, region, latency objective, refused, site quota, GPU fit, tenant limit. The
built-in profiles:

- ``balanced``: carbon 0.5, cost 0.5, latency 0.25, free GPUs 0.1, off-peak 0.1, telemetry 0.1 — a bit of
  everything, carbon and money first.
- ``green``: carbon 1.0, cost 0.05, telemetry 0.05 — the cleanest grid over the job's run; defers a job
  with slack to a cleaner site and hour, leaving room, at a price, where latency-bound jobs need it.
- ``cheap``: cost 1.0, carbon 0.05, telemetry 0.05 — the lowest price; a job with slack waits for room at a
  cheaper site.
- ``fast``: latency 1.0, free GPUs 0.5, telemetry 0.25 — near the users, on the least loaded site.

Scorer names: ``carbon``, ``cost``, ``latency``, ``free_gpus``, ``least_loaded``, ``follow_sun_offpeak``,
``follow_sun_solar``, ``telemetry``, ``carbon_now``, ``cheapest``, ``round_robin``, ``spillover`` (see
``policies/scorers/``). Configuration (``profiles:`` in the federation YAML) may redefine a built-in
profile or add one; an unknown scorer or a negative weight is an error naming the profile and the scorer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.errors import at
from policies.filters import standard_filters
from policies.pipeline import Pipeline, Weighted, default_pipeline
from policies.scorers import Scorer
from policies.scorers.carbon import CarbonScorer
from policies.scorers.carbon_now import CarbonNowScorer
from policies.scorers.cheapest import CheapestScorer
from policies.scorers.cost import CostScorer
from policies.scorers.follow_sun import FollowSunScorer
from policies.scorers.free_gpus import FreeGpusScorer
from policies.scorers.latency import LatencyScorer
from policies.scorers.least_loaded import LeastLoadedScorer
from policies.scorers.round_robin import RoundRobinScorer
from policies.scorers.spillover import SpilloverScorer
from policies.scorers.telemetry import TelemetryScorer
from policies.migration import MigrationPolicy
from policies.timeshift import ShiftPolicy

SCORERS: dict[str, Callable[[], Scorer]] = {
    "carbon": CarbonScorer,
    "cost": CostScorer,
    "latency": LatencyScorer,
    "free_gpus": FreeGpusScorer,
    "least_loaded": LeastLoadedScorer,
    "follow_sun_offpeak": lambda: FollowSunScorer("offpeak"),
    "follow_sun_solar": lambda: FollowSunScorer("solar"),
    "telemetry": TelemetryScorer,
    "carbon_now": CarbonNowScorer,
    "cheapest": CheapestScorer,
    "round_robin": RoundRobinScorer,
    "spillover": SpilloverScorer,
}

BUILTIN: dict[str, dict[str, float]] = {
    "balanced": {"carbon": 0.5, "cost": 0.5, "latency": 0.25, "free_gpus": 0.1, "follow_sun_offpeak": 0.1,
                 "telemetry": 0.1},
    "green": {"carbon": 1.0, "cost": 0.05, "telemetry": 0.05},
    "cheap": {"cost": 1.0, "carbon": 0.05, "telemetry": 0.05},
    "fast": {"latency": 1.0, "free_gpus": 0.5, "telemetry": 0.25},
}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the profile and the scorer or field."""


SHIFTS: dict[str, ShiftPolicy] = {
    "balanced": ShiftPolicy(objective="carbon", min_saving=0.2, miss_cost=30.0),
    "green": ShiftPolicy(objective="carbon", max_wait_factor=4.0, min_saving_abs=0.5, miss_cost=30.0,
                         latency_reserve=1.0, latency_reserve_price=0.2),
    "cheap": ShiftPolicy(objective="cost", miss_cost=30.0),
}
"""How the built-in profiles shift flexible jobs in time (``fast`` never defers): the defaults of
:class:`policies.timeshift.ShiftPolicy` (latest start at deadline - 1.5 × the estimate, up to a week ahead,
no headroom, 10 % saving), chosen on the 2021 replay of the Philly trace; ``balanced`` asks twice the
saving before it makes a job wait. ``green`` waits at most four times a job's expected run time and only
for half a kilogram or more: on the 2021 replay it missed nearly 90 % fewer deadlines at 30 % utilisation
and nearly a third fewer at 50 % than with the bare defaults, for the same carbon to within 1 % (measured
before the risk below was priced; README, Evidence).

All three price the risk a wait adds to the deadline at 30 per whole unit of probability, in the
objective's unit (``miss_cost``; :mod:`policies.runtime_risk`): 0.3 kg CO2e (``cheap``: 0.3 USD) per
percentage point. Chosen on the 2021 replay: of 30, 100 and 300 tried on ``green`` at both utilisations
(and 1,000 at 30 %), 30 is the one that kept the targets ``green`` met there (20 % below the best
carbon-blind baseline at 50 %, 10 % below carbon-greedy at 30 %), with ``duration_safety`` 1.5 then and
on the machine the previous release was measured on. On that replay the misses of jobs
deferred for a saving fell from 129 to 44 (``green``), 1,246 to 110 (``balanced``) and 810 to 232
(``cheap``) at 50 % utilisation, and from 99 to 38, 1,128 to 35 and 411 to 17 at 30 %, for at most
0.9 % more carbon (``green`` at 30 %) and 0.1 % more cost (``balanced`` at 30 %) (README, Evidence).

``green`` keeps room for latency-bound jobs, priced (``latency_reserve`` 1.0: the most they held at each
site hour by hour over the last week; ``latency_reserve_price`` 0.2 kg CO2e per GPU-hour taken from it:
:mod:`policies.latency_reserve`), and 1.5 expected run times before the deadline (``duration_safety``, the
default; 1.25 before the room was kept, when the price of the risk alone guarded deferrals better). Chosen on
2021 (README, Evidence): of the prices 0.2, 0.5, 1, 2 and 5 and the room as a bar, 0.5 was the one that kept
every target ``green`` can meet at both utilisations on the Evidence's draw of the workload, until the
forecasts stopped going below 0 g/kWh (2026-11-29): with them, 0.5 left ``green`` 19.8 % below the best
carbon-blind baseline at 50 % (108.4 t), and 0.2 is the one that keeps every 2021 target (107.6 t, 20.4 %;
at 30 % 78.2 t and 66 misses against carbon-greedy's 88.5 t and 77). The room as a bar cost 2.3 t more at
50 %, past that target; the misses at 30 % move non-monotonically with the price (70 to 147 before), as one
burst of latency-bound jobs finds their sites full or not. On two more draws (seeds 1 and 2) the price 0.5
kept the 50 % target (20.3 %, 21.2 %) and cut the misses at 30 % by 45 % and 36 % (124 against
carbon-greedy's 151; 489 against 433).
``green`` does not bound a deferral's chance of a miss (``max_risk``): it cost 3.4-5.6 % more carbon. A platform
that puts deadlines first sets it. Nor does any built-in profile check a deferral against the GPUs that
jobs past their estimates are expected to hold (``book_overruns``): for ``green`` it took the misses of jobs
deferred for a saving to 0-3 on the four replays (from 10-27), but cost 0.7-1.6 t, and in 2021 at 50 % left
it 19.0 % below the best carbon-blind baseline, short of the target met there (README, Evidence)."""


MIGRATIONS: dict[str, MigrationPolicy] = {
    "green": MigrationPolicy(objective="carbon"),
}
"""Which built-in profiles move running checkpointable jobs to a cleaner site (``policies.migration``, its
defaults: 20 % and 1 kg saved over the part of the rest of the run that the 48-hour forecast covers, a
10-minute restart counted, at least 2 h left; and room made for latency-bound jobs that can wait no longer).
Only jobs that say they are checkpointable are ever moved; the simulator and the live cycle act on it alike
(README, *Moving running work*)."""


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float] = Field(description="scorer name -> weight (>= 0; 0 turns the scorer off)")
    shift: ShiftPolicy | None = Field(default=None, description="time-shifting of flexible jobs; none: never defer")
    migrate: MigrationPolicy | None = Field(default=None, description="moving running checkpointable jobs to a "
                                            "cleaner or cheaper site; none: never move one")

    @field_validator("weights")
    @classmethod
    def _known_and_non_negative(cls, weights: dict[str, float]) -> dict[str, float]:
        for name, w in weights.items():
            if name not in SCORERS:
                raise ValueError(f"unknown scorer {name!r}; scorers are: {', '.join(SCORERS)}")
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"scorer {name}: weight must be a finite number >= 0, got {w}")
        if not any(w > 0 for w in weights.values()):
            raise ValueError("at least one scorer needs a weight above 0")
        return weights

    @model_validator(mode="after")
    def _pause_needs_shift(self) -> Profile:
        if self.migrate is not None and self.migrate.pause and self.shift is None:
            raise at(("migrate", "pause"), "pause needs shift: a paused job is put back in the queue for the "
                                           "profile's time-shift search to defer, and this profile has none")
        if self.migrate is not None and self.migrate.pause and self.migrate.objective != "carbon":
            raise at(("migrate", "pause"), "pause is for the carbon objective: it waits for cleaner hours of the "
                                           "grid, and a migrate objective of cost would never pause a job")
        return self


JOB_PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
"""The names a job spec's ``profile`` may hold (``broker.models.JobSpec.profile``)."""


class ProfilesConfig(BaseModel):
    """``profiles:`` in the federation config: the default profile, the ones jobs may ask for, and
    definitions that add profiles or replace built-in ones."""

    model_config = ConfigDict(extra="forbid")

    default: str | None = Field(default=None, description="the profile jobs run under unless they name one; "
                                "none: the release's default pipeline (most free GPUs)")
    job_may_choose: list[str] = Field(default_factory=lambda: list(BUILTIN),
                                      description="profiles a job may name in its spec; [] forbids overrides")
    definitions: dict[str, Profile] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _names_exist(self) -> ProfilesConfig:
        known = set(BUILTIN) | set(self.definitions)
        named: list[tuple[tuple[str | int, ...], str | None]] = [
            (("default",), self.default), *((("job_may_choose", i), n) for i, n in enumerate(self.job_may_choose))]
        for field, name in named:
            if name is not None and name not in known:
                raise at(field, f"profile {name!r} is not defined; profiles are: {', '.join(sorted(known))}")
        for i, name in enumerate(self.job_may_choose):
            if not JOB_PROFILE_NAME.fullmatch(name):
                raise at(("job_may_choose", i), f"no job can name profile {name!r}: a job spec's profile is 1-63 "
                                                "lower-case letters, digits or '-', starting with a letter or digit; "
                                                "rename it")
        return self

    def weights(self, name: str) -> dict[str, float]:
        if name in self.definitions:
            return dict(self.definitions[name].weights)
        if name in BUILTIN:
            return dict(BUILTIN[name])
        raise ProfileError(f"profile {name!r} is not defined; profiles are: "
                           f"{', '.join(sorted(set(BUILTIN) | set(self.definitions)))}")

    def shift(self, name: str) -> ShiftPolicy | None:
        if name in self.definitions:
            return self.definitions[name].shift
        return SHIFTS.get(name)

    def migrate(self, name: str) -> MigrationPolicy | None:
        if name in self.definitions:
            return self.definitions[name].migrate
        return MIGRATIONS.get(name)

    def choose(self, requested: str | None) -> str | None:
        """The profile a job runs under: its own when allowed, else the federation's default (None: the
        release's default pipeline)."""
        if requested is None:
            return self.default
        if requested not in self.job_may_choose:
            raise ProfileError(f"profile {requested!r} may not be chosen by a job here; allowed: "
                               f"{', '.join(self.job_may_choose) or 'none'}")
        return requested


def filters() -> tuple:
    return standard_filters()


def pipeline_for(weights: Mapping[str, float], shift: ShiftPolicy | None = None,
                 migrate: MigrationPolicy | None = None) -> Pipeline:
    """The pipeline of a profile: every filter, then each scorer with its weight, its time-shifting and its
    moving of running work."""
    for name in weights:
        if name not in SCORERS:
            raise ProfileError(f"unknown scorer {name!r}; scorers are: {', '.join(SCORERS)}")
    return Pipeline(filters=filters(),
                    scorers=tuple(Weighted(SCORERS[name](), float(w)) for name, w in weights.items()), shift=shift,
                    migrate=migrate)


def profile_pipeline(name: str | None, config: ProfilesConfig | None = None) -> Pipeline:
    """The pipeline of profile ``name``; ``None``: the release's default pipeline (most free GPUs)."""
    if name is None:
        return default_pipeline()
    config = config or ProfilesConfig()
    return pipeline_for(config.weights(name), config.shift(name), config.migrate(name))
