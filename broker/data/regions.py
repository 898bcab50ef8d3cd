"""GCP region coordinates (``regions.json``) and yearly grid carbon per GCP region (``carbon.csv``).

What it gives:

- :func:`load_gcp_regions` → :class:`RegionTable`: per canonical region ``gcp:<region>`` its display name,
  ``latitude_deg`` and ``longitude_deg`` (WGS84 degrees, north and east positive), exactly as the file has
  them. :meth:`RegionTable.great_circle_km` gives the distance between two regions in kilometres.
- :func:`load_gcp_region_carbon` → ``dict[region, RegionCarbon]``: Google's yearly grid carbon intensity
  (``g_co2_per_kwh``, gCO2eq/kWh) and carbon-free-energy share (``cfe_fraction``, 0..1) per region — a
  convenience for a coarse carbon score when no hourly zone data is wired up; the hourly Electricity
  Maps data is the better source where a zone exists.
- :func:`great_circle_km`: haversine distance on a sphere of the mean Earth radius (6371.0088 km); it is
  within 0.5 % of the ellipsoidal distance, far better than anything a scheduler needs.

Suspicious coordinates are reported, never corrected: :attr:`RegionTable.problems` (also returned by
:meth:`RegionTable.validate`) lists each one with the region, the field, the value and why it is
suspicious, and a suggested value where one is obvious (a flipped sign). Each region is checked against
the country its name states (a bounding-box table, :data:`COUNTRY_BOXES`), against the part of the world
its region id states (``us-``, ``europe-``, … :data:`REGION_PREFIX_BOXES`), and for the valid degree range;
a name whose country the table lacks is reported as unchecked. A caller that agrees with the suggestions
takes :meth:`RegionTable.with_suggested_fixes`, which returns a new table and leaves this one alone.

Errors: malformed input (unreadable JSON, a missing or non-numeric field, a region id that is not a GCP
region, a duplicate region) raises :class:`DataFileError`, a ``ValueError`` naming the file and the
row / region and column. The price and latency loaders raise the same class.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from broker import ids

EARTH_MEAN_RADIUS_KM = 6371.0088


class DataFileError(ValueError):
    """A data file is malformed; the message names the file, the row (line number, 1 = header) or key,
    and the column, and says what was wrong."""

    def __init__(self, path: str | Path, where: str, problem: str) -> None:
        self.path = str(path)
        self.where = where
        self.problem = problem
        super().__init__(f"{self.path}: {where}: {problem}")


# --- distance -----------------------------------------------------------------------------------------


def great_circle_km(a_lat_lon_deg: tuple[float, float], b_lat_lon_deg: tuple[float, float]) -> float:
    """Great-circle (haversine) distance in km between two (latitude, longitude) points in degrees."""
    lat1, lon1 = map(math.radians, a_lat_lon_deg)
    lat2, lon2 = map(math.radians, b_lat_lon_deg)
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_MEAN_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


# --- plausibility tables ------------------------------------------------------------------------------

# (lat_min, lat_max, lon_min, lon_max) in degrees, rounded outwards by about half a degree. Keys are the
# country as the last comma-separated part of a region's name (or the whole name) says it, lower case.
COUNTRY_BOXES: dict[str, tuple[float, float, float, float]] = {
    "south africa": (-35.0, -22.0, 16.0, 33.0),
    "republic of china": (21.5, 25.5, 119.5, 122.5),  # Taiwan
    "people's republic of china": (18.0, 54.0, 73.0, 135.0),  # includes Hong Kong
    "japan": (24.0, 46.0, 122.5, 146.0),
    "south korea": (33.0, 39.0, 124.5, 131.0),
    "india": (6.5, 35.5, 68.0, 97.5),
    "singapore": (1.1, 1.5, 103.6, 104.1),
    "indonesia": (-11.0, 6.0, 95.0, 141.0),
    "australia": (-44.0, -10.0, 113.0, 154.0),
    "poland": (49.0, 55.0, 14.0, 24.5),
    "finland": (59.5, 70.5, 20.0, 32.0),
    "sweden": (55.0, 69.5, 11.0, 24.5),
    "spain": (36.0, 44.0, -9.5, 4.5),
    "belgium": (49.5, 51.5, 2.5, 6.5),
    "uk": (49.5, 61.0, -8.5, 2.0),
    "germany": (47.0, 55.5, 5.5, 15.5),
    "netherlands": (50.5, 53.7, 3.3, 7.3),
    "switzerland": (45.8, 48.0, 5.9, 10.6),
    "italy": (36.5, 47.2, 6.6, 18.6),
    "france": (41.3, 51.2, -5.2, 9.6),
    "israel": (29.4, 33.4, 34.2, 35.9),
    "qatar": (24.4, 26.2, 50.7, 51.7),
    "kingdom of saudi arabia": (16.0, 32.5, 34.5, 55.7),
    "canada": (41.6, 83.2, -141.1, -52.5),
    "mexico": (14.5, 32.8, -118.5, -86.7),
    "brazil": (-34.0, 5.5, -74.0, -34.7),
    "chile": (-56.0, -17.5, -76.0, -66.4),
    "usa": (24.4, 49.5, -125.0, -66.9),  # contiguous states; GCP has no region in Alaska or Hawaii
}

# What a GCP region id's first part promises, as a (lat_min, lat_max, lon_min, lon_max) box: a check that
# does not depend on the (hand-written) display name.
REGION_PREFIX_BOXES: dict[str, tuple[float, float, float, float]] = {
    "us": (24.4, 49.5, -125.0, -66.9),
    "northamerica": (14.0, 84.0, -170.0, -50.0),
    "southamerica": (-56.0, 13.0, -82.0, -34.0),
    "europe": (35.0, 72.0, -25.0, 45.0),
    "asia": (-11.0, 56.0, 60.0, 150.0),
    "australia": (-45.0, -10.0, 110.0, 155.0),
    "me": (12.0, 42.0, 25.0, 63.0),
    "africa": (-35.0, 38.0, -18.0, 52.0),
}

_KNOWN_FIELDS = frozenset({"name", "flag", "latitude", "longitude"})


def _inside(lat: float, lon: float, box: tuple[float, float, float, float]) -> bool:
    lat_min, lat_max, lon_min, lon_max = box
    return lat_min <= lat <= lat_max and lon_min <= lon <= lon_max


def _box_text(box: tuple[float, float, float, float]) -> str:
    return f"latitude {box[0]:+g}..{box[1]:+g}, longitude {box[2]:+g}..{box[3]:+g}"


# --- the region table ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Region:
    """One GCP region as the file gives it."""

    region: str  # canonical, gcp:<region>
    name: str
    latitude_deg: float
    longitude_deg: float

    @property
    def lat_lon_deg(self) -> tuple[float, float]:
        return (self.latitude_deg, self.longitude_deg)


@dataclass(frozen=True, slots=True)
class RegionProblem:
    """A suspicious value in the region file. ``suggested`` is a likely correct value, or None."""

    region: str
    field: str
    value: object
    reason: str
    suggested: float | None = None

    def __str__(self) -> str:
        hint = f" (suggested: {self.suggested:+g})" if self.suggested is not None else ""
        return f"{self.region}: {self.field}={self.value!r}: {self.reason}{hint}"


class RegionTable(Mapping[str, Region]):
    """Regions by canonical id (``gcp:us-east1``); a ``Mapping[str, Region]``. Lookups accept any
    spelling :func:`broker.ids.region` accepts (``gcp:us-east1-b``)."""

    def __init__(self, regions: Mapping[str, Region], problems: list[RegionProblem], path: str = "") -> None:
        self._regions = dict(sorted(regions.items()))
        self.path = path
        self.problems: list[RegionProblem] = problems

    def __getitem__(self, region: str) -> Region:
        key = ids.region(region)
        try:
            return self._regions[key]
        except KeyError:
            raise KeyError(f"region {key!r} is not in the region table {self.path or ''}".rstrip()) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(self._regions)

    def coordinates(self) -> dict[str, tuple[float, float]]:
        """``{region: (latitude_deg, longitude_deg)}``, the form :mod:`broker.data.prices` takes."""
        return {k: r.lat_lon_deg for k, r in self._regions.items()}

    def great_circle_km(self, a: str, b: str) -> float:
        """Great-circle distance in km between two regions of this table."""
        return great_circle_km(self[a].lat_lon_deg, self[b].lat_lon_deg)

    def validate(self) -> list[RegionProblem]:
        """The problems found when the file was loaded (the same list as :attr:`problems`)."""
        return list(self.problems)

    def with_suggested_fixes(self, problems: list[RegionProblem] | None = None) -> RegionTable:
        """A new table with the ``suggested`` value of each given problem (default: all that have one)
        applied; the problems applied are dropped from the new table's list. This table is unchanged."""
        chosen = [p for p in (self.problems if problems is None else problems) if p.suggested is not None]
        regions = dict(self._regions)
        for p in chosen:
            field = {"latitude": "latitude_deg", "longitude": "longitude_deg"}[p.field]
            regions[p.region] = replace(regions[p.region], **{field: p.suggested})
        remaining = [p for p in self.problems if p not in chosen]
        return RegionTable(regions, remaining, self.path)


