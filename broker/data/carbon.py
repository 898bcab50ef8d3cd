"""Grid carbon intensity per grid zone, as a regular hourly UTC series in gCO2e/kWh.

What it reads
    A folder in one of two layouts (both may be mixed in one folder):

    - one sub-folder per zone holding any number of CSV files (any years), as Electricity Maps ships them:
      ``<ZONE>/<ZONE>_2021_hourly.csv`` with columns ``Datetime (UTC)``, ``Carbon Intensity gCO₂eq/kWh
      (direct)`` and ``Carbon Intensity gCO₂eq/kWh (LCA)`` (other columns are ignored); the files Electricity
      Maps publishes now (2023 on, and its re-issues of earlier years) name the life-cycle column
      ``Carbon intensity gCO₂eq/kWh (Life cycle)``, which is read the same;
    - flat files ``<zone>_ci.csv`` with columns ``Time`` and ``Carbon Intensity``, as the Let's Wait Awhile
      data ships them (15- or 30-minute steps, one series only).

    The zone is named by the folder or file name, never by the rows: ``BR-SP/`` holds rows whose
    ``Zone Id`` says ``BR-CS`` and loads as ``BR-SP`` (the report notes the difference). Names go through
    :func:`broker.ids.grid_zone`; Let's Wait Awhile file names go through :data:`LWA_FILE_ZONES` first.

Units and series
    gCO2e per kWh of electricity consumed. Direct (operational, combustion only) intensity by default;
    life-cycle (LCA, including construction and fuel supply) with ``lifecycle=True``. A single-series file
    has no life-cycle figure, so asking for one from it is an error naming the file.

Time
    Every series is hourly, UTC, regular: value ``i`` covers ``[start + i h, start + (i + 1) h)``.
    Timestamps are read as UTC: one with an offset (``+01:00``, ``Z``) is converted to UTC, a naive one is
    taken as UTC already (both shipped sources write UTC, so clock changes cause no repeated or missing
    local hours). A reading stamped inside an hour belongs to that hour.

How problems are handled (each one is a line of :attr:`CarbonData.report`, or an error)
    - sub-hourly readings are averaged into their hour (plain mean of the readings stamped in that hour);
    - duplicate timestamps (the same instant twice, also across files) are resolved by the mean of their
      values, and listed;
    - missing hours inside the series are filled by linear interpolation between the hours either side when
      the gap is at most ``max_gap_hours`` (default :data:`MAX_GAP_HOURS`, 6 h), and listed; a longer gap is
      a :class:`CarbonDataError` naming the zone and the missing span;
    - a non-numeric, non-finite or negative value, or an unreadable timestamp, is an error naming the file
      and the row (line number, header = line 1); so is a missing column, a folder with no data, a zone
      with no rows and a requested zone that is absent (the message lists the zones present).

Nothing here reads a clock or the network; loading all 16 Electricity Maps zones × 2 years takes about half
a second. The carbon scorer that uses this data is turned off by giving it weight 0, not here.
"""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NoReturn

import numpy as np

from broker.ids import UnknownIdentifier, grid_zone

__all__ = [
    "LWA_FILE_ZONES",
    "MAX_GAP_HOURS",
    "CarbonData",
    "CarbonDataError",
    "CarbonSpanError",
    "ZoneSeries",
    "load_carbon",
]

MAX_GAP_HOURS = 6
"""Longest run of missing hours filled by linear interpolation; a longer one is an error."""

# Let's Wait Awhile (Wiesner et al., Middleware 2021) names its files by country: ger_ci.csv is Germany, whose
# grid is the German-Luxembourg bidding zone DE-LU in Electricity Maps' ids. Keys are lower case.
LWA_FILE_ZONES: dict[str, str] = {"ger": "DE-LU", "gb": "GB", "fr": "FR"}

