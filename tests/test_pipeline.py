"""The placement pipeline: which site a job goes to, and the explanation a user reads for every site that
it did not go to (filters, then most free GPUs, then the first site by name)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import ids
from broker.models import Decision, JobSpec, SiteSpec, SiteState
from policies import explain
from policies.filters.gpu_fit import GpuFitFilter
from policies.filters.health import HealthyFilter
from policies.filters.region import RefusedFilter, RegionFilter
from policies.pipeline import Pipeline, PipelineError, Placement, Weighted, default_pipeline
from policies.scorers.free_gpus import FreeGpusScorer
from policies.snapshot import MODEL_INDEX, JobRequest, Snapshot, build_snapshot
from tests.builders import NOW, job, site, site_state

Site = tuple[SiteSpec, SiteState | None]


@dataclass
class Outcome:
    """One decision, as the pipeline returned it and as the user reads it."""

    placement: Placement
    decision: Decision
    record: dict[str, Any]

    @property
    def site(self) -> str | None:
        return self.decision.site

    @property
    def model(self) -> str | None:
        return ids.GPU_MODEL_IDS[self.placement.model] if self.placement.placed else None

    def reasons(self) -> dict[str, list[str]]:
        return {v.site: v.reasons for v in self.decision.sites if not v.feasible}


def snapshot(*sites: Site) -> Snapshot:
    return build_snapshot(NOW, [spec for spec, _ in sites], {spec.name: state for spec, state in sites})


def decide(
    sites: tuple[Site, ...] | list[Site],
    spec: JobSpec,
    excluded: frozenset[str] = frozenset(),
    pipeline: Pipeline | None = None,
    snap: Snapshot | None = None,
) -> Outcome:
    pipeline = pipeline or default_pipeline()
    snap = snap or snapshot(*sites)
    req = JobRequest.from_spec("job-1", spec, excluded)
    placement = pipeline.decide(req, snap)
    rec = explain.record(pipeline, placement, snap)
    decision = explain.render(rec, req, {f.code: f for f in pipeline.filters}, attempt=1)
    return Outcome(placement, decision, rec)


def up(name: str, free: dict[str, int] | None = None, shared: dict[str, int] | None = None, **spec: Any) -> Site:
    """A healthy site built from ``spec`` with ``free`` GPUs (all free by default)."""
    s = site(name, **spec)
    return s, site_state(s, free=free, shared=shared)


def down(name: str, **spec: Any) -> Site:
    s = site(name, **spec)
    return s, site_state(s, healthy=False)


# --- which site wins and why --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    sites: tuple[Site, ...]
    job: JobSpec
    winner: str | None
    reasons: dict[str, list[str]]  # site -> the reasons it was rejected with, in filter order
    excluded: frozenset[str] = frozenset()
    model: str | None = None


CASES = [
    pytest.param(
        Case(
            sites=(up("berlin", gpus={"a100-80gb": 16}), up("tokyo", gpus={"h100-80gb": 8})),
            job=job(count=2, model="h100-80gb"),
            winner="tokyo",
            reasons={"berlin": ["gpus-do-not-fit: site has no h100-80gb"]},
        ),
        id="a job naming a model goes to the only site that has it",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", gpus={"t4": 16}), up("tokyo", gpus={"a100-40gb": 8})),
            job=job(count=2, memory_gib=24),
            winner="tokyo",
            reasons={
                "berlin": ["gpus-do-not-fit: GPUs of any model here have 16 GiB per GPU; the job needs 24 GiB"]
            },
            model="a100-40gb",
        ),
        id="a memory requirement filters out a site whose GPUs are too small, however many are free",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", gpus={"a100-40gb": 8}), up("tokyo", gpus={"a100-40gb": 8})),
            job=job(model="a100-40gb", memory_gib=48),
            winner=None,
            reasons={
                "berlin": ["gpus-do-not-fit: a100-40gb here have 40 GiB per GPU; the job needs 48 GiB"],
                "tokyo": ["gpus-do-not-fit: a100-40gb here have 40 GiB per GPU; the job needs 48 GiB"],
            },
        ),
        id="a named model with less memory than the job needs fits nowhere",
    ),
    pytest.param(
        Case(
            sites=(
                up("berlin", free={"a100-80gb": 3}, gpus={"a100-80gb": 16}),
                up("tokyo", free={"a100-80gb": 8}, gpus={"a100-80gb": 8}),
            ),
            job=job(count=12),
            winner=None,
            reasons={
                "berlin": ["gpus-do-not-fit: job needs 12 GPUs of any model; 3 free"],
                "tokyo": ["gpus-do-not-fit: job needs 12 GPUs of any model; 8 free"],
            },
        ),
        id="a job larger than the free GPUs of every site is unplaceable with the numbers for each site",
    ),
    pytest.param(
        Case(
            sites=(down("berlin", gpus={"a100-80gb": 16}), up("tokyo", free={"a100-80gb": 2})),
            job=job(count=2),
            winner="tokyo",
            reasons={"berlin": ["site-unhealthy: site is not healthy (unreachable, or its last report is too old)"]},
        ),
        id="an unhealthy site is skipped even with more free GPUs",
    ),
    pytest.param(
        Case(
            sites=((site("berlin", gpus={"a100-80gb": 16}), None), up("tokyo", free={"a100-80gb": 2})),
            job=job(),
            winner="tokyo",
            reasons={
                "berlin": [
                    "site-unhealthy: site is not healthy (unreachable, or its last report is too old)",
                    "gpus-do-not-fit: job needs 1 GPUs of any model; 0 free",
                ]
            },
        ),
        id="a site the broker has not heard from is treated as unhealthy with no free GPUs",
    ),
    pytest.param(
        Case(
            sites=(
                up("berlin", free={"a100-80gb": 1}, region="gcp:europe-west3"),
                up("tokyo", region="gcp:asia-northeast1"),
            ),
            job=job(allowed_regions=["gcp:europe-west3-a"]),
            winner="berlin",
            reasons={
                "tokyo": [
                    "region-not-allowed: region gcp:asia-northeast1 is not among the job's allowed regions "
                    "(gcp:europe-west3)"
                ]
            },
        ),
        id="allowed regions keep a job in them even when another region has more free GPUs",
    ),
    pytest.param(
        Case(
            sites=(
                up("berlin", region="gcp:europe-west3"),
                up("tokyo", free={"a100-80gb": 1}, region="gcp:asia-northeast1"),
            ),
            job=job(denied_regions=["gcp:europe-west3"]),
            winner="tokyo",
            reasons={"berlin": ["region-not-allowed: region gcp:europe-west3 is denied by the job"]},
        ),
        id="a denied region is avoided even when it has more free GPUs",
    ),
    pytest.param(
        Case(
            sites=(up("berlin"), up("tokyo", free={"a100-80gb": 1})),
            job=job(),
            excluded=frozenset({"berlin", "gone-site"}),
            winner="tokyo",
            reasons={"berlin": ["site-refused: site refused this job earlier; it is skipped until conditions change"]},
        ),
        id="a site that refused the job is skipped and a refused site that no longer exists is ignored",
    ),
    pytest.param(
        Case(
            sites=(
                up("amsterdam", free={"a100-80gb": 3}),
                up("berlin", free={"a100-80gb": 7}),
                up("tokyo", free={"a100-80gb": 5}),
            ),
            job=job(count=2),
            winner="berlin",
            reasons={},
        ),
        id="the site with the most free GPUs wins",
    ),
    pytest.param(
        Case(
            sites=(
                up("zurich", free={"a100-80gb": 6}),
                up("tokyo", free={"a100-80gb": 6}),
                up("amsterdam", free={"a100-80gb": 2}),
            ),
            job=job(count=2),
            winner="tokyo",
            reasons={},
        ),
        id="a tie in free GPUs goes to the first site by name whatever order the sites are given in",
    ),
    pytest.param(
        Case(
            sites=(
                up("berlin", free={"a100-80gb": 0}, shared={"a100-80gb": 600}),
                up("tokyo", free={"a100-80gb": 0}, shared={"a100-80gb": 300}),
            ),
            job=job(milli=500),
            winner="berlin",
            reasons={
                "tokyo": [
                    "gpus-do-not-fit: job needs 500/1000 of one GPUs of any model; 0 whole GPUs free and the "
                    "largest shared GPU has 300/1000 free"
                ]
            },
            model="a100-80gb",
        ),
        id="a fractional job fits on a shared GPU with enough room when no whole GPU is free",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", free={"a100-80gb": 0}, shared={"a100-80gb": 400}),),
            job=job(milli=500, model="a100-80gb"),
            winner=None,
            reasons={
                "berlin": [
                    "gpus-do-not-fit: job needs 500/1000 of one a100-80gb; 0 whole GPUs free and the largest "
                    "shared GPU has 400/1000 free"
                ]
            },
        ),
        id="a fractional job does not fit when the share is too small and no whole GPU is free",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", free={"a100-80gb": 1}, shared={"a100-80gb": 100}),),
            job=job(milli=500),
            winner="berlin",
            reasons={},
        ),
        id="a fractional job takes a whole free GPU when no shared GPU has room",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", gpus={"h100-80gb": 8, "t4": 8, "a100-40gb": 8}),),
            job=job(count=4, memory_gib=12),
            winner="berlin",
            reasons={},
            model="t4",
        ),
        id="a job naming no model gets the smallest GPUs that fit",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", gpus={"h100-80gb": 8, "l4": 8, "a100-40gb": 8}),),
            job=job(count=4, memory_gib=30),
            winner="berlin",
            reasons={},
            model="a100-40gb",
        ),
        id="a job naming no model gets the smallest GPUs with enough memory",
    ),
    pytest.param(
        Case(
            sites=(up("berlin", free={"t4": 2}, gpus={"h100-80gb": 8, "t4": 8}),),
            job=job(count=4),
            winner="berlin",
            reasons={},
            model="h100-80gb",
        ),
        id="a job naming no model skips the smallest GPUs when too few of them are free",
    ),
    pytest.param(
        Case(
            sites=(
                down("berlin", region="gcp:europe-west3", gpus={"t4": 8}),
                up("tokyo", region="gcp:asia-northeast1", free={"a100-80gb": 0}),
            ),
            job=job(count=2, denied_regions=["gcp:europe-west3"], memory_gib=40),
            winner=None,
            reasons={
                "berlin": [
                    "site-unhealthy: site is not healthy (unreachable, or its last report is too old)",
                    "region-not-allowed: region gcp:europe-west3 is denied by the job",
                    "gpus-do-not-fit: GPUs of any model here have 16 GiB per GPU; the job needs 40 GiB",
                ],
                "tokyo": ["gpus-do-not-fit: job needs 2 GPUs of any model; 0 free"],
            },
        ),
        id="a site that fails several filters lists every reason, not only the first",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_which_site_wins_and_why(case: Case) -> None:
    out = decide(case.sites, case.job, case.excluded)
    assert out.site == case.winner
    assert out.reasons() == case.reasons
    if case.model is not None:
        assert out.model == case.model
    if case.winner is None:
        assert out.decision.outcome == "unplaceable"
        assert out.decision.summary.startswith("no site can take the job now")
    else:
        assert out.decision.outcome == "placed"
        assert out.decision.summary.startswith(f"placed on {case.winner} ({out.model}, ")


def test_an_unplaceable_summary_counts_the_sites_each_filter_rejected() -> None:
    sites = (down("amsterdam"), up("berlin", free={"a100-80gb": 1}), up("tokyo", free={"a100-80gb": 0}))
    out = decide(sites, job(count=2))
    assert out.decision.summary == (
        "no site can take the job now (2 gpus-do-not-fit, 1 site-unhealthy); it stays queued and is decided again"
    )


def test_with_no_sites_the_summary_says_none_is_registered() -> None:
    out = decide((), job())
    assert (out.decision.outcome, out.decision.summary, out.decision.sites) == (
        "unplaceable", "no site is registered", []
    )


# --- assume: decisions within one cycle see each other ------------------------------------------------


def test_assume_makes_the_second_of_two_full_site_jobs_go_elsewhere() -> None:
    snap = snapshot(up("berlin"), up("tokyo"))
    pipeline, spec = default_pipeline(), job(count=8)
    placed = []
    for n in range(3):
        req = JobRequest.from_spec(f"job-{n}", spec)
        p = pipeline.decide(req, snap)
        placed.append(snap.sites[p.site] if p.placed else None)
        if p.placed:
            snap.assume(p.site, req, p.model)
    assert placed == ["berlin", "tokyo", None]
    assert snap.free_gpus[:, MODEL_INDEX["a100-80gb"]].tolist() == [0, 0]


@pytest.mark.parametrize(
    ("milli", "free_after", "shared_after"),
    [
        pytest.param([300], 1, 700, id="one share opens a whole GPU and leaves the rest of it shared"),
        pytest.param([400, 400], 1, 200, id="a second small share goes onto the GPU the first one opened"),
        pytest.param([600, 600], 0, 400, id="a second share too big for the opened GPU opens another"),
        pytest.param([1000], 1, 0, id="a whole-GPU job takes a free GPU and leaves the shares alone"),
    ],
)
def test_assume_debits_fractional_jobs_from_shared_gpus_first(
    milli: list[int], free_after: int, shared_after: int
) -> None:
    snap = snapshot(up("berlin", free={"a100-80gb": 2}))
    col = MODEL_INDEX["a100-80gb"]
    for m in milli:
        snap.assume(0, JobRequest.from_spec("j", job(milli=m)), col)
    assert (int(snap.free_gpus[0, col]), int(snap.shared_free_milli[0, col])) == (free_after, shared_after)


def test_after_assume_a_fractional_job_that_fits_no_share_is_unplaceable() -> None:
    snap = snapshot(up("berlin", free={"a100-80gb": 1}))
    pipeline = default_pipeline()
    first = JobRequest.from_spec("j1", job(milli=600))
    p = pipeline.decide(first, snap)
    snap.assume(p.site, first, p.model)
    assert decide((), job(milli=600), snap=snap).decision.outcome == "unplaceable"
    assert decide((), job(milli=400), snap=snap).site == "berlin"


# --- building a pipeline ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filters", "scorers", "message"),
    [
        pytest.param(
            (HealthyFilter(), GpuFitFilter(), HealthyFilter()), (), "a filter is listed twice",
            id="a filter listed twice is refused",
        ),
        pytest.param(
            (HealthyFilter(),), (Weighted(FreeGpusScorer(), 1.0), Weighted(FreeGpusScorer(), 2.0)),
            "a scorer is listed twice", id="a scorer listed twice is refused",
        ),
        pytest.param(
            (HealthyFilter(),), (Weighted(FreeGpusScorer(), -0.5),),
            "scorer free_gpus: weight must be a finite number >= 0, got -0.5", id="a negative weight is refused",
        ),
        pytest.param(
            (HealthyFilter(),), (Weighted(FreeGpusScorer(), float("nan")),),
            "weight must be a finite number", id="a NaN weight is refused",
        ),
        pytest.param(
            (HealthyFilter(),), (Weighted(FreeGpusScorer(), float("inf")),),
            "weight must be a finite number", id="an infinite weight is refused",
        ),
    ],
)
def test_a_pipeline_that_cannot_work_is_refused(filters: tuple, scorers: tuple, message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        Pipeline(filters=filters, scorers=scorers)


def test_a_scorer_with_weight_zero_is_turned_off_and_ties_go_to_the_first_site_by_name() -> None:
    pipeline = Pipeline(filters=default_pipeline().filters, scorers=(Weighted(FreeGpusScorer(), 0.0),))
    out = decide((up("berlin", free={"a100-80gb": 1}), up("tokyo")), job(), pipeline=pipeline)
    assert out.site == "berlin"
    assert all(v.terms == [] for v in out.decision.sites)


# --- explanations -------------------------------------------------------------------------------------


def three_sites() -> tuple[Site, ...]:
    return (
        up("amsterdam", free={"a100-80gb": 2}),
        down("berlin"),
        up("tokyo", free={"a100-80gb": 8}),
        up("zurich", free={"a100-80gb": 5}),
    )


def test_a_decision_explains_every_site_with_score_terms_or_reasons() -> None:
    pipeline = Pipeline(
        filters=(HealthyFilter(), RegionFilter(), RefusedFilter(), GpuFitFilter()),
        scorers=(Weighted(FreeGpusScorer(), 2.0),),
    )
    out = decide(three_sites(), job(), pipeline=pipeline)
    d = out.decision
    assert [v.site for v in d.sites] == ["amsterdam", "berlin", "tokyo", "zurich"]
    assert (d.outcome, d.site, d.job_id, d.attempt, d.decided_at) == ("placed", "tokyo", "job-1", 1, NOW)
    assert d.summary == "placed on tokyo (a100-80gb, score 2.000): best of 3 feasible of 4 sites"

    by_site = {v.site: v for v in d.sites}
    # A rejected site still shows each term's raw value; it was not ranked, so nothing normalised or weighted.
    assert not by_site["berlin"].feasible
    assert [(t.scorer, t.raw, t.normalised, t.weight, t.weighted) for t in by_site["berlin"].terms] == [
        ("free_gpus", 8.0, None, 2.0, None)]
    assert by_site["berlin"].score is None
    terms = {name: [(t.scorer, t.raw, t.normalised, t.weight, t.weighted) for t in by_site[name].terms]
             for name in ("amsterdam", "tokyo", "zurich")}
    assert terms == {
        "amsterdam": [("free_gpus", 2.0, 0.0, 2.0, 0.0)],
        "tokyo": [("free_gpus", 8.0, 1.0, 2.0, 2.0)],
        "zurich": [("free_gpus", 5.0, 0.5, 2.0, 1.0)],
    }
    assert [by_site[n].score for n in ("amsterdam", "tokyo", "zurich")] == [0.0, 2.0, 1.0]
    assert all(v.reasons == [] for v in d.sites if v.feasible)


def test_a_record_names_each_sites_region_where_it_cannot_index_them() -> None:
    """A record keeps each site's index among the distinct regions (version 3), or, where the snapshot has no
    such index (more distinct regions than two bytes count), the region of each site by name; both explain
    the same, region reasons included."""
    sites = (*three_sites(), up("osaka", region="gcp:asia-northeast2", free={"a100-80gb": 8}))
    spec = job(count=6, allowed_regions=["gcp:us-east1"])
    indexed = decide(sites, spec)
    snap = snapshot(*sites)
    many = (*snap.region_names, *(f"gcp:elsewhere-{i}" for i in range(0x10000)))  # (sites' indices unchanged)
    by_name = decide(sites, spec, snap=replace(snap, region_names=many))
    assert "region_code" in indexed.record and "regions" not in indexed.record
    assert "regions" in by_name.record and "region_code" not in by_name.record
    assert by_name.decision == indexed.decision
    assert by_name.reasons()["osaka"] == ["region-not-allowed: region gcp:asia-northeast2 is not among the job's "
                                          "allowed regions (gcp:us-east1)"]


def test_a_record_survives_json_and_explains_the_same_decision_later() -> None:
    out = decide(three_sites(), job(count=6))
    text = json.dumps(out.record)
    req = JobRequest.from_spec("job-1", job(count=6))
    filters = {f.code: f for f in default_pipeline().filters}
    later = explain.render(json.loads(text), req, filters, attempt=1)
    assert later == out.decision
    assert later.site == "tokyo"
    assert {v.site: v.reasons for v in later.sites if not v.feasible} == {
        "amsterdam": ["gpus-do-not-fit: job needs 6 GPUs of any model; 2 free"],
        "berlin": ["site-unhealthy: site is not healthy (unreachable, or its last report is too old)"],
        "zurich": ["gpus-do-not-fit: job needs 6 GPUs of any model; 5 free"],
    }


def test_an_unplaceable_record_is_json_and_names_no_site() -> None:
    out = decide(three_sites(), job(count=9))
    rec = json.loads(json.dumps(out.record))
    assert (rec["site"], rec["model"]) == (None, None)
    assert out.decision.outcome == "unplaceable"
    assert all(v.reasons and v.score is None and not v.feasible for v in out.decision.sites)


def test_a_deferred_decision_says_until_when() -> None:
    out = decide(three_sites(), job(count=9))
    until = NOW + timedelta(hours=3)
    req = JobRequest.from_spec("job-1", job(count=9))
    d = explain.render(out.record, req, {f.code: f for f in default_pipeline().filters}, 2, deferred_until=until)
    assert (d.outcome, d.deferred_until, d.attempt) == ("deferred", until, 2)
    assert d.summary == f"deferred until {until.isoformat()}"


# --- property: a placement always honours every filter ------------------------------------------------

MODELS = ("t4", "l4", "a100-40gb", "a100-80gb", "h100-80gb")
REGIONS = ("gcp:us-east1", "gcp:europe-west3", "aws:eu-west-1")
NAMES = ("amsterdam", "berlin", "lima", "osaka", "tokyo")


@st.composite
def federations(draw: st.DrawFn) -> list[Site]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=len(NAMES), unique=True))
    sites = []
    for name in names:
        models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True))
        totals = {m: draw(st.sampled_from([4, 8, 16])) for m in models}
        spec = site(name, region=draw(st.sampled_from(REGIONS)), gpus=totals)
        if draw(st.integers(0, 5)) == 0:  # not heard from
            sites.append((spec, None))
            continue
        free = {m: draw(st.integers(0, t)) for m, t in totals.items()}
        shared = {m: draw(st.integers(0, 1000)) for m in models}
        sites.append((spec, site_state(spec, free=free, shared=shared, healthy=draw(st.integers(0, 3)) > 0)))
    return sites


@st.composite
def jobs(draw: st.DrawFn) -> JobSpec:
    milli = draw(st.one_of(st.just(1000), st.integers(1, 999)))
    regions = draw(st.lists(st.sampled_from(REGIONS), max_size=2, unique=True))
    split = draw(st.integers(0, len(regions)))
    return job(
        count=1 if milli < 1000 else draw(st.integers(1, 12)),
        milli=milli,
        model=draw(st.one_of(st.none(), st.sampled_from(MODELS))),
        memory_gib=draw(st.one_of(st.none(), st.sampled_from([8, 16, 24, 40, 48, 80]))),
        allowed_regions=regions[:split],
        denied_regions=regions[split:],
    )


@settings(max_examples=200, deadline=None)
@given(federations(), jobs(), st.sets(st.sampled_from(NAMES), max_size=2))
def test_a_placed_job_passes_every_filter_and_an_unplaceable_one_fails_one_everywhere(
    sites: list[Site], spec: JobSpec, refused: set[str]
) -> None:
    snap = snapshot(*sites)
    req = JobRequest.from_spec("job-1", spec, frozenset(refused))
    p = default_pipeline().decide(req, snap)
    if not p.placed:
        assert np.all(p.failures != 0)
        return
    i, m = p.site, p.model
    name, site_region = snap.sites[i], snap.regions[i]
    assert p.failures[i] == 0
    assert snap.healthy[i]
    assert name not in refused
    assert not spec.allowed_regions or site_region in spec.allowed_regions
    assert site_region not in spec.denied_regions
    assert spec.gpus.model is None or ids.GPU_MODEL_IDS[m] == spec.gpus.model
    assert snap.memory_gib[i, m] >= (spec.gpus.memory_gib or 0) and snap.total_gpus[i, m] > 0
    if spec.gpus.milli < 1000:
        assert snap.free_gpus[i, m] >= 1 or snap.shared_free_milli[i, m] >= spec.gpus.milli
    else:
        assert snap.free_gpus[i, m] >= spec.gpus.count
    best = p.totals[list(p.feasible).index(i)]
    assert best >= p.totals.max() - 1e-9  # no feasible site scored higher


@pytest.mark.parametrize("name", sorted(__import__("policies.baselines", fromlist=["POLICIES"]).POLICIES))
def test_every_named_policy_keeps_a_job_within_its_latency_objective(name: str) -> None:
    """The objective is the job's hard constraint: no policy, baseline or the live default, sends the job to a
    site farther than it allows, even when that site is the emptiest, cheapest and cleanest."""
    from policies.baselines import policy

    far = up("far", gpus={"a100-80gb": 64}, region="gcp:europe-west1", grid_zone="SE",
             usd_per_gpu_hour={"a100-80gb": 0.5}, rtt_ms={"gcp:us-east1": 95.0})
    near = up("near", gpus={"a100-80gb": 8}, free={"a100-80gb": 4}, usd_per_gpu_hour={"a100-80gb": 9.0},
              rtt_ms={"gcp:us-east1": 2.0})
    spec = job(count=2, latency_slo_ms=30, origin_region="gcp:us-east1")
    out = decide([far, near], spec, pipeline=policy(name))
    assert out.site == "near"
    assert any("latency objective of 30 ms" in r for r in out.reasons()["far"])


def test_a_decisions_terms_read_pickle_and_compare_as_the_plain_tuple_of_them() -> None:
    """The score terms are made when first read (``Terms``): what a reader sees is each scorer's term in
    scorer order, the same every time it reads them, and a copy sent to another process is the plain tuple."""
    import pickle

    from policies.pipeline import TermArrays, Terms
    from policies.scorers.latency import LatencyScorer

    pipeline = Pipeline(filters=(HealthyFilter(), GpuFitFilter()),
                        scorers=(Weighted(FreeGpusScorer(), 2.0), Weighted(LatencyScorer(), 1.0)))
    out = decide(three_sites(), job(), pipeline=pipeline)
    terms = out.placement.terms
    assert isinstance(terms, Terms) and len(terms) == 2
    first = list(terms)
    assert [(t.scorer, t.weight) for t in first] == [("free_gpus", 2.0), ("latency", 1.0)]
    assert all(isinstance(t, TermArrays) for t in first) and terms[0] is first[0] and terms[-1] is first[1]
    assert terms[0].normalised.shape == out.placement.feasible.shape
    assert np.array_equal(terms[0].raw[out.placement.feasible] > 2.0, terms[0].normalised > 0.0)  # free GPUs
    copy = pickle.loads(pickle.dumps(terms))
    assert type(copy) is tuple and [t.scorer for t in copy] == ["free_gpus", "latency"]
    assert all(np.array_equal(a.normalised, b.normalised) and np.array_equal(a.raw, b.raw)
               for a, b in zip(copy, first, strict=True))
    assert terms == tuple(first) and terms != tuple(first[:1])


@pytest.mark.parametrize("ceiling,where", [(None, "berlin"), (10, "berlin"), (0, None), (-5, None)])
def test_preemptible_work_counts_as_room_only_below_the_priority_a_site_lets_the_tenant_have(ceiling, where) -> None:
    # berlin's A100s are all held by preemptible work of priority 0. A job of priority 10 may have them
    # preempted, unless berlin caps its tenant's priority (priority_ceiling) at 0 or below: the site's own
    # search then preempts nothing for it, and would refuse it.
    from policies.snapshot import QuotaView

    berlin = up("berlin", free={"a100-80gb": 0})
    snap = snapshot(berlin)
    below = np.zeros((snap.n_sites, 2))
    below[snap.index["berlin"], 1] = 8.0
    inf = np.full(snap.n_sites, np.inf)
    caps = {} if ceiling is None else {"t1": np.full(snap.n_sites, float(ceiling))}
    quota = QuotaView({}, {}, {}, {}, inf, inf.copy(), ceiling=caps)
    snap = replace(snap, preempt_levels=(0,), preempt_below=below, quota=quota)
    out = decide([berlin], job(model="a100-80gb", priority=10), snap=snap)
    assert out.site == where
    # Another tenant, whose priority berlin does not cap, still has them preempted.
    assert decide([berlin], job(tenant="t2", model="a100-80gb", priority=10), snap=snap).site == "berlin"


@pytest.mark.parametrize("count,milli", [(1, 1000), (1, 250)], ids=["whole", "fractional"])
def test_preemptible_work_of_another_model_is_no_room_for_a_job_naming_its_model(count: int, milli: int) -> None:
    # berlin's A100s are all held by preemptible work of lower priority, which counts as room for an urgent
    # job (the site would preempt it); but not for a job asking for T4s, which berlin does not have.
    berlin, tokyo = up("berlin", free={"a100-80gb": 0}), up("tokyo", gpus={"t4": 8}, free={"t4": 0})
    snap = snapshot(berlin, tokyo)
    below = np.zeros((snap.n_sites, 2))
    below[snap.index["berlin"], 1] = 8.0
    snap = replace(snap, preempt_levels=(0,), preempt_below=below)
    out = decide([berlin, tokyo], job(count=count, milli=milli, model="t4", priority=10), snap=snap)
    assert out.site is None
    assert out.reasons()["berlin"] == ["gpus-do-not-fit: site has no t4"]
    # An A100 job of that priority still goes where it can preempt.
    assert decide([berlin, tokyo], job(count=count, milli=milli, model="a100-80gb", priority=10), snap=snap).site == "berlin"
