"""Live inputs: carbon intensity and GPU prices as providers behind one interface each.

- :mod:`broker.providers.carbon`: :class:`CarbonProvider` (async ``history``, ``latest``, ``close``) with
  :class:`FileCarbonProvider` (the shipped or shared files) and :class:`HttpCarbonProvider` (an Electricity
  Maps v3 API service, with a cache, timeouts and retries); config :data:`CarbonProviderConfig`
  (``kind: files | http``) and :func:`build_carbon_provider`. Units: gCO2e/kWh, hourly, UTC.
- :mod:`broker.providers.prices`: :class:`PriceProvider` (``usd_per_gpu_hour(site, model, spot)``) with
  :class:`StaticPriceProvider` (the site spec) and :class:`FilePriceProvider` (the GCP price list, falling back
  to the site spec); config :data:`PriceProviderConfig` (``kind: static | files``) and
  :func:`build_price_provider`. Units: US dollars per GPU per hour. A configured provider overrides the site
  spec's static price.

Turning them off: the files provider (carbon) and the static provider (prices) need no network; a scorer is
taken out of decisions by its weight 0, not here.
"""

from broker.providers.carbon import (
    CarbonProvider,
    CarbonProviderConfig,
    FileCarbonProvider,
    FilesCarbonConfig,
    HttpCarbonConfig,
    HttpCarbonProvider,
    ProviderError,
    build_carbon_provider,
    parse_carbon_provider_config,
)
from broker.providers.prices import (
    FilePriceProvider,
    FilesPriceConfig,
    PriceProvider,
    PriceProviderConfig,
    StaticPriceConfig,
    StaticPriceProvider,
    build_price_provider,
    parse_price_provider_config,
)

__all__ = [
    "CarbonProvider",
    "CarbonProviderConfig",
    "FileCarbonProvider",
    "FilePriceProvider",
    "FilesCarbonConfig",
    "FilesPriceConfig",
    "HttpCarbonConfig",
    "HttpCarbonProvider",
    "PriceProvider",
    "PriceProviderConfig",
    "ProviderError",
    "StaticPriceConfig",
    "StaticPriceProvider",
    "build_carbon_provider",
    "build_price_provider",
    "parse_carbon_provider_config",
    "parse_price_provider_config",
]