def _check_region(key: str, raw: Mapping[str, object], region: Region) -> list[RegionProblem]:
    out: list[RegionProblem] = []
    lat, lon = region.latitude_deg, region.longitude_deg
    if not -90.0 <= lat <= 90.0:
        out.append(RegionProblem(key, "latitude", lat, "outside -90..90 degrees"))
    if not -180.0 <= lon <= 180.0:
        out.append(RegionProblem(key, "longitude", lon, "outside -180..180 degrees"))

    country = region.name.rsplit(",", 1)[-1].strip().lower()
    box = COUNTRY_BOXES.get(country)
    if box is None:
        out.append(RegionProblem(
            key, "name", region.name,
            f"cannot check the coordinates: country {country!r} is not in COUNTRY_BOXES; add it",
        ))
    elif not _inside(lat, lon, box):
        where = f"({lat:+g}, {lon:+g}) is outside {country} ({_box_text(box)})"
        if _inside(-lat, lon, box):
            out.append(RegionProblem(key, "latitude", lat, f"{where}; {-lat:+g} would be inside: "
                                     "the latitude's sign looks wrong (wrong hemisphere)", suggested=-lat))
        elif _inside(lat, -lon, box):
            out.append(RegionProblem(key, "longitude", lon, f"{where}; {-lon:+g} would be inside: "
                                     "the longitude's sign looks wrong", suggested=-lon))
        elif _inside(lon, lat, box):
            out.append(RegionProblem(key, "latitude", lat, f"{where}; latitude and longitude look swapped"))
        else:
            out.append(RegionProblem(key, "latitude", lat, where))

    prefix = key.removeprefix("gcp:").split("-", 1)[0]
    pbox = REGION_PREFIX_BOXES.get(prefix)
    if pbox is None:
        out.append(RegionProblem(key, "region", key, f"region prefix {prefix!r} is not in REGION_PREFIX_BOXES"))
    elif not _inside(lat, lon, pbox) and not any(p.suggested is not None for p in out):
        out.append(RegionProblem(
            key, "latitude", lat,
            f"({lat:+g}, {lon:+g}) is outside what the id's {prefix!r} implies ({_box_text(pbox)})",
        ))

    for extra in sorted(set(raw) - _KNOWN_FIELDS):
        out.append(RegionProblem(
            key, extra, raw[extra], "a field no other region has; the loader ignores it",
        ))
    return out


