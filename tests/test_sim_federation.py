"""The simulator's default federation on the real shared files: one equal site per carbon zone, sized so that
the Philly trace keeps it half busy, priced and timed from each zone's cloud region — and every stand-in
the data forced (a missing price, an unmeasured region, a wrong coordinate) named in the report."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from broker.data.carbon import load_carbon
from broker.data.latency import LatencyMatrix, load_latency
from broker.data.prices import PriceTable, load_gcp_prices
from broker.data.regions import RegionTable, load_gcp_regions
from broker.data.traces import Trace, load_trace, resolve_preset
from broker.ids import UnknownIdentifier
from broker.models import SiteSpec
from broker.simulation.federation import (
    DEFAULT_GPU_MODEL,
    FIBRE_KM_PER_MS,
    GPUS_PER_NODE,
    REGION_TIMEZONES,
    ZONE_REGIONS,
    DefaultFederation,
    FederationError,
    UnknownZoneError,
    ZoneRegion,
    build_default_federation,
    size_sites,
)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PRICES_CSV = SHARED_DATA / "prices" / "gcp" / "gcp_gpu_instance_prices.csv"
LATENCY_CSV = SHARED_DATA / "network" / "skyplane" / "latency.csv"
REGIONS_JSON = SHARED_DATA / "regions" / "gcp" / "regions.json"
PHILLY_CSV = SHARED_DATA / "traces" / "philly" / "philly_jobs_pollux.csv"
ELECTRICITYMAPS = SHARED_DATA / "carbon-intensity" / "electricitymaps-hourly"
LETSWAITAWHILE = SHARED_DATA / "carbon-intensity" / "letswaitawhile-2020"


def _shared(path: Path) -> Path:
    """The path, or a failure (never a skip) saying which shared file is missing."""
    if not path.exists():
        pytest.fail(f"{path} is missing: these tests need the real data in {SHARED_DATA} "
                    "(see its SOURCES.md); CI always has it")
    return path


@pytest.fixture(scope="module")
def prices() -> PriceTable:
    return load_gcp_prices(_shared(PRICES_CSV))


@pytest.fixture(scope="module")
def latency() -> LatencyMatrix:
    return load_latency(_shared(LATENCY_CSV))


@pytest.fixture(scope="module")
def regions() -> RegionTable:
    return load_gcp_regions(_shared(REGIONS_JSON))


@pytest.fixture(scope="module")
def philly() -> Trace:
    return load_trace(_shared(PHILLY_CSV), resolve_preset("philly"))


@pytest.fixture(scope="module")
def carbon_zones() -> tuple[str, ...]:
    return load_carbon(_shared(ELECTRICITYMAPS)).zones()


@pytest.fixture
def build(prices: PriceTable, latency: LatencyMatrix, regions: RegionTable, philly: Trace):
    """``build(zones, **options)``: the default federation for the Philly trace's mean GPUs busy."""
    def _build(zones, **options) -> DefaultFederation:
        options.setdefault("trace_mean_gpus_busy", philly.mean_gpus_busy())
        return build_default_federation(zones, prices=prices, latency=latency, regions=regions, **options)
    return _build


@pytest.fixture(scope="module")
def sixteen(prices, latency, regions, philly, carbon_zones) -> DefaultFederation:
    return build_default_federation(
        carbon_zones, trace_mean_gpus_busy=philly.mean_gpus_busy(), largest_job_gpus=int(philly.gpus.max()),
        prices=prices, latency=latency, regions=regions,
    )


def _site(federation: DefaultFederation, zone: str) -> SiteSpec:
    (site,) = [s for s in federation.sites if s.grid_zone == zone]
    return site


def _lines(federation: DefaultFederation, prefix: str) -> list[str]:
    return [line for line in federation.report if line.startswith(prefix)]


# --- the zone table -----------------------------------------------------------------------------------


def test_every_zone_of_the_shipped_carbon_data_has_a_region_and_time_zone_in_the_table(carbon_zones) -> None:
    flat = load_carbon(_shared(LETSWAITAWHILE)).zones()
    assert len(carbon_zones) == 16
    assert set(carbon_zones) | set(flat) <= set(ZONE_REGIONS)
    assert all(row.reason for row in ZONE_REGIONS.values())


def test_the_default_model_is_priced_in_the_region_of_every_zone_of_the_table(prices: PriceTable) -> None:
    unpriced = [z for z, row in ZONE_REGIONS.items() if prices.price(row.region, DEFAULT_GPU_MODEL) is None]
    assert unpriced == []


