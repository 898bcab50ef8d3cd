"""Carbon-intensity providers: where the broker gets grid carbon intensity, files or a live service, behind one
interface.

The interface (:class:`CarbonProvider`, all methods async)
    - ``history(zone, start, end)`` → ``np.ndarray`` of float64, one value per hour of ``[start, end)``:
      value ``i`` is the intensity of ``[start + i h, start + (i + 1) h)``. ``start`` and ``end`` are
      timezone-aware and on the hour (converted to UTC); ``start == end`` gives an empty array.
    - ``latest(zone, now)`` → the intensity of the hour containing ``now`` (aware).
    - ``close()`` → releases what the provider holds (the HTTP session); idempotent.

    Zones are grid-zone ids, canonicalised with :func:`broker.ids.grid_zone` (``DE`` and ``germany`` are
    ``DE-LU``). Units: gCO2e per kWh of electricity consumed; direct (operational) intensity by default,
    life-cycle with ``lifecycle=True``, as in :mod:`broker.data.carbon`.

    A caller mistake (a naive or mid-hour time, ``end`` before ``start``, a malformed zone id) is a
    ``ValueError``. Anything the data or the service cannot answer is a :class:`ProviderError` whose one-line
    message names the zone, where the answer was sought (the files, or the request path without the token)
    and why.

Providers
    - :class:`FileCarbonProvider` wraps a loaded :class:`~broker.data.carbon.CarbonData` (the shipped slice
      ``data/carbon`` or the shared folder): no network, no cache needed; a time outside the files is a
      ``ProviderError`` naming the zone and the span the files cover.
    - :class:`HttpCarbonProvider` asks a service speaking the Electricity Maps v3 API:

      ``GET {base}/v3/carbon-intensity/latest?zone=Z`` → ``{"zone", "carbonIntensity", "datetime", ...}``;
      ``GET {base}/v3/carbon-intensity/history?zone=Z`` → ``{"zone", "history": [{"datetime",
      "carbonIntensity"}, ...]}`` (the last 24 hours); ``GET {base}/v3/carbon-intensity/past-range?zone=Z&
      start=ISO&end=ISO`` → ``{"zone", "data": [...]}`` (at most 10 days a request, so longer spans are
      asked in pieces of :data:`MAX_RANGE_HOURS`). Every request also sends ``emissionFactorType=direct``
      (or ``lifecycle``) so that the service's default (life-cycle) is never mixed up with the files'
      default (direct).

      - **Zone ids**: the service names some zones differently from the files; :data:`SERVICE_ZONES`
        (``DE-LU`` → ``DE``, ``BR-SP`` → ``BR-CS``, as the shipped files' ``Zone Id`` column says) is applied,
        and ``zones={canonical: service id}`` adds or overrides entries.
      - **Token**: sent as the ``auth-token`` header when given; it is never logged and never appears in an
        error message (a message that would contain it has it replaced by ``***``). The config reads it from
        the environment variable named by ``token_env``.
      - **Timeouts and retries**: one ``aiohttp.ClientSession`` for all requests, each limited by
        ``ClientTimeout(total=timeout_s)`` (default 5 s); a connection error, a timeout, a cut-off answer, an
        HTTP 5xx or 429 is retried up to ``retries`` times (default 3, so at most 4 requests; 0 turns retrying
        off) with exponential backoff and jitter (``backoff_s`` 0.5 s, doubling up to ``max_backoff_s`` 10 s,
        plus a random 0 to ``backoff_s``). A ``Retry-After`` header (seconds or an HTTP date) on a 429 or 5xx
        is honoured instead, up to ``max_retry_after_s`` (default 30 s). Any other 4xx (401 bad token, 404
        unknown zone, 400) fails at once. Each retry is logged at WARNING with the path (no token), the reason
        and the wait.
      - **Cache**: answers are kept for ``cache_ttl_s`` (default 300 s; 0 turns the cache off), keyed per
        (endpoint, zone, hour): ``latest`` by the hour of ``now``, and hourly values by the hour they
        describe (whichever of ``history`` and ``past-range`` brought them), so repeated calls within the
        same hour do not touch the network. The cache is per provider instance and in memory.
      - **Which endpoint**: ``history()`` uses what is cached; if hours are missing and none is older than the
        last 24 hours by ``clock`` (default the system clock) it asks ``history`` (one cheap request), and
        anything still missing it asks ``past-range`` for. ``latest()`` asks ``latest``; if the service's
        latest reading is for a later hour than ``now`` (``now`` is in the past: replays, backtests) it
        answers from ``history()`` instead; a reading up to :data:`LATEST_LAG_HOURS` (1 h) older than ``now``'s
        hour is accepted (the service may not have the new hour yet just after it starts); an older one is an
        error.
      - **Missing hours** in an answer (absent, or ``carbonIntensity: null``) are filled by linear
        interpolation between the hours either side when the run is at most :data:`MAX_GAP_HOURS` (6 h) and
        lies inside the span asked for, as :mod:`broker.data.carbon` does for files, and logged at INFO; a
        longer run, or one at either end of the span (nothing to interpolate from), is a ``ProviderError``
        naming the zone, the request that should have had them and the missing hours. Several readings stamped
        inside one hour are averaged into it. A reading that is not a number from 0 to :data:`MAX_INTENSITY`
        (5,000 g/kWh) is an error naming the entry.

Configuration
    :data:`CarbonProviderConfig` (pydantic 2, unknown fields are errors) is a union tagged by ``kind``::

        carbon: {kind: files, path: data/carbon}
        carbon: {kind: http, url: https://api.electricitymap.org, token_env: ELECTRICITYMAPS_TOKEN,
                 timeout_s: 5, cache_ttl_s: 300, retries: 3}

    :func:`build_carbon_provider` turns one into a provider. To turn live carbon data off, configure the files
    provider (or none); to turn carbon out of placement decisions altogether, give the carbon scorer weight 0.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlencode

import aiohttp
import numpy as np
from pydantic import Field, HttpUrl, TypeAdapter
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from yarl import URL

from broker.clock import Clock, SystemClock
from broker.data.carbon import MAX_GAP_HOURS, CarbonData, CarbonDataError, load_carbon
from broker.ids import UnknownIdentifier, grid_zone
from broker.models import GridZoneId, Spec, on_this_machine

__all__ = [
    "HISTORY_PATH",
    "LATEST_LAG_HOURS",
    "LATEST_PATH",
    "MAX_GAP_HOURS",
    "MAX_INTENSITY",
    "MAX_RANGE_HOURS",
    "PAST_RANGE_PATH",
    "SERVICE_ZONES",
    "CarbonProvider",
    "CarbonProviderConfig",
    "FileCarbonProvider",
    "FilesCarbonConfig",
    "HttpCarbonConfig",
    "HttpCarbonProvider",
    "ProviderError",
    "build_carbon_provider",
    "parse_carbon_provider_config",
]

log = logging.getLogger(__name__)

LATEST_PATH = "/v3/carbon-intensity/latest"
HISTORY_PATH = "/v3/carbon-intensity/history"
PAST_RANGE_PATH = "/v3/carbon-intensity/past-range"

MAX_RANGE_HOURS = 240
"""Longest span asked of ``past-range`` in one request (the service allows 10 days)."""

MAX_INTENSITY = 5000.0
"""Highest reading taken, gCO2e/kWh: no grid emits more (coal plants are near 1,000); a higher one is an
error in the answer, and one too large for the forecast's running sums to stay finite."""