_FLAT_SUFFIX = "_ci.csv"
_HOUR = timedelta(hours=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_LISTED = 5  # items listed per report line before "and N more"
_MAX_ROW_SHOWN = 120  # characters of a malformed row quoted in an error

# Column names, compared after _col() normalisation (lower case, CO₂ written CO2, spaces collapsed).
_TIME_COLUMNS = ("datetime (utc)", "time", "datetime")
_DIRECT_COLUMN = "carbon intensity gco2eq/kwh (direct)"
_LCA_COLUMNS = ("carbon intensity gco2eq/kwh (lca)", "carbon intensity gco2eq/kwh (life cycle)")
_SINGLE_COLUMN = "carbon intensity"
_ZONE_ID_COLUMN = "zone id"


class CarbonDataError(ValueError):
    """The carbon data cannot be loaded or does not cover what was asked; the message says what and where."""


class CarbonSpanError(CarbonDataError):
    """A time or interval lies outside the hours a zone's data covers; the message names the zone and span."""


@dataclass(frozen=True, slots=True)
class ZoneSeries:
    """One zone's hourly series: ``g_co2_per_kwh[i]`` covers ``[start + i h, start + (i + 1) h)``, UTC."""

    zone: str
    start: datetime
    g_co2_per_kwh: np.ndarray  # float64, read-only
    _cumulative: np.ndarray = field(repr=False)  # [0, v0, v0+v1, ...]: the integral in gCO2e/kWh·h

    @property
    def end(self) -> datetime:
        """The end of the last covered hour (exclusive)."""
        return self.start + len(self.g_co2_per_kwh) * _HOUR


class CarbonData:
    """Hourly carbon intensity for a set of grid zones, with the notes written while loading it."""

    def __init__(self, series: Mapping[str, ZoneSeries], report: Iterable[str] = (), *, lifecycle: bool = False):
        self.by_zone: dict[str, ZoneSeries] = dict(sorted(series.items()))
        self.report: list[str] = list(report)
        self.lifecycle = lifecycle

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, tuple[datetime, Sequence[float] | np.ndarray]], *, lifecycle: bool = False
    ) -> CarbonData:
        """Build from ``{zone: (start hour, hourly gCO2e/kWh values)}``: for tests and synthetic scenarios."""
        return cls({z: _zone_series(grid_zone(z), start, np.asarray(v, dtype=np.float64))
                    for z, (start, v) in arrays.items()}, lifecycle=lifecycle)

    def __repr__(self) -> str:
        kind = "life-cycle" if self.lifecycle else "direct"
        return f"CarbonData({kind}, zones={list(self.by_zone)})"

    def zones(self) -> tuple[str, ...]:
        """The canonical grid zone ids loaded, sorted."""
        return tuple(self.by_zone)

    def span(self, zone: str) -> tuple[datetime, datetime]:
        """``(start, end)`` of the covered hours, UTC; ``end`` is exclusive (the end of the last hour)."""
        s = self._get(zone)
        return s.start, s.end

    def intensity(self, zone: str, when: datetime) -> float:
        """gCO2e/kWh of the hour containing ``when`` (timezone-aware)."""
        s = self._get(zone)
        i = _aware(when, "when") - s.start
        idx = i // _HOUR
        if not 0 <= idx < len(s.g_co2_per_kwh):
            raise CarbonSpanError(f"{_fmt(when)} is outside {_covers(s)}")
        return float(s.g_co2_per_kwh[idx])

    def series(self, zone: str, start: datetime, hours: int) -> np.ndarray:
        """``hours`` hourly values (gCO2e/kWh) from the hour containing ``start``: a read-only view."""
        s = self._get(zone)
        if hours < 0:
            raise CarbonDataError(f"hours must be 0 or more, not {hours}")
        idx = (_aware(start, "start") - s.start) // _HOUR
        if idx < 0 or idx + hours > len(s.g_co2_per_kwh):
            raise CarbonSpanError(
                f"the {hours} hours from {_fmt(s.start + idx * _HOUR)} are not all inside {_covers(s)}"
            )
        return s.g_co2_per_kwh[idx: idx + hours]

    def mean_over(self, zone: str, start: datetime, end: datetime) -> float:
        """Time-weighted mean gCO2e/kWh over ``[start, end)``, exact for partial hours at both ends.

        Energy (kWh) used evenly over the interval times this mean is its carbon (gCO2e). An empty interval
        (``start == end``) gives the intensity at ``start``.
        """
        s = self._get(zone)
        a, b = self._offsets(s, start, end)
        v = s.g_co2_per_kwh
        i, j = math.floor(a), math.floor(b)
        if b == a:
            return float(v[min(i, len(v) - 1)])
        if i == j:
            return float(v[i])
        total = v[i] * (i + 1 - a) + float(v[i + 1: j].sum())
        if j < len(v):
            total += v[j] * (b - j)
        return float(total / (b - a))

    def mean_over_many(self, zone: str, starts: Sequence[datetime] | np.ndarray,
                       ends: Sequence[datetime] | np.ndarray) -> np.ndarray:
        """Vectorised :meth:`mean_over` for many intervals of one zone.

        ``starts`` and ``ends`` are sequences of timezone-aware datetimes or ``datetime64`` arrays (read as
        UTC). Uses a cumulative sum, so results agree with :meth:`mean_over` to about 1e-9 relative.
        """
        s = self._get(zone)
        a = (_epoch_seconds(starts, "starts") - _seconds(s.start)) / 3600.0
        b = (_epoch_seconds(ends, "ends") - _seconds(s.start)) / 3600.0
        if a.shape != b.shape:
            raise CarbonDataError(f"starts and ends differ in length: {a.shape} and {b.shape}")
        n = len(s.g_co2_per_kwh)
        bad = (a < 0) | (a >= n) | (b > n) | (b < a)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            what = "ends before it starts" if b[k] < a[k] else f"is not inside {_covers(s)}"
            raise CarbonSpanError(f"interval {k} ({a[k]:+.3f} h to {b[k]:+.3f} h from {_fmt(s.start)}) {what}")
        v, cum = s.g_co2_per_kwh, s._cumulative
        ka = np.minimum(np.floor(a).astype(np.int64), n - 1)
        kb = np.minimum(np.floor(b).astype(np.int64), n - 1)
        ia = cum[ka] + (a - ka) * v[ka]
        ib = cum[kb] + (b - kb) * v[kb]
        width = b - a
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(width > 0, (ib - ia) / np.where(width > 0, width, 1.0), v[ka])

    # --- helpers ---

    def _get(self, zone: str) -> ZoneSeries:
        s = self.by_zone.get(zone)
        if s is None:
            try:
                s = self.by_zone.get(grid_zone(zone))
            except UnknownIdentifier:
                s = None
        if s is None:
            raise CarbonDataError(f"no carbon data for zone {zone!r}; zones loaded: {', '.join(self.by_zone)}")
        return s

    @staticmethod
    def _offsets(s: ZoneSeries, start: datetime, end: datetime) -> tuple[float, float]:
        a = (_aware(start, "start") - s.start) / _HOUR
        b = (_aware(end, "end") - s.start) / _HOUR
        if b < a:
            raise CarbonSpanError(f"the interval from {_fmt(start)} to {_fmt(end)} ends before it starts")
        if a < 0 or b > len(s.g_co2_per_kwh) or (a == b == len(s.g_co2_per_kwh)):
            raise CarbonSpanError(f"the interval from {_fmt(start)} to {_fmt(end)} is not inside {_covers(s)}")
        return a, b


