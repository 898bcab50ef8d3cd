"""A Kubernetes cluster as a site, through the ``kubernetes`` package's asyncio client (``kubernetes.aio``).

- Capacity: read from the Nodes. Whole GPUs are ``nvidia.com/gpu`` allocatable; MIG slices are the
  ``nvidia.com/mig-<profile>`` allocatable of the device plugin's mixed strategy (a node's MIG GPUs are
  ``nvidia.com/gpu.count`` minus its whole GPUs, else its slices' compute slices / 7, rounded up). Under the
  single strategy (label ``nvidia.com/mig.strategy=single``, product label ``<GPU>-MIG-<profile>``) a Node's
  ``nvidia.com/gpu`` are MIG slices of that profile, on the fewest GPUs that hold them, and no whole GPUs; a
  job asking that profile there asks ``nvidia.com/gpu`` for its slices (see ``job_manifest``). The model comes
  from NVIDIA GPU feature discovery's ``nvidia.com/gpu.product`` label, mapped to the canonical ids
  (``broker.ids``); a node whose product is missing or unknown, that is cordoned or not Ready, that lacks a label
  of ``node_selector``, or that has a NoSchedule or NoExecute taint none of ``tolerations`` tolerates, is left out
  (``left_out``, with the reason). Nodes are grouped into the site's node groups, and
  :class:`policies.admission.SiteAdmission` is built from them (rebuilt when the Nodes change; the attempts this
  adapter runs are re-entered).
- Admission: before it creates a Job the adapter applies ``SiteAdmission`` (its inventory from the Nodes, the
  site's quotas and fair share), so it refuses what the site's policy refuses. Jobs the site preempts for it are
  stopped only once the cluster has accepted its Job (a refusal, such as a missing namespace, RBAC or an admission
  webhook, stops nobody). A job runs as one Pod, so whole GPUs must fit on one node (``topology: node`` is
  implied). Fractional GPUs (``milli``, ``shared``) are refused: the NVIDIA device plugin hands out whole GPUs or
  MIG slices. What the cluster still decides: the scheduler places the Pod (on a node the inventory may not have
  chosen), ResourceQuota admission may refuse it, and the device plugin assigns the devices (a MIG layout is fixed
  on the node, where the inventory assumes any mix of the offered slices).
- What runs already: Pods not of this site (Pending on a node, or Running) that ask for ``nvidia.com/gpu`` or
  MIG slices hold those GPUs of their node in the inventory (not in the quota book); the Pods are re-read with
  the Nodes, at most every ``pods_ttl_s`` (5 s). On start, and whenever the ledgers are rebuilt, this site's
  active Jobs are re-entered (GPUs from the container limits, on their Pod's node or any node of their model,
  tenant from the labels, priority/preemptible from an annotation, since ``status.startTime``); one whose node
  is gone counts against its tenant's quota only (logged). A rebuild keeps the tenants' usage history (the fair
  share's sliding window); a restart of the adapter starts it afresh. One whose Pod is Running has run since the Pod's
  ``status.startTime``: ``running`` is reported once, at that time, and a later stop counts its run from it.
- Jobs: a batch/v1 Job named ``h-<job id>-<attempt>`` in namespace ``namespace_prefix + tenant`` (which must
  exist; past 63 characters, the limit of a namespace name, shortened to end in a hash: ``namespace``), one Pod,
  ``backoffLimit: 0`` (the broker retries) and a ``podFailurePolicy`` that fails it at once when the cluster
  disrupts its Pod, its GPUs as container limits, a node affinity on the product labels of
  the chosen model, the configured ``tolerations`` and ``node_selector``, the securityContexts of
  ``pod_security`` (restricted: what the Pod Security Standards' restricted profile asks) and
  ``pod_security_context`` (none where neither is set), for a checkpointable job
  ``terminationGracePeriodSeconds`` a little under ``stop_wait_s``, the time a stop waits for it to write its
  checkpoint (less 10 % of it or 5 s, whichever is smaller, at least 1 s: ``grace_period_s``), labelled with the
  site, job id, attempt and tenant. A repeated dispatch of the same attempt finds the existing Job (create answers 409) and admits it
  once. Cancel deletes the Job (background propagation) and is final for the attempt.
- Events: a watch on Jobs and one on Pods (label ``heliotrope.io/site``): a Running Pod → ``running``; a Job with
  a ``Complete`` condition or ``succeeded`` → ``succeeded``; ``Failed`` or ``failed`` → ``failed`` with the Job's
  reason and how its container ended (``OOMKilled``, the exit code, which the ``podFailurePolicy`` also puts in
  the Job's reason), but ``lost`` where the cluster took the Pod away (its ``DisruptionTarget`` condition: a drain, an
  eviction, its Node lost), which is no failure of the job's, unless the kubelet evicted it for its own usage
  (``own_eviction``: over its ephemeral-storage limits, or over its requests under node pressure) → ``failed``,
  else it would be requeued and evicted again for ever; a Pod whose container waits for what will not come
  (``NEVER_STARTS``: an image name that is none, or never pulled) → ``failed`` at once, its Job deleted, and so
  one that waits for what may yet come (``STUCK_AFTER``: an image pull failing, a missing Secret) once it has
  waited ``unschedulable_after_s`` from its Pod's startTime (0 or None: it waits); a Pod the
  scheduler has found no room for (PodScheduled False, Unschedulable) for ``unschedulable_after_s``, counted from
  the condition's lastTransitionTime, → ``lost`` (before it ran: the broker routes the job elsewhere, no failure
  of the job's), its Job deleted, but not while Pods of a stop here are still going (a preemption making room for
  it) nor in the ``AFTER_STOP_GRACE_S`` after (0 or None: it waits); a Job the cluster has made no Pod for in
  ``unschedulable_after_s`` from its creationTimestamp (it refuses it: Pod Security admission, a LimitRange, a
  ResourceQuota; only a FailedCreate Event says so, and its message is the reason given) the same, with ``PODLESS_AFTER_STOP_GRACE_S`` after a stop
  (the site's own ResourceQuota refuses a preemptor's Pod until its victims have gone); a Job deleted by someone
  else → ``lost``. These waits are counted on the cluster's clock, as the timestamps they start from: the
  adapter's clock plus the skew the ``Date`` header of the API server's answers shows
  (:mod:`adapters.cluster_clock`).
  A Job that succeeded or failed is deleted once the broker has taken its outcome (``taken``). Each time a watch (re)connects (after an error, its 300 s
  timeout or 410 Gone) it lists the Jobs or Pods and reconciles: an attempt whose Job is gone from the list
  (deleted while no watch ran) is ``lost``, a stopping one whose Pods are gone is stopped. A stop (``preempt``, or
  the site's own preemption) deletes the Job and is reported ``preempted`` once its last Pod has gone (or after
  ``stop_wait_s``); Pods found at start without their Job are such a stop, begun before this adapter: known, their
  GPUs held, reported the same way. Each stop is kept in ``state_dir`` (``stops.json``,
  :class:`adapters.site_state.StopJournal`) until the broker has taken its event, so one whose Pods went while no
  adapter ran (the broker restarting) is reported by the next adapter, with its run up to the stop, rather than
  taken for a lost attempt. With ``state_namespace`` the stops are kept in the cluster too, in the ConfigMap
  ``heliotrope-stops-<site>`` there (:mod:`adapters.kubernetes_stops`, written in the background), and joined to
  the file's at start: the adapter of a broker replica with another ``state_dir`` that takes over reports them
  the same way. A ConfigMap the cluster refuses is logged, and the adapter goes on with its file. A site removed
  from the federation (``forget_quotas``) drops its stops from both, so a new site of its name takes none up.
- Quotas: the spec's quotas with the operator's changes (kept in ``state_dir``, :mod:`adapters.quota_store`;
  the usage history their fair share weighs too, :class:`adapters.site_state.UsageJournal`, taken by the first
  ledgers built after a start) are enforced by ``SiteAdmission`` and mirrored as a ResourceQuota ``heliotrope-gpus`` in each tenant's
  namespace: ``requests.nvidia.com/gpu`` = guarantee + burst (MIG slices and per-model limits are not
  expressible there, and are annotated only). Where Nodes of the single MIG strategy advertise slices as
  ``nvidia.com/gpu``, one GPU of the limit may be seven such slices, so the mirror's limit is seven times
  guarantee + burst there (a bound the site's own admission keeps within, not the limit itself). The mirror
  follows the Nodes: at each inventory refresh (every ``snapshot``, so each broker cycle, and each ``submit``)
  a ResourceQuota whose manifest would change (Nodes relabelled to or from the single strategy, or such Nodes
  come or gone) is written again; an unchanged layout costs no call. A write that fails is logged with the
  namespace and status and tried again at the first refresh ``quota_retry_s`` (30 s) later, the wait doubling
  with each failure in a row, to an hour (the snapshot goes on; ``SiteAdmission`` keeps the quota meanwhile).
  A quota removed while its ResourceQuota is being written stays removed (writes and deletes take turns).
- Every API call has a timeout (``request_timeout_s``) and is retried (``retries``, exponential back-off) on
  connection errors, 429 and 5xx; what still fails raises ``AdapterError`` with the API server's message (a
  401 names the credentials' settings to check: ``_refusal``).
- Telemetry: the Nodes give only the GPUs' memory. With ``telemetry: {kind: prometheus, url: ...}`` the
  adapter reads what the cluster's dcgm-exporter measures (temperature, power, utilisation, memory, clock
  throttling) from the Prometheus server that scrapes it, every ``every_s`` (``adapters.dcgm``), and its
  snapshots carry the latest reading (the queue depth stays its own); a reading older than ``stale_after_s``
  is not used.

Credentials: ``in_cluster`` (the Pod's service account, its token re-read as the kubelet rotates it), else the
kubeconfig (``kubeconfig``, ``context``; a token of an exec plugin, ``gcp`` or ``oidc`` renewed as it expires,
a ``tokenFile`` read again every minute),
or ``host`` alone (an unauthenticated URL such as ``kubectl proxy`` or a test emulator). RBAC: list/watch
nodes; create/get/list/watch/delete jobs; list/watch pods (all namespaces); get pods/log (a job's logs:
:mod:`adapters.kubernetes_logs`); create/patch/delete resourcequotas; with ``state_namespace``, get/create/patch
configmaps in that namespace.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config
from kubernetes.aio.config import kube_config as kube_config_module
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from adapters.base import (
    AdapterError, Admission, EventKind, JobEvent, JobLogs, LogFollow, LogsNotFound, LogsUnsupported, tail_text,
)
from adapters import kubernetes_logs
from adapters.cluster_clock import ClusterClock
from adapters.quota_store import QuotaOverrides, log_beyond_site
from adapters.kept_logs import KeptLog, KeptLogs
from adapters.kubernetes_stops import ClusterUsage, ClusterStops
from adapters.site_state import StopJournal, UsageJournal
from adapters.telemetry import telemetry_feed
from adapters.kubernetes_nodes import (
    ASK_ANNOTATION,
    ATTEMPT_LABEL,
    GPU,
    JOB_ANNOTATION,
    JOB_LABEL,
    MIG_PREFIX,
    PRODUCT_LABEL,
    NodeGpus,
    attempt_key,
    inventory_nodes,
    job_ask,
    job_ended,
    node_groups,
    _timestamp,
    place_on,
    pod_gpus,
    product_model,  # noqa: F401 - re-exported: part of this module's interface
    read_node,
)
from broker.clock import Clock
from broker.models import (
    GpuRequest,
    Health,
    Job,
    KubernetesAdapterConfig,
    NodeGroup,
    QuotaState,
    SiteSpec,
    SiteState,
    Telemetry,
    TenantQuota,
)
from policies.admission import Admitted, SiteAdmission
from policies.inventory import MIG_SLICES_PER_GPU
from policies.quota import Ask, QuotaBook

log = logging.getLogger(__name__)

SITE_LABEL = "heliotrope.io/site"
TENANT_LABEL = "heliotrope.io/tenant"
PODS_TTL_S = 5.0  # how long a read of the Pods (GPUs held outside heliotrope) is reused
QUOTA_RETRY_S = 30.0  # after a ResourceQuota write fails, the wait before the next; doubling, at most an hour
QUOTA_NAME = "heliotrope-gpus"
ENDED_LOG_LINES = 1000  # of an ended attempt's log, the end kept when its Job is deleted: at most these lines
ENDED_LOG_BYTES = 256 * 1024  # ... and bytes
ENDED_LOGS_BYTES = 32 * 1024 * 1024  # the ended attempts' logs kept in all (the oldest go first)
# A followed log (``follow_logs``) may be quiet for as long as its job prints nothing: no read timeout, only this bound
# on the whole stream (the client takes one number, a total), as long as the broker's (broker.api.LOG_FOLLOW_MAX_S).
FOLLOW_MAX_S = 24 * 3600.0
ENDED_LOG_READ_S = 10.0  # how long the read of one may take before its Job is deleted without it
TOMBSTONE_TTL_S = 3600.0
TOKEN_FILE_REREAD_S = 60.0  # a kubeconfig's tokenFile is read again this often (client-go: a minute)
# A container waiting for one of these will not start without someone changing the image or the Pod's config
# (the kubelet retries for ever, the Job waits for ever): the attempt fails at once, its Job is deleted.
NEVER_STARTS = frozenset({"ErrImageNeverPull", "InvalidImageName"})
# ... and for one of these, once it has lasted ``unschedulable_after_s`` from the Pod's startTime: a registry's
# outage or rate limit, a Secret or ConfigMap made just after the Pod, pass, and the kubelet's retries start it.
STUCK_AFTER = frozenset({"ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"})
STUCK_REASONS = NEVER_STARTS | STUCK_AFTER
# After a stop's Pods have gone (a preemption making room), the scheduler is given this long to place a Pod that
# waited for their GPUs before ``unschedulable_after_s`` may withdraw it (it retries such Pods within seconds).
AFTER_STOP_GRACE_S = 60.0
# ... and this long to create the Pod of a Job whose Pods it refused meanwhile (the site's own ResourceQuota, full
# until the victims' Pods have gone): the Job controller tries again with a back-off of up to 6 minutes.
PODLESS_AFTER_STOP_GRACE_S = 360.0
# A checkpointable Pod's grace period ends this much before the stop's wait (``grace_period_s``): 10 % of it, at
# most 5 s, time for the delete to reach the kubelet.
GRACE_MARGIN, GRACE_MARGIN_S = 0.1, 5.0
UNPLACED_RECHECK_S = 30.0  # the longest a waiting Pod's deadline sleeps before it looks again
# The Job fails at once when the cluster disrupts its Pod (an eviction, a drain, its Node lost, the scheduler's
# preemption), with this rule's reason in its Failed condition: the adapter reports such a failure ``lost``.
# Else, where the container exits non-zero, the Failed condition names its exit code.
POD_FAILURE_POLICY = {"rules": [
    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "FailJob", "onExitCodes": {"containerName": "job", "operator": "NotIn", "values": [0]}}]}

T = TypeVar("T")


# The kubelet's eviction messages (pkg/kubelet/eviction/helpers.go) that blame the Pod's own usage: over its
# ephemeral-storage limits (a container's, the Pod's total, an emptyDir's sizeLimit), or, under node pressure, a
# container of it using more than it requested (the kubelet names only such containers).
OWN_USAGE = re.compile(r"exceeds the total limit of containers|exceeded its local ephemeral storage limit|"
                       r"Usage of EmptyDir volume .* exceeds the limit|Container \S+ was using \S+, request is")
# The Job controller's message when a podFailurePolicy rule on DisruptionTarget failed the Job: the Pod's name
DISRUPTED_POD = re.compile(r"Pod ([^/\s]+)/(\S+) has condition DisruptionTarget")
# DisruptionTarget reasons of the cluster's own doing, whatever the message: a drain or the descheduler (the
# Eviction API), a NoExecute taint, the scheduler preempting it for a Pod of higher priority, its Node gone.
CLUSTER_DISRUPTIONS = frozenset({"EvictionByEvictionAPI", "DeletionByTaintManager", "PreemptionByScheduler",
                                 "PreemptionByKubeScheduler", "DeletionByPodGC"})


def own_eviction(reason: str | None, message: str | None) -> str | None:
    """Where the kubelet evicted a Pod for its own usage, why (its message): the job's failure, to count against
    its ``max_attempts`` (it would be evicted again wherever it ran); else None, a loss that is no fault of the
    job's. The kubelet's evictions (the DisruptionTarget reason ``TerminationByKubelet``, or the Pod's status
    reason ``Evicted`` on clusters without the condition) are decided by their message: one over the Pod's own
    limits, or naming a container of it that used more than it requested under node pressure (heliotrope's Pods
    request no memory or disk, so any use of the resource the node ran short of), is the job's; a node shutdown,
    node pressure naming none of its containers, and every other reason are not."""
    if reason in CLUSTER_DISRUPTIONS or not message:
        return None
    return message.strip()[:300] if OWN_USAGE.search(message) else None


def _label_value(value: str) -> str:
    """A label value: at most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", value)[:63].strip("-_.")
    return clean or "x"