def _number(path: Path, where: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise DataFileError(path, where, f"field {field!r}: {value!r} is not a number")
    try:
        out = float(value)
    except ValueError:
        raise DataFileError(path, where, f"field {field!r}: {value!r} is not a number") from None
    if not math.isfinite(out):
        raise DataFileError(path, where, f"field {field!r}: {value!r} is not a finite number")
    return out


def load_gcp_regions(path: str | Path) -> RegionTable:
    """Read ``regions.json`` (``{"<region>": {"name", "latitude", "longitude", ...}}``) into a
    :class:`RegionTable` with every suspicious value in :attr:`RegionTable.problems`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataFileError(path, f"line {e.lineno}", f"not valid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise DataFileError(path, "top level", "expected an object mapping region ids to region objects")
    regions: dict[str, Region] = {}
    problems: list[RegionProblem] = []
    for raw_key, raw in data.items():
        where = f"region {raw_key!r}"
        try:
            key = ids.region(f"gcp:{raw_key}")
        except ids.UnknownIdentifier as e:
            raise DataFileError(path, where, f"not a GCP region id ({e})") from None
        if key in regions:
            raise DataFileError(path, where, f"{key} appears twice (zone suffixes are dropped)")
        if not isinstance(raw, dict):
            raise DataFileError(path, where, "expected an object with name, latitude and longitude")
        for field in ("name", "latitude", "longitude"):
            if field not in raw:
                raise DataFileError(path, where, f"field {field!r} is missing")
        region = Region(
            key, str(raw["name"]),
            _number(path, where, "latitude", raw["latitude"]),
            _number(path, where, "longitude", raw["longitude"]),
        )
        regions[key] = region
        problems.extend(_check_region(key, raw, region))
    return RegionTable(regions, problems, str(path))


# --- carbon -------------------------------------------------------------------------------------------

CARBON_COLUMNS = {
    "region": "Google Cloud Region",
    "location": "Location",
    "cfe_fraction": "Google CFE",
    "g_co2_per_kwh": "Grid carbon intensity (gCO2eq / kWh)",
}


@dataclass(frozen=True, slots=True)
class RegionCarbon:
    """One row of ``carbon.csv``: yearly averages Google publishes per region."""

    region: str  # canonical, gcp:<region>
    location: str
    cfe_fraction: float  # share of the region's hourly consumption matched by carbon-free energy, 0..1
    g_co2_per_kwh: float  # average location-based grid intensity, gCO2eq/kWh


def read_csv_rows(path: Path, required: list[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, row) after checking the header has every required column. Shared by the loaders.

    A file that is not UTF-8, or whose quote is never closed (the rest of the file runs into one field past
    the csv module's limit, 128 KiB), is a :class:`DataFileError` naming it, not the csv module's bare error."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise DataFileError(path, "line 1 (header)", f"missing column(s) {', '.join(map(repr, missing))}; "
                                    f"the header has {', '.join(map(repr, header)) or 'nothing'}")
            for row in reader:
                if None in row or any(v is None for v in row.values()):
                    raise DataFileError(path, f"line {reader.line_num}", f"expected {len(header)} fields")
                yield reader.line_num, row
        except UnicodeDecodeError as e:
            raise DataFileError(path, f"byte {e.start}", f"not UTF-8 text ({e.reason}); save it as UTF-8 CSV") from None
        except csv.Error as e:
            # reader.line_num is still the last row read whole: the bad one starts after it
            raise DataFileError(path, f"after line {reader.line_num}", f"not a readable CSV ({e}); look for a quote "
                                "that is never closed") from None


def csv_float(path: Path, line: int, row: Mapping[str, str], column: str, *, empty_ok: bool = False) -> float | None:
    text = row[column].strip()
    if text == "" and empty_ok:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise DataFileError(path, f"line {line}", f"column {column!r}: {row[column]!r} is not a number")
    return value


def load_gcp_region_carbon(path: str | Path) -> dict[str, RegionCarbon]:
    """Read ``carbon.csv`` (columns ``Google Cloud Region``, ``Location``, ``Google CFE`` (0..1) and
    ``Grid carbon intensity (gCO2eq / kWh)``) into ``{canonical region: RegionCarbon}``. A CFE share
    outside 0..1, a negative intensity or a region listed twice is an error naming the line."""
    path = Path(path)
    out: dict[str, RegionCarbon] = {}
    for line, row in read_csv_rows(path, list(CARBON_COLUMNS.values())):
        raw_region = row[CARBON_COLUMNS["region"]].strip()
        try:
            key = ids.region(f"gcp:{raw_region}")
        except ids.UnknownIdentifier as e:
            raise DataFileError(path, f"line {line}", f"column {CARBON_COLUMNS['region']!r}: {e}") from None
        if key in out:
            raise DataFileError(path, f"line {line}", f"{key} is listed twice")
        cfe = csv_float(path, line, row, CARBON_COLUMNS["cfe_fraction"])
        g = csv_float(path, line, row, CARBON_COLUMNS["g_co2_per_kwh"])
        assert cfe is not None and g is not None
        if not 0.0 <= cfe <= 1.0:
            raise DataFileError(
                path, f"line {line}", f"column {CARBON_COLUMNS['cfe_fraction']!r}: {cfe} is not a share 0..1",
            )
        if g < 0:
            raise DataFileError(path, f"line {line}", f"column {CARBON_COLUMNS['g_co2_per_kwh']!r}: {g} is negative")
        out[key] = RegionCarbon(key, row[CARBON_COLUMNS["location"]].strip(), cfe, g)
    return out
