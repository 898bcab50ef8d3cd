"""Write the recorded Electricity Maps v3 answers in this folder from the shipped carbon slice.

Run from the repository root: ``.venv/bin/python tests/data/electricitymaps/make.py``. It reads
``data/carbon/<FOLDER>/<FOLDER>_2022-slice.csv`` (the Electricity Maps free data; see data/SOURCES.md) and
writes, per zone, the three answers the HTTP carbon provider asks for, as the service would give them on
2022-06-07 at 23:xx UTC: ``<ZONE>.past-range.json`` (2022-06-01 00:00 .. 2022-06-07 23:00, 168 hours),
``<ZONE>.history.json`` (the last 24 hours) and ``<ZONE>.latest.json`` (the last hour). ``<ZONE>`` is the
service's zone id, taken from the rows' ``Zone Id`` column (``DE`` for the ``DE-LU`` folder).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
FOLDERS = ("GB", "DE-LU")
FIRST_DAY, LAST_DAY = "2022-06-01", "2022-06-07"  # inclusive, UTC


def entry(row: dict[str, str]) -> dict[str, object]:
    # The service also sends updatedAt and createdAt, which the files do not have, and rounds the intensity to
    # a whole number; the files' two decimals are kept so that tests can compare with the file provider exactly.
    return {
        "zone": row["Zone Id"],
        "carbonIntensity": float(row["Carbon Intensity gCO₂eq/kWh (direct)"]),
        "datetime": row["Datetime (UTC)"].replace(" ", "T") + ".000Z",
        "emissionFactorType": "direct",
        "isEstimated": row["Data Estimated"].strip().lower() == "true",
        "estimationMethod": row["Data Estimation Method"].strip() or None,
    }


def write(path: Path, payload: dict[str, object], key: str | None) -> None:
    # One entry a line: small, and readable in a diff.
    if key is None:
        text = json.dumps(payload, ensure_ascii=False)
    else:
        head = json.dumps({k: v for k, v in payload.items() if k != key}, ensure_ascii=False)[:-1]
        lines = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in payload[key])  # type: ignore[union-attr]
        text = f'{head}, "{key}": [\n{lines}\n]}}'
    path.write_text(text + "\n", encoding="utf-8")


def main() -> None:
    for folder in FOLDERS:
        csv_path = ROOT / "data" / "carbon" / folder / f"{folder}_2022-slice.csv"
        with csv_path.open(newline="", encoding="utf-8-sig") as fh:
            rows = [r for r in csv.DictReader(fh) if FIRST_DAY <= r["Datetime (UTC)"][:10] <= LAST_DAY]
        entries = [entry(r) for r in rows]
        assert len(entries) == 168, (folder, len(entries))
        zone = str(entries[0]["zone"])
        write(HERE / f"{zone}.past-range.json", {"zone": zone, "data": entries}, "data")
        write(HERE / f"{zone}.history.json", {"zone": zone, "history": entries[-24:]}, "history")
        write(HERE / f"{zone}.latest.json", dict(entries[-1]), None)


if __name__ == "__main__":
    main()
