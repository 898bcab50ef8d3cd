"""The simulator's default federation: one equal site per grid zone, sized from a trace.

What it builds
    When ``--sites`` is not given, the simulator runs over one site per carbon zone. Every site has the same
    capacity: ``nodes_per_site`` whole nodes of :data:`GPUS_PER_NODE` (8) GPUs of one model
    (:data:`DEFAULT_GPU_MODEL`), the smallest number that keeps the trace's mean GPUs busy at or below the
    utilisation target (default 50 %; :func:`size_sites`). Each zone stands for the cloud region in
    :data:`ZONE_REGIONS` (or in the caller's ``zone_regions``, which overrides and extends the table); that
    region gives the site its coordinates, its price and its round-trip times.

Units
    ``usd_per_gpu_hour``: on-demand US dollars per GPU-hour of the model (:mod:`broker.data.prices`).
    ``rtt_ms``: round-trip time in milliseconds from each origin region (:mod:`broker.data.latency`).
    Coordinates in degrees, north and east positive. Utilisation is a fraction, 0 < u <= 1.

Substitutions (each one is a line of :attr:`DefaultFederation.report`; nothing is substituted silently)
    - Coordinates: every suspicious value in the region table that has a suggested correction
      (``africa-south1``'s latitude sign) is corrected with :meth:`RegionTable.with_suggested_fixes`; the
      corrected table is used for the sites and for every distance below.
    - Price: where the site's region does not offer the model, the nearest region (great-circle) that does
      sets the price (:meth:`PriceTable.nearest_priced`).
    - Latency: where the latency matrix has no measurement of a region, the nearest measured GCP region
      (great-circle) stands in for it, and the fibre time to it is added: RTT(site, origin) =
      RTT(stand-in of site, stand-in of origin) + 2 × distance to each stand-in / :data:`FIBRE_KM_PER_MS`,
      a path through the stand-ins. Without the added time a far stand-in would make a region look nearer
      to everything than it is (Johannesburg's nearest measured region is Mumbai, 6,984 km away). Should
      two measured stand-ins lack a measurement of their pair, the RTT is the fibre lower bound of the
      direct distance, reported.

Origins
    ``rtt_ms`` holds one entry per origin region: by default every site's own region plus every region of
    the zone table that the latency matrix measured, so a job from any region the table names has an RTT.

Jobs larger than one site
    :meth:`DefaultFederation.too_large` flags them; the simulator reports them and leaves them out for
    every policy alike, so no policy is charged for a job that cannot run anywhere.

How to turn it off: give ``--sites`` (a site file); this module is then not used. Nothing here reads a
clock, a file or the network: the caller passes the loaded price, latency and region tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from broker import ids
from broker.data.latency import LatencyMatrix
from broker.data.prices import PriceTable
from broker.data.regions import RegionTable, great_circle_km
from broker.errors import problems
from broker.models import MAX_GPUS_PER_SITE, NodeGroup, SimulatedAdapterConfig, SiteSpec

__all__ = [
    "DEFAULT_GPU_MODEL",
    "DEFAULT_UTILISATION",
    "FIBRE_KM_PER_MS",
    "GPUS_PER_NODE",
    "REGION_TIMEZONES",
    "ZONE_REGIONS",
    "DefaultFederation",
    "FederationError",
    "UnknownZoneError",
    "ZoneRegion",
    "build_default_federation",
    "site_name",
    "size_sites",
]

DEFAULT_GPU_MODEL = "a100-80gb"
"""The one GPU model of the default sites. The shipped GCP price list prices it on demand in all 40 of its
regions (A100 40GB lacks ``northamerica-northeast2``, RTX PRO 6000 half the regions), so every zone of the
table gets its own region's price; it is also the model most of the published GPU-cluster traces ran on
or on its predecessors, and an 8-GPU A100 node (``a2-ultragpu-8g``) is the common training shape."""

GPUS_PER_NODE = 8
"""GPUs in each node of a default site: the HGX/DGX A100 board, GCP's ``a2-ultragpu-8g``."""

