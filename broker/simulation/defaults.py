"""Where the simulator's default inputs are: the copies shipped in ``data/`` (provenance in data/SOURCES.md;
``broker.shipped`` finds the folder in a checkout and in an installed wheel). A module of its own so that the
command line can name them without importing the simulator."""

from broker.shipped import DATA

DEFAULT_CARBON = DATA / "carbon"
DEFAULT_PRICES = DATA / "prices" / "gcp_gpu_instance_prices.csv"
DEFAULT_LATENCY = DATA / "network" / "gcp-latency.csv"
DEFAULT_REGIONS = DATA / "regions" / "regions.json"
