"""Price providers: what one GPU-hour of a model costs at a site, in US dollars per GPU per hour.

The interface (:class:`PriceProvider`, synchronous: prices are read from memory)
    ``usd_per_gpu_hour(site, model, spot=False) -> float | None``: the on-demand (or spot) price of one GPU of
    ``model`` (any spelling :func:`broker.ids.gpu_model` accepts; an unknown one raises its
    ``UnknownIdentifier``) at ``site`` (a :class:`~broker.models.SiteSpec`), or ``None`` where nothing prices
    it. ``source(site, model, spot=False)`` says in words where that price comes from.

Providers
    - :class:`StaticPriceProvider`: the site spec's own ``usd_per_gpu_hour`` (what the platform team registered);
      this is the default and what the broker uses when no price provider is configured. A site spec has one
      price per model and no spot price, so ``spot=True`` gives the same price.
    - :class:`FilePriceProvider`: the GCP price list (:func:`broker.data.prices.load_gcp_prices`, the shipped
      ``data/prices/gcp_gpu_instance_prices.csv``) looked up by the site's region (the cheapest whole-GPU
      machine, as :class:`~broker.data.prices.PriceTable` defines it). Where the list has no price (a region
      outside GCP, a model the region does not offer, no spot price) it falls back to the site spec;
      ``source()`` says which was used.

    **A configured provider overrides the static price in the site spec**: with ``{kind: files}`` the price
    list's price wins wherever it has one, and the spec's ``usd_per_gpu_hour`` is only the fallback. To turn
    the override off, configure ``{kind: static}`` (or no price provider); to take price out of placement
    decisions altogether, give the cost scorer weight 0.

Configuration
    :data:`PriceProviderConfig` (pydantic 2, unknown fields are errors) is ``{kind: static}`` or
    ``{kind: files, path: data/prices/gcp_gpu_instance_prices.csv}``; :func:`build_price_provider` turns one
    into a provider (the file is read then: a ``DataFileError`` naming file and line if it cannot be).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import Field, TypeAdapter

from broker import ids
from broker.data.prices import PriceTable, load_gcp_prices
from broker.models import SiteSpec, Spec, on_this_machine

__all__ = [
    "FilePriceProvider",
    "FilesPriceConfig",
    "PriceProvider",
    "PriceProviderConfig",
    "StaticPriceConfig",
    "StaticPriceProvider",
    "build_price_provider",
    "parse_price_provider_config",
]

SITE_SPEC = "site spec"
NO_PRICE = "none"


@runtime_checkable
class PriceProvider(Protocol):
    """USD per GPU-hour of a model at a site; ``None`` where nothing prices it."""

    def usd_per_gpu_hour(self, site: SiteSpec, model: str, spot: bool = False) -> float | None: ...


class StaticPriceProvider:
    """The prices in the site spec (``usd_per_gpu_hour``); the same price whether ``spot`` or not."""

    def __repr__(self) -> str:
        return "StaticPriceProvider()"

    def usd_per_gpu_hour(self, site: SiteSpec, model: str, spot: bool = False) -> float | None:
        return site.usd_per_gpu_hour.get(ids.gpu_model(model))

    def source(self, site: SiteSpec, model: str, spot: bool = False) -> str:
        """``"site spec"`` where the spec prices the model, else ``"none"``."""
        return SITE_SPEC if self.usd_per_gpu_hour(site, model, spot) is not None else NO_PRICE


class FilePriceProvider:
    """The GCP price list by the site's region, falling back to the site spec; see the module docstring."""

    def __init__(self, table: PriceTable) -> None:
        self.table = table

    @classmethod
    def load(cls, path: str) -> FilePriceProvider:
        """Read the GCP price list at ``path`` (a ``DataFileError`` naming file and line if it cannot)."""
        return cls(load_gcp_prices(path))

    def __repr__(self) -> str:
        return f"FilePriceProvider({self.table.path or 'in memory'})"

    def _listed(self, site: SiteSpec, model: str, spot: bool) -> float | None:
        return self.table.price(site.region, ids.gpu_model(model), spot)

    def usd_per_gpu_hour(self, site: SiteSpec, model: str, spot: bool = False) -> float | None:
        listed = self._listed(site, model, spot)
        if listed is not None:
            return listed
        return site.usd_per_gpu_hour.get(ids.gpu_model(model))

    def source(self, site: SiteSpec, model: str, spot: bool = False) -> str:
        """Where :meth:`usd_per_gpu_hour` takes its price from: ``"price list <file> (<region>, <machine>, on-demand
        |spot)"``, ``"site spec"`` (the list has none) or ``"none"`` (neither has one)."""
        m = ids.gpu_model(model)
        entry = self.table.entry(site.region, m)
        if entry is not None and self._listed(site, m, spot) is not None:
            machine = entry.spot_instance_type if spot else entry.instance_type
            where = f" {self.table.path}" if self.table.path else ""
            return f"price list{where} ({entry.region}, {machine}, {'spot' if spot else 'on-demand'})"
        return SITE_SPEC if site.usd_per_gpu_hour.get(m) is not None else NO_PRICE


# --- configuration --------------------------------------------------------------------------------------


class StaticPriceConfig(Spec):
    """Prices from each site spec's ``usd_per_gpu_hour`` (the default)."""

    kind: Literal["static"]


class FilesPriceConfig(Spec):
    """Prices from the GCP price list by the site's region, falling back to the site spec."""

    kind: Literal["files"]
    path: Annotated[str, on_this_machine("a CSV file", "download it and name the file")] = Field(
        min_length=1, description="the GCP GPU price list CSV, e.g. data/prices/gcp_gpu_instance_prices.csv",
    )


PriceProviderConfig = Annotated[StaticPriceConfig | FilesPriceConfig, Field(discriminator="kind")]
"""``{kind: static}`` or ``{kind: files, path}``."""

_CONFIG = TypeAdapter(PriceProviderConfig)


def parse_price_provider_config(data: Any) -> StaticPriceConfig | FilesPriceConfig:
    """Validate a mapping as a :data:`PriceProviderConfig`; raises pydantic's ``ValidationError``."""
    return _CONFIG.validate_python(data)


def build_price_provider(
    cfg: StaticPriceConfig | FilesPriceConfig | Mapping[str, Any] | None = None,
) -> StaticPriceProvider | FilePriceProvider:
    """The provider a config describes; ``None`` gives the static (site spec) provider."""
    if cfg is None:
        return StaticPriceProvider()
    if not isinstance(cfg, StaticPriceConfig | FilesPriceConfig):
        cfg = parse_price_provider_config(cfg)
    if isinstance(cfg, FilesPriceConfig):
        return FilePriceProvider.load(cfg.path)
    return StaticPriceProvider()