def test_every_zone_region_has_coordinates_and_a_region_time_zone(regions: RegionTable) -> None:
    assert {row.region for row in ZONE_REGIONS.values()} <= set(regions)
    assert set(regions) <= set(REGION_TIMEZONES)


# --- sizing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mean_gpus_busy", "n_sites", "utilisation", "gpus_per_node", "nodes"),
    [
        pytest.param(400.0, 10, 0.5, 8, 10, id="400 busy GPUs over 10 sites at 50 % need exactly 10 nodes each"),
        pytest.param(400.1, 10, 0.5, 8, 11, id="a little more than fits exactly takes one node more"),
        pytest.param(374.24, 16, 0.5, 8, 6, id="Philly's 374 busy GPUs over 16 sites at 50 % need 6 nodes each"),
        pytest.param(374.24, 16, 0.25, 8, 12, id="at 25 % the same trace needs 12 nodes each"),
        pytest.param(8.0, 1, 1.0, 8, 1, id="8 busy GPUs fill one 8-GPU node at 100 %"),
        pytest.param(9.0, 1, 1.0, 8, 2, id="9 busy GPUs at 100 % need a second node"),
        pytest.param(16.8, 1, 0.3, 8, 7, id="float noise (16.8 / 2.4 = 7.000000000000001) does not add an eighth node"),
        pytest.param(0.0, 16, 0.5, 8, 1, id="an idle trace still gets one node per site"),
        pytest.param(12.0, 3, 0.5, 4, 2, id="4-GPU nodes: 12 busy GPUs over 3 sites at 50 % need 2 nodes each"),
    ],
)
def test_size_sites_gives_the_fewest_whole_nodes_that_meet_the_target(
    mean_gpus_busy: float, n_sites: int, utilisation: float, gpus_per_node: int, nodes: int,
) -> None:
    assert size_sites(mean_gpus_busy, n_sites, utilisation, gpus_per_node) == nodes


@pytest.mark.parametrize(
    ("mean_gpus_busy", "n_sites", "utilisation", "message"),
    [
        pytest.param(100.0, 4, 0.0, "utilisation must be a fraction above 0", id="a target of 0 % is refused"),
        pytest.param(100.0, 4, 1.5, "at most 1", id="a target above 100 % is refused"),
        pytest.param(100.0, 4, -0.5, "utilisation", id="a negative target is refused"),
        pytest.param(100.0, 4, math.nan, "utilisation", id="a NaN target is refused"),
        pytest.param(100.0, 0, 0.5, "n_sites", id="no sites is refused"),
        pytest.param(-1.0, 4, 0.5, "mean GPUs busy", id="a negative load is refused"),
    ],
)
def test_size_sites_refuses_what_cannot_be_sized(
    mean_gpus_busy: float, n_sites: int, utilisation: float, message: str,
) -> None:
    with pytest.raises(FederationError, match=message):
        size_sites(mean_gpus_busy, n_sites, utilisation)


# --- the sixteen-zone federation ----------------------------------------------------------------------


def test_sixteen_zones_give_sixteen_valid_sites_each_in_its_own_zone(sixteen: DefaultFederation,
                                                                     carbon_zones) -> None:
    assert len(sixteen.sites) == 16
    assert sorted(s.grid_zone for s in sixteen.sites) == sorted(carbon_zones)
    assert len({s.name for s in sixteen.sites}) == 16
    for site in sixteen.sites:
        assert SiteSpec.model_validate(site.model_dump()) == site
        assert site.region == ZONE_REGIONS[site.grid_zone].region
        assert site.timezone == ZONE_REGIONS[site.grid_zone].timezone
        assert site.adapter.dispatch_delay_s == 0
    assert _site(sixteen, "US-CAL-CISO").name == "us-cal-ciso"


def test_every_site_has_the_same_whole_8_gpu_nodes_of_the_default_model(sixteen: DefaultFederation) -> None:
    for site in sixteen.sites:
        (group,) = site.gpus
        assert (group.model, group.gpus_per_node, group.nodes) == (DEFAULT_GPU_MODEL, 8, sixteen.nodes_per_site)
        assert site.total_gpus() == {DEFAULT_GPU_MODEL: sixteen.gpus_per_site}
    assert sixteen.gpus_per_site == sixteen.nodes_per_site * GPUS_PER_NODE
    assert sixteen.total_gpus == 16 * sixteen.gpus_per_site


