"""Domain models (pydantic 2): sites, their state, jobs, their state machine, and decisions.

Units live in field names (``duration_s``, ``usd_per_gpu_hour``, ``rtt_ms``, ``memory_gib``); times are
timezone-aware and normalised to UTC; identifiers are canonicalised on the way in (see ``broker.ids``).
Every model forbids unknown fields, so a typo such as ``gpu:`` for ``gpus:`` is an error, not a silent
default.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from broker import ids
from broker.errors import at

_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def _slug(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            "must be 1-63 lower-case letters, digits or '-', starting and ending with a letter or digit"
        )
    return value


def iana_time_zone(value: str) -> str:
    """``value`` if it names an IANA time zone (``Europe/Berlin``), else ``ValueError``."""
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # an area such as 'Europe' is a directory
        raise ValueError(f"{value!r} is not an IANA time zone such as Europe/Berlin") from None
    return value


def _utc(value: datetime) -> datetime:
    if value.tzinfo is UTC:
        return value  # already UTC (every stored time): no copy
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range once converted to UTC") from None


Slug = Annotated[str, AfterValidator(_slug)]
GpuModelId = Annotated[str, AfterValidator(ids.gpu_model)]
RegionId = Annotated[str, AfterValidator(ids.region)]
GridZoneId = Annotated[str, AfterValidator(ids.grid_zone)]
TimeZoneName = Annotated[str, AfterValidator(iana_time_zone)]
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_utc)]


MAX_GPUS_PER_SITE = 200_000  # larger than any single cluster today; bounds what one request can ask of us
MAX_GPU_MEMORY_GIB = 4096  # the most memory a site may say one of its GPUs has
# The most a site spec may charge for one GPU-hour, in USD: no GPU rents for anything near it, so a larger number is
# a slip of the keyboard. It also keeps a job's cost finite: the cost scorer multiplies the price by the GPUs held
# and the run's seconds (up to ~1.3e11 together), and a price past ~1e297 made that infinite, every site's score
# NaN and the placement arbitrary.
MAX_USD_PER_GPU_HOUR = 1_000_000
# The most GPUs a tenant's quota may guarantee or let it burst by: five times the largest site, so that a burst meant
# as "no limit" fits (any number of the site's size or more already lets the tenant take the whole site), while a
# number such as 1e12 is refused as the slip it is.
MAX_QUOTA_GPUS = 1_000_000
MAX_TENANT_LIMIT_GPUS = 10_000_000  # a tenant's limit across the federation (config or API)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Spec(Strict):
    """What a user or an operator writes (a job, a site, its quotas, its adapter): every number finite. JSON's
    ``NaN`` and ``Infinity`` (which Python's parser accepts) and YAML's ``.nan`` and ``.inf`` are refused by
    name, since a stored one could not be read back as the same number (the store's JSON writes it as null)."""

    model_config = ConfigDict(allow_inf_nan=False)


# --- sites --------------------------------------------------------------------------------------------


class NodeGroup(Spec):
    """A group of identical nodes: ``nodes`` machines with ``gpus_per_node`` GPUs of one model each."""

    model: GpuModelId
    gpus_per_node: int = Field(ge=1, le=64)
    nodes: int = Field(ge=1, le=100_000)
    memory_gib_per_gpu: float | None = Field(
        default=None, gt=0, le=MAX_GPU_MEMORY_GIB, description="defaults to the model's memory (a100-40gb: 40)"
    )
    nvlink_domain: str | None = Field(default=None, description="nodes sharing this id share one NVLink domain")
    mig_profiles: list[str] = Field(default_factory=list, description="MIG profiles offered, e.g. 1g.10gb")

    @field_validator("mig_profiles")
    @classmethod
    def _mig(cls, profiles: list[str]) -> list[str]:
        for p in profiles:
            mig_slices(p)
        return profiles

    @model_validator(mode="after")
    def _mig_fits(self, info: ValidationInfo) -> NodeGroup:
        if self.mig_profiles and not ids.GPU_MODEL_BY_ID[self.model].mig and not stored(info):
            raise at("mig_profiles", f"{self.model} GPUs cannot be partitioned into MIG slices (models that "
                                     f"can: {', '.join(m.id for m in ids.GPU_MODELS if m.mig)})")
        for p in self.mig_profiles:
            memory = int(p.split(".")[1][:-2])
            if memory > self.gpu_memory_gib:
                raise at("mig_profiles", f"{p} needs {memory} GiB, more than a {self.model} GPU here has "
                                         f"({self.gpu_memory_gib:g} GiB)")
        return self

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_memory_gib(self) -> float:
        return self.memory_gib_per_gpu or float(ids.GPU_MODEL_BY_ID[self.model].memory_gib)


def mig_slices(profile: str) -> int:
    """The compute slices (of 7) of a MIG profile such as ``3g.40gb``; ValueError for anything else."""
    match = re.fullmatch(r"([1-7])g\.(\d+)gb", profile)
    if match is None or int(match.group(2)) == 0:
        raise ValueError(f"{profile!r} is not a MIG profile such as 1g.10gb or 3g.40gb (1 to 7 compute slices)")
    return int(match.group(1))


class TenantQuota(Spec):
    """A tenant's local quota at one site; enforced by the site (see ``policies.quota``).

    A tenant holds at most ``guaranteed_gpus + burst_gpus`` GPUs (fractions count as their share). Its
    guarantee is honoured whenever it asks: work that borrowed it is preempted. A guarantee for one ``model``
    also takes that model's GPUs back from tenants whose quotas count any model, within their own guarantees,
    when borrowed work is not enough, but only as far as the site's idle GPUs of other models can hold those
    guarantees (``policies.preemption``): a guarantee with no ``model`` is one of GPUs, not of a model.
    ``priority_ceiling`` caps the priority its jobs are ranked with at this site (a job asking more is ranked
    at the ceiling)."""

    tenant: Slug
    guaranteed_gpus: int = Field(default=0, ge=0, json_schema_extra={"maximum": MAX_QUOTA_GPUS},
                                 description=f"at most {MAX_QUOTA_GPUS:,}, and at most the site's GPUs")
    burst_gpus: int = Field(default=0, ge=0, json_schema_extra={"maximum": MAX_QUOTA_GPUS},
                            description=f"allowed above the guarantee; at most {MAX_QUOTA_GPUS:,} (the site's GPUs "
                                        "or more: no limit but the site)")
    fair_share_weight: float = Field(default=1.0, gt=0)
    priority_ceiling: int | None = Field(default=None, ge=-1000, le=1000)
    model: GpuModelId | None = Field(default=None, description="None: counts GPUs of any model")

    @field_validator("guaranteed_gpus", "burst_gpus")
    @classmethod
    def _at_most(cls, gpus: int, info: ValidationInfo) -> int:
        """Not a ``le=``: a quota an earlier release stored (which took any number) still loads."""
        if gpus > MAX_QUOTA_GPUS and not stored(info):
            raise ValueError(f"{gpus:,} GPUs is more than the {MAX_QUOTA_GPUS:,} a quota may give; "
                             + ("a guarantee is at most the site's GPUs" if info.field_name == "guaranteed_gpus"
                                else "a burst of the site's GPUs or more already sets no limit but the site"))
        return gpus

    def beyond(self, capacity: Mapping[str, float]) -> tuple[str, str] | None:
        """(field, problem) where this quota asks for what a site of ``capacity`` (GPUs per model) cannot give:
        a ``model`` it has none of, or a ``guaranteed_gpus`` above its GPUs (of that model); else None. A
        guarantee no site could honour would still keep every other tenant's non-preemptible work out. Checked
        where a quota comes in (a site spec sent to the API, a quota change), not when one is read back: a
        stored one an earlier release took still loads, and its guarantee counts at most the GPUs it names
        (``policies.quota``)."""
        if self.model is not None and capacity.get(self.model, 0) <= 0:
            has = ", ".join(sorted(m for m, n in capacity.items() if n > 0)) or "none"
            return "model", (f"the site has no {self.model} GPUs (it has {has}); name one of its models, or none "
                             f"to count GPUs of any model")
        pool = sum(capacity.values()) if self.model is None else capacity[self.model]
        if self.guaranteed_gpus > pool:
            kind = "" if self.model is None else f" {self.model}"
            return "guaranteed_gpus", (f"{self.guaranteed_gpus} is more than the site's {pool:g}{kind} GPUs; "
                                       f"a guarantee can be at most what the site has")
        return None


MAX_REWEIGHT_PERIODS = 10_000
"""At most this many ``reweight_h`` periods in a fair share's ``window_h``: a recomputation's work. Checked on
what comes in (the API, config files), not on what an earlier release stored."""

STORED: dict[str, bool] = {"stored": True}
"""The validation context of what is read back from the store or a site's state files (``model_validate(...,
context=STORED)``): checks added since a release accepted the data are skipped there, so it still loads."""


def _up(value: float, digits: int = 3) -> float:
    """``value`` (above 0) rounded up to ``digits`` significant digits, as a bound a message suggests."""
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return round(math.ceil(value / step - 1e-9) * step, 12)


def on_this_machine(what: str, instead: str) -> AfterValidator:
    """A ``path`` setting read on this machine: a URL there is refused, saying ``instead`` what to write (read
    as a file name, its ``//`` collapsed, it failed at start as no such ``what``)."""

    def check(path: str) -> str:
        if "://" in path:
            raise ValueError(f"{path!r} is a URL; kind files reads {what} on this machine: {instead}")
        return path

    return AfterValidator(check)


def stored(info: ValidationInfo) -> bool:
    """Whether a validator runs on stored data (:data:`STORED`) rather than on new input."""
    return bool(info.context and info.context.get("stored"))


class FairSharePolicy(Spec):
    """How a site divides what is left once guarantees are met (``policies.fairshare``).

    ``mode``: ``time`` weighs each tenant's share by its decayed usage over the sliding window (a tenant that
    burst yesterday yields to one that did not); ``instant`` divides by weight alone; ``off`` admits in
    priority-then-arrival order with quota limits and reclaim of guarantees only."""

    mode: Literal["time", "instant", "off"] = "time"
    window_h: float = Field(default=24.0, gt=0, le=24 * 90,
                            description="usage older than this is forgotten (counted in whole reweight_h "
                                        "periods; at least the last one)")
    reweight_h: float = Field(default=1.0, gt=0, le=24 * 7, description="how often shares are recomputed")
    half_life_h: float = Field(default=6.0, gt=0, le=24 * 90, description="usage this old counts half")
    k: float = Field(default=1.0, ge=0, le=100, description="how strongly past usage moves a share")
    min_run_s: float = Field(default=0.0, ge=0, description="preemption spares a job that ran less than this")
    unlisted_tenants: Literal["refuse", "best-effort"] = Field(
        default="best-effort",
        description="a tenant the quota list does not name: refused, or guaranteed nothing with no burst limit",
    )

    @model_validator(mode="after")
    def _periods(self, info: ValidationInfo) -> FairSharePolicy:
        if stored(info):  # (an earlier release accepted more: a site stored so must still start)
            return self
        periods = self.window_h / self.reweight_h
        if periods > MAX_REWEIGHT_PERIODS:  # each recomputation walks the window's usage period by period
            raise at("reweight_h", f"{self.reweight_h:g} h divides window_h ({self.window_h:g} h) into "
                             f"{periods:,.0f} periods, more than {MAX_REWEIGHT_PERIODS:,}; recompute less often "
                             f"(reweight_h at least {_up(self.window_h / MAX_REWEIGHT_PERIODS):g} h) or shorten the "
                             "window")
        return self


class SimulatedAdapterConfig(Spec):
    """A simulated site: runs jobs for their duration on the broker's clock."""

    kind: Literal["simulated"] = "simulated"
    dispatch_delay_s: float = Field(default=0.2, ge=0, le=3600)
    failure_rate: float = Field(default=0.0, ge=0, le=1, description="chance that an attempt fails")
    seed: int = 0
    state_dir: str | None = Field(
        default=None, description="where the site keeps its operator's quota changes and the usage history its "
                                  "fair share weighs (default: the broker's folder for site state, beside its "
                                  "database)")


class Toleration(Spec):
    """A Kubernetes toleration (``spec.tolerations`` of a Pod), as Kubernetes writes it: ``key``, ``operator``
    (``Equal``: the taint's value must be ``value``; ``Exists``: any value, and with no key any taint),
    ``effect`` (none: every effect) and ``tolerationSeconds`` (NoExecute only: how long the Pod stays once
    tainted)."""

    model_config = ConfigDict(populate_by_name=True)

    key: str | None = Field(default=None, min_length=1, max_length=316)
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, alias="tolerationSeconds")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise at("value", f"operator Exists takes no value (it tolerates any), but value is {self.value!r}")
        if self.key is None and self.operator != "Exists":
            raise at("operator", "a toleration without a key must have operator Exists (it tolerates every taint)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise at("tolerationSeconds", "tolerationSeconds needs effect NoExecute (Kubernetes refuses it "
                                          "otherwise)")
        return self

    def tolerates(self, taint: dict[str, Any]) -> bool:
        """Whether it tolerates ``taint`` (a Node's ``spec.taints`` entry), as the Kubernetes scheduler
        decides."""
        if self.effect is not None and self.effect != taint.get("effect"):
            return False
        if self.key is not None and self.key != taint.get("key"):
            return False
        return self.operator == "Exists" or (self.value or "") == (taint.get("value") or "")

    def manifest(self) -> dict[str, Any]:
        """As a Pod's ``spec.tolerations`` entry."""
        return self.model_dump(by_alias=True, exclude_none=True)


RESTRICTED_RUN_AS_USER = 65534
"""The user each job's container runs as under ``pod_security: restricted`` where ``pod_security_context`` names
none: ``nobody``, which most images have. The restricted profile asks ``runAsNonRoot``, which the kubelet checks
against the user the container would run as only when it starts it: an image whose user is root (busybox, the
adapter's default image, and most CUDA and PyTorch images) or a name rather than a number then fails with
CreateContainerConfigError, a Pod the cluster admitted that never starts. A numeric non-root user set in the Pod
passes both the admission and the kubelet's check, whatever the image says."""

MAX_POSIX_ID = 2**31 - 1
"""The largest user or group id Kubernetes takes in a securityContext."""

_SECURITY_CONTEXT_KEYS_NOT_TAKEN = frozenset({
    "privileged", "allowPrivilegeEscalation", "capabilities", "runAsNonRoot", "seccompProfile", "seLinuxOptions",
    "seLinuxChangePolicy", "appArmorProfile", "readOnlyRootFilesystem", "procMount", "sysctls", "supplementalGroups",
    "supplementalGroupsPolicy", "fsGroupChangePolicy", "windowsOptions"})
"""Kubernetes securityContext keys (of a Pod or a container) a ``pod_security_context`` does not take: refused
naming them, as settings heliotrope does not copy, not as misspellings."""


class PodSecurityContext(Spec):
    """The user and groups of each job's Pod (its ``spec.securityContext``), as Kubernetes writes them:
    ``runAsUser`` (the user its processes run as; unset: the image's, or under ``pod_security: restricted``
    65534, nobody), ``runAsGroup`` (their primary group; unset: the image's) and ``fsGroup`` (a supplementary
    group of theirs that owns the Pod's volumes). Ids from 0 to 2^31 - 1."""

    # Read and written as Kubernetes spells them (what a user reads back is what they wrote); the Python names
    # are also read.
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    run_as_user: int | None = Field(default=None, ge=0, le=MAX_POSIX_ID, alias="runAsUser",
                                    exclude_if=lambda uid: uid is None)
    run_as_group: int | None = Field(default=None, ge=0, le=MAX_POSIX_ID, alias="runAsGroup",
                                     exclude_if=lambda gid: gid is None)
    fs_group: int | None = Field(default=None, ge=0, le=MAX_POSIX_ID, alias="fsGroup",
                                 exclude_if=lambda gid: gid is None)

    @model_validator(mode="before")
    @classmethod
    def _user_and_groups_only(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            other = sorted(str(k) for k in value if k in _SECURITY_CONTEXT_KEYS_NOT_TAKEN)
            if other:
                raise ValueError(
                    f"{', '.join(other)}: not taken here: pod_security_context sets only runAsUser, runAsGroup and "
                    "fsGroup of each job's Pod; pod_security: restricted sets what the Pod Security Standards' "
                    "restricted profile asks (runAsNonRoot, seccompProfile RuntimeDefault, no privilege "
                    "escalation, every capability dropped)")
        return value

    def manifest(self) -> dict[str, Any]:
        """As a Pod's ``spec.securityContext`` (the keys set)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class _Readings(Spec):
    """What the telemetry sources share: a reading must stay fresh until the next one is taken."""

    @model_validator(mode="after")
    def _fresh_until_the_next(self, info: ValidationInfo) -> _Readings:
        every, stale = getattr(self, "every_s"), getattr(self, "stale_after_s")
        if stale <= every and not stored(info):  # (a site an earlier release stored still loads)
            raise at("stale_after_s", f"stale_after_s ({stale:g} s) is not longer than every_s ({every:g} s): each "
                                      "reading would go stale before the next is taken, and the measured telemetry "
                                      "would come and go; make stale_after_s a few readings long")
        return self


class NvmlTelemetryConfig(_Readings):
    """GPU telemetry read through NVML on the machine the site agent runs on (``adapters.telemetry``): for a
    site whose GPUs are in the agent's own node. Needs the NVIDIA driver there; the agent starts without it
    and logs why each reading failed."""

    kind: Literal["nvml"] = "nvml"
    every_s: float = Field(default=15.0, ge=1, le=3600, description="seconds between readings")
    stale_after_s: float = Field(
        default=60.0, gt=0, le=86400,
        description="a reading older than this is not sent: the site's own telemetry goes out instead")


# One PromQL label matcher and the comma after it: a label name, an operator, and a quoted string (PromQL's
# double or single quotes, with backslash escapes).
_PROMQL_MATCHER = re.compile(
    r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')\s*(,|$)""")


def _prometheus_url(value: str) -> str:
    """A Prometheus base URL: http or https, a host, no credentials, no query or fragment; no trailing ``/``."""
    example = "such as http://prometheus.monitoring.svc:9090"
    if value != value.strip() or any(c.isspace() for c in value):
        raise ValueError(f"must be a URL without spaces, {example}")
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise ValueError(f"is not a URL ({e}); write one {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL of the Prometheus server, {example}")
    if port == 0:
        raise ValueError("port 0 is no port; leave it out or name the server's port")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials (user:password@); put a bearer token in an environment "
                         "variable and name it in token_env")
    if parts.query or parts.fragment:
        raise ValueError("must be the server's base URL, without ?query or #fragment (/api/v1/query is added)")
    return value.rstrip("/")


def _promql_selector(value: str) -> str:
    """PromQL label matchers without braces (``cluster="lon-1", namespace=~"gpu-.*"``), as written, stripped;
    anything else (braces, a function, an unquoted value) is refused, so nothing but matchers reaches a query."""
    text = value.strip()
    pos = 0
    while pos < len(text):
        m = _PROMQL_MATCHER.match(text, pos)
        if m is None:
            raise ValueError(
                f"{text!r} is not PromQL label matchers: write them without braces, separated by commas, each a "
                "label name, one of = != =~ !~ and a quoted value, such as "
                "cluster=\"lon-1\", namespace=~\"gpu-operator|nvidia\"")
        if m.group(1) == "__name__":
            raise ValueError("may not match __name__: the queries name dcgm-exporter's metrics themselves")
        pos = m.end()
    return text


class PrometheusTelemetryConfig(_Readings):
    """GPU telemetry that NVIDIA's DCGM exporter (dcgm-exporter, part of the GPU Operator) publishes and a
    Prometheus server scrapes (``adapters.dcgm``): for a Kubernetes cluster, from the broker or a site agent,
    neither of which needs to run on a GPU node. Clock throttling needs the exporter to export
    DCGM_FI_DEV_CLOCKS_EVENT_REASONS, which its default counters do not (see the README)."""

    kind: Literal["prometheus"] = "prometheus"
    url: Annotated[str, AfterValidator(_prometheus_url)] = Field(
        description="the Prometheus server's base URL (http or https; a path prefix is kept), e.g. "
                    "http://prometheus.monitoring.svc:9090; /api/v1/query is added")
    selector: str = Field(
        default="", max_length=1000,
        description="PromQL label matchers added to every query, without braces, e.g. cluster=\"lon-1\" or "
                    "cluster=\"lon-1\", namespace=\"gpu-operator\" (empty: every GPU the server has)")
    every_s: float = Field(default=30.0, ge=1, le=3600, description="seconds between readings")
    stale_after_s: float = Field(
        default=120.0, gt=0, le=86400,
        description="a reading older than this is not sent: the site's own telemetry goes out instead")
    timeout_s: float = Field(default=5.0, gt=0, le=120, description="for each query to Prometheus")
    token_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of the environment variable holding a bearer token for Prometheus (never the token "
                    "itself)")
    ca_file: str | None = Field(
        default=None, min_length=1,
        description="CA bundle (PEM) that verifies an https Prometheus with a private CA (None: the system's)")

    @field_validator("selector")
    @classmethod
    def _selector(cls, value: str) -> str:
        return _promql_selector(value)

    @model_validator(mode="after")
    def _ca_needs_https(self) -> PrometheusTelemetryConfig:
        if self.ca_file is not None and not self.url.startswith("https://"):
            raise at("ca_file", "ca_file verifies an https server, but url is http://; use https:// or drop ca_file")
        return self


TelemetrySourceConfig = Annotated[NvmlTelemetryConfig | PrometheusTelemetryConfig, Field(discriminator="kind")]
"""``{kind: nvml, ...}`` (the agent's own node) or ``{kind: prometheus, url, ...}`` (dcgm-exporter)."""


UNSCHEDULABLE_AFTER_S = 300.0
"""``adapter.unschedulable_after_s`` unset: how long a Kubernetes site's Pod may wait for the scheduler."""


class KubernetesAdapterConfig(Spec):
    """A Kubernetes cluster (``adapters.kubernetes``): GPUs from its Nodes, jobs as batch/v1 Jobs in the tenant's
    namespace (``namespace_prefix`` + tenant), quotas mirrored as ResourceQuota objects."""

    kind: Literal["kubernetes"] = "kubernetes"
    kubeconfig: str | None = Field(default=None, description="kubeconfig file (None: ~/.kube/config or KUBECONFIG)")
    in_cluster: bool = Field(default=False, description="use the pod's service account instead of a kubeconfig")
    context: str | None = Field(default=None, description="kubeconfig context (None: its current context)")
    host: str | None = Field(default=None, description="API server URL without credentials (tests, kubectl proxy)")
    namespace_prefix: str = Field(default="heliotrope-", max_length=30, pattern=r"^([a-z0-9][a-z0-9-]*)?$")
    request_timeout_s: float = Field(default=10.0, gt=0, le=300, description="per API call")
    retries: int = Field(default=3, ge=1, le=10, description="attempts per API call on transient errors")
    image: str = Field(default="busybox:1.36", min_length=1, description="container image of each job")
    command: list[str] = Field(default_factory=list, description="its command (empty: the image's entrypoint)")
    state_dir: str | None = Field(
        default=None, description="where the site keeps its operator's quota changes, the usage history its fair "
                                  "share weighs, its stops not yet reported and the ends of its ended attempts' "
                                  "logs (default: the broker's)")
    state_namespace: str | None = Field(
        default=None, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
        description="a namespace where the site also keeps its stops not yet reported, in the ConfigMap "
                    "heliotrope-stops-<site> (its Pods may go while no adapter runs), and the usage history its "
                    "fair share weighs, in heliotrope-usage-<site>: a broker replica with another state_dir that "
                    "takes over then reports those stops as preemptions with their run, not as lost attempts, and "
                    "goes on with the tenants' past usage. Needs get, create and patch on configmaps there. None: "
                    "state_dir only",
        # Left out where unset, as telemetry below: brokers of earlier releases sharing the database read it.
        exclude_if=lambda namespace: namespace is None)
    stop_wait_s: float = Field(
        default=300.0, gt=0, le=3600,
        description="a job the broker stops to move it, or the site preempts for its quotas, is reported stopped "
                    "once its Pods are gone, or after this long (a checkpointable job's Pod has this less 10 % or 5 s, "
                    "whichever is smaller, at least 1 s, as its terminationGracePeriodSeconds, in which it writes "
                    "its checkpoint)")
    unschedulable_after_s: float | None = Field(
        default=UNSCHEDULABLE_AFTER_S, ge=0, le=86400,
        description="an attempt whose Pod the cluster's scheduler has found no room for (PodScheduled False, "
                    "Unschedulable) this long, from the condition's lastTransitionTime, is withdrawn: its Job is "
                    "deleted and the broker hears it lost, so it routes the job again, skipping this site for "
                    "refusal_ttl_s, with none of its max_attempts spent; so is one whose Job the cluster has made "
                    "no Pod for this long from its creationTimestamp (Pod Security admission, a LimitRange or a "
                    "ResourceQuota refuses it). The wait does not end while Pods this site stops (a preemption "
                    "making room) are still going, nor in the 60 s (for a Job without a Pod, 6 minutes) after. "
                    "A Pod whose container has waited this long, from its startTime, on ImagePullBackOff, "
                    "ErrImagePull or CreateContainerConfigError fails its attempt (InvalidImageName, "
                    "ErrImageNeverPull: at once). "
                    "0 or null: such Pods and Jobs wait in the cluster for as long as it takes",
        # Left out where it is the default: brokers of earlier releases sharing the database still read the site.
        exclude_if=lambda after_s: after_s == UNSCHEDULABLE_AFTER_S)
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="copied into each job's Pod; a Node with a NoSchedule or NoExecute taint none of them "
                    "tolerates is left out of the site's capacity (its Pods could not go there)")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels each job's Pod must have (its nodeSelector); Nodes without them are left out of "
                    "the site's capacity")
    pod_security: Literal["restricted"] | None = Field(
        default=None,
        description="restricted: each job's Pod meets the Kubernetes Pod Security Standards' restricted profile, "
                    "so a namespace labelled pod-security.kubernetes.io/enforce: restricted admits it: the Pod runs "
                    "as a non-root user (runAsNonRoot, runAsUser 65534 unless pod_security_context names one: "
                    "the kubelet refuses to start an image whose user is root, as busybox's is) with the "
                    "RuntimeDefault seccomp profile, its container without privilege escalation and with every "
                    "capability dropped. None: the Pod sets no securityContext beyond pod_security_context",
        # Left out where unset, as telemetry below: brokers of earlier releases sharing the database read it.
        exclude_if=lambda level: level is None)
    pod_security_context: PodSecurityContext | None = Field(
        default=None,
        description="runAsUser, runAsGroup and fsGroup of each job's Pod (its securityContext), as Kubernetes "
                    "writes them; with pod_security restricted, runAsUser may not be 0. None: the image's user",
        exclude_if=lambda context: context is None)
    telemetry: PrometheusTelemetryConfig | None = Field(
        default=None,
        description="measure the cluster's GPUs (temperature, power, utilisation, clock throttling) from the "
                    "Prometheus server that scrapes its dcgm-exporter, and report that instead of the memory "
                    "read from the Nodes (None: no measured telemetry). Only kind prometheus: the broker runs "
                    "this adapter away from the GPU nodes, where NVML sees no GPUs",
        # Left out where unset: a site that does not use it is stored as before, so brokers of earlier releases
        # (whose specs forbid unknown keys) sharing the database still read it.
        exclude_if=lambda telemetry: telemetry is None)

    @field_validator("pod_security", mode="before")
    @classmethod
    def _profile(cls, value: Any) -> Any:
        if value in ("privileged", "baseline"):
            raise ValueError(f"{value}: each job's Pod meets the {value} profile as it is (it asks for no host "
                             "namespace, port or path, and no privilege): leave pod_security out; restricted is "
                             "the one profile it is set for")
        return value

    @field_validator("pod_security_context", mode="before")
    @classmethod
    def _a_mapping(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, Mapping | PodSecurityContext):
            raise ValueError(f"must be a mapping of runAsUser, runAsGroup and fsGroup, such as {{runAsUser: 1000, "
                             f"fsGroup: 1000}}, not a {type(value).__name__}")
        return value

    @field_validator("pod_security_context")
    @classmethod
    def _non_root_when_restricted(cls, value: PodSecurityContext | None,
                                  info: ValidationInfo) -> PodSecurityContext | None:
        if value is not None and value.run_as_user == 0 and info.data.get("pod_security") == "restricted":
            raise ValueError("runAsUser 0 is root, which pod_security restricted forbids (the admission refuses "
                             "the Pod, or the kubelet its container): name a non-root user, or leave runAsUser out "
                             f"for {RESTRICTED_RUN_AS_USER} (nobody)")
        return value

    def security_contexts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ``securityContext`` of each job's Pod and of its container, as manifests (empty: none is set):
        ``pod_security_context``'s keys, and under ``pod_security: restricted`` what the restricted profile
        asks, with ``runAsUser`` :data:`RESTRICTED_RUN_AS_USER` where none is named."""
        pod = {} if self.pod_security_context is None else self.pod_security_context.manifest()
        container: dict[str, Any] = {}
        if self.pod_security == "restricted":
            pod = {"runAsNonRoot": True, "runAsUser": RESTRICTED_RUN_AS_USER, **pod,
                   "seccompProfile": {"type": "RuntimeDefault"}}
            container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        return pod, container

    @field_validator("telemetry", mode="before")
    @classmethod
    def _not_nvml(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and value.get("kind") == "nvml":
            raise ValueError("kind nvml would read the GPUs of the machine the broker runs on, not the cluster's: "
                             "use kind prometheus (the cluster's dcgm-exporter, through Prometheus), or a site "
                             "agent on a GPU node with its own telemetry: {kind: nvml}")
        return value


MQTT_MAX_PAYLOAD_BYTES = 4 << 20
"""``mqtt.max_payload_bytes`` unset: 4 MiB, more than any heartbeat of 65,000 attempts needs whole."""
MQTT_MIN_PAYLOAD_BYTES = 16 << 10
"""The least ``mqtt.max_payload_bytes`` takes: a heartbeat's report (capacity, telemetry, a quota state of
some forty tenants) must fit in one message, and each part of a split list of attempts must hold some."""
MQTT_LARGEST_PAYLOAD_BYTES = (256 << 20) - (1 << 10)
"""The most ``mqtt.max_payload_bytes`` takes: MQTT's own limit on a packet (256 MiB less one byte, topic and
header included), less room for the topic and header."""


class MqttSettings(Spec):
    """How to reach the MQTT broker that carries the site protocol: Mosquitto 1.6 or later, or any MQTT 5 broker
    (one of MQTT 3.1.1 only works, without command expiry: ``adapters.mqtt_protocol``)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=1883, ge=1, le=65535)
    username: str | None = None
    password_env: str | None = Field(default=None, description="environment variable holding the password")
    tls: bool = Field(default=False, description="connect with TLS, verifying the MQTT broker with the system CA "
                                                 "store (or ca_file)")
    ca_file: str | None = Field(default=None, min_length=1,
                                description="CA bundle (PEM) that verifies the MQTT broker's certificate, for a "
                                            "private CA; setting it implies TLS")
    cert_file: str | None = Field(default=None, min_length=1,
                                  description="client certificate (PEM) for an MQTT broker that requires one; "
                                              "with key_file; implies TLS")
    key_file: str | None = Field(default=None, min_length=1, description="the client certificate's private key (PEM)")
    keepalive_s: int = Field(default=10, ge=2, le=3600, description="MQTT keepalive; the last will fires after 1.5x")
    reconnect_max_s: float = Field(default=5.0, gt=0, le=300, description="longest wait between reconnect attempts")
    client_id: str | None = Field(default=None, description="None: heliotrope-broker, or heliotrope-agent-SITE")
    max_payload_bytes: int = Field(
        default=MQTT_MAX_PAYLOAD_BYTES,
        description="the largest message payload this side sends and takes: set it to the MQTT broker's cap "
                    "(Mosquitto's message_size_limit, AWS IoT's 128 KB), or to a cap on whole packets (EMQX's "
                    "and Mosquitto's max_packet_size) less 512 bytes for the topic and header. The same on the "
                    "broker and every agent; a site agent sends a longer list of attempts in parts that fit")

    @field_validator("max_payload_bytes")
    @classmethod
    def _payload_cap(cls, value: int) -> int:
        if value < MQTT_MIN_PAYLOAD_BYTES:
            raise ValueError(f"{value} bytes is less than {MQTT_MIN_PAYLOAD_BYTES} (16 KiB), the least a heartbeat's "
                             "report needs in one message: give the MQTT broker's cap on a message (for AWS IoT, "
                             "131072), or raise that cap")
        if value > MQTT_LARGEST_PAYLOAD_BYTES:
            raise ValueError(f"{value} bytes is more than {MQTT_LARGEST_PAYLOAD_BYTES}, the most an MQTT packet holds "
                             "with its topic (256 MiB)")
        return value

    @model_validator(mode="after")
    def _client_cert_pair(self) -> MqttSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise at("key_file" if self.key_file is None else "cert_file",
                     "cert_file and key_file go together (a client certificate and its private key): set both, or "
                     "neither")
        return self

    @property
    def uses_tls(self) -> bool:
        """Whether the connection is TLS: ``tls``, or a ``ca_file`` or client certificate set."""
        return self.tls or self.ca_file is not None or self.cert_file is not None


