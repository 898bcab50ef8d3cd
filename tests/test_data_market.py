"""The market data loaders on the real shared files: GCP GPU prices per GPU-hour, inter-region RTT and GCP
region coordinates — the numbers a user would see a placement explained with, and the errors a user meets
when a data file is broken."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from broker.data.latency import LatencyMatrix, UnmeasuredPair, load_latency
from broker.data.prices import PriceTable, load_gcp_prices
from broker.data.regions import (
    DataFileError,
    RegionTable,
    great_circle_km,
    load_gcp_region_carbon,
    load_gcp_regions,
)
from broker.ids import UnknownIdentifier

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PRICES_CSV = SHARED_DATA / "prices" / "gcp" / "gcp_gpu_instance_prices.csv"
LATENCY_CSV = SHARED_DATA / "network" / "skyplane" / "latency.csv"
REGIONS_JSON = SHARED_DATA / "regions" / "gcp" / "regions.json"
CARBON_CSV = SHARED_DATA / "regions" / "gcp" / "carbon.csv"



@pytest.fixture(scope="module")
def prices() -> PriceTable:
    return load_gcp_prices(PRICES_CSV)


@pytest.fixture(scope="module")
def latency() -> LatencyMatrix:
    return load_latency(LATENCY_CSV)


@pytest.fixture(scope="module")
def regions() -> RegionTable:
    return load_gcp_regions(REGIONS_JSON)


def _copy_with(tmp_path: Path, source: Path, lines: int, edit: dict[int, tuple[str, str]] | None = None) -> Path:
    """The first ``lines`` lines of a real file, with ``{line: (old, new)}`` replacements (line 1 = header)."""
    text = source.read_text(encoding="utf-8").splitlines()[:lines]
    for line, (old, new) in (edit or {}).items():
        assert old in text[line - 1], f"line {line} has no {old!r}"
        text[line - 1] = text[line - 1].replace(old, new, 1)
    out = tmp_path / source.name
    out.write_text("\n".join(text) + "\n", encoding="utf-8")
    return out


# --- prices -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("region", "model", "spot", "usd_per_gpu_hour"),
    [
        pytest.param("gcp:us-central1", "a100-80gb", False, 5.06879789041096,
                     id="an A100 80GB in us-central1 costs what the 1-GPU a2-ultragpu-1g costs per hour"),
        pytest.param("gcp:us-central1", "a100-80gb", True, 2.75954630136986,
                     id="a spot A100 80GB in us-central1 costs the a2-ultragpu-1g spot price"),
        pytest.param("gcp:us-central1", "a100-40gb", False, 55.739504 / 16,
                     id="an A100 40GB in us-central1 is priced from the 16-GPU a2-megagpu, cheaper per GPU"),
        pytest.param("gcp:us-central1", "l4", False, 0.706832255,
                     id="an L4 in us-central1 is priced from the smallest g2-standard-4, not the 8-GPU g2-standard-96"),
        pytest.param("gcp:northamerica-northeast1", "a100", True, 5.36432 / 16,
                     id="GCP's accelerator name a100 is looked up as a100-40gb"),
        pytest.param("gcp:us-central1-a", "h100-80gb", False, 88.4899999025753 / 8,
                     id="a zone is priced as its region"),
    ],
)
def test_a_gpu_hour_costs_the_cheapest_whole_machine_price_divided_by_its_gpus(
    prices: PriceTable, region: str, model: str, spot: bool, usd_per_gpu_hour: float,
) -> None:
    assert prices.price(region, model, spot=spot) == pytest.approx(usd_per_gpu_hour, rel=1e-9)


def test_the_price_names_the_machine_it_comes_from(prices: PriceTable) -> None:
    entry = prices.entry("gcp:us-east4", "h100-80gb")
    assert entry is not None
    assert (entry.instance_type, entry.spot_instance_type) == ("a3-highgpu-1g", "a3-megagpu-8g")


def test_a_fractional_gpu_machine_is_normalised_to_a_whole_gpu_but_does_not_set_the_price(prices: PriceTable) -> None:
    slices = {o.instance_type: o for o in prices.offers("gcp:us-central1", "rtx-pro-6000")}
    eighth = slices["g4-standard-6"]
    assert eighth.gpu_count == 0.125
    assert eighth.usd_per_gpu_hour == pytest.approx(0.55955625 / 0.125)
    assert slices["g4-standard-12"].usd_per_gpu_hour == pytest.approx(slices["g4-standard-48"].usd_per_gpu_hour)
    # The 1/8 slice is the cheapest rate per GPU, but a job wanting a GPU gets the 1-GPU g4-standard-48.
    assert eighth.usd_per_gpu_hour < 4.49993
    assert prices.price("gcp:us-central1", "rtx-pro-6000") == pytest.approx(4.49993)


def test_spot_is_cheaper_than_on_demand_wherever_both_are_priced(prices: PriceTable) -> None:
    both = [
        (r, m) for r in prices.regions for m in prices.models
        if prices.price(r, m) is not None and prices.price(r, m, spot=True) is not None
    ]
    assert len(both) > 100
    dearer = [
        (r, m) for r, m in both
        if not prices.price(r, m, spot=True) < prices.price(r, m)  # type: ignore[operator]
    ]
    assert dearer == []


def test_the_table_knows_the_five_canonical_models_in_forty_regions(prices: PriceTable) -> None:
    assert prices.models == ("a100-40gb", "a100-80gb", "h100-80gb", "l4", "rtx-pro-6000")
    assert len(prices.regions) == 40
    assert "gcp:northamerica-northeast2" not in prices.regions_with("a100-40gb")


def test_a_model_a_region_does_not_offer_has_no_price_and_an_unknown_model_is_an_error(prices: PriceTable) -> None:
    assert prices.price("gcp:northamerica-northeast2", "a100-40gb") is None
    with pytest.raises(UnknownIdentifier, match="a100-90gb"):
        prices.price("gcp:us-central1", "a100-90gb")


@pytest.mark.parametrize(
    ("region", "model", "nearest", "usd_per_gpu_hour"),
    [
        pytest.param("gcp:northamerica-northeast2", "a100-40gb", "gcp:northamerica-northeast1", 59.308990816 / 16,
                     id="Toronto has no A100 40GB, so Montreal's price is the nearest"),
        pytest.param("gcp:europe-west9", "rtx-pro-6000", "gcp:europe-west1", 4.949923,
                     id="Paris has no RTX PRO 6000, so Belgium's is the nearest"),
        pytest.param("gcp:us-central1", "a100-40gb", "gcp:us-central1", 55.739504 / 16,
                     id="a region that prices the model is its own nearest"),
    ],
)
def test_a_region_lacking_a_model_borrows_the_nearest_priced_region(
    prices: PriceTable, regions: RegionTable, region: str, model: str, nearest: str, usd_per_gpu_hour: float,
) -> None:
    got_region, got_price = prices.nearest_priced(region, model, regions.coordinates())
    assert got_region == nearest
    assert got_price == pytest.approx(usd_per_gpu_hour)
    assert prices.nearest_priced(region, model, regions) == (got_region, got_price)


PRICE_HEADER = 1
A100_US_CENTRAL1 = 32  # a2-highgpu-1g,a100,1,...,us-central1,3.673385,1.92802,...


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param({PRICE_HEADER: ("usd_per_hour_spot", "spot")}, ["line 1", "'usd_per_hour_spot'"],
                     id="a missing spot column is named"),
        pytest.param({A100_US_CENTRAL1: ("3.673385", "3.67 USD")}, ["line 32", "'usd_per_hour'", "3.67 USD"],
                     id="a price that is not a number names its line and column"),
        pytest.param({A100_US_CENTRAL1: ("3.673385", "-3.673385")}, ["line 32", "negative"],
                     id="a negative price names its line"),
        pytest.param({A100_US_CENTRAL1: ("3.673385", "3,67")}, ["line 32", "expected 12 fields"],
                     id="a decimal comma that splits a row into too many fields names its line"),
        pytest.param({A100_US_CENTRAL1: ("us-central1", "US Central 1")}, ["line 32", "region"],
                     id="a region that is not a GCP region name names its line"),
        pytest.param({A100_US_CENTRAL1: (",a100,", ",a100x,")}, ["line 32", "a2-highgpu-1g", "a100x"],
                     id="an unknown GPU type names its line, the machine and the type"),
        pytest.param({A100_US_CENTRAL1: (",1,12,", ",0,12,")}, ["line 32", "gpu_count"],
                     id="a machine with no GPUs names its line"),
    ],
)
def test_a_malformed_price_file_is_refused_naming_file_and_row(
    tmp_path: Path, edit: dict[int, tuple[str, str]], expected: list[str],
) -> None:
    broken = _copy_with(tmp_path, PRICES_CSV, 40, edit)
    with pytest.raises(DataFileError) as err:
        load_gcp_prices(broken)
    assert str(broken) in str(err.value)
    for text in expected:
        assert text in str(err.value)


def test_an_empty_spot_price_means_no_spot_offer(tmp_path: Path) -> None:
    copy = _copy_with(tmp_path, PRICES_CSV, 40, {A100_US_CENTRAL1: (",1.92802,", ",,")})
    table = load_gcp_prices(copy)
    assert table.price("gcp:us-central1", "a100-40gb", spot=True) is None
    assert table.price("gcp:us-central1", "a100-40gb") == pytest.approx(3.673385)


# --- latency ------------------------------------------------------------------------------------------


def test_rtt_is_the_same_in_both_directions(latency: LatencyMatrix) -> None:
    matrix = latency.as_array(latency.regions)
    assert matrix.shape == (69, 69)
    assert np.array_equal(matrix, matrix.T, equal_nan=True)
    assert latency.rtt_ms("aws:eu-north-1", "azure:eastus") == latency.rtt_ms("azure:eastus", "aws:eu-north-1")


@pytest.mark.parametrize(
    ("a", "b", "combine", "rtt_ms"),
    [
        pytest.param("gcp:us-central1", "gcp:us-east1", "min", 32.821,
                     id="Iowa to South Carolina is the lower of the two premium readings (33.071 and 32.821 ms)"),
        pytest.param("gcp:us-east1-b", "gcp:us-central1-a", "median", (33.071 + 32.821) / 2,
                     id="with the median rule two readings give their mean, zones read as their regions"),
        pytest.param("azure:uksouth", "gcp:europe-west2", "min", 3.658,
                     id="two London regions are 3.7 ms apart although one reading spiked to 133.8 ms"),
        pytest.param("azure:uksouth", "gcp:europe-west2", "median", (3.658 + 133.834) / 2,
                     id="the median rule lets the 133.8 ms spike pull two London regions to 69 ms"),
    ],
)
def test_duplicate_measurements_of_a_pair_are_resolved_by_the_chosen_rule(
    a: str, b: str, combine: str, rtt_ms: float, latency: LatencyMatrix,
) -> None:
    matrix = latency if combine == "min" else load_latency(LATENCY_CSV, combine="median")  # type: ignore[arg-type]
    assert matrix.rtt_ms(a, b) == pytest.approx(rtt_ms)


def test_the_report_counts_the_duplicates_and_names_the_largest_disagreement(latency: LatencyMatrix) -> None:
    report = latency.report
    assert (report.pairs, report.pairs_with_duplicates, report.measurements_merged) == (2346, 2346, 2346)
    assert report.largest_disagreement_pair == ("azure:uksouth", "gcp:europe-west2")
    assert sorted(report.largest_disagreement_rtt_ms) == [3.658, 133.834]
    assert report.largest_disagreement_ms == pytest.approx(130.176)
    assert report.rows_other_tier == 3318


def test_the_standard_tier_is_a_separate_network_of_gcp_regions_only() -> None:
    standard = load_latency(LATENCY_CSV, tier="standard")
    assert all(r.startswith("gcp:") for r in standard.regions)
    assert standard.rtt_ms("gcp:us-central1", "gcp:us-east1") == pytest.approx(32.356)  # min(32.356, 32.387)


def test_a_region_is_zero_ms_from_itself_and_an_unmeasured_pair_names_both_regions(latency: LatencyMatrix) -> None:
    assert latency.rtt_ms("gcp:us-east1-b", "gcp:us-east1-c") == 0.0
    with pytest.raises(UnmeasuredPair, match=r"gcp:us-east1 and gcp:me-west1") as err:
        latency.rtt_ms("gcp:us-east1", "gcp:me-west1")
    assert isinstance(err.value, KeyError)
    row = latency.as_array(["gcp:us-east1", "gcp:me-west1"])
    assert row[0, 0] == 0.0 and math.isnan(row[0, 1])


def test_the_nearest_candidate_is_the_one_with_the_lowest_rtt(latency: LatencyMatrix) -> None:
    candidates = ["aws:eu-west-1", "aws:eu-west-2", "azure:uksouth", "gcp:asia-east1", "gcp:me-west1"]
    assert latency.nearest("gcp:europe-west2-a", candidates) == ("azure:uksouth", 3.658)
    with pytest.raises(UnmeasuredPair):
        latency.nearest("gcp:europe-west2", ["gcp:me-west1"])


LATENCY_FIRST_ROW = 2  # aws:eu-north-1,PREMIUM,m5.large,azure:eastus,PREMIUM,Standard_D2_v3,105.897,105.976,...


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param({1: ("avg_rtt", "mean_rtt")}, ["line 1", "'avg_rtt'"], id="a missing avg_rtt column is named"),
        pytest.param({LATENCY_FIRST_ROW: ("105.976", "n/a")}, ["line 2", "avg_rtt"],
                     id="an RTT that is not a number names its line and column"),
        pytest.param({LATENCY_FIRST_ROW: ("aws:eu-north-1", "eu-north-1")}, ["line 2", "src_region"],
                     id="a region without its provider names its line"),
        pytest.param({LATENCY_FIRST_ROW: ("azure:eastus", "azure:east us")}, ["line 2", "dst_region"],
                     id="a malformed region names its line"),
        pytest.param({LATENCY_FIRST_ROW: (",PREMIUM,m5", ",GOLD,m5")}, ["line 2", "GOLD"],
                     id="an unknown network tier names its line"),
    ],
)
def test_a_malformed_latency_file_is_refused_naming_file_and_row(
    tmp_path: Path, edit: dict[int, tuple[str, str]], expected: list[str],
) -> None:
    broken = _copy_with(tmp_path, LATENCY_CSV, 10, edit)
    with pytest.raises(DataFileError) as err:
        load_latency(broken)
    assert str(broken) in str(err.value)
    for text in expected:
        assert text in str(err.value)


def test_a_quote_never_closed_in_a_latency_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    # The rest of the file runs into one field, past the csv module's 128 KiB limit: its own error names no file.
    lines = LATENCY_CSV.read_text(encoding="utf-8").splitlines()
    lines[LATENCY_FIRST_ROW] = '"' + lines[LATENCY_FIRST_ROW]
    broken = tmp_path / "latency.csv"
    broken.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataFileError) as err:
        load_latency(broken)
    assert str(err.value).startswith(f"{broken}: after line {LATENCY_FIRST_ROW}: not a readable CSV")


# --- regions ------------------------------------------------------------------------------------------


def test_johannesburgs_wrong_sign_latitude_is_reported_not_changed(regions: RegionTable) -> None:
    joburg = [p for p in regions.problems if p.region == "gcp:africa-south1"]
    assert [(p.field, p.value, p.suggested) for p in joburg] == [("latitude", 26.2056, -26.2056)]
    assert "sign" in joburg[0].reason and "south africa" in joburg[0].reason
    assert regions["gcp:africa-south1"].latitude_deg == 26.2056  # as the file has it

    fixed = regions.with_suggested_fixes()
    assert fixed["gcp:africa-south1"].latitude_deg == -26.2056
    assert regions["gcp:africa-south1"].latitude_deg == 26.2056
    assert not any(p.region == "gcp:africa-south1" for p in fixed.problems)


def test_the_real_region_file_has_exactly_two_problems(regions: RegionTable) -> None:
    assert [(p.region, p.field) for p in regions.validate()] == [
        ("gcp:africa-south1", "latitude"),
        ("gcp:me-central1", "gCO2_kWh"),  # a stray carbon value (471) only this region carries; ignored
    ]
    assert len(regions) == 40


@pytest.mark.parametrize(
    ("region", "entry", "field", "reason"),
    [
        pytest.param("northamerica-northeast1", {"name": "Montréal, Canada", "latitude": 45.5017, "longitude": 73.5673},
                     "longitude", "sign", id="Montreal east of Greenwich has a wrong-sign longitude"),
        pytest.param("europe-southwest1", {"name": "Madrid, Spain", "latitude": -3.7025, "longitude": 40.4167},
                     "latitude", "swapped", id="Madrid with latitude and longitude exchanged is reported as swapped"),
        pytest.param("europe-southwest1", {"name": "Madrid, Spain", "latitude": 48.8566, "longitude": 2.3522},
                     "latitude", "outside spain", id="Paris's coordinates under Madrid's name are outside Spain"),
        pytest.param("europe-southwest1", {"name": "Atlantis", "latitude": 40.4, "longitude": -3.7},
                     "name", "cannot check", id="a country the table does not know is reported as unchecked"),
        pytest.param("europe-southwest1", {"name": "Madrid, Spain", "latitude": 140.4, "longitude": -3.7},
                     "latitude", "-90..90", id="a latitude beyond the pole is out of range"),
        pytest.param("us-east1", {"name": "Madrid, Spain", "latitude": 40.4167, "longitude": -3.7025},
                     "latitude", "'us' implies", id="a us- region placed in Spain contradicts its id"),
    ],
)
def test_suspicious_coordinates_are_reported_with_the_reason(
    tmp_path: Path, region: str, entry: dict[str, object], field: str, reason: str,
) -> None:
    path = tmp_path / "regions.json"
    path.write_text(json.dumps({region: entry}), encoding="utf-8")
    table = load_gcp_regions(path)
    assert [p.field for p in table.problems][:1] == [field]
    assert reason in table.problems[0].reason
    assert table[f"gcp:{region}"].latitude_deg == entry["latitude"]  # reported, not changed


def test_london_to_frankfurt_is_about_640_km(regions: RegionTable) -> None:
    assert regions.great_circle_km("gcp:europe-west2", "gcp:europe-west3") == pytest.approx(640, rel=0.03)
    assert great_circle_km((51.5074, -0.1278), (51.5074, -0.1278)) == 0.0


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param({"us-east1": {"name": "South Carolina, USA", "longitude": -81.2}}, ["'us-east1'", "'latitude'"],
                     id="a region without latitude names the region and field"),
        pytest.param({"us-east1": {"name": "South Carolina, USA", "latitude": "north", "longitude": -81.2}},
                     ["'us-east1'", "'latitude'", "not a number"],
                     id="a latitude that is not a number names the region"),
        pytest.param({"US East 1": {"name": "South Carolina, USA", "latitude": 33.8, "longitude": -81.2}},
                     ["'US East 1'", "not a GCP region"], id="a key that is not a GCP region id is named"),
    ],
)
def test_a_malformed_region_file_is_refused_naming_file_and_region(
    tmp_path: Path, content: dict[str, object], expected: list[str],
) -> None:
    path = tmp_path / "regions.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(DataFileError) as err:
        load_gcp_regions(path)
    assert str(path) in str(err.value)
    for text in expected:
        assert text in str(err.value)


def test_yearly_carbon_is_read_per_region_including_regions_without_coordinates(regions: RegionTable) -> None:
    carbon = load_gcp_region_carbon(CARBON_CSV)
    assert len(carbon) == 44
    assert (carbon["gcp:europe-west2"].g_co2_per_kwh, carbon["gcp:europe-west2"].cfe_fraction) == (105.94, 0.79)
    assert sorted(set(carbon) - set(regions)) == [
        "gcp:europe-north2", "gcp:northamerica-south1", "gcp:us-central2", "gcp:us-east2",
    ]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param({1: ("Google CFE", "CFE")}, ["line 1", "'Google CFE'"], id="a missing CFE column is named"),
        pytest.param({3: ("439.29", "high")}, ["line 3", "Grid carbon intensity"],
                     id="an intensity that is not a number names its line"),
        pytest.param({3: ("0.17", "17")}, ["line 3", "0..1"], id="a CFE percentage instead of a share names its line"),
    ],
)
def test_a_malformed_carbon_file_is_refused_naming_file_and_row(
    tmp_path: Path, edit: dict[int, tuple[str, str]], expected: list[str],
) -> None:
    broken = _copy_with(tmp_path, CARBON_CSV, 6, edit)
    with pytest.raises(DataFileError) as err:
        load_gcp_region_carbon(broken)
    assert str(broken) in str(err.value)
    for text in expected:
        assert text in str(err.value)
