"""Round-trip times between cloud regions, in milliseconds, from Skyplane's measured ``latency.csv``.

Input columns: ``src_region, src_tier, src_instance_class, dst_region, dst_tier, dst_instance_class,
min_rtt, avg_rtt, max_rtt, mdev_rtt`` (ms; ``mdev_rtt`` may be empty). Output: :class:`LatencyMatrix` of
``rtt_ms`` per unordered pair of canonical regions (:func:`broker.ids.region`: ``gcp:us-east1-b`` →
``gcp:us-east1``, ``aws:eu-north-1``, ``azure:eastus``).

Rules (each a choice; the reason follows it):

- One network tier only (default ``PREMIUM``): a row is used when both its ``src_tier`` and ``dst_tier``
  equal it. GCP's Standard tier hands traffic to the public internet near the source region, so its RTTs
  are a different, usually slower network; averaging the two tiers would describe neither. AWS and Azure
  rows are all labelled ``PREMIUM``, so ``tier="STANDARD"`` leaves only GCP↔GCP pairs.
- The value of a measurement is its ``avg_rtt`` (the mean of one ping run); min/max/mdev are checked to be
  numbers but not used.
- RTT is symmetric (a round trip from A and one from B cross the same two paths), so measurements of
  A→B and B→A are measurements of one pair. The file has each pair twice, once from each end, and the
  two disagree by up to 130 ms. They are resolved by ``combine``:

  - ``"min"`` (default): the lower of the measurements. Delay noise is one-sided — queues and detours
    only ever add time — so the lowest reading is closest to the path's steady RTT. The median of two
    readings is their mean, which turns a bad reading of 134 ms for two London regions (the other reads
    3.7 ms, and the bad run's own ``min_rtt`` is 3.6 ms: a spike, not the path) into 69 ms.
    Caveat: 6 of the 702 GCP↔GCP premium readings in the 2022 file are lower than light in fibre
    allows for the distance (us-east4→asia-southeast2 reads 120.7 ms where 16,360 km need at least
    160 ms); ``min`` keeps such a reading when it is the lower one.
  - ``"median"``: the median of the measurements (robust when a pair has three or more).

  :attr:`LatencyMatrix.report` gives how many pairs had more than one measurement and the largest
  disagreement, so the choice can be reviewed.
- Measurements between two zones of the same region are dropped: a region to itself is 0 ms by definition.
- An unknown tier, a region that is not well-formed, a non-numeric or negative RTT, or a missing column
  raises :class:`~broker.data.regions.DataFileError` (a ``ValueError``) naming file, line and column.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from broker import ids
from broker.data.regions import DataFileError, csv_float, read_csv_rows

REQUIRED_COLUMNS = ["src_region", "src_tier", "dst_region", "dst_tier", "min_rtt", "avg_rtt", "max_rtt"]
TIERS = ("PREMIUM", "STANDARD")

Pair = tuple[str, str]


class UnmeasuredPair(KeyError):
    """No measurement for this pair of regions in the tier loaded."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class LatencyReport:
    """What loading did: rows used and skipped, duplicates resolved and the largest disagreement."""

    tier: str
    combine: str
    rows_read: int
    rows_other_tier: int
    rows_same_region: int
    pairs: int
    pairs_with_duplicates: int  # pairs measured more than once (both directions count)
    measurements_merged: int  # measurements beyond the first, per pair, summed
    largest_disagreement_pair: Pair | None
    largest_disagreement_rtt_ms: tuple[float, ...]  # every measurement of that pair, as read

    @property
    def largest_disagreement_ms(self) -> float:
        v = self.largest_disagreement_rtt_ms
        return max(v) - min(v) if v else 0.0


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