class RemoteAdapterConfig(Spec):
    """A site run by a site agent (``heliotrope agent``) that reaches the broker over MQTT
    (``adapters.remote``; the protocol is ``adapters.mqtt_protocol``). The broker's ``mqtt`` setting names the
    MQTT broker; the site's agent publishes its capacity and events there and takes dispatches from it."""

    kind: Literal["mqtt"] = "mqtt"
    lease_s: float = Field(default=15.0, gt=0, le=3600,
                           description="a site silent this long loses its lease: its jobs are requeued elsewhere")
    command_timeout_s: float = Field(default=10.0, gt=0, le=600,
                                     description="how long a dispatch, cancel or quota command waits for the reply")
    resend_s: float = Field(default=2.0, gt=0, le=60, description="how often an unanswered command is sent again")


AdapterConfig = Annotated[SimulatedAdapterConfig | KubernetesAdapterConfig | RemoteAdapterConfig,
                          Field(discriminator="kind")]


# The keys a site has as read (``GET /v1/sites/NAME``, ``heliotrope sites get``) that are the broker's, not its
# spec's: a document that carries them (a site read, edited and sent back whole) is refused naming them so
# (``broker.errors.problems``), not as a misspelling.
SITE_READ_ONLY_KEYS = {
    "status": "the site's last report, which is the broker's: leave it out of a spec (a site as read, less "
              "status and signals)",
    "signals": "what routing reads of the site now, which is the broker's: leave it out of a spec (a site as "
               "read, less status and signals)",
}


