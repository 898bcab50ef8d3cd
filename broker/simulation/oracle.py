"""The whole-job oracle: a schedule that knows the future, to set beside the offline bound.

What it is
    A schedule of the workload in which every job runs whole, once, at one site, for its true run time, at
    the start and site chosen knowing what no policy knows: every job's true run time, every site's true
    carbon intensity in every future hour and, with ``shadow_kg_per_gpu_hour`` (the offline LP's price of
    each site-hour's capacity, :mod:`broker.simulation.bound`), how much the jobs still to come will want
    each site-hour. It is not a bound, and not a policy: it reads the future, and it is a greedy packing,
    so a better offline schedule may exist and a policy may even beat it. It shows roughly what foresight
    buys a whole-job schedule; the fluid offline bound, below it, also lets work split over hours and
    sites, and the distance between the two is at most what running jobs whole costs.

How it packs
    Time is cut into slots of ``slot_s`` seconds (300). A job starts at its submit time or on a later slot
    boundary and holds its GPUs in every slot its run touches, so no (site, GPU model) pool ever holds more
    GPUs than it has at any instant. Jobs are packed one after the other, those allowed the fewest sites
    first (a latency objective ties a job to the sites near its origin), then in submit order; each takes,
    among the pools it may use (the sites ``allowed_sites`` lets it use, a model it can run on) and every
    start from its submit time to its latest start (deadline - true run time), the one with room for its
    whole run with the least carbon over the run (plus, with shadow prices, the price of the GPU-hours it
    takes); ties go to the earlier start, then the first pool (site by name, then model). A job with no
    room anywhere before its latest start takes the earliest start with room after it (a deadline miss,
    counted as any policy's is). A fractional job holds ``milli / 1000`` of a GPU: the shares in a pool add
    up to at most its GPUs, but a share is not tied to one physical GPU as the replay ties it, so with
    fractional jobs the packing may be a little tighter than a real schedule.

Accounting is the replay's own (:func:`broker.simulation.engine.replay`'s): carbon, energy and cost over
each job's actual run window, so every metric of a policy run is computed for the oracle the same way.
Memory: the GPUs taken per pool and slot (8 bytes each) as far as the jobs' windows reach.

Nothing here reads a clock (other than to time the packing), a file or the network.
"""

from __future__ import annotations

import time
from typing import NoReturn

import numpy as np
from scipy.ndimage import maximum_filter1d

from broker.simulation.engine import Federation, SimulationError, _account, hourly_integral
from broker.simulation.results import PolicyRun
from broker.simulation.workload import Workload
from policies.snapshot import MODEL_INDEX, TDP_KW

NAME = "whole-job oracle"
SLOT_S = 300.0


