"""Canonical identifiers: GPU models, cloud regions and grid zones, each in one table with its aliases.

Everything that enters heliotrope (a site spec, a job spec, a price list, a node label read from a
cluster) is turned into these canonical names at the edge, so the rest of the code compares plain
strings.

- GPU models: ``a100-40gb``, ``h100-80gb``, ``l4`` … from vendor product names (``NVIDIA A100-SXM4-80GB``,
  what ``nvidia-smi`` and NVIDIA's GPU feature discovery report) and cloud SKU names
  (``nvidia-tesla-a100``, ``a2-ultragpu``, ``h100-80gb-mega``). An unknown model is an error: a typo must
  not silently create a GPU model that no site has.
- Cloud regions: ``provider:region`` (``gcp:us-east1``, ``aws:eu-west-1``, ``azure:eastus``). Zone
  suffixes are stripped (``gcp:us-east1-b`` → ``gcp:us-east1``, ``aws:eu-west-1a`` → ``aws:eu-west-1``).
  ``onprem:<name>`` names a region outside any cloud.
- Grid zones: as the carbon-intensity data names them (Electricity Maps zone ids, ``DE-LU``,
  ``US-CAL-CISO``). Common aliases (``CAISO``, ``ERCOT``, ``DE``) map to them; any other well-formed zone
  id is accepted as written so that zones outside the shipped data still work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class UnknownIdentifier(ValueError):
    """Raised when a name cannot be mapped to a canonical identifier; the message lists what is known."""


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One canonical GPU model: its id, memory per GPU, board power, every alias it is known by, and whether it
    can be partitioned into MIG slices (NVIDIA's Multi-Instance GPU: A100, H100, H200, B200, RTX PRO 6000
    Blackwell; not L4, L40S, A10G, T4, V100 or P100)."""

    id: str
    memory_gib: int
    tdp_w: int
    aliases: tuple[str, ...]
    mig: bool = False


# One row per canonical model. Aliases are matched after normalisation (lower case, runs of spaces and
# underscores turned into '-'), so "NVIDIA A100-SXM4-80GB" and "nvidia_a100_sxm4_80gb" are the same.
GPU_MODELS: tuple[GpuModel, ...] = (
    GpuModel("a100-40gb", 40, 400, (
        "a100", "nvidia-a100", "nvidia-tesla-a100", "a100-sxm4-40gb", "nvidia-a100-sxm4-40gb",
        "a100-pcie-40gb", "nvidia-a100-pcie-40gb", "a2-highgpu", "a2-megagpu", "p4d",
    ), mig=True),
    GpuModel("a100-80gb", 80, 400, (
        "nvidia-a100-80gb", "a100-sxm4-80gb", "nvidia-a100-sxm4-80gb", "a100-80gb-pcie",
        "nvidia-a100-80gb-pcie", "a2-ultragpu", "p4de",
    ), mig=True),
    GpuModel("h100-80gb", 80, 700, (
        "h100", "nvidia-h100", "nvidia-h100-80gb", "nvidia-h100-80gb-hbm3", "h100-sxm5-80gb",
        "nvidia-h100-sxm5-80gb", "h100-80gb-hbm3", "h100-80gb-mega", "nvidia-h100-mega-80gb",
        "nvidia-h100-pcie", "h100-pcie", "h100-pcie-80gb", "a3-highgpu", "a3-megagpu", "p5",
    ), mig=True),
    GpuModel("h100-94gb", 94, 400, ("h100-nvl", "nvidia-h100-nvl", "nvidia-h100-94gb"), mig=True),
    GpuModel("h200-141gb", 141, 700, ("h200", "nvidia-h200", "nvidia-h200-141gb", "a3-ultragpu", "p5e", "p5en"),
             mig=True),
    GpuModel("b200-180gb", 180, 1000, ("b200", "nvidia-b200", "a4-highgpu", "p6-b200"), mig=True),
    GpuModel("l4", 24, 72, ("nvidia-l4", "l4-24gb", "g2-standard", "g6")),
    GpuModel("l40s-48gb", 48, 350, ("l40s", "nvidia-l40s", "g6e")),
    GpuModel("a10g-24gb", 24, 150, ("a10g", "nvidia-a10g", "g5")),
    GpuModel("t4", 16, 70, ("tesla-t4", "nvidia-tesla-t4", "nvidia-t4", "t4-16gb", "g4dn")),
    GpuModel("v100-16gb", 16, 300, (
        "v100", "tesla-v100", "nvidia-tesla-v100", "tesla-v100-sxm2-16gb", "tesla-v100-pcie-16gb",
        "v100-sxm2-16gb", "p3",
    )),
    GpuModel("v100-32gb", 32, 300, ("tesla-v100-sxm2-32gb", "tesla-v100-pcie-32gb", "v100-sxm2-32gb", "p3dn")),
    GpuModel("p100-16gb", 16, 250, ("p100", "tesla-p100", "nvidia-tesla-p100", "tesla-p100-pcie-16gb")),
    GpuModel("rtx-pro-6000", 96, 600, (
        "rtx6000", "rtx-6000", "nvidia-rtx-pro-6000", "nvidia-rtx-pro-6000-blackwell-server-edition", "g4-standard",
    ), mig=True),
)