class SiteSpec(Spec):
    """What a platform team registers: where a site is, what GPUs it has, what they cost, who may use them."""

    name: Slug
    region: RegionId
    grid_zone: GridZoneId
    timezone: TimeZoneName
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    gpus: list[NodeGroup] = Field(min_length=1, max_length=256)
    usd_per_gpu_hour: dict[GpuModelId, float] = Field(default_factory=dict)
    rtt_ms: dict[RegionId, float] = Field(default_factory=dict, description="round-trip time from origin regions")
    quotas: list[TenantQuota] = Field(default_factory=list, description="empty: the site enforces no quotas")
    fair_share: FairSharePolicy = Field(default_factory=FairSharePolicy)
    adapter: AdapterConfig = Field(default_factory=SimulatedAdapterConfig)
    labels: dict[str, str] = Field(default_factory=dict)
    cordoned: bool = Field(default=False, description="the site's operator took it out of routing: no new jobs are "
                                                      "placed there; what runs there runs on")
    cordon_reason: str | None = Field(default=None, max_length=500, description="why, in the operator's words")

    @field_validator("usd_per_gpu_hour", "rtt_ms")
    @classmethod
    def _non_negative(cls, values: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        for key, v in values.items():
            if v < 0:
                raise ValueError(f"{key}: must be zero or more, got {v}")
            if info.field_name == "usd_per_gpu_hour" and v > MAX_USD_PER_GPU_HOUR and not stored(info):
                raise ValueError(f"{key}: {v:g} USD per GPU-hour is more than the {MAX_USD_PER_GPU_HOUR:,} a site "
                                 "may charge; give the price of one GPU for one hour")
        return values

    @model_validator(mode="after")
    def _prices_for_owned_models(self) -> SiteSpec:
        owned = {g.model for g in self.gpus}
        stray = sorted(set(self.usd_per_gpu_hour) - owned)
        if stray:
            raise at("usd_per_gpu_hour", f"prices {', '.join(stray)}, which no node group of this site has")
        total = sum(g.gpus for g in self.gpus)
        if total > MAX_GPUS_PER_SITE:
            raise at("gpus", f"{total} GPUs in all is more than {MAX_GPUS_PER_SITE:,} a site may have")
        seen: dict[str, int] = {}
        for i, q in enumerate(self.quotas):
            if q.tenant in seen:  # named, with both places: a long list is hard to search by eye
                raise at(("quotas", i, "tenant"), f"each tenant may appear once; {q.tenant} appears at "
                                                  f"quotas[{seen[q.tenant]}] and quotas[{i}] (merge them into one)")
            seen[q.tenant] = i
        return self

    def quota_problems(self) -> list[dict[str, str]]:
        """Each quota that asks for GPUs the site does not have (:meth:`TenantQuota.beyond`), as
        ``{"field": "quotas[1].model", "problem": ...}``. Not a validator: a spec stored by an earlier release
        must still load; the API and the config files refuse new ones."""
        capacity = self.total_gpus()
        out = []
        for i, q in enumerate(self.quotas):
            found = q.beyond(capacity)
            if found is not None:
                out.append({"field": f"quotas[{i}].{found[0]}", "problem": found[1]})
        return out

    def total_gpus(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.gpus:
            out[g.model] = out.get(g.model, 0) + g.gpus
        return out


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"


class ModelCapacity(Spec):
    """Capacity of one GPU model at one site."""

    model: GpuModelId
    total_gpus: int = Field(ge=0, le=MAX_GPUS_PER_SITE)
    free_gpus: int = Field(ge=0, le=MAX_GPUS_PER_SITE, description="whole GPUs with nothing on them")
    used_gpus: int = Field(ge=0, le=MAX_GPUS_PER_SITE, description="GPUs with at least part in use")
    shared_free_milli: int = Field(
        default=0, ge=0, le=1000, description="largest free share of a GPU already shared by fractional jobs"
    )
    memory_gib_per_gpu: float = Field(ge=0, le=MAX_GPU_MEMORY_GIB)
    mig_free_slices: dict[str, int] = Field(
        default_factory=dict, description="MIG slices of each profile that could still be made (GPUs in MIG mode)")

    @model_validator(mode="after")
    def _within_total(self) -> ModelCapacity:
        if self.free_gpus > self.total_gpus:
            raise at("free_gpus", f"{self.free_gpus} {self.model} free of {self.total_gpus} in all")
        return self


THROTTLING_REASONS = frozenset({"hw_slowdown", "sw_thermal", "hw_thermal", "power_brake"})
"""Clock-event reasons (NVML's names, as ``adapters.nvml`` decodes them) that mean heat, or the site's power
supply, holds a GPU's clocks down: thermal slowdown, hardware slowdown, the power brake (an external signal,
such as a facility's power limit). Not counted: ``sw_power_cap`` (the GPU's own power limit, routinely
reached by any GPU at full load, so it marks a busy site, not an ailing one), ``idle`` (nothing runs),
settings an operator chose (``applications_clocks``, ``display_clock``, ``sync_boost``), and reasons NVML adds
later."""


class Telemetry(Spec):
    """Site-wide telemetry: means over GPUs for utilisation, sums for memory and power, maximum temperature,
    and the share of GPUs whose clocks heat or power holds down."""

    gpu_utilisation_pct: float = Field(default=0.0, ge=0, le=100)
    memory_used_gib: float = Field(default=0.0, ge=0)
    memory_total_gib: float = Field(default=0.0, ge=0)
    temperature_c_max: float = 0.0
    power_w: float = Field(default=0.0, ge=0)
    queue_depth: int = Field(default=0, ge=0)
    throttled_pct: float | None = Field(
        default=None, ge=0, le=100,
        description="share of the GPUs read whose clocks heat or power held down at the last sample (thermal "
                    "slowdown, hardware slowdown, power brake; not the GPU's own power cap, routine at full "
                    "load); None: the site does not report it")
    throttle_reasons: dict[Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=64,
        description="GPUs per clock-event reason at the last sample, every reason the GPUs gave (idle too)")

    @classmethod
    def throttle_of(cls, reasons_per_gpu: list[tuple[str, ...]]) -> dict[str, Any]:
        """``throttled_pct`` and ``throttle_reasons`` over the GPUs whose reasons were read (each GPU's reason
        names); both left unset (not reported) when none was."""
        if not reasons_per_gpu:
            return {}
        counts: dict[str, int] = {}
        for reasons in reasons_per_gpu:
            for name in set(reasons):
                counts[name] = counts.get(name, 0) + 1
        held = sum(1 for reasons in reasons_per_gpu if THROTTLING_REASONS.intersection(reasons))
        return {"throttled_pct": round(100.0 * held / len(reasons_per_gpu), 2),
                "throttle_reasons": dict(sorted(counts.items()))}

    def wire(self) -> dict[str, Any]:
        """As a site agent sends it: the throttle fields only when the site reports them, so that a broker of
        an earlier release (whose telemetry forbids keys it does not know) still takes a report without them."""
        data = self.model_dump(mode="json")
        if self.throttled_pct is None:
            data.pop("throttled_pct")
        if not self.throttle_reasons:
            data.pop("throttle_reasons")
        return data


class TenantQuotaState(Spec):
    """One tenant's quota at a site as the site reports it (``GET /v1/sites/{name}/quota``)."""

    tenant: str
    listed: bool = Field(default=True, description="false: the site has no quota for it (unlisted_tenants applies)")
    model: GpuModelId | None = None
    guaranteed_gpus: float = 0.0
    burst_gpus: float | None = Field(default=None, description="None: no limit above the guarantee")
    fair_share_weight: float = 1.0
    priority_ceiling: int | None = None
    in_use_gpus: float = Field(default=0.0, description="GPUs its running jobs hold (fractions count as their share)")
    borrowed_gpus: float = Field(default=0.0, description="in use above its guarantee: lent capacity, reclaimable")
    fair_share_gpus: float = Field(default=0.0, description="its share now: guarantee, then the rest by weight and usage")
    decayed_usage_gpu_h: float = Field(default=0.0, description="GPU-hours used over the window, with half-life decay")
    waiting_reason: str | None = Field(default=None, description="why the site last refused one of its jobs")
    room_gpus: float | None = Field(default=None, description="more GPUs its preemptible jobs may hold (None: no limit)")
    nonpreemptible_room_gpus: float | None = Field(
        default=None, description="more GPUs its non-preemptible jobs may hold without making a guarantee unreclaimable")
    reclaimable_gpus: float = Field(default=0.0, description="GPUs it would get back now by reclaiming its guarantee")
    preemptible_gpus_by_priority: dict[int, float] = Field(
        default_factory=dict,
        description="GPUs its own preemptible jobs past their minimum run time hold, by priority (capped by its "
                    "ceiling): what a job of its own of higher priority may preempt, even at its limit",
        # Left out where empty: a report without it is sent as before, so brokers of earlier releases (whose
        # reports forbid unknown keys) still take a site agent's heartbeat where the tenant runs no such job.
        exclude_if=lambda held: not held)
    preemptible_gpus_by_model: dict[GpuModelId, dict[int, float]] = Field(
        default_factory=dict,
        description="the same GPUs per GPU model, then by priority: a site preempts for a job only jobs on the model "
                    "it gives it (absent from a site of an earlier release: the broker then counts those of every "
                    "model)",
        exclude_if=lambda held: not held)  # left out where empty, as preemptible_gpus_by_priority
    reclaimable_gpus_by_model: dict[GpuModelId, float] = Field(
        default_factory=dict,
        description="reclaimable_gpus per GPU model (models with none left out): a reclaim preempts only borrowers' "
                    "jobs on the model the site gives the job (absent from a site of an earlier release: the broker "
                    "then counts reclaimable_gpus for every model its quota counts)",
        exclude_if=lambda held: not held)  # left out where empty, as preemptible_gpus_by_priority
    configured_guaranteed_gpus: float | None = Field(
        default=None,
        description="the guarantee as configured, where the site counts less of it now (guaranteed_gpus is at most "
                    "the GPUs of its model the site has: a Node away, a model gone); absent where it counts it whole",
        exclude_if=lambda v: v is None)  # left out where absent, as preemptible_gpus_by_priority


class QuotaState(Spec):
    """A site's quota state: what it enforces and where each tenant stands."""

    enforced: bool = Field(description="false: the site lists no quotas and admits whatever fits")
    fair_share: FairSharePolicy = Field(default_factory=FairSharePolicy)
    capacity_gpus: float = 0.0
    tenants: list[TenantQuotaState] = Field(default_factory=list)
    unlisted_room_gpus: float | None = Field(
        default=None, description="what a tenant the list does not name may hold: 0 if refused, None: no limit")
    unlisted_nonpreemptible_room_gpus: float | None = Field(
        default=None, description="what such a tenant's non-preemptible jobs may hold (capacity nobody is guaranteed)")
    preemptible_gpus_by_priority: dict[int, float] = Field(
        default_factory=dict, description="GPUs held by preemptible jobs past their minimum run time, by priority")
    preemptible_gpus_by_model: dict[GpuModelId, dict[int, float]] = Field(
        default_factory=dict,
        description="the same GPUs per GPU model, then by priority (absent from a site of an earlier release)",
        # Left out where empty, so brokers of earlier releases still take a heartbeat where no such job runs.
        exclude_if=lambda held: not held)

    def tenant(self, name: str) -> TenantQuotaState | None:
        for t in self.tenants:
            if t.tenant == name:
                return t
        return None


class SiteState(Spec):
    """What the broker last heard from a site."""

    site: str
    health: Health = Health.UNKNOWN
    last_heard_at: UtcDatetime | None = None
    capacity: list[ModelCapacity] = Field(default_factory=list)
    telemetry: Telemetry = Field(default_factory=Telemetry)
    running_jobs: int = Field(default=0, ge=0)
    reason: str | None = Field(default=None, description="why the site is not healthy")
    lease_expires_at: UtcDatetime | None = Field(
        default=None, description="sites run by an agent: when their lease runs out unless a heartbeat renews it")
    quota: QuotaState | None = Field(default=None, description="the site's quota state, if it reports one")


# --- jobs ---------------------------------------------------------------------------------------------


class GpuRequest(Spec):
    """GPUs a job needs: ``count`` whole GPUs, a share of one GPU, or MIG slices.

    - Whole GPUs: ``count`` of them, all at once or none (a gang); ``memory_gib`` is the least memory each
      must have; ``topology`` keeps them within one node or one NVLink domain.
    - A share of one GPU: ``milli`` below 1000 (compute), or ``shared: true`` with ``memory_gib`` (memory).
      ``memory_gib`` is then the memory the job takes on the shared GPU (default: its ``milli`` share of the
      GPU's memory); a GPU's jobs never hold more memory than it has.
    - MIG: ``mig_profile`` (for instance ``1g.10gb``) asks for ``count`` fixed slices of that profile, on GPUs
      whose node group offers it.
    """

    count: int = Field(default=1, ge=1, le=4096)
    model: GpuModelId | None = Field(default=None, description="None: any model")
    memory_gib: float | None = Field(
        default=None, gt=0, le=4096,
        description="whole GPUs: minimum memory per GPU; a shared GPU: the memory this job takes on it",
    )
    milli: int = Field(default=1000, ge=1, le=1000, description="thousandths of one GPU; 1000 = whole GPUs")
    shared: bool = Field(default=False, description="part of one GPU, sized by memory_gib")
    mig_profile: str | None = Field(
        default=None, description="a MIG slice, e.g. 1g.10gb: 1 to 7 compute slices, 1 to 4096 GiB",
        # (the document's pattern is what the checks below accept; they word what is wrong)
        json_schema_extra={"pattern": r"^[1-7]g\.([1-9][0-9]{0,2}|[1-3][0-9]{3}|40[0-8][0-9]|409[0-6])gb$"})
    topology: Literal["any", "node", "nvlink"] = Field(
        default="any", description="node: all GPUs on one node; nvlink: within one NVLink domain"
    )

    @model_validator(mode="after")
    def _fraction_of_one(self) -> GpuRequest:
        if self.milli < 1000 and self.count != 1:
            raise at("count", "a fractional job (milli below 1000) asks for part of one GPU: count must be 1")
        if self.shared:
            if self.count != 1:
                raise at("count", "a job sharing a GPU (shared) asks for part of one GPU: count must be 1")
            if self.memory_gib is None:
                raise at("memory_gib", "shared needs memory_gib, the memory the job takes on the shared GPU")
        if self.mig_profile is not None:
            try:
                mig_slices(self.mig_profile)
            except ValueError as e:
                raise at("mig_profile", str(e)) from None
            if self.milli < 1000 or self.shared:
                raise at("mig_profile", "a MIG slice is a fixed partition; do not combine it with milli or shared")
        return self

    def never_fits(self) -> str | None:
        """Why no site could ever run this request, where that can be told from it alone (checked when a job
        is submitted, not when a stored one is read: an earlier release accepted such jobs)."""
        if self.mig_profile is not None:
            memory = int(self.mig_profile.split(".")[1][:-2])
            if memory > MAX_GPU_MEMORY_GIB:
                return (f"mig_profile: {self.mig_profile} needs {memory} GiB, more than any GPU a site may have "
                        f"({MAX_GPU_MEMORY_GIB} GiB)")
            if self.model is not None and not ids.GPU_MODEL_BY_ID[self.model].mig:
                capable = ", ".join(m.id for m in ids.GPU_MODELS if m.mig)
                return (f"mig_profile: {self.model} GPUs cannot be partitioned into MIG slices; ask for a model "
                        f"that can ({capable}), or leave model out")
            # (a slice larger than the model's nominal memory is not refused: a site may give its GPUs more,
            # memory_gib_per_gpu, and then offer it)
        return None

    @property
    def fractional(self) -> bool:
        """True when the job takes part of one GPU (compute share or memory), beside other jobs."""
        return self.milli < 1000 or self.shared


AFTER_MAX = 64
"""Jobs one job may run after (``JobSpec.after``, ``after_any`` and ``after_failed`` together)."""

JobIds = list[Annotated[str, Field(min_length=1, max_length=64)]]
"""A spec's list of the jobs it runs after (``JobSpec.after``, ``after_any``, ``after_failed``)."""


def _none(ids: list[str]) -> bool:
    """Left out where empty: brokers of earlier releases still read the specs of jobs without dependencies."""
    return not ids


class JobSpec(Spec):
    """What a submitter sends. Only ``tenant``, ``name``, ``gpus`` and ``duration_s`` are required."""

    tenant: Slug
    name: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    gpus: GpuRequest
    duration_s: float = Field(gt=0, le=366 * 86400, description="expected run time")
    priority: int = Field(default=0, ge=-1000, le=1000)
    deadline: UtcDatetime | None = None
    latency_slo_ms: float | None = Field(default=None, gt=0, description="maximum RTT from origin_region")
    origin_region: RegionId | None = None
    allowed_regions: list[RegionId] = Field(default_factory=list, description="empty: any region")
    denied_regions: list[RegionId] = Field(default_factory=list)
    preemptible: bool = False
    checkpointable: bool = False
    min_run_s: float | None = Field(
        default=None, ge=0, le=366 * 86400,
        description="preemption spares the job until it has run this long (none: the site's min_run_s); a "
                    "site reclaiming a guarantee spares it at most the site's min_run_s",
    )
    max_attempts: int = Field(
        default=3, ge=1, le=100, description="failed attempts allowed; preemption and site loss do not count"
    )
    max_lost_attempts: int | None = Field(
        default=None, ge=0, le=1000,
        description="lost attempts allowed (a site that went away, a drain or eviction, a Pod the cluster could "
                    "not place, a remote site's lease run out): the job fails at this many losses, told apart "
                    "from failures, preemptions and refusals; 0: no bound; none: the broker's max_lost_attempts",
        # Left out where unset: a spec that does not use it is sent and stored as before, so brokers of earlier
        # releases (whose specs forbid unknown keys) still read it; dispatches to site agents never carry it
        # (adapters.mqtt_protocol.Dispatch).
        exclude_if=lambda n: n is None,
    )
    labels: dict[str, str] = Field(default_factory=dict)
    profile: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$",
        description="routing profile (balanced, green, cheap, fast, or one the federation defines), if the "
                    "federation lets jobs choose it; none: the federation's default",
    )
    deferrable: bool = Field(
        default=True,
        description="false: the job must start as soon as a site has room (interactive work, a notebook, a "
                    "debugging session); no profile defers it to a cleaner or cheaper hour, whatever slack its "
                    "deadline leaves, and it is queued as urgent as a job whose latest start is its submission",
        # Left out where it is the default: a spec that does not use it is sent and stored as before, so brokers
        # of earlier releases (whose specs forbid unknown keys) still read it; dispatches to site agents never
        # carry it (adapters.mqtt_protocol.Dispatch).
        exclude_if=lambda deferrable: deferrable,
    )
    after: JobIds = Field(
        default_factory=list, max_length=AFTER_MAX,
        description="ids of jobs that must succeed before this one is queued for placement (as Slurm's "
                    "--dependency=afterok): it waits in state queued, out of the scheduling queue, until every one "
                    f"has succeeded, and fails at once if one fails or is cancelled; at most {AFTER_MAX}, no "
                    "duplicates, each an existing job (so there are no cycles)",
        # Left out where empty, for the reason deferrable is (_none); dispatches to site agents never carry it
        # (adapters.mqtt_protocol.Dispatch).
        exclude_if=_none,
    )
    after_any: JobIds = Field(
        default_factory=list, max_length=AFTER_MAX,
        description="ids of jobs that must end, however (succeeded, failed or cancelled), before this one is queued "
                    "for placement (as Slurm's --dependency=afterany): it waits in state queued, out of the "
                    f"scheduling queue, until every one has ended; at most {AFTER_MAX} across after, after_any and "
                    "after_failed, each job in one of them once, each an existing job",
        exclude_if=_none,
    )
    after_failed: JobIds = Field(
        default_factory=list, max_length=AFTER_MAX,
        description="ids of jobs that must fail or be cancelled before this one is queued for placement (as Slurm's "
                    "--dependency=afternotok: a clean-up or fallback step): it waits in state queued, out of the "
                    "scheduling queue, until every one has, and fails at once if one succeeds; at most "
                    f"{AFTER_MAX} across after, after_any and after_failed, each job in one of them once, each an "
                    "existing job",
        exclude_if=_none,
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.latency_slo_ms is not None and self.origin_region is None:
            raise at("origin_region", "latency_slo_ms needs origin_region: the RTT is measured from there")
        both = set(self.allowed_regions) & set(self.denied_regions)
        if both:
            raise at("denied_regions", f"regions both allowed and denied: {', '.join(sorted(both))}")
        return self


LABELS_MAX = 64  # labels a job may carry
LABEL_MAX_CHARS = 256  # characters of a label's key, and of its value


def label_problem(key: str, value: str) -> str | None:
    """What is wrong with one of a submitted job's labels, or None. Checked at submission (``POST /v1/jobs``, the
    preview), not where a stored job is read, so jobs an earlier release accepted still load: a key is 1 to
    ``LABEL_MAX_CHARS`` characters without ``=`` (``label=KEY=VALUE`` could not name it); a value at most that;
    neither holds a control character (U+0000-U+001F, U+007F: the stores disagree on a NUL, and a listing's query
    could not carry one). The bound keeps a label within a row of PostgreSQL's labels index (a value of 3,000
    characters that do not compress failed the insert there: "index row requires 9024 bytes")."""
    if not key:
        return "a label's key may not be empty"
    for part, text in (("key", key), ("value", value)):
        if len(text) > LABEL_MAX_CHARS:
            return f"{part} of label {key[:40]!r} is {len(text)} characters; at most {LABEL_MAX_CHARS}"
        bad = next((c for c in text if c < " " or c == "\x7f"), None)
        if bad is not None:
            return f"{part} of label {key[:40]!r} holds the control character {bad!r}"
    if "=" in key:
        return f"key of label {key[:40]!r} holds '='; a listing by label=KEY=VALUE could not name it"
    return None


def labels_problem(labels: Mapping[str, str]) -> str | None:
    """What is wrong with a submitted job's labels (too many, or the first bad one: :func:`label_problem`), or None;
    what the broker answers 422 naming ``labels`` for, and what ``heliotrope submit`` checks before it sends any job
    of a list."""
    if len(labels) > LABELS_MAX:
        return f"{len(labels)} labels; a job carries at most {LABELS_MAX}"
    return next((p for key, value in labels.items() if (p := label_problem(key, value)) is not None), None)


class JobChange(Strict):
    """A change to a queued job (``PATCH /v1/jobs/{id}``): its ``priority``, its ``deadline`` (null removes it) or
    its routing ``profile`` (null: the federation's default). Keys left out stay as they are; no other may change
    (cancel the job and submit it again)."""

    priority: int | None = Field(default=None, ge=-1000, le=1000, description="the job's new priority")
    deadline: UtcDatetime | None = Field(default=None, description="the job's new deadline; null: none")
    profile: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$",
        description="the job's new routing profile; null: the federation's default")

    @field_validator("priority")
    @classmethod
    def _priority_is_a_number(cls, value: int | None) -> int | None:
        # (run only for a priority the body gives: null is refused naming the key, not the whole body)
        if value is None:
            raise ValueError("a job has a priority (0 by default); give a number")
        return value

    @model_validator(mode="after")
    def _some_change(self) -> JobChange:
        if not self.model_fields_set:
            raise ValueError("give at least one of priority, deadline, profile")
        return self

    def applied_to(self, spec: JobSpec) -> JobSpec:
        """``spec`` with these changes (checked as a spec is)."""
        changed = {k: getattr(self, k) for k in self.model_fields_set}
        return JobSpec.model_validate({**spec.model_dump(), **changed})


class JobState(enum.StrEnum):
    QUEUED = "queued"
    DISPATCHING = "dispatching"
    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def on_site(self) -> bool:
        """True while an attempt holds (or is about to hold) GPUs at a site."""
        return self in (JobState.DISPATCHING, JobState.ADMITTED, JobState.RUNNING)


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

Q, D, A, R = JobState.QUEUED, JobState.DISPATCHING, JobState.ADMITTED, JobState.RUNNING
S, F, C, P = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED

# The state machine. "Requeue" is any edge back to QUEUED: a site's rejection (undo of an assumed
# placement), a failed attempt with attempts left, a lost site, or a preempted job going back in line.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    Q: frozenset({D, C, F}),
    D: frozenset({A, Q, C}),
    A: frozenset({R, S, F, C, P, Q}),
    R: frozenset({S, F, C, P, Q}),
    P: frozenset({Q, C, F}),
    S: frozenset(),
    F: frozenset(),
    C: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, job_id: str, src: JobState, dst: JobState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[src])) or "none (final state)"
        super().__init__(f"job {job_id} is {src}; it cannot become {dst} (allowed from {src}: {allowed})")
        self.src, self.dst = src, dst