def whole_job_oracle(
    workload: Workload,
    federation: Federation,
    allowed_sites: np.ndarray,
    left_out: np.ndarray,
    *,
    shadow_kg_per_gpu_hour: np.ndarray | None = None,
    slot_s: float = SLOT_S,
    submit_order: bool = False,
    max_wait_s: float | None = None,
) -> PolicyRun:
    """Pack every job not ``left_out`` (bool[jobs]) at the sites ``allowed_sites`` (bool[jobs, sites], site
    order as ``federation.specs``) lets it use; module docstring for the rule. ``shadow_kg_per_gpu_hour``:
    float64[sites, hours of carbon data] from the carbon LP (None: carbon alone decides). Two ablations, to
    see where its lead over a policy comes from (``bench/oracle_ablation.py``): ``submit_order`` packs every
    job in submit order (not those allowed the fewest sites first: no job is placed ahead of one submitted
    before it, as a broker deciding each job as it arrives would place it); ``max_wait_s`` lets no job start
    later than that after its submission (a policy's deferral horizon), unless no start before has room.
    Returns the schedule as a :class:`PolicyRun` named :data:`NAME`. Raises :class:`SimulationError` when a job cannot
    end before the carbon data does."""
    t_wall = time.perf_counter()
    n = len(workload.submit_s)
    n_sites = len(federation.specs)
    if allowed_sites.shape != (n, n_sites) or left_out.shape != (n,):
        raise SimulationError(f"allowed_sites must be bool[{n}, {n_sites}] and left_out bool[{n}], got "
                              f"{allowed_sites.shape} and {left_out.shape}")
    if shadow_kg_per_gpu_hour is not None and shadow_kg_per_gpu_hour.shape != (n_sites, federation.hours):
        raise SimulationError(f"shadow_kg_per_gpu_hour must be float[{n_sites}, {federation.hours}] (sites, hours "
                              f"of carbon data), got {shadow_kg_per_gpu_hour.shape}")
    if not slot_s > 0:
        raise SimulationError(f"slot_s must be above 0, got {slot_s}")
    if max_wait_s is not None and not max_wait_s >= 0:
        raise SimulationError(f"max_wait_s must be 0 or more, got {max_wait_s}")
    data_slots = int(np.floor(federation.hours * 3600.0 / slot_s))

    # Pools: (site, model) pairs with GPUs, in site order then model order. Capacity in milli-GPUs.
    pool_site, pool_model = np.nonzero(federation.base.total_gpus > 0)
    capacity = (federation.base.total_gpus[pool_site, pool_model].astype(np.int64) * 1000)
    held = workload.held
    need = np.ceil(held * 1000.0 - 1e-9).astype(np.int64)
    job_model = np.array([-1 if m is None else MODEL_INDEX[m] for m in workload.model], dtype=np.int64)
    allowed_pools = (allowed_sites[:, pool_site]
                     & ((job_model[:, None] < 0) | (job_model[:, None] == pool_model[None, :]))
                     & (need[:, None] <= capacity[None, :]))
    sites_allowed = np.zeros(n, dtype=np.int64)
    for s in range(n_sites):
        sites_allowed += allowed_pools[:, pool_site == s].any(axis=1)

    price = None
    if shadow_kg_per_gpu_hour is not None:
        hourly_price = np.asarray(shadow_kg_per_gpu_hour, dtype=np.float64)
        price = (hourly_price, np.hstack([np.zeros((n_sites, 1)), np.cumsum(hourly_price, axis=1)]))

    submit, duration, deadline = workload.submit_s, workload.true_duration_s, workload.deadline_s
    first = np.floor(submit / slot_s).astype(np.int64)
    # Slots a run holds: starting at its submit time (maybe mid-slot), or on a later slot boundary.
    at_submit = np.maximum(np.ceil((submit + duration) / slot_s).astype(np.int64) - first, 1)
    on_boundary = np.maximum(np.ceil(duration / slot_s).astype(np.int64), 1)
    latest = np.maximum(np.floor((deadline - duration) / slot_s).astype(np.int64), first)
    if max_wait_s is not None:
        latest = np.minimum(latest, first + int(max_wait_s // slot_s))
    # GPUs taken per pool and slot, as far as any window reaches (grown when a late job needs more)
    reach = int((latest + at_submit)[~left_out].max(initial=1))
    occupied = np.zeros((len(pool_site), min(reach, data_slots)), dtype=np.int64)

    todo = np.flatnonzero(~left_out)
    if submit_order:
        order = todo[np.lexsort((np.arange(len(todo)), submit[todo]))]
    else:
        order = todo[np.lexsort((np.arange(len(todo)), submit[todo], sites_allowed[todo]))]
    site = np.full(n, -1, dtype=np.int64)
    model = np.zeros(n, dtype=np.int64)
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    for j in order:
        pools = np.flatnonzero(allowed_pools[j])
        if pools.size == 0:
            raise SimulationError(f"job {j}: no site it may use has {held[j]:g} GPUs of a model it can use")
        a, span0, span = int(first[j]), int(at_submit[j]), int(on_boundary[j])
        if a + span0 > data_slots:
            _past(j, float(submit[j] + duration[j]), federation, workload)
        b = min(int(latest[j]), occupied.shape[1] - span)  # >= a: the array reaches every window
        best: tuple[float, int, int] | None = None  # (value, start slot, pool)
        for p in pools:
            room = capacity[p] - need[j]
            t = _starts_with_room(occupied[p], a, b, span0, span, room)
            if t.size == 0:
                continue
            begin = np.maximum(t * slot_s, submit[j])
            s = int(pool_site[p])
            value = _value(federation, price, s, begin, begin + duration[j], TDP_KW[pool_model[p]], held[j])
            i = int(np.flatnonzero(value <= value.min() + _tie(value.min()))[0])  # the earliest of the least
            if best is None or value[i] < best[0] - _tie(best[0]) or (
                    value[i] <= best[0] + _tie(best[0]) and int(t[i]) < best[1]):
                best = (float(value[i]), int(t[i]), int(p))
        while best is None:  # no room in the window: the earliest start with room after it
            width = occupied.shape[1]
            for p in pools:
                t0 = _earliest_room(occupied[p], b + 1, span, capacity[p] - need[j], width)
                if t0 < width and (best is None or t0 < best[1]):
                    best = (np.inf, t0, int(p))
            if best is None:
                if width >= data_slots:
                    raise SimulationError(
                        f"{NAME}: found no room for job {j} before the carbon data ends ({federation.hours} h "
                        f"after the run's start, {workload.start.isoformat()}); choose an earlier --start, fewer "
                        "--days, or more years of carbon data")
                grown = min(data_slots, max(2 * width, width + 2 * span))
                occupied = np.hstack([occupied, np.zeros((occupied.shape[0], grown - width), dtype=np.int64)])
        _, slot, p = best
        held_for = span0 if slot == a else span
        occupied[p, slot:slot + held_for] += need[j]
        site[j], model[j] = pool_site[p], pool_model[p]
        start[j] = max(float(submit[j]), slot * slot_s)
        end[j] = start[j] + float(duration[j])
    return _account(NAME, workload, federation, site, model, np.nan_to_num(start), np.nan_to_num(end),
                    time.perf_counter() - t_wall)


def _starts_with_room(occupied: np.ndarray, a: int, b: int, span0: int, span: int, room: int) -> np.ndarray:
    """The start slots in ``a .. b`` from which the run has room (``occupied <= room`` in every slot it
    holds): ``span0`` slots from ``a`` (the start at submit), ``span`` from a later one."""
    ok_first = bool(occupied[a:a + span0].max() <= room)
    later = np.zeros(0, dtype=np.int64)
    if b > a:
        window = occupied[a + 1:b + span]
        peak = maximum_filter1d(window, size=span, origin=-(span // 2), mode="nearest") if span > 1 else window
        later = a + 1 + np.flatnonzero(peak[:b - a] <= room)
    return np.concatenate([[a], later]) if ok_first else later


def _value(federation: Federation, price: tuple[np.ndarray, np.ndarray] | None, site: int, begin: np.ndarray,
           finish: np.ndarray, kw_per_gpu: float, gpus: float) -> np.ndarray:
    """What a run over ``[begin, finish)`` (seconds, arrays) at ``site`` is charged: its carbon in kg, plus
    the price of the GPU-hours it takes when ``price`` (hourly prices and their running sums) is given."""
    value = kw_per_gpu * gpus * (federation.carbon_integral(site, finish)
                                 - federation.carbon_integral(site, begin)) / 1000.0
    if price is not None:
        value += gpus * (hourly_integral(*price, site, finish) - hourly_integral(*price, site, begin))
    return value


def _tie(value: float) -> float:
    """Values closer than this are equal (the same carbon summed in another order)."""
    return 1e-9 * abs(value) + 1e-15


def _earliest_room(occupied: np.ndarray, t: int, span: int, room: int, slots: int) -> int:
    """The first slot ``>= t`` from which ``span`` slots all have ``occupied <= room``; ``slots`` if none."""
    while t + span <= slots:
        over = np.flatnonzero(occupied[t:t + span] > room)
        if over.size == 0:
            return t
        t += int(over[-1]) + 1
    return slots


def _past(job: int, end_s: float, federation: Federation, workload: Workload) -> NoReturn:
    raise SimulationError(
        f"{NAME}: job {job} would end {end_s / 3600.0:.1f} h after the run's start ({workload.start.isoformat()}) "
        f"even if it started at once, past the {federation.hours} h of carbon data; choose an earlier --start, "
        "fewer --days, or more years of carbon data"
    )
