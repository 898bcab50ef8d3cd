"""GPU usage by tenant, site and GPU model over a window of time (``GET /v1/usage``, ``heliotrope usage``): what
a platform team charges its tenants back for, as SkyPilot's cost report or a Slurm ``sreport`` does.

An *attempt holds* its GPUs from the first transition the broker stored of it being admitted or running at its
site until the next transition of another state (it succeeded, failed, was cancelled, preempted, requeued): the
times the broker recorded them (``GET /v1/jobs/{id}/events``). A job's attempt still admitted or running holds them
until now. It holds the GPUs its request charges (:func:`policies.snapshot.gpus_charged`: whole GPUs, a share of
one, N/7 of a GPU per MIG slice of ``Ng``), as tenant limits and site quotas count them.

Finished jobs are deleted with their transitions ``broker.job_retention_h`` after they ended; before the store
deletes them it adds their attempts' GPU-seconds, cut at the hours (UTC), into ``usage_hours`` (one row per hour,
tenant, site and GPU model, written in the deletion's transaction), so a report over months goes on counting them.
Windows are therefore whole hours: a report's ``from`` is taken back to the start of its hour and its ``to``
forward to the end of its own (the answer says which).

Figures per row: ``gpu_hours``; ``attempts`` that began to hold GPUs in the window (an attempt across the window's
start is in ``gpu_hours``, not in ``attempts``); ``energy_kwh`` (GPU-hours x the model's board power, TDP: an upper
estimate, as the carbon ledger's); ``cost_usd`` (each attempt's GPU-hours x the price per GPU-hour of its model at
its site that routing saw when the attempt was placed, as SkyPilot's cost report charges the price at launch, so a
price changed since, by a price provider or a site's ``usd_per_gpu_hour``, does not change past bills; the cycle
records it on the attempt's transitions (``job_events.usd_per_gpu_hour``, migration 8) and the roll-up keeps its
cost (``usage_hours.cost_usd`` over ``priced_gpu_seconds``). GPU-hours with no price recorded, placed before this
release, by a replica of an earlier one, or where the site had no price then, are charged at the price routing
sees *now*, a price provider's where one is configured, else the spec's, and ``notes`` says how many; a row with
such GPU-hours at a site without a price now, as a site removed since, is left without ``cost_usd``: an estimate
for chargeback, not a bill); and where the broker has a carbon provider, ``co2e_kg`` (that energy, hour by hour,
x its site's grid intensity in that hour as the provider measured it, the hour under way at its forecast; left out
of a row with energy at an hour or site whose intensity cannot be had, which the answer's ``notes`` name).

This module does no I/O: the stores read the transitions (streamed into :class:`Holds`) and the rolled-up hours
(``Store.usage_records``), the API the intensities (only of the hours used: :func:`hours_used`), and
:func:`report` puts the report together.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from broker import ids
from broker.models import STORED, GpuRequest, JobState
from policies.snapshot import gpus_charged

log = logging.getLogger(__name__)

HOUR_S = 3600
UNKNOWN_MODEL = "unknown"  # an attempt whose GPU model nobody recorded (a transition of an earlier release)
GROUP_KEYS = ("tenant", "site", "gpu_model")
MAX_WINDOW_DAYS = 400  # a report spans at most this: over a year, with room for a calendar year's edges
_HOLDING = frozenset({JobState.ADMITTED.value, JobState.RUNNING.value})


@dataclass(frozen=True, slots=True)
class Held:
    """One attempt's hold on GPUs: from ``start`` to ``end`` (POSIX seconds; ``end`` None: holding them still), at
    the price per GPU-hour routing saw when it was placed."""

    tenant: str
    site: str
    gpu_model: str
    gpus: float
    start: float
    end: float | None
    usd_per_gpu_hour: float | None = None  # the price routing saw when it was placed (None: none was recorded)


UNPRICED_SLACK = 1e-9  # a rolled-up row's unpriced GPU-seconds (its whole less its priced) below this share: none
Event = tuple[str, str, str, "str | None", int, "str | None", "float | None"]
"""A job's transition as stored: (job id, at, state, site, attempt, GPU model, USD per GPU-hour at placement)."""
HourFigures = tuple[float, int, float, float]
"""A rolled-up hour's figures: (GPU-seconds, attempts begun, GPU-seconds with a price recorded, their USD cost at
it). The GPU-seconds without one are the first less the third (``usage_hours`` is so: a replica of an earlier release
adds GPU-seconds alone, which are then unpriced)."""
HourRow = tuple[int, str, str, str, float, int, float, float]
"""A ``usage_hours`` row: (hour start, tenant, site, GPU model, *HourFigures)."""