class Job(BaseModel):
    """A submitted job and where it stands. ``attempt`` counts dispatches (0 before the first)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    spec: JobSpec
    state: JobState = JobState.QUEUED
    site: str | None = None
    gpu_model: str | None = Field(default=None, description="GPU model the current attempt was placed on")
    usd_per_gpu_hour: float | None = Field(
        default=None, exclude=True,
        description="the USD per GPU-hour of gpu_model at its site that routing saw when the current attempt was "
                    "placed (None where unpriced, or placed by an earlier release or before the job was read back "
                    "from the store); the usage report charges the attempt at it",
        # Never in the job's document: brokers of earlier releases sharing the database refuse keys they do not
        # know, and nearly every placed job has a price. Its stored copy is the transitions' (job_events'
        # usd_per_gpu_hour, migration 8), which the usage report reads.
    )
    attempt: int = Field(default=0, description="dispatches so far; each dispatch is a new attempt")
    failed_attempts: int = Field(default=0, description="attempts that failed; max_attempts bounds these")
    created_at: UtcDatetime
    updated_at: UtcDatetime
    started_at: UtcDatetime | None = None
    finished_at: UtcDatetime | None = None
    reason: str | None = Field(default=None, description="why the job is in its state")
    run_s: float = Field(default=0.0, ge=0, description="seconds run so far, kept across checkpointed attempts")
    restart_s: float = Field(default=0.0, ge=0, description=(
        "seconds of run_s that preempted attempts resumed from a checkpoint spent restarting (each one's run, "
        "up to its profile's restart overhead) rather than adding work: the work kept is run_s less this"))
    version: int = Field(default=0, description="bumped by every stored change (optimistic concurrency)")
    waiting: bool = Field(
        default=False,
        description="true while the job waits for the jobs it runs after (spec.after to succeed, spec.after_any "
                    "to end, spec.after_failed to fail or be cancelled): it is queued but out of the scheduling queue "
                    "(never placed, previewed as placeable, deferred or counted against a limit) until they have; "
                    "left out where false",
        # Left out where false: a job without dependencies is stored as before (brokers of earlier releases read it).
        exclude_if=lambda waiting: not waiting,
    )

    def transition(self, dst: JobState, now: datetime, **changes: Any) -> Job:
        """Return a copy of this job in state ``dst``; raise IllegalTransition if the machine forbids it."""
        if dst not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.id, self.state, dst)
        update: dict[str, Any] = {"state": dst, "updated_at": now, "version": self.version + 1, **changes}
        if update.get("reason") is not None:
            update["reason"] = clean_text(update["reason"])
        if dst == JobState.QUEUED:  # back in line: no site holds the job any more
            update.update(site=None, gpu_model=None, usd_per_gpu_hour=None)
        else:  # (a job waiting for others leaves the queue only by ending: it waits no more)
            update.setdefault("waiting", False)
        if dst == JobState.RUNNING and self.started_at is None:
            update.setdefault("started_at", now)
        if dst.terminal:
            update.setdefault("finished_at", now)
        return self.model_copy(update=update)


# --- decisions ----------------------------------------------------------------------------------------


class ScoreTerm(Strict):
    scorer: str = Field(description="the scorer's name (policies/scorers/), as the profile weights it")
    raw: float | None = Field(description="the scorer's value in its own units (None: not a finite number, or "
                                          "unknown: a zone with no forecast, a site with no price for a model with "
                                          "room, an unmeasured round trip; the scorer ranks such a site after every "
                                          "known one)")
    normalised: float | None = Field(
        description="0..1 over the sites that passed the filters; 1 is best (None: the site was rejected, so "
                    "it was not ranked)")
    ranked_as: float | None = Field(
        None, exclude_if=lambda v: v is None,
        description="where raw is unknown at a site that passed the filters, the value the decision ranked it as "
                    "(in the scorer's units: one more than the worst known value, so the site ranks after every "
                    "known one); the sites' normalised values are worked out with it. Absent where raw is known")
    weight: float = Field(description="the profile's weight of the scorer")
    weighted: float | None = Field(description="normalised × weight, the term's part of the site's score (None: the "
                                               "site was rejected)")


class SiteVerdict(Strict):
    site: str = Field(description="the site's name")
    feasible: bool = Field(description="whether the site passed every filter (false: see reasons)")
    reasons: list[str] = Field(default_factory=list, description="every filter that rejected the site")
    terms: list[ScoreTerm] = Field(default_factory=list, description="every scorer's term at the site, in the "
                                                                       "profile's order")
    score: float | None = Field(None, description="the sum of the terms' weighted values; the highest is chosen, "
                                                  "ties going to the first site by name (None: the site was rejected)")
    passed_over: str | None = Field(
        None, description="why a time-shifting profile's plan turned this site away now although it scored "
                          "higher than the site chosen (its GPUs are booked within the run, or kept for "
                          "latency-bound jobs or as headroom); None: it was not")


class DeadlineRisk(Strict):
    now: float = Field(description="the chance (0..1) of missing the deadline when started now")
    then: float = Field(description="the chance (0..1) of missing it when started at the planned start")


class DeferralPlan(Strict):
    """The planned start of a deferred job and what it was weighed against (the decision record's
    ``deferred``)."""

    site: str = Field(description="where the plan starts the job")
    start: UtcDatetime = Field(description="when the plan starts it (the start of an hour)")
    objective: Literal["carbon", "cost"] = Field(description="what the plan minimises: carbon (kg CO2e) or cost "
                                                           "(USD)")
    value_then: float | None = Field(description="the objective's forecast of the run from the planned start")
    value_now: float | None = Field(None, description="the same for the best start now (None: none could start "
                                                      "now)")
    room_price_now: float | None = Field(
        None, description="the price of the room kept for latency-bound jobs that a start now would take, in the "
                          "objective's unit (None: none)")
    now_site: str | None = Field(None, description="the site of the best start now")
    deadline_risk: DeadlineRisk | None = Field(
        None, description="the chance of missing the deadline now and then, from how long recent jobs ran against "
                          "their estimates (None: not priced)")


class Decision(Strict):
    """Why a job went where it went: the pick (or deferral), every site's rejections and score terms."""

    job_id: str = Field(description="the job's id")
    attempt: int = Field(description="placed: the attempt the placement started; deferred or unplaceable: the "
                                     "attempts made before the decision (0: none yet)")
    decided_at: UtcDatetime = Field(description="when the decision was taken (one that keeps a job waiting is "
                                                "taken again at later passes and recorded again when it changes, "
                                                "and at least once a minute)")
    outcome: Literal["placed", "deferred", "unplaceable"] = Field(
        description="placed: sent to the site; deferred: planned to start later (deferral); unplaceable: no site "
                    "could take it then, and it waited in the queue")
    site: str | None = Field(None, description="the site chosen (None: not placed)")
    deferred_until: UtcDatetime | None = Field(None, description="the planned start of a deferred job")
    summary: str = Field(description="the decision in words: why this site, or why it waits")
    sites: list[SiteVerdict] = Field(description="every site the decision saw, by name: its rejections or its "
                                                 "score terms")
    deferral: DeferralPlan | None = Field(None, description="for a deferred job, the plan and what it weighed")


