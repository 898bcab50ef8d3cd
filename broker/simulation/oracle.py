"""The whole-job oracle: a schedule that knows the future, to set beside the offline bound.

What it is
    A feasible schedule of the workload in which every job runs whole, once, at one site, for its true run
    time, at the start and site chosen knowing what no policy knows: every job's true run time, every
    site's true carbon intensity in every future hour and, with ``shadow_kg_per_gpu_hour`` (the offline
    LP's price of each site-hour's capacity, :mod:`broker.simulation.bound`), how much the jobs still to
    come will want each site-hour. It is not a bound: a better offline schedule may exist, and it is not a
    policy: it reads the future. Its carbon is an upper estimate of the best any whole-job schedule could
    do, as the fluid offline bound is a lower one; a policy's distance from it is what foresight would buy,
    and the bound's distance from it is what running jobs whole (no splitting over hours or sites) costs.

How it packs
    Time is cut into slots of ``slot_s`` seconds (300). A job starts at its submit time or on a later slot
    boundary and holds its GPUs in every slot its run touches (its run rounded out to whole slots), so no
    site ever holds more GPUs than it has at any instant. Jobs are packed one after the other, those allowed
    the fewest sites first (a latency objective ties a job to the sites near its origin), then in submit
    order; each takes, among the sites (and GPU models) it may use and every start from its submit time to
    its latest start (deadline - true run time, and no later than the carbon data allows), the one with
    room for its whole run with the least carbon over the run (plus, with shadow prices, the price of the
    GPU-hours it takes); ties go to the earlier start, then the first site by name. A job with no room
    anywhere before its latest start takes the earliest start with room after it (a deadline miss, counted
    as any policy's is). Fractional jobs hold ``milli / 1000`` of a GPU, packed fluidly within a site.

Accounting is the replay's own (:func:`broker.simulation.engine.replay`'s): carbon, energy and cost over
each job's actual run window, so every metric of a policy run is computed for the oracle the same way.

Nothing here reads a clock (other than to time the packing), a file or the network.
"""

from __future__ import annotations

import time
from typing import NoReturn

import numpy as np
from scipy.ndimage import maximum_filter1d