DEFAULT_UTILISATION = 0.5
"""The trace's mean GPUs busy over the federation's GPUs that :func:`size_sites` aims for."""

FIBRE_KM_PER_MS = 200.0
"""Distance light covers in glass fibre per millisecond (c / 1.5), for the RTT lower bound."""

_NEED_TOLERANCE = 1e-9  # a need within this of a whole number of nodes counts as that number (float noise)


class FederationError(ValueError):
    """The default federation cannot be built from what was given; the message says what to change."""


class UnknownZoneError(FederationError):
    """A zone has no row in :data:`ZONE_REGIONS` and none was given in ``zone_regions``."""


@dataclass(frozen=True, slots=True)
class ZoneRegion:
    """The cloud region a grid zone stands for, the zone's IANA time zone, and why that region."""

    region: str
    timezone: str
    reason: str = ""


def _row(region: str, timezone: str, reason: str) -> ZoneRegion:
    return ZoneRegion(ids.region(region), timezone, reason)


# One row per grid zone of the shipped carbon data: the GCP region in (or nearest to) that grid.
ZONE_REGIONS: dict[str, ZoneRegion] = {
    "AU-NSW": _row("gcp:australia-southeast1", "Australia/Sydney", "Sydney is in New South Wales."),
    "AU-VIC": _row("gcp:australia-southeast2", "Australia/Melbourne", "Melbourne is in Victoria."),
    "BR-SP": _row("gcp:southamerica-east1", "America/Sao_Paulo",
                  "São Paulo is in the South-East/Centre-West subsystem (the rows say BR-CS)."),
    "CA-ON": _row("gcp:northamerica-northeast2", "America/Toronto",
                  "Toronto is in Ontario's IESO grid; Montréal (northeast1) is on Québec's."),
    "CL-SIC": _row("gcp:southamerica-west1", "America/Santiago",
                   "Santiago is in the former central grid SIC, now part of Chile's SEN."),
    "DE-LU": _row("gcp:europe-west3", "Europe/Berlin",
                  "Frankfurt, the older German region with latency measurements (Berlin, west10, has none)."),
    "FR": _row("gcp:europe-west9", "Europe/Paris", "Paris is in France."),
    "GB": _row("gcp:europe-west2", "Europe/London", "London is in Great Britain."),
    "IN-WE": _row("gcp:asia-south1", "Asia/Kolkata",
                  "Mumbai is in India's Western grid; Delhi (south2) is in the Northern grid."),
    "JP-TK": _row("gcp:asia-northeast1", "Asia/Tokyo", "Tokyo is in TEPCO's area; Osaka (northeast2) is Kansai."),
    "KR": _row("gcp:asia-northeast3", "Asia/Seoul", "Seoul is in South Korea."),
    "SG": _row("gcp:asia-southeast1", "Asia/Singapore", "The region is in Singapore."),
    "US-CAL-CISO": _row("gcp:us-west2", "America/Los_Angeles",
                        "Los Angeles is in CAISO; Oregon (us-west1) is not."),
    "US-MIDA-PJM": _row("gcp:us-east4", "America/New_York",
                        "Northern Virginia is in PJM; Columbus (us-east5) is too but has no latency measurements."),
    "US-NY-NYIS": _row("gcp:us-east4", "America/New_York",
                       "GCP has no New York region; Northern Virginia is the nearest to New York City "
                       "(about 350 km; Montréal about 530 km), NYISO's load centre; so it shares PJM's "
                       "price and RTTs and differs from it by its grid only."),
    "US-TEX-ERCO": _row("gcp:us-south1", "America/Chicago", "Dallas is in ERCOT."),
    "ZA": _row("gcp:africa-south1", "Africa/Johannesburg",
               "Johannesburg; regions.json gives its latitude with the wrong sign (corrected, reported)."),
}