@dataclass(frozen=True, slots=True)
class UsageRecords:
    """What a store gives a report: the attempts of the jobs it still keeps that may have held GPUs in the window
    (:class:`Holds`), and the hours rolled up from the jobs it deleted (:data:`HourRow`)."""

    held: Sequence[Held]
    hours: Sequence[HourRow]


def request_charge(gpus: str, model: str | None) -> float:
    """The GPUs a stored request (``spec.gpus``, its JSON) charges on ``model``, as routing charges it
    (:func:`policies.snapshot.gpus_charged`), a GPU shared by memory sized on ``model`` where it is known."""
    g = GpuRequest.model_validate(json.loads(gpus), context=STORED)
    return gpus_charged(g.model_copy(update={"model": model}) if model in ids.GPU_MODEL_BY_ID else g)


class Holds:
    """The attempts that held GPUs, read from jobs' transitions as a store streams them (:meth:`feed`, the events
    of each job together, in the order stored, in as many pieces as it likes), so that a report over many jobs
    keeps their attempts, not their transitions. :meth:`job` names each job whose transitions count (its tenant,
    its GPU request's JSON, the model of its current attempt), first; others' transitions are passed over.

    A transition stored before this release names no model: its attempt is charged to the model a later transition
    of the same attempt names (stored since), else to the job's model where it is the job's current attempt (the
    last its transitions name), the one that model is of; else (an earlier one, perhaps at another site)
    to ``unknown``. So a job's attempts are kept until its last transition is read.

    An attempt's price is the one a transition of it names (the placement's does, and those after it while the
    leader that placed it keeps it in memory); none where none does (placed before this release, or unpriced)."""

    def __init__(self) -> None:
        self.held: list[Held] = []
        self._jobs: dict[str, tuple[str, str, str | None]] = {}
        self._texts: dict[str, str] = {}  # one copy of each tenant's name and GPU request's JSON
        self._charges: dict[tuple[str, str], float] = {}
        self._job: str | None = None
        # (attempt, site, model, start, USD per GPU-hour) of the hold
        self._open: tuple[int, str, str | None, float, float | None] | None = None
        self._last_attempt = 0  # of the job being read: the attempt its last transition read names
        self._priced: tuple[int, float] | None = None  # of the job being read: the last price named, its attempt's
        self._ended: list[tuple[int, str, str | None, float, float | None, float | None]] = []  # _open + end

    def job(self, job_id: str, tenant: str, gpus: str, model: str | None) -> None:
        texts = self._texts
        self._jobs[job_id] = (texts.setdefault(tenant, tenant), texts.setdefault(gpus, gpus), model)

    def feed(self, events: Iterable[Event]) -> None:
        for job_id, at, state, site, attempt, model, usd in events:
            if job_id != self._job:
                self._close(None)
                self._flush()
                self._job = job_id if job_id in self._jobs else None
                self._priced = None
            if self._job is None:
                continue
            self._last_attempt = attempt
            ts = datetime.fromisoformat(at).timestamp()
            if usd is not None:
                self._priced = (attempt, usd)
            price = self._priced[1] if self._priced is not None and self._priced[0] == attempt else None
            if self._open is not None and attempt == self._open[0]:
                # (a hold begun before this release, or read back from the store by a leader that did not place it:
                # a later transition of its attempt names its model or price)
                _, held_site, held_model, start, held_price = self._open
                self._open = (attempt, held_site, held_model or model, start,
                              held_price if held_price is not None else price)
            if self._open is not None and (state not in _HOLDING or attempt != self._open[0]):
                self._close(ts)
            if self._open is None and state in _HOLDING and site is not None:
                self._open = (attempt, site, model, ts, price)

    def done(self) -> list[Held]:
        """The attempts read (one still holding its GPUs at the last transition read: ``end`` None)."""
        self._close(None)
        self._flush()
        self._job = None
        return self.held

    def _close(self, end: float | None) -> None:
        if self._open is not None and self._job is not None:
            self._ended.append((*self._open, end))
        self._open = None

    def _flush(self) -> None:
        """The job being read is read whole: its holds, each on its model."""
        if self._job is not None:
            tenant, gpus, job_model = self._jobs[self._job]
            for attempt, site, model, start, price, end in self._ended:
                model = model or (job_model if attempt == self._last_attempt else None) or UNKNOWN_MODEL
                key = (gpus, model)
                if key not in self._charges:
                    try:
                        self._charges[key] = request_charge(gpus, model)
                    except ValueError as e:  # (a stored request this release cannot read: counted, not in the way)
                        count = _count_of(gpus)
                        log.warning("usage: job %s: its GPU request cannot be read (%s); counted as %g GPUs",
                                    self._job, str(e).splitlines()[0], count)
                        self._charges[key] = count
                self.held.append(Held(tenant, site, model, self._charges[key], start, end, price))
        self._ended = []