def test_philly_keeps_the_federation_at_most_half_busy_and_one_node_fewer_would_not(
    sixteen: DefaultFederation, philly: Trace,
) -> None:
    busy = philly.mean_gpus_busy()
    assert busy / (16 * sixteen.nodes_per_site * 8) <= 0.5
    assert busy / (16 * (sixteen.nodes_per_site - 1) * 8) > 0.5
    assert (sixteen.nodes_per_site, sixteen.gpus_per_site, sixteen.total_gpus) == (6, 48, 768)
    assert sixteen.expected_utilisation == pytest.approx(busy / 768)
    assert "768 GPUs" in sixteen.report[0] and "48.7%" in sixteen.report[0]


def test_a_quarter_utilisation_target_about_doubles_the_capacity(build, carbon_zones,
                                                                 sixteen: DefaultFederation) -> None:
    quarter = build(carbon_zones, utilisation=0.25)
    assert 2 * sixteen.nodes_per_site - 1 <= quarter.nodes_per_site <= 2 * sixteen.nodes_per_site
    assert quarter.expected_utilisation <= 0.25


def test_every_site_is_priced_from_its_own_region_when_that_region_offers_the_model(
    sixteen: DefaultFederation, prices: PriceTable,
) -> None:
    for site in sixteen.sites:
        assert site.usd_per_gpu_hour == {DEFAULT_GPU_MODEL: prices.price(site.region, DEFAULT_GPU_MODEL)}
    assert _lines(sixteen, "price:") == []


def test_every_site_has_an_rtt_from_every_origin_and_zero_from_its_own_region(
    sixteen: DefaultFederation, latency: LatencyMatrix,
) -> None:
    site_regions = {s.region for s in sixteen.sites}
    assert site_regions <= set(sixteen.origin_regions)
    for site in sixteen.sites:
        assert set(site.rtt_ms) == set(sixteen.origin_regions)
        assert site.rtt_ms[site.region] == 0.0
    de, gb = _site(sixteen, "DE-LU"), _site(sixteen, "GB")
    assert de.rtt_ms["gcp:europe-west2"] == latency.rtt_ms("gcp:europe-west3", "gcp:europe-west2")
    assert gb.rtt_ms["gcp:europe-west3"] == de.rtt_ms["gcp:europe-west2"]


def test_an_unmeasured_region_uses_its_nearest_measured_region_plus_the_fibre_time_to_it(
    sixteen: DefaultFederation, latency: LatencyMatrix, regions: RegionTable,
) -> None:
    california = _site(sixteen, "US-CAL-CISO")
    assert "gcp:us-west2" not in latency.regions
    (line,) = [x for x in _lines(sixteen, "latency:") if x.startswith("latency: gcp:us-west2 ")]
    assert "gcp:us-west4" in line and "368 km" in line
    detour = 2 * regions.great_circle_km("gcp:us-west2", "gcp:us-west4") / FIBRE_KM_PER_MS
    assert california.rtt_ms["gcp:europe-west2"] == pytest.approx(
        latency.rtt_ms("gcp:us-west4", "gcp:europe-west2") + detour)
    unmeasured = {"gcp:us-west2", "gcp:us-south1", "gcp:africa-south1"}
    assert {x.split()[1] for x in _lines(sixteen, "latency: gcp:")} == unmeasured


def test_africa_south1s_wrong_latitude_is_corrected_and_reported_so_the_za_site_is_southern(
    sixteen: DefaultFederation,
) -> None:
    za = _site(sixteen, "ZA")
    assert za.latitude == pytest.approx(-26.2056)
    (line,) = _lines(sixteen, "coordinates:")
    assert "gcp:africa-south1" in line and "latitude" in line and "-26.2056" in line


def test_a_job_larger_than_the_largest_site_is_flagged_and_reported(sixteen: DefaultFederation,
                                                                    philly: Trace) -> None:
    flags = sixteen.too_large(np.array([1, 8, 48, 49, 64, 128]))
    assert flags.tolist() == [False, False, False, True, True, True]
    assert sorted(set(philly.gpus[sixteen.too_large(philly.gpus)].tolist())) == [64, 128]
    (line,) = _lines(sixteen, "too large:")
    assert "128 GPUs" in line and "48" in line and "every policy" in line


# --- substitutions and user mappings ------------------------------------------------------------------


