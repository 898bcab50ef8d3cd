"""GCP GPU prices per GPU-hour, per region and canonical GPU model, from whole-machine prices.

Input: ``gcp_gpu_instance_prices.csv`` (one row per machine type and region, flattened from Cyclenerd's
``pricing.yml``), columns ``instance_type, gpu_type, gpu_count, region, usd_per_hour, usd_per_hour_spot``
(others are ignored). Output: :class:`PriceTable`, keyed by canonical region ``gcp:<region>`` and canonical
GPU model (:func:`broker.ids.gpu_model`, so ``a100`` → ``a100-40gb``, ``h100-80gb-mega`` → ``h100-80gb``,
``rtx6000`` → ``rtx-pro-6000``), in ``usd_per_gpu_hour`` (US dollars per GPU per hour), on-demand and spot.

Rules (each a choice; the reason follows it):

- Per-GPU price = machine price / ``gpu_count``. The machine price includes its vCPUs and memory, which a
  GPU job uses too, so this is what one GPU-hour costs the user on that machine.
- Fractional machines (``g4-standard-6`` carries 1/8 of an RTX PRO 6000, ``gpu_count`` 0.125): price /
  0.125 is the rate *per whole-GPU equivalent*, which is the right unit to compare with other machines —
  GCP prices the slices pro rata (``g4-standard-12`` at 0.25 GPU costs exactly a quarter of the 1-GPU
  ``g4-standard-48``). But a slice is not a GPU: a job asking for one GPU cannot run on it, and quoting
  the slightly cheaper slice rate (the 1/8 slice has a smaller vCPU share) would promise a price no
  whole-GPU job can get. So slices are kept, normalised, in :meth:`PriceTable.offers`, and the headline
  :meth:`PriceTable.price` uses them only where a region offers a model in slices alone (none does today).
- Several machines offer the same GPU in a region (``g2-standard-4`` … ``-96`` for L4; ``a3-highgpu`` and
  ``a3-megagpu`` both for H100): the headline price is the **cheapest per GPU-hour** over the whole-GPU
  machines, taken separately for on-demand and spot. The broker compares a GPU-hour at a site with a
  GPU-hour on a cloud, and a job can rent the cheapest shape; "the one with the most GPUs" would quote
  e.g. 1.00 instead of 0.71 USD for an L4 in us-central1 only because the 8-GPU shape has more vCPUs per
  GPU. The machine each price comes from is kept (:meth:`PriceTable.entry`) so a decision can name it.
  Caveat: the cheapest shape has the fewest vCPUs and least memory per GPU.
- An empty price (on-demand or spot) is "not offered": it becomes ``None`` and the row takes no part in that
  column. A model a region does not offer at all gives ``None`` from :meth:`PriceTable.price`.
- A ``gpu_type`` that :mod:`broker.ids` does not know, a region that is not a GCP region, a non-numeric
  or negative price, a ``gpu_count`` that is not positive, a missing column, or the same machine listed twice
  for a region raises :class:`~broker.data.regions.DataFileError` (a ``ValueError``) naming file and line.

Regions that lack a model: :meth:`PriceTable.nearest_priced` returns the nearest region (great-circle
distance from a coordinates table) that prices it. Nothing here reads a clock or the network.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from broker import ids
from broker.data.regions import DataFileError, csv_float, great_circle_km, read_csv_rows

REQUIRED_COLUMNS = ["instance_type", "gpu_type", "gpu_count", "region", "usd_per_hour", "usd_per_hour_spot"]


@dataclass(frozen=True, slots=True)
class MachineOffer:
    """One machine type in one region, its price normalised per whole GPU."""

    instance_type: str
    region: str  # canonical
    model: str  # canonical GPU model
    gpu_count: float  # may be a fraction (0.125, 0.25, 0.5)
    usd_per_machine_hour: float | None
    usd_per_machine_hour_spot: float | None
    line: int  # line in the source file (1 = header)

    @property
    def fractional(self) -> bool:
        return self.gpu_count < 1

    @property
    def usd_per_gpu_hour(self) -> float | None:
        return None if self.usd_per_machine_hour is None else self.usd_per_machine_hour / self.gpu_count

    @property
    def usd_per_gpu_hour_spot(self) -> float | None:
        return None if self.usd_per_machine_hour_spot is None else self.usd_per_machine_hour_spot / self.gpu_count


@dataclass(frozen=True, slots=True)
class PriceEntry:
    """The headline price of a model in a region and the machine each price comes from."""

    region: str
    model: str
    usd_per_gpu_hour: float | None
    usd_per_gpu_hour_spot: float | None
    instance_type: str | None  # the machine the on-demand price comes from
    spot_instance_type: str | None  # the machine the spot price comes from


def _cheapest(offers: list[MachineOffer], spot: bool) -> MachineOffer | None:
    def price(o: MachineOffer) -> float | None:
        return o.usd_per_gpu_hour_spot if spot else o.usd_per_gpu_hour

    priced = [o for o in offers if price(o) is not None]
    whole = [o for o in priced if not o.fractional]
    pool = whole or priced
    # Prices within a micro-dollar are a tie (the 1-, 2- and 4-GPU shapes of a family differ only in float
    # noise); a tie goes to the machine with fewer GPUs, which a job of any size can rent, then the name.
    return min(pool, key=lambda o: (round(price(o), 6), o.gpu_count, o.instance_type), default=None)


class PriceTable:
    """Per-GPU-hour prices by (canonical region, canonical model). Lookups accept any spelling
    :mod:`broker.ids` accepts (``gcp:us-central1-a``, ``a100``) and raise its ``UnknownIdentifier`` for
    names it does not know."""

    def __init__(self, offers: list[MachineOffer], path: str = "") -> None:
        self.path = path
        grouped: dict[tuple[str, str], list[MachineOffer]] = defaultdict(list)
        for o in offers:
            grouped[(o.region, o.model)].append(o)
        self._offers = {k: sorted(v, key=lambda o: (o.gpu_count, o.instance_type)) for k, v in sorted(grouped.items())}
        self._entries: dict[tuple[str, str], PriceEntry] = {}
        for key, group in self._offers.items():
            on_demand, spot = _cheapest(group, spot=False), _cheapest(group, spot=True)
            if on_demand is None and spot is None:
                continue
            self._entries[key] = PriceEntry(
                key[0], key[1],
                on_demand.usd_per_gpu_hour if on_demand else None,
                spot.usd_per_gpu_hour_spot if spot else None,
                on_demand.instance_type if on_demand else None,
                spot.instance_type if spot else None,
            )

    @property
    def regions(self) -> tuple[str, ...]:
        """Every region with at least one price, sorted."""
        return tuple(sorted({r for r, _ in self._entries}))

    @property
    def models(self) -> tuple[str, ...]:
        """Every canonical model with at least one price, sorted."""
        return tuple(sorted({m for _, m in self._entries}))

    def entry(self, region: str, model: str) -> PriceEntry | None:
        """The headline prices and the machines they come from, or None where the model is not offered."""
        return self._entries.get((ids.region(region), ids.gpu_model(model)))

    def offers(self, region: str, model: str) -> list[MachineOffer]:
        """Every machine offering the model in the region, fractional ones included, smallest first."""
        return list(self._offers.get((ids.region(region), ids.gpu_model(model)), []))

    def price(self, region: str, model: str, spot: bool = False) -> float | None:
        """USD per GPU-hour (on-demand, or spot), or None where the region does not offer it."""
        e = self.entry(region, model)
        if e is None:
            return None
        return e.usd_per_gpu_hour_spot if spot else e.usd_per_gpu_hour

    def regions_with(self, model: str, spot: bool = False) -> tuple[str, ...]:
        """The regions that price the model (on-demand, or spot), sorted."""
        m = ids.gpu_model(model)
        column = "usd_per_gpu_hour_spot" if spot else "usd_per_gpu_hour"
        return tuple(r for (r, mm), e in self._entries.items() if mm == m and getattr(e, column) is not None)

    def nearest_priced(
        self, region: str, model: str, coords: Mapping[str, tuple[float, float]], spot: bool = False,
    ) -> tuple[str, float]:
        """``(region, usd_per_gpu_hour)`` of the region nearest to ``region`` (great-circle distance, from
        ``coords``: ``{region: (latitude_deg, longitude_deg)}``, e.g. ``RegionTable.coordinates()`` or a
        ``RegionTable`` itself) that prices the model; ``region`` itself when it does. Priced regions
        missing from ``coords`` are skipped. Raises ``KeyError`` when ``region`` has no coordinates and
        ``LookupError`` when no region with coordinates prices the model."""
        here, m = ids.region(region), ids.gpu_model(model)
        own = self.price(here, m, spot)
        if own is not None:
            return here, own
        lat_lon = _lat_lon(coords)
        if here not in lat_lon:
            raise KeyError(f"{here} has no coordinates in the table given, so no region is nearest to it")
        candidates = [r for r in self.regions_with(m, spot) if r in lat_lon]
        if not candidates:
            raise LookupError(f"no region with coordinates prices {m} ({'spot' if spot else 'on-demand'})")
        best = min(candidates, key=lambda r: (great_circle_km(lat_lon[here], lat_lon[r]), r))
        price = self.price(best, m, spot)
        assert price is not None
        return best, price


def _lat_lon(coords: Mapping[str, object]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for key, value in coords.items():
        point = getattr(value, "lat_lon_deg", value)  # a Region, or a (lat, lon) pair
        lat, lon = point  # type: ignore[misc]
        out[ids.region(key)] = (float(lat), float(lon))
    return out


def load_gcp_prices(path: str | Path) -> PriceTable:
    """Read the GCP GPU machine price list into a :class:`PriceTable` (rules in the module docstring)."""
    path = Path(path)
    offers: list[MachineOffer] = []
    seen: dict[tuple[str, str], int] = {}
    for line, row in read_csv_rows(path, REQUIRED_COLUMNS):
        where = f"line {line}"
        instance_type = row["instance_type"].strip()
        try:
            model = ids.gpu_model(row["gpu_type"])
        except ids.UnknownIdentifier as e:
            raise DataFileError(path, where, f"column 'gpu_type' ({instance_type}): {e}") from None
        try:
            region = ids.region(f"gcp:{row['region'].strip()}")
        except ids.UnknownIdentifier as e:
            raise DataFileError(path, where, f"column 'region': {e}") from None
        if (region, instance_type) in seen:
            raise DataFileError(path, where, f"{instance_type} in {region} is already listed on line "
                                f"{seen[(region, instance_type)]}")
        seen[(region, instance_type)] = line
        gpu_count = csv_float(path, line, row, "gpu_count")
        assert gpu_count is not None
        if gpu_count <= 0:
            raise DataFileError(path, where, f"column 'gpu_count': {row['gpu_count']!r} is not a positive number")
        prices = {}
        for column in ("usd_per_hour", "usd_per_hour_spot"):
            value = csv_float(path, line, row, column, empty_ok=True)
            if value is not None and value < 0:
                raise DataFileError(path, where, f"column {column!r}: {row[column]!r} is negative")
            prices[column] = value
        offers.append(MachineOffer(
            instance_type, region, model, gpu_count, prices["usd_per_hour"], prices["usd_per_hour_spot"], line,
        ))
    return PriceTable(offers, str(path))

