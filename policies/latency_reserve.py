"""Room kept for jobs near their users: a reserve at each site, learned from what latency-bound jobs held there.

A job with a latency objective may run only at the few sites near its origin (Frankfurt or London for a
European user at 50 ms). Deferred work without one goes wherever and whenever the grid is cleanest, and at
30 % utilisation it filled London's clean hours so often that latency-bound jobs found both sites full and
waited past their deadlines: on the 2022 Philly replay ``green`` missed 147 deadlines of latency-bound jobs
where carbon-greedy, which defers nothing, missed 45. A fixed ``headroom`` (a tenth of every site) cut that
to 44 but cost 3.9 % more carbon: it also held back the clean sites that no latency-bound job needed.

This reserve is kept only where latency-bound jobs are seen to need it, as much as they need:

- **What is learned** (:class:`LatencyDemand`): once an hour, the GPUs that jobs with a latency objective
  hold at each site and GPU model (running there, or booked by a deferral for that hour). The reserve is
  the ``quantile`` of the last ``window_h`` hourly samples, per site and model: what they needed there
  most of the time, and nothing at a site they never used.
- **How it is kept** (by the plan's search, :mod:`policies.timeshift`): as a protection level (the nested
  booking limits of revenue management): in each hour of the plan, work without a latency objective that
  the time-shift plan places (a deferral, or a start now of a job that could wait) leaves free the reserve
  less what latency-bound jobs already hold or have booked in that hour: it may hold at most the site's
  GPUs less the larger of the two. Latency-bound jobs may take all of it; a job that cannot wait is not
  held back (:func:`policies.timeshift.start_now`), nor is one that could wait when no later start has
  room either (it starts now rather than wait for nothing).
- **Or priced** (``shift.latency_reserve_price``, in the objective's unit per GPU-hour): the room kept is then
  a bid price rather than a bar (as in bid-price control, the other classic of revenue management). Work
  without a latency objective may take some of it, paying the price for each GPU-hour it takes, pro rata
  over the hours its run holds; a start now that takes any is allowed only where no start now elsewhere
  costs less, price included, and a later start's value carries its price as it carries the deadline
  risk's. So the room gives way where keeping it would cost more than the price (when every clean site is
  full, at high utilisation), and holds where a job has somewhere nearly as good to go. Moves of running
  work (:mod:`policies.migration`) still treat the room kept as a bar.

What it buys and costs on the Philly replays is in the README (Evidence, "``green`` keeps room for
latency-bound jobs, priced", and "Room for latency-bound jobs and a bound on a deferral's risk"). As a bar,
at the 0.9 quantile, 13-48 % fewer deadline misses on five of the six replays measured, for at most 2.7 t
more carbon, but at 50 % utilisation in 2021 ``green`` past its carbon target. Priced, ``green`` keeps it
(the 1.0 quantile at 0.5 kg CO2e per GPU-hour): 23-67 % fewer misses on all four replays, for 0.7-2.4 t,
every target it met before still met. Since forecasts stopped going below 0 g/kWh the price is 0.2, chosen
again on 2021 (``policies.profiles.SHIFTS``).

Units: GPUs (a fractional job counts ``milli / 1000`` of one), POSIX hours; the price in the objective's unit
per GPU-hour. Turning it on: a profile's ``shift.latency_reserve`` (a quantile in (0, 1]); None, the
default of :class:`policies.timeshift.ShiftPolicy` (not ``green``'s), keeps nothing. Pure: the broker and the
simulator own the samples (:class:`LatencyDemand`) and hand each pass their sorted samples
(``Snapshot.near_samples``) and what latency-bound jobs hold in each hour of the plan
(``Snapshot.near_booked``). The broker keeps the samples in its store (:meth:`LatencyDemand.state`), so a
broker that restarts or takes over from another replica does not learn the week again.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

WINDOW_H = 168
"""Hours of samples a reserve is learned from: a week, so that every hour of the day and day of the week is
in it, and a change in demand shows within days."""


class LatencyDemand:
    """The GPUs latency-bound jobs held at each site and model, one sample per hour, over the last
    ``window_h`` hours. Sites are known by name: when the set of sites changes, the samples of those that
    stay are kept (a new site has none, so no reserve until it has some)."""

    def __init__(self, window_h: int = WINDOW_H) -> None:
        if window_h < 1:
            raise ValueError(f"window_h must be at least 1, got {window_h}")
        self.window_h = window_h
        self._slots = window_h + 1  # the open hour's sample and window_h complete ones
        self._sites: tuple[str, ...] = ()
        self._ring = np.zeros((self._slots, 0, 0), dtype=np.float32)  # [hour % slots, site, model]; NaN: none
        self._hour: int | None = None  # the POSIX hour of the latest sample
        self._latest = np.zeros((0, 0), dtype=np.float32)  # the latest sample itself
        self._cache: dict[int, np.ndarray] = {}

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites of the latest sample, in its order."""
        return self._sites

    @property
    def n_models(self) -> int:
        return int(self._ring.shape[2])

    @property
    def hour(self) -> int | None:
        """The POSIX hour of the latest sample (None: none yet)."""
        return self._hour

    def _follow(self, sites: tuple[str, ...], n_models: int) -> None:
        """Lay the samples out for ``sites`` (in that order), keeping those of the sites that stay."""
        ring = np.full((self._slots, len(sites), n_models), np.nan, dtype=np.float32)
        if self._ring.shape[2] == n_models:
            was = {name: i for i, name in enumerate(self._sites)}
            for i, name in enumerate(sites):
                if name in was:
                    ring[:, i] = self._ring[:, was[name]]
        self._sites, self._ring = sites, ring
        self._cache.clear()

    def observe(self, hour: int, sites: tuple[str, ...], held: np.ndarray) -> None:
        """Record ``held`` (float[n_sites, n_models]: GPUs latency-bound jobs hold at each of ``sites``) as
        POSIX hour ``hour``'s sample. A second sample in the same hour keeps the larger (read by
        :meth:`reserve` once the next hour's first sample is in, so the reserve changes once an hour); hours
        with no sample since the last one hold what the latest sample saw (nothing changed that anyone saw).
        Sample after deciding as well as before, where passes are few: what a pass starts is held for the
        rest of the hour."""
        held = np.asarray(held, dtype=np.float32)
        if sites != self._sites or held.shape[1] != self._ring.shape[2]:
            self._follow(sites, held.shape[1])
        last = self._hour
        if last is not None and hour < last:
            return  # a sample from the past (a clock stepping back): ignore it
        slot = self._ring[hour % self._slots]
        if hour == last:
            np.fmax(slot, held, out=slot)
            self._latest = held.copy()
            return
        if last is not None:
            fill = self._latest if self._latest.shape == held.shape else np.nan  # nothing seen: no sample
            for h in range(max(last + 1, hour - self._slots + 1), hour):
                self._ring[h % self._slots] = fill
        slot[:] = held
        self._latest = held.copy()
        self._hour = hour
        self._cache.clear()

    def state(self) -> dict[str, Any]:
        """The samples as a JSON-ready document (:meth:`restore` reads it back): the ring of hours, zlib
        compressed (hours not sampled and sites never used compress to almost nothing)."""
        return {"v": STATE_VERSION, "window_h": self.window_h, "hour": self._hour, "sites": list(self._sites),
                "n_models": self.n_models, "ring": _pack(self._ring)}

    @classmethod
    def restore(cls, doc: dict[str, Any], window_h: int = WINDOW_H) -> LatencyDemand:
        """A demand from :meth:`state`'s document. The hours between its latest sample and the next one
        observed are not filled in (nobody saw them: a broker was down), so they are no samples. Raises
        ValueError when the document is not one this release wrote, or was kept over another window (a ring
        of another length means other hours)."""
        if not isinstance(doc, dict) or doc.get("v") != STATE_VERSION:
            raise ValueError(f"not a latency demand document of version {STATE_VERSION}")
        if doc.get("window_h") != window_h:
            raise ValueError(f"kept over {doc.get('window_h')} hours, not {window_h}")
        demand = cls(window_h)
        try:
            sites = tuple(str(name) for name in doc["sites"])
            n_models = int(doc["n_models"])
            hour = None if doc["hour"] is None else int(doc["hour"])
            ring = _unpack(doc["ring"], (demand._slots, len(sites), n_models))
        except (KeyError, TypeError, ValueError, zlib.error) as e:
            raise ValueError(f"a latency demand document that cannot be read: {e}") from None
        demand._sites, demand._ring, demand._hour = sites, ring, hour
        return demand

    def samples(self, sites: tuple[str, ...], n_models: int) -> np.ndarray:
        """float32[k, n_sites, n_models]: each site's samples of the last ``window_h`` hours, the latest
        hour's (still open) one left out, sorted ascending along the first axis, for :func:`reserve` (a site
        that joined since has 0 for the hours before; k is 0 before the first hour is complete). The same
        array until the next hour's first sample."""
        if sites != self._sites or n_models != self._ring.shape[2]:
            self._follow(sites, n_models)
        out = self._cache.get(0)
        if out is None:
            filled = ~np.isnan(self._ring).all(axis=(1, 2)) if self._ring.shape[1] else np.zeros(self._slots, bool)
            if self._hour is not None:
                filled[self._hour % self._slots] = False
            out = self._cache[0] = np.sort(np.nan_to_num(self._ring[filled]), axis=0)
        return out


STATE_VERSION = 1


def _pack(values: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(values, dtype="<f4").tobytes(), 6)).decode()


def _unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(text, validate=True))
    values = np.frombuffer(raw, dtype="<f4")
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{values.size} values where {shape} needs {int(np.prod(shape))}")
    return values.reshape(shape).astype(np.float32)  # a writable copy


def reserve(samples: np.ndarray, quantile: float) -> np.ndarray:
    """float32[n_sites, n_models]: the ``quantile`` of ``samples`` (sorted, as :meth:`LatencyDemand.samples`
    gives them), the lowest sample at or above it; 0 where there are none."""
    if not samples.shape[0]:
        return np.zeros(samples.shape[1:], dtype=np.float32)
    return np.ascontiguousarray(samples[min(int(np.ceil(quantile * (samples.shape[0] - 1) - 1e-9)),
                                            samples.shape[0] - 1)], dtype=np.float32)