PREVIEW_LIST_MAX = 1000
"""Job specs one ``POST /v1/preview`` decides together, at most."""


class Preview(Strict):
    """What the broker would decide for a job now (``POST /v1/preview``); nothing is submitted."""

    note: str = Field(description="what the preview is, and what it cannot know")
    decision: Decision = Field(description="the decision, as GET /v1/jobs/{id}/decision gives one (job_id "
                                           "'preview')")
    ahead: int | None = Field(None, ge=0, exclude_if=lambda n: n is None, description=(
        "queued jobs decided before it, as the next pass would decide them, their placements and deferrals taking "
        "their room first (left out by releases that decided it as if first in the queue)"))
    listed_ahead: int | None = Field(None, ge=0, exclude_if=lambda n: n is None, description=(
        "for a list of specs previewed together: the specs of the list decided before it, as the queue would order "
        "them submitted one after another in the list's order, their placements and deferrals taking their room "
        "first"))
    waiting_for: list[str] | None = Field(None, exclude_if=lambda ids: not ids, description=(
        "the jobs the spec runs after whose condition does not hold yet (those of after that have not succeeded, "
        "of after_any that have not ended, of after_failed that have not failed or been cancelled): the job would "
        "wait for them, out of the scheduling queue, and no site was weighed (the decision's outcome is "
        "unplaceable, its summary says so); left out "
        "where it would not wait"))


