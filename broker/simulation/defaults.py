"""Where the simulator's default inputs are: the copies shipped in ``data/`` (provenance in data/SOURCES.md).
A module of its own so that the command line can name them without importing the simulator."""

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"
DEFAULT_PRICES = DATA / "prices" / "gcp_gpu_instance_prices.csv"
DEFAULT_LATENCY = DATA / "network" / "gcp-latency.csv"
DEFAULT_REGIONS = DATA / "regions" / "regions.json"