def _count_of(gpus: str) -> float:
    """A GPU request's ``count`` where it has a readable one, else 1."""
    try:
        count = json.loads(gpus).get("count", 1)
    except (ValueError, AttributeError):
        return 1.0
    return float(count) if isinstance(count, int | float) and count > 0 else 1.0


def holds(jobs: Mapping[str, tuple[str, str, str | None]], events: Iterable[Event]) -> list[Held]:
    """:class:`Holds` of ``jobs`` from ``events`` read at once."""
    reader = Holds()
    for job_id, (tenant, gpus, model) in jobs.items():
        reader.job(job_id, tenant, gpus, model)
    reader.feed(events)
    return reader.done()


def by_hour(hold: Held, until: float) -> Iterator[tuple[int, float]]:
    """``hold``'s GPU-seconds in each hour (UTC) it spans: (hour start, GPU-seconds), up to ``until`` where it
    has not ended."""
    end = hold.end if hold.end is not None else until
    t = hold.start
    while t < end:
        hour = int(t // HOUR_S) * HOUR_S
        step = min(end, hour + HOUR_S)
        yield hour, (step - t) * hold.gpus
        t = step


def add_hour(figures: HourFigures | None, added: HourFigures) -> HourFigures:
    """A rolled-up hour's figures with ``added`` added in (``figures`` None: the hour had none), as a store's
    ``usage_hours`` adds them."""
    if figures is None:
        return added
    return (figures[0] + added[0], figures[1] + added[1], figures[2] + added[2], figures[3] + added[3])


def roll_up(held: Iterable[Held]) -> dict[tuple[int, str, str, str], HourFigures]:
    """Ended holds (of jobs about to be deleted) added up per (hour start, tenant, site, GPU model): GPU-seconds,
    the attempts begun that hour, and the GPU-seconds of those with a price recorded and their cost at it
    (:data:`HourFigures`)."""
    out: dict[tuple[int, str, str, str], HourFigures] = {}
    for h in held:
        if h.end is None:
            continue
        first = int(h.start // HOUR_S) * HOUR_S
        usd = h.usd_per_gpu_hour
        for hour, gpu_s in by_hour(h, h.end):
            key = (hour, h.tenant, h.site, h.gpu_model)
            priced = (gpu_s, gpu_s / HOUR_S * usd) if usd is not None else (0.0, 0.0)
            out[key] = add_hour(out.get(key), (gpu_s, int(hour == first), *priced))
        if h.end <= h.start:  # (held no time: still an attempt begun)
            key = (first, h.tenant, h.site, h.gpu_model)
            out[key] = add_hour(out.get(key), (0.0, 1, 0.0, 0.0))
    return out


class WindowError(ValueError):
    """A report's window that cannot be: ``field`` (``from`` or ``to``) names the parameter to change."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def window(frm: datetime | None, to: datetime | None, now: datetime) -> tuple[datetime, datetime]:
    """A report's window in whole hours (UTC): ``from`` back to the start of its hour, ``to`` on to the end of
    its own; by default the 30 days up to the end of the current hour. Raises WindowError (naming the parameter:
    ``to``, or ``from`` where it alone is given) for a window that ends before it starts or spans more than
    :data:`MAX_WINDOW_DAYS`."""
    def floor(t: datetime) -> datetime:
        return datetime.fromtimestamp(int(t.timestamp() // HOUR_S) * HOUR_S, UTC)

    end = to if to is not None else now
    field = "to"
    try:
        end_h = floor(end)
        if end_h < end:
            end_h += timedelta(hours=1)
        field = "from"
        start_h = floor(frm) if frm is not None else end_h - timedelta(days=30)
    except (OverflowError, OSError, ValueError):  # (an hour or 30 days beyond year 9999 or before year 1)
        raise WindowError(field, "the window reaches past the dates a report can name (years 1 to 9999)") from None
    given = "to" if to is not None else "from"  # (the end named where given; a from alone is what is wrong)
    if end_h <= start_h:
        raise WindowError(given, "the window must end after it starts (from)"
                         + ("" if to is not None else "; with no to it ends at the end of the current hour"))
    if end_h - start_h > timedelta(days=MAX_WINDOW_DAYS):
        raise WindowError(given, f"a report spans at most {MAX_WINDOW_DAYS} days; ask for several")
    return start_h, end_h


def hours_used(records: UsageRecords, start: datetime, end: datetime, now: datetime) -> dict[str, tuple[int, int]]:
    """Per site, the first and the last hour start (POSIX seconds) of [``start``, ``end``) in which GPUs were held
    there, up to ``now``: the intensities a report's ``co2e_kg`` needs (those of the hours between, too)."""
    lo, hi, until = start.timestamp(), end.timestamp(), min(now.timestamp(), end.timestamp())
    out: dict[str, tuple[int, int]] = {}

    def add(site: str, first: int, last: int) -> None:
        if site in out:
            first, last = min(first, out[site][0]), max(last, out[site][1])
        out[site] = (first, last)

    for hour, _, site, _, gpu_s, *_ in records.hours:
        if lo <= hour < hi and gpu_s > 0:
            add(site, int(hour), int(hour))
    for h in records.held:
        a, b = max(h.start, lo), min(h.end if h.end is not None else until, hi)
        if b > a:
            add(h.site, int(a // HOUR_S) * HOUR_S, int(math.ceil(b / HOUR_S) - 1) * HOUR_S)
    return out


@dataclass(slots=True)
class Part:
    """A row's GPU-seconds on one model at one site: all of them, those with no price recorded (charged at the
    price now), and the USD cost of the others at the prices recorded."""

    gpu_s: float = 0.0
    unpriced_s: float = 0.0
    usd: float = 0.0

    def add(self, gpu_s: float, unpriced_s: float, usd: float) -> None:
        self.gpu_s += gpu_s
        self.unpriced_s += unpriced_s
        self.usd += usd


@dataclass(slots=True)
class Row:
    gpu_s: float = 0.0
    attempts: int = 0
    parts: dict[tuple[str, str], Part] = field(default_factory=dict)  # (site, model) -> its GPU-seconds and cost
    kwh: dict[tuple[str, int], float] = field(default_factory=dict)  # (site, hour start) -> kWh (with intensities)

    def add(self, other: Row) -> None:
        self.gpu_s += other.gpu_s
        self.attempts += other.attempts
        for k, p in other.parts.items():
            self.parts.setdefault(k, Part()).add(p.gpu_s, p.unpriced_s, p.usd)
        for k, e in other.kwh.items():
            self.kwh[k] = self.kwh.get(k, 0.0) + e


def _tdp_kw(model: str) -> float:
    return ids.GPU_MODEL_BY_ID[model].tdp_w / 1000.0 if model in ids.GPU_MODEL_BY_ID else 0.0


def report(records: UsageRecords, start: datetime, end: datetime, now: datetime, by: Sequence[str],
           prices: Mapping[str, Mapping[str, float]], tenants: Iterable[str] | None = None,
           site: str | None = None, intensity: Mapping[str, Mapping[int, float]] | None = None) -> dict[str, Any]:
    """The usage report over [``start``, ``end``) (whole hours): one row per distinct value of the ``by`` keys
    (of :data:`GROUP_KEYS`), largest GPU-hours first, and the totals. Each attempt is charged at the price
    recorded when it was placed; ``prices`` (site -> model -> USD per GPU-hour, as routing sees them now) charge the
    GPU-seconds without one; ``tenants``: only these (a submitter's own); ``site``: only this one;
    ``intensity``: site -> hour start -> gCO2e/kWh of its grid, for ``co2e_kg`` (None: no carbon figures; a row
    with energy at an hour or site it lacks gets none either)."""
    lo, hi, until = start.timestamp(), end.timestamp(), min(now.timestamp(), end.timestamp())
    wanted = None if tenants is None else frozenset(tenants)
    rows: dict[tuple[str, ...], Row] = {}

    def row_of(tenant: str, at_site: str, model: str) -> Row | None:
        if (wanted is not None and tenant not in wanted) or (site is not None and at_site != site):
            return None
        values = {"tenant": tenant, "site": at_site, "gpu_model": model}
        return rows.setdefault(tuple(values[k] for k in by), Row())

    def add(row: Row, at_site: str, model: str, hour: int, gpu_s: float, unpriced_s: float, usd: float) -> None:
        row.gpu_s += gpu_s
        row.parts.setdefault((at_site, model), Part()).add(gpu_s, unpriced_s, usd)
        if intensity is not None:
            row.kwh[(at_site, hour)] = row.kwh.get((at_site, hour), 0.0) + gpu_s / HOUR_S * _tdp_kw(model)

    def held(gpu_s: float, price: float | None) -> tuple[float, float]:
        """The unpriced GPU-seconds and the cost at its own price of ``gpu_s`` held by an attempt."""
        return (gpu_s, 0.0) if price is None else (0.0, gpu_s / HOUR_S * price)

    for hour, tenant, at_site, model, gpu_s, attempts, priced_s, usd in records.hours:
        if lo <= hour < hi and (row := row_of(tenant, at_site, model)) is not None:
            unpriced_s = gpu_s - priced_s  # (what a replica of an earlier release, or one before migration 8, added)
            add(row, at_site, model, hour, gpu_s, unpriced_s if unpriced_s > UNPRICED_SLACK * gpu_s else 0.0, usd)
            row.attempts += attempts
    for h in records.held:
        stop = h.end if h.end is not None else until
        began = lo <= h.start < hi
        if not (began or (h.start < hi and stop > lo)) or (row := row_of(h.tenant, h.site, h.gpu_model)) is None:
            continue
        row.attempts += began
        clipped = Held(h.tenant, h.site, h.gpu_model, h.gpus, max(h.start, lo), min(stop, hi))
        if intensity is None:
            gpu_s = max(clipped.end - clipped.start, 0.0) * h.gpus  # type: ignore[operator]
            add(row, h.site, h.gpu_model, 0, gpu_s, *held(gpu_s, h.usd_per_gpu_hour))
        else:
            for hour, gpu_s in by_hour(clipped, hi):
                add(row, h.site, h.gpu_model, hour, gpu_s, *held(gpu_s, h.usd_per_gpu_hour))

    def at_price_now(row: Row) -> tuple[float, float, bool]:
        """The GPU-seconds of ``row`` with no price recorded that the price now charges, their cost, and whether
        every part that held GPUs unpriced has a price now."""
        gpu_s, usd, whole = 0.0, 0.0, True
        for (st, m), p in row.parts.items():
            if p.gpu_s > 0 and p.unpriced_s > 0:  # (a part that held no time costs nothing)
                if m in prices.get(st, {}):
                    gpu_s, usd = gpu_s + p.unpriced_s, usd + p.unpriced_s / HOUR_S * prices[st][m]
                else:
                    whole = False
        return gpu_s, usd, whole

    def figures(row: Row) -> dict[str, Any]:
        kwh = sum(p.gpu_s / HOUR_S * _tdp_kw(m) for (_, m), p in row.parts.items())
        out: dict[str, Any] = {"gpu_hours": round(row.gpu_s / HOUR_S, 6), "attempts": row.attempts,
                               "energy_kwh": round(kwh, 6)}
        _, today_usd, whole = at_price_now(row)
        if whole:
            out["cost_usd"] = round(sum(p.usd for p in row.parts.values()) + today_usd, 2)
        if intensity is not None:
            grams, known = 0.0, True
            for (st, hour), e in row.kwh.items():
                g = intensity.get(st, {}).get(hour, math.nan)
                if math.isfinite(g):
                    grams += e * g
                elif e > 0:
                    known = False
            if known:
                out["co2e_kg"] = round(grams / 1000.0, 6)
        return out

    items = []
    for key, row in sorted(rows.items(), key=lambda kv: (-kv[1].gpu_s, kv[0])):
        items.append({**dict(zip(by, key)), **figures(row)})
    total = Row()
    for row in rows.values():
        total.add(row)
    out = {"from": start.isoformat(), "to": end.isoformat(), "by": list(by), "items": items, "total": figures(total)}
    notes = []
    unknown = sum(p.gpu_s for (_, m), p in total.parts.items() if m not in ids.GPU_MODEL_BY_ID) / HOUR_S
    if unknown > 0:
        notes.append(f"energy_kwh, co2e_kg: {unknown:.6g} GPU-hours were held on a GPU model nobody recorded "
                     f"(gpu_model {UNKNOWN_MODEL}: placed before this release) and count no energy")
    today_h = at_price_now(total)[0] / HOUR_S
    if today_h > 0:
        notes.append(f"cost_usd: {today_h:.6g} GPU-hours were placed before prices were recorded (before this "
                     f"release, or where their site had no price then) and are charged at today's price")
    if notes:
        out["notes"] = notes
    return out