def job_name(job_id: str, attempt: int) -> str:
    """The Job's name for an attempt: stable, so a repeated dispatch finds it (DNS-1123, at most 63)."""
    slug = re.sub(r"[^a-z0-9-]", "-", job_id.lower()).strip("-")[:36].strip("-")
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return f"h-{slug}-{digest}-{attempt}" if slug else f"h-{digest}-{attempt}"


def grace_period_s(stop_wait_s: float) -> int:
    """A checkpointable job's ``terminationGracePeriodSeconds``: strictly inside the stop's wait, which starts at
    the Job's delete, a little before the kubelet's SIGTERM (the Job controller and the kubelet see the delete
    later): ``stop_wait_s`` less ``GRACE_MARGIN`` of it or ``GRACE_MARGIN_S``, whichever is smaller, rounded
    down, so the kubelet's SIGKILL comes before the stop is reported; at least 1 s (0 would kill at once)."""
    margin = min(stop_wait_s * GRACE_MARGIN, GRACE_MARGIN_S)
    return max(1, math.floor(stop_wait_s - margin))


def gpu_resources(req: GpuRequest) -> dict[str, str]:
    if req.mig_profile is not None:
        return {MIG_PREFIX + req.mig_profile: str(req.count)}
    return {GPU: str(req.count)}


@dataclass(slots=True)
class _Attempt:
    job_id: str
    attempt: int
    tenant: str
    namespace: str
    admitted: bool = False  # entered in the admission ledgers
    running_since: datetime | None = None
    done: bool = False
    job: Job | None = field(default=None, repr=False)
    # what re-enters it into new ledgers (a broker restart, changed Nodes): its GPUs, the ask, where it runs
    req: GpuRequest | None = None
    ask: Ask | None = None
    node: str | None = None  # the Node its Pod runs on, once scheduled
    started: float | None = None  # POSIX seconds
    pods: set[str] = field(default_factory=set)  # its Pods that exist, as the watch saw them
    stopping: str | None = None  # why it is being stopped (a move, a preemption): reported once its Pods are gone
    released: bool = False  # its GPUs and quota already given to the job that preempted it, ahead of its Pods
    orphan: bool = False  # found at start as Pods without their Job: a stop under way before this adapter
    has_job: bool = False  # its Job was made or seen: one that is gone from a list of the Jobs was deleted
    disrupted: str | None = None  # why the cluster took its Pod away (an eviction, its Node lost): not its failure
    reading_pod: bool = False  # its Job failed as its Pod was disrupted, and the Pod is being read (whose fault?)
    own_eviction: str | None = None  # ... unless the kubelet evicted it for its own usage (``own_eviction``): why
    exited: str | None = None  # how its container ended, where it failed (OOMKilled, its exit code)
    unschedulable: str | None = None  # the scheduler's last word on why its Pod cannot be placed (logged once each)
    # (These three times are the cluster's, by its clock: ``_unplaced_deadline`` compares them with the
    # cluster's time, ``_cluster_time``.) Since when its Pod has been unschedulable (the condition's
    # lastTransitionTime), while it is: withdrawn once that is ``unschedulable_after_s`` ago (``_unplaced_deadline``)
    unplaced_since: datetime | None = None
    # since when its container has been waiting for one of ``STUCK_AFTER`` (its Pod's startTime), while it is, and
    # the kubelet's last word on it: the attempt fails once that is ``unschedulable_after_s`` ago
    stuck_since: datetime | None = None
    stuck: str | None = None
    had_pod: bool = False  # a Pod of its Job was seen (else, once its Job is that old, the cluster refuses them)
    created: datetime | None = None  # its Job's creationTimestamp (or when this adapter first saw the Job)


def _transient(e: BaseException) -> bool:
    if isinstance(e, k8s.ApiException):
        return e.status in (0, 429) or (e.status or 0) >= 500
    return isinstance(e, aiohttp.ClientError | asyncio.TimeoutError | ConnectionError)