_SEP = re.compile(r"[\s_]+")


def _norm(name: str) -> str:
    return _SEP.sub("-", name.strip().lower())


_GPU_BY_ALIAS: dict[str, GpuModel] = {}
for _m in GPU_MODELS:
    for _alias in (_m.id, *_m.aliases):
        _key = _norm(_alias)
        if _key in _GPU_BY_ALIAS:
            raise RuntimeError(f"GPU alias {_alias!r} is listed twice")
        _GPU_BY_ALIAS[_key] = _m

GPU_MODEL_IDS: tuple[str, ...] = tuple(m.id for m in GPU_MODELS)
GPU_MODEL_BY_ID: dict[str, GpuModel] = {m.id: m for m in GPU_MODELS}


def gpu_model(name: str) -> str:
    """Return the canonical GPU model id for ``name`` (a canonical id, product name or cloud SKU).

    >>> gpu_model("NVIDIA A100-SXM4-80GB")
    'a100-80gb'
    """
    model = _GPU_BY_ALIAS.get(_norm(name))
    if model is None:
        raise UnknownIdentifier(
            f"unknown GPU model {name!r}; known models: {', '.join(GPU_MODEL_IDS)}"
        )
    return model.id


# --- cloud regions ------------------------------------------------------------------------------------

PROVIDERS = ("gcp", "aws", "azure", "onprem")

# Region syntax per provider, with the zone suffix as an optional group that is dropped.
_REGION_SYNTAX: dict[str, re.Pattern[str]] = {
    "gcp": re.compile(r"^(?P<region>[a-z]+-[a-z]+\d+)(?:-[a-z])?$"),
    "aws": re.compile(r"^(?P<region>[a-z]{2}(?:-gov)?-[a-z]+-\d+)[a-z]?$"),
    "azure": re.compile(r"^(?P<region>[a-z][a-z0-9]+)$"),
    "onprem": re.compile(r"^(?P<region>[a-z0-9][a-z0-9._-]{0,62})$"),
}


def region(name: str) -> str:
    """Return the canonical ``provider:region`` for ``name``, zone suffix stripped.

    >>> region("GCP:us-east1-b")
    'gcp:us-east1'
    >>> region("aws:eu-west-1a")
    'aws:eu-west-1'
    """
    raw = name.strip().lower()
    provider, sep, rest = raw.partition(":")
    if not sep:
        raise UnknownIdentifier(
            f"region {name!r} must be written provider:region, for example gcp:us-east1 or aws:eu-west-1"
        )
    syntax = _REGION_SYNTAX.get(provider)
    if syntax is None:
        raise UnknownIdentifier(f"unknown cloud provider {provider!r} in region {name!r}; known: {', '.join(PROVIDERS)}")
    match = syntax.match(rest)
    if match is None:
        raise UnknownIdentifier(f"{rest!r} is not a well-formed {provider} region name")
    return f"{provider}:{match.group('region')}"


# --- grid zones ---------------------------------------------------------------------------------------

# Zones of the shipped carbon data (Electricity Maps ids), with the names people also use for them.
GRID_ZONES: dict[str, tuple[str, ...]] = {
    "AU-NSW": ("new-south-wales",),
    "AU-VIC": ("victoria",),
    "BR-SP": ("BR-CS", "sao-paulo"),
    "CA-ON": ("ontario", "IESO"),
    "CL-SIC": ("chile",),
    "DE-LU": ("DE", "germany", "GER"),
    "FR": ("france",),
    "GB": ("UK", "great-britain"),
    "IN-WE": ("india-west",),
    "JP-TK": ("tokyo", "TEPCO"),
    "KR": ("south-korea", "korea"),
    "SG": ("singapore",),
    "US-CAL-CISO": ("CAISO", "california"),
    "US-MIDA-PJM": ("PJM",),
    "US-NY-NYIS": ("NYISO", "new-york"),
    "US-TEX-ERCO": ("ERCOT", "texas"),
    "ZA": ("south-africa", "eskom"),
}
_ZONE_BY_ALIAS: dict[str, str] = {}
for _zone, _aliases in GRID_ZONES.items():
    for _alias in (_zone, *_aliases):
        _ZONE_BY_ALIAS[_norm(_alias)] = _zone

_ZONE_SYNTAX = re.compile(r"^[A-Z]{2}(?:-[A-Z0-9]{1,8}){0,3}$")


def grid_zone(name: str) -> str:
    """Return the canonical grid zone id: an alias from the table, or a well-formed zone id as written.

    >>> grid_zone("caiso")
    'US-CAL-CISO'
    """
    known = _ZONE_BY_ALIAS.get(_norm(name))
    if known is not None:
        return known
    upper = name.strip().upper()
    if _ZONE_SYNTAX.match(upper):
        return upper
    raise UnknownIdentifier(
        f"{name!r} is not a grid zone id; use the carbon data's zone names, for example DE-LU or US-CAL-CISO"
    )