from broker.simulation.engine import Federation, SimulationError, _account
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
) -> PolicyRun:
    """Pack every job not ``left_out`` (bool[jobs]) at the sites ``allowed_sites`` (bool[jobs, sites], site
    order as ``federation.specs``) lets it use; module docstring for the rule. ``shadow_kg_per_gpu_hour``:
    float64[sites, hours] from the carbon LP (None: carbon alone decides). Returns the schedule as a
    :class:`PolicyRun` named :data:`NAME`. Raises :class:`SimulationError` when a job cannot end before
    the carbon data does."""
    t_wall = time.perf_counter()
    n = len(workload.submit_s)
    n_sites = len(federation.specs)
    if allowed_sites.shape != (n, n_sites) or left_out.shape != (n,):
        raise SimulationError(f"allowed_sites must be bool[{n}, {n_sites}] and left_out bool[{n}], got "
                              f"{allowed_sites.shape} and {left_out.shape}")
    if not slot_s > 0:
        raise SimulationError(f"slot_s must be above 0, got {slot_s}")
    per_hour = 3600.0 / slot_s
    data_slots = int(np.floor(federation.hours * 3600.0 / slot_s))

    # Pools: (site, model) pairs with GPUs, in site order then model order. Capacity in milli-GPUs.
    pool_site, pool_model = np.nonzero(federation.base.total_gpus > 0)
    capacity = (federation.base.total_gpus[pool_site, pool_model].astype(np.int64) * 1000)
    held = workload.gpus.astype(np.float64) * np.where(workload.milli < 1000, workload.milli / 1000.0, 1.0)
    need = np.ceil(held * 1000.0 - 1e-9).astype(np.int64)
    job_model = np.array([-1 if m is None else MODEL_INDEX[m] for m in workload.model], dtype=np.int64)
    allowed_pools = (allowed_sites[:, pool_site]
                     & ((job_model[:, None] < 0) | (job_model[:, None] == pool_model[None, :]))
                     & (need[:, None] <= capacity[None, :]))

    # Per site and slot: the intensity integral (g/kWh·h) and the shadow price integral (kg per GPU).
    hourly = federation.intensity
    site_cum = _slot_integral(hourly, data_slots, per_hour)
    price_cum = None if shadow_kg_per_gpu_hour is None else _slot_integral(
        _to_hours(shadow_kg_per_gpu_hour, federation.hours), data_slots, per_hour)
    submit, duration, deadline = workload.submit_s, workload.true_duration_s, workload.deadline_s
    first = np.floor(submit / slot_s).astype(np.int64)
    held_slots = np.ceil((submit + duration) / slot_s).astype(np.int64) - first  # from the submit slot on
    held_slots = np.maximum(held_slots, 1)
    latest = np.maximum(np.floor((deadline - duration) / slot_s).astype(np.int64), first)
    # GPUs taken per pool and slot, as far as any window reaches (grown when a late job needs more)
    reach = int((latest + held_slots)[~left_out].max(initial=1))
    occupied = np.zeros((len(pool_site), min(reach, data_slots)), dtype=np.int64)

    todo = np.flatnonzero(~left_out)
    order = todo[np.lexsort((np.arange(len(todo)), submit[todo], allowed_pools[todo].sum(axis=1)))]
    site = np.full(n, -1, dtype=np.int64)
    model = np.zeros(n, dtype=np.int64)
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    for j in order:
        pools = np.flatnonzero(allowed_pools[j])
        if pools.size == 0:
            raise SimulationError(f"job {j}: no site it may use has {held[j]:g} GPUs of a model it can use")
        span, a = int(held_slots[j]), int(first[j])
        b = min(int(latest[j]), occupied.shape[1] - span)
        if a + span > data_slots:
            _past(j, (a + span) * slot_s, federation, workload)
        power = TDP_KW[pool_model[pools]] * held[j]
        best_value, best_pool, best_slot = np.inf, -1, -1
        if b >= a:
            for p, kw in zip(pools, power):
                room = capacity[p] - need[j]
                window = occupied[p, a:b + span]
                peak = maximum_filter1d(window, size=span, origin=-(span // 2), mode="nearest")[:b - a + 1] \
                    if span > 1 else window
                fits = np.flatnonzero(peak <= room)
                if fits.size == 0:
                    continue
                t = a + fits
                s = pool_site[p]
                value = kw * (site_cum[s, t + span] - site_cum[s, t]) / 1000.0
                if price_cum is not None:
                    value = value + held[j] * (price_cum[s, t + span] - price_cum[s, t])
                i = int(np.argmin(value))
                if value[i] < best_value - 1e-12:
                    best_value, best_pool, best_slot = float(value[i]), int(p), int(t[i])
        while best_pool < 0:  # no room in the window: the earliest start with room after it
            width = occupied.shape[1]
            best_slot = width
            for p in pools:
                t = _earliest_room(occupied[p], max(b + 1, a), span, capacity[p] - need[j], width)
                if t < best_slot:
                    best_slot, best_pool = t, int(p)
            if best_pool < 0:
                if width >= data_slots:
                    _past(j, (max(b + 1, a) + span) * slot_s, federation, workload)
                grown = min(data_slots, max(2 * width, width + 2 * span))
                occupied = np.hstack([occupied, np.zeros((occupied.shape[0], grown - width), dtype=np.int64)])
        occupied[best_pool, best_slot:best_slot + span] += need[j]
        site[j], model[j] = pool_site[best_pool], pool_model[best_pool]
        start[j] = max(float(submit[j]), best_slot * slot_s)
        end[j] = start[j] + float(duration[j])
    return _account(NAME, workload, federation, site, model, np.nan_to_num(start), np.nan_to_num(end),
                    time.perf_counter() - t_wall)


def _slot_integral(hourly: np.ndarray, slots: int, per_hour: float) -> np.ndarray:
    """float64[rows, slots + 1]: the integral of each row's hourly values from 0 to each slot boundary, in
    value × hours (a slot inside one hour takes that hour's value; one that straddles two, pro rata)."""
    edges = np.arange(slots + 1) / per_hour  # hours
    cum_h = np.zeros((hourly.shape[0], hourly.shape[1] + 1))
    np.cumsum(hourly, axis=1, out=cum_h[:, 1:])
    h = np.minimum(np.floor(edges).astype(np.int64), hourly.shape[1] - 1)
    return cum_h[:, h] + (edges - h)[None, :] * hourly[:, h]


def _to_hours(values: np.ndarray, hours: int) -> np.ndarray:
    """``values`` (float[sites, k]) cut or padded with 0 to ``hours`` columns."""
    if values.shape[1] >= hours:
        return values[:, :hours]
    return np.hstack([values, np.zeros((values.shape[0], hours - values.shape[1]))])


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
        f"{NAME}: job {job} would end {end_s / 3600.0:.1f} h after the run's start ({workload.start.isoformat()}), "
        f"past the {federation.hours} h of carbon data; choose an earlier --start, fewer --days, or more years "
        "of carbon data"
    )