# The IANA time zone of each GCP region of the shipped region table: the time zone a zone mapped by a bare
# region name in ``zone_regions`` gets (give a ZoneRegion to state the zone's own).
REGION_TIMEZONES: dict[str, str] = {f"gcp:{r}": tz for r, tz in {
    "africa-south1": "Africa/Johannesburg", "asia-east1": "Asia/Taipei", "asia-east2": "Asia/Hong_Kong",
    "asia-northeast1": "Asia/Tokyo", "asia-northeast2": "Asia/Tokyo", "asia-northeast3": "Asia/Seoul",
    "asia-south1": "Asia/Kolkata", "asia-south2": "Asia/Kolkata", "asia-southeast1": "Asia/Singapore",
    "asia-southeast2": "Asia/Jakarta", "australia-southeast1": "Australia/Sydney",
    "australia-southeast2": "Australia/Melbourne", "europe-central2": "Europe/Warsaw",
    "europe-north1": "Europe/Helsinki", "europe-southwest1": "Europe/Madrid", "europe-west1": "Europe/Brussels",
    "europe-west10": "Europe/Berlin", "europe-west12": "Europe/Rome", "europe-west2": "Europe/London",
    "europe-west3": "Europe/Berlin", "europe-west4": "Europe/Amsterdam", "europe-west6": "Europe/Zurich",
    "europe-west8": "Europe/Rome", "europe-west9": "Europe/Paris", "me-central1": "Asia/Qatar",
    "me-central2": "Asia/Riyadh", "me-west1": "Asia/Jerusalem", "northamerica-northeast1": "America/Toronto",
    "northamerica-northeast2": "America/Toronto", "southamerica-east1": "America/Sao_Paulo",
    "southamerica-west1": "America/Santiago", "us-central1": "America/Chicago", "us-east1": "America/New_York",
    "us-east4": "America/New_York", "us-east5": "America/New_York", "us-south1": "America/Chicago",
    "us-west1": "America/Los_Angeles", "us-west2": "America/Los_Angeles", "us-west3": "America/Denver",
    "us-west4": "America/Los_Angeles",
}.items()}


# --- sizing -------------------------------------------------------------------------------------------


