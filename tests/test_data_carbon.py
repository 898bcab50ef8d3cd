"""Carbon intensity data: what a user gets from ``load_carbon`` on the real Electricity Maps and Let's Wait
Awhile files and on the shipped slice, how gaps, duplicates and odd timestamps are handled and reported, and
which mistakes in the files or in a question stop with a message that says where."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from broker.data.carbon import CarbonData, CarbonDataError, CarbonSpanError, load_carbon

ROOT = Path(__file__).resolve().parents[1]
SLICE = ROOT / "data" / "carbon"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "carbon-intensity"
ELECTRICITY_MAPS = SHARED / "electricitymaps-hourly"
LETS_WAIT_AWHILE = SHARED / "letswaitawhile-2020"


SIXTEEN_ZONES = (
    "AU-NSW", "AU-VIC", "BR-SP", "CA-ON", "CL-SIC", "DE-LU", "GB", "IN-WE", "JP-TK", "KR", "SG",
    "US-CAL-CISO", "US-MIDA-PJM", "US-NY-NYIS", "US-TEX-ERCO", "ZA",
)
DEMO_ZONES = ("AU-NSW", "BR-SP", "CA-ON", "DE-LU", "GB", "JP-TK", "US-CAL-CISO", "US-MIDA-PJM")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.fixture(scope="module")
def direct() -> CarbonData:
    return load_carbon(ELECTRICITY_MAPS)


@pytest.fixture(scope="module")
def lifecycle() -> CarbonData:
    return load_carbon(ELECTRICITY_MAPS, lifecycle=True)


# --- a copy of a real file, edited: the builder for the problem cases -----------------------------------

SLICE_FILE = SLICE / "DE-LU" / "DE-LU_2022-slice.csv"
SLICE_LINES = SLICE_FILE.read_text(encoding="utf-8").splitlines()  # line 1 is the header; hour h is line h + 2


def line_of(hour: datetime) -> int:
    """The 1-based line of the DE-LU slice that holds ``hour`` (2022-06-01 00:00 UTC is line 2)."""
    return int((hour - utc(2022, 6, 1)) / timedelta(hours=1)) + 2


def direct_value(hour: datetime) -> float:
    return float(SLICE_LINES[line_of(hour) - 1].split(",")[4])


def zone_copy(tmp_path: Path, edit: Callable[[list[str]], list[str]] = lambda lines: lines,
              name: str = "DE-LU_2022-slice.csv") -> Path:
    """A carbon folder holding one DE-LU file: the shipped real rows after ``edit``."""
    folder = tmp_path / "carbon" / "DE-LU"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("\n".join(edit(list(SLICE_LINES))) + "\n", encoding="utf-8")
    return tmp_path / "carbon"


def without_hours(first: datetime, count: int) -> Callable[[list[str]], list[str]]:
    start = line_of(first) - 1
    return lambda lines: lines[:start] + lines[start + count:]


def replace_on(hour: datetime, old: str, new: str) -> Callable[[list[str]], list[str]]:
    def edit(lines: list[str]) -> list[str]:
        k = line_of(hour) - 1
        assert old in lines[k]
        lines[k] = lines[k].replace(old, new, 1)
        return lines
    return edit


# --- the real Electricity Maps files ------------------------------------------------------------------


def test_all_sixteen_zones_load_with_every_hour_of_2021_and_2022(direct: CarbonData) -> None:
    assert direct.zones() == SIXTEEN_ZONES
    for zone in SIXTEEN_ZONES:
        assert direct.span(zone) == (utc(2021, 1, 1), utc(2023, 1, 1)), zone
        assert len(direct.series(zone, utc(2021, 1, 1), 17_520)) == 17_520, zone


def test_the_real_files_need_no_gap_filling_or_duplicate_resolution(direct: CarbonData) -> None:
    # The only notes are the three zones whose rows carry another zone id than their folder.
    assert direct.report == [
        "BR-SP: rows name zone BR-CS; loaded as BR-SP, its folder's name",
        "CL-SIC: rows name zone CL-SEN; loaded as CL-SIC, its folder's name",
        "DE-LU: rows name zone DE; loaded as DE-LU, its folder's name",
    ]


def test_brazil_is_named_by_its_folder_br_sp_although_its_rows_say_br_cs(direct: CarbonData) -> None:
    assert "BR-SP" in direct.zones()
    assert "BR-CS" not in direct.zones()
    # BR-CS is an alias of BR-SP, so asking by the rows' name finds the same series.
    assert direct.intensity("BR-CS", utc(2022, 6, 10, 15)) == direct.intensity("BR-SP", utc(2022, 6, 10, 15)) == 76.75


@pytest.mark.parametrize(
    ("zone", "hour", "g_direct", "g_lifecycle"),
    [
        pytest.param("GB", utc(2021, 3, 28, 1), 65.9, 110.26,
                     id="GB at 01:00 UTC on the day British clocks go forward reads as in the file"),
        pytest.param("US-CAL-CISO", utc(2022, 12, 31, 23), 229.67, 300.57,
                     id="California's last hour of 2022 reads as in the file"),
        pytest.param("JP-TK", utc(2021, 1, 1, 0), 377.36, 459.22,
                     id="Tokyo's first hour of 2021 reads as in the file"),
        pytest.param("DE-LU", utc(2021, 5, 3, 1, 59), 330.65, 397.4,
                     id="a time late in an hour reads that hour's value"),
        pytest.param("DE-LU", datetime(2021, 5, 3, 4, 0, tzinfo=timezone(timedelta(hours=2))), 335.16, 402.25,
                     id="a time given in Berlin summer time reads the UTC hour it is"),
    ],
)
def test_known_hours_read_the_values_in_the_file(direct: CarbonData, lifecycle: CarbonData, zone: str,
                                                 hour: datetime, g_direct: float, g_lifecycle: float) -> None:
    assert direct.intensity(zone, hour) == g_direct
    assert lifecycle.intensity(zone, hour) == g_lifecycle


def test_life_cycle_intensity_is_above_direct_in_every_hour_of_every_zone(direct: CarbonData,
                                                                          lifecycle: CarbonData) -> None:
    assert direct.lifecycle is False and lifecycle.lifecycle is True
    for zone in SIXTEEN_ZONES:
        assert (lifecycle.series(zone, utc(2021, 1, 1), 17_520) > direct.series(zone, utc(2021, 1, 1), 17_520)).all()


def test_zones_restricts_what_loads_and_accepts_aliases() -> None:
    data = load_carbon(ELECTRICITY_MAPS, zones=["caiso", "germany"])
    assert data.zones() == ("DE-LU", "US-CAL-CISO")


# --- the real Let's Wait Awhile files ------------------------------------------------------------------


def test_lets_wait_awhile_files_load_as_de_lu_gb_and_fr_at_hourly_resolution() -> None:
    data = load_carbon(LETS_WAIT_AWHILE)
    assert data.zones() == ("DE-LU", "FR", "GB")
    assert data.span("DE-LU") == (utc(2019, 12, 20), utc(2021, 1, 10))
    assert data.span("GB") == (utc(2019, 12, 20), utc(2021, 1, 10))
    assert data.span("FR") == (utc(2019, 12, 20), utc(2021, 1, 9, 23))  # fr_ci.csv ends at 22:30
    assert "DE-LU: 37147 readings (15 min, 30 min steps) averaged into 9288 hours" in data.report


@pytest.mark.parametrize(
    ("zone", "hour", "readings"),
    [
        pytest.param("DE-LU", utc(2020, 6, 1, 12),
                     (136.59620097031495, 138.02014613865677, 137.89074892813267, 138.68877254217568),
                     id="a German hour is the mean of its four 15-minute readings in ger_ci.csv"),
        pytest.param("GB", utc(2020, 6, 1, 12), (184.93534980374048, 172.72084414351704),
                     id="a British hour in June 2020 is the mean of its two 30-minute readings"),
        pytest.param("GB", utc(2020, 11, 15, 3),
                     (106.26993145743145, 123.61386742015014, 152.59295980598452, 123.93360369179136),
                     id="a British hour after gb_ci.csv turns to 15-minute steps is the mean of four readings"),
    ],
)
def test_an_hour_of_sub_hourly_data_is_the_mean_of_its_readings(zone: str, hour: datetime,
                                                                readings: tuple[float, ...]) -> None:
    data = load_carbon(LETS_WAIT_AWHILE, zones=[zone])
    assert data.intensity(zone, hour) == pytest.approx(sum(readings) / len(readings), rel=1e-12)


def test_asking_a_single_series_file_for_life_cycle_intensity_names_the_file() -> None:
    with pytest.raises(CarbonDataError, match=r"ger_ci\.csv has a single series.*lifecycle=False"):
        load_carbon(LETS_WAIT_AWHILE, lifecycle=True, zones=["DE-LU"])


# --- the shipped slice ---------------------------------------------------------------------------------


def test_the_shipped_slice_holds_three_weeks_of_june_2022_for_the_eight_demo_zones() -> None:
    data = load_carbon(SLICE)
    assert data.zones() == DEMO_ZONES
    for zone in DEMO_ZONES:
        assert data.span(zone) == (utc(2022, 6, 1), utc(2022, 6, 22)), zone
    assert data.intensity("DE-LU", utc(2022, 6, 1, 12)) == 312.38


def test_the_shipped_slice_equals_the_real_files_over_its_three_weeks(direct: CarbonData) -> None:
    shipped = load_carbon(SLICE)
    for zone in DEMO_ZONES:
        np.testing.assert_array_equal(shipped.series(zone, utc(2022, 6, 1), 504),
                                      direct.series(zone, utc(2022, 6, 1), 504), err_msg=zone)


def test_shipped_slice_files_are_small() -> None:
    assert sum(f.stat().st_size for f in SLICE.rglob("*.csv")) < 1_000_000


# --- gaps, duplicates and timestamps in copies of a real file ------------------------------------------


def test_a_three_hour_gap_is_filled_by_linear_interpolation_and_reported(tmp_path: Path) -> None:
    data = load_carbon(zone_copy(tmp_path, without_hours(utc(2022, 6, 5, 10), 3)))
    before, after = direct_value(utc(2022, 6, 5, 9)), direct_value(utc(2022, 6, 5, 13))
    filled = data.series("DE-LU", utc(2022, 6, 5, 10), 3)
    np.testing.assert_allclose(filled, [before + (after - before) * k / 4 for k in (1, 2, 3)])
    assert data.span("DE-LU") == (utc(2022, 6, 1), utc(2022, 6, 22))
    assert data.report == [
        "DE-LU: rows name zone DE; loaded as DE-LU, its folder's name",
        "DE-LU: 3 missing hours in 1 gap filled by linear interpolation: "
        "2022-06-05 10:00 UTC to 2022-06-05 12:00 UTC (3 h)",
    ]


@pytest.mark.parametrize(
    ("first", "hours", "max_gap_hours", "span"),
    [
        pytest.param(utc(2022, 6, 10), 48, 6, "2022-06-10 00:00 UTC to 2022-06-11 23:00 UTC (48 h)",
                     id="a two-day gap is an error naming the zone and the missing span"),
        pytest.param(utc(2022, 6, 5, 10), 3, 2, "2022-06-05 10:00 UTC to 2022-06-05 12:00 UTC (3 h)",
                     id="a three-hour gap is an error when max_gap_hours is lowered to 2"),
    ],
)
def test_a_gap_longer_than_the_limit_is_an_error(tmp_path: Path, first: datetime, hours: int,
                                                 max_gap_hours: int, span: str) -> None:
    folder = zone_copy(tmp_path, without_hours(first, hours))
    with pytest.raises(CarbonDataError) as err:
        load_carbon(folder, max_gap_hours=max_gap_hours)
    assert str(err.value).startswith(f"zone DE-LU has no data from {span}")
    assert f"is {max_gap_hours} h" in str(err.value)


def test_a_duplicated_hour_is_resolved_by_the_mean_and_reported(tmp_path: Path) -> None:
    hour = utc(2022, 6, 7, 8)
    original = direct_value(hour)

    def duplicate_with_another_value(lines: list[str]) -> list[str]:
        row = lines[line_of(hour) - 1]
        fields = row.split(",")
        fields[4] = str(original + 10)
        return lines + [",".join(fields)]  # the duplicate comes last, out of order

    data = load_carbon(zone_copy(tmp_path, duplicate_with_another_value))
    assert data.intensity("DE-LU", hour) == pytest.approx(original + 5)
    assert data.span("DE-LU") == (utc(2022, 6, 1), utc(2022, 6, 22))
    assert data.report[-1] == (
        "DE-LU: 1 duplicate timestamp resolved by the mean of their rows: "
        f"2022-06-07 08:00 UTC (2 rows: {original:g}, {original + 10:g})"
    )


def test_two_files_with_the_same_hours_are_reported_as_duplicates_and_change_no_value(tmp_path: Path) -> None:
    folder = zone_copy(tmp_path)
    zone_copy(tmp_path, name="DE-LU_2022-slice-again.csv")
    data = load_carbon(folder)
    np.testing.assert_array_equal(data.series("DE-LU", utc(2022, 6, 1), 504), load_carbon(SLICE, zones=["DE-LU"])
                                  .series("DE-LU", utc(2022, 6, 1), 504))
    assert data.report[-1].startswith("DE-LU: 504 duplicate timestamps resolved by the mean of their rows: ")
    assert data.report[-1].endswith(" and 499 more")


@pytest.mark.parametrize(
    "written",
    [
        pytest.param("2022-06-05 14:00:00+02:00", id="a timestamp with a +02:00 offset is converted to UTC"),
        pytest.param("2022-06-05T12:00:00Z", id="a timestamp ending in Z is UTC"),
        pytest.param("2022-06-05 07:00:00-05:00", id="a timestamp with a negative offset is converted to UTC"),
        pytest.param("2022-06-05 14:00+02", id="a short offset as long as a plain timestamp is still converted to UTC"),
    ],
)
def test_a_row_with_an_offset_timestamp_lands_on_its_utc_hour(tmp_path: Path, written: str) -> None:
    hour = utc(2022, 6, 5, 12)
    data = load_carbon(zone_copy(tmp_path, replace_on(hour, "2022-06-05 12:00:00", written)))
    assert data.intensity("DE-LU", hour) == direct_value(hour)
    assert data.span("DE-LU") == (utc(2022, 6, 1), utc(2022, 6, 22))
    assert not any("missing" in note or "duplicate" in note for note in data.report)


# --- errors a user can meet while loading ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("hour", "old", "new", "message"),
    [
        pytest.param(utc(2022, 6, 3, 3), ",DE,", ",DE,n/a,", r"row 53: carbon intensity 'n/a' is not a number",
                     id="a non-numeric value names the file and the row"),
        pytest.param(utc(2022, 6, 3, 3), ",DE,", ",DE,-", r"row 53: carbon intensity '-\d.*' is not a finite number",
                     id="a negative value names the file and the row"),
        pytest.param(utc(2022, 6, 3, 3), ",DE,", ",DE,nan,", r"row 53: carbon intensity 'nan' is not a finite number",
                     id="a NaN value names the file and the row"),
        pytest.param(utc(2022, 6, 3, 3), "2022-06-03 03:00:00", "03/06/2022 03:00",
                     r"row 53: '03/06/2022 03:00' is not a timestamp",
                     id="an unreadable timestamp names the file and the row"),
    ],
)
def test_a_bad_row_is_an_error_naming_the_file_and_the_row(tmp_path: Path, hour: datetime, old: str, new: str,
                                                          message: str) -> None:
    folder = zone_copy(tmp_path, replace_on(hour, old, new))
    with pytest.raises(CarbonDataError, match=r"DE-LU_2022-slice\.csv, " + message):
        load_carbon(folder)


def test_a_quote_never_closed_is_an_error_naming_the_file_not_the_csv_modules_bare_one(tmp_path: Path) -> None:
    # A stray quote at the start of a row runs the rest of the file into one field: in a year's file that
    # passes the csv module's 128 KiB field limit, whose own error names no file.
    lines = ["Datetime (UTC),Carbon Intensity gCO₂eq/kWh (direct)", '"2022-06-01 00:00:00,100']
    lines += [f"2022-06-01 00:00:00,{k}" for k in range(20_000)]
    folder = tmp_path / "carbon" / "DE-LU"
    folder.mkdir(parents=True)
    (folder / "year.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CarbonDataError, match=r"year\.csv: not a readable CSV \(field larger than field limit"):
        load_carbon(tmp_path / "carbon")


def test_a_quote_never_closed_in_a_short_file_is_one_short_line_naming_the_row(tmp_path: Path) -> None:
    folder = zone_copy(tmp_path, replace_on(utc(2022, 6, 3, 3), "2022-06-03 03:00:00", '"2022-06-03 03:00:00'))
    with pytest.raises(CarbonDataError,
                       match=r"DE-LU_2022-slice\.csv, row \d+: only 1 fields: \['2022-06-03 03:00") as err:
        load_carbon(folder)
    assert len(str(err.value)) < 300  # the row runs to the end of the file; the message quotes its start


def test_a_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "carbon" / "DE-LU"
    folder.mkdir(parents=True)
    (folder / "latin1.csv").write_bytes("Datetime (UTC),Carbon Intensity gCO₂eq/kWh (direct)\n"
                                        "2022-06-01 00:00:00,100 \xb5\n".encode("latin-1", errors="replace"))
    with pytest.raises(CarbonDataError, match=r"latin1\.csv: not UTF-8 text"):
        load_carbon(tmp_path / "carbon")


def test_the_bad_row_is_found_in_the_life_cycle_column_when_that_is_asked_for(tmp_path: Path) -> None:
    hour = utc(2022, 6, 3, 3)
    lca = SLICE_LINES[line_of(hour) - 1].split(",")[5]
    folder = zone_copy(tmp_path, replace_on(hour, f",{lca},", ",unknown,"))
    assert load_carbon(folder).intensity("DE-LU", hour) == direct_value(hour)  # direct is untouched
    with pytest.raises(CarbonDataError, match=r"row 53: carbon intensity 'unknown' is not a number"):
        load_carbon(folder, lifecycle=True)


@pytest.mark.parametrize(
    ("lifecycle", "column"),
    [
        pytest.param(False, "(direct)", id="a file without the direct column names the file and the column"),
        pytest.param(True, "(LCA)", id="a file without the life-cycle column names the file and the column"),
    ],
)
def test_a_missing_column_names_the_file_and_the_column(tmp_path: Path, lifecycle: bool, column: str) -> None:
    def rename(lines: list[str]) -> list[str]:
        lines[0] = lines[0].replace(f"Carbon Intensity gCO₂eq/kWh {column}", "Intensity")
        return lines

    with pytest.raises(CarbonDataError, match=rf"DE-LU_2022-slice\.csv has no column 'Carbon Intensity gCO₂eq/kWh "
                                              rf"\({column[1:-1]}\)"):
        load_carbon(zone_copy(tmp_path, rename), lifecycle=lifecycle)


def test_the_current_electricity_maps_header_loads_both_series(tmp_path: Path) -> None:
    """Electricity Maps' downloads from 2023 on (and its re-issues of earlier years) write "Carbon intensity",
    "Zone id" and a life-cycle column "(Life cycle)" instead of "(LCA)": the same series, read the same."""
    def current_header(lines: list[str]) -> list[str]:
        lines[0] = (lines[0].replace("Carbon Intensity", "Carbon intensity").replace("(LCA)", "(Life cycle)")
                    .replace("Zone Id", "Zone id"))
        return lines

    folder = zone_copy(tmp_path, current_header)
    old = load_carbon(SLICE, zones=["DE-LU"], lifecycle=True)
    new = load_carbon(folder, lifecycle=True)
    np.testing.assert_array_equal(new.series("DE-LU", utc(2022, 6, 1), 504), old.series("DE-LU", utc(2022, 6, 1), 504))
    np.testing.assert_array_equal(load_carbon(folder).series("DE-LU", utc(2022, 6, 1), 504),
                                  load_carbon(SLICE, zones=["DE-LU"]).series("DE-LU", utc(2022, 6, 1), 504))


def test_a_file_without_a_time_column_names_the_file(tmp_path: Path) -> None:
    def rename(lines: list[str]) -> list[str]:
        lines[0] = lines[0].replace("Datetime (UTC)", "When")
        return lines

    with pytest.raises(CarbonDataError, match=r"DE-LU_2022-slice\.csv has no time column 'Datetime \(UTC\)'"):
        load_carbon(zone_copy(tmp_path, rename))


def test_an_empty_folder_is_an_error_that_says_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(CarbonDataError, match=r"no carbon data in .*: expected one folder per zone"):
        load_carbon(tmp_path)


def test_a_folder_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CarbonDataError, match=r"does not exist"):
        load_carbon(tmp_path / "nowhere")


def test_a_zone_whose_file_has_only_a_header_is_an_error_naming_the_zone(tmp_path: Path) -> None:
    with pytest.raises(CarbonDataError, match=r"zone DE-LU has no rows in .*DE-LU_2022-slice\.csv"):
        load_carbon(zone_copy(tmp_path, lambda lines: lines[:1]))


def test_a_requested_zone_that_is_absent_is_named_with_the_zones_present() -> None:
    with pytest.raises(CarbonDataError, match=r"zone KR not in .*; zones present: AU-NSW, BR-SP, CA-ON, DE-LU, "
                                              r"GB, JP-TK, US-CAL-CISO, US-MIDA-PJM"):
        load_carbon(SLICE, zones=["GB", "KR"])


def test_a_folder_that_names_no_grid_zone_is_an_error_that_says_how_to_lay_out_the_data(tmp_path: Path) -> None:
    (tmp_path / "not a zone").mkdir()
    (tmp_path / "not a zone" / "x.csv").write_text("Time,Carbon Intensity\n2022-01-01 00:00:00,1\n")
    with pytest.raises(CarbonDataError, match=r"does not name a grid zone .* one folder per zone"):
        load_carbon(tmp_path)


# --- questions asked of the data -----------------------------------------------------------------------

# Four hours from 2022-01-01 00:00 UTC: 100, 200, 400 and 800 gCO2e/kWh.
STEPS = CarbonData.from_arrays({"GB": (utc(2022, 1, 1), [100.0, 200.0, 400.0, 800.0])})


@pytest.mark.parametrize(
    ("start", "end", "mean"),
    [
        pytest.param(utc(2022, 1, 1, 0, 30), utc(2022, 1, 1, 2, 15), (0.5 * 100 + 200 + 0.25 * 400) / 1.75,
                     id="half of the first hour, all of the second and a quarter of the third weigh by time"),
        pytest.param(utc(2022, 1, 1, 1, 10), utc(2022, 1, 1, 1, 50), 200.0,
                     id="an interval inside one hour is that hour's value"),
        pytest.param(utc(2022, 1, 1), utc(2022, 1, 1, 4), 375.0, id="the whole span is the mean of its hours"),
        pytest.param(utc(2022, 1, 1, 3, 30), utc(2022, 1, 1, 4), 800.0,
                     id="an interval may end exactly where the data ends"),
        pytest.param(utc(2022, 1, 1, 1), utc(2022, 1, 1, 3), 300.0, id="whole hours are a plain mean"),
        pytest.param(utc(2022, 1, 1, 2, 20), utc(2022, 1, 1, 2, 20), 400.0,
                     id="an empty interval gives the intensity at its instant"),
    ],
)
def test_mean_over_weighs_each_hour_by_the_time_spent_in_it(start: datetime, end: datetime, mean: float) -> None:
    assert STEPS.mean_over("GB", start, end) == pytest.approx(mean, rel=1e-12)
    assert STEPS.mean_over_many("GB", [start], [end]) == pytest.approx([mean], rel=1e-9)


def test_mean_over_many_accepts_datetime64_arrays_and_answers_each_interval() -> None:
    starts = np.array(["2022-01-01T00:30", "2022-01-01T01:10", "2022-01-01T00:00"], dtype="datetime64[s]")
    ends = np.array(["2022-01-01T02:15", "2022-01-01T01:50", "2022-01-01T04:00"], dtype="datetime64[s]")
    np.testing.assert_allclose(STEPS.mean_over_many("GB", starts, ends), [200.0, 200.0, 375.0], rtol=1e-12)


@pytest.mark.parametrize(
    "ask",
    [
        pytest.param(lambda: STEPS.intensity("GB", utc(2022, 1, 1, 4)), id="the hour after the data ends"),
        pytest.param(lambda: STEPS.intensity("GB", utc(2021, 12, 31, 23, 59)), id="a minute before the data starts"),
        pytest.param(lambda: STEPS.mean_over("GB", utc(2022, 1, 1, 3), utc(2022, 1, 1, 4, 1)),
                     id="a run window that ends a minute after the data"),
        pytest.param(lambda: STEPS.series("GB", utc(2022, 1, 1, 2), 3), id="a series running past the data"),
        pytest.param(lambda: STEPS.mean_over_many("GB", [utc(2022, 1, 1)], [utc(2022, 1, 2)]),
                     id="one of many intervals running past the data"),
    ],
)
def test_asking_outside_the_covered_span_is_an_error_naming_the_zone_and_the_span(ask: Callable[[], object]) -> None:
    with pytest.raises(CarbonSpanError,
                       match=r"GB's carbon data, which covers 2022-01-01 00:00 UTC to 2022-01-01 04:00 UTC"):
        ask()


@pytest.mark.parametrize(
    ("when", "value"),
    [
        pytest.param(utc(2022, 1, 1, 1, 59, 59), 200.0, id="the last second of an hour reads that hour"),
        pytest.param(utc(2022, 1, 1, 2), 400.0, id="the top of the hour reads the new hour"),
        pytest.param(datetime(2022, 1, 1, 3, 30, tzinfo=timezone(timedelta(hours=2))), 200.0,
                     id="a time in another timezone reads its UTC hour"),
    ],
)
def test_intensity_reads_the_hour_containing_the_time(when: datetime, value: float) -> None:
    assert STEPS.intensity("GB", when) == value


def test_series_is_a_read_only_slice_from_the_hour_containing_start() -> None:
    values = STEPS.series("GB", utc(2022, 1, 1, 1, 40), 2)
    np.testing.assert_array_equal(values, [200.0, 400.0])
    with pytest.raises(ValueError, match="read-only"):
        values[0] = 0.0


def test_a_naive_datetime_is_refused_rather_than_guessed() -> None:
    with pytest.raises(CarbonDataError, match="must be a timezone-aware datetime"):
        STEPS.intensity("GB", datetime(2022, 1, 1, 1))


def test_asking_for_a_zone_not_loaded_names_it_and_lists_the_zones_loaded() -> None:
    with pytest.raises(CarbonDataError, match=r"no carbon data for zone 'FR'; zones loaded: GB"):
        STEPS.intensity("FR", utc(2022, 1, 1))


def test_an_interval_that_ends_before_it_starts_is_an_error() -> None:
    with pytest.raises(CarbonSpanError, match="ends before it starts"):
        STEPS.mean_over("GB", utc(2022, 1, 1, 2), utc(2022, 1, 1, 1))

