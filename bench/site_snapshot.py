"""How long a site's snapshot (capacity, telemetry, quota state) takes on the event loop, by site size.

Every broker cycle asks each local site for a snapshot, within ``collect_timeout_s`` (2 s); the simulated and
Kubernetes adapters build it on the event loop, so its cost is time the API and the heartbeats wait. Builds a
simulated site of N H100s (8 per node) at each size, runs a quarter of them busy with one-GPU jobs (so the
inventory holds work), and prints the mean over ``--repeat`` snapshots.

    .venv/bin/python bench/site_snapshot.py [--gpus 8000 64000 192000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime

from adapters.simulated import SimulatedSite
from broker.clock import ManualClock
from broker.models import GpuRequest, Job, JobSpec, SiteSpec

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def spec(gpus: int) -> SiteSpec:
    return SiteSpec.model_validate({
        "name": f"s{gpus}", "region": "gcp:europe-west2", "grid_zone": "GB", "timezone": "Europe/London",
        "latitude": 51.5, "longitude": -0.1, "gpus": [{"model": "h100-80gb", "gpus_per_node": 8,
                                                      "nodes": gpus // 8}]})


async def one(gpus: int, repeat: int) -> tuple[float, float]:
    site = SimulatedSite(spec(gpus), ManualClock(NOW))
    await site.start()
    busy = gpus // 4
    for i in range(busy):
        job = Job(id=f"j{i}", spec=JobSpec(tenant="t", name=f"j{i}", gpus=GpuRequest(count=1), duration_s=86400),
                  attempt=1, created_at=NOW, updated_at=NOW)
        site._admission.start(f"j{i}/1", site._admission.admit(f"j{i}/1", job.spec, NOW.timestamp()),
                              NOW.timestamp())
    began = time.perf_counter()
    for _ in range(repeat):
        state = await site.snapshot()
    took = (time.perf_counter() - began) / repeat
    await site.close()
    return took, state.telemetry.gpu_utilisation_pct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8_000, 64_000, 192_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for gpus in args.gpus:
        took, util = asyncio.run(one(gpus, args.repeat))
        print(f"{gpus:>8,} GPUs ({util:.0f} % busy): {took * 1000:8.2f} ms per snapshot")


if __name__ == "__main__":
    main()