LATEST_LAG_HOURS = 1
"""How many hours older than ``now``'s hour the service's latest reading may be and still be used."""

SERVICE_ZONES: dict[str, str] = {"DE-LU": "DE", "BR-SP": "BR-CS"}
"""Canonical zone → the live service's zone id, where they differ (from the shipped files' ``Zone Id``)."""

_HOUR = timedelta(hours=1)
_HISTORY_HOURS = 24


class ProviderError(RuntimeError):
    """A provider could not answer; ``str()`` is one line naming the zone, where it looked and why."""

    def __init__(self, reason: str, *, zone: str | None = None, where: str | None = None) -> None:
        self.reason, self.zone, self.where = reason, zone, where
        parts = ["carbon provider"]
        if zone:
            parts.append(f"zone {zone}")
        if where:
            parts.append(where)
        super().__init__(": ".join(parts) + f": {reason}")


@runtime_checkable
class CarbonProvider(Protocol):
    """Hourly grid carbon intensity (gCO2e/kWh) by canonical grid zone; see the module docstring."""

    async def history(self, zone: str, start: datetime, end: datetime) -> np.ndarray: ...

    async def latest(self, zone: str, now: datetime) -> float: ...

    async def close(self) -> None: ...


# --- time helpers ---------------------------------------------------------------------------------------