def test_a_region_without_the_model_is_priced_from_the_nearest_region_that_has_it(
    build, prices: PriceTable, regions: RegionTable,
) -> None:
    assert prices.price("gcp:northamerica-northeast2", "a100-40gb") is None
    federation = build(["CA-ON", "DE-LU"], model="a100-40gb")
    ontario = _site(federation, "CA-ON")
    assert ontario.region == "gcp:northamerica-northeast2"
    assert ontario.usd_per_gpu_hour == {"a100-40gb": prices.price("gcp:northamerica-northeast1", "a100-40gb")}
    (line,) = _lines(federation, "price:")
    assert "gcp:northamerica-northeast2" in line and "gcp:northamerica-northeast1" in line and "499 km" in line


def test_a_zone_outside_the_table_can_be_mapped_by_the_user(build) -> None:
    federation = build(["NO-NO1", "DE-LU"], zone_regions={"NO-NO1": "gcp:europe-north1"})
    norway = _site(federation, "NO-NO1")
    assert (norway.name, norway.region, norway.timezone) == ("no-no1", "gcp:europe-north1", "Europe/Helsinki")
    assert norway.latitude == pytest.approx(60.5693)
    assert any("NO-NO1" in x and "Europe/Helsinki" in x for x in federation.report)
    assert "gcp:europe-north1" in federation.origin_regions


def test_a_user_mapping_with_a_zone_region_sets_the_zones_own_time_zone(build) -> None:
    federation = build(["NO-NO1"], zone_regions={"NO-NO1": ZoneRegion("gcp:europe-north1", "Europe/Oslo")})
    assert _site(federation, "NO-NO1").timezone == "Europe/Oslo"


def test_a_user_mapping_overrides_the_table_and_the_report_says_so(build) -> None:
    federation = build(["DE-LU"], zone_regions={"DE": "gcp:europe-west10"})
    assert _site(federation, "DE-LU").region == "gcp:europe-west10"
    assert any("overrides" in x and "gcp:europe-west3" in x for x in federation.report)


def test_a_site_whose_stand_in_is_the_origin_gets_the_fibre_time_not_zero(build, regions: RegionTable) -> None:
    federation = build(["US-CAL-CISO"], origin_regions=["gcp:us-west4"])
    expected = 2 * regions.great_circle_km("gcp:us-west2", "gcp:us-west4") / FIBRE_KM_PER_MS
    assert federation.sites[0].rtt_ms == {"gcp:us-west4": pytest.approx(expected)}
    assert expected > 3


@pytest.mark.parametrize(
    ("zones", "options", "error", "message"),
    [
        pytest.param(["NO-NO1"], {}, UnknownZoneError, r"NO-NO1.*pass zone_regions",
                     id="a zone outside the table is named and the fix (zone_regions) is given"),
        pytest.param([], {}, FederationError, "no grid zones given", id="an empty zone list is refused"),
        pytest.param(["DE-LU", "DE"], {}, FederationError, "DE-LU is given twice",
                     id="a zone given twice under two names is refused"),
        pytest.param(["DE-LU"], {"utilisation": 0}, FederationError, "utilisation",
                     id="a utilisation of 0 is refused"),
        pytest.param(["DE-LU"], {"utilisation": 1.01}, FederationError, "at most 1",
                     id="a utilisation above 1 is refused"),
        pytest.param(["DE-LU"], {"model": "t4"}, FederationError, "prices t4.*choose a model",
                     id="a model no region prices is refused, listing the priced ones"),
        pytest.param(["DE-LU"], {"model": "a100-90gb"}, UnknownIdentifier, "unknown GPU model",
                     id="a model that does not exist is refused"),
        pytest.param(["NO-NO1"], {"zone_regions": {"NO-NO1": "aws:eu-north-1"}}, FederationError,
                     "time zone", id="a user region with no known time zone asks for a ZoneRegion"),
        pytest.param(["NO-NO1"], {"zone_regions": {"NO-NO1": ZoneRegion("aws:eu-north-1", "Europe/Stockholm")}},
                     FederationError, "not in the region table",
                     id="a user region without coordinates is refused"),
        pytest.param(["NO-NO1"], {"zone_regions": {"NO-NO1": ZoneRegion("gcp:europe-north1", "Norway")}},
                     FederationError, "not an IANA time zone", id="a user time zone that is not one is refused"),
    ],
)
def test_input_that_cannot_make_a_federation_is_refused_with_a_message_saying_what_to_change(
    build, zones: list[str], options: dict, error: type[Exception], message: str,
) -> None:
    with pytest.raises(error, match=message):
        build(zones, **options)

