"""The demo's sample job stream: a steady, seeded mix of small training and inference jobs sent to the
broker over HTTP, exactly as a submitter would, with a one-line summary of the queue every few seconds."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Any

from broker.client import ApiClientError, Client
from broker.models import SiteSpec

log = logging.getLogger("heliotrope.demo")

TENANTS = ("vision", "nlp", "speech", "research")


def sample_job(rng: random.Random, models: list[str], n: int, seconds: tuple[float, float] = (10, 90)) -> dict[str, Any]:
    tenant = rng.choice(TENANTS)
    kind = rng.random()
    spec: dict[str, Any] = {"tenant": tenant, "name": f"{tenant}-{n:05d}",
                            "duration_s": round(rng.uniform(*seconds), 1)}
    if kind < 0.2:
        spec["gpus"] = {"count": 1, "milli": rng.choice((250, 500))}
        spec["name"] = f"{tenant}-infer-{n:05d}"
    elif kind < 0.5:
        spec["gpus"] = {"count": rng.choice((1, 2, 4, 8)), "model": rng.choice(models)}
    else:
        spec["gpus"] = {"count": rng.choice((1, 1, 2, 4))}
    spec["priority"] = rng.choice((0, 0, 0, 10, 50))
    spec["preemptible"] = rng.random() < 0.5
    return spec


async def feed(
    url: str, sites: list[SiteSpec], rate_per_s: float = 0.5, seed: int = 1, seconds: tuple[float, float] = (10, 90),
    token: str | None = None, ca_file: str | None = None,
) -> None:
    """Submit a sample job every ``1 / rate_per_s`` seconds and log the jobs' states every tenth; ``token``:
    the bearer token to submit with where the broker requires one."""
    rng = random.Random(seed)
    models = sorted({g.model for s in sites for g in s.gpus}) or ["a100-80gb"]
    interval = 1.0 / rate_per_s if rate_per_s > 0 else None
    n = 0
    async with Client(url, token=token, ca_file=ca_file) as client:
        while True:
            if interval is not None:
                n += 1
                try:
                    await client.request("POST", "/v1/jobs", sample_job(rng, models, n, seconds))
                except ApiClientError as e:
                    log.warning("sample job refused: %s", e)
            if n % 10 == 0 or interval is None:
                try:
                    jobs = await client.list_all("/v1/jobs", {"limit": "1000"}, limit=1000)
                    counts = Counter(j["state"] for j in jobs)
                    log.info("jobs: " + ", ".join(f"{counts[s]} {s}" for s in (
                        "queued", "dispatching", "admitted", "running", "succeeded", "failed", "cancelled") if counts[s]))
                except ApiClientError as e:
                    log.warning("cannot list jobs: %s", e)
            await asyncio.sleep(interval or 5.0)