def _fmt(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%MZ")


def _utc(when: datetime, name: str) -> datetime:
    if not isinstance(when, datetime):
        raise ValueError(f"{name} must be a datetime, got {type(when).__name__}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware (UTC), got the naive time {when.isoformat()}")
    return when.astimezone(UTC)


def _floor_hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _hour_bounds(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    s, e = _utc(start, "start"), _utc(end, "end")
    for name, t in (("start", s), ("end", e)):
        if t != _floor_hour(t):
            raise ValueError(f"{name} must be on the hour, got {t.isoformat()}")
    if e < s:
        raise ValueError(f"end ({_fmt(e)}) is before start ({_fmt(s)})")
    return s, e


def _hours(start: datetime, end: datetime) -> list[datetime]:
    n = (end - start) // _HOUR
    return [start + i * _HOUR for i in range(n)]


def _span_text(hours: list[datetime]) -> str:
    first, last = hours[0], hours[-1] + _HOUR
    return f"{len(hours)} h from {_fmt(first)} to {_fmt(last)}"


def _zone(zone: str) -> str:
    try:
        return grid_zone(zone)
    except UnknownIdentifier as e:
        raise ValueError(str(e)) from None


# --- files ----------------------------------------------------------------------------------------------


class FileCarbonProvider:
    """Carbon intensity from loaded files (:func:`broker.data.carbon.load_carbon`): no network, no clock."""

    def __init__(self, data: CarbonData, source: str = "") -> None:
        self.data = data
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, lifecycle: bool = False) -> FileCarbonProvider:
        """Load every zone under ``path`` (a :class:`~broker.data.carbon.CarbonDataError` if it cannot)."""
        return cls(load_carbon(path, lifecycle=lifecycle), str(path))

    def __repr__(self) -> str:
        return f"FileCarbonProvider({self.source or 'in memory'}, zones={list(self.data.zones())})"

    @property
    def _where(self) -> str:
        return f"files {self.source}" if self.source else "files"

    def _covered(self, zone: str) -> tuple[datetime, datetime]:
        try:
            return self.data.span(zone)
        except CarbonDataError:
            raise ProviderError(
                f"no carbon data for this zone; zones loaded: {', '.join(self.data.zones()) or 'none'}",
                zone=zone, where=self._where,
            ) from None

    async def history(self, zone: str, start: datetime, end: datetime) -> np.ndarray:
        zone = _zone(zone)
        s, e = _hour_bounds(start, end)
        first, last = self._covered(zone)
        if s == e:
            return np.empty(0, dtype=np.float64)
        if s < first or e > last:
            raise ProviderError(
                f"{_fmt(s)} to {_fmt(e)} is outside the data, which covers {_fmt(first)} to {_fmt(last)}",
                zone=zone, where=self._where,
            )
        return np.array(self.data.series(zone, s, (e - s) // _HOUR), dtype=np.float64)

    async def latest(self, zone: str, now: datetime) -> float:
        zone = _zone(zone)
        t = _utc(now, "now")
        first, last = self._covered(zone)
        if not first <= t < last:
            raise ProviderError(
                f"{t.isoformat()} is outside the data, which covers {_fmt(first)} to {_fmt(last)}",
                zone=zone, where=self._where,
            )
        return self.data.intensity(zone, t)

    async def close(self) -> None:
        return None


# --- HTTP -----------------------------------------------------------------------------------------------


class _Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's Retry-After in seconds, if it sent one."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


def _retry_after_s(value: str | None) -> float | None:
    """Seconds from a Retry-After header: a number of seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


class _TtlCache:
    """``key → value`` for ``ttl_s`` seconds of ``time.monotonic()``; ``ttl_s == 0`` keeps nothing."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._items: dict[tuple[Any, ...], tuple[float, float]] = {}

    def get(self, key: tuple[Any, ...]) -> float | None:
        item = self._items.get(key)
        if item is None:
            return None
        expires, value = item
        if time.monotonic() >= expires:
            del self._items[key]
            return None
        return value

    def put(self, key: tuple[Any, ...], value: float) -> None:
        if self.ttl_s > 0:
            self._items[key] = (time.monotonic() + self.ttl_s, value)

    def purge(self) -> None:
        now = time.monotonic()
        for key in [k for k, (expires, _) in self._items.items() if now >= expires]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)


class HttpCarbonProvider:
    """Carbon intensity from an Electricity Maps v3 API service; behaviour in the module docstring.

    Use ``async with HttpCarbonProvider(...) as p:`` or call :meth:`close` when done. The session is opened
    on the first request, inside the running event loop.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        cache_ttl_s: float = 300.0,
        retries: int = 3,
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_retry_after_s: float = 30.0,
        lifecycle: bool = False,
        zones: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        token_env: str | None = None,
    ) -> None:
        url = URL(str(base_url))
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the carbon service URL must look like https://HOST[:PORT][/PATH], got {str(base_url)!r}")
        if url.query_string or url.fragment:
            raise ValueError(f"the carbon service URL must have no query or fragment, got {str(base_url)!r}")
        for name, value, low in (("timeout_s", timeout_s, 0.0), ("cache_ttl_s", cache_ttl_s, 0.0),
                                 ("backoff_s", backoff_s, 0.0), ("max_backoff_s", max_backoff_s, 0.0),
                                 ("max_retry_after_s", max_retry_after_s, 0.0)):
            if not (math.isfinite(value) and value >= low) or (name == "timeout_s" and value == 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'timeout_s' else 'non-negative'} "
                                 f"number of seconds, got {value}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a whole number of 0 or more, got {retries!r}")
        self.base_url = str(url).rstrip("/")
        self._token = token or None
        self._token_env = token_env
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_retry_after_s = float(max_retry_after_s)
        self.lifecycle = lifecycle
        self.service_zones = {**SERVICE_ZONES, **{grid_zone(k): v.strip() for k, v in (zones or {}).items()}}
        self._clock: Clock = clock or SystemClock()
        self._cache = _TtlCache(float(cache_ttl_s))
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:  # never the token itself
        return f"HttpCarbonProvider({self.base_url}, token={'set' if self._token else 'none'})"

    async def __aenter__(self) -> HttpCarbonProvider:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # --- the interface ---

    async def history(self, zone: str, start: datetime, end: datetime) -> np.ndarray:
        zone = _zone(zone)
        s, e = _hour_bounds(start, end)
        hours = _hours(s, e)
        if not hours:
            return np.empty(0, dtype=np.float64)
        got: dict[datetime, float] = {}
        for h in hours:
            v = self._cache.get(("hourly", zone, h))
            if v is not None:
                got[h] = v
        missing = [h for h in hours if h not in got]
        asked: list[tuple[datetime, datetime, str]] = []  # (first hour, end, request) of each request made
        if missing:
            self._cache.purge()
            recent_from = _floor_hour(_utc(self._clock.now(), "clock.now()")) - (_HISTORY_HOURS - 1) * _HOUR
            if missing[0] >= recent_from:
                asked.append((recent_from, recent_from + _HISTORY_HOURS * _HOUR, self._shown(HISTORY_PATH, zone, {})))
                got.update(self._keep(zone, await self._history_answer(zone), hours))
                missing = [h for h in hours if h not in got]
            if missing:
                a, b = missing[0], missing[-1] + _HOUR
                while a < b:
                    c = min(b, a + MAX_RANGE_HOURS * _HOUR)
                    asked.append((a, c, self._shown(PAST_RANGE_PATH, zone, self._range_params(a, c))))
                    got.update(self._keep(zone, await self._past_range_answer(zone, a, c), hours))
                    a = c
                missing = [h for h in hours if h not in got]
        values = np.array([got.get(h, math.nan) for h in hours], dtype=np.float64)
        if missing:
            def where(hour: datetime) -> str:  # the last request that should have had the hour
                return next((shown for first, end, shown in reversed(asked) if first <= hour < end),
                            asked[-1][2] if asked else "cache")

            self._fill_gaps(zone, where, hours, values)
            for h, v in zip(hours, values, strict=True):
                self._cache.put(("hourly", zone, h), float(v))
        return values

    async def latest(self, zone: str, now: datetime) -> float:
        zone = _zone(zone)
        hour = _floor_hour(_utc(now, "now"))
        cached = self._cache.get(("latest", zone, hour))
        if cached is not None:
            return cached
        params = self._params(zone, {})
        where = self._shown(LATEST_PATH, zone, {})
        payload = await self._get(zone, LATEST_PATH, params)
        if not isinstance(payload, dict):
            raise ProviderError(f"expected a JSON object, got {type(payload).__name__}", zone=zone, where=where)
        self._check_zone(zone, where, payload)
        readings = self._readings(zone, where, [payload])
        if not readings:
            raise ProviderError("the answer has no reading (carbonIntensity is null)", zone=zone, where=where)
        at, value = next(iter(readings.items()))
        if at > hour:  # now is in the past for the service: answer from the hourly data
            value = float((await self.history(zone, hour, hour + _HOUR))[0])
        elif hour - at > LATEST_LAG_HOURS * _HOUR:
            raise ProviderError(
                f"the service's latest reading is for {_fmt(at)}, more than {LATEST_LAG_HOURS} h before the "
                f"hour asked for ({_fmt(hour)})", zone=zone, where=where,
            )
        self._cache.put(("latest", zone, hour), value)
        return value

    # --- requests ---

    def _service_zone(self, zone: str) -> str:
        return self.service_zones.get(zone, zone)

    def _params(self, zone: str, extra: Mapping[str, str]) -> dict[str, str]:
        return {"zone": self._service_zone(zone), **extra,
                "emissionFactorType": "lifecycle" if self.lifecycle else "direct"}

    @staticmethod
    def _range_params(start: datetime, end: datetime) -> dict[str, str]:
        return {"start": start.strftime("%Y-%m-%dT%H:%M:%SZ"), "end": end.strftime("%Y-%m-%dT%H:%M:%SZ")}

    def _shown(self, path: str, zone: str, extra: Mapping[str, str]) -> str:
        """``GET /path?query`` as errors and logs show it: no host, no token (the token is a header)."""
        return self._redact(f"GET {path}?{urlencode({'zone': self._service_zone(zone), **extra}, safe=':')}")

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text

    async def _history_answer(self, zone: str) -> dict[datetime, float]:
        where = self._shown(HISTORY_PATH, zone, {})
        payload = await self._get(zone, HISTORY_PATH, self._params(zone, {}))
        return self._readings(zone, where, self._list(zone, where, payload, "history"))

    async def _past_range_answer(self, zone: str, start: datetime, end: datetime) -> dict[datetime, float]:
        extra = self._range_params(start, end)
        where = self._shown(PAST_RANGE_PATH, zone, extra)
        payload = await self._get(zone, PAST_RANGE_PATH, self._params(zone, extra))
        readings = self._readings(zone, where, self._list(zone, where, payload, "data"))
        return {h: v for h, v in readings.items() if start <= h < end}

    def _keep(self, zone: str, readings: dict[datetime, float], wanted: list[datetime]) -> dict[datetime, float]:
        """Cache every hour the answer brought; return those asked for."""
        for h, v in readings.items():
            self._cache.put(("hourly", zone, h), v)
        return {h: readings[h] for h in wanted if h in readings}

    def _check_zone(self, zone: str, where: str, payload: dict[str, Any]) -> None:
        answered = payload.get("zone")
        asked = self._service_zone(zone)
        if answered is not None and answered != asked:
            raise ProviderError(f"the answer is for zone {answered!r}, not {asked!r}", zone=zone, where=where)

    def _list(self, zone: str, where: str, payload: Any, key: str) -> list[Any]:
        if not isinstance(payload, dict):
            raise ProviderError(f"expected a JSON object, got {type(payload).__name__}", zone=zone, where=where)
        self._check_zone(zone, where, payload)
        items = payload.get(key)
        if not isinstance(items, list):
            raise ProviderError(f"the answer has no {key!r} list", zone=zone, where=where)
        return items

    def _readings(self, zone: str, where: str, items: list[Any]) -> dict[datetime, float]:
        """``{hour: gCO2e/kWh}`` from the answer's entries; readings inside one hour are averaged; nulls skipped."""
        sums: dict[datetime, list[float]] = {}
        for k, item in enumerate(items):
            if not isinstance(item, dict):
                raise ProviderError(f"entry {k} is not a JSON object", zone=zone, where=where)
            raw_t, raw_v = item.get("datetime"), item.get("carbonIntensity")
            try:
                t = datetime.fromisoformat(str(raw_t))
            except ValueError:
                raise ProviderError(f"entry {k}: datetime {raw_t!r} is not an ISO 8601 time", zone=zone,
                                    where=where) from None
            if t.tzinfo is None:
                t = t.replace(tzinfo=UTC)
            if raw_v is None:
                continue  # the service has no value for this hour: a missing hour
            try:  # (an integer too large for a float is no more a reading than a string)
                v = math.nan if isinstance(raw_v, bool) or not isinstance(raw_v, int | float) else float(raw_v)
            except OverflowError:
                v = math.nan
            if not 0.0 <= v <= MAX_INTENSITY:
                shown = repr(raw_v) if len(repr(raw_v)) <= 40 else repr(raw_v)[:37] + "..."
                raise ProviderError(f"entry {k} ({_fmt(t)}): carbonIntensity {shown} is not a number from 0 to "
                                    f"{MAX_INTENSITY:g} gCO2e/kWh", zone=zone, where=where)
            sums.setdefault(_floor_hour(t.astimezone(UTC)), []).append(v)
        return {h: sum(vs) / len(vs) for h, vs in sorted(sums.items())}

    def _fill_gaps(self, zone: str, where: Callable[[datetime], str], hours: list[datetime],
                   values: np.ndarray) -> None:
        """Interpolate runs of NaN of at most MAX_GAP_HOURS inside ``values`` in place, or raise; ``where``
        names the request that should have had an hour."""
        missing = np.isnan(values)
        n = len(values)
        i = 0
        filled: list[str] = []
        while i < n:
            if not missing[i]:
                i += 1
                continue
            j = i
            while j < n and missing[j]:
                j += 1
            run = hours[i:j]
            if i == 0 or j == n:
                raise ProviderError(
                    f"the service has no data for the {_span_text(run)}, at the "
                    f"{'start' if i == 0 else 'end'} of the span asked for, so it cannot be interpolated",
                    zone=zone, where=where(run[0]),
                )
            if j - i > MAX_GAP_HOURS:
                raise ProviderError(
                    f"the service has no data for the {_span_text(run)}, longer than the {MAX_GAP_HOURS} h "
                    "that are interpolated", zone=zone, where=where(run[0]),
                )
            a, b = values[i - 1], values[j]
            for k in range(i, j):
                values[k] = a + (b - a) * (k - i + 1) / (j - i + 1)
            filled.append(f"{_span_text(run)} ({where(run[0])})")
            i = j
        log.info("carbon provider: zone %s: interpolated missing hours: %s", zone, "; ".join(filled))

    async def _get(self, zone: str, path: str, params: dict[str, str]) -> Any:
        shown = self._shown(path, zone, {k: v for k, v in params.items() if k in ("start", "end")})
        attempts = 0
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.retries + 1),
                wait=self._wait,
                retry=retry_if_exception_type(_Transient),
                before_sleep=lambda rs: self._log_retry(zone, shown, rs),
                reraise=True,
            ):
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    return await self._once(zone, shown, path, params)
        except _Transient as e:
            raise ProviderError(
                f"{self._redact(e.reason)}; gave up after {attempts} attempt{'s' if attempts != 1 else ''}",
                zone=zone, where=shown,
            ) from None
        raise AssertionError("not reached")  # pragma: no cover

    def _wait(self, rs: RetryCallState) -> float:
        exc = rs.outcome.exception() if rs.outcome is not None else None
        if isinstance(exc, _Transient) and exc.retry_after is not None:
            return min(exc.retry_after, self.max_retry_after_s)
        # exponential backoff with jitter: backoff_s, 2 x, 4 x ... (at most max_backoff_s) plus up to backoff_s
        backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (rs.attempt_number - 1))
        return backoff + random.uniform(0, self.backoff_s)

    def _log_retry(self, zone: str, shown: str, rs: RetryCallState) -> None:
        exc = rs.outcome.exception() if rs.outcome is not None else None
        reason = exc.reason if isinstance(exc, _Transient) else repr(exc)
        wait = rs.next_action.sleep if rs.next_action is not None else 0.0
        log.warning("carbon provider: zone %s: %s: %s; retry %d of %d in %.2f s", zone, shown, self._redact(reason),
                    rs.attempt_number, self.retries, wait)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json"}
            if self._token:
                headers["auth-token"] = self._token
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=headers)
        return self._session

    async def _once(self, zone: str, shown: str, path: str, params: dict[str, str]) -> Any:
        try:
            async with self._http().get(self.base_url + path, params=params) as resp:
                status, reason = resp.status, resp.reason or ""
                retry_after = resp.headers.get("Retry-After")
                body = await resp.read()
        except TimeoutError:
            raise _Transient(f"no answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientConnectionError as e:
            raise _Transient(f"cannot connect: {e or type(e).__name__}") from None
        except aiohttp.ClientPayloadError as e:
            raise _Transient(f"the answer was cut off: {e or type(e).__name__}") from None
        except aiohttp.ClientError as e:
            raise ProviderError(f"request failed: {self._redact(str(e) or type(e).__name__)}", zone=zone,
                                where=shown) from None
        what = f"HTTP {status} {reason}".rstrip()
        if status == 429 or status >= 500:
            raise _Transient(what, _retry_after_s(retry_after))
        if status in (401, 403):
            source = f"${self._token_env}" if self._token_env else "the configured token"
            hint = f"check {source}" if self._token else "no token was given (set token_env in the config)"
            raise ProviderError(f"{what}: the service refused the request; {hint}", zone=zone, where=shown)
        if status >= 400:
            raise ProviderError(f"{what}: {self._redact(_service_message(body))}", zone=zone, where=shown)
        if status != 200:
            raise ProviderError(f"{what}: expected 200", zone=zone, where=shown)
        try:
            return json.loads(body)
        except ValueError:
            excerpt = body[:80].decode("utf-8", "replace")
            raise ProviderError(f"the answer is not JSON: {self._redact(excerpt)!r}", zone=zone, where=shown) from None


def _service_message(body: bytes) -> str:
    """The service's own words about an error, short: ``{"message": ...}``/``{"error": ...}`` or the text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            if isinstance(data.get(key), str):
                text = data[key]
                break
    text = " ".join(text.split())
    return (text[:200] + "...") if len(text) > 200 else (text or "no message")


# --- configuration --------------------------------------------------------------------------------------


class FilesCarbonConfig(Spec):
    """Carbon intensity from files: the shipped slice ``data/carbon`` or the shared Electricity Maps folder."""

    kind: Literal["files"]
    path: Annotated[str, on_this_machine("a folder", "for an Electricity Maps service use kind: http with url")] = (
        Field(min_length=1, description="folder read by broker.data.carbon.load_carbon"))
    lifecycle: bool = Field(default=False, description="life-cycle (LCA) intensity instead of direct")


class HttpCarbonConfig(Spec):
    """Carbon intensity from a live Electricity Maps v3 API service."""

    kind: Literal["http"]
    url: HttpUrl = Field(description="base URL, e.g. https://api.electricitymap.org; paths /v3/... are added")
    token_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of the environment variable holding the auth-token (never the token itself)",
    )
    timeout_s: float = Field(default=5.0, gt=0, le=300)
    cache_ttl_s: float = Field(default=300.0, ge=0, le=86_400, description="0 turns the cache off")
    retries: int = Field(default=3, ge=0, le=10, description="retries after the first request; 0 turns them off")
    backoff_s: float = Field(default=0.5, ge=0, le=60, description="first retry wait, doubling, with jitter")
    max_retry_after_s: float = Field(default=30.0, ge=0, le=3600, description="cap on a Retry-After wait")
    lifecycle: bool = Field(default=False, description="life-cycle (LCA) intensity instead of direct")
    zones: dict[GridZoneId, str] = Field(
        default_factory=dict, description="canonical zone -> the service's zone id, added to SERVICE_ZONES",
    )


CarbonProviderConfig = Annotated[FilesCarbonConfig | HttpCarbonConfig, Field(discriminator="kind")]
"""``{kind: files, path}`` or ``{kind: http, url, token_env, timeout_s, cache_ttl_s, retries, ...}``."""

_CONFIG = TypeAdapter(CarbonProviderConfig)


def parse_carbon_provider_config(data: Any) -> FilesCarbonConfig | HttpCarbonConfig:
    """Validate a mapping (from YAML or JSON) as a :data:`CarbonProviderConfig`; raises pydantic's
    ``ValidationError`` (format it with :func:`broker.errors.problems`)."""
    return _CONFIG.validate_python(data)


def build_carbon_provider(
    cfg: FilesCarbonConfig | HttpCarbonConfig | Mapping[str, Any],
    *,
    clock: Clock | None = None,
    environ: Mapping[str, str] | None = None,
) -> CarbonProvider:
    """The provider a config describes. ``files`` loads the folder now (a ``CarbonDataError`` if it cannot);
    ``http`` reads its token from ``environ`` (default ``os.environ``), a ``ProviderError`` if ``token_env``
    names a variable that is unset or empty. Close the provider when done."""
    if not isinstance(cfg, FilesCarbonConfig | HttpCarbonConfig):
        cfg = parse_carbon_provider_config(cfg)
    if isinstance(cfg, FilesCarbonConfig):
        return FileCarbonProvider.load(cfg.path, lifecycle=cfg.lifecycle)
    env = os.environ if environ is None else environ
    token = None
    if cfg.token_env is not None:
        token = env.get(cfg.token_env, "").strip()
        if not token:
            raise ProviderError(f"token_env names ${cfg.token_env}, which is not set (or empty) in the environment")
    return HttpCarbonProvider(
        str(cfg.url), token, cfg.timeout_s, cfg.cache_ttl_s, cfg.retries,
        backoff_s=cfg.backoff_s, max_retry_after_s=cfg.max_retry_after_s, lifecycle=cfg.lifecycle,
        zones=cfg.zones, clock=clock, token_env=cfg.token_env,
    )