class KubernetesSite:
    def __init__(self, spec: SiteSpec, clock: Clock, config: KubernetesAdapterConfig | None = None,
                 state_dir: str | Path | None = None, api_client: k8s.ApiClient | None = None) -> None:
        """``api_client``: a ready client (tests); by default one is built at ``start`` from the config."""
        self.spec = spec
        self.name = spec.name
        cfg = config or spec.adapter
        if not isinstance(cfg, KubernetesAdapterConfig):
            raise ValueError(f"site {spec.name}: adapter kind {cfg.kind!r} is not kubernetes")
        self.config = cfg
        self._clock = clock
        # The cluster's time (the adapter's clock plus the skew the API server's answers show): what the cluster's
        # timestamps (lastTransitionTime, startTime, creationTimestamp) are compared with
        self._cluster_time = ClusterClock(clock, spec.name)
        folder = state_dir if state_dir is not None else cfg.state_dir
        self._overrides = QuotaOverrides(Path(folder) / spec.name / "quota.json" if folder is not None else None)
        # The stops begun whose `preempted` the broker has not taken yet (its Pods may go while no adapter runs).
        self._journal = StopJournal(Path(folder) / spec.name / "stops.json" if folder is not None else None)
        # The usage history the fair share weighs, taken by the first ledgers built after the start
        self._usage = UsageJournal(Path(folder) / spec.name / "usage.json" if folder is not None else None, self.name)
        self._usage_restored = False
        # ... and its copy in the cluster, for a broker replica with another folder (read at start)
        self._cluster_usage = (ClusterUsage(self.name, cfg.state_namespace, self._json, lambda: self._core,
                                            close_timeout_s=cfg.request_timeout_s * 2)
                               if cfg.state_namespace is not None else None)
        self._usage_in_cluster: bytes | None = None
        if self._cluster_usage is not None:
            self._usage.mirror = self._cluster_usage.put
        # ... and their copy in the cluster, for a broker replica with another folder (None: not configured)
        self._cluster_stops = (ClusterStops(self.name, cfg.state_namespace, self._json, lambda: self._core,
                                            close_timeout_s=cfg.request_timeout_s * 2)
                               if cfg.state_namespace is not None else None)
        self._api = api_client
        self._own_api = api_client is None
        self._no_client: str | None = None  # why start could not make an API client (its error), if it could not
        self._admission: SiteAdmission | None = None
        self._history: QuotaBook | None = None  # the last ledgers' book, whose usage history a rebuild takes on
        self._events_unread = False  # whether a read of Events has failed (logged once)
        self._groups: list[NodeGroup] = []
        # (model, profile of a single-strategy node or None) -> product label values seen
        self._products: dict[tuple[str, str | None], set[str]] = {}
        self._single: dict[str, str] = {}  # Node of the single MIG strategy -> the profile it advertises as GPUs
        self._single_inv: set[str] = set()  # those Nodes' names in the inventory
        self._node_map: dict[str, list[str]] = {}  # Node -> its names in the inventory
        self._node_model: dict[str, str] = {}
        self._foreign: dict[str, tuple[str, GpuRequest]] = {}  # Pods outside this site: id -> (Node, GPUs)
        self._foreign_held: dict[str, tuple[str, GpuRequest]] = {}  # those entered in the inventory
        # tenant -> the ResourceQuota last written for its quota, or why the last write failed (``_mirror_quota``)
        self._mirrored: dict[str, dict[str, Any] | str] = {}
        self._pods_read_at: float | None = None  # time.monotonic()
        self.pods_ttl_s = PODS_TTL_S
        self.quota_retry_s = QUOTA_RETRY_S
        self._mirror_retry: dict[str, tuple[float, float]] = {}  # tenant -> (time.monotonic() of the next try, wait)
        self._quota_writes = asyncio.Lock()  # a ResourceQuota's write and its record, or its delete, at a time
        self.left_out: list[str] = []  # nodes left out of the inventory, with the reason
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._withdrawn: dict[tuple[str, int], datetime] = {}
        self._stop_waits: set[asyncio.Task[None]] = set()  # stopping attempts awaiting the end of their Pods
        # the end of the log of the latest attempts that ended, kept as their Jobs are deleted (_keep_log), in the
        # state folder too, so that they outlive a restart
        self._ended_logs = KeptLogs(Path(folder) / spec.name / "logs" if folder is not None else None, spec.name)
        self._unplaced: dict[tuple[str, int], asyncio.Task[None]] = {}  # deadlines of unschedulable Pods
        # when a stop's Pods last went (GPUs freed for a waiting Pod), by the cluster's clock
        self._stop_ended: datetime | None = None
        self._pods_listed = False  # the Pods watch has listed them once: a Job without a Pod seen has none
        self._events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._watches: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one admission at a time
        # GPU telemetry measured by the cluster's dcgm-exporter, read from Prometheus (None: not configured)
        self.telemetry = telemetry_feed(self.name, cfg.telemetry, clock) if cfg.telemetry is not None else None

    # --- life cycle ---

    async def start(self) -> None:
        if self._api is None:
            try:
                self._api = await self._build_client()
            except AdapterError as e:
                self._no_client = str(e)
                raise
            self._no_client = None
        await self._join_cluster_stops()
        if self._cluster_usage is not None and not self._usage_restored:
            self._usage_in_cluster = await self._cluster_usage.read()
        await self._adopt()
        await self._adopt_pods()
        self._adopt_stops()
        await self._refresh_inventory()
        for tenant_quota in self._quotas():
            try:
                await self._mirror_quota(tenant_quota)
            except AdapterError as e:
                log.warning("site %s: %s", self.name, e)
        if self._cluster_stops is not None:
            self._cluster_stops.start()  # writes what the start changed, then each change
        loop = asyncio.get_running_loop()
        self._watches = [loop.create_task(self._watch("jobs"), name=f"k8s-{self.name}-jobs"),
                         loop.create_task(self._watch("pods"), name=f"k8s-{self.name}-pods")]
        if self.telemetry is not None:
            # Read in the background only: a source that hangs (a Prometheus that drops packets) must not hold
            # up the start, nor the reports; the first reading goes out with the report after it.
            self.telemetry.start()

    async def close(self) -> None:
        book = self._admission.book if self._admission is not None else self._history
        if book is not None and self._usage_restored:
            self._usage.save(book, self._clock.now().timestamp(), force=True)
        for task in (*self._watches, *self._stop_waits):
            task.cancel()
        await asyncio.gather(*self._watches, *self._stop_waits, return_exceptions=True)
        self._watches = []
        if self._cluster_stops is not None:
            await self._cluster_stops.close()  # (what is still queued: one last try)
        if self._cluster_usage is not None:
            await self._cluster_usage.close()
        if self.telemetry is not None:
            await self.telemetry.stop()
        if self._api is not None and self._own_api:
            await self._api.close()
            self._api = None

    async def _build_client(self) -> k8s.ApiClient:
        cfg = self.config
        configuration = k8s.Configuration()
        unused = [name for name, value, used in (
            ("kubeconfig", cfg.kubeconfig, cfg.host is None and not cfg.in_cluster),
            ("context", cfg.context, cfg.host is None and not cfg.in_cluster),
            ("in_cluster", cfg.in_cluster or None, cfg.host is None)) if value is not None and not used]
        if unused:  # (a site spec stored by an earlier release may hold both: warned, not refused)
            chosen = "adapter.host" if cfg.host is not None else "adapter.in_cluster (the Pod's service account)"
            log.warning("site %s: %s %s not used: the credentials come from %s", self.name,
                        ", ".join(f"adapter.{n}" for n in unused), "is" if len(unused) == 1 else "are", chosen)
        try:
            if cfg.host is not None:
                configuration.host = cfg.host
            elif cfg.in_cluster:
                k8s_config.load_incluster_config(client_configuration=configuration)
            else:
                path = str(Path(cfg.kubeconfig).expanduser()) if cfg.kubeconfig else None
                _check_kubeconfig_exists(path)
                if path is not None:
                    _check_kubeconfig(path)
                loader = await k8s_config.load_kube_config(config_file=path, context=cfg.context,
                                                           client_configuration=configuration, persist_config=False)
                configuration.refresh_api_key_hook = _token_refresher(loader)
        except Exception as e:  # noqa: BLE001 (the loader's own errors, and YAML, type and base64 ones from a bad file)
            why = str(e) if isinstance(e, k8s_config.ConfigException | OSError) else f"{type(e).__name__}: {e}"
            raise AdapterError(f"site {self.name}: cannot load Kubernetes credentials ({why}); set adapter.kubeconfig "
                               "and adapter.context, or adapter.in_cluster: true inside the cluster") from e
        return k8s.ApiClient(configuration)

    # --- API calls: a timeout on each, retries on transient errors ---


    async def _call(self, what: str, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        timeout = self.config.request_timeout_s
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(self.config.retries),
                                               wait=wait_exponential(multiplier=0.2, max=5),
                                               retry=retry_if_exception(_transient), reraise=True):
                with attempt:
                    async with asyncio.timeout(timeout + 1):
                        return await fn(*args, _request_timeout=timeout, **kwargs)
        except k8s.ApiException:
            raise
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            raise AdapterError(f"site {self.name}: {what} failed: {e!r}") from e
        raise AssertionError("unreachable")

    async def _json(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Call a ``*_without_preload_content`` method and decode its JSON (no client-side model checks). The
        answer's ``Date`` header tells how far the API server's clock is from the adapter's (``_cluster_time``)."""
        async def call(*a: Any, **kw: Any) -> Any:
            sent = self._clock.now()
            resp = await fn(*a, **kw)
            try:
                headers = getattr(resp, "headers", None)
                self._cluster_time.observe(headers.get("Date") if headers is not None else None, sent,
                                           self._clock.now())
                if resp.status >= 400:
                    raise k8s.ApiException(status=resp.status, reason=_refusal(resp.status, await resp.text()))
                return await resp.json()
            finally:
                resp.release()
        return await self._call(what, call, *args, **kwargs)

    async def _text(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any, last_bytes: int,
                    **kwargs: Any) -> tuple[bytes, bool]:
        """As :meth:`_json`, for an answer that is text (a Pod's log): its last ``last_bytes`` bytes, read as it
        comes (no more than twice that held at once), and whether bytes before them were left out."""
        async def call(*a: Any, **kw: Any) -> tuple[bytes, bool]:
            resp = await fn(*a, **kw)
            try:
                if resp.status >= 400:
                    raise k8s.ApiException(status=resp.status, reason=_refusal(resp.status, await resp.text()))
                kept, dropped = bytearray(), False
                async for chunk in resp.content.iter_chunked(1 << 16):
                    kept += chunk
                    if len(kept) > 2 * last_bytes + (1 << 16):
                        del kept[:len(kept) - last_bytes]
                        dropped = True
                if len(kept) > last_bytes:
                    del kept[:len(kept) - last_bytes]
                    dropped = True
                return bytes(kept), dropped
            finally:
                resp.release()
        return await self._call(what, call, *args, **kwargs)

    @property
    def _client(self) -> k8s.ApiClient:
        """The API client :meth:`start` made. Without one (credentials that could not be loaded, or a closed
        adapter) every call fails with the reason, rather than go out through the library's default client:
        that one points at no cluster, fails with a bare invalid-URL error and leaves its HTTP session open."""
        if self._api is None:
            raise AdapterError(self._no_client or f"site {self.name}: the adapter has no connection to the "
                                                  "cluster (not started, or closed)")
        return self._api

    @property
    def _core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self._client)

    @property
    def _batch(self) -> k8s.BatchV1Api:
        return k8s.BatchV1Api(self._client)

    async def _refused_why(self, namespace: str, job: str) -> str | None:
        """The message of the Job's latest ``FailedCreate`` Event (the Job controller's: Pod Security admission,
        a LimitRange or a ResourceQuota refused its Pod), or None: none recorded, or the Events cannot be read (the
        site's RBAC without ``list`` on events, logged once)."""
        try:
            data = await self._json("reading a Job's Events", self._core.list_namespaced_event_without_preload_content,
                                    namespace, field_selector=f"involvedObject.kind=Job,involvedObject.name={job}")
        except (k8s.ApiException, AdapterError) as e:
            if not self._events_unread:
                self._events_unread = True
                log.warning("site %s: cannot read the Events of Job %s/%s (%s); a Job the cluster makes no Pod for is "
                            "withdrawn without the cluster's reason (grant list on events)", self.name, namespace,
                            job, e.reason if isinstance(e, k8s.ApiException) else e)
            return None
        failed = [e for e in data.get("items") or [] if e.get("reason") == "FailedCreate" and e.get("message")
                  and (e.get("involvedObject") or {}).get("name") == job
                  and (e.get("involvedObject") or {}).get("kind", "Job") == "Job"]
        if not failed:
            return None
        latest = max(failed, key=lambda e: _timestamp(e.get("lastTimestamp") or e.get("eventTime")
                                                      or (e.get("metadata") or {}).get("creationTimestamp")) or 0.0)
        return _short_message(str(latest["message"]))

    def namespace(self, tenant: str) -> str:
        """The tenant's namespace: ``namespace_prefix`` + tenant. A namespace name is at most 63 characters (an
        RFC 1123 label); a longer one keeps the first characters of the tenant and ends in ``-`` and 8 hex
        digits of its SHA-256, as ``job_name`` does (so tenants that share a long beginning stay apart)."""
        name = self.config.namespace_prefix + tenant
        if len(name) <= 63:
            return name
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:8]
        kept = tenant[:63 - len(self.config.namespace_prefix) - 9].rstrip("-")
        return f"{self.config.namespace_prefix}{kept}-{digest}"

    def _ours(self, obj: dict[str, Any]) -> bool:
        """The label selector again, client-side (an emulator may ignore it)."""
        return ((obj.get("metadata") or {}).get("labels") or {}).get(SITE_LABEL) == _label_value(self.name)

    # --- inventory ---

    async def _refresh_inventory(self) -> None:
        """Read the Nodes (and, at most every ``pods_ttl_s``, the Pods); rebuild the ledgers when the node groups
        changed, re-entering what runs here; keep the GPUs of Pods outside heliotrope out of them."""
        try:
            data = await self._json("listing Nodes", self._core.list_node_without_preload_content)
        except k8s.ApiException as e:
            raise AdapterError(f"site {self.name}: listing Nodes failed ({e.status}: {e.reason})") from e
        nodes: list[NodeGpus] = []
        left_out = []
        for item in data.get("items") or []:
            found = read_node(item, self.config.tolerations, self.config.node_selector)
            if isinstance(found, str):
                left_out.append(found)
            else:
                nodes.append(found)
        self.left_out = left_out
        self._products = {}
        for n in nodes:
            self._products.setdefault((n.model, n.single), set()).add(n.product)
        self._single = {n.name: n.single for n in nodes if n.single is not None}
        await self._follow_layout()
        await self._read_pods()
        groups = node_groups(nodes)
        node_map = inventory_nodes(nodes)
        # (the same groups of other Nodes, one replacing another alike, is a new inventory: the Pods on the new
        # ones are placed by their Nodes' names)
        if groups == self._groups and node_map == self._node_map and self._admission is not None:
            self._sync_foreign()
            return
        self._groups = groups
        self._node_map = node_map
        self._single_inv = {inv for node in self._single for inv in self._node_map.get(node, ())}
        self._node_model = {n.name: n.model for n in nodes}
        self._foreign_held = {}
        if self._admission is not None:
            self._history = self._admission.book
        if not groups:
            self._admission = None
            return
        spec = self.spec.model_copy(update={"gpus": groups, "usd_per_gpu_hour": {}})
        self._admission = SiteAdmission(spec, self._overrides.apply(self.spec.quotas))
        log_beyond_site(self.name, self._admission.book)
        self._sync_foreign()  # first: those GPUs are taken, whatever heliotrope's ledgers say
        live = [a for a in self._attempts.values()
                if not a.done and not a.released and a.req is not None and a.ask is not None]
        for a in self._attempts.values():
            a.admitted = False
        for a in sorted(live, key=lambda a: a.started or 0.0):
            self._reenter(a)
        # the tenants' past usage, not only what runs now, decides their fair shares: the last ledgers', or (the
        # first since the start) what the site kept before its restart
        if self._history is not None:
            self._admission.book.take_usage(self._history, self._clock.now().timestamp())
        elif not self._usage_restored:
            self._usage.restore(self._admission.book, self._clock.now().timestamp(), self._usage_in_cluster,
                                self._cluster_usage.where if self._cluster_usage is not None else "")
            self._usage_in_cluster = None
        self._usage_restored = True

    def _reenter(self, a: _Attempt) -> None:
        """Enter a running attempt into fresh ledgers: on its Pod's Node, else anywhere on its model. One the
        inventory cannot place (its Node vanished) still counts against its tenant's quota."""
        assert self._admission is not None and a.req is not None and a.ask is not None
        key, model = _key(a.job_id, a.attempt), a.ask.model
        inventory = self._admission.inventory
        placement = None
        if model in inventory.capacity():
            if a.node is not None:
                placement = place_on(inventory, a.req, model, self._node_map.get(a.node, ()))
            else:
                found = inventory.find(a.req, model)
                placement = found if not isinstance(found, str) else None
        started = a.started if a.started is not None else self._clock.now().timestamp()
        ask = a.ask
        if model in inventory.capacity():
            ask = dataclasses.replace(ask, gpus=inventory.charge(a.req, model))
        a.admitted = True
        if placement is not None:
            self._admission.start(key, Admitted(placement, ask), started)
            return
        where = f"Node {a.node}" if a.node is not None else f"any {model} Node"
        try:
            self._admission.book.start(ask, started)
        except ValueError as e:
            log.warning("site %s: job %s (Job %s/%s) no longer fits %s, and its quota cannot count it: %s",
                        self.name, a.job_id, a.namespace, job_name(a.job_id, a.attempt), where, e)
            return
        log.warning("site %s: job %s (Job %s/%s) does not fit %s in the inventory; counted by its tenant's quota "
                    "only", self.name, a.job_id, a.namespace, job_name(a.job_id, a.attempt), where)

    async def _read_pods(self) -> None:
        """The Pods holding GPUs on a Node: those outside this site (``_foreign``) and the Nodes of ours.
        Cached for ``pods_ttl_s``: a snapshot lists the Nodes anyway, and the Pods of a large cluster cost more."""
        now = time.monotonic()
        if self._pods_read_at is not None and now - self._pods_read_at < self.pods_ttl_s:
            return
        try:
            data = await self._json("listing Pods", self._core.list_pod_for_all_namespaces_without_preload_content,
                                    field_selector="status.phase!=Succeeded,status.phase!=Failed")
        except k8s.ApiException as e:
            raise AdapterError(f"site {self.name}: listing Pods failed ({e.status}: {e.reason})") from e
        self._pods_read_at = now
        foreign: dict[str, tuple[str, GpuRequest]] = {}
        for pod in data.get("items") or []:
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            node, phase = spec.get("nodeName"), (pod.get("status") or {}).get("phase")
            if not node or phase not in ("Pending", "Running"):
                continue
            ours = self._ours(pod)
            key = attempt_key(meta) if ours else None
            orphan = key is not None and key in self._attempts and self._attempts[key].orphan
            if ours and not orphan:
                if key is not None and key in self._attempts:
                    self._attempts[key].node = node
            elif (req := pod_gpus(pod)) is not None:  # not ours, or ours without its Job: not in the ledgers
                foreign[f"pod:{meta.get('namespace')}/{meta.get('name')}"] = (node, req)
        self._foreign = foreign

    def _sync_foreign(self) -> None:
        """Hold the GPUs of Pods outside heliotrope in the inventory (not in the quota book): what they take of
        their Node is not free. Where heliotrope's ledger put a job on GPUs such a Pod holds, the Pod takes
        what is left (logged)."""
        if self._admission is None:
            return
        inventory = self._admission.inventory
        for pod_id in [p for p, held in self._foreign_held.items() if self._foreign.get(p) != held]:
            inventory.release(pod_id)
            del self._foreign_held[pod_id]
        for pod_id, (node, req) in self._foreign.items():
            model = self._node_model.get(node)
            if pod_id in self._foreign_held or model is None:
                continue
            if req.mig_profile is None and node in self._single:  # its nvidia.com/gpu are MIG slices
                req = GpuRequest(count=req.count, mig_profile=self._single[node])
            placement = place_on(inventory, req, model, self._node_map.get(node, ()), partial=True)
            if placement is None or len(placement.slots) < req.count:
                log.warning("site %s: Pod %s holds %s on Node %s, where the ledger has %s free", self.name,
                            pod_id[4:], gpu_resources(req), node, len(placement.slots) if placement else 0)
            if placement is not None:
                inventory.commit(pod_id, placement)
            self._foreign_held[pod_id] = (node, req)

    async def _adopt(self) -> None:
        """Jobs of this site already in the cluster (a broker restart): known, so cancel and events work, and
        the active ones are re-entered into the ledgers (by ``_refresh_inventory``) with their GPUs, tenant
        and start time, so capacity and quotas count them."""
        for obj in await self._list_jobs():
            meta = obj["metadata"]
            key = attempt_key(meta)
            if key is None:
                continue
            labels = meta.get("labels") or {}
            a = self._attempts.setdefault(key, _Attempt(key[0], key[1], labels.get(TENANT_LABEL, ""),
                                                        meta.get("namespace", "")))
            a.has_job = True
            if a.ask is None and not job_ended(obj.get("status") or {}):
                self._adopt_ask(a, obj)

    async def _adopt_pods(self) -> None:
        """The Pods of this site already in the cluster (a broker restart).

        A Running Pod of an adopted Job: the attempt has run since the Pod's ``status.startTime`` (so a job
        preempted later keeps the run time it had before the restart), and ``running`` is reported once, at that
        time (the broker ignores it if it knew; the watch does not report it again).

        Pods whose Job is gone (a stop under way when the broker before this one stopped: its Job deleted, its
        Pods still writing their checkpoint): known as stopping, so that the broker does not take the attempt
        for lost and start the job elsewhere meanwhile (``known_attempts``), their GPUs held (``_read_pods``),
        and ``preempted`` reported once their last Pod goes, or after ``stop_wait_s``."""
        try:
            data = await self._json("listing Pods", self._core.list_pod_for_all_namespaces_without_preload_content,
                                    label_selector=f"{SITE_LABEL}={_label_value(self.name)}")
        except k8s.ApiException as e:
            raise AdapterError(f"site {self.name}: listing Pods failed ({e.status}: {e.reason})") from e
        for pod in data.get("items") or []:
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            key = attempt_key(meta)
            if not self._ours(pod) or key is None or status.get("phase") not in ("Pending", "Running"):
                continue
            if key in self._attempts:
                self._adopt_pod(self._attempts[key], pod)
                continue
            labels = meta.get("labels") or {}
            a = self._attempts[key] = _Attempt(key[0], key[1], labels.get(TENANT_LABEL, ""), meta.get("namespace", ""),
                                               orphan=True, released=True, pods={meta.get("name", "")})
            if status.get("phase") == "Running":  # what it ran, as far as the site knows (a Pending one ran nothing)
                started = _timestamp(status.get("startTime"))
                a.running_since = (datetime.fromtimestamp(started, tz=UTC) if started is not None
                                   else self._clock.now())
            a.stopping = "stopped: its Job was deleted before this site's adapter started"
            log.info("site %s: the Pods of %s attempt %d outlive their Job (a stop under way); reported "
                     "preempted once they have gone", self.name, key[0], key[1])
            self._wait_for_pods(key)

    def _adopt_pod(self, a: _Attempt, pod: dict[str, Any]) -> None:
        """A live Pod of an adopted Job: where it runs, and, if Running, since when (``running`` reported)."""
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if a.done or a.orphan:
            return
        a.pods.add(meta.get("name", ""))
        a.had_pod = True
        if node := (pod.get("spec") or {}).get("nodeName"):
            a.node = node
        if status.get("phase") != "Running" or a.running_since is not None:
            return
        started = _timestamp(status.get("startTime"))
        a.running_since = datetime.fromtimestamp(started, tz=UTC) if started is not None else self._clock.now()
        self._events.put_nowait(JobEvent(a.job_id, a.attempt, EventKind.RUNNING, a.running_since))

    async def _join_cluster_stops(self) -> None:
        """With ``state_namespace``: the stops kept in the cluster (a broker replica with another state folder
        may have begun them) are joined to the file's, before ``_adopt_stops``; the file's that the cluster
        lacks are queued to be written there, and so is each change from now on. A ConfigMap that cannot be
        read leaves the file's alone (logged by ``ClusterStops.read``)."""
        if self._cluster_stops is None:
            return
        found = await self._cluster_stops.read()
        if found is not None:
            joined = self._journal.merge(found)
            if joined:
                log.info("site %s: %d stop(s) not yet reported found in %s, begun by another adapter: %s",
                         self.name, len(joined), self._cluster_stops.where,
                         ", ".join(f"{s.job_id} attempt {s.attempt}" for s in joined))
        there = {(s.job_id, s.attempt) for s in found or ()}
        for key, kept in self._journal.items():
            if key not in there:
                self._cluster_stops.put(key, kept)
        self._journal.listener = self._cluster_stops.put

    def _adopt_stops(self) -> None:
        """Stops the adapter before this one began whose ``preempted`` the broker never took (``StopJournal``):
        one whose Pods are still there is reported once they go (``_adopt_pods``), with the reason it was
        stopped for; one of which nothing is left in the cluster ended while no adapter watched, and is
        reported now, with its run up to the stop. One whose Job is still there never took (its deletion
        failed): it runs on, and is forgotten."""
        for key, kept in self._journal.items():
            a = self._attempts.get(key)
            if a is not None and a.orphan:
                a.stopping = kept.reason
                continue
            if a is not None:
                log.warning("site %s: %s attempt %d, whose stop began at %s, still has its Job (its deletion did "
                            "not take); it runs on, or its own outcome stands", self.name, key[0], key[1],
                            kept.at.isoformat())
                self._journal.remove(key)
                continue
            self._attempts[key] = _Attempt(key[0], key[1], "", "", done=True, released=True, stopping=kept.reason)
            self._withdrawn[key] = kept.at
            log.info("site %s: %s attempt %d, whose stop began at %s, has gone from the cluster meanwhile; "
                     "reported preempted after %.0f s running", self.name, key[0], key[1], kept.at.isoformat(),
                     kept.run_s)
            self._events.put_nowait(JobEvent(key[0], key[1], EventKind.PREEMPTED, kept.at, reason=kept.reason,
                                             run_s=kept.run_s))

    def _adopt_ask(self, a: _Attempt, obj: dict[str, Any]) -> None:
        found = job_ask(obj, _key(a.job_id, a.attempt), a.tenant)
        if isinstance(found, str):
            log.warning("site %s: %s; not counted", self.name, found)
        else:
            a.req, a.ask, a.started = found

    async def _list_jobs(self) -> list[dict[str, Any]]:
        try:
            data = await self._json("listing Jobs", self._batch.list_job_for_all_namespaces_without_preload_content,
                                    label_selector=f"{SITE_LABEL}={_label_value(self.name)}")
        except k8s.ApiException as e:
            raise AdapterError(f"site {self.name}: listing Jobs failed ({e.status}: {e.reason})") from e
        return [j for j in data.get("items") or [] if self._ours(j)]

    # --- CapacityReporter ---

    async def snapshot(self) -> SiteState:
        await self._refresh_inventory()
        now = self._clock.now()
        running = sum(1 for a in self._attempts.values() if not a.done and not a.released)
        if self._admission is None:
            reason = "; ".join(self.left_out) or "the cluster has no Nodes"
            return SiteState(site=self.name, health=Health.UNHEALTHY, last_heard_at=now, running_jobs=running,
                             reason=f"no usable GPU nodes: {reason}"[:1000])
        inventory = self._admission.inventory
        memory_kib = sum(u.memory_kib for u in inventory.usage().values())
        state = SiteState(
            site=self.name, health=Health.HEALTHY, last_heard_at=now,
            capacity=[f.capacity() for _, f in sorted(inventory.free().items())],
            telemetry=Telemetry(memory_total_gib=round(memory_kib / (1 << 20), 2), queue_depth=0),
            running_jobs=running,
            quota=self._admission.report(now.timestamp()),
        )
        self._usage.save(self._admission.book, now.timestamp())
        return self.telemetry.overlay(state) if self.telemetry is not None else state

    # --- JobRunner ---

    async def submit(self, job: Job) -> Admission:
        key = (job.id, job.attempt)
        async with self._lock:
            if key in self._withdrawn:
                return Admission.rejected(f"attempt {job.attempt} was withdrawn" if key in self._attempts
                                          else f"attempt {job.attempt} was withdrawn or has ended")
            known = self._attempts.get(key)
            if known is not None and known.admitted:
                return Admission.ok()
            if job.spec.gpus.fractional:
                return Admission.rejected("this Kubernetes site hands out whole GPUs or MIG slices only (the NVIDIA "
                                          "device plugin); ask for whole GPUs or a mig_profile")
            await self._refresh_inventory()
            if self._admission is None:
                return Admission.rejected(f"site {self.name} has no usable GPU nodes: {'; '.join(self.left_out)}")
            namespace = self.namespace(job.spec.tenant)
            now = self._clock.now().timestamp()
            existing = await self._get_job(namespace, job_name(job.id, job.attempt))
            decision = self._admission.admit(_key(*key), _as_pod(job).spec, now, model=job.gpu_model)
            if existing is None:
                if not isinstance(decision, Admitted):
                    return Admission.rejected(decision.reason)
                # The Job first: a cluster that refuses it (no namespace, RBAC, an admission webhook) must not
                # have its victims stopped for nothing. Its Pod waits in the cluster until their GPUs are free.
                single = any(slot.node in self._single_inv for slot in decision.placement.slots)
                admission = await self._create_job(job, namespace, decision.placement.model, single)
                if not admission.admitted:
                    return admission
                if key in self._withdrawn:  # withdrawn while its Job was made: stop nobody for it (see below)
                    return await self._drop_withdrawn(job, namespace)
                for victim in decision.victims:
                    await self._preempt(victim, f"for job {job.id} of tenant {job.spec.tenant}, which "
                                                f"{decision.reason}")
            if key in self._withdrawn:  # (while its victims were being stopped)
                return await self._drop_withdrawn(job, namespace)
            attempt = self._attempts.setdefault(key, _Attempt(job.id, job.attempt, job.spec.tenant, namespace))
            attempt.job, attempt.has_job = job, True
            if attempt.done:  # its Job ended while the victims were being stopped (the watch reported it):
                attempt.admitted = True  # nothing of it is left to hold in the ledgers
                return Admission.ok()
            if isinstance(decision, Admitted):
                attempt.req, attempt.ask, attempt.started = _as_pod(job).spec.gpus, decision.ask, now
            if isinstance(decision, Admitted) and (existing is None or not decision.victims):
                self._admission.start(_key(*key), decision, now)
            # else the Job exists already (a repeated dispatch): it holds its GPUs whatever the ledgers say
            attempt.admitted = True
            return Admission.ok()

    async def _drop_withdrawn(self, job: Job, namespace: str) -> Admission:
        """An attempt withdrawn while it was being admitted (cancel takes no lock, and found no Job to delete
        then): its Job is deleted and the submit refused. Admitted, it would run with nobody to stop it, since
        the broker counts it withdrawn."""
        key = (job.id, job.attempt)
        await self._delete_job(key, _Attempt(job.id, job.attempt, job.spec.tenant, namespace))
        self._finish(key)
        self._forget(key)
        return Admission.rejected(f"attempt {job.attempt} was withdrawn while it was being dispatched")

    async def _get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._json("reading a Job", self._batch.read_namespaced_job_without_preload_content,
                                    name, namespace)
        except k8s.ApiException as e:
            if e.status == 404:
                return None
            raise AdapterError(f"site {self.name}: reading Job {namespace}/{name} failed ({e.status})") from e

    def job_manifest(self, job: Job, namespace: str, model: str, single: bool = False) -> dict[str, Any]:
        """The Job for an attempt on GPUs of ``model``. ``single``: its MIG slices are on Nodes of the device
        plugin's single strategy, which advertise them as ``nvidia.com/gpu`` (its affinity is to those Nodes'
        product labels); else it asks ``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>`` on Nodes of the
        model's plain product label."""
        labels = {SITE_LABEL: _label_value(self.name), JOB_LABEL: _label_value(job.id),
                  ATTEMPT_LABEL: str(job.attempt), TENANT_LABEL: job.spec.tenant}
        annotations = {JOB_ANNOTATION: job.id, ASK_ANNOTATION: json.dumps({
            "priority": job.spec.priority, "preemptible": job.spec.preemptible, "min_run_s": job.spec.min_run_s,
            "checkpointable": job.spec.checkpointable})}
        profile = job.spec.gpus.mig_profile if single else None
        resources = {GPU: str(job.spec.gpus.count)} if profile is not None else gpu_resources(job.spec.gpus)
        container: dict[str, Any] = {
            "name": "job", "image": self.config.image,
            "resources": {"limits": resources, "requests": dict(resources)},
            "env": [{"name": "HELIOTROPE_JOB_ID", "value": job.id},
                    {"name": "HELIOTROPE_ATTEMPT", "value": str(job.attempt)}],
        }
        if self.config.command:
            container["command"] = list(self.config.command)
        pod_security, container_security = self.config.security_contexts()
        if container_security:
            container["securityContext"] = container_security
        products = sorted(self._products.get((model, profile), ()))
        pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
        if pod_security:  # pod_security, pod_security_context: a namespace enforcing Pod Security admits it
            pod_spec["securityContext"] = pod_security
        if job.spec.checkpointable:
            # A stop waits up to stop_wait_s for its Pods to write their checkpoint and go: the kubelet's
            # default of 30 s killed a checkpoint being written, while the broker kept the run as saved.
            pod_spec["terminationGracePeriodSeconds"] = grace_period_s(self.config.stop_wait_s)
        if self.config.tolerations:
            pod_spec["tolerations"] = [t.manifest() for t in self.config.tolerations]
        if self.config.node_selector:
            pod_spec["nodeSelector"] = dict(self.config.node_selector)
        if products:
            pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": PRODUCT_LABEL, "operator": "In", "values": products}]}]}}}
        return {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job_name(job.id, job.attempt), "namespace": namespace, "labels": labels,
                         "annotations": annotations},
            "spec": {"backoffLimit": 0, "podFailurePolicy": POD_FAILURE_POLICY, "template": {
                "metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}},
        }

    async def _create_job(self, job: Job, namespace: str, model: str, single: bool = False) -> Admission:
        manifest = self.job_manifest(job, namespace, model, single)
        try:
            await self._json("creating a Job", self._batch.create_namespaced_job_without_preload_content,
                             namespace, manifest)
        except k8s.ApiException as e:
            if e.status == 409:
                return Admission.ok()  # made by a concurrent dispatch of the same attempt
            if e.status == 404:
                return Admission.rejected(f"namespace {namespace} does not exist at site {self.name}; create it "
                                          f"(one namespace per tenant, named {self.config.namespace_prefix}<tenant>, "
                                          "shortened with a hash past 63 characters)")
            if e.status in (403, 422):
                return Admission.rejected(f"the cluster refused Job {namespace}/{manifest['metadata']['name']} "
                                          f"({e.status}): {e.reason}")
            raise AdapterError(f"site {self.name}: creating Job {namespace}/{manifest['metadata']['name']} failed "
                               f"({e.status}: {e.reason})") from e
        return Admission.ok()

    async def cancel(self, job_id: str, attempt: int) -> None:
        key = (job_id, attempt)
        self._withdrawn[key] = self._clock.now()  # final: a submit of it, now or later, is refused
        self._forget_old_tombstones()
        known = self._attempts.get(key)
        await self._delete_job(key, known)
        self._finish(key)
        self._journal.remove(key)  # cancelled: no stop of it is reported any more
        self._forget(key)  # (an event of it not yet taken finds its Job deleted already)

    async def _delete_job(self, key: tuple[str, int], known: _Attempt | None) -> None:
        namespaces = [known.namespace] if known is not None and known.namespace else []
        if not namespaces:  # not dispatched from this process: find it by its labels
            namespaces = [j["metadata"].get("namespace", "") for j in await self._list_jobs()
                          if (j["metadata"].get("annotations") or {}).get(JOB_ANNOTATION) == key[0]
                          and (j["metadata"].get("labels") or {}).get(ATTEMPT_LABEL) == str(key[1])]
        for namespace in namespaces:
            try:
                await self._json("deleting a Job", self._batch.delete_namespaced_job_without_preload_content,
                                 job_name(*key), namespace, propagation_policy="Background")
            except k8s.ApiException as e:
                if e.status != 404:
                    raise AdapterError(f"site {self.name}: deleting Job {namespace}/{job_name(*key)} failed "
                                       f"({e.status}: {e.reason})") from e

    async def preempt(self, job_id: str, attempt: int, reason: str) -> None:
        """The broker's request to checkpoint and stop a running attempt (``Preempter``): its Job is deleted
        (its Pods get SIGTERM and their terminationGracePeriodSeconds to write a checkpoint), and the
        ``preempted`` event, with how long it ran, is sent once the watch has seen its last Pod go (or after
        ``stop_wait_s``): the broker restarts the job elsewhere only when it has stopped here."""
        key = (job_id, attempt)
        known = self._attempts.get(key)
        if known is None or known.done or known.stopping is not None:
            return  # not this process's, it ended (its own event stands), or it is being stopped
        self._withdrawn[key] = self._clock.now()
        known.stopping = reason
        self._journal.add(key, reason, known.running_since, self._clock.now())
        await self._delete_job(key, known)
        if not known.pods:
            self._stopped(key)
            return
        self._wait_for_pods(key)

    def _wait_for_pods(self, key: tuple[str, int]) -> None:
        """Report a stopping attempt when its last Pod goes (the watch), or after ``stop_wait_s``."""
        task = asyncio.get_running_loop().create_task(self._stop_deadline(key), name=f"k8s-stop-{key[0]}")
        self._stop_waits.add(task)
        task.add_done_callback(self._stop_waits.discard)

    async def _stop_deadline(self, key: tuple[str, int]) -> None:
        await asyncio.sleep(self.config.stop_wait_s)
        known = self._attempts.get(key)
        if known is not None and not known.done:
            log.warning("site %s: the Pods of %s attempt %d were still there %.0f s after its Job was deleted; "
                        "reported stopped all the same", self.name, key[0], key[1], self.config.stop_wait_s)
            self._stopped(key)

    def _stopped(self, key: tuple[str, int]) -> None:
        """A stop (one the broker asked for, or the site's own preemption) is done: the GPUs are free, and the
        broker hears ``preempted``."""
        known = self._attempts.get(key)
        if known is None or known.stopping is None:
            return
        now = self._clock.now()
        run_s = max((now - known.running_since).total_seconds(), 0.0) if known.running_since is not None else 0.0
        if self._finish(key):
            self._events.put_nowait(JobEvent(key[0], key[1], EventKind.PREEMPTED, now, reason=known.stopping,
                                             run_s=run_s))

    async def _preempt(self, victim: str, reason: str) -> None:
        """The site's own preemption (its quotas, for a job of higher priority or a tenant reclaiming its
        guarantee): the victim's Job is deleted and its GPUs and quota go to the preemptor in the ledgers at
        once (its Pod waits in the cluster until they are free), but the broker hears ``preempted`` only once
        the watch has seen the victim's last Pod go (or after ``stop_wait_s``), as for a stop it asked for: a
        checkpointing job is never started again elsewhere while it still writes its checkpoint here."""
        job_id, _, attempt_s = victim.rpartition("/")
        key = (job_id, int(attempt_s))
        known = self._attempts.get(key)
        self._withdrawn[key] = self._clock.now()
        if known is not None and not known.done and known.stopping is None:
            self._journal.add(key, reason, known.running_since, self._clock.now())
        await self._delete_job(key, known)
        if known is not None and not known.done and known.pods:
            self._release(key)
            known.released = True
            if known.stopping is None:
                known.stopping = reason
                self._wait_for_pods(key)
            # else the broker had asked to stop it already: that stop is reported once its Pods are gone
            return
        run_s = 0.0
        if known is not None and known.running_since is not None:
            run_s = max((self._clock.now() - known.running_since).total_seconds(), 0.0)
        if self._finish(key):
            self._events.put_nowait(JobEvent(job_id, key[1], EventKind.PREEMPTED, self._clock.now(), reason=reason,
                                             run_s=run_s))

    def _finish(self, key: tuple[str, int]) -> bool:
        """The attempt ended: free its GPUs and quota. False if it had ended already."""
        known = self._attempts.get(key)
        if known is not None and known.done:
            return False
        if known is not None:
            known.done = True
            if known.stopping is not None:
                self._stop_ended = self._cluster_time.now()
            if known.released:  # its ledgers were freed when it was preempted
                return True
        self._release(key)
        return True

    def _release(self, key: tuple[str, int]) -> None:
        """Free an attempt's GPUs and quota in the site's ledgers. While there are none (every Node away), its end
        is told to the last ledgers' book, whose usage history the next ledgers take (``_history``): it ran until
        now, not until the Nodes come back."""
        now = self._clock.now().timestamp()
        if self._admission is not None:
            if self._admission.stop(_key(*key), now) is None:
                with contextlib.suppress(KeyError):  # counted by quota only (its Node had gone), or not at all
                    self._admission.book.stop(_key(*key), now)
        elif self._history is not None:
            with contextlib.suppress(KeyError):  # (not in that book: entered after it, or ended already)
                self._history.stop(_key(*key), now)

    def _forget(self, key: tuple[str, int]) -> None:
        """An attempt that is over, its outcome taken (or cancelled) and its Job deleted, is no longer kept: a
        tombstone in ``_withdrawn`` refuses a repeated dispatch of it and has the watch ignore its Job's and Pods'
        last events (``TOMBSTONE_TTL_S``), so the attempts known here do not grow with each attempt ever run."""
        known = self._attempts.get(key)
        if known is None or not known.done:
            return
        self._withdrawn.setdefault(key, self._clock.now())
        del self._attempts[key]
        if (task := self._unplaced.pop(key, None)) is not None:
            task.cancel()
        self._forget_old_tombstones()

    def _forget_old_tombstones(self) -> None:
        if len(self._withdrawn) < 1024:
            return
        cutoff = self._clock.now() - timedelta(seconds=TOMBSTONE_TTL_S)
        for key in [k for k, at in self._withdrawn.items() if at < cutoff]:
            del self._withdrawn[key]

    # --- LogReader ---

    async def _keep_log(self, key: tuple[str, int]) -> None:
        """Before an ended attempt's Job and Pods are deleted: keep the end of its log (``ENDED_LOG_LINES``, at
        most ``ENDED_LOG_BYTES``) among the latest ended attempts' (``ENDED_LOGS_BYTES`` in all), so its logs can
        still be read, from this adapter's memory and its state folder (:mod:`adapters.kept_logs`). A log that
        cannot be read now is not kept (logged at debug)."""
        try:
            async with asyncio.timeout(ENDED_LOG_READ_S):
                kept = await self.logs(key[0], key[1], ENDED_LOG_LINES, ENDED_LOG_BYTES)
        except (AdapterError, TimeoutError) as e:
            log.debug("site %s: the log of attempt %d of job %s was not kept before its Job was deleted: %s",
                      self.name, key[1], key[0], e)
            return
        await self._ended_logs.put(key, KeptLog(kept.text.encode(), kept.truncated, kept.source), ENDED_LOGS_BYTES)

    async def logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
        """The log of the attempt's newest Pod's container (:mod:`adapters.kubernetes_logs`); for an attempt that
        ended and whose Job was deleted, the end of it this adapter kept (``_keep_log``)."""
        ended = self._ended_logs.get((job_id, attempt))
        if ended is not None:
            text, cut = tail_text(ended.data.decode(), tail_lines, limit_bytes)
            return JobLogs(text, ended.truncated or cut, f"{ended.source} (kept when its Job was deleted)")
        name, namespace, container, source = await self._attempt_pod(job_id, attempt)
        raw, dropped = await self._read_log(name, namespace, container, source, tail_lines, limit_bytes)
        return kubernetes_logs.as_logs(raw, dropped, tail_lines, limit_bytes, source)

    async def _attempt_pod(self, job_id: str, attempt: int) -> tuple[str, str, str | None, str]:
        """The attempt's newest Pod: its name, namespace, the container whose log is read, and those in words."""
        site, job_label = _label_value(self.name), _label_value(job_id)
        what = f"attempt {attempt} of job {job_id}"
        try:
            data = await self._json("listing an attempt's Pods", self._core.list_pod_for_all_namespaces_without_preload_content,
                                    label_selector=kubernetes_logs.attempt_selector(site, job_label, attempt))
        except k8s.ApiException as e:
            raise AdapterError(f"site {self.name}: listing the Pods of {what} failed ({e.status}: {e.reason})") from e
        pod = kubernetes_logs.newest_pod(data.get("items") or [], site, job_id, job_label, attempt)
        if pod is None:
            raise LogsNotFound(f"site {self.name} has no Pod of {what}: it has not been made yet, or it was deleted "
                               "(the Job of an attempt that ended is deleted, with its Pods, once the broker has its "
                               "outcome; the end of its log is kept then, unless it could not be read, the attempt "
                               "was stopped or lost, or the adapter restarted since without a state_dir)")
        meta = pod.get("metadata") or {}
        tenant = (meta.get("labels") or {}).get(TENANT_LABEL, "")
        name, namespace = meta.get("name") or "", meta.get("namespace") or self.namespace(tenant)
        container = kubernetes_logs.container_of(pod)
        return name, namespace, container, f"pod {namespace}/{name}" + (f" container {container}" if container else "")

    async def _read_log(self, name: str, namespace: str, container: str | None, source: str, tail_lines: int | None,
                        limit_bytes: int) -> tuple[bytes, bool]:
        """The end of a Pod's log: its last ``limit_bytes`` of the last ``tail_lines`` lines, and whether bytes before
        them were left out."""
        try:
            # (not the API server's limitBytes: it stops its answer after that many bytes, so it would keep the start
            # of the tail, not its end)
            return await self._text("reading a Pod's log", self._core.read_namespaced_pod_log_without_preload_content,
                                    name, namespace, container=container, tail_lines=tail_lines,
                                    last_bytes=max(limit_bytes, 0))
        except k8s.ApiException as e:
            raise self._log_refused(e, source) from e

    def _log_refused(self, e: k8s.ApiException, source: str) -> AdapterError:
        if e.status in (400, 404):  # the container waits to start, or the Pod has just gone
            return LogsNotFound(f"site {self.name}: {source} has no log ({e.reason})")
        if e.status == 403:
            return LogsUnsupported(f"the cluster refused to give the log of {source} ({e.reason}): grant the "
                                   "site's credentials get on pods/log")
        return AdapterError(f"site {self.name}: reading the log of {source} failed ({e.status}: {e.reason})")

    # --- LogFollower ---

    async def follow_logs(self, job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> LogFollow:
        """The log of the attempt's newest Pod's container followed, as ``kubectl logs -f`` does: the API server's
        ``follow`` read, relayed as it comes until the kubelet ends it (the container has ended, or the Pod gone).
        It is read once without ``follow`` first, as :meth:`logs` reads it: that says whether lines before the tail
        were left out, and, where the tail is longer than ``limit_bytes``, how many of its lines fit them, which the
        followed read then asks for (``tailLines``; the API server's ``limitBytes`` would end the stream). An
        attempt whose Job was deleted: the end of its log kept then, and the end."""
        ended = self._ended_logs.get((job_id, attempt))
        if ended is not None:
            kept = await self.logs(job_id, attempt, tail_lines, limit_bytes)
            return LogFollow(kept.truncated, kept.source, kubernetes_logs.once(kept.text))
        name, namespace, container, source = await self._attempt_pod(job_id, attempt)
        raw, dropped = await self._read_log(name, namespace, container, source, tail_lines, limit_bytes)
        truncated = kubernetes_logs.as_logs(raw, dropped, tail_lines, limit_bytes, source).truncated
        follow_lines = kubernetes_logs.lines_within(raw) if dropped else tail_lines
        try:
            async with asyncio.timeout(self.config.request_timeout_s + 1):
                resp = await self._core.read_namespaced_pod_log_without_preload_content(
                    name, namespace, container=container, tail_lines=follow_lines, follow=True,
                    _request_timeout=FOLLOW_MAX_S)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            raise AdapterError(f"site {self.name}: following the log of {source} failed: {e!r}") from e
        if resp.status >= 400:
            try:
                refusal = k8s.ApiException(status=resp.status, reason=_refusal(resp.status, await resp.text()))
            finally:
                resp.release()
            raise self._log_refused(refusal, source)
        chunks = self._relay_log(resp, source)
        await anext(chunks)  # (started: closing it now closes the response)
        return LogFollow(truncated, source, chunks)

    async def _relay_log(self, resp: Any, source: str) -> AsyncGenerator[str, None]:
        """A followed log's bytes as text, chunk by chunk as they come (aiohttp's buffer bounds what is held: it
        stops reading from the API server while its buffer is full); the response is closed at the end."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            yield ""
            async for data in resp.content.iter_any():
                text = decoder.decode(data)
                if text:
                    yield text
            rest = decoder.decode(b"", final=True)
            if rest:
                yield rest
        except (aiohttp.ClientError, ConnectionError) as e:
            raise AdapterError(f"site {self.name}: following the log of {source} failed: {e!r}") from e
        finally:
            resp.close()

    # --- AttemptLookup ---

    async def known_attempts(self) -> set[tuple[str, int]]:
        """The attempts whose Jobs exist (finished ones too: their outcome comes from the watch), those being
        stopped whose Pods outlive their Job (their ``preempted`` comes once the Pods have gone), and those
        stopped whose ``preempted`` the broker has not taken yet (``StopJournal``)."""
        out = {key for key, a in self._attempts.items() if a.stopping is not None and not a.done}
        out |= self._journal.keys()
        for obj in await self._list_jobs():
            meta = obj["metadata"]
            with contextlib.suppress(ValueError):
                out.add(((meta.get("annotations") or {}).get(JOB_ANNOTATION, ""),
                         int((meta.get("labels") or {}).get(ATTEMPT_LABEL, ""))))
        return out

    # --- EventSource ---

    async def events(self) -> AsyncIterator[JobEvent]:
        while True:
            yield await self._events.get()

    def taken(self, event: JobEvent) -> None:
        """``EventReceipts``: the attempt's end is kept by the broker (or the agent's broker); a stop of it kept
        in the journal is done with, and its Job, if the cluster keeps it (one that succeeded or failed), is
        deleted in the background with its Pods: nothing reads it any more, and the Jobs and Pods of every
        attempt ever run would otherwise pile up in the tenants' namespaces and in each list of the Jobs."""
        if event.kind == EventKind.RUNNING:
            return
        key = (event.job_id, event.attempt)
        self._journal.remove(key)
        known = self._attempts.get(key)
        if known is None or not known.done:
            return
        if not known.has_job or not known.namespace or known.stopping is not None:
            self._forget(key)  # (a stopped or lost attempt's Job was deleted already, to stop it or by others)
            return

        async def delete() -> None:
            await self._keep_log(key)  # (its Pods go with it: what it printed last is kept here)
            try:
                await self._delete_job(key, known)
            except AdapterError as e:
                log.warning("%s; it stays (delete it by hand: it holds no GPUs)", e)
                return  # (known, and done, its Job's events are ignored meanwhile)
            self._forget(key)
        with contextlib.suppress(RuntimeError):  # (no running loop: nothing to clean up from)
            task = asyncio.get_running_loop().create_task(delete(), name=f"k8s-clean-{key[0]}")
            self._stop_waits.add(task)
            task.add_done_callback(self._stop_waits.discard)

    async def _watch(self, kind: str) -> None:
        """Follow Jobs or Pods of this site. Each (re)connect opens the watch, then lists them and reconciles
        what it knows with the list (``_resync``): what changed while no watch ran (a Job deleted during an API
        server restart, a stopped attempt's Pods gone) is reported then, and what changes during the list is in
        the stream, read next (the watch starts with the objects as they are, then their changes; the events
        are idempotent). When the stream ends (the server's 300 s timeout, an error, an ERROR event such as 410
        Gone) it reconnects and lists again."""
        watch = (self._batch.list_job_for_all_namespaces_without_preload_content if kind == "jobs"
                 else self._core.list_pod_for_all_namespaces_without_preload_content)
        delay = 0.2
        while True:
            try:
                resp = await watch(watch=True, label_selector=f"{SITE_LABEL}={_label_value(self.name)}",
                                   timeout_seconds=300, _request_timeout=330.0)
                try:
                    if resp.status >= 400:
                        raise k8s.ApiException(status=resp.status, reason=_refusal(resp.status, await resp.text()))
                    await self._resync(kind)
                    delay = 0.2
                    while line := await resp.content.readline():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if event.get("type") == "ERROR":  # 410 Gone (too old a resourceVersion), or another
                            status = event.get("object") or {}
                            raise k8s.ApiException(status=status.get("code") or 0, reason=status.get("message"))
                        self._on_watch_event(kind, event)
                finally:
                    resp.release()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a watch must outlive the cluster's hiccups; logged
                log.warning("site %s: watch on %s failed (%r); reconnecting in %.1fs", self.name, kind, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def _resync(self, kind: str) -> None:
        """List this site's Jobs or Pods, treat each as the watch would, and reconcile the attempts known here
        with the list: one whose Job has gone (deleted outside heliotrope while no watch ran) is ``lost``; a
        stopping one whose Pods have all gone is stopped. Under the lock that admission holds, so a Job being
        created is not taken for a gone one."""
        fn = (self._batch.list_job_for_all_namespaces_without_preload_content if kind == "jobs"
              else self._core.list_pod_for_all_namespaces_without_preload_content)
        async with self._lock:
            data = await self._json(f"listing {'Jobs' if kind == 'jobs' else 'Pods'}", fn,
                                    label_selector=f"{SITE_LABEL}={_label_value(self.name)}")
            items = [obj for obj in data.get("items") or [] if self._ours(obj)]
            listed: dict[tuple[str, int], set[str]] = {}
            for obj in items:
                key = attempt_key(obj.get("metadata") or {})
                if key is not None:
                    listed.setdefault(key, set()).add((obj.get("metadata") or {}).get("name", ""))
            for key, known in list(self._attempts.items()):
                if known.done:
                    continue
                if kind == "pods":
                    known.pods &= listed.get(key, set())
                    if not known.pods:
                        known.unplaced_since = known.stuck_since = None  # (its Pod went while no watch ran)
                    if known.stopping is not None and not known.pods:
                        self._stopped(key)  # its last Pod went while no watch ran
                elif (key not in listed and known.has_job and known.stopping is None and not known.orphan
                      and key not in self._withdrawn):
                    self._gone(key, known.namespace, job_name(*key))
            for obj in items:
                self._on_watch_event(kind, {"type": "ADDED", "object": obj})
            if kind == "pods":
                self._pods_listed = True

    def _stuck(self, key: tuple[str, int], known: _Attempt, why: str, waited_s: float | None = None) -> None:
        """Its Pod cannot start (its image cannot be pulled, its config refers to what is not there; ``waited_s``:
        for that long, of a cause that may pass): the attempt fails, rather than hold its GPUs while the kubelet
        retries for ever, and its Job is deleted."""
        if not self._finish(key):
            return
        now = self._clock.now()
        self._withdrawn[key] = now
        waited = f" for {waited_s:.0f} s" if waited_s is not None else ""
        self._events.put_nowait(JobEvent(key[0], key[1], EventKind.FAILED, now, reason=(
            f"its Pod cannot start{waited} ({why}); check adapter.image and the Pod's configuration")))
        self._delete_later(key, known, "it stays, waiting")

    def _follow_unplaced(self, key: tuple[str, int], known: _Attempt, unplaced: dict[str, Any] | None,
                         pod: str) -> None:
        """Keep ``unplaced_since`` from the Pod's PodScheduled condition (its lastTransitionTime, so a list after a
        watch reconnects, or the first list of an adapter started since, gives the same time; where the cluster
        gives none, when this adapter first saw it), and start the deadline that withdraws it."""
        if unplaced is None:
            known.unplaced_since = None
            return
        fresh = known.unplaced_since is None
        if fresh:
            at = _timestamp(unplaced.get("lastTransitionTime"))
            known.unplaced_since = (datetime.fromtimestamp(at, tz=UTC) if at is not None
                                    else self._cluster_time.now())
        self._arm_unplaced(key, known, pod, fresh)

    def _arm_unplaced(self, key: tuple[str, int], known: _Attempt, pod: str, fresh: bool = False) -> None:
        """Start the deadline of an attempt whose Pod cannot be scheduled, or whose Job has no Pod yet; ``fresh``:
        started again, from the time its Pod became unschedulable (one kept for its Job without a Pod sleeps on)."""
        if fresh and (old := self._unplaced.pop(key, None)) is not None:
            old.cancel()
        if (not self.config.unschedulable_after_s or known.stopping is not None or key in self._withdrawn
                or key in self._unplaced):
            return
        task = asyncio.get_running_loop().create_task(self._unplaced_deadline(key, pod),
                                                      name=f"k8s-unplaced-{key[0]}")
        self._unplaced[key] = task
        self._stop_waits.add(task)  # (cancelled at close)
        task.add_done_callback(self._stop_waits.discard)
        task.add_done_callback(lambda t: self._unplaced.pop(key, None) if self._unplaced.get(key) is t else None)

    async def _unplaced_deadline(self, key: tuple[str, int], pod: str) -> None:
        """Withdraw the attempt once its Pod has been unschedulable for ``unschedulable_after_s``: not while
        Pods of a stop here are still going, nor in the ``AFTER_STOP_GRACE_S`` after the last went (a
        preemption's victims free the GPUs the Pod waits for, and the scheduler places it then). Counted on the
        cluster's clock (``_cluster_time``), as the timestamps it starts from: a broker's host clock ahead of the
        API server's would withdraw the Pod early, one behind late."""
        after = timedelta(seconds=self.config.unschedulable_after_s or 0.0)
        why: str | None = None
        events_read = False  # (the Job's Events read since the deadline was last found passed)
        while True:
            known = self._attempts.get(key)
            if known is None or known.done or known.stopping is not None or key in self._withdrawn:
                return
            stuck = known.stuck_since is not None and known.stuck is not None  # (its Pod was placed)
            podless = not stuck and known.unplaced_since is None and not known.had_pod and known.created is not None
            since = known.stuck_since if stuck else known.unplaced_since if not podless else known.created
            if since is None:
                return  # placed (its Pod scheduled) and starting, or gone
            now = self._cluster_time.now()  # (the cluster's timestamps are compared with the cluster's time)
            due = since + after
            if self._stop_ended is not None and not stuck:
                grace_s = PODLESS_AFTER_STOP_GRACE_S if podless else AFTER_STOP_GRACE_S
                due = max(due, self._stop_ended + timedelta(seconds=grace_s))
            wait_s = (due - now).total_seconds()
            if not stuck and (any(a.stopping is not None and not a.done for a in self._attempts.values()) or (
                    podless and not self._pods_listed)):
                wait_s = max(wait_s, 1.0)  # (look again soon: the stop may end, the Pods be listed, any moment)
            if wait_s <= 0:
                if stuck:
                    self._stuck(key, known, known.stuck or "", (now - since).total_seconds())
                elif podless and not events_read:
                    # (why the cluster makes no Pod is in the Job's Events; read before its Job is deleted, and
                    # then look again: its Pod may have come, or a stop begun, while they were read)
                    why = await self._refused_why(known.namespace, job_name(*key))
                    events_read = True
                    continue
                else:
                    self._unplaceable(key, known, pod, (now - since).total_seconds(), podless,
                                      why if podless else None)
                return
            events_read = False
            await asyncio.sleep(min(wait_s, UNPLACED_RECHECK_S))

    def _unplaceable(self, key: tuple[str, int], known: _Attempt, pod: str, waited_s: float,
                     podless: bool = False, why: str | None = None) -> None:
        """The scheduler has found no room for the attempt's Pod for too long (or, ``podless``, the cluster has
        made none for its Job, ``why`` its latest FailedCreate Event's message where one could be read): its GPUs
        are freed, the broker hears ``lost`` (no failure of the job's: it routes it again, elsewhere for a while)
        and its Job is deleted, with its Pod."""
        if not self._finish(key):
            return
        now = self._clock.now()
        self._withdrawn[key] = now  # final: the Job's deletion is not taken for a loss, a late submit is refused
        known.has_job = False  # (deleted here: none left for ``taken`` to delete)
        # (A namespace enforcing Pod Security restricted, the commonest of these, takes Pods that adapter
        # pod_security: restricted makes.)
        hint = "" if self.config.pod_security == "restricted" else (
            " (a namespace that enforces restricted takes the Pods of adapter.pod_security: restricted)")
        if podless and why is not None:
            what = (f"the cluster made no Pod for its Job {known.namespace}/{job_name(*key)} in {waited_s:.0f} s: "
                    f"{why}{hint if 'PodSecurity' in why else ''}")
        elif podless:
            what = (f"the cluster made no Pod for its Job {known.namespace}/{job_name(*key)} in {waited_s:.0f} s (it "
                    f"refuses to create it: Pod Security admission{hint}, a LimitRange or a ResourceQuota; `kubectl "
                    "describe job` shows its FailedCreate events)")
        else:
            what = (f"the cluster's scheduler found no room for its Pod {known.namespace}/{pod} for {waited_s:.0f} s "
                    f"({known.unschedulable or 'Unschedulable'})")
        log.warning("site %s: %s attempt %d: %s; the attempt is withdrawn, its Job deleted", self.name, key[0],
                    key[1], what)
        self._events.put_nowait(JobEvent(key[0], key[1], EventKind.LOST, now, reason=(
            f"{what}; withdrawn after adapter.unschedulable_after_s")))
        self._delete_later(key, known, "it stays, waiting")

    def _delete_later(self, key: tuple[str, int], known: _Attempt, otherwise: str) -> None:
        """Delete the attempt's Job in the background; a failure is logged with ``otherwise``."""
        async def delete() -> None:
            await self._keep_log(key)  # (its Pods go with it: what it printed last is kept here)
            try:
                await self._delete_job(key, known)
            except AdapterError as e:
                log.warning("%s; %s", e, otherwise)
        task = asyncio.get_running_loop().create_task(delete(), name=f"k8s-delete-{key[0]}")
        self._stop_waits.add(task)
        task.add_done_callback(self._stop_waits.discard)

    def _background(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._stop_waits.add(task)  # (cancelled at close)
        task.add_done_callback(self._stop_waits.discard)

    async def _read_disrupted(self, key: tuple[str, int], known: _Attempt, namespace: str, pod: str, reason: str,
                              run_s: float) -> None:
        """The Job failed as the cluster disrupted its Pod, whose own update has not come yet: the Pod (if it is
        still there) says whether the kubelet evicted it for its own usage, a failure, or the cluster took it
        away, a loss."""
        obj: dict[str, Any] = {}
        try:  # (a list, which the site's RBAC grants cluster-wide, where a get would need more)
            data = await self._json("reading a Pod", self._core.list_pod_for_all_namespaces_without_preload_content,
                                    field_selector=f"metadata.namespace={namespace},metadata.name={pod}")
            obj = next((o for o in data.get("items") or [] if (o.get("metadata") or {}).get("name") == pod
                        and (o.get("metadata") or {}).get("namespace", namespace) == namespace), {})
        except (k8s.ApiException, AdapterError) as e:
            log.debug("site %s: reading Pod %s/%s failed (%r): taken as a loss", self.name, namespace, pod, e)
        status = obj.get("status") or {}
        why = next((c for c in status.get("conditions") or []
                    if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), status)
        if known.own_eviction is None and known.disrupted is None:
            known.own_eviction = own_eviction(why.get("reason"), why.get("message") or status.get("message"))
        self._disrupted(key, known, run_s, reason)

    def _disrupted(self, key: tuple[str, int], known: _Attempt, run_s: float, reason: str) -> None:
        """Its Pod was disrupted: by the kubelet for its own usage, a failed attempt (an eviction as much the job's
        as an OOMKill: as a loss it would be requeued and evicted again for ever); else by the cluster (a drain,
        a taint, the scheduler's preemption, its Node lost or short of what others use), a loss, no failure of
        the job's."""
        now = self._clock.now()
        if self._attempts.get(key) is not known or not self._finish(key):
            return  # (cancelled, and forgotten, while its Pod was read)
        if known.own_eviction is not None:
            self._events.put_nowait(JobEvent(key[0], key[1], EventKind.FAILED, now, run_s=run_s, reason=(
                f"the kubelet evicted its Pod for its own usage ({known.own_eviction})")))
        else:
            self._events.put_nowait(JobEvent(key[0], key[1], EventKind.LOST, now, run_s=run_s, reason=(
                f"the cluster took its Pod away ({known.disrupted or reason})")))

    def _gone(self, key: tuple[str, int], namespace: str, name: str) -> None:
        """An attempt's Job was deleted, not by heliotrope: ``lost``."""
        known = self._attempts.get(key)
        since = known.running_since if known is not None else None
        if known is not None:
            known.has_job = False  # (none left to delete)
        now = self._clock.now()
        run_s = max((now - since).total_seconds(), 0.0) if since is not None else 0.0
        if self._finish(key):
            self._events.put_nowait(JobEvent(key[0], key[1], EventKind.LOST, now, run_s=run_s,
                                             reason=f"Job {namespace}/{name} was deleted outside heliotrope"))

    def _on_watch_event(self, kind: str, event: dict[str, Any]) -> None:
        obj = event.get("object") or {}
        if event.get("type") == "ERROR" or not self._ours(obj):
            return
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        key = attempt_key(meta)
        if key is None or (key not in self._attempts and key in self._withdrawn):
            return  # (over and forgotten, or withdrawn before this adapter knew it: its Job is being deleted)
        known = self._attempts.setdefault(key, _Attempt(key[0], key[1], labels.get(TENANT_LABEL, ""),
                                                        meta.get("namespace", "")))
        if known.done:
            return
        now = self._clock.now()
        status = obj.get("status") or {}
        if kind == "pods":
            if event.get("type") == "DELETED":
                known.pods.discard(meta.get("name", ""))
                if not known.pods:
                    known.unplaced_since = known.stuck_since = None  # (a Pod of its Job made again starts afresh)
                if known.stopping is not None and not known.pods:
                    self._stopped(key)  # its last Pod has exited: stopped, as the broker asked
                return
            known.pods.add(meta.get("name", ""))
            known.had_pod = True
            if node := (obj.get("spec") or {}).get("nodeName"):
                known.node = node
            disruption = next((c for c in status.get("conditions") or []
                               if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
            if disruption is not None or status.get("reason") == "Evicted":
                why = disruption or status
                known.disrupted = ": ".join(x for x in (why.get("reason"), why.get("message")) if x) or "disrupted"
                known.own_eviction = own_eviction(why.get("reason"), why.get("message") or status.get("message"))
            unplaced = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"
                             and c.get("status") == "False" and c.get("reason") == "Unschedulable"), None)
            if unplaced is not None and unplaced.get("message") != known.unschedulable:
                known.unschedulable = unplaced.get("message")
                after_s = self.config.unschedulable_after_s
                log.warning("site %s: the Pod %s/%s of %s attempt %d cannot be scheduled (%s); it waits in the "
                            "cluster, holding its GPUs in the site's books, %s", self.name,
                            meta.get("namespace") or known.namespace, meta.get("name"), key[0], key[1],
                            known.unschedulable or "Unschedulable",
                            f"and is withdrawn if it still cannot be {after_s:.0f} s after it first could not"
                            if after_s else "until it can be or is cancelled (unschedulable_after_s: 0)")
            self._follow_unplaced(key, known, unplaced, meta.get("name", ""))
            ended = next((t for c in status.get("containerStatuses") or []
                          if (t := (c.get("state") or {}).get("terminated") or {}).get("exitCode")), None)
            if ended is not None:
                known.exited = ", ".join(x for x in (ended.get("reason"), f"exit code {ended['exitCode']}",
                                                     (ended.get("message") or "").strip()[:200]) if x)
            stuck = next((w for c in (*(status.get("initContainerStatuses") or []),
                                      *(status.get("containerStatuses") or []))
                          if (w := (c.get("state") or {}).get("waiting") or {}).get("reason") in STUCK_REASONS), None)
            if stuck is not None and known.stopping is None and key not in self._withdrawn:
                why = ": ".join(x for x in (stuck.get("reason"), stuck.get("message")) if x)
                if stuck.get("reason") in NEVER_STARTS:
                    self._stuck(key, known, why)
                    return
                known.stuck = why
                if known.stuck_since is None:  # (from the Pod's startTime: the same after a watch reconnects)
                    at = _timestamp(status.get("startTime"))
                    known.stuck_since = (datetime.fromtimestamp(at, tz=UTC) if at is not None
                                         else self._cluster_time.now())
                    self._arm_unplaced(key, known, meta.get("name", ""), fresh=True)
            else:
                known.stuck_since = None
            if status.get("phase") == "Running" and known.running_since is None and event.get("type") != "DELETED":
                known.running_since = now
                self._events.put_nowait(JobEvent(key[0], key[1], EventKind.RUNNING, now))
            return
        run_s = max((now - known.running_since).total_seconds(), 0.0) if known.running_since else 0.0
        conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
        if "Complete" in conditions or (status.get("succeeded") or 0) > 0:
            if self._finish(key):
                self._events.put_nowait(JobEvent(key[0], key[1], EventKind.SUCCEEDED, now, run_s=run_s))
        elif "Failed" in conditions or (status.get("failed") or 0) > 0:
            failed = conditions.get("Failed") or {}
            reason = ": ".join(x for x in (failed.get("reason"), failed.get("message")) if x) or "the Job's Pod failed"
            if known.exited is not None:
                reason = f"its container ended {known.exited} ({reason})"
            pod = DISRUPTED_POD.search(failed.get("message") or "")
            if known.disrupted is None and pod is not None:
                # the Job's failure came before its Pod's: the Pod says whose fault it was (read it first)
                if not known.reading_pod:
                    known.reading_pod = True
                    self._background(self._read_disrupted(key, known, pod[1], pod[2], reason, run_s),
                                     f"k8s-disrupted-{key[0]}")
            elif known.disrupted is not None or (failed.get("reason") == "PodFailurePolicy"
                                                 and "DisruptionTarget" in (failed.get("message") or "")):
                self._disrupted(key, known, run_s, reason)
            elif self._finish(key):
                self._events.put_nowait(JobEvent(key[0], key[1], EventKind.FAILED, now, reason=reason, run_s=run_s))
        elif event.get("type") == "DELETED" and key not in self._withdrawn:
            self._gone(key, meta.get("namespace", ""), meta.get("name", ""))
        else:
            known.has_job = True
            was = known.created
            if (at := _timestamp(meta.get("creationTimestamp"))) is not None:
                known.created = datetime.fromtimestamp(at, tz=UTC)
            elif known.created is None:
                known.created = self._cluster_time.now()
            if not known.had_pod:
                self._arm_unplaced(key, known, "", fresh=known.created != was)

    # --- QuotaAdmin ---

    def _quotas(self) -> list[TenantQuota]:
        return list(self._overrides.apply(self.spec.quotas))

    async def quota(self) -> QuotaState:
        if self._admission is None:
            await self._refresh_inventory()
        if self._admission is None:
            raise AdapterError(f"site {self.name} has no usable GPU nodes, so no quota state")
        return self._admission.report(self._clock.now().timestamp())

    async def set_quota(self, quota: TenantQuota) -> QuotaState:
        self._overrides.set(quota)  # kept first: a change the site forgets on restart was never made
        now = self._clock.now().timestamp()
        if self._admission is not None:
            self._admission.set_quota(quota, now)
            log_beyond_site(self.name, self._admission.book)
        await self._mirror_quota(quota)
        return await self.quota()

    async def remove_quota(self, tenant: str) -> QuotaState:
        if all(q.tenant != tenant for q in self._quotas()):
            raise KeyError(f"site {self.name} has no quota for tenant {tenant}")
        self._overrides.remove(tenant)
        if self._admission is not None:
            self._admission.remove_quota(tenant, self._clock.now().timestamp())
        async with self._quota_writes:  # after a write under way (a refresh's), so it cannot bring it back
            self._mirrored.pop(tenant, None)
            self._mirror_retry.pop(tenant, None)
            try:
                await self._json("deleting a ResourceQuota",
                                 self._core.delete_namespaced_resource_quota_without_preload_content,
                                 QUOTA_NAME, self.namespace(tenant))
            except k8s.ApiException as e:
                if e.status != 404:
                    raise AdapterError(f"site {self.name}: the quota of {tenant} is removed here, but deleting "
                                       f"ResourceQuota {self.namespace(tenant)}/{QUOTA_NAME} failed ({e.status})"
                                       ) from e
        return await self.quota()

    async def forget_quotas(self) -> None:
        """The site leaves the federation: its quota changes, usage history and stops not yet reported are dropped,
        in its state folder and in the cluster, so a new site of its name starts afresh (and does not report the
        old one's stops as its own)."""
        self._overrides.forget()
        self._usage.forget()
        self._journal.forget()
        self._ended_logs.forget()
        if self._cluster_usage is not None:
            await self._cluster_usage.forget()  # (its copy in the cluster too: a new site of its name starts afresh)
        if self._cluster_stops is not None:
            await self._cluster_stops.forget()

    def quota_manifest(self, quota: TenantQuota) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": QUOTA_NAME, "namespace": self.namespace(quota.tenant),
                         "labels": {SITE_LABEL: _label_value(self.name), TENANT_LABEL: quota.tenant},
                         "annotations": {"heliotrope.io/guaranteed-gpus": str(quota.guaranteed_gpus),
                                         "heliotrope.io/burst-gpus": str(quota.burst_gpus),
                                         "heliotrope.io/model": quota.model or "any"}},
            "spec": {"hard": {f"requests.{GPU}": str((quota.guaranteed_gpus + quota.burst_gpus)
                                                     * (MIG_SLICES_PER_GPU if self._single else 1))}},
        }

    async def _mirror_quota(self, quota: TenantQuota) -> None:
        """Write the tenant's ResourceQuota (create, else patch) and keep what was written, or why it failed, in
        ``_mirrored``: ``_follow_layout`` writes it again when the Nodes change its limit, or after a failure."""
        async with self._quota_writes:
            if all(q.tenant != quota.tenant for q in self._quotas()):
                return  # removed while this write waited (its ResourceQuota is deleted)
            manifest = self.quota_manifest(quota)
            namespace = manifest["metadata"]["namespace"]
            try:
                await self._write_quota(manifest)
            except (k8s.ApiException, AdapterError) as e:
                api = isinstance(e, k8s.ApiException)
                why = f"{e.status}: {e.reason}" if api else str(e).removeprefix(f"site {self.name}: ")
                hint = f"; does namespace {namespace} exist?" if api else ""
                error = AdapterError(f"site {self.name}: the quota of {quota.tenant} is kept and enforced by "
                                     f"heliotrope, but mirroring it as ResourceQuota {namespace}/{QUOTA_NAME} failed "
                                     f"({why}){hint}")
                self._mirrored[quota.tenant] = str(error)
                _, wait = self._mirror_retry.get(quota.tenant, (0.0, 0.0))
                wait = min(max(2 * wait, self.quota_retry_s), 3600.0)
                self._mirror_retry[quota.tenant] = (time.monotonic() + wait, wait)
                raise error from e
            self._mirrored[quota.tenant] = manifest
            self._mirror_retry.pop(quota.tenant, None)

    async def _write_quota(self, manifest: dict[str, Any]) -> None:
        namespace = manifest["metadata"]["namespace"]
        try:
            await self._json("creating a ResourceQuota",
                             self._core.create_namespaced_resource_quota_without_preload_content,
                             namespace, manifest)
            return
        except k8s.ApiException as e:
            if e.status != 409:
                raise
        patch = {"metadata": {"labels": manifest["metadata"]["labels"],
                              "annotations": manifest["metadata"]["annotations"]}, "spec": manifest["spec"]}
        await self._json("updating a ResourceQuota", self._core.patch_namespaced_resource_quota_without_preload_content,
                         QUOTA_NAME, namespace, patch)

    async def _follow_layout(self) -> None:
        """At each inventory refresh: write again each tenant's ResourceQuota whose manifest is no longer the one
        written (Nodes of the single MIG strategy came or went, so its limit is seven times guarantee + burst, or
        no longer), or whose last write failed. An unchanged layout makes no call. A failure is logged (a warning
        when its cause is new) and tried again at the first refresh ``quota_retry_s`` later (the wait doubling
        with each failure in a row, to an hour), so a missing namespace costs no call per cycle; the quota itself
        stands in ``SiteAdmission``. Only tenants mirrored before (by ``start``, ``set_quota``) are followed."""
        for quota in self._quotas():
            last = self._mirrored.get(quota.tenant)
            if last is None or last == self.quota_manifest(quota):
                continue
            if time.monotonic() < self._mirror_retry.get(quota.tenant, (0.0, 0.0))[0]:
                continue
            try:
                await self._mirror_quota(quota)
            except AdapterError as e:
                (log.warning if str(e) != last else log.debug)(
                    "%s; tried again at the next inventory refresh", e)


def _short_message(text: str, most: int = 400) -> str:
    """A cluster's message on one line, cut to ``most`` characters (a Pod Security refusal lists every check)."""
    line = " ".join(text.split())
    return line if len(line) <= most else line[:most - 1] + "…"


def _refusal(status: int, body: str) -> str:
    """What the API server said, in words: the ``message`` of its Status answer, else the start of its body; a
    401 says what to check (an expired token says no more than ``Unauthorized``)."""
    try:
        said = json.loads(body).get("message") or body
    except (ValueError, AttributeError):
        said = body
    said = str(said).strip()[:500]
    if status == 401:
        return (f"{said or 'Unauthorized'}: the cluster refused the site's credentials (an expired or revoked "
                "token, or those of another cluster); check adapter.kubeconfig and adapter.context, or the "
                "service account")
    return said


def _key(job_id: str, attempt: int) -> str:
    return f"{job_id}/{attempt}"


def _as_pod(job: Job) -> Job:
    """The job as one Pod runs it: whole GPUs all on one node."""
    if job.spec.gpus.mig_profile is None and job.spec.gpus.topology == "any":
        gpus = job.spec.gpus.model_copy(update={"topology": "node"})
        return job.model_copy(update={"spec": job.spec.model_copy(update={"gpus": gpus})})
    return job


def _token_refresher(loader: Any) -> Callable[[k8s.Configuration], Awaitable[None]] | None:
    """A hook the client awaits before each request that renews a kubeconfig credential that expires (an exec
    plugin's token with an ``expirationTimestamp``: EKS, GKE's gke-gcloud-auth-plugin, kubelogin; the ``gcp`` and
    ``oidc`` auth providers), as kubectl does, within five minutes of its expiry. The client's loader reads it
    once; without this every call failed with 401 Unauthorized once the first token expired (on EKS after 15
    minutes), until the broker restarted. A ``tokenFile`` (a projected service account token, rotated by whoever
    writes it) is read again every ``TOKEN_FILE_REREAD_S``, as client-go does. None for credentials that do not
    expire (a token in the file, a certificate)."""
    user = loader._user  # noqa: SLF001 - the loader keeps what it refreshes from here only
    if not user or not ("exec" in user or "tokenFile" in user or loader.provider in ("gcp", "oidc")):
        return None
    lock = asyncio.Lock()  # one renewal at a time (an exec plugin is a process)
    read_at = [time.monotonic()]

    async def refresh(configuration: k8s.Configuration) -> None:
        async with lock:
            if "exec" not in user and loader.provider not in ("gcp", "oidc"):  # a tokenFile
                if time.monotonic() - read_at[0] < TOKEN_FILE_REREAD_S:
                    return
                read_at[0] = time.monotonic()
                with contextlib.suppress(Exception):  # (gone for a moment while rewritten: the old one is sent)
                    loader._load_user_token()  # noqa: SLF001
            elif loader.provider == "gcp":
                await loader.load_gcp_token()  # (renews an expired token only)
            elif loader.provider == "oidc":
                await loader._load_oid_token()  # noqa: SLF001 (renews an expired id-token only)
            else:
                expiry = getattr(loader, "exec_plugin_expiry", None)
                if expiry is None or not kube_config_module._is_expired(expiry):  # noqa: SLF001
                    return  # valid yet, or a plugin's token without an expiry: kept, as kubectl keeps it
                await loader.load_from_exec_plugin()  # (logs a plugin that fails; the old token is sent)
            if getattr(loader, "token", None):
                configuration.api_key["BearerToken"] = loader.token
    return refresh


def _check_kubeconfig_exists(path: str | None) -> None:
    """Refuse a kubeconfig that is not there, in words: the client's loader only logs that it found no file and
    then fails as if the file had no ``current-context``, which sends an operator looking inside a file that
    does not exist. ``path`` None: the client's default, ``$KUBECONFIG`` (a list of files, any of which may be
    missing) or else ``~/.kube/config``."""
    if path is not None:
        if not Path(path).is_file():
            raise k8s_config.ConfigException(f"{path}: no such file")
        return
    default = kube_config_module.KUBE_CONFIG_DEFAULT_LOCATION
    candidates = [Path(p).expanduser() for p in default.split(kube_config_module.ENV_KUBECONFIG_PATH_SEPARATOR) if p]
    if not any(p.is_file() for p in candidates):
        raise k8s_config.ConfigException(
            f"no kubeconfig: adapter.kubeconfig is unset and {', '.join(map(str, candidates)) or default} "
            f"{'does' if len(candidates) == 1 else 'do'} not exist")


def _check_kubeconfig(path: str) -> None:
    """Refuse a kubeconfig file that is not one, in words (the client's loader fails on it with a TypeError)."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        why = f"line {mark.line + 1}: {problem}" if mark is not None and problem else str(e).splitlines()[0]
        raise k8s_config.ConfigException(f"{path} is not a YAML file ({why})") from None
    if not isinstance(doc, dict):
        raise k8s_config.ConfigException(f"{path} holds no kubeconfig (a YAML mapping of clusters, users and "
                                         f"contexts), but {'nothing' if doc is None else type(doc).__name__}")