# --- loading --------------------------------------------------------------------------------------------


def load_carbon(
    path: str | Path,
    *,
    lifecycle: bool = False,
    zones: Iterable[str] | None = None,
    max_gap_hours: int = MAX_GAP_HOURS,
) -> CarbonData:
    """Load every zone under ``path`` (or only ``zones``) as hourly UTC gCO2e/kWh; see the module docstring."""
    root = Path(path)
    sources = _discover(root)
    if zones is not None:
        wanted = []
        for z in zones:
            try:
                wanted.append(grid_zone(z))
            except UnknownIdentifier as err:
                raise CarbonDataError(f"requested zone {z!r}: {err}") from None
        absent = [z for z in wanted if z not in sources]
        if absent:
            raise CarbonDataError(
                f"zone{'s' if len(absent) > 1 else ''} {', '.join(absent)} not in {root}; "
                f"zones present: {', '.join(sorted(sources))}"
            )
        sources = {z: sources[z] for z in dict.fromkeys(wanted)}
    report: list[str] = []
    series = {zone: _load_zone(zone, files, lifecycle, max_gap_hours, report) for zone, files in sources.items()}
    return CarbonData(series, report, lifecycle=lifecycle)


def _discover(root: Path) -> dict[str, list[Path]]:
    """Map each canonical zone to its CSV files, from zone folders and flat ``<zone>_ci.csv`` files."""
    if not root.is_dir():
        raise CarbonDataError(f"carbon data folder {root} does not exist or is not a folder")
    found: dict[str, list[Path]] = {}
    origin: dict[str, Path] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_dir():
            name, files = entry.name, sorted(p for p in entry.glob("*.csv") if p.is_file())
            if not files:
                raise CarbonDataError(f"zone folder {entry} holds no CSV files")
        elif entry.is_file() and entry.name.lower().endswith(_FLAT_SUFFIX):
            stem = entry.name[: -len(_FLAT_SUFFIX)]
            name, files = LWA_FILE_ZONES.get(stem.lower(), stem), [entry]
        else:
            continue
        try:
            zone = grid_zone(name)
        except UnknownIdentifier as err:
            raise CarbonDataError(
                f"{entry} does not name a grid zone ({err}); {root} should hold one folder per zone "
                f"or <zone>{_FLAT_SUFFIX} files"
            ) from None
        if zone in found:
            raise CarbonDataError(f"zone {zone} appears twice in {root}: as {origin[zone].name} and {entry.name}")
        found[zone], origin[zone] = files, entry
    if not found:
        raise CarbonDataError(
            f"no carbon data in {root}: expected one folder per zone holding CSV files, "
            f"or <zone>{_FLAT_SUFFIX} files"
        )
    return found