class LatencyMatrix:
    """RTT in ms between canonical regions; lookups accept any spelling :func:`broker.ids.region` accepts."""

    def __init__(self, rtt_ms: dict[Pair, float], report: LatencyReport) -> None:
        self._rtt_ms = dict(sorted(rtt_ms.items()))
        self.report = report
        self._regions = tuple(sorted({r for pair in self._rtt_ms for r in pair}))

    @property
    def regions(self) -> tuple[str, ...]:
        """Every region with at least one measurement, sorted."""
        return self._regions

    def has(self, a: str, b: str) -> bool:
        ra, rb = ids.region(a), ids.region(b)
        return ra == rb or _pair(ra, rb) in self._rtt_ms

    def rtt_ms(self, a: str, b: str) -> float:
        """RTT in ms between two regions (0 for a region to itself); :class:`UnmeasuredPair` (a
        ``KeyError``) naming both regions when the pair was not measured in this tier."""
        ra, rb = ids.region(a), ids.region(b)
        if ra == rb:
            return 0.0
        try:
            return self._rtt_ms[_pair(ra, rb)]
        except KeyError:
            raise UnmeasuredPair(
                f"no {self.report.tier} RTT measured between {ra} and {rb}"
                + ("" if ra in self._regions and rb in self._regions else
                   f"; {', '.join(r for r in (ra, rb) if r not in self._regions)} has no measurements at all")
            ) from None

    def as_array(self, regions: Iterable[str]) -> np.ndarray:
        """Square ``float64`` matrix of RTT in ms in the order given: 0 on the diagonal, NaN where unmeasured."""
        keys = [ids.region(r) for r in regions]
        out = np.full((len(keys), len(keys)), np.nan)
        for i, a in enumerate(keys):
            for j, b in enumerate(keys):
                if a == b:
                    out[i, j] = 0.0
                else:
                    out[i, j] = self._rtt_ms.get(_pair(a, b), np.nan)
        return out

    def nearest(self, region: str, candidates: Iterable[str]) -> tuple[str, float]:
        """``(candidate, rtt_ms)`` with the lowest RTT from ``region`` (``region`` itself, at 0 ms, if it is a
        candidate); unmeasured candidates are skipped, ties go to the name that sorts first.
        :class:`UnmeasuredPair` when no candidate was measured from ``region``."""
        here = ids.region(region)
        measured = [(self.rtt_ms(here, c), c) for c in {ids.region(c) for c in candidates} if self.has(here, c)]
        if not measured:
            raise UnmeasuredPair(f"none of the candidates has a {self.report.tier} RTT measured from {here}")
        rtt, best = min(measured)
        return best, rtt


def _region(path: Path, line: int, column: str, value: str) -> str:
    try:
        return ids.region(value)
    except ids.UnknownIdentifier as e:
        raise DataFileError(path, f"line {line}", f"column {column!r}: {e}") from None


def load_latency(
    path: str | Path, tier: str = "PREMIUM", combine: Literal["min", "median"] = "min",
) -> LatencyMatrix:
    """Read Skyplane's ``latency.csv`` into a :class:`LatencyMatrix` for one tier (rules in the module docstring)."""
    path = Path(path)
    tier = tier.upper()
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
    if combine not in ("min", "median"):
        raise ValueError(f"combine must be 'min' or 'median', not {combine!r}")
    measured: dict[Pair, list[float]] = defaultdict(list)
    rows_read = rows_other_tier = rows_same_region = 0
    for line, row in read_csv_rows(path, REQUIRED_COLUMNS):
        rows_read += 1
        tiers = (row["src_tier"].strip().upper(), row["dst_tier"].strip().upper())
        for column, value in zip(("src_tier", "dst_tier"), tiers):
            if value not in TIERS:
                raise DataFileError(path, f"line {line}", f"column {column!r}: unknown tier {value!r}; "
                                    f"known: {', '.join(TIERS)}")
        a = _region(path, line, "src_region", row["src_region"])
        b = _region(path, line, "dst_region", row["dst_region"])
        values = {}
        for column in ("min_rtt", "avg_rtt", "max_rtt", "mdev_rtt"):
            if column not in row:
                continue
            value = csv_float(path, line, row, column, empty_ok=column == "mdev_rtt")
            if value is not None and value < 0:
                raise DataFileError(path, f"line {line}", f"column {column!r}: {row[column]!r} is negative")
            values[column] = value
        if tiers != (tier, tier):
            rows_other_tier += 1
            continue
        if a == b:
            rows_same_region += 1
            continue
        measured[_pair(a, b)].append(values["avg_rtt"])  # type: ignore[arg-type]

    reduce = min if combine == "min" else statistics.median
    rtt_ms = {pair: float(reduce(v)) for pair, v in measured.items()}
    dups = {pair: v for pair, v in measured.items() if len(v) > 1}
    worst = max(dups, key=lambda p: (max(dups[p]) - min(dups[p]), p), default=None)
    report = LatencyReport(
        tier=tier, combine=combine, rows_read=rows_read, rows_other_tier=rows_other_tier,
        rows_same_region=rows_same_region, pairs=len(rtt_ms), pairs_with_duplicates=len(dups),
        measurements_merged=sum(len(v) - 1 for v in dups.values()),
        largest_disagreement_pair=worst,
        largest_disagreement_rtt_ms=tuple(dups[worst]) if worst else (),
    )
    return LatencyMatrix(rtt_ms, report)
