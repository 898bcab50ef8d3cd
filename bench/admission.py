"""Site-local admission of one job: the decision every adapter makes before it accepts a job.

What runs (``policies.admission.SiteAdmission``: the GPU inventory and the quota book together):

1. A site of ``--gpus`` GPUs (nodes of 8 A100-80GB) and ``--tenants`` tenants, each guaranteed an equal part
   of ``--guaranteed`` (default 80%) of the site, with burst up to the whole site, fair share ``time``.
2. The site is filled with running jobs (``--job-gpus``: 1, 2, 4 or 8 GPUs, seeded; 1,000 GPUs hold about 270
   of them, or 1,000 with ``--job-gpus 1``), half
   of the tenants borrowing beyond their guarantee with preemptible work, started over the past day so the
   decayed usage and the minimum run time matter. Usage is re-weighted once before timing starts.
3. Timed, each on fresh asks (distinct job ids, so nothing is cached between them), on the full site:
   - ``fits``: a job that fits (a GPU is freed first, so the search is not needed);
   - ``reclaim``: a tenant under its guarantee asks for 1 to 8 GPUs; borrowers are preempted (the victim
     search: candidates in order, shortest prefix by bisection, the inventory asked as if they were gone);
   - ``priority``: a high-priority job of a tenant at its guarantee preempts lower-priority borrowers;
   - ``refused``: a tenant over its guarantee asks at priority 0: every candidate is examined and none helps.
   Each figure is the median and 99th percentile of ``--repeat`` single admissions (``time.perf_counter_ns``
   around ``admit``, which changes nothing, so every repeat sees the same full site).

Prints figures; asserts nothing. Usage::

    .venv/bin/python bench/admission.py [--gpus 1000] [--tenants 100] [--repeat 2000] [--seed 1] [--job-gpus 1,2,4,8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from broker.models import FairSharePolicy, GpuRequest, JobSpec, NodeGroup, SiteSpec, TenantQuota
from policies.admission import Admitted, SiteAdmission


def build(gpus: int, tenants: int, guaranteed: float, seed: int,
          sizes: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[SiteAdmission, list[str], float]:
    rng = random.Random(seed)
    names = [f"t{i:03d}" for i in range(tenants)]
    share = int(gpus * guaranteed / tenants)
    spec = SiteSpec(
        name="bench", region="gcp:us-east4", grid_zone="US-MIDA-PJM", timezone="America/New_York",
        latitude=39.0, longitude=-77.5, gpus=[NodeGroup(model="a100-80gb", gpus_per_node=8, nodes=gpus // 8)],
        quotas=[TenantQuota(tenant=t, guaranteed_gpus=share, burst_gpus=gpus) for t in names],
        fair_share=FairSharePolicy(mode="time", min_run_s=600),
    )
    site = SiteAdmission(spec)
    now = 1_700_000_000.0
    t = now - 86_400
    n = 0
    # Tenants in the first half hold their guarantee and borrow; the others hold part of theirs.
    while True:
        tenant = names[n % (tenants // 2)] if n % 3 else names[tenants // 2 + n % (tenants // 2)]
        count = rng.choice(sizes)
        job = JobSpec(tenant=tenant, name=f"run-{n}", gpus=GpuRequest(count=count, model="a100-80gb"),
                      duration_s=3600, preemptible=True, checkpointable=True, priority=rng.randint(-5, 5))
        t += rng.random() * 2 * 86_400 / (gpus / statistics.mean(sizes))  # about a day (time only moves forward)
        verdict = site.admit(f"run-{n}", job, t)
        if not isinstance(verdict, Admitted) or verdict.victims:
            if sum(f.free_gpus for f in site.inventory.free().values()) == 0:
                break
            n += 1
            continue
        site.start(f"run-{n}", verdict, t)
        n += 1
    now = max(now, t)
    site.report(now)  # the hourly re-weight, outside the timed section
    return site, names, now


def time_asks(site: SiteAdmission, make, now: float, repeat: int) -> tuple[float, float, dict[str, int]]:
    samples = []
    outcomes = {"admitted": 0, "with victims": 0, "refused": 0}
    for i in range(repeat):
        job_id, spec = make(i)
        t0 = time.perf_counter_ns()
        verdict = site.admit(job_id, spec, now)
        samples.append((time.perf_counter_ns() - t0) / 1000)
        if isinstance(verdict, Admitted):
            outcomes["with victims" if verdict.victims else "admitted"] += 1
        else:
            outcomes["refused"] += 1
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))], outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--guaranteed", type=float, default=0.8, help="share of the site guaranteed in all")
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--job-gpus", default="1,2,4,8", help="sizes of the running jobs, in GPUs (default %(default)s)")
    args = ap.parse_args()
    sizes = tuple(int(x) for x in args.job_gpus.split(","))
    t0 = time.perf_counter()
    site, names, now = build(args.gpus // 8 * 8, args.tenants, args.guaranteed, args.seed, sizes)
    report = {t.tenant: t for t in site.report(now).tenants}
    running = sum(1 for _ in site.inventory._jobs)
    print(f"site: {args.gpus // 8 * 8} GPUs, {args.tenants} tenants, {running} running jobs, "
          f"{sum(t.borrowed_gpus for t in report.values()):g} GPUs borrowed; built in {time.perf_counter() - t0:.2f} s")
    rng = random.Random(args.seed + 1)
    room = {t: int(s.guaranteed_gpus - s.in_use_gpus) for t, s in report.items() if s.in_use_gpus < s.guaranteed_gpus}
    under = sorted(room)
    over = [t for t, s in report.items() if s.borrowed_gpus > 0]
    if not under or not over:
        raise SystemExit("the fill left no tenant under its guarantee or none borrowing; try another --seed")

    def within(tenant: str) -> int:
        return max(c for c in (1, 2, 4, 8) if c <= room[tenant])

    def spec(tenant: str, count: int, i: int, kind: str, **more) -> tuple[str, JobSpec]:
        return f"{kind}-{i}", JobSpec(tenant=tenant, name=f"{kind}-{i}", gpus=GpuRequest(count=count, model="a100-80gb"),
                                      duration_s=3600, **more)

    cases = {
        "reclaim": lambda i: spec(t := rng.choice(under), within(t), i, "reclaim"),
        "priority": lambda i: spec(rng.choice(over), rng.choice((1, 2, 4)), i, "priority", priority=100,
                                   preemptible=True),
        "refused": lambda i: spec(rng.choice(over), 8, i, "refused", preemptible=True, priority=-10),
    }
    print(f"{'case':10} {'median µs':>10} {'p99 µs':>8}  outcomes")
    for name, make in cases.items():
        median, p99, outcomes = time_asks(site, make, now, args.repeat)
        print(f"{name:10} {median:10.1f} {p99:8.1f}  {outcomes}")
    # a job that fits: free one GPU first
    victim = next(iter(site.inventory._jobs))
    site.stop(victim, now)
    median, p99, outcomes = time_asks(site, lambda i: spec(rng.choice(under), 1, i, "fits"), now, args.repeat)
    print(f"{'fits':10} {median:10.1f} {p99:8.1f}  {outcomes}")


if __name__ == "__main__":
    main()