def _col(name: str) -> str:
    return " ".join(name.replace("₂", "2").strip().lower().split())


@dataclass(slots=True)
class _FileRows:
    seconds: np.ndarray
    values: np.ndarray
    zone_ids: set[str]


def _read_file(file: Path, lifecycle: bool) -> _FileRows:
    try:
        return _parse_file(file, lifecycle)
    # Neither names the file: a file saved in another encoding, or a quote left open that runs the rest of
    # the file into one field past the csv module's limit (128 KiB).
    except UnicodeDecodeError as exc:
        raise CarbonDataError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8 CSV"
                              ) from None
    except csv.Error as exc:
        raise CarbonDataError(f"{file}: not a readable CSV ({exc}); look for a quote that is never closed"
                              ) from None


def _parse_file(file: Path, lifecycle: bool) -> _FileRows:
    with file.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            return _FileRows(np.empty(0, np.int64), np.empty(0), set())
        cols = {_col(h): i for i, h in enumerate(header)}
        t_col = next((cols[c] for c in _TIME_COLUMNS if c in cols), None)
        if t_col is None:
            raise CarbonDataError(f"{file} has no time column 'Datetime (UTC)' or 'Time'; its columns: {header}")
        if lifecycle:
            v_col = next((cols[c] for c in _LCA_COLUMNS if c in cols), None)
            if v_col is None and _SINGLE_COLUMN in cols:
                raise CarbonDataError(
                    f"{file} has a single series ('Carbon Intensity'), no life-cycle (LCA) one; "
                    "load it with lifecycle=False"
                )
            wanted = "Carbon Intensity gCO₂eq/kWh (LCA)' or 'Carbon intensity gCO₂eq/kWh (Life cycle)"
        else:
            v_col = cols.get(_DIRECT_COLUMN, cols.get(_SINGLE_COLUMN))
            wanted = "Carbon Intensity gCO₂eq/kWh (direct)' or 'Carbon Intensity"
        if v_col is None:
            raise CarbonDataError(f"{file} has no column '{wanted}'; its columns: {header}")
        z_col = cols.get(_ZONE_ID_COLUMN)
        rows = [r for r in reader if r]
    width = max(t_col, v_col) + 1
    if any(len(r) < width for r in rows):
        _raise_bad_row(file, t_col, v_col)
    times = [r[t_col] for r in rows]
    seconds = _parse_times(times)
    if seconds is None:
        _raise_bad_row(file, t_col, v_col)
    try:
        values = np.array([r[v_col] for r in rows], dtype=np.float64)
    except ValueError:
        _raise_bad_row(file, t_col, v_col)
    if not (np.isfinite(values).all() and (values >= 0).all()):
        _raise_bad_row(file, t_col, v_col)
    zone_ids = {r[z_col] for r in rows if len(r) > z_col} if z_col is not None else set()
    return _FileRows(seconds, values, zone_ids)