ActiveState = Literal["queued", "dispatching", "admitted", "running", "preempted"]  # the states a job can leave
class Cancellation(Strict):
    """Which jobs to cancel at once (``POST /v1/cancellations``, ``heliotrope cancel --tenant T --label k=v``): every
    job of ``tenant`` carrying all of ``labels``, in ``state`` (none: any state a job can still leave), at ``site``,
    that the caller may cancel. A tenant or labels must be named, so that one request cannot cancel every job."""

    tenant: Slug | None = Field(default=None, description="the tenant whose jobs to cancel")
    labels: dict[str, str | None] = Field(default_factory=dict, max_length=64,
                                          description="labels each job must carry, every one (null: with any value)")
    state: ActiveState | None = Field(default=None, description="only jobs in this state; none: every active state")
    site: Slug | None = Field(default=None, description="only jobs at this site")
    reason: str | None = Field(default=None, max_length=500, description="why, recorded on each job cancelled")

    @field_validator("labels")
    @classmethod
    def _keys_named(cls, labels: dict[str, str | None]) -> dict[str, str | None]:
        if "" in labels:
            raise ValueError("a label's key may not be empty")
        return labels


class TenantLimitChange(Spec):
    """A tenant's federation-wide GPU limit set live (``PUT /v1/tenants/{tenant}/limit``, ``heliotrope tenant-limit``),
    standing over ``broker.tenant_limits`` and ``broker.default_tenant_limit`` until deleted (:mod:`broker.limits`)."""

    gpus: float | None = Field(ge=0, le=MAX_TENANT_LIMIT_GPUS, description=(
        f"GPUs the tenant's jobs may hold at once across the federation, a fractional job counting its share (at most "
        f"{MAX_TENANT_LIMIT_GPUS:,}, as in the configuration); 0: none start; null: unlimited"))


def clean_text(value: str, limit: int = 1000) -> str:
    """Free text from elsewhere (a site's reason, an adapter's error) made safe to store: no unpaired
    surrogates, no NUL (PostgreSQL's text refuses it, where SQLite takes it), bounded length."""
    return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "?")[:limit]


def utcnow() -> datetime:
    return datetime.now(UTC)