def size_sites(
    mean_gpus_busy: float, n_sites: int, utilisation: float = DEFAULT_UTILISATION,
    gpus_per_node: int = GPUS_PER_NODE,
) -> int:
    """Nodes per site: the smallest whole number ``k >= 1`` with
    ``mean_gpus_busy / (n_sites × k × gpus_per_node) <= utilisation``.

    Rounding is up (a site never has a fraction of a node, and rounding down would overshoot the target);
    a need within 1e-9 of a whole number counts as that number, so float noise (``3.0000000000000004``)
    does not add a node. An idle trace still gets one node per site.
    """
    _check_utilisation(utilisation)
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise FederationError(f"n_sites must be a whole number of sites, 1 or more, not {n_sites!r}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise FederationError(f"gpus_per_node must be a whole number, 1 or more, not {gpus_per_node!r}")
    if not math.isfinite(mean_gpus_busy) or mean_gpus_busy < 0:
        raise FederationError(f"mean GPUs busy must be a finite number, 0 or more, not {mean_gpus_busy!r}")
    need = mean_gpus_busy / (n_sites * gpus_per_node * utilisation)
    nodes = max(1, math.ceil(need - _NEED_TOLERANCE))
    if nodes * gpus_per_node > MAX_GPUS_PER_SITE:  # what a site spec may hold
        raise FederationError(
            f"utilisation {utilisation:g} sizes each site at {nodes * gpus_per_node:,} GPUs (the trace keeps "
            f"{mean_gpus_busy:,.1f} busy on average), more than a site may have ({MAX_GPUS_PER_SITE:,}); give a "
            f"larger utilisation")
    return nodes


def _check_utilisation(utilisation: float) -> None:
    if isinstance(utilisation, bool) or not isinstance(utilisation, (int, float)) or not 0 < utilisation <= 1:
        raise FederationError(
            f"utilisation must be a fraction above 0 and at most 1 (0.5 for 50 %), not {utilisation!r}"
        )


# --- the federation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DefaultFederation:
    """The default sites, how they were sized, and every substitution made while building them."""

    sites: list[SiteSpec]
    model: str
    nodes_per_site: int
    gpus_per_site: int
    utilisation_target: float
    trace_mean_gpus_busy: float
    origin_regions: tuple[str, ...]
    report: list[str]

    @property
    def total_gpus(self) -> int:
        return sum(sum(s.total_gpus().values()) for s in self.sites)

    @property
    def expected_utilisation(self) -> float:
        """The trace's mean GPUs busy over all the federation's GPUs (a fraction)."""
        return self.trace_mean_gpus_busy / self.total_gpus

    @property
    def largest_site_gpus(self) -> int:
        return max(sum(s.total_gpus().values()) for s in self.sites)

    def too_large(self, gpus: Any) -> np.ndarray:
        """Boolean array: which of the jobs' GPU counts (an array or sequence) exceed the largest site's
        GPUs. Such jobs cannot run anywhere; report them and leave them out for every policy."""
        return np.asarray(gpus) > self.largest_site_gpus


def site_name(zone: str) -> str:
    """The default site's name for a zone: the canonical zone id in lower case (``US-CAL-CISO`` →
    ``us-cal-ciso``), a valid site name for every well-formed zone id."""
    return ids.grid_zone(zone).lower()


def build_default_federation(
    zones: Sequence[str],
    *,
    trace_mean_gpus_busy: float,
    prices: PriceTable,
    latency: LatencyMatrix,
    regions: RegionTable,
    largest_job_gpus: int | None = None,
    utilisation: float = DEFAULT_UTILISATION,
    model: str = DEFAULT_GPU_MODEL,
    zone_regions: Mapping[str, str | ZoneRegion] | None = None,
    origin_regions: Sequence[str] | None = None,
) -> DefaultFederation:
    """One site per zone, equal in whole nodes, sized for ``utilisation`` (rules in the module docstring).

    ``zone_regions`` maps a zone to a region (``"gcp:europe-north1"``: the time zone is then the region's,
    from :data:`REGION_TIMEZONES`) or to a :class:`ZoneRegion`; it overrides and extends
    :data:`ZONE_REGIONS`. ``largest_job_gpus`` (the trace's largest job) adds a report line when that job
    does not fit one site. Raises :class:`FederationError` (a ``ValueError``) saying what to change.
    """
    _check_utilisation(utilisation)
    model = ids.gpu_model(model)
    if isinstance(zones, str):
        raise FederationError(f"zones must be a list of zone ids, not the string {zones!r}")
    if not zones:
        raise FederationError("no grid zones given: the default federation has one site per zone; "
                              "give at least one zone, e.g. DE-LU")
    report: list[str] = []
    table = _zone_table(zone_regions, report)
    canonical = [ids.grid_zone(z) for z in zones]
    twice = sorted({z for z in canonical if canonical.count(z) > 1})
    if twice:
        raise FederationError(f"zone {', '.join(twice)} is given twice (after aliases such as DE → DE-LU); "
                              "give each zone once")
    unknown = [z for z in canonical if z not in table]
    if unknown:
        raise UnknownZoneError(
            f"grid zone {', '.join(unknown)} has no cloud region in the default federation's table "
            f"(ZONE_REGIONS knows {', '.join(sorted(ZONE_REGIONS))}); pass zone_regions, e.g. "
            f"{{'{unknown[0]}': 'gcp:europe-north1'}} (heliotrope simulate --zone-regions {unknown[0]}=gcp:europe-north1), "
            "mapping it to the GCP region in or nearest to that grid; or give --sites"
        )
    if not prices.regions_with(model):
        where = f" {prices.path}" if prices.path else ""
        raise FederationError(f"no region of the price list{where} prices {model} on demand; "
                              f"choose a model it prices: {', '.join(prices.models)}")

    coords = _corrected_coordinates(regions, report)
    for z in canonical:
        if table[z].region not in coords:
            raise FederationError(
                f"zone {z}: region {table[z].region} is not in the region table {regions.path}, so it has no "
                "coordinates; map the zone to a region the table has"
            )
    nodes = size_sites(trace_mean_gpus_busy, len(canonical), utilisation)
    site_regions = [table[z].region for z in canonical]
    origins = _origins(origin_regions, site_regions, table, latency)
    rtt = _Rtt(latency, coords, report)

    sites = []
    for zone in canonical:
        row = table[zone]
        price = _price(prices, row.region, model, coords, zone, report)
        lat, lon = coords[row.region]
        spec = {
            "name": site_name(zone), "region": row.region, "grid_zone": zone, "timezone": row.timezone,
            "latitude": lat, "longitude": lon,
            "gpus": [NodeGroup(model=model, gpus_per_node=GPUS_PER_NODE, nodes=nodes)],
            "usd_per_gpu_hour": {model: price},
            "rtt_ms": {o: rtt.between(row.region, o) for o in origins},
            "adapter": SimulatedAdapterConfig(dispatch_delay_s=0.0),
            "labels": {"federation": "default"},
        }
        try:
            sites.append(SiteSpec.model_validate(spec))
        except ValidationError as e:
            detail = "; ".join(f"{p['field']}: {p['problem']}" for p in problems(e))
            raise FederationError(f"zone {zone}: the site built for it is not valid: {detail}") from None

    gpus_per_site = nodes * GPUS_PER_NODE
    total = gpus_per_site * len(sites)
    report.insert(0, (
        f"sizing: {len(sites)} sites × {nodes} nodes × {GPUS_PER_NODE} {model} = {total} GPUs; the trace's "
        f"mean {trace_mean_gpus_busy:.1f} GPUs busy is {trace_mean_gpus_busy / total:.1%} of them "
        f"(target at most {utilisation:.0%})"
    ))
    if largest_job_gpus is not None and largest_job_gpus > gpus_per_site:
        report.append(
            f"too large: the trace's largest job asks for {largest_job_gpus} GPUs, more than one site's "
            f"{gpus_per_site}; jobs above {gpus_per_site} GPUs are reported and left out for every policy"
        )
    return DefaultFederation(sites, model, nodes, gpus_per_site, float(utilisation),
                             float(trace_mean_gpus_busy), origins, report)


# --- steps --------------------------------------------------------------------------------------------


def _zone_table(zone_regions: Mapping[str, str | ZoneRegion] | None, report: list[str]) -> dict[str, ZoneRegion]:
    table = dict(ZONE_REGIONS)
    for raw_zone, value in (zone_regions or {}).items():
        zone = ids.grid_zone(raw_zone)
        if isinstance(value, ZoneRegion):
            row = ZoneRegion(ids.region(value.region), value.timezone, value.reason or "given in zone_regions")
        elif isinstance(value, str):
            region = ids.region(value)
            tz = REGION_TIMEZONES.get(region)
            if tz is None:
                raise FederationError(
                    f"zone_regions: {zone} → {region}: no time zone is known for that region; give "
                    f"ZoneRegion('{region}', '<IANA time zone, e.g. Europe/Oslo>') instead of the bare name"
                )
            row = ZoneRegion(region, tz, "given in zone_regions")
            report.append(f"zone {zone}: mapped to {region} by zone_regions; its time zone {tz} is the "
                          "region's (give a ZoneRegion to set the zone's own)")
        else:
            raise FederationError(f"zone_regions: {zone}: expected a region name or a ZoneRegion, not {value!r}")
        if zone in ZONE_REGIONS and ZONE_REGIONS[zone].region != row.region:
            report.append(f"zone {zone}: zone_regions overrides the table's {ZONE_REGIONS[zone].region} "
                          f"with {row.region}")
        table[zone] = row
    return table


def _corrected_coordinates(regions: RegionTable, report: list[str]) -> dict[str, tuple[float, float]]:
    fixable = [p for p in regions.problems if p.suggested is not None and p.field in ("latitude", "longitude")]
    for p in fixable:
        report.append(f"coordinates: {regions.path or 'the region table'} gives {p.region} {p.field} "
                      f"{p.value!r}, which looks wrong ({p.reason}); used {p.suggested:+g} for the site and "
                      "every distance (RegionTable.with_suggested_fixes)")
    return regions.with_suggested_fixes(fixable).coordinates() if fixable else regions.coordinates()


def _origins(given: Sequence[str] | None, site_regions: list[str], table: Mapping[str, ZoneRegion],
             latency: LatencyMatrix) -> tuple[str, ...]:
    if given is not None:
        if isinstance(given, str):
            raise FederationError(f"origin_regions must be a list of regions, not the string {given!r}")
        out = [ids.region(o) for o in given]
        if not out:
            raise FederationError("origin_regions is empty; leave it out for the default origins")
        return tuple(dict.fromkeys(out))
    measured = set(latency.regions)
    return tuple(sorted(set(site_regions) | {row.region for row in table.values() if row.region in measured}))


def _price(prices: PriceTable, region: str, model: str, coords: Mapping[str, tuple[float, float]],
           zone: str, report: list[str]) -> float:
    try:
        source, price = prices.nearest_priced(region, model, coords)
    except LookupError as e:  # KeyError (no coordinates) is a LookupError too
        raise FederationError(f"zone {zone}: no price for {model} near {region}: {e}") from None
    if source != region:
        km = great_circle_km(coords[region], coords[source])
        report.append(f"price: {region} (zone {zone}) does not offer {model}; used {source}'s "
                      f"{price:.2f} USD/GPU-hour, the nearest region that does ({km:,.0f} km)")
    return price


class _Rtt:
    """RTTs between regions with stand-ins for unmeasured ones; each stand-in and estimate reported once."""

    def __init__(self, latency: LatencyMatrix, coords: Mapping[str, tuple[float, float]], report: list[str]):
        self.latency, self.coords, self.report = latency, coords, report
        self.measured = set(latency.regions)
        self.candidates = sorted(r for r in self.measured if r in coords)
        self.stand_ins: dict[str, tuple[str, float]] = {}  # region: (stand-in, fibre RTT to it in ms)
        self.estimated: set[tuple[str, str]] = set()

    def _fibre_ms(self, a: str, b: str) -> float:
        return 2 * great_circle_km(self.coords[a], self.coords[b]) / FIBRE_KM_PER_MS

    def stand_in(self, region: str) -> tuple[str, float]:
        """``(region, 0)`` for a measured region, else ``(nearest measured region, fibre RTT to it)``."""
        if region in self.measured:
            return region, 0.0
        if region not in self.stand_ins:
            if region not in self.coords:
                raise FederationError(f"latency: {region} has no measurements and no coordinates in the region "
                                      "table, so no measured region can stand in for it; use a GCP region of "
                                      "the region table")
            if not self.candidates:
                raise FederationError(f"latency: {region} has no measurements and no measured region has "
                                      "coordinates in the region table to stand in for it")
            best = min(self.candidates, key=lambda r: (great_circle_km(self.coords[region], self.coords[r]), r))
            km = great_circle_km(self.coords[region], self.coords[best])
            extra = self._fibre_ms(region, best)
            self.report.append(f"latency: {region} has no {self.latency.report.tier} RTT measurements; used "
                               f"those of {best}, the nearest measured region ({km:,.0f} km), plus {extra:.1f} "
                               "ms, the fibre round trip to it")
            self.stand_ins[region] = (best, extra)
        return self.stand_ins[region]

    def between(self, site: str, origin: str) -> float:
        if site == origin:
            return 0.0
        (a, extra_a), (b, extra_b) = self.stand_in(site), self.stand_in(origin)
        if a == b or self.latency.has(a, b):
            return self.latency.rtt_ms(a, b) + extra_a + extra_b
        if site not in self.coords or origin not in self.coords:
            missing = origin if origin not in self.coords else site
            raise FederationError(f"latency: no RTT measured between {a} and {b}, and {missing} has no "
                                  "coordinates for an estimate; use regions of the region table")
        rtt = self._fibre_ms(site, origin)
        pair = (min(site, origin), max(site, origin))
        if pair not in self.estimated:
            self.estimated.add(pair)
            self.report.append(f"latency: no RTT measured between {pair[0]} and {pair[1]} or their stand-ins; "
                               f"used the fibre lower bound {rtt:.1f} ms (distance × 2 / {FIBRE_KM_PER_MS:g} km/ms)")
        return rtt