def _parse_times(times: list[str]) -> np.ndarray | None:
    """Epoch seconds (int64) for each timestamp, or None if one cannot be read (the caller finds which)."""
    if all(len(t) == 19 for t in times):  # the plain naive form "YYYY-MM-DD HH:MM:SS": parse in bulk as UTC
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                parsed = np.array(times, dtype="datetime64[s]")
        except (ValueError, UserWarning, DeprecationWarning):
            parsed = None  # an offset or an odd form: read row by row below
        if parsed is not None and not np.isnat(parsed).any():
            return parsed.astype(np.int64)
    out = np.empty(len(times), np.int64)
    for k, t in enumerate(times):
        sec = _parse_one(t)
        if sec is None:
            return None
        out[k] = sec
    return out


def _parse_one(text: str) -> int | None:
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return math.floor(dt.timestamp())


def _raise_bad_row(file: Path, t_col: int, v_col: int) -> NoReturn:
    """Re-read ``file`` row by row and raise an error naming the first bad row (line number)."""
    with file.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        next(reader)
        for row in reader:
            if not row:
                continue
            line = reader.line_num
            if len(row) <= max(t_col, v_col):
                # The row as read, cut short: one whose quote is never closed holds the rest of the file.
                shown = repr(row)
                shown = shown if len(shown) <= _MAX_ROW_SHOWN else shown[:_MAX_ROW_SHOWN] + " ..."
                raise CarbonDataError(f"{file}, row {line}: only {len(row)} fields: {shown}")
            if _parse_one(row[t_col]) is None:
                raise CarbonDataError(f"{file}, row {line}: {row[t_col]!r} is not a timestamp (YYYY-MM-DD HH:MM:SS)")
            raw = row[v_col]
            try:
                value = float(raw)
            except ValueError:
                raise CarbonDataError(f"{file}, row {line}: carbon intensity {raw!r} is not a number") from None
            if not math.isfinite(value) or value < 0:
                raise CarbonDataError(
                    f"{file}, row {line}: carbon intensity {raw!r} is not a finite number of 0 or more"
                )
    raise CarbonDataError(f"{file}: a row could not be read")  # not reached: the caller saw a bad row


def _load_zone(zone: str, files: list[Path], lifecycle: bool, max_gap: int, report: list[str]) -> ZoneSeries:
    parts = [_read_file(f, lifecycle) for f in files]
    seconds = np.concatenate([p.seconds for p in parts])
    values = np.concatenate([p.values for p in parts])
    if seconds.size == 0:
        raise CarbonDataError(f"zone {zone} has no rows in {', '.join(str(f) for f in files)}")

    other_ids = sorted(set().union(*(p.zone_ids for p in parts)) - {zone})
    if other_ids:
        report.append(f"{zone}: rows name zone {', '.join(other_ids)}; loaded as {zone}, its folder's name")

    # 1. duplicate timestamps: mean of their values
    stamps, inverse, counts = np.unique(seconds, return_inverse=True, return_counts=True)
    per_stamp = np.bincount(inverse, weights=values) / counts
    if (counts > 1).any():
        dup = np.flatnonzero(counts > 1)
        listed = [f"{_fmt_s(stamps[k])} ({counts[k]} rows: "
                  f"{', '.join(f'{x:g}' for x in values[inverse == k])})" for k in dup[:_MAX_LISTED]]
        report.append(
            f"{zone}: {len(dup)} duplicate timestamp{'s' if len(dup) > 1 else ''} resolved by the mean of "
            f"their rows: {'; '.join(listed)}{_more(len(dup))}"
        )

    # 2. readings within an hour: mean into that hour
    hours, h_inverse, h_counts = np.unique(stamps // 3600, return_inverse=True, return_counts=True)
    per_hour = np.bincount(h_inverse, weights=per_stamp) / h_counts
    if len(hours) < len(stamps):
        steps = np.unique(np.diff(stamps))
        steps_txt = ", ".join(f"{s // 60} min" for s in steps[steps < 3600][:4])
        report.append(f"{zone}: {len(stamps)} readings ({steps_txt} steps) averaged into {len(hours)} hours")
    elif (stamps % 3600).any():
        report.append(f"{zone}: {int((stamps % 3600 != 0).sum())} readings not on the hour taken as their hour's")

    # 3. missing hours: interpolate short gaps, refuse long ones
    gap_after = np.flatnonzero(np.diff(hours) > 1)
    if gap_after.size:
        lengths = hours[gap_after + 1] - hours[gap_after] - 1
        spans = [f"{_fmt_s((hours[k] + 1) * 3600)} to {_fmt_s((hours[k + 1] - 1) * 3600)} ({n} h)"
                 for k, n in zip(gap_after, lengths, strict=True)]
        long = [sp for sp, n in zip(spans, lengths, strict=True) if n > max_gap]
        if long:
            raise CarbonDataError(
                f"zone {zone} has no data from {long[0]}"
                f"{f' and {len(long) - 1} more gaps' if len(long) > 1 else ''}; the longest gap filled by "
                f"interpolation is {max_gap} h (max_gap_hours)"
            )
        report.append(
            f"{zone}: {int(lengths.sum())} missing hours in {len(spans)} gap{'s' if len(spans) > 1 else ''} filled "
            f"by linear interpolation: {'; '.join(spans[:_MAX_LISTED])}{_more(len(spans))}"
        )
        full = np.arange(hours[0], hours[-1] + 1)
        per_hour = np.interp(full, hours, per_hour)

    start = _EPOCH + timedelta(hours=int(hours[0]))
    return _zone_series(zone, start, per_hour)


def _zone_series(zone: str, start: datetime, values: np.ndarray) -> ZoneSeries:
    start = _aware(start, "start")
    if start != start.replace(minute=0, second=0, microsecond=0):
        raise CarbonDataError(f"a zone series must start on the hour, not at {_fmt(start)}")
    if values.ndim != 1 or values.size == 0:
        raise CarbonDataError(f"zone {zone} needs a non-empty one-dimensional series of hourly values")
    values = np.array(values, dtype=np.float64)  # own copy
    values.setflags(write=False)
    cumulative = np.concatenate(([0.0], np.cumsum(values)))
    cumulative.setflags(write=False)
    return ZoneSeries(zone, start.astimezone(UTC), values, cumulative)


# --- small helpers --------------------------------------------------------------------------------------


def _aware(when: datetime, what: str) -> datetime:
    if when.tzinfo is None or when.utcoffset() is None:
        raise CarbonDataError(f"{what} must be a timezone-aware datetime (UTC), not the naive {when.isoformat()}")
    return when


def _seconds(when: datetime) -> float:
    return (when - _EPOCH).total_seconds()


def _epoch_seconds(times: Sequence[datetime] | np.ndarray, what: str) -> np.ndarray:
    if isinstance(times, np.ndarray) and np.issubdtype(times.dtype, np.datetime64):
        return times.astype("datetime64[us]").astype(np.int64) / 1e6
    return np.array([_seconds(_aware(t, what)) for t in times], dtype=np.float64)


def _fmt(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _fmt_s(seconds: int | np.integer) -> str:
    return _fmt(_EPOCH + timedelta(seconds=int(seconds)))


def _covers(s: ZoneSeries) -> str:
    return f"{s.zone}'s carbon data, which covers {_fmt(s.start)} to {_fmt(s.end)} (end exclusive)"


def _more(n: int) -> str:
    return f" and {n - _MAX_LISTED} more" if n > _MAX_LISTED else ""
