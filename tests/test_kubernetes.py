"""The Kubernetes adapter against kmock, a Kubernetes API emulator started in-process on a free port.

kmock stores the objects it is sent and serves list, watch, fetch, create (409 on a duplicate), merge-patch
and delete. It does not schedule Pods, run them, enforce ResourceQuota or filter by label selector, so the
tests play the cluster's part: they preload Nodes, and patch Pods and Jobs to move them through their life.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from kubernetes.aio import client as k8s

from adapters import kubernetes_logs
from adapters.base import AdapterError, EventKind, JobEvent, JobLogs, LogsNotFound, LogsUnsupported
from adapters.kubernetes import KubernetesSite, job_name, product_model
from adapters.kubernetes_nodes import node_groups, read_node
from adapters.kubernetes_stops import ClusterUsage, config_map_name
from broker.clock import Clock, ManualClock, SystemClock
from broker.models import FairSharePolicy, GpuRequest, Job, KubernetesAdapterConfig, TenantQuota
from policies.inventory import Inventory, Placement
from policies.quota import Ask, QuotaBook
from tests.builders import NOW, job, site
from tests.pod_security import restricted_violations

JOBS, PODS, NODES, QUOTAS = "batch/v1/jobs", "v1/pods", "v1/nodes", "v1/resourcequotas"
CONFIG_MAPS, EVENTS = "v1/configmaps", "v1/events"


def node(name: str, product: str | None, gpus: int = 0, mig: dict[str, int] | None = None,
         gpu_count: int | None = None, **spec: Any) -> dict[str, Any]:
    labels = {} if product is None else {"nvidia.com/gpu.product": product}
    if gpu_count is not None:
        labels["nvidia.com/gpu.count"] = str(gpu_count)
    allocatable = {"cpu": "64", "nvidia.com/gpu": str(gpus)}
    allocatable |= {f"nvidia.com/mig-{p}": str(n) for p, n in (mig or {}).items()}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": spec,
            "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": "True"}]}}


CLUSTER = [
    node("a100-0", "NVIDIA-A100-SXM4-80GB", gpus=8),
    node("a100-1", "NVIDIA-A100-SXM4-80GB", gpus=8),
    node("mig-0", "NVIDIA-A100-SXM4-80GB", mig={"1g.10gb": 7, "3g.40gb": 2}, gpu_count=3),
    node("cpu-0", None),
    node("unlabelled", None, gpus=4),
    node("cordoned", "NVIDIA-H100-80GB-HBM3", gpus=8, unschedulable=True),
]


@pytest.fixture
async def cluster() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):  # a free port of its choosing
        for resource in (JOBS, PODS, QUOTAS, CONFIG_MAPS, EVENTS):
            emulator.resources[resource] = {}
        for n in CLUSTER:
            emulator.objects[NODES, None, n["metadata"]["name"]] = n
        yield emulator


def make_site(cluster: kmock.KubernetesEmulator, stop_wait_s: float = 300.0, state_dir: Path | None = None,
              state_namespace: str | None = None, unschedulable_after_s: float | None = 300.0,
              clock: Clock | None = None, **spec: Any) -> KubernetesSite:
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2,
                                     stop_wait_s=stop_wait_s, state_namespace=state_namespace,
                                     unschedulable_after_s=unschedulable_after_s)
    return KubernetesSite(site("kube", adapter=config.model_dump(), **spec), clock or SystemClock(),
                          state_dir=state_dir)


@pytest.fixture
async def kube(cluster: kmock.KubernetesEmulator) -> AsyncIterator[KubernetesSite]:
    adapter = make_site(cluster, quotas=[{"tenant": "t1", "guaranteed_gpus": 4, "burst_gpus": 4}])
    await adapter.start()
    yield adapter
    await adapter.close()


def attempt(job_id: str = "j-1", n: int = 1, **spec: Any) -> Job:
    return Job(id=job_id, spec=job(**spec), attempt=n, created_at=NOW, updated_at=NOW)


def mig_attempt(job_id: str, count: int, profile: str) -> Job:
    spec = job().model_copy(update={"gpus": GpuRequest(count=count, mig_profile=profile)})
    return Job(id=job_id, spec=spec, attempt=1, created_at=NOW, updated_at=NOW)


def jobs(cluster: kmock.KubernetesEmulator) -> dict[tuple[str | None, str], dict[str, Any]]:
    return {(ns, name): obj for (res, ns, name), obj in cluster.objects.items()
            if res.plural == "jobs" and not obj.deleted}


async def next_event(adapter: KubernetesSite, stream: AsyncIterator[JobEvent]) -> JobEvent:
    return await asyncio.wait_for(anext(stream), 5)


async def pod_running(cluster: kmock.KubernetesEmulator, name: str, namespace: str = "heliotrope-t1") -> None:
    """What the cluster's Job controller and kubelet would do for Job ``name``: a Pod of it, pending, then
    running (the emulator runs no controller)."""
    labels = dict(jobs(cluster)[(namespace, name)]["spec"]["template"]["metadata"]["labels"])
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-abc", "labels": labels},
           "spec": {"containers": [{"name": "job", "image": "x"}]}, "status": {"phase": "Pending"}}
    assert (await cluster.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)).status == 200
    await cluster.patch(f"/api/v1/namespaces/{namespace}/pods/{name}-abc", json={"status": {"phase": "Running"}})


async def j1_sent(adapter: KubernetesSite) -> str:
    """j-1 (8 GPUs, tenant t1) admitted by the adapter; returns its Job's name."""
    assert (await adapter.submit(attempt("j-1", count=8))).admitted
    return job_name("j-1", 1)


async def j1_running(adapter: KubernetesSite, stream: AsyncIterator[JobEvent],
                     cluster: kmock.KubernetesEmulator) -> str:
    """j-1 (8 GPUs, tenant t1) admitted, its Pod running, and the adapter's ``running`` read from ``stream``;
    returns its Job's name."""
    name = await j1_sent(adapter)
    await pod_running(cluster, name)
    assert (await next_event(adapter, stream)).kind == EventKind.RUNNING
    return name


# --- capacity from Nodes ---


@pytest.mark.parametrize(("product", "model"), [
    ("NVIDIA-A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "a100-40gb"),
    ("NVIDIA-H100-80GB-HBM3", "h100-80gb"),
    ("Tesla-T4", "t4"),
    ("NVIDIA-L4", "l4"),
], ids=[
    "an A100 80GB product label maps to a100-80gb",
    "a single-strategy MIG product label maps to its GPU",
    "an H100 HBM3 label maps to h100-80gb",
    "a Tesla T4 label maps to t4",
    "an L4 label maps to l4",
])
def test_gpu_feature_discovery_products_map_to_canonical_models(product: str, model: str) -> None:
    assert product_model(product) == model


async def test_capacity_counts_whole_gpus_and_mig_slices_of_usable_nodes(kube: KubernetesSite) -> None:
    state = await kube.snapshot()
    [a100] = state.capacity
    assert a100.model == "a100-80gb"
    assert a100.total_gpus == 16 + 3  # two whole-GPU nodes, one node of 3 MIG GPUs
    assert a100.free_gpus == 16
    assert a100.mig_free_slices["1g.10gb"] == 21  # 3 GPUs of 7 one-slice instances could still be made
    assert a100.mig_free_slices["3g.40gb"] == 6
    assert state.health == "healthy"
    left_out = " | ".join(kube.left_out)
    assert "unlabelled has GPUs but no nvidia.com/gpu.product" in left_out
    assert "cordoned is cordoned" in left_out


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(("settings", "counted", "why"), [
    ({}, 8, "node a100-1 is tainted nvidia.com/gpu=present:NoSchedule, which no toleration of adapter.tolerations"),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}, 16, None),
    ({"tolerations": [{"key": "nvidia.com/gpu", "value": "present"}]}, 16, None),
    ({"tolerations": [{"key": "nvidia.com/gpu", "value": "absent"}]}, 8, "tainted nvidia.com/gpu=present"),
    ({"tolerations": [{"operator": "Exists"}], "node_selector": {"pool": "training"}}, 8,
     "node a100-0 has no label pool=training (adapter.node_selector)"),
], ids=["a node tainted NoSchedule is left out when nothing tolerates the taint",
        "an Exists toleration of the key counts it", "an Equal toleration of its value counts it",
        "a toleration of another value does not",
        "a node without the node_selector's labels is left out"])
async def test_tainted_nodes_count_only_when_the_jobs_pods_tolerate_them(
        cluster: kmock.KubernetesEmulator, settings: dict[str, Any], counted: int, why: str | None) -> None:
    tainted = node("a100-1", "NVIDIA-A100-SXM4-80GB", gpus=8, taints=[GPU_TAINT])
    tainted["metadata"]["labels"]["pool"] = "training"
    cluster.objects[NODES, None, "a100-1"] = tainted
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2, **settings)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()
    try:
        assert (await adapter.snapshot()).capacity[0].free_gpus == counted
        assert why is None or why in " | ".join(adapter.left_out)
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        pod = jobs(cluster)[("heliotrope-t1", job_name("j-1", 1))]["spec"]["template"]["spec"]
        assert pod.get("tolerations", []) == [{"operator": "Equal"} | t for t in settings.get("tolerations", [])]
        assert pod.get("nodeSelector", {}) == settings.get("node_selector", {})
    finally:
        await adapter.close()


@pytest.mark.parametrize(("toleration", "message"), [
    ({"key": "a", "operator": "Exists", "value": "b"}, "operator Exists takes no value"),
    ({"value": "b"}, "a toleration without a key must have operator Exists"),
    ({"key": "a", "effect": "NoSchedule", "tolerationSeconds": 60}, "tolerationSeconds needs effect NoExecute"),
    ({"key": "a", "effect": "Sometimes"}, "effect"),
    ({"key": "a", "tolerationseconds": 60}, "tolerationseconds"),
], ids=["Exists with a value", "no key without Exists", "tolerationSeconds without NoExecute",
        "an effect Kubernetes does not have", "a misspelt field"])
def test_a_toleration_kubernetes_would_refuse_is_refused_in_the_config(toleration: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KubernetesAdapterConfig(tolerations=[toleration])


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 65534, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize(("settings", "pod_context", "container_context"), [
    ({}, None, None),
    ({"pod_security": "restricted"}, RESTRICTED_POD, RESTRICTED_CONTAINER),
    ({"pod_security": "restricted", "pod_security_context": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000}},
     RESTRICTED_POD | {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000}, RESTRICTED_CONTAINER),
    ({"pod_security_context": {"fsGroup": 2000}}, {"fsGroup": 2000}, None),
], ids=["without pod_security the Pod sets no securityContext, as before",
        "pod_security restricted: the Pod runs as nobody, non-root, RuntimeDefault seccomp, no capabilities",
        "with restricted, the user and groups the operator names",
        "pod_security_context alone sets its keys and nothing else"])
async def test_a_jobs_pod_meets_the_restricted_pod_security_profile_where_the_site_asks_for_it(
        cluster: kmock.KubernetesEmulator, settings: dict[str, Any], pod_context: dict[str, Any] | None,
        container_context: dict[str, Any] | None) -> None:
    # A namespace labelled pod-security.kubernetes.io/enforce: restricted (OpenShift, GKE Autopilot-like policies)
    # accepts the Job but refuses its Pod, and the attempt waited unschedulable_after_s to be withdrawn. The
    # emulator runs no Pod Security admission: the profile's checks are made on the Pod template here.
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2, **settings)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        pod = jobs(cluster)[("heliotrope-t1", job_name("j-1", 1))]["spec"]["template"]["spec"]
        assert pod.get("securityContext") == pod_context
        assert pod["containers"][0].get("securityContext") == container_context
        violations = restricted_violations(pod)
        if settings.get("pod_security") == "restricted":
            assert violations == []
        else:
            assert any(v.startswith("container job does not run as non-root") for v in violations)
    finally:
        await adapter.close()


@pytest.mark.parametrize(("settings", "field", "message"), [
    ({"pod_security": "restricted", "pod_security_context": {"runAsUser": 0}}, "pod_security_context",
     "runAsUser 0 is root, which pod_security restricted forbids"),
    ({"pod_security_context": {"runAsUser": 1000, "privileged": True}}, "pod_security_context",
     "privileged: not taken here: pod_security_context sets only runAsUser, runAsGroup and fsGroup"),
    ({"pod_security_context": {"runAsUser": -1}}, "pod_security_context.runAsUser", "greater than or equal to 0"),
    ({"pod_security_context": {"runAsUser": 2**31}}, "pod_security_context.runAsUser", "less than or equal to"),
    ({"pod_security_context": {"fsgroup": 1000}}, "pod_security_context.fsgroup", "Extra inputs"),
    ({"pod_security_context": "restricted"}, "pod_security_context", "must be a mapping of runAsUser"),
    ({"pod_security": "baseline"}, "pod_security", "meets the baseline profile as it is"),
    ({"pod_security": "Restricted"}, "pod_security", "Input should be 'restricted'"),
], ids=["runAsUser 0 under restricted", "a securityContext key heliotrope does not copy", "a negative user id",
        "a user id past 2^31 - 1", "a misspelt key", "not a mapping", "the baseline profile, which needs nothing",
        "a profile misspelt"])
def test_a_pod_security_setting_kubernetes_or_the_profile_would_refuse_is_refused_naming_the_field(
        settings: dict[str, Any], field: str, message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        KubernetesAdapterConfig.model_validate(settings)
    [error] = refused.value.errors()
    assert ".".join(map(str, error["loc"])) == field and message in error["msg"]


def test_pod_security_is_stored_only_where_set_and_read_back_as_written() -> None:
    # Left out where unset, so brokers of earlier releases (whose specs forbid keys they do not know) sharing the
    # database still read the site; where set, read back in Kubernetes' spelling, as the operator wrote it.
    plain = KubernetesAdapterConfig().model_dump()
    assert "pod_security" not in plain and "pod_security_context" not in plain
    written = {"pod_security": "restricted", "pod_security_context": {"runAsUser": 1000, "fsGroup": 2000}}
    stored = KubernetesAdapterConfig.model_validate(written)
    assert {k: stored.model_dump(mode="json")[k] for k in written} == written
    assert KubernetesAdapterConfig.model_validate_json(stored.model_dump_json()) == stored


async def test_slices_of_the_single_mig_strategy_are_counted_and_asked_for_as_slices(
        cluster: kmock.KubernetesEmulator) -> None:
    # What GPU feature discovery and the device plugin publish under `migStrategy: single` for one A100-40GB
    # split into seven 1g.5gb slices: seven nvidia.com/gpu, each a slice, not a whole GPU.
    single = node("single-mig", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", gpus=7, gpu_count=7)
    single["metadata"]["labels"] |= {"nvidia.com/gpu.memory": "4864", "nvidia.com/mig.strategy": "single"}
    cluster.objects[NODES, None, "single-mig"] = single
    adapter = make_site(cluster)
    await adapter.start()
    try:
        a100_40 = {c.model: c for c in (await adapter.snapshot()).capacity}["a100-40gb"]
        assert (a100_40.total_gpus, a100_40.free_gpus, a100_40.mig_free_slices) == (1, 0, {"1g.5gb": 7})
        whole = await adapter.submit(attempt("j-1", count=1, model="a100-40gb"))
        assert not whole.admitted  # there is no whole A100-40GB to give
        whole_80 = await adapter.submit(attempt("j-2", count=1, model="a100-80gb"))
        assert whole_80.admitted
        spec = job().model_copy(update={"gpus": GpuRequest(count=2, model="a100-40gb", mig_profile="1g.5gb")})
        assert (await adapter.submit(Job(id="m-1", spec=spec, attempt=1, created_at=NOW, updated_at=NOW))).admitted
        for name, resource, product in [("m-1", "nvidia.com/gpu", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
                                        ("j-2", "nvidia.com/gpu", "NVIDIA-A100-SXM4-80GB")]:
            pod = jobs(cluster)[("heliotrope-t1", job_name(name, 1))]["spec"]["template"]["spec"]
            assert pod["containers"][0]["resources"]["limits"] == {resource: "2" if name == "m-1" else "1"}
            term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [product]
    finally:
        await adapter.close()
    restarted = make_site(cluster)  # the Job asks nvidia.com/gpu, but it is read back as two slices
    await restarted.start()
    try:
        a100_40 = {c.model: c for c in (await restarted.snapshot()).capacity}["a100-40gb"]
        assert a100_40.mig_free_slices == {"1g.5gb": 5}
    finally:
        await restarted.close()


@pytest.mark.parametrize(("profile", "slices", "gpus"), [
    ("1g.5gb", 56, 8), ("2g.10gb", 24, 8), ("3g.20gb", 16, 8), ("4g.20gb", 8, 8), ("7g.40gb", 8, 8), ("2g.10gb", 4, 2),
])
def test_a_single_strategy_node_has_as_many_gpus_as_its_slices_need(profile, slices, gpus) -> None:  # noqa: ANN001
    # An A100 40GB holds seven 1g.5gb, three 2g.10gb, two 3g.20gb (memory: 40 GB), one 4g.20gb (compute), as
    # the inventory places them; counting compute slices alone gave 7 GPUs for 24 2g.10gb and 5 for 8 4g.20gb.
    labels_node = node("n", f"NVIDIA-A100-SXM4-40GB-MIG-{profile}", gpus=slices, gpu_count=slices)
    labels_node["metadata"]["labels"]["nvidia.com/mig.strategy"] = "single"
    found = read_node(labels_node)
    assert not isinstance(found, str) and (found.mig_gpus, found.mig) == (gpus, {profile: slices})


@pytest.mark.parametrize(("product", "memory_mib", "mig", "model"), [
    ("NVIDIA-H100-80GB-HBM3", "81559", {"4g.40gb": 1, "3g.40gb": 1}, "h100-80gb"),
    ("NVIDIA-H100-80GB-HBM3", "81559", {"7g.80gb": 1}, "h100-80gb"),
    ("NVIDIA-H200", "143771", {"7g.141gb": 1}, "h200-141gb"),
], ids=["an H100 80GB split 4g.40gb + 3g.40gb", "an H100 80GB as one 7g.80gb", "an H200 as one 7g.141gb"])
def test_mig_gpus_of_a_node_whose_memory_label_is_below_the_nominal_hold_the_slices_it_advertises(
        product: str, memory_mib: str, mig: dict[str, int], model: str) -> None:
    # GPU feature discovery's nvidia.com/gpu.memory is what the driver reports (79.6 GiB for an H100 80GB),
    # while MIG profile names carry nominal memory: sizing the MIG GPUs by the label refused the 3g.40gb beside
    # a 4g.40gb, and made a node group with 7g.80gb invalid (the whole inventory failed to build).
    labelled = node("mixed", product, gpus=7, mig=mig, gpu_count=8)
    labelled["metadata"]["labels"]["nvidia.com/gpu.memory"] = memory_mib
    found = read_node(labelled)
    assert not isinstance(found, str)
    inventory = Inventory.from_spec(site("kube").model_copy(update={"gpus": node_groups([found])}))
    for n, (profile, count) in enumerate(mig.items()):
        placed = inventory.find(GpuRequest(count=count, mig_profile=profile), model)
        assert isinstance(placed, Placement), placed
        inventory.commit(f"j-{n}", placed)
    assert inventory.free()[model].free_gpus == 7


@pytest.mark.parametrize(("product", "memory_mib", "asked", "model"), [
    ("NVIDIA-H100-80GB-HBM3", "81559", 80, "h100-80gb"),
    ("NVIDIA-L4", "23034", 24, "l4"),
    ("Tesla-T4", "15109", 16, "t4"),
], ids=["an H100 80GB", "an L4", "a T4 with ECC on"])
def test_a_job_asking_a_gpus_nominal_memory_fits_the_whole_gpus_whose_driver_reports_a_little_less(
        product: str, memory_mib: str, asked: int, model: str) -> None:
    # The driver keeps a few per cent of a GPU's memory for itself, and nvidia.com/gpu.memory is what it reports:
    # sized by that label, an H100 80GB had 79.6 GiB, so a job asking for the 80 GiB it is sold with was refused.
    labelled = node("whole", product, gpus=8, gpu_count=8)
    labelled["metadata"]["labels"]["nvidia.com/gpu.memory"] = memory_mib
    found = read_node(labelled)
    assert not isinstance(found, str)
    inventory = Inventory.from_spec(site("kube").model_copy(update={"gpus": node_groups([found])}))
    assert isinstance(inventory.find(GpuRequest(count=8, memory_gib=asked), model), Placement)
    assert not isinstance(inventory.find(GpuRequest(count=1, memory_gib=asked + 1), model), Placement)


def test_whole_gpus_whose_memory_label_is_well_below_their_models_are_sized_by_the_label() -> None:
    # A variant with less memory than the model its product name reads as (here a 40 GiB label on a product read
    # as an H100 80GB) keeps the label: a job asking for more than the GPU has must not be placed there.
    labelled = node("small", "NVIDIA-H100-80GB-HBM3", gpus=8, gpu_count=8)
    labelled["metadata"]["labels"]["nvidia.com/gpu.memory"] = "40960"
    found = read_node(labelled)
    assert not isinstance(found, str)
    inventory = Inventory.from_spec(site("kube").model_copy(update={"gpus": node_groups([found])}))
    assert isinstance(inventory.find(GpuRequest(count=1, memory_gib=40), "h100-80gb"), Placement)
    assert not isinstance(inventory.find(GpuRequest(count=1, memory_gib=41), "h100-80gb"), Placement)


async def test_a_tenants_resource_quota_counts_slices_where_nodes_advertise_them_as_gpus(
        cluster: kmock.KubernetesEmulator) -> None:
    # Under the single MIG strategy a slice job's Pod asks nvidia.com/gpu for each slice; a ResourceQuota of
    # guarantee + burst whole GPUs would make the cluster refuse Pods the site admitted (the emulator does not
    # enforce ResourceQuotas, so the test reads the limit the adapter mirrors).
    single = node("single-mig", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", gpus=7, gpu_count=7)
    single["metadata"]["labels"] |= {"nvidia.com/gpu.memory": "4864", "nvidia.com/mig.strategy": "single"}
    cluster.objects[NODES, None, "single-mig"] = single
    adapter = make_site(cluster, quotas=[{"tenant": "t1", "guaranteed_gpus": 1, "burst_gpus": 1}])
    await adapter.start()
    try:
        assert cluster.objects[QUOTAS, "heliotrope-t1", "heliotrope-gpus"]["spec"]["hard"] == {
            "requests.nvidia.com/gpu": "14"}
    finally:
        await adapter.close()


def a100_40(name: str, single: bool) -> dict[str, Any]:
    """An A100-40GB Node as a whole GPU, or, after the GPU operator's MIG manager has reconfigured it to the
    single strategy, as seven 1g.5gb slices advertised as nvidia.com/gpu."""
    if not single:
        return node(name, "NVIDIA-A100-SXM4-40GB", gpus=1, gpu_count=1)
    relabelled = node(name, "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", gpus=7, gpu_count=7)
    relabelled["metadata"]["labels"] |= {"nvidia.com/gpu.memory": "4864", "nvidia.com/mig.strategy": "single"}
    return relabelled


def quota_writes(cluster: kmock.KubernetesEmulator) -> int:
    """ResourceQuota creations and patches the cluster was sent."""
    return sum(len(cluster[verb, kmock.resource(QUOTAS)]) for verb in (kmock.action.CREATE, kmock.action.UPDATE))


async def test_a_resource_quota_follows_nodes_that_change_mig_strategy(cluster: kmock.KubernetesEmulator) -> None:
    # A Node relabelled to the single MIG strategy (or back) changes what nvidia.com/gpu counts: the mirrored
    # limit must follow, or the cluster refuses Pods the site admitted (or lets through more than the quota).
    cluster.objects[NODES, None, "a100-40"] = a100_40("a100-40", single=False)
    adapter = make_site(cluster, quotas=[{"tenant": "t1", "guaranteed_gpus": 1, "burst_gpus": 1}])
    await adapter.start()
    try:
        key = (QUOTAS, "heliotrope-t1", "heliotrope-gpus")
        for single, limit in [(False, "2"), (True, "14"), (False, "2")]:
            cluster.objects[NODES, None, "a100-40"] = a100_40("a100-40", single)
            await adapter.snapshot()
            assert cluster.objects[key]["spec"]["hard"] == {"requests.nvidia.com/gpu": limit}
        await adapter.set_quota(TenantQuota(tenant="t1", guaranteed_gpus=2, burst_gpus=1))
        cluster.objects[NODES, None, "a100-40"] = a100_40("a100-40", single=True)
        assert (await adapter.submit(mig_attempt("m-1", 1, "1g.5gb"))).admitted  # a dispatch refreshes as well
        assert cluster.objects[key]["spec"]["hard"] == {"requests.nvidia.com/gpu": "21"}
        assert cluster.objects[key]["metadata"]["annotations"]["heliotrope.io/guaranteed-gpus"] == "2"
    finally:
        await adapter.close()


async def test_an_unchanged_inventory_does_not_rewrite_the_resource_quotas(kube: KubernetesSite,
                                                                           cluster: kmock.KubernetesEmulator) -> None:
    versions = len(cluster.objects[QUOTAS, "heliotrope-t1", "heliotrope-gpus"].history)  # kmock's resourceVersion
    writes = quota_writes(cluster)
    cluster.objects[NODES, None, "a100-0"]["metadata"]["labels"]["team"] = "vision"  # no change of MIG strategy
    for _ in range(3):
        await kube.snapshot()
    assert (await kube.submit(attempt("j-1", count=1))).admitted
    assert quota_writes(cluster) == writes
    assert len(cluster.objects[QUOTAS, "heliotrope-t1", "heliotrope-gpus"].history) == versions


async def test_a_resource_quota_the_cluster_refuses_to_update_is_tried_again_at_the_next_refresh(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    key = (QUOTAS, "heliotrope-t1", "heliotrope-gpus")
    real = k8s.CoreV1Api.patch_namespaced_resource_quota_without_preload_content
    refused: list[str] = []

    async def refuse(self: Any, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        refused.append(namespace)
        raise k8s.ApiException(status=403, reason="resourcequotas is forbidden")

    monkeypatch.setattr(k8s.CoreV1Api, "patch_namespaced_resource_quota_without_preload_content", refuse)
    kube.quota_retry_s = 0.0  # no wait between tries (the default backs off: the test below)
    cluster.objects[NODES, None, "a100-40"] = a100_40("a100-40", single=True)
    for _ in range(2):
        state = await kube.snapshot()  # the snapshot stands, and so does the quota in the site's own admission
        assert state.health == "healthy" and state.quota is not None and state.quota.tenant("t1") is not None
    assert refused == ["heliotrope-t1"] * 2 and cluster.objects[key]["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "8"}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "mirroring" in r.getMessage()]
    assert len(warnings) == 1 and "heliotrope-t1/heliotrope-gpus" in warnings[0] and "403" in warnings[0]
    assert (await kube.submit(attempt("j-1", count=8))).admitted
    assert not (await kube.submit(attempt("j-2", count=1))).admitted  # the site keeps t1 to 4 + 4 GPUs
    monkeypatch.setattr(k8s.CoreV1Api, "patch_namespaced_resource_quota_without_preload_content", real)
    await kube.snapshot()
    assert cluster.objects[key]["spec"]["hard"] == {"requests.nvidia.com/gpu": "56"}


async def test_a_resource_quota_write_that_fails_is_not_tried_at_every_refresh(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace that does not exist, or RBAC that refuses: the next try waits quota_retry_s (doubling), so
    the cluster is not asked at every broker cycle, nor is the site's report slowed by it."""
    refused: list[str] = []

    async def refuse(self: Any, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        refused.append(namespace)
        raise k8s.ApiException(status=403, reason="resourcequotas is forbidden")

    monkeypatch.setattr(k8s.CoreV1Api, "patch_namespaced_resource_quota_without_preload_content", refuse)
    cluster.objects[NODES, None, "a100-40"] = a100_40("a100-40", single=True)
    for _ in range(3):
        assert (await kube.snapshot()).health == "healthy"
    assert refused == ["heliotrope-t1"]  # one try; the next waits 30 s


async def test_a_quota_removed_while_its_resource_quota_is_being_rewritten_stays_removed(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    real = k8s.CoreV1Api.create_namespaced_resource_quota_without_preload_content
    writing = asyncio.Event()

    async def slow(self: Any, *args: Any, **kwargs: Any) -> Any:  # a write is a create first (409: then a patch)
        writing.set()
        await asyncio.sleep(0.3)
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(k8s.CoreV1Api, "create_namespaced_resource_quota_without_preload_content", slow)
    cluster.objects[NODES, None, "a100-40"] = a100_40("a100-40", single=True)  # the refresh rewrites t1's
    refresh = asyncio.ensure_future(kube.snapshot())
    await writing.wait()
    await kube.remove_quota("t1")
    await refresh
    await kube.snapshot()

    live = [name for (res, ns, name), obj in cluster.objects.items()
            if res.plural == "resourcequotas" and ns == "heliotrope-t1" and not obj.deleted]
    assert live == []  # not brought back by the write that was under way


@pytest.mark.parametrize("labels", [
    {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-SHARED", "nvidia.com/gpu.replicas": "4"},
    {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.replicas": "4"},
], ids=["GPU feature discovery marks the product shared", "only the replicas label tells"])
def test_a_node_whose_gpus_are_time_sliced_is_left_out_as_shared(labels: dict[str, str]) -> None:
    # The device plugin's time-slicing advertises each GPU 4 times as nvidia.com/gpu: 8 GPUs are 32 there.
    # Such a node was either counted as 32 whole GPUs or left out as a GPU model heliotrope does not know.
    shared = node("ts-0", None, gpus=32)
    shared["metadata"]["labels"] = labels
    why = read_node(shared)
    assert isinstance(why, str), why
    assert "node ts-0 shares each GPU among 4 Pods" in why and "unknown GPU model" not in why


async def test_a_cluster_without_gpu_nodes_is_unhealthy_and_refuses_jobs(cluster: kmock.KubernetesEmulator) -> None:
    for name in ("a100-0", "a100-1", "mig-0"):
        del cluster.objects[NODES, None, name]
    adapter = make_site(cluster)
    await adapter.start()
    try:
        state = await adapter.snapshot()
        assert state.health == "unhealthy" and "no usable GPU nodes" in (state.reason or "")
        assert not (await adapter.submit(attempt())).admitted
    finally:
        await adapter.close()


async def _a_site_with_a_quota_for_t1(cluster: kmock.KubernetesEmulator, clock: ManualClock | None = None,
                                      state_dir: Path | None = None,
                                      state_namespace: str | None = None) -> tuple[KubernetesSite, ManualClock]:
    """A started Kubernetes site on the emulator, on a manual clock, with tenant t1 guaranteed 4 GPUs and 12 more."""
    clock = clock or ManualClock(datetime(2026, 11, 30, tzinfo=UTC))
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=2,
                                     state_namespace=state_namespace)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump(), quotas=[
        {"tenant": "t1", "guaranteed_gpus": 4, "burst_gpus": 12}]), clock, state_dir=state_dir)
    await adapter.start()
    return adapter, clock


def _t1_usage(state) -> float:  # noqa: ANN001
    """Tenant t1's decayed usage (GPU-hours) in a site's state."""
    return next(t.decayed_usage_gpu_h for t in state.quota.tenants if t.tenant == "t1")


async def test_a_node_that_comes_or_goes_leaves_the_tenants_usage_history_and_fair_shares_as_they_were(
        cluster: kmock.KubernetesEmulator) -> None:
    # The ledgers are rebuilt whenever the Nodes change (a Node added, drained, NotReady): the tenant that used
    # the site all night must not count as fresh, nor the usage of its jobs still running count twice.
    adapter, clock = await _a_site_with_a_quota_for_t1(cluster)
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        assert (await adapter.submit(attempt("j-2", count=4))).admitted
        await clock.advance(3 * 3600)
        await adapter.cancel("j-1", 1)  # ended: only the history knows it ran
        await clock.advance(3600)
        before = _t1_usage(await adapter.snapshot())
        assert before > 20
        cluster.objects[NODES, None, "a100-2"] = node("a100-2", "NVIDIA-A100-SXM4-80GB", gpus=8)
        after = await adapter.snapshot()
        assert after.capacity[0].total_gpus == 27  # 16 + 3 MIG GPUs before: the ledgers were rebuilt with the new Node
        assert _t1_usage(after) == pytest.approx(before)
    finally:
        await adapter.close()


async def test_a_restarted_adapter_keeps_the_tenants_usage_history_and_charges_the_run_while_it_was_down_once(
        cluster: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    # A broker restart (or a site agent's) built the ledgers afresh: only the jobs still running counted, from their
    # starts, so the tenant that used the site all night came back with a clean slate.
    t0 = datetime(2026, 11, 30, tzinfo=UTC)
    adapter, clock = await _a_site_with_a_quota_for_t1(cluster, ManualClock(t0), state_dir=tmp_path)
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        assert (await adapter.submit(attempt("j-2", count=4))).admitted  # runs on through the restart
        await clock.advance(3 * 3600)
        await adapter.cancel("j-1", 1)  # ended before the restart: only the history knows it ran
        await clock.advance(3600)
        before = _t1_usage(await adapter.snapshot())
        assert before > 20
    finally:
        await adapter.close()
    await clock.advance(2 * 3600)  # down for two hours; j-2 runs on in the cluster
    # (the adapter re-enters j-2 at its Job's creationTimestamp, which the API server writes at creation; the
    # emulator writes none)
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{job_name('j-2', 1)}", json={"metadata": {
        "creationTimestamp": t0.strftime("%Y-%m-%dT%H:%M:%SZ")}})
    again, _ = await _a_site_with_a_quota_for_t1(cluster, clock, state_dir=tmp_path)
    try:
        after = _t1_usage(await again.snapshot())
    finally:
        await again.close()
    # what a site that never restarted reports: the same ledgers, the same runs (j-2's time away counted once)
    book = QuotaBook([TenantQuota(tenant="t1", guaranteed_gpus=4, burst_gpus=12)], FairSharePolicy(),
                     {"a100-80gb": 16})
    for job_id, gpus in (("j-1", 8), ("j-2", 4)):
        book.start(Ask(job_id, "t1", gpus, "a100-80gb", 0, False, None), t0.timestamp())
    book.stop("j-1", t0.timestamp() + 3 * 3600)
    uninterrupted = book.state(clock.now().timestamp())[0].decayed_usage_gpu_h
    assert after == pytest.approx(uninterrupted, rel=1e-3)
    fresh = QuotaBook([TenantQuota(tenant="t1", guaranteed_gpus=4, burst_gpus=12)], FairSharePolicy(),
                      {"a100-80gb": 16})  # without the history: j-2 alone
    fresh.start(Ask("j-2", "t1", 4, "a100-80gb", 0, False, None), t0.timestamp())
    assert after > 1.5 * fresh.state(clock.now().timestamp())[0].decayed_usage_gpu_h


async def test_a_replica_with_another_state_folder_takes_the_usage_history_kept_in_the_cluster(
        cluster: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    # Broker replicas each run the site's adapter with their own folder: the one that took over started the fair
    # share's window afresh. With state_namespace the history is kept in a ConfigMap too, and the later of the two
    # copies is taken.
    first, clock = await _a_site_with_a_quota_for_t1(cluster, state_dir=tmp_path / "a", state_namespace="hs")
    try:
        assert (await first.submit(attempt("j-1", count=8))).admitted
        await clock.advance(3 * 3600)
        await first.cancel("j-1", 1)
        await clock.advance(3600)
        before = _t1_usage(await first.snapshot())
        assert before > 10
    finally:
        await first.close()
    kept = cluster.objects[CONFIG_MAPS, "hs", "heliotrope-usage-kube"]["data"]["usage.json"]
    assert json.loads(kept)["accounts"][0]["tenant"] == "t1"
    (tmp_path / "b" / "kube").mkdir(parents=True)  # the other replica's folder, with an older save of its own
    (tmp_path / "b" / "kube" / "usage.json").write_text(json.dumps(
        {**json.loads(kept), "saved_at": json.loads(kept)["saved_at"] - 7200, "accounts": []}))
    second, _ = await _a_site_with_a_quota_for_t1(cluster, clock, state_dir=tmp_path / "b", state_namespace="hs")
    try:
        assert _t1_usage(await second.snapshot()) == pytest.approx(before)
    finally:
        await second.close()


async def test_a_site_removed_leaves_no_usage_history_in_the_cluster_for_a_new_site_of_its_name(
        cluster: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    # A site removed from the federation drops its usage history, so a new site of its name starts afresh: its
    # copy in the ConfigMap went on, and the new site took the old one's tenants' usage from it.
    first, clock = await _a_site_with_a_quota_for_t1(cluster, state_dir=tmp_path, state_namespace="hs")
    try:
        assert (await first.submit(attempt("j-1", count=8))).admitted
        await clock.advance(3 * 3600)
        await first.cancel("j-1", 1)
        assert _t1_usage(await first.snapshot()) > 10  # (saved, and queued for the ConfigMap)
    finally:
        await first.forget_quotas()  # the site leaves the federation
        await first.close()
    second, _ = await _a_site_with_a_quota_for_t1(cluster, clock, state_dir=tmp_path, state_namespace="hs")
    try:
        assert _t1_usage(await second.snapshot()) == 0
    finally:
        await second.close()


async def test_a_usage_history_write_that_fails_unexpectedly_leaves_later_saves_reaching_the_cluster(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A write that fails with what the writer does not expect (here a body that is no JSON) ended its task: no
    # later save reached the ConfigMap, and the adapter's close raised it (its API client left open).
    create = k8s.CoreV1Api.create_namespaced_config_map_without_preload_content
    calls: list[str] = []

    async def once_no_json(self: Any, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        calls.append(body["metadata"]["name"])
        if body["metadata"]["name"] == "heliotrope-usage-kube" and calls.count("heliotrope-usage-kube") == 1:
            raise ValueError("Expecting value: line 1 column 1 (char 0)")
        return await create(self, namespace, body, **kwargs)

    monkeypatch.setattr(k8s.CoreV1Api, "create_namespaced_config_map_without_preload_content", once_no_json)
    adapter, clock = await _a_site_with_a_quota_for_t1(cluster, state_dir=tmp_path, state_namespace="hs")
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        await adapter.snapshot()  # the first save: its write fails
        for _ in range(100):
            if "heliotrope-usage-kube" in calls:
                break
            await asyncio.sleep(0.02)
        await clock.advance(3600)
        await adapter.snapshot()  # the next save
        for _ in range(100):
            if (CONFIG_MAPS, "hs", "heliotrope-usage-kube") in cluster.objects:
                break
            await asyncio.sleep(0.02)
        kept = cluster.objects[CONFIG_MAPS, "hs", "heliotrope-usage-kube"]["data"]["usage.json"]
        assert json.loads(kept)["accounts"][0]["tenant"] == "t1"
    finally:
        await adapter.close()
    assert adapter._api is None  # (closed)


async def test_a_usage_history_the_cluster_holds_in_another_format_is_logged_and_the_file_taken(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # What another release or an operator left under usage.json must not keep the site from starting.
    first, clock = await _a_site_with_a_quota_for_t1(cluster, state_dir=tmp_path, state_namespace="hs")
    try:
        assert (await first.submit(attempt("j-1", count=8))).admitted
        await clock.advance(3 * 3600)
        await first.cancel("j-1", 1)
        before = _t1_usage(await first.snapshot())
    finally:
        await first.close()
    for garbage in ("no json", "[]", json.dumps({"v": 9, "saved_at": "later"})):
        await cluster.patch("/api/v1/namespaces/hs/configmaps/heliotrope-usage-kube",
                            json={"data": {"usage.json": garbage}})
        second, _ = await _a_site_with_a_quota_for_t1(cluster, clock, state_dir=tmp_path, state_namespace="hs")
        try:
            assert _t1_usage(await second.snapshot()) == pytest.approx(before)
        finally:
            await second.close()
        assert "the usage history in ConfigMap hs/heliotrope-usage-kube cannot be read" in caplog.text
        caplog.clear()


async def test_a_usage_history_saved_after_the_adapter_closed_is_not_written() -> None:
    # The writer is made at the first save; one after the close (none before it) would have been left running.
    calls: list[str] = []

    async def call(what: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        return {}

    kept = ClusterUsage("kube", "hs", call, lambda: k8s.CoreV1Api(k8s.ApiClient()))
    await kept.close()
    kept.put(b"{}")
    await asyncio.sleep(0.05)
    assert calls == [] and kept._task is None


async def test_jobs_that_end_while_every_node_is_away_add_no_usage_for_the_time_away(
        cluster: kmock.KubernetesEmulator) -> None:
    # Every GPU Node gone from the inventory (cordoned for maintenance, NotReady, a zone down): the site has no
    # ledgers, and what ends then is not taken off them. The history the ledgers had went on counting those jobs
    # as running, and the Nodes' return charged their tenant the whole time away as usage; a job that runs on
    # all the while is charged for it.
    adapter, clock = await _a_site_with_a_quota_for_t1(cluster)
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        assert (await adapter.submit(attempt("j-2", count=4))).admitted  # runs on all the while
        await clock.advance(3600)
        before = _t1_usage(await adapter.snapshot())
        for n in CLUSTER:
            del cluster.objects[NODES, None, n["metadata"]["name"]]
        cluster.resources[NODES] = {}  # (declared, with none left)
        assert (await adapter.snapshot()).capacity == []
        await adapter.cancel("j-1", 1)  # ended while the Nodes were away
        await clock.advance(10 * 3600)
        for n in CLUSTER:
            cluster.objects[NODES, None, n["metadata"]["name"]] = n
        after = _t1_usage(await adapter.snapshot())
        assert before < after <= before + 4 * 10  # j-2's ten hours at most (j-1's were 8 x 10 more)
    finally:
        await adapter.close()


# --- Jobs: creation, idempotent re-dispatch, refusal, cancel ---


async def test_a_job_becomes_a_batch_job_with_its_gpus_labels_and_model_affinity(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    assert (await kube.submit(attempt("j-1", 2, count=4))).admitted
    created = jobs(cluster)[("heliotrope-t1", job_name("j-1", 2))]
    labels = created["metadata"]["labels"]
    assert labels["heliotrope.io/job-id"] == "j-1" and labels["heliotrope.io/attempt"] == "2"
    assert labels["heliotrope.io/site"] == "kube" and labels["heliotrope.io/tenant"] == "t1"
    pod = created["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert pod["restartPolicy"] == "Never" and created["spec"]["backoffLimit"] == 0
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["values"] == ["NVIDIA-A100-SXM4-80GB"]
    assert (await kube.snapshot()).capacity[0].free_gpus == 12


@pytest.mark.parametrize(("checkpointable", "stop_wait_s", "grace_s"), [
    (True, 600, 595), (True, 20, 18), (True, 1.5, 1), (True, 0.5, 1), (False, 600, None)],
    ids=["a checkpointable job's Pod has all but 5 s of stop_wait_s to write its checkpoint",
         "or all but 10 % of a short one",
         "a stop_wait_s of a second or two leaves it a second",
         "a stop_wait_s under a second leaves it a second, not an immediate kill",
         "another job's Pod has the cluster's default"])
async def test_a_checkpointable_jobs_pod_has_as_long_to_stop_as_the_site_waits_for_it(
        cluster: kmock.KubernetesEmulator, checkpointable: bool, stop_wait_s: float, grace_s: int | None) -> None:
    # A stop (a move, a preemption) deletes the Job; the kubelet sends SIGTERM, then SIGKILL after the Pod's
    # terminationGracePeriodSeconds, 30 s unless set, while the adapter waits stop_wait_s for it and the broker
    # then keeps the run as checkpointed: a checkpoint that takes a minute was killed half-written. The wait
    # starts at the Job's delete, a little before the kubelet's SIGTERM: a grace of all of stop_wait_s let the
    # stop be reported while the checkpoint was still being written; one of 0 (stop_wait_s < 1) killed at once.
    adapter = make_site(cluster, stop_wait_s=stop_wait_s)
    await adapter.start()
    try:
        assert (await adapter.submit(attempt("j-1", count=8, checkpointable=checkpointable))).admitted
        pod = jobs(cluster)[("heliotrope-t1", job_name("j-1", 1))]["spec"]["template"]["spec"]
        assert pod.get("terminationGracePeriodSeconds") == grace_s
    finally:
        await adapter.close()


async def test_a_long_tenant_name_gives_a_namespace_kubernetes_accepts(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    # A tenant may be 63 characters, but "heliotrope-" + tenant may not: Kubernetes refuses a namespace name
    # past 63 characters (the emulator does not check, so the test does).
    long_a, long_b = "research-" + "a" * 54, "research-" + "a" * 53 + "b"
    await kube.set_quota(TenantQuota(tenant=long_a, guaranteed_gpus=1))
    assert (await kube.submit(attempt("j-1", count=1, tenant=long_a))).admitted
    [(namespace, _)] = jobs(cluster)
    assert len(namespace) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace)
    assert namespace.startswith("heliotrope-research-aaa")
    quota = cluster.objects[QUOTAS, namespace, "heliotrope-gpus"]  # its quota goes to the same namespace
    assert quota["spec"]["hard"] == {"requests.nvidia.com/gpu": "1"}
    assert kube.namespace(long_b) != namespace  # tenants that begin alike stay apart
    assert kube.namespace("t1") == "heliotrope-t1" and kube.namespace("x" * 52) == "heliotrope-" + "x" * 52


async def test_a_mig_job_asks_for_its_mig_resource(kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    assert (await kube.submit(mig_attempt("m-1", 2, "1g.10gb"))).admitted
    created = jobs(cluster)[("heliotrope-t1", job_name("m-1", 1))]
    assert created["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/mig-1g.10gb": "2"}
    assert (await kube.snapshot()).capacity[0].mig_free_slices["1g.10gb"] == 19


async def test_a_repeated_dispatch_finds_the_existing_job(kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    assert (await kube.submit(attempt("j-1", count=8))).admitted
    assert (await kube.submit(attempt("j-1", count=8))).admitted
    restarted = make_site(cluster)  # a broker restart: a fresh adapter, the same cluster
    await restarted.start()
    try:
        assert (await restarted.submit(attempt("j-1", count=8))).admitted
    finally:
        await restarted.close()
    assert list(jobs(cluster)) == [("heliotrope-t1", job_name("j-1", 1))]
    assert len(cluster[kmock.action.CREATE, kmock.resource("batch/v1/jobs")]) == 1
    assert (await kube.snapshot()).capacity[0].free_gpus == 8  # counted once


@pytest.mark.parametrize(("spec", "reason"), [
    ({"count": 9}, "no room"),
    ({"count": 1, "model": "h100-80gb"}, "no h100-80gb at this site"),
    ({"milli": 500}, "whole GPUs or MIG slices only"),
], ids=[
    "nine GPUs do not fit on one eight-GPU node",
    "a model the Nodes do not have is refused",
    "a fractional GPU is refused: the device plugin hands out whole GPUs",
])
async def test_the_site_policy_refuses_before_any_job_is_made(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, spec: dict[str, Any], reason: str) -> None:
    answer = await kube.submit(attempt(**spec))
    assert not answer.admitted and reason in (answer.reason or "")
    assert not jobs(cluster)


async def test_the_tenants_quota_is_applied_before_a_job_is_made(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    assert (await kube.submit(attempt("j-1", count=8))).admitted  # guarantee 4 + burst 4
    answer = await kube.submit(attempt("j-2", count=1))
    assert not answer.admitted
    assert list(jobs(cluster)) == [("heliotrope-t1", job_name("j-1", 1))]


async def test_cancel_deletes_the_job_and_is_final(kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    assert (await kube.submit(attempt("j-1", count=8))).admitted
    await kube.cancel("j-1", 1)
    assert not jobs(cluster)
    assert (await kube.snapshot()).capacity[0].free_gpus == 16
    again = await kube.submit(attempt("j-1", count=8))
    assert not again.admitted and "withdrawn" in (again.reason or "")
    await kube.cancel("j-never", 1)  # an attempt the cluster never had: nothing to delete, no error


async def test_a_cancel_that_comes_while_the_job_is_being_made_is_not_admitted_and_leaves_no_job(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker withdraws an attempt while the site is still making its Job (a cancel, a dispatch that timed
    out): cancel found no Job to delete, then the Job was made and the attempt admitted, running at a site
    the broker counts it gone from, with nobody to stop it."""
    make = kube._create_job

    async def made_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        answer = await make(*args, **kwargs)
        assert jobs(cluster)  # made: the cancel below comes in while the submit has not answered
        await kube.cancel("j-1", 1)
        return answer

    monkeypatch.setattr(kube, "_create_job", made_then_cancelled)
    answer = await kube.submit(attempt("j-1", count=8))
    assert not answer.admitted and "withdrawn" in (answer.reason or "")
    assert not jobs(cluster)
    assert (await kube.snapshot()).capacity[0].free_gpus == 16
    assert ("j-1", 1) not in await kube.known_attempts()


async def test_the_broker_asking_to_stop_a_job_deletes_it_as_a_preemption_with_its_run_time(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    # A move (policies.migration): the Job is deleted (its Pods get SIGTERM and their grace period to write a
    # checkpoint); once its Pod has gone, its GPUs are free and the broker hears "preempted" with the reason
    # and how long it ran, so the job is never restarted elsewhere while it still runs here.
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    await asyncio.sleep(0.2)
    await kube.preempt("j-1", 1, "moved from here to b from its checkpoint")
    assert not jobs(cluster)
    with pytest.raises(TimeoutError):  # its Pod is still writing its checkpoint
        await asyncio.wait_for(asyncio.shield(anext_task := asyncio.ensure_future(anext(stream))), 0.5)
    assert (await kube.snapshot()).capacity[0].free_gpus == 8
    await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")  # what the kubelet does once it exits
    stopped = await asyncio.wait_for(anext_task, 5)
    assert (stopped.job_id, stopped.attempt, stopped.kind) == ("j-1", 1, EventKind.PREEMPTED)
    assert stopped.reason == "moved from here to b from its checkpoint" and 0.1 < stopped.run_s < 5
    assert (await kube.snapshot()).capacity[0].free_gpus == 16
    await kube.preempt("j-1", 1, "again")  # it has ended: nothing more happens
    await kube.preempt("j-never", 1, "never here")
    with pytest.raises(TimeoutError):
        await next_event(kube, stream)


async def test_a_stop_whose_pods_never_go_is_reported_after_stop_wait_s(cluster: kmock.KubernetesEmulator) -> None:
    adapter = make_site(cluster, stop_wait_s=0.5)
    await adapter.start()
    stream = adapter.events()
    try:
        await j1_running(adapter, stream, cluster)
        await adapter.preempt("j-1", 1, "moved")
        stopped = await next_event(adapter, stream)  # the emulator runs no garbage collector: the Pod stays
        assert (stopped.kind, stopped.reason) == (EventKind.PREEMPTED, "moved")
    finally:
        await adapter.close()


async def test_a_stop_under_way_when_the_adapter_restarts_is_reported_once_its_pod_has_gone(
        cluster: kmock.KubernetesEmulator) -> None:
    # The broker asked to stop a job (a move), and restarted while the job's Pod still wrote its checkpoint.
    # The Job is gone, so the fresh adapter finds only the Pod: it must not let the broker take the attempt
    # for lost and start the job elsewhere meanwhile, nor hand its GPUs out.
    first = make_site(cluster)
    await first.start()
    stream = first.events()
    name = await j1_running(first, stream, cluster)
    await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={  # where the scheduler put it
        "spec": {"nodeName": "a100-0", "containers": [{"name": "job", "image": "x",
                                                      "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "status": {"startTime": "2026-11-28T01:00:00Z"}})
    await first.preempt("j-1", 1, "moved from here to b from its checkpoint")
    await first.close()
    assert not jobs(cluster)
    second = make_site(cluster)
    await second.start()
    events = second.events()
    try:
        assert ("j-1", 1) in await second.known_attempts()  # so a restarted broker does not requeue it yet
        state = await second.snapshot()
        assert state.capacity[0].free_gpus == 8 and state.running_jobs == 0  # its Pod holds a100-0's GPUs
        with pytest.raises(TimeoutError):  # not reported running again, nor stopped while the Pod is there
            await asyncio.wait_for(asyncio.shield(pending := asyncio.ensure_future(anext(events))), 0.5)
        await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")
        stopped = await asyncio.wait_for(pending, 5)
        assert (stopped.job_id, stopped.attempt, stopped.kind) == ("j-1", 1, EventKind.PREEMPTED)
        assert stopped.run_s > 60  # since the Pod's start, as the site knows it
        assert ("j-1", 1) not in await second.known_attempts()
        second._pods_read_at = None  # the Pods are re-read with the Nodes at most every pods_ttl_s
        assert (await second.snapshot()).capacity[0].free_gpus == 16
    finally:
        await second.close()


async def test_known_attempts_are_the_jobs_of_this_site(kube: KubernetesSite) -> None:
    assert (await kube.submit(attempt("j-1", 1))).admitted
    assert (await kube.submit(attempt("j-2", 3))).admitted
    assert await kube.known_attempts() == {("j-1", 1), ("j-2", 3)}


# --- status from the watch ---


async def test_the_watch_reports_running_then_succeeded(kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    stream = kube.events()
    assert (await kube.submit(attempt("j-1", count=2))).admitted
    name = job_name("j-1", 1)
    await pod_running(cluster, name)
    running = await next_event(kube, stream)
    assert (running.job_id, running.attempt, running.kind) == ("j-1", 1, EventKind.RUNNING)
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"status": {
        "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}})
    done = await next_event(kube, stream)
    assert (done.job_id, done.kind) == ("j-1", EventKind.SUCCEEDED)
    assert (await kube.snapshot()).capacity[0].free_gpus == 16


async def test_the_watch_reports_a_failed_job_with_its_reason(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    stream = kube.events()
    assert (await kube.submit(attempt("j-1"))).admitted
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{job_name('j-1', 1)}", json={"status": {
        "failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit"}]}})
    failed = await next_event(kube, stream)
    assert failed.kind == EventKind.FAILED and "BackoffLimitExceeded" in (failed.reason or "")


async def gone(cluster: kmock.KubernetesEmulator, name: str, namespace: str = "heliotrope-t1") -> bool:
    """Whether Job ``name`` is deleted within a second (the adapter deletes some in the background)."""
    for _ in range(20):
        if (namespace, name) not in jobs(cluster):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("outcome", ["succeeded", "failed"], ids=["a Job that succeeded", "a Job that failed"])
async def test_a_finished_job_is_deleted_once_the_broker_has_its_outcome(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, outcome: str) -> None:
    # The Jobs (and Pods) of every attempt ever run piled up in the tenants' namespaces, and in every list
    # of the Jobs the adapter makes; once the broker has stored the outcome nothing needs them.
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    condition = "Complete" if outcome == "succeeded" else "Failed"
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"status": {
        outcome: 1, "conditions": [{"type": condition, "status": "True"}]}})
    done = await next_event(kube, stream)
    assert done.kind == EventKind(outcome)
    assert not await gone(cluster, name)  # kept until the broker has the outcome (a restart reads it again)
    kube.taken(done)
    assert await gone(cluster, name)
    await asyncio.sleep(0.2)
    assert kube._events.empty()  # its deletion is no `lost`


async def test_the_attempts_that_ended_are_not_kept_for_ever(kube: KubernetesSite,
                                                              cluster: kmock.KubernetesEmulator) -> None:
    # Each attempt ever run stayed in the adapter's map for as long as it ran: a broker that runs for months
    # grew by one entry a job.
    stream = kube.events()
    ends: list[JobEvent] = []
    for round_ in range(3):
        for n, outcome in enumerate(("succeeded", "failed", "lost", "stopped", "cancelled")):
            job_id = f"j-{round_}-{n}"
            assert (await kube.submit(attempt(job_id))).admitted
            name = job_name(job_id, 1)
            await pod_running(cluster, name)
            assert (await next_event(kube, stream)).kind == EventKind.RUNNING
            if outcome in ("succeeded", "failed"):
                condition = "Complete" if outcome == "succeeded" else "Failed"
                await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"status": {
                    outcome: 1, "conditions": [{"type": condition, "status": "True"}]}})
            elif outcome == "lost":
                await cluster.delete(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}")
            elif outcome == "stopped":
                await kube.preempt(job_id, 1, "moved")
                await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")  # (the kubelet)
            else:
                await kube.cancel(job_id, 1)
                await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")
                continue  # (no event: the broker withdrew it)
            end = await next_event(kube, stream)
            assert end.kind == {"succeeded": EventKind.SUCCEEDED, "failed": EventKind.FAILED,
                                "lost": EventKind.LOST, "stopped": EventKind.PREEMPTED}[outcome]
            kube.taken(end)
            ends.append(end)
    for end in ends:
        assert await gone(cluster, job_name(end.job_id, end.attempt))
    await asyncio.sleep(0.3)  # (the last watch events of their Jobs and Pods)
    assert kube._attempts == {}
    assert kube._events.empty() and await kube.known_attempts() == set()
    again = await kube.submit(attempt("j-0-0"))  # a repeated dispatch of an attempt that ended starts nothing
    assert not again.admitted and not jobs(cluster)
    assert (await kube.snapshot()).capacity[0].free_gpus == 16


async def job_failed_for(cluster: kmock.KubernetesEmulator, name: str, pod_condition: str | None,
                         exit_code: int | None = None) -> None:
    """What the Job controller does when the Job's Pod failed with ``pod_condition`` True, its container ending
    with ``exit_code``: the first FailJob rule of the Job's podFailurePolicy that matches fails the Job naming
    the rule, else backoffLimit 0 is exceeded."""
    job_spec = jobs(cluster)[("heliotrope-t1", name)]["spec"]
    failed = {"reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}
    for i, rule in enumerate((job_spec.get("podFailurePolicy") or {}).get("rules") or []):
        codes = rule.get("onExitCodes") or {}
        if rule.get("action") == "FailJob" and any(
                c.get("type") == pod_condition for c in rule.get("onPodConditions") or []):
            failed = {"reason": "PodFailurePolicy", "message": f"Pod heliotrope-t1/{name}-abc has condition "
                                                               f"{pod_condition} matching FailJob rule at index {i}"}
            break
        if rule.get("action") == "FailJob" and exit_code is not None and codes.get("containerName") == "job" and (
                (exit_code in codes["values"]) == (codes["operator"] == "In")):
            failed = {"reason": "PodFailurePolicy", "message": f"Container job for pod heliotrope-t1/{name}-abc "
                                                               f"failed with exit code {exit_code} matching FailJob "
                                                               f"rule at index {i}"}
            break
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"status": {
        "failed": 1, "conditions": [{"type": "Failed", "status": "True"} | failed]}})


@pytest.mark.parametrize("pod_status", [
    None,
    {"phase": "Failed", "conditions": [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}]},
    {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."},
], ids=["a drain: the Job's failure arrives before its Pod's",
        "a drain: the Pod's eviction arrives first",
        "the kubelet evicting the Pod under memory pressure"])
async def test_a_pod_the_cluster_takes_away_is_lost_not_a_failed_attempt(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, pod_status: dict[str, Any] | None) -> None:
    # `kubectl drain` for maintenance, a Node gone, the kubelet short of memory: the job did not fail, and
    # must not use up one of its max_attempts (which counts failures only, not the loss of a site's GPUs).
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    if pod_status is not None:
        await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={"status": pod_status})
    await job_failed_for(cluster, name, "DisruptionTarget")
    lost = await next_event(kube, stream)
    assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
    assert "the cluster took its Pod away" in (lost.reason or "")
    assert (await kube.snapshot()).capacity[0].free_gpus == 16


def evicted(reason: str | None, message: str) -> dict[str, Any]:
    """A Pod's status as the kubelet (``reason`` TerminationByKubelet) or the cluster leaves it when it takes the
    Pod away: phase Failed, the DisruptionTarget condition (none where ``reason`` is None: an older cluster, whose
    kubelet sets the status reason ``Evicted`` only)."""
    status: dict[str, Any] = {"phase": "Failed", "message": message}
    if reason is None:
        return status | {"reason": "Evicted"}
    return status | {"reason": "Evicted" if reason == "TerminationByKubelet" else None, "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": message}]}


@pytest.mark.parametrize(("reason", "message"), [
    ("TerminationByKubelet", "Pod ephemeral local storage usage exceeds the total limit of containers 10Gi. "),
    ("TerminationByKubelet", 'Container job exceeded its local ephemeral storage limit "10Gi". '),
    (None, 'Usage of EmptyDir volume "scratch" exceeds the limit "1Gi". '),
    ("TerminationByKubelet", "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. "
                             "Container job was using 250Gi, request is 0, has larger consumption of memory. "),
], ids=["over its Pod's ephemeral-storage limit", "over its container's ephemeral-storage limit",
        "over its emptyDir's size limit (a cluster without DisruptionTarget)",
        "its container using memory it did not request while the node ran short"])
@pytest.mark.parametrize("pod_first", [True, False],
                         ids=["the Pod's eviction arrives first", "the Job's failure arrives before its Pod's"])
async def test_a_pod_the_kubelet_evicts_for_its_own_usage_is_a_failed_attempt(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, reason: str | None, message: str,
        pod_first: bool) -> None:
    # Reported lost, such a job was requeued, ran out of its disk or memory again, was evicted again, and so on
    # for ever: a loss never counts against max_attempts. It is the job's doing, as an OOMKill is.
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    if pod_first:
        await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={"status": evicted(
            reason, message)})
        await asyncio.sleep(0.1)
    else:  # (the Pod's update is in the cluster, but the Pods' watch has not brought it yet)
        cluster.objects[PODS, "heliotrope-t1", f"{name}-abc"]["status"] = evicted(reason, message)
    await job_failed_for(cluster, name, "DisruptionTarget")
    failed = await next_event(kube, stream)
    assert (failed.job_id, failed.kind) == ("j-1", EventKind.FAILED)
    assert failed.reason == f"the kubelet evicted its Pod for its own usage ({message.strip()})"
    assert (await kube.snapshot()).capacity[0].free_gpus == 16


@pytest.mark.parametrize(("reason", "message"), [
    ("EvictionByEvictionAPI", "Eviction API: evicting"),
    ("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"),
    ("PreemptionByScheduler", "default-scheduler: preempting to accommodate a higher priority pod"),
    ("DeletionByPodGC", "PodGC: node no longer exists"),
    ("TerminationByKubelet", "Pod was terminated in response to imminent node shutdown."),
    ("TerminationByKubelet", "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. "),
    # (a drain of a node whose own kubelet had named the Pod's usage earlier is still the drain's)
    ("EvictionByEvictionAPI", "Container job was using 250Gi, request is 0, has larger consumption of memory."),
], ids=["a drain", "a NoExecute taint", "the scheduler's preemption", "its Node gone", "a node shutdown",
        "node pressure naming none of its containers", "the Eviction API, whatever its message"])
async def test_a_pod_the_cluster_evicts_for_its_own_reasons_stays_lost(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, reason: str, message: str) -> None:
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={"status": evicted(
        reason, message)})
    await asyncio.sleep(0.1)
    await job_failed_for(cluster, name, "DisruptionTarget")
    lost = await next_event(kube, stream)
    assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
    assert lost.reason == f"the cluster took its Pod away ({reason}: {message})"


@pytest.mark.parametrize("pod_first", [True, False],
                         ids=["the Pod's end arrives first", "the Job's failure arrives before its Pod's"])
async def test_a_job_whose_pod_fails_on_its_own_is_a_failed_attempt_that_says_how(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, pod_first: bool) -> None:
    # "BackoffLimitExceeded: Job has reached the specified backoff limit" was all a user learnt of a job that
    # ran out of memory: the container's end says why.
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    if pod_first:
        await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={"status": {
            "phase": "Failed", "containerStatuses": [{"name": "job", "state": {"terminated": {
                "exitCode": 137, "reason": "OOMKilled"}}}]}})
    await job_failed_for(cluster, name, None, exit_code=137)
    failed = await next_event(kube, stream)
    assert failed.kind == EventKind.FAILED and "exit code 137" in (failed.reason or "")
    assert not pod_first or "its container ended OOMKilled, exit code 137" in (failed.reason or "")


async def test_a_pod_the_scheduler_cannot_place_is_named_in_a_warning_with_the_schedulers_reason(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, caplog: pytest.LogCaptureFixture) -> None:
    # The inventory placed it, the scheduler does not (GPUs it did not know were taken, a constraint it does not
    # model): the job waited with no word anywhere of why.
    assert (await kube.submit(attempt("j-1", count=8))).admitted
    name = job_name("j-1", 1)
    labels = dict(jobs(cluster)[("heliotrope-t1", name)]["spec"]["template"]["metadata"]["labels"])
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-abc", "labels": labels},
           "spec": {"containers": [{"name": "job", "image": "x"}]},
           "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                          "reason": "Unschedulable", "message": why}]}}
    with caplog.at_level("WARNING", logger="adapters.kubernetes"):
        assert (await cluster.post("/api/v1/namespaces/heliotrope-t1/pods", json=pod)).status == 200
        await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={"metadata": {
            "annotations": {"touched": "1"}}})  # another update, the same reason: not logged again
        await asyncio.sleep(0.3)
    said = [r.getMessage() for r in caplog.records if "cannot be scheduled" in r.getMessage()]
    assert len(said) == 1 and f"heliotrope-t1/{name}-abc of j-1 attempt 1" in said[0] and why in said[0]


UNPLACED = "0/3 nodes are available: 1 node(s) had untolerated taint {dedicated: infer}, 2 Insufficient nvidia.com/gpu."


async def unschedulable_pod(cluster: kmock.KubernetesEmulator, name: str, since: datetime,
                            namespace: str = "heliotrope-t1") -> None:
    """What the cluster's Job controller and scheduler would do for Job ``name`` where no Node has room: a
    Pending Pod whose PodScheduled condition is False, Unschedulable, since ``since``."""
    labels = dict(jobs(cluster)[(namespace, name)]["spec"]["template"]["metadata"]["labels"])
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-abc", "labels": labels},
           "spec": {"containers": [{"name": "job", "image": "x"}]},
           "status": {"phase": "Pending", "conditions": [{
               "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNPLACED,
               "lastTransitionTime": since.strftime("%Y-%m-%dT%H:%M:%SZ")}]}}
    assert (await cluster.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)).status == 200


async def test_a_pod_unschedulable_past_the_limit_has_its_attempt_withdrawn_and_reported_lost(
        cluster: kmock.KubernetesEmulator) -> None:
    # The site's scheduler disagrees with the adapter's inventory (a taint it did not see, fragmentation):
    # the Pod waited for ever, its GPUs held in the site's books, and the broker never moved the job.
    adapter = make_site(cluster, unschedulable_after_s=600)
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_sent(adapter)
        await unschedulable_pod(cluster, name, datetime.now(UTC) - timedelta(seconds=601))
        lost = await next_event(adapter, stream)
        assert (lost.job_id, lost.attempt, lost.kind) == ("j-1", 1, EventKind.LOST)
        assert UNPLACED in (lost.reason or "") and "unschedulable_after_s" in (lost.reason or "")
        assert await gone(cluster, name)
        assert (await adapter.snapshot()).capacity[0].free_gpus == 16  # its 8 GPUs are free again
        assert not (await adapter.submit(attempt("j-1", count=8))).admitted  # withdrawn: final for the attempt
    finally:
        await adapter.close()


class SkewedClock(SystemClock):
    """The broker's host clock, ``ahead_s`` ahead of the true time (and of the emulator's, which is the true one;
    negative: behind)."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead = timedelta(seconds=ahead_s)

    def now(self) -> datetime:
        return super().now() + self.ahead


@pytest.mark.parametrize(("ahead_s", "podless"), [(600, False), (-600, False), (600, True)], ids=[
    "a Pod unschedulable, the broker's clock 10 minutes ahead of the cluster's",
    "a Pod unschedulable, the broker's clock 10 minutes behind",
    "a Job the cluster makes no Pod for, the broker's clock 10 minutes ahead"])
async def test_the_unschedulable_wait_is_counted_on_the_clusters_clock(
        cluster: kmock.KubernetesEmulator, caplog: pytest.LogCaptureFixture, ahead_s: float, podless: bool) -> None:
    # The wait starts from the cluster's timestamps (lastTransitionTime, creationTimestamp), written by the API
    # server's clock, and was counted on the broker's: a broker host 10 minutes ahead withdrew every Pod the
    # scheduler had not placed at once, one 10 minutes behind only 10 minutes late. The adapter reads the skew
    # from the Date header of the API server's answers and counts the wait on the cluster's clock.
    adapter = make_site(cluster, unschedulable_after_s=300, clock=SkewedClock(ahead_s))
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_sent(adapter)
        # Waiting for 296 s of the cluster's time (to the second: up to 297 s), else for 302 s (303 s)
        since = datetime.now(UTC) - timedelta(seconds=296 if ahead_s > 0 else 302)
        if podless:
            await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"metadata": {
                "creationTimestamp": since.strftime("%Y-%m-%dT%H:%M:%SZ")}})
        else:
            await unschedulable_pod(cluster, name, since)
        if ahead_s > 0:  # 896 s by the broker's clock: not withdrawn before its 300 s have passed on the cluster's
            await asyncio.sleep(1.5)
            assert adapter._events.empty() and ("heliotrope-t1", name) in jobs(cluster)
        lost = await asyncio.wait_for(anext(stream), 8)  # (302 s: at once, not after 10 more minutes)
        assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
        waited_s = float(re.search(r" (\d+) s", lost.reason or "")[1])
        assert 299 <= waited_s <= 310, lost.reason  # as the cluster counts it (896 s by the broker's clock ahead)
        assert await gone(cluster, name)
        said = [r.getMessage() for r in caplog.records if "the API server's clock is" in r.getMessage()]
        assert len(said) == 1 and f"10.0 minutes {'behind' if ahead_s > 0 else 'ahead of'} the broker's" in said[0]
    finally:
        await adapter.close()


@pytest.mark.parametrize("after_s", [0, None], ids=["unschedulable_after_s: 0", "unschedulable_after_s: null"])
async def test_an_unschedulable_pod_may_be_left_waiting_for_ever(cluster: kmock.KubernetesEmulator,
                                                                  after_s: float | None) -> None:
    adapter = make_site(cluster, unschedulable_after_s=after_s)
    await adapter.start()
    try:
        name = await j1_sent(adapter)
        await unschedulable_pod(cluster, name, datetime.now(UTC) - timedelta(days=1))
        await asyncio.sleep(0.5)
        assert adapter._events.empty() and ("heliotrope-t1", name) in jobs(cluster)
    finally:
        await adapter.close()


def test_unschedulable_after_s_is_checked_and_stored_only_where_set() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unschedulable_after_s"):
        KubernetesAdapterConfig(unschedulable_after_s=-1)
    assert KubernetesAdapterConfig.model_validate({"unschedulable_after_s": 120}).model_dump()[
        "unschedulable_after_s"] == 120
    # The default is left out, so brokers of earlier releases sharing the database still read the site.
    assert "unschedulable_after_s" not in KubernetesAdapterConfig().model_dump()


async def test_a_job_whose_pods_the_cluster_refuses_to_create_has_its_attempt_withdrawn(
        cluster: kmock.KubernetesEmulator) -> None:
    # Pod Security admission, a LimitRange or a ResourceQuota of the cluster's own refuses the Job's Pod: the Job
    # controller records a FailedCreate Event and no condition, and the Job stays without Pods. It waited for ever.
    adapter = make_site(cluster, unschedulable_after_s=600)
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_sent(adapter)
        made = (datetime.now(UTC) - timedelta(seconds=601)).strftime("%Y-%m-%dT%H:%M:%SZ")
        # (what the API server writes at creation; the emulator writes none)
        await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"metadata": {
            "creationTimestamp": made}})
        lost = await next_event(adapter, stream)
        assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
        assert f"made no Pod for its Job heliotrope-t1/{name}" in (lost.reason or "")
        assert "kubectl describe job" in (lost.reason or "")  # (no Event says why)
        # The commonest refusal, and what the site's operator can do about it:
        assert "a namespace that enforces restricted takes the Pods of adapter.pod_security: restricted" in (
            lost.reason or "")
        assert await gone(cluster, name)
        assert (await adapter.snapshot()).capacity[0].free_gpus == 16
    finally:
        await adapter.close()


def failed_create(job: str, message: str, at: datetime, name: str, kind: str = "Job") -> dict[str, Any]:
    """A core/v1 Event as the Job controller records it when the API server refuses the Job's Pod."""
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "heliotrope-t1"},
            "involvedObject": {"kind": kind, "name": job, "namespace": "heliotrope-t1"}, "reason": "FailedCreate",
            "type": "Warning", "message": message, "lastTimestamp": at.strftime("%Y-%m-%dT%H:%M:%SZ")}


@pytest.mark.parametrize("events_readable", [True, False], ids=["its latest FailedCreate Event says why",
                                                                  "Events it may not read"])
async def test_a_job_the_cluster_makes_no_pod_for_is_withdrawn_with_the_clusters_reason(
        cluster: kmock.KubernetesEmulator, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        events_readable: bool) -> None:
    # Only the Job's Events say why the cluster refuses its Pod; the submitter read "Pod Security admission, a
    # LimitRange or a ResourceQuota" and had to ask the cluster's operator which.
    adapter = make_site(cluster, unschedulable_after_s=600)
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_sent(adapter)
        now = datetime.now(UTC)
        psa = ('pods "{0}-x7k2p" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation '
               '!= false (container "job" must set securityContext.allowPrivilegeEscalation=false), unrestricted '
               'capabilities (container "job" must set securityContext.capabilities.drop=["ALL"])').format(name)
        for event in (failed_create(name, "an older refusal", now - timedelta(seconds=500), "e1"),
                      failed_create(name, psa, now - timedelta(seconds=30), "e2"),
                      failed_create("another-job", "not this Job's", now, "e3"),
                      failed_create(name, "not the Job's own", now, "e4", kind="Pod")):
            cluster.objects[EVENTS, "heliotrope-t1", event["metadata"]["name"]] = event
        if not events_readable:  # RBAC without list on events: the API server answers 403

            async def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
                raise k8s.ApiException(status=403, reason='events is forbidden: cannot list resource "events"')

            monkeypatch.setattr(k8s.CoreV1Api, "list_namespaced_event_without_preload_content", refuse)
        await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"metadata": {
            "creationTimestamp": (now - timedelta(seconds=601)).strftime("%Y-%m-%dT%H:%M:%SZ")}})
        lost = await next_event(adapter, stream)
        assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
        if events_readable:
            assert f"made no Pod for its Job heliotrope-t1/{name} in " in lost.reason and psa in lost.reason
            assert "older" not in lost.reason and "not this" not in lost.reason and "own" not in lost.reason
            assert "takes the Pods of adapter.pod_security: restricted" in lost.reason  # (what the operator can do)
        else:
            assert "Pod Security admission" in lost.reason and "a LimitRange or a ResourceQuota" in lost.reason
            assert "cannot read the Events of Job" in caplog.text and "grant list on events" in caplog.text
    finally:
        await adapter.close()


async def test_a_job_whose_pod_came_is_not_taken_for_one_without(cluster: kmock.KubernetesEmulator) -> None:
    adapter = make_site(cluster, unschedulable_after_s=600)
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_running(adapter, stream, cluster)
        await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"metadata": {
            "creationTimestamp": (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")}})
        await asyncio.sleep(0.5)
        assert adapter._events.empty() and ("heliotrope-t1", name) in jobs(cluster)
    finally:
        await adapter.close()


async def test_a_pod_briefly_unschedulable_is_left_to_the_scheduler(cluster: kmock.KubernetesEmulator) -> None:
    # During a preemption, or while the autoscaler adds a Node, a Pod is unschedulable for a while and then
    # placed: it must not be withdrawn meanwhile.
    adapter = make_site(cluster, unschedulable_after_s=2)
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_sent(adapter)
        await unschedulable_pod(cluster, name, datetime.now(UTC))  # (to the second: up to 1 s ago)
        await asyncio.sleep(0.5)
        await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc", json={"spec": {
            "nodeName": "a100-0"}, "status": {"phase": "Running", "conditions": [
                {"type": "PodScheduled", "status": "True"}]}})
        assert (await next_event(adapter, stream)).kind == EventKind.RUNNING
        await asyncio.sleep(2.0)
        assert adapter._events.empty() and ("heliotrope-t1", name) in jobs(cluster)
    finally:
        await adapter.close()


async def test_a_pod_unschedulable_while_a_stop_makes_room_waits_for_it(cluster: kmock.KubernetesEmulator) -> None:
    # The site preempted a job to make room for this one: the new Pod is unschedulable until the victim's Pod,
    # writing its checkpoint, has gone. Withdrawing it meanwhile would stop one job for nothing.
    adapter = make_site(cluster, unschedulable_after_s=1, quotas=[{"tenant": "t1", "guaranteed_gpus": 16}])
    await adapter.start()
    stream = adapter.events()
    try:
        name = await j1_running(adapter, stream, cluster)
        await adapter.preempt("j-1", 1, "moved to a cleaner site")  # its Pod goes on writing its checkpoint
        assert (await adapter.submit(attempt("j-2", count=8))).admitted
        await unschedulable_pod(cluster, job_name("j-2", 1), datetime.now(UTC) - timedelta(seconds=5))
        await asyncio.sleep(1.5)
        assert adapter._events.empty() and ("heliotrope-t1", job_name("j-2", 1)) in jobs(cluster)
        await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")  # its checkpoint written
        assert (await next_event(adapter, stream)).kind == EventKind.PREEMPTED
        await asyncio.sleep(0.5)
        assert adapter._events.empty()  # the scheduler has its grace to place the Pod now
    finally:
        await adapter.close()


@pytest.mark.parametrize("restart", [False, True], ids=["the Pod watch reconnects", "a new adapter takes over"])
async def test_the_time_a_pod_has_been_unschedulable_outlives_a_reconnect(
        cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch, restart: bool) -> None:
    # Measured from the PodScheduled condition's lastTransitionTime, not from when this watch or this adapter
    # first saw it: a watch that ends every 300 s (or a broker restarting) must not put the withdrawal off for ever.
    real = k8s.CoreV1Api.list_pod_for_all_namespaces_without_preload_content
    streams = []

    async def kept(self: Any, *args: Any, **kwargs: Any) -> Any:
        resp = await real(self, *args, **kwargs)
        if kwargs.get("watch"):
            streams.append(resp)
        return resp

    monkeypatch.setattr(k8s.CoreV1Api, "list_pod_for_all_namespaces_without_preload_content", kept)
    adapter = make_site(cluster, unschedulable_after_s=4)
    await adapter.start()
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        since = datetime.now(UTC).replace(microsecond=0)
        await unschedulable_pod(cluster, job_name("j-1", 1), since)
        await asyncio.sleep(2.5)
        if restart:
            await adapter.close()
            adapter = make_site(cluster, unschedulable_after_s=4)
            await adapter.start()
        else:
            streams[-1].close()  # the watch ends (its 300 s timeout); the adapter lists the Pods again
        lost = await next_event(adapter, adapter.events())
        assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
        assert (lost.at - since).total_seconds() < 5.5  # (from when it was first seen again: 6.5 s or more)
    finally:
        await adapter.close()


async def waiting_pod(cluster: kmock.KubernetesEmulator, name: str, waiting: dict[str, str],
                      started: datetime | None = None) -> None:
    """Job ``name``'s Pod, placed on a100-0 and started by the kubelet at ``started`` (now), its container
    waiting for ``waiting``."""
    labels = dict(jobs(cluster)[("heliotrope-t1", name)]["spec"]["template"]["metadata"]["labels"])
    started = started or datetime.now(UTC)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-abc", "labels": labels},
           "spec": {"nodeName": "a100-0", "containers": [{"name": "job", "image": "x"}]},
           "status": {"phase": "Pending", "startTime": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                      "containerStatuses": [{"name": "job", "state": {"waiting": waiting}}]}}
    assert (await cluster.post("/api/v1/namespaces/heliotrope-t1/pods", json=pod)).status == 200


PULL_BACKOFF = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nvcr.io/nvidia/pytorhc:24.05-py3"'}
PULL_FAILED = {"reason": "ErrImagePull", "message": "429 Too Many Requests: toomanyrequests: rate limit exceeded"}
NO_SECRET = {"reason": "CreateContainerConfigError", "message": 'secret "wandb" not found'}


@pytest.mark.parametrize(("waiting", "started_s_ago"), [
    ({"reason": "InvalidImageName", "message": 'couldn\'t parse image name "nvcr.io//pytorch"'}, 0),
    ({"reason": "ErrImageNeverPull", "message": 'Container image "pytorch:x" is not present with pull policy of '
                                                "Never"}, 0),
    (PULL_BACKOFF, 301), (NO_SECRET, 600),
], ids=["an image name that is none", "an image never pulled that is not there",
        "an image that could not be pulled for unschedulable_after_s", "a Secret missing for longer"])
async def test_a_pod_that_cannot_start_fails_its_attempt_and_frees_its_gpus(
        kube: KubernetesSite, cluster: kmock.KubernetesEmulator, waiting: dict[str, str], started_s_ago: int) -> None:
    # The kubelet retries for ever and the Job waits for ever: without this the attempt held its GPUs for ever,
    # and the broker never heard why the job does not run. (An adapter that restarts, or a watch that reconnects,
    # finds the Pod waiting since its startTime, and does not wait unschedulable_after_s (300 s here) again.)
    stream = kube.events()
    assert (await kube.submit(attempt("j-1", count=8))).admitted
    name = job_name("j-1", 1)
    await waiting_pod(cluster, name, waiting, datetime.now(UTC) - timedelta(seconds=started_s_ago))
    failed = await next_event(kube, stream)
    assert (failed.job_id, failed.kind) == ("j-1", EventKind.FAILED)
    assert waiting["reason"] in (failed.reason or "") and waiting["message"] in (failed.reason or "")
    assert await gone(cluster, name)
    assert (await kube.snapshot()).capacity[0].free_gpus == 16
    await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")  # (the garbage collector)
    await asyncio.sleep(0.2)
    assert kube._events.empty()  # nothing more of it: no `lost` for the Job it deleted itself


@pytest.mark.parametrize("waiting", [PULL_FAILED, PULL_BACKOFF, NO_SECRET],
                         ids=["a registry's rate limit", "an image pull backing off", "a Secret made after the Pod"])
async def test_a_pod_waiting_for_what_may_yet_come_fails_only_after_unschedulable_after_s(
        cluster: kmock.KubernetesEmulator, waiting: dict[str, str]) -> None:
    # A registry down for a minute, Docker Hub's rate limit, a Secret created just after the Job: the first
    # ErrImagePull failed the attempt for good, where the kubelet's next try would have started it.
    adapter = make_site(cluster, unschedulable_after_s=3)
    await adapter.start()
    try:
        stream = adapter.events()
        for job_id in ("j-1", "j-2"):
            assert (await adapter.submit(attempt(job_id, count=8))).admitted
            await waiting_pod(cluster, job_name(job_id, 1), waiting)
        await asyncio.sleep(1.0)  # (its startTime, in whole seconds, may be a second before)
        assert adapter._events.empty()  # not yet: the kubelet tries again
        # j-1's image comes (the registry is back): it runs
        await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{job_name('j-1', 1)}-abc", json={"status": {
            "phase": "Running", "containerStatuses": [{"name": "job", "state": {"running": {}}}]}})
        running = await next_event(adapter, stream)
        assert (running.job_id, running.kind) == ("j-1", EventKind.RUNNING)
        failed = await next_event(adapter, stream)  # j-2's does not: it fails, its GPUs freed
        assert (failed.job_id, failed.kind) == ("j-2", EventKind.FAILED)
        assert waiting["message"] in (failed.reason or "") and "cannot start for " in (failed.reason or "")
        assert await gone(cluster, job_name("j-2", 1))
        await asyncio.sleep(1.0)
        assert adapter._events.empty()  # j-1 runs on
        assert (await adapter.snapshot()).capacity[0].free_gpus == 8
    finally:
        await adapter.close()


async def test_a_job_deleted_outside_heliotrope_is_lost(kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    stream = kube.events()
    assert (await kube.submit(attempt("j-1"))).admitted
    await cluster.delete(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{job_name('j-1', 1)}")
    lost = await next_event(kube, stream)
    assert lost.kind == EventKind.LOST and "deleted outside heliotrope" in (lost.reason or "")


async def test_a_job_deleted_while_the_watch_reconnects_is_lost(
        cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    # The Job watch ends (the server's timeout, an API server restart) and cannot reconnect for a while;
    # meanwhile someone deletes the Job. The watch that comes back never sees a DELETED event for it, so the
    # adapter must notice from a list that it has gone, or the attempt holds its 8 GPUs for ever.
    real = k8s.BatchV1Api.list_job_for_all_namespaces_without_preload_content
    outage, streams = asyncio.Event(), []

    async def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        if outage.is_set():
            raise aiohttp.ClientConnectionError("the API server is restarting")
        resp = await real(self, *args, **kwargs)
        if kwargs.get("watch"):
            streams.append(resp)
        return resp

    monkeypatch.setattr(k8s.BatchV1Api, "list_job_for_all_namespaces_without_preload_content", flaky)
    adapter = make_site(cluster)
    await adapter.start()
    stream = adapter.events()
    try:
        assert (await adapter.submit(attempt("j-1", count=8))).admitted
        await asyncio.sleep(0.2)
        outage.set()
        streams[-1].close()  # the stream ends; reconnecting fails while the outage lasts
        await asyncio.sleep(0.2)
        await cluster.delete(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{job_name('j-1', 1)}")
        outage.clear()
        lost = await next_event(adapter, stream)
        assert (lost.job_id, lost.kind) == ("j-1", EventKind.LOST)
        assert "deleted outside heliotrope" in (lost.reason or "")
        assert (await adapter.snapshot()).capacity[0].free_gpus == 16
    finally:
        await adapter.close()


# --- quotas mirrored as ResourceQuota ---


async def test_quotas_are_mirrored_as_resource_quotas(kube: KubernetesSite, cluster: kmock.KubernetesEmulator) -> None:
    mirrored = cluster.objects[QUOTAS, "heliotrope-t1", "heliotrope-gpus"]
    assert mirrored["spec"]["hard"] == {"requests.nvidia.com/gpu": "8"}
    await kube.set_quota(TenantQuota(tenant="t1", guaranteed_gpus=2, burst_gpus=1))
    assert cluster.objects[QUOTAS, "heliotrope-t1", "heliotrope-gpus"]["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "3"}
    await kube.set_quota(TenantQuota(tenant="t2", guaranteed_gpus=1))
    assert cluster.objects[QUOTAS, "heliotrope-t2", "heliotrope-gpus"]["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "1"}
    state = await kube.remove_quota("t1")
    assert cluster.objects[QUOTAS, "heliotrope-t1", "heliotrope-gpus"].deleted
    assert state.tenant("t2") is not None


# --- what runs already: a broker restart, Pods outside heliotrope ---


async def test_a_fresh_adapter_counts_the_active_jobs_of_the_one_before(cluster: kmock.KubernetesEmulator) -> None:
    quotas = [{"tenant": "t1", "guaranteed_gpus": 8, "burst_gpus": 8}]
    first = make_site(cluster, quotas=quotas)
    await first.start()
    try:
        assert (await first.submit(attempt("j-1", count=8))).admitted
        assert (await first.submit(attempt("j-2", count=4))).admitted
    finally:
        await first.close()
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{job_name('j-2', 1)}",
                        json={"status": {"startTime": "2024-05-01T12:00:00Z"}})
    second = make_site(cluster, quotas=quotas)  # a broker restart: a fresh adapter, the same cluster
    await second.start()
    try:
        state = await second.snapshot()
        assert state.capacity[0].free_gpus == 4
        assert state.quota is not None and state.quota.tenant("t1").in_use_gpus == 12
        refused = await second.submit(attempt("j-3", count=6))
        assert not refused.admitted
        assert (await second.submit(attempt("j-3", count=4))).admitted
        await second.cancel("j-1", 1)  # an adopted job is released when it ends
        assert (await second.snapshot()).capacity[0].free_gpus == 8
    finally:
        await second.close()


async def test_a_job_running_before_the_adapter_restarted_keeps_its_run_time(cluster: kmock.KubernetesEmulator) -> None:
    # A checkpointable job has run for an hour when the broker restarts; later it is moved. The run it had
    # before the restart counts, so the broker keeps its checkpoint's work (it counted from the restart).
    first = make_site(cluster)
    await first.start()
    try:
        name = await j1_running(first, first.events(), cluster)
    finally:
        await first.close()
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    await cluster.patch(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc",
                        json={"status": {"startTime": an_hour_ago.strftime("%Y-%m-%dT%H:%M:%SZ")}})
    second = make_site(cluster)
    await second.start()
    stream = second.events()
    try:
        running = await next_event(second, stream)  # once, at the Pod's start: the broker ignores it if it knew
        assert running.kind == EventKind.RUNNING and abs((running.at - an_hour_ago).total_seconds()) < 1
        await second.preempt("j-1", 1, "moved")
        await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")
        stopped = await next_event(second, stream)
        assert stopped.kind == EventKind.PREEMPTED and 3599 < stopped.run_s < 3660
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(stream), 0.3)
    finally:
        await second.close()


def foreign_pod(name: str, node_name: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "other"},
            "spec": {"nodeName": node_name, "containers": [
                {"name": "x", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


async def test_gpus_of_pods_outside_heliotrope_are_not_free(cluster: kmock.KubernetesEmulator) -> None:
    del cluster.objects[NODES, None, "a100-1"]
    cluster.objects[PODS, "other", "train"] = foreign_pod("train", "a100-0", 4)
    cluster.objects[PODS, "other", "done"] = foreign_pod("done", "a100-0", 4, phase="Succeeded")
    adapter = make_site(cluster)
    adapter.pods_ttl_s = 0.0
    await adapter.start()
    try:
        assert (await adapter.snapshot()).capacity[0].free_gpus == 4
        answer = await adapter.submit(attempt("j-1", count=6))
        assert not answer.admitted and "no room" in (answer.reason or "")
        assert not jobs(cluster)
        await cluster.delete("/api/v1/namespaces/other/pods/train")  # it ended: its GPUs are free again
        assert (await adapter.snapshot()).capacity[0].free_gpus == 8
        assert (await adapter.submit(attempt("j-1", count=6))).admitted
    finally:
        await adapter.close()


async def test_gpus_of_pods_outside_heliotrope_on_a_node_that_replaced_another_of_its_shape_are_not_free(
        cluster: kmock.KubernetesEmulator) -> None:
    # A node pool upgrade or the autoscaler replaces a100-1 by a100-2, alike: the node groups are unchanged, but
    # the adapter still knew the Nodes by their old names, so it did not count what other Pods take on a100-2.
    adapter = make_site(cluster)
    adapter.pods_ttl_s = 0.0
    await adapter.start()
    try:
        assert (await adapter.snapshot()).capacity[0].free_gpus == 16
        del cluster.objects[NODES, None, "a100-1"]
        cluster.objects[NODES, None, "a100-2"] = node("a100-2", "NVIDIA-A100-SXM4-80GB", gpus=8)
        cluster.objects[PODS, "other", "train"] = foreign_pod("train", "a100-2", 8)
        assert (await adapter.snapshot()).capacity[0].free_gpus == 8
        assert (await adapter.submit(attempt("j-1", count=8))).admitted  # on a100-0
        assert not (await adapter.submit(attempt("j-2", count=8))).admitted  # a100-2's GPUs are taken
    finally:
        await adapter.close()


# --- preemption ---


async def stopped_while_no_adapter_ran(cluster: kmock.KubernetesEmulator, state_dir: Path, stop,  # noqa: ANN001
                                       state_namespace: str | None = None) -> float:
    """Tenant a runs j-0 on its guarantee and j-1 on tenant b's, all 16 GPUs, for half a second; then
    ``stop(adapter)`` stops j-1; the adapter closes, and j-1's Pod goes while none runs. Returns how long j-1
    ran before the stop, at least."""
    first = make_site(cluster, state_dir=state_dir, state_namespace=state_namespace,
                      quotas=[{"tenant": "a", "guaranteed_gpus": 8, "burst_gpus": 8},
                              {"tenant": "b", "guaranteed_gpus": 8}])
    await first.start()
    stream = first.events()
    try:
        for name in ("j-0", "j-1"):
            assert (await first.submit(attempt(name, count=8, tenant="a", preemptible=True))).admitted
        await pod_running(cluster, job_name("j-1", 1), "heliotrope-a")
        assert (await next_event(first, stream)).kind == EventKind.RUNNING
        await asyncio.sleep(0.5)
        await stop(first)
        assert ("heliotrope-a", job_name("j-1", 1)) not in jobs(cluster)
    finally:
        await first.close()
    await cluster.delete(f"/api/v1/namespaces/heliotrope-a/pods/{job_name('j-1', 1)}-abc")
    return 0.5


async def broker_asks(adapter: KubernetesSite) -> None:
    """The broker's stop of j-1: a move."""
    await adapter.preempt("j-1", 1, "moved from kube to b from its checkpoint")


async def site_reclaims(adapter: KubernetesSite) -> None:
    """The site's own stop of j-1: tenant b reclaims its guarantee."""
    assert (await adapter.submit(attempt("k-1", count=8, tenant="b"))).admitted


STOPS = {"the broker's": broker_asks, "the site's own": site_reclaims}


async def reported_stopped(adapter: KubernetesSite, events: Any, stop: str, ran: float) -> JobEvent:
    """The adapter that starts after j-1's stop (``STOPS[stop]``) knows the attempt, then reports it on
    ``events`` preempted, for the reason it was stopped, with its run up to the stop (at least ``ran`` s)."""
    assert ("j-1", 1) in await adapter.known_attempts()
    stopped = await next_event(adapter, events)
    assert (stopped.job_id, stopped.attempt, stopped.kind) == ("j-1", 1, EventKind.PREEMPTED)
    if stop == "the broker's":
        assert stopped.reason == "moved from kube to b from its checkpoint"
    else:
        assert "for job k-1" in (stopped.reason or "")
    assert ran <= stopped.run_s < 5
    return stopped


@pytest.mark.parametrize("stop", ["the broker's", "the site's own"])
async def test_a_stop_whose_pods_go_while_no_adapter_runs_is_reported_by_the_next_one(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, stop: str) -> None:
    # The job's Pod wrote its checkpoint and exited while the broker restarted: nothing of it is left in the
    # cluster. The next adapter, from the same state folder, still knows the stop and reports it with the run
    # up to the stop, so the broker keeps the checkpoint's work rather than taking the attempt for lost; once
    # the broker has taken the event, it is forgotten.
    ran = await stopped_while_no_adapter_ran(cluster, tmp_path, STOPS[stop])
    assert (tmp_path / "kube" / "stops.json").exists()
    second = make_site(cluster, state_dir=tmp_path)
    await second.start()
    try:
        events = second.events()
        stopped = await reported_stopped(second, events, stop, ran)  # so a restarted broker does not requeue it
        assert ("j-1", 1) in await second.known_attempts()  # until the broker has it
        second.taken(stopped)  # what the broker says once it has stored the event: the stop is done with
        assert ("j-1", 1) not in await second.known_attempts()
        assert not (tmp_path / "kube" / "stops.json").exists()
    finally:
        await second.close()
    third = make_site(cluster, state_dir=tmp_path)
    await third.start()
    try:
        with pytest.raises(TimeoutError):  # reported once
            await next_event(third, third.events())
    finally:
        await third.close()


async def test_a_stop_reported_as_the_adapter_closed_is_reported_again_by_the_next_one(
        cluster: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    # The Pod went and the adapter queued "preempted", but closed before the broker took it.
    first = make_site(cluster, state_dir=tmp_path)
    await first.start()
    stream = first.events()
    try:
        name = await j1_running(first, stream, cluster)
        await first.preempt("j-1", 1, "moved")
        await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")
        for _ in range(200):  # until the watch has seen the Pod go
            if first._events.qsize():
                break
            await asyncio.sleep(0.05)
        assert first._events.qsize() == 1
    finally:
        await first.close()
    second = make_site(cluster, state_dir=tmp_path)
    await second.start()
    try:
        stopped = await next_event(second, second.events())
        assert (stopped.job_id, stopped.kind, stopped.reason) == ("j-1", EventKind.PREEMPTED, "moved")
    finally:
        await second.close()


async def test_a_stop_whose_job_is_still_there_never_took_and_is_forgotten(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The stop was noted, but its Job's deletion never reached the cluster: the job runs on.
    first = make_site(cluster, state_dir=tmp_path)
    await first.start()
    try:
        assert (await first.submit(attempt("j-1", count=8))).admitted
        first._journal.add(("j-1", 1), "moved", None, NOW)
    finally:
        await first.close()
    second = make_site(cluster, state_dir=tmp_path)
    await second.start()
    try:
        assert "still has its Job (its deletion did not take); it runs on" in caplog.text
        assert not (tmp_path / "kube" / "stops.json").exists()
        with pytest.raises(TimeoutError):
            await next_event(second, second.events())
        assert (await second.snapshot()).capacity[0].free_gpus == 8  # it still holds its GPUs
    finally:
        await second.close()


async def test_a_stops_file_that_cannot_be_read_is_set_aside_and_the_site_starts(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "kube").mkdir()
    (tmp_path / "kube" / "stops.json").write_text('[{"job_id": "j-1"}]')
    adapter = make_site(cluster, state_dir=tmp_path)
    await adapter.start()
    try:
        assert "cannot read the stops not yet reported" in caplog.text
        assert (tmp_path / "kube" / "stops.json.unreadable").exists()
        assert await adapter.known_attempts() == set()
    finally:
        await adapter.close()


# --- the stops kept in the cluster too (state_namespace): a takeover by a replica with another state folder ---


def kept_in_cluster(cluster: kmock.KubernetesEmulator, name: str = "heliotrope-stops-kube",
                    namespace: str = "heliotrope") -> list[tuple[str, int]] | None:
    """The (job id, attempt) of the stops the ConfigMap holds; None when there is no ConfigMap."""
    found = [obj for (res, ns, n), obj in cluster.objects.items()
             if res.plural == "configmaps" and (ns, n) == (namespace, name) and not obj.deleted]
    if not found:
        return None
    return [(s["job_id"], s["attempt"]) for s in json.loads(found[0]["data"]["stops.json"]) if "job_id" in s]


async def until_kept(cluster: kmock.KubernetesEmulator, expected: list[tuple[str, int]]) -> None:
    for _ in range(100):
        if kept_in_cluster(cluster) == expected:
            return
        await asyncio.sleep(0.05)
    assert kept_in_cluster(cluster) == expected


@pytest.mark.parametrize("stop", ["the broker's", "the site's own"])
async def test_a_stop_whose_pods_go_during_a_takeover_is_reported_by_a_replica_with_another_state_folder(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, stop: str) -> None:
    # Broker replicas each run their own adapters, each with its own folder. The leader stops j-1 (a move, or
    # the site's own quotas) and goes; j-1's Pod writes its checkpoint and exits before the other replica's
    # adapter starts. That adapter finds the stop in the cluster and reports it with the run up to the stop,
    # so the job goes on from its checkpoint rather than starting over as a lost attempt.
    ran = await stopped_while_no_adapter_ran(cluster, tmp_path / "replica-0",
                                             STOPS[stop],
                                             state_namespace="heliotrope")
    assert kept_in_cluster(cluster) == [("j-1", 1)]  # written before the adapter closed
    other = make_site(cluster, state_dir=tmp_path / "replica-1", state_namespace="heliotrope")
    await other.start()
    try:
        events = other.events()
        stopped = await reported_stopped(other, events, stop, ran)  # so the new leader does not requeue it
        assert (tmp_path / "replica-1" / "kube" / "stops.json").exists()  # kept here too, until the broker has it
        other.taken(stopped)  # the broker has stored the event: the stop is done with, here and in the cluster
        assert ("j-1", 1) not in await other.known_attempts()
        assert not (tmp_path / "replica-1" / "kube" / "stops.json").exists()
        await until_kept(cluster, [])  # the ConfigMap stays, with no stops
        with pytest.raises(TimeoutError):  # reported once
            await asyncio.wait_for(anext(events), 0.5)
    finally:
        await other.close()


@pytest.mark.parametrize("same_folder", [True, False], ids=["by the same broker (its state folder)",
                                                         "by a broker replica with another state folder"])
async def test_a_site_removed_leaves_no_stops_for_a_new_site_of_its_name(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, same_folder: bool) -> None:
    # A site removed while a stop of it was not yet reported: its usage history was cleared, but its stops stayed
    # in the ConfigMap heliotrope-stops-<site> (and its state folder), and a new site of its name later added on
    # the same namespace took them up as its own, reporting the old site's attempt preempted.
    first = make_site(cluster, state_dir=tmp_path / "a", state_namespace="heliotrope")
    await first.start()
    try:
        name = await j1_running(first, first.events(), cluster)
        await first.preempt("j-1", 1, "moved from kube to b from its checkpoint")  # its Pod writes its checkpoint
        await until_kept(cluster, [("j-1", 1)])
        await first.forget_quotas()  # the site leaves the federation (and its adapter closes)
    finally:
        await first.close()
    await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")  # (gone while no adapter ran)
    assert kept_in_cluster(cluster) == []  # the ConfigMap stays, with no stops
    assert not (tmp_path / "a" / "kube" / "stops.json").exists()
    second = make_site(cluster, state_dir=tmp_path / ("a" if same_folder else "b"), state_namespace="heliotrope")
    await second.start()
    try:
        assert ("j-1", 1) not in await second.known_attempts()
        with pytest.raises(TimeoutError):  # no preempted for an attempt the new site never ran
            await asyncio.wait_for(anext(second.events()), 0.5)
        assert kept_in_cluster(cluster) == []
    finally:
        await second.close()


async def test_a_stop_kept_in_the_file_only_is_written_to_the_cluster_at_start(
        cluster: kmock.KubernetesEmulator, tmp_path: Path) -> None:
    # A stop begun before state_namespace was set (or while the ConfigMap could not be written): the next
    # start writes it there, so a replica with another folder would find it too.
    first = make_site(cluster, state_dir=tmp_path)
    await first.start()
    try:
        first._journal.add(("j-1", 1), "moved", None, NOW)
    finally:
        await first.close()
    assert kept_in_cluster(cluster) is None
    second = make_site(cluster, state_dir=tmp_path, state_namespace="heliotrope")
    await second.start()
    try:
        stopped = await next_event(second, second.events())
        assert (stopped.job_id, stopped.kind, stopped.reason) == ("j-1", EventKind.PREEMPTED, "moved")
        await until_kept(cluster, [("j-1", 1)])  # until the broker has taken it
        second.taken(stopped)
        await until_kept(cluster, [])
    finally:
        await second.close()


async def test_a_config_map_the_cluster_refuses_leaves_the_site_on_its_file(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # RBAC without configmaps in the state namespace: the site comes up and stops jobs as before, with its
    # file alone, and says what is missing.
    refused: list[str] = []

    def refuse(verb: str) -> Any:
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            refused.append(verb)
            raise k8s.ApiException(status=403, reason=f'configmaps is forbidden: cannot {verb} resource "configmaps"')
        return call

    for verb in ("read", "create", "patch"):
        monkeypatch.setattr(k8s.CoreV1Api, f"{verb}_namespaced_config_map_without_preload_content", refuse(verb))
    first = make_site(cluster, state_dir=tmp_path, state_namespace="heliotrope")
    await first.start()
    stream = first.events()
    def errors() -> list[str]:  # (about the stops; those about the usage history, its own ConfigMap, below)
        return [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "usage history" not in r.getMessage()]

    try:
        assert refused == ["read", "read"]  # the stops' ConfigMap, the usage history's
        assert len(errors()) == 1 and "cannot read the stops not yet reported from ConfigMap " \
            "heliotrope/heliotrope-stops-kube (403" in errors()[0]
        assert "get, create and patch on configmaps in namespace heliotrope" in errors()[0]
        assert "cannot read the usage history from ConfigMap heliotrope/heliotrope-usage-kube (403" in caplog.text
        name = await j1_running(first, stream, cluster)
        await first.preempt("j-1", 1, "moved")
        assert (tmp_path / "kube" / "stops.json").exists()
        for _ in range(100):
            if "write" in caplog.text:
                break
            await asyncio.sleep(0.05)
        assert len(errors()) == 2 and "cannot write the stops not yet reported to ConfigMap " \
            "heliotrope/heliotrope-stops-kube (403" in errors()[1]
    finally:
        await first.close()
    await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")
    second = make_site(cluster, state_dir=tmp_path, state_namespace="heliotrope")
    await second.start()
    try:
        stopped = await next_event(second, second.events())  # from the file
        assert (stopped.job_id, stopped.kind, stopped.reason) == ("j-1", EventKind.PREEMPTED, "moved")
        assert (await second.snapshot()).health == "healthy"
    finally:
        await second.close()
    assert kept_in_cluster(cluster) is None


async def test_replicas_writing_the_config_map_at_once_keep_each_others_stops(
        cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each write is on condition of the resourceVersion it read; one refused (409: another replica wrote in
    # between) reads again and applies its change to what the other wrote.
    other = {"job_id": "x-1", "attempt": 2, "reason": "moved", "running_since": None, "at": NOW.isoformat()}
    cluster.objects[CONFIG_MAPS, "heliotrope", "heliotrope-stops-kube"] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "heliotrope-stops-kube", "namespace": "heliotrope", "resourceVersion": "7"},
        "data": {"stops.json": "[]"}}
    real = k8s.CoreV1Api.patch_namespaced_config_map_without_preload_content
    sent: list[dict[str, Any]] = []

    async def racing(self: Any, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        sent.append(body)
        if len(sent) == 1:  # another replica's write lands first
            cluster.objects[CONFIG_MAPS, namespace, name].patch(
                {"metadata": {"resourceVersion": "8"}, "data": {"stops.json": json.dumps([other])}})
            raise k8s.ApiException(status=409, reason="the object has been modified")
        return await real(self, name, namespace, body, **kwargs)

    monkeypatch.setattr(k8s.CoreV1Api, "patch_namespaced_config_map_without_preload_content", racing)
    adapter = make_site(cluster, state_namespace="heliotrope")
    await adapter.start()
    stream = adapter.events()
    try:
        await j1_running(adapter, stream, cluster)
        await adapter.preempt("j-1", 1, "moved")
        await until_kept(cluster, [("j-1", 1), ("x-1", 2)])
        assert [b["metadata"]["resourceVersion"] for b in sent] == ["7", "8"]
    finally:
        await adapter.close()


async def test_entries_of_the_config_map_this_release_cannot_read_cost_no_other_stop(
        cluster: kmock.KubernetesEmulator) -> None:
    # A replica of a later release (a rolling upgrade) may write a key this one does not know, or an entry it
    # cannot read at all: the list was read all or nothing, so one such entry made it empty, and the next write
    # replaced every other replica's stops with this one's.
    later = {"job_id": "x-1", "attempt": 2, "reason": "moved", "running_since": None, "at": NOW.isoformat(),
             "checkpoint": "s3://bucket/x-1"}
    odd = {"kind": "something a later release keeps"}
    cluster.objects[CONFIG_MAPS, "heliotrope", "heliotrope-stops-kube"] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "heliotrope-stops-kube", "namespace": "heliotrope", "resourceVersion": "7"},
        "data": {"stops.json": json.dumps([later, odd])}}
    adapter = make_site(cluster, state_namespace="heliotrope")
    await adapter.start()
    stream = adapter.events()
    try:
        gone = await next_event(adapter, stream)  # x-1's stop, read from the cluster: nothing left of it there
        assert (gone.job_id, gone.attempt, gone.kind) == ("x-1", 2, EventKind.PREEMPTED)
        await j1_running(adapter, stream, cluster)
        await adapter.preempt("j-1", 1, "moved")
        await until_kept(cluster, [("j-1", 1), ("x-1", 2)])
        entries = json.loads(cluster.objects[CONFIG_MAPS, "heliotrope", "heliotrope-stops-kube"]["data"]["stops.json"])
        assert later in entries and odd in entries  # written back as they were
    finally:
        await adapter.close()


@pytest.mark.parametrize(("site_name", "expected"), [
    ("kube", "heliotrope-stops-kube"),
    ("a" * 63, "heliotrope-stops-" + "a" * 37 + "-" + hashlib.sha256(b"a" * 63).hexdigest()[:8]),
    ("Lab_1", "heliotrope-stops-lab-1-" + hashlib.sha256(b"Lab_1").hexdigest()[:8]),
], ids=["a site name as it is", "a long one shortened with a hash", "one a name may not hold, with a hash"])
def test_the_config_map_of_a_sites_stops_has_a_name_kubernetes_accepts(site_name: str, expected: str) -> None:
    name = config_map_name(site_name)
    assert name == expected and len(name) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name)


@pytest.fixture
async def borrowing(cluster: kmock.KubernetesEmulator) -> AsyncIterator[tuple[KubernetesSite, AsyncIterator[JobEvent]]]:
    """A site whose tenant a (8 GPUs guaranteed, 8 more of burst) runs a-1 on its guarantee and a-2 on b's
    (8 guaranteed, none used yet); a-2 is what b's first job reclaims."""
    adapter = make_site(cluster, quotas=[{"tenant": "a", "guaranteed_gpus": 8, "burst_gpus": 8},
                                         {"tenant": "b", "guaranteed_gpus": 8}])
    await adapter.start()
    stream = adapter.events()
    try:
        assert (await adapter.submit(attempt("a-1", count=8, tenant="a", preemptible=True))).admitted
        assert (await adapter.submit(attempt("a-2", count=8, tenant="a", preemptible=True))).admitted
        yield adapter, stream
    finally:
        await adapter.close()


async def a2_running(adapter: KubernetesSite, stream: AsyncIterator[JobEvent],
                     cluster: kmock.KubernetesEmulator) -> str:
    """a-2 (of ``borrowing``) running in a Pod, as the site has heard; returns its Job's name."""
    victim = job_name("a-2", 1)
    await pod_running(cluster, victim, "heliotrope-a")
    assert (await next_event(adapter, stream)).kind == EventKind.RUNNING
    return victim


async def test_a_tenant_reclaiming_its_guarantee_preempts_the_borrowing_job(
        borrowing: tuple[KubernetesSite, AsyncIterator[JobEvent]], cluster: kmock.KubernetesEmulator) -> None:
    adapter, stream = borrowing
    assert (await adapter.submit(attempt("b-1", count=8, tenant="b"))).admitted
    preempted = await next_event(adapter, stream)
    assert (preempted.job_id, preempted.kind) == ("a-2", EventKind.PREEMPTED)
    assert "for job b-1 of tenant b" in (preempted.reason or "")
    assert "reclaims its guarantee" in (preempted.reason or "")
    assert set(jobs(cluster)) == {("heliotrope-a", job_name("a-1", 1)), ("heliotrope-b", job_name("b-1", 1))}
    assert (await adapter.snapshot()).capacity[0].free_gpus == 0


async def test_a_job_withdrawn_while_its_job_is_made_preempts_nobody(
        borrowing: tuple[KubernetesSite, AsyncIterator[JobEvent]], cluster: kmock.KubernetesEmulator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # b-1 would reclaim b's guarantee from a-2, but the broker withdraws b-1 while its Job is being made: a-2
    # must run on, not lose its Job (and its progress) for a job that was then deleted.
    adapter, stream = borrowing
    victim = await a2_running(adapter, stream, cluster)
    make = adapter._create_job

    async def made_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        answer = await make(*args, **kwargs)
        await adapter.cancel("b-1", 1)
        return answer

    monkeypatch.setattr(adapter, "_create_job", made_then_cancelled)
    answer = await adapter.submit(attempt("b-1", count=8, tenant="b"))
    assert not answer.admitted and "withdrawn" in (answer.reason or "")
    assert ("heliotrope-a", victim) in jobs(cluster) and ("heliotrope-b", job_name("b-1", 1)) not in jobs(cluster)
    with pytest.raises(TimeoutError):  # a-2 is not preempted
        await asyncio.wait_for(anext(stream), 0.5)


@pytest.mark.parametrize(("status", "why"), [
    (404, 'namespaces "heliotrope-b" not found'),
    (403, 'jobs.batch is forbidden: User "heliotrope" cannot create resource "jobs" in the namespace'),
    (422, "admission webhook denied the request"),
], ids=["tenant b's namespace does not exist", "RBAC forbids Jobs there", "an admission webhook refuses it"])
async def test_a_job_the_cluster_refuses_preempts_nobody(
        borrowing: tuple[KubernetesSite, AsyncIterator[JobEvent]], cluster: kmock.KubernetesEmulator,
        monkeypatch: pytest.MonkeyPatch, status: int, why: str) -> None:
    # b-1 reclaims b's guarantee from a-2, but the cluster refuses b-1's Job (the emulator checks none of
    # these, so the test refuses it): a-2 must run on, not be stopped for a job that never existed.
    adapter, stream = borrowing
    victim = await a2_running(adapter, stream, cluster)
    real = k8s.BatchV1Api.create_namespaced_job_without_preload_content

    async def refuse_in_b(self: Any, namespace: str, body: Any, **kwargs: Any) -> Any:
        if namespace == "heliotrope-b":
            raise k8s.ApiException(status=status, reason=why)
        return await real(self, namespace, body, **kwargs)

    monkeypatch.setattr(k8s.BatchV1Api, "create_namespaced_job_without_preload_content", refuse_in_b)
    answer = await adapter.submit(attempt("b-1", count=8, tenant="b"))
    assert not answer.admitted and "heliotrope-b" in (answer.reason or "")
    assert ("heliotrope-a", victim) in jobs(cluster)
    state = await adapter.snapshot()
    assert state.capacity[0].free_gpus == 0 and state.running_jobs == 2  # a-1 and a-2 still hold their GPUs
    with pytest.raises(TimeoutError):  # a-2 is not preempted
        await asyncio.wait_for(anext(stream), 0.5)


async def test_a_job_that_ends_while_its_victims_are_being_stopped_holds_nothing_after(
        borrowing: tuple[KubernetesSite, AsyncIterator[JobEvent]], cluster: kmock.KubernetesEmulator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # b-1's Job is created first, then a-2 is stopped for it; b-1 fails while a-2's delete is in flight, and
    # the watch reports it. The site must not then book b-1's GPUs for a job that has ended.
    adapter, stream = borrowing
    await a2_running(adapter, stream, cluster)
    real = k8s.BatchV1Api.delete_namespaced_job_without_preload_content

    async def slow_delete(self: Any, name: str, namespace: str, **kwargs: Any) -> Any:
        if name == job_name("a-2", 1):
            await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-b/jobs/{job_name('b-1', 1)}",
                                json={"status": {"failed": 1, "conditions": [
                                    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}})
            await asyncio.sleep(0.3)  # the watch reads the failure meanwhile
        return await real(self, name, namespace, **kwargs)

    monkeypatch.setattr(k8s.BatchV1Api, "delete_namespaced_job_without_preload_content", slow_delete)
    assert (await adapter.submit(attempt("b-1", count=8, tenant="b"))).admitted
    ended = await next_event(adapter, stream)
    assert (ended.job_id, ended.kind) == ("b-1", EventKind.FAILED)
    await cluster.delete(f"/api/v1/namespaces/heliotrope-a/pods/{job_name('a-2', 1)}-abc")  # a-2's Pod goes
    stopped = await next_event(adapter, stream)
    assert (stopped.job_id, stopped.kind) == ("a-2", EventKind.PREEMPTED)
    state = await adapter.snapshot()
    assert state.capacity[0].free_gpus == 8 and state.running_jobs == 1  # a-1 alone
    assert {t.tenant: t.in_use_gpus for t in state.quota.tenants} == {"a": 8.0, "b": 0.0}


async def test_a_preemption_for_the_sites_quotas_is_reported_once_the_victims_pod_has_gone(
        borrowing: tuple[KubernetesSite, AsyncIterator[JobEvent]], cluster: kmock.KubernetesEmulator) -> None:
    # The preemptor gets the GPUs in the site's books at once (its Pod waits in the cluster for them), but the
    # broker hears "preempted" only when the victim's Pod has exited: a checkpointing job is not started
    # elsewhere while it still writes its checkpoint here.
    adapter, stream = borrowing
    victim = await a2_running(adapter, stream, cluster)
    await asyncio.sleep(0.2)
    assert (await adapter.submit(attempt("b-1", count=8, tenant="b"))).admitted
    assert ("heliotrope-a", victim) not in jobs(cluster)
    waiting = asyncio.ensure_future(anext(stream))
    with pytest.raises(TimeoutError):  # its Pod is still in its grace period
        await asyncio.wait_for(asyncio.shield(waiting), 0.5)
    state = await adapter.snapshot()
    assert state.capacity[0].free_gpus == 0 and state.running_jobs == 2  # b-1 holds a-2's GPUs in the books
    quota = {q.tenant: q for q in (await adapter.quota()).tenants}
    assert quota["a"].in_use_gpus == 8 and quota["b"].in_use_gpus == 8
    await cluster.delete(f"/api/v1/namespaces/heliotrope-a/pods/{victim}-abc")
    preempted = await asyncio.wait_for(waiting, 5)
    assert (preempted.job_id, preempted.kind) == ("a-2", EventKind.PREEMPTED)
    assert "for job b-1 of tenant b" in (preempted.reason or "") and 0.2 < preempted.run_s < 5
    with pytest.raises(TimeoutError):  # reported once
        await next_event(adapter, stream)


async def test_a_job_the_site_preempts_while_the_broker_stops_it_is_reported_once_its_pods_are_gone(
        borrowing: tuple[KubernetesSite, AsyncIterator[JobEvent]], cluster: kmock.KubernetesEmulator) -> None:
    adapter, stream = borrowing
    victim = await a2_running(adapter, stream, cluster)
    await adapter.preempt("a-2", 1, "moved from kube to elsewhere from its checkpoint")
    assert (await adapter.submit(attempt("b-1", count=8, tenant="b"))).admitted  # its guarantee: a-2's GPUs
    waiting = asyncio.ensure_future(anext(stream))
    with pytest.raises(TimeoutError):  # a-2's Pod is still writing its checkpoint
        await asyncio.wait_for(asyncio.shield(waiting), 0.5)
    await cluster.delete(f"/api/v1/namespaces/heliotrope-a/pods/{victim}-abc")
    stopped = await asyncio.wait_for(waiting, 5)
    assert (stopped.job_id, stopped.kind, stopped.reason) == (
        "a-2", EventKind.PREEMPTED, "moved from kube to elsewhere from its checkpoint")
    with pytest.raises(TimeoutError):
        await next_event(adapter, stream)


# --- credentials: a kubeconfig, a context, in-cluster ---


def kubeconfig(path, server: str, context: str = "lab") -> str:  # noqa: ANN001
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: emulated
  cluster: {{server: "{server}"}}
- name: unreachable
  cluster: {{server: "http://127.0.0.1:9"}}
users:
- name: operator
  user: {{token: not-checked-by-the-emulator}}
contexts:
- name: {context}
  context: {{cluster: emulated, user: operator}}
- name: elsewhere
  context: {{cluster: unreachable, user: operator}}
current-context: elsewhere
""")
    return str(path)


async def test_a_kubeconfig_file_and_its_named_context_reach_the_cluster(cluster, tmp_path) -> None:  # noqa: ANN001
    """What an operator writes (`kubeconfig:` and `context:`), not the `host:` shortcut the other tests use.
    The file's current context names an unreachable cluster, so only the named context can succeed."""
    path = kubeconfig(tmp_path / "config", str(cluster.url).rstrip("/"))
    config = KubernetesAdapterConfig(kubeconfig=path, context="lab", request_timeout_s=5, retries=2)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()
    try:
        state = await adapter.snapshot()
        assert state.health == "healthy" and state.capacity[0].total_gpus == 19
    finally:
        await adapter.close()


async def test_a_token_from_an_exec_plugin_is_renewed_before_it_expires(cluster, tmp_path) -> None:  # noqa: ANN001
    """EKS (`aws eks get-token`, 15 minutes), GKE (gke-gcloud-auth-plugin, an hour) and kubelogin give
    kubeconfigs whose token comes from a plugin and expires. The adapter must run the plugin again as the token
    expires, as kubectl does: before, every call failed with 401 Unauthorized from then on, until a restart."""
    token_file = tmp_path / "token.json"
    plugin = tmp_path / "get-token"
    plugin.write_text(f"#!/bin/sh\nexec cat {token_file}\n")
    plugin.chmod(0o755)

    def issue(token: str, valid_s: float) -> None:
        expiry = (datetime.now(UTC) + timedelta(seconds=valid_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
        token_file.write_text(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1",
                                          "kind": "ExecCredential",
                                          "status": {"token": token, "expirationTimestamp": expiry}}))

    accepted = ["tok-1"]  # what the API server takes now: an expired token is refused
    cluster[lambda req: req.headers.get("Authorization") != f"Bearer {accepted[0]}"] << 401
    path = Path(kubeconfig(tmp_path / "config", str(cluster.url).rstrip("/")))
    path.write_text(path.read_text().replace(
        "user: {token: not-checked-by-the-emulator}",
        f"user: {{exec: {{apiVersion: client.authentication.k8s.io/v1beta1, command: {plugin}}}}}"))
    issue("tok-1", 300 + 2)  # renewed five minutes before it expires, as kubectl does: here in 2 s
    config = KubernetesAdapterConfig(kubeconfig=str(path), context="lab", request_timeout_s=5, retries=1)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()
    try:
        assert (await adapter.snapshot()).health == "healthy"
        issue("tok-2", 3600)
        await asyncio.sleep(2.5)
        accepted[0] = "tok-2"  # tok-1 has expired
        state = await adapter.snapshot()
        assert state.health == "healthy" and state.capacity[0].total_gpus == 19
    finally:
        await adapter.close()


@pytest.mark.parametrize("body", [
    None, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "Unauthorized",
           "reason": "Unauthorized", "code": 401}], ids=["an empty answer", "the API server's Status"])
async def test_credentials_the_cluster_refuses_are_a_clear_error(cluster, body) -> None:  # noqa: ANN001
    # An expired or revoked token: the error said "listing Jobs failed (401: )", or quoted the JSON answer.
    refusal = cluster[kmock.path(re.compile(".*"))] << 401
    if body is not None:
        refusal << body
    adapter = make_site(cluster)
    try:
        with pytest.raises(AdapterError) as err:
            await adapter.start()
        assert "401: Unauthorized: the cluster refused the site's credentials" in str(err.value)
        assert "adapter.kubeconfig" in str(err.value) and '"kind"' not in str(err.value)
    finally:
        await adapter.close()


async def test_a_kubeconfigs_token_file_is_read_again_as_it_is_rotated(cluster, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A kubeconfig whose user names a `tokenFile` (a projected service account token for an agent outside the
    cluster, rotated hourly): read once, the token expired and every call failed with 401 from then on."""
    from adapters import kubernetes as adapter_module

    token = tmp_path / "token"
    token.write_text("tok-1")
    accepted = ["tok-1"]
    cluster[lambda req: req.headers.get("Authorization") != f"Bearer {accepted[0]}"] << 401
    path = Path(kubeconfig(tmp_path / "config", str(cluster.url).rstrip("/")))
    path.write_text(path.read_text().replace("user: {token: not-checked-by-the-emulator}",
                                             f"user: {{tokenFile: {token}}}"))
    monkeypatch.setattr(adapter_module, "TOKEN_FILE_REREAD_S", 0.5)
    config = KubernetesAdapterConfig(kubeconfig=str(path), context="lab", request_timeout_s=5, retries=1)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    await adapter.start()
    try:
        assert (await adapter.snapshot()).health == "healthy"
        token.write_text("tok-2")  # rotated; tok-1 expires
        accepted[0] = "tok-2"
        await asyncio.sleep(0.6)
        assert (await adapter.snapshot()).health == "healthy"
    finally:
        await adapter.close()


async def test_credentials_settings_that_another_one_overrides_are_named_in_a_warning(cluster, tmp_path, caplog
                                                                                     ) -> None:  # noqa: ANN001
    """`host:` wins over a kubeconfig, as `in_cluster:` does: an operator who set both learns which is used."""
    path = kubeconfig(tmp_path / "config", str(cluster.url).rstrip("/"))
    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), kubeconfig=path, context="lab",
                                     request_timeout_s=5, retries=2)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    with caplog.at_level("WARNING", logger="adapters.kubernetes"):
        await adapter.start()
    try:
        assert (await adapter.snapshot()).health == "healthy"
        assert ("site kube: adapter.kubeconfig, adapter.context are not used: the credentials come from adapter.host"
                in caplog.text)
    finally:
        await adapter.close()


@pytest.mark.parametrize(("settings", "message"), [
    ({"context": "missing"}, "cannot load Kubernetes credentials"),
    ({"kubeconfig": "/nonexistent/kubeconfig"}, "cannot load Kubernetes credentials"),
    ({"in_cluster": True}, "cannot load Kubernetes credentials"),
], ids=["a context the kubeconfig does not have", "a kubeconfig file that is not there",
        "in-cluster credentials outside a cluster"])
async def test_credentials_that_cannot_be_loaded_are_a_clear_error(cluster, tmp_path, settings, message) -> None:  # noqa: ANN001
    path = kubeconfig(tmp_path / "config", str(cluster.url).rstrip("/"))
    config = KubernetesAdapterConfig(**({"kubeconfig": path} | settings), request_timeout_s=5, retries=1)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    try:
        with pytest.raises(AdapterError, match=message) as err:
            await adapter.start()
            await adapter.snapshot()
        assert "adapter.kubeconfig" in str(err.value)
    finally:
        await adapter.close()


@pytest.mark.parametrize(("text", "reason"), [
    ("clusters: [\n - {name: x\n", "is not a YAML file \\(line 2: expected the node content, but found '-'\\)"),
    ("", "holds no kubeconfig \\(a YAML mapping of clusters, users and contexts\\), but nothing"),
    ("- just\n- a list\n", "holds no kubeconfig .*, but list"),
    ("clusters: 3\n", "TypeError"),
], ids=["not YAML", "an empty file", "a YAML list", "clusters that are not a list"])
async def test_a_kubeconfig_that_is_not_one_is_a_clear_error(tmp_path, text, reason) -> None:  # noqa: ANN001
    path = tmp_path / "config"
    path.write_text(text)
    config = KubernetesAdapterConfig(kubeconfig=str(path), request_timeout_s=5, retries=1)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    try:
        with pytest.raises(AdapterError, match=f"site kube: cannot load Kubernetes credentials \\(.*{reason}") as err:
            await adapter.start()
            await adapter.snapshot()
        assert "adapter.kubeconfig" in str(err.value)
    finally:
        await adapter.close()


@pytest.mark.parametrize("where", ["named", "default"],
                         ids=["adapter.kubeconfig names a file that is not there",
                              "no adapter.kubeconfig, and no file at the client's default location"])
async def test_a_kubeconfig_that_is_not_there_is_named_as_missing(tmp_path, monkeypatch, where) -> None:  # noqa: ANN001
    # The README's example says `kubeconfig: ~/.kube/config`; where there is no such file, the client's loader
    # fails as if the file had no current-context, which sends the operator looking inside a file that is not there.
    from kubernetes.aio.config import kube_config

    missing = tmp_path / "kube" / "config"
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(missing))
    settings = {"kubeconfig": str(missing)} if where == "named" else {}
    config = KubernetesAdapterConfig(**settings, request_timeout_s=5, retries=1)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    try:
        with pytest.raises(AdapterError) as err:
            await adapter.start()
        assert f"{missing}: no such file" in str(err.value) if where == "named" else \
            f"adapter.kubeconfig is unset and {missing} does not exist" in str(err.value)
        assert "current-context" not in str(err.value)
    finally:
        await adapter.close()


async def test_an_adapter_without_credentials_calls_nothing_and_says_why(tmp_path) -> None:  # noqa: ANN001
    # A stored site whose credentials cannot be loaded still joins (unhealthy), and the broker asks its adapter
    # which attempts it holds and for its quota report: those calls must fail with the start's reason, not go
    # out through the client library's default client (no cluster: an invalid-URL error, and an HTTP session
    # left open, which asyncio logs as an ERROR).
    config = KubernetesAdapterConfig(kubeconfig=str(tmp_path / "absent"), request_timeout_s=5, retries=1)
    adapter = KubernetesSite(site("kube", adapter=config.model_dump()), SystemClock())
    try:
        with pytest.raises(AdapterError) as started:
            await adapter.start()
        for call in (adapter.known_attempts, adapter.snapshot):
            with pytest.raises(AdapterError) as err:
                await call()
            assert str(err.value) == str(started.value), call.__name__
    finally:
        await adapter.close()


async def test_a_bad_kubeconfigs_path_is_not_in_the_reason_everyone_reads(tmp_path) -> None:  # noqa: ANN001
    # The site's health reason goes to every role that may see the site, submitters included, and to its
    # site events; the kubeconfig is a secret no one is sent (broker.auth.SECRET_FIELDS), its path included.
    from broker.federation import Federation
    from broker.service import adapter_factory

    path = tmp_path / "team-gamma-prod-admin.kubeconfig"
    path.write_text("- not: a kubeconfig\n")
    spec = site("gamma", adapter=KubernetesAdapterConfig(kubeconfig=str(path), retries=1).model_dump())
    fed = Federation(SystemClock(), adapter_factory(SystemClock()))
    try:
        member = await fed.add(spec, tolerate_failure=True)
        reason = member.public_state().reason or ""
        assert "cannot load Kubernetes credentials (<adapter.kubeconfig> holds no kubeconfig" in reason
        assert "team-gamma-prod-admin" not in reason
    finally:
        await fed.close()


# --- a cluster that cannot be reached when the broker starts ---


async def test_a_stored_site_whose_adapter_cannot_start_leaves_the_broker_serving_and_joins_when_it_can(
        cluster, tmp_path) -> None:  # noqa: ANN001
    """The kubeconfig is not there when the broker starts (a secret not mounted yet, a cluster being rebuilt):
    the broker still starts and serves its other sites; this one is unhealthy, saying why, and joins at the
    first collect after the kubeconfig appears."""
    from broker.config import BrokerSettings
    from broker.service import Broker

    missing = tmp_path / "later" / "kubeconfig"
    config = KubernetesAdapterConfig(kubeconfig=str(missing), context="lab", request_timeout_s=5, retries=1)
    kube_site = site("kube", adapter=config.model_dump())
    other = site("sim", adapter={"kind": "simulated", "dispatch_delay_s": 0.01})
    broker = Broker(BrokerSettings(db=str(tmp_path / "b.db"), cycle_interval_s=0.05, shutdown_grace_s=0.5))
    broker.federation.restart_after_s = 0.2
    await broker.start([kube_site, other])
    try:
        member = broker.federation.get("kube")
        assert member is not None and member.public_state().health != "healthy"
        assert "its adapter could not start" in (member.public_state().reason or "")
        assert broker.federation.get("sim").public_state().health == "healthy"  # type: ignore[union-attr]

        missing.parent.mkdir()
        kubeconfig(missing, str(cluster.url).rstrip("/"))
        for _ in range(200):
            await asyncio.sleep(0.05)
            member = broker.federation.get("kube")
            if member.public_state().health == "healthy":
                break
        assert member.public_state().health == "healthy", member.public_state()
        assert sum(c.total_gpus for c in member.public_state().capacity) > 0
    finally:
        await broker.stop()


async def until_state(broker: Any, job_id: str, state: Any) -> Job:
    for _ in range(200):
        got = await broker.book.get(job_id)
        if got.state == state:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} is {got.state}, not {state}")


async def stopped_as_its_broker_goes(cluster: kmock.KubernetesEmulator, broker: Any, kube_site: Any) -> str:
    """Run a checkpointable job at the site ``kube``, stop it there (a preemption) as ``broker`` goes down, and
    let its Pod go while no broker runs; the job's id."""
    from broker.models import JobState

    await broker.start([kube_site], run_loop=False)
    try:
        submitted, _ = await broker.book.submit(job(count=8, checkpointable=True))
        await broker.cycle.run_once(full=True)
        await until_state(broker, submitted.id, JobState.ADMITTED)
        await pod_running(cluster, job_name(submitted.id, 1))
        await until_state(broker, submitted.id, JobState.RUNNING)
        await asyncio.sleep(0.5)
        await broker.federation.get("kube").adapter.preempt(submitted.id, 1, "stopped by its operator")
    finally:
        await broker.stop()
    await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{job_name(submitted.id, 1)}-abc")
    return submitted.id


async def requeued_from_its_checkpoint(broker: Any, job_id: str) -> None:
    """``broker``, started next, requeues the job as preempted with the time it ran, not as a lost attempt."""
    from broker.models import JobState

    requeued = await until_state(broker, job_id, JobState.QUEUED)
    assert requeued.run_s >= 0.5
    assert requeued.reason == "requeued after preemption from its checkpoint"
    history = [e["reason"] for e in await broker.store.job_events(job_id)]
    assert "preempted on kube: stopped by its operator" in history
    assert not any("no longer knows" in (r or "") for r in history)


async def test_a_restarted_broker_keeps_the_work_of_a_job_whose_pods_went_while_it_was_down(cluster, tmp_path) -> None:  # noqa: ANN001
    """A checkpointable job is being stopped at a Kubernetes site as the broker goes down; its Pod writes its
    checkpoint and exits while no broker runs. The broker that starts next hears the stop from the adapter's
    journal, once its jobs are loaded: the job is requeued from its checkpoint with the time it ran, not taken
    for a lost attempt that starts over."""
    from broker.config import BrokerSettings
    from broker.service import Broker

    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=1,
                                     state_dir=str(tmp_path / "state"))
    kube_site = site("kube", adapter=config.model_dump())
    settings = BrokerSettings(db=str(tmp_path / "b.db"), shutdown_grace_s=0.5)
    job_id = await stopped_as_its_broker_goes(cluster, Broker(settings), kube_site)
    assert (tmp_path / "state" / "kube" / "stops.json").exists()

    again = Broker(settings)
    await again.start([], run_loop=False)
    try:
        await requeued_from_its_checkpoint(again, job_id)
        for _ in range(100):  # the broker has it: the adapter forgets the stop
            if not (tmp_path / "state" / "kube" / "stops.json").exists():
                break
            await asyncio.sleep(0.05)
        assert not (tmp_path / "state" / "kube" / "stops.json").exists()
    finally:
        await again.stop()


async def test_a_broker_replica_with_another_state_folder_keeps_the_work_of_a_job_whose_pods_went_at_takeover(
        cluster, tmp_path) -> None:  # noqa: ANN001
    """As above, but the broker that starts next is another replica, whose adapters keep their state in a
    folder of their own: it hears the stop from the ConfigMap in ``state_namespace``."""
    from broker.config import BrokerSettings
    from broker.service import Broker, adapter_factory

    config = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=1,
                                     state_namespace="heliotrope")
    kube_site = site("kube", adapter=config.model_dump())
    settings = BrokerSettings(db=str(tmp_path / "b.db"), shutdown_grace_s=0.5)

    def replica(n: int) -> Broker:  # (one database file: the replicas' shared store, one of them at a time)
        clock = SystemClock()
        return Broker(settings, clock=clock, factory=adapter_factory(clock, tmp_path / f"replica-{n}"))

    job_id = await stopped_as_its_broker_goes(cluster, replica(0), kube_site)
    assert (tmp_path / "replica-0" / "kube" / "stops.json").exists()
    assert not (tmp_path / "replica-1").exists()

    taking_over = replica(1)
    await taking_over.start([], run_loop=False)
    try:
        await requeued_from_its_checkpoint(taking_over, job_id)
        await until_kept(cluster, [])  # the broker has it: the stop is forgotten in the cluster
    finally:
        await taking_over.stop()


async def test_registering_a_site_whose_adapter_cannot_start_stores_nothing(cluster, tmp_path) -> None:  # noqa: ANN001
    from broker.config import BrokerSettings
    from broker.service import Broker

    config = KubernetesAdapterConfig(kubeconfig=str(tmp_path / "absent"), request_timeout_s=5, retries=1)
    broker = Broker(BrokerSettings(db=str(tmp_path / "b.db"), cycle_interval_s=0.05, shutdown_grace_s=0.5))
    await broker.start([])
    try:
        with pytest.raises(AdapterError, match="cannot load Kubernetes credentials"):
            await broker.register_site(site("kube", adapter=config.model_dump()))
        assert await broker.store.list_sites() == [] and "kube" not in broker.federation
        # A working site with the same name can be registered right after.
        good = KubernetesAdapterConfig(host=str(cluster.url).rstrip("/"), request_timeout_s=5, retries=1)
        await broker.register_site(site("kube", adapter=good.model_dump()))
        assert [s.name for s in await broker.store.list_sites()] == ["kube"]

        # An update to settings that cannot start keeps the site on the ones that work.
        with pytest.raises(AdapterError):
            await broker.update_site(site("kube", adapter=config.model_dump()))
        stored = await broker.store.list_sites()
        assert stored[0].adapter.host == good.host  # type: ignore[union-attr]
        await broker.federation.collect()
        assert broker.federation.get("kube").public_state().health == "healthy"  # type: ignore[union-attr]
    finally:
        await broker.stop()


async def test_a_pod_that_comes_while_the_jobs_events_are_read_keeps_its_attempt(
        cluster: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    # The deadline of a Job without Pods reads its Events before it withdraws it; the Job controller may make its
    # Pod meanwhile (the ResourceQuota that refused it freed). The attempt was withdrawn with a running Pod.
    adapter = make_site(cluster, unschedulable_after_s=600)
    await adapter.start()
    stream = adapter.events()
    reading, go_on = asyncio.Event(), asyncio.Event()
    real = k8s.CoreV1Api.list_namespaced_event_without_preload_content

    async def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        reading.set()
        await go_on.wait()
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(k8s.CoreV1Api, "list_namespaced_event_without_preload_content", slow)
    try:
        name = await j1_sent(adapter)
        await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"metadata": {
            "creationTimestamp": (datetime.now(UTC) - timedelta(seconds=601)).strftime("%Y-%m-%dT%H:%M:%SZ")}})
        await asyncio.wait_for(reading.wait(), 5)
        await pod_running(cluster, name)  # the Pod comes while the Events are read
        assert (await next_event(adapter, stream)).kind == EventKind.RUNNING
        go_on.set()
        await asyncio.sleep(0.5)
        assert adapter._events.empty() and ("heliotrope-t1", name) in jobs(cluster)
    finally:
        go_on.set()
        await adapter.close()


async def test_a_state_config_map_read_answered_with_no_json_leaves_the_site_starting_on_its_file(
        cluster: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A proxy in the way answering 200 with a page that is no JSON: the read raised past the adapter's start,
    # and the site did not come up.
    async def not_json(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    monkeypatch.setattr(k8s.CoreV1Api, "read_namespaced_config_map_without_preload_content", not_json)
    adapter = make_site(cluster, state_dir=tmp_path, state_namespace="heliotrope")
    await adapter.start()
    try:
        assert (await adapter.snapshot()).health == "healthy"
        assert "cannot read the stops not yet reported from ConfigMap heliotrope/heliotrope-stops-kube" in caplog.text
        assert "cannot read the usage history from ConfigMap heliotrope/heliotrope-usage-kube" in caplog.text
    finally:
        await adapter.close()


# --- logs (kmock stores Pods but runs no container: it has no log to serve, and answers a Pod's log
# subresource with the Pod itself; each test routes the log subresource to what a kubelet would answer) ---


async def test_a_running_attempts_logs_are_its_pods_job_container_log_as_the_api_server_cuts_it(cluster, kube) -> None:  # noqa: ANN001
    name = await j1_sent(kube)
    await pod_running(cluster, name)
    cluster[kmock.subresource("log")] << b"epoch 9 loss 0.31\nepoch 10 loss 0.30\n"
    got = await kube.logs("j-1", 1, 2, 1 << 20)
    assert got.text == "epoch 9 loss 0.31\nepoch 10 loss 0.30\n"
    assert got.source == f"pod heliotrope-t1/{name}-abc container job"
    assert got.truncated  # as long as the tail asked for: lines before it may have been left out
    (asked,) = cluster[kmock.subresource("log")]
    assert asked.params == {"container": "job", "tailLines": "2"}  # (the bytes are cut here: see below)
    assert str(asked.url.path) == f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc/log"
    shorter = await kube.logs("j-1", 1, 10, 1 << 20)
    assert not shorter.truncated and shorter.text == got.text


async def test_logs_come_from_the_newest_pod_of_the_attempt_and_no_other_attempts(cluster, kube) -> None:  # noqa: ANN001
    name = await j1_sent(kube)
    labels = dict(jobs(cluster)[("heliotrope-t1", name)]["spec"]["template"]["metadata"]["labels"])
    for pod_name, created, attempt in (("old", "2026-01-01T00:00:00Z", "1"), ("new", "2026-01-01T00:05:00Z", "1"),
                                       ("other", "2026-01-01T00:09:00Z", "2")):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": "heliotrope-t1", "creationTimestamp": created,
                            "labels": {**labels, "heliotrope.io/attempt": attempt}},
               "spec": {"containers": [{"name": "istio-proxy", "image": "x"}, {"name": "job", "image": "x"}]}}
        assert (await cluster.post("/api/v1/namespaces/heliotrope-t1/pods", json=pod)).status == 200
    cluster[kmock.subresource("log")] << b"hello\n"
    got = await kube.logs("j-1", 1, None, 4096)
    assert got.source == "pod heliotrope-t1/new container job" and not got.truncated
    (asked,) = cluster[kmock.subresource("log")]
    assert str(asked.url.path).endswith("/pods/new/log") and "tailLines" not in asked.params


@pytest.mark.parametrize("answer, error, says", [
    (None, LogsNotFound, "site kube has no Pod of attempt 1 of job j-1: it has not been made yet, or it was deleted"),
    (400, LogsNotFound, 'has no log (container "job" in pod "p" is waiting to start: ContainerCreating)'),
    (403, LogsUnsupported, "grant the site's credentials get on pods/log"),
], ids=["no Pod (gone, or not made yet)", "a Pod whose container waits to start", "RBAC without pods/log"])
async def test_logs_of_an_attempt_without_a_log_to_read_say_why(cluster, kube, answer, error, says) -> None:  # noqa: ANN001
    name = await j1_sent(kube)
    if answer is not None:
        await pod_running(cluster, name)
        message = ('container "job" in pod "p" is waiting to start: ContainerCreating' if answer == 400 else
                   'pods "p" is forbidden: User "heliotrope" cannot get resource "pods/log"')
        cluster[kmock.subresource("log")] << answer << {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                         "message": message, "code": answer}
    with pytest.raises(error) as caught:
        await kube.logs("j-1", 1, 10, 4096)
    assert says in str(caught.value)


@pytest.mark.parametrize("outcome", ["succeeded", "failed"], ids=["a Job that succeeded", "a Job that failed"])
async def test_an_ended_attempts_log_is_kept_when_its_job_and_pods_are_deleted(cluster, kube, outcome) -> None:  # noqa: ANN001
    # The adapter deletes an ended attempt's Job with its Pods once the broker has its outcome; the log of a job
    # that failed, the one its owner most wants to read, went with them.
    stream = kube.events()
    name = await j1_running(kube, stream, cluster)
    cluster[kmock.subresource("log")] << b"epoch 1\nTraceback (most recent call last):\nCUDA out of memory\n"
    condition = "Complete" if outcome == "succeeded" else "Failed"
    await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"status": {
        outcome: 1, "conditions": [{"type": condition, "status": "True"}]}})
    done = await next_event(kube, stream)
    kube.taken(done)
    assert await gone(cluster, name)
    await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")  # (the cluster's cascade)
    got = await kube.logs("j-1", 1, 2, 1 << 20)
    assert got.text == "Traceback (most recent call last):\nCUDA out of memory\n" and got.truncated
    assert got.source == f"pod heliotrope-t1/{name}-abc container job (kept when its Job was deleted)"
    assert (await kube.logs("j-1", 1, None, 1 << 20)).text.startswith("epoch 1\n")
    with pytest.raises(LogsNotFound):  # another attempt's is not made up from it
        await kube.logs("j-1", 2, None, 1 << 20)



async def test_an_ended_attempts_kept_log_outlives_a_restart_with_a_state_dir(cluster, tmp_path) -> None:  # noqa: ANN001
    # Kept in memory only, the log of a job that failed was gone after the broker restarted (an upgrade): its Job and
    # Pods had been deleted, so nothing could be read any more.
    kube = make_site(cluster, state_dir=tmp_path)
    await kube.start()
    try:
        stream = kube.events()
        name = await j1_running(kube, stream, cluster)
        cluster[kmock.subresource("log")] << b"epoch 1\nTraceback (most recent call last):\nCUDA out of memory\n"
        await cluster.patch(f"/apis/batch/v1/namespaces/heliotrope-t1/jobs/{name}", json={"status": {
            "failed": 1, "conditions": [{"type": "Failed", "status": "True"}]}})
        kube.taken(await next_event(kube, stream))
        assert await gone(cluster, name)
        await cluster.delete(f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc")
    finally:
        await kube.close()
    again = make_site(cluster, state_dir=tmp_path)  # the adapter of the broker that started next
    await again.start()
    try:
        got = await again.logs("j-1", 1, 2, 1 << 20)
        assert got.text == "Traceback (most recent call last):\nCUDA out of memory\n" and got.truncated
        assert got.source == f"pod heliotrope-t1/{name}-abc container job (kept when its Job was deleted)"
        followed = await again.follow_logs("j-1", 1, None, 1 << 20)
        assert "".join([chunk async for chunk in followed.chunks]).startswith("epoch 1\n")
        with pytest.raises(LogsNotFound):
            await again.logs("j-1", 2, None, 1 << 20)
        # The site leaves the federation: a new site of its name reads none of them.
        await again.forget_quotas()
        with pytest.raises(LogsNotFound):
            await again.logs("j-1", 1, None, 1 << 20)
    finally:
        await again.close()
    assert not (tmp_path / "kube" / "logs").exists()


async def test_kept_logs_keep_their_bound_and_a_damaged_index_is_set_aside(tmp_path, caplog) -> None:  # noqa: ANN001
    from adapters.kept_logs import KeptLog, KeptLogs, file_name

    folder = tmp_path / "kube" / "logs"
    kept = KeptLogs(folder, "kube")
    for attempt in range(1, 6):  # 5 logs of 400 bytes, kept to 1,000 bytes: the two newest stay
        await kept.put(("j/../1", attempt), KeptLog(b"x" * 399 + b"\n", attempt == 5, f"pod p{attempt}"), 1000)
    assert kept.bytes == 800
    assert sorted(p.name for p in folder.glob("*.log")) == sorted(file_name(("j/../1", a)) for a in (4, 5))
    again = KeptLogs(folder, "kube")  # a restart: the same two, in the same order, as they were
    assert [again.get(("j/../1", a)) for a in (4, 5)] == [kept.get(("j/../1", a)) for a in (4, 5)]
    assert again.get(("j/../1", 3)) is None and again.get(("j/../1", 5)).truncated
    (folder / file_name(("j/../1", 4))).unlink()  # one file lost: the other is still read
    (folder / "stray.log").write_bytes(b"left by a crash")  # a file no index names is cleared away
    third = KeptLogs(folder, "kube")
    assert third.get(("j/../1", 4)) is None and third.get(("j/../1", 5)) is not None
    assert not (folder / "stray.log").exists()
    (folder / "index.json").write_text("{not json")
    with caplog.at_level("ERROR"):
        fourth = KeptLogs(folder, "kube")
    assert len(fourth) == 0 and (folder / "index.json.unreadable").exists()
    assert "kept logs" in caplog.text

async def test_a_log_kept_as_or_after_the_site_leaves_brings_back_no_folder(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # The site leaves while an ended attempt's log is being written (its Job deleted in the background), or one is
    # kept after (forget_quotas awaits the cluster's copies first): a new site of its name must find no folder.
    import threading
    from adapters import kept_logs
    from adapters.kept_logs import KeptLog, KeptLogs

    folder = tmp_path / "kube" / "logs"
    kept = KeptLogs(folder, "kube")
    await kept.put(("j", 1), KeptLog(b"one\n", False, None), 1000)
    writing, release = threading.Event(), threading.Event()
    write = kept_logs.write_atomically

    def slow(path: Path, data: bytes) -> None:
        writing.set()
        release.wait(5)
        write(path, data)

    monkeypatch.setattr(kept_logs, "write_atomically", slow)
    under_way = asyncio.create_task(kept.put(("j", 2), KeptLog(b"two\n", False, None), 1000))
    assert await asyncio.to_thread(writing.wait, 5)
    threading.Timer(0.2, release.set).start()  # (the write ends while the site is forgotten)
    kept.forget()
    await under_way
    monkeypatch.setattr(kept_logs, "write_atomically", write)
    await kept.put(("j", 3), KeptLog(b"three\n", False, None), 1000)
    assert not folder.exists()
    assert len(KeptLogs(folder, "kube")) == 0


async def test_kept_logs_load_from_a_read_only_state_dir_and_keep_their_bound_after_a_failed_write(
        tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    import errno
    from adapters import kept_logs
    from adapters.kept_logs import KeptLog, KeptLogs, file_name

    folder = tmp_path / "kube" / "logs"
    kept = KeptLogs(folder, "kube")
    await kept.put(("j", 1), KeptLog(b"x" * 399 + b"\n", False, None), 1000)
    (folder / "stray.log").write_bytes(b"left by a crash")
    unlink = Path.unlink

    def read_only(path: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "unlink", read_only)  # (root passes a chmod: a read-only mount does not)
    with caplog.at_level("WARNING"):
        again = KeptLogs(folder, "kube")  # the adapter still starts, with the log kept
    assert again.get(("j", 1)) is not None and "stray.log" in caplog.text
    monkeypatch.setattr(Path, "unlink", unlink)
    # A write that fails (a full disk) as the bound drops the oldest: its file goes at the next write that works,
    # not only at the next start.
    write = kept_logs.write_atomically

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(kept_logs, "write_atomically", full)
    await again.put(("j", 2), KeptLog(b"y" * 999 + b"\n", False, None), 1000)  # ("j", 1) goes from memory
    monkeypatch.setattr(kept_logs, "write_atomically", write)
    await again.put(("j", 3), KeptLog(b"z\n", False, None), 1000)  # ("j", 2) goes too
    assert sorted(p.name for p in folder.glob("*.log")) == sorted([file_name(("j", 3)), "stray.log"])


def kubelet_log(text: bytes) -> Any:
    """What a kubelet answers for a container whose log is ``text``: its last ``tailLines`` lines, then, as
    ``limitBytes`` says, only the first that many bytes of them (it stops writing there)."""
    def answer(request: kmock.Request) -> bytes:
        out = text
        if "tailLines" in request.params:
            lines = text.splitlines(keepends=True)
            out = b"".join(lines[len(lines) - int(request.params["tailLines"]):])
        if "limitBytes" in request.params:
            out = out[:int(request.params["limitBytes"])]
        return out
    return answer


async def test_a_log_longer_than_the_bytes_asked_for_keeps_its_end_not_the_start_of_its_tail_logs(cluster, kube) -> None:  # noqa: ANN001
    # The API server's limitBytes stops the answer after that many bytes: asked for the last 3 lines and at most
    # 150 bytes, a kubelet writes the first 150 bytes of those lines, and the newest ones never came.
    name = await j1_sent(kube)
    await pod_running(cluster, name)
    lines = [f"step {i} ".encode() + b"x" * 90 + b"\n" for i in range(1, 6)]
    cluster[kmock.subresource("log")] << kubelet_log(b"".join(lines))
    got = await kube.logs("j-1", 1, 3, 150)
    assert got.truncated and got.text.endswith(lines[-1].decode()) and len(got.text.encode()) <= 150
    (asked,) = cluster[kmock.subresource("log")]
    assert asked.params.get("tailLines") == "3"
    # a character cut in two where the bytes kept begin is left out, not shown as a replacement character
    assert kubernetes_logs.as_logs("né\n".encode()[2:], True, None, 100, "p") == JobLogs("\n", True, "p")


async def test_the_ended_logs_kept_hold_no_more_memory_than_their_bound_logs(kube, monkeypatch) -> None:  # noqa: ANN001
    # A Python str with one character beyond U+FFFF (an emoji) takes 4 bytes for each of its characters: the
    # bound on the logs kept counted their bytes of UTF-8, so logs of ASCII and an emoji held four times as much.
    import gc
    import tracemalloc

    from adapters import kubernetes as kubernetes_module

    monkeypatch.setattr(kubernetes_module, "ENDED_LOGS_BYTES", 1 << 20)

    async def logs(job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
        return JobLogs("\U0001f680 launched\n" + "x" * (64 * 1024 - 20) + f" {attempt:03d}\n", False, "pod p")

    monkeypatch.setattr(kube, "logs", logs)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for attempt in range(1, 33):  # 2 MiB of logs, twice the bound
            await kube._keep_log(("j-1", attempt))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1.25 * (1 << 20), f"{held} bytes held for logs kept to 1 MiB"
    newest = await KubernetesSite.logs(kube, "j-1", 32, None, 1 << 20)
    assert newest.text.startswith("\U0001f680 launched\n") and newest.text.endswith(" 032\n")
    assert newest.source == "pod p (kept when its Job was deleted)"
    with pytest.raises(LogsNotFound):  # the oldest went
        await KubernetesSite.logs(kube, "j-1", 1, None, 1 << 20)


class FollowedKubelet:
    """What a kubelet answers for a container that is still writing its log: a read without ``follow`` as
    :func:`kubelet_log` does, and one with ``follow=true`` streamed, its last ``tailLines`` lines, then each
    :meth:`write` as it comes, until :meth:`exit` (the container ended). ``closed`` is set once a followed read's
    stream has been let go of (the reader left, or it ended)."""

    def __init__(self, text: bytes) -> None:
        self.text, self.wrote, self.ended, self.closed = text, asyncio.Event(), False, asyncio.Event()

    def write(self, data: bytes) -> None:
        self.text += data
        self.wrote.set()

    def exit(self) -> None:
        self.ended = True
        self.wrote.set()

    def __call__(self, request: kmock.Request) -> Any:
        if request.params.get("follow") != "true":
            return kubelet_log(self.text)(request)
        return self._follow(kubelet_log(self.text)(request))

    async def _follow(self, tail: bytes) -> AsyncIterator[bytes]:
        sent = len(self.text)
        try:
            yield tail
            while not self.ended:
                await self.wrote.wait()
                self.wrote.clear()
                if len(self.text) > sent:
                    yield self.text[sent:]
                    sent = len(self.text)
        finally:
            self.closed.set()


async def test_a_followed_log_is_the_tail_then_what_the_container_writes_until_it_ends_logs(
        cluster, kube) -> None:  # noqa: ANN001
    name = await j1_sent(kube)
    await pod_running(cluster, name)
    kubelet = FollowedKubelet(b"epoch 1 loss 0.9\nepoch 2 loss 0.5\nepoch 3 loss 0.4\n")
    cluster[kmock.subresource("log")] << kubelet
    followed = await kube.follow_logs("j-1", 1, 2, 1 << 20)
    assert followed.truncated and followed.source == f"pod heliotrope-t1/{name}-abc container job"
    assert await anext(followed.chunks) == "epoch 2 loss 0.5\nepoch 3 loss 0.4\n"
    kubelet.write("epoch 4 loss 0.3 \u2713\n".encode()[:-3])  # a character split between two writes
    kubelet.write("epoch 4 loss 0.3 \u2713\n".encode()[-3:])
    got = await anext(followed.chunks)
    while not got.endswith("\n"):
        got += await anext(followed.chunks)
    assert got == "epoch 4 loss 0.3 \u2713\n"
    kubelet.exit()  # the container ended: the kubelet ends the stream, and so does the follow
    assert [chunk async for chunk in followed.chunks] == []
    asked = [r for r in cluster[kmock.subresource("log")] if r.params.get("follow") == "true"]
    assert [r.params for r in asked] == [{"container": "job", "tailLines": "2", "follow": "true"}]
    assert str(asked[0].url.path) == f"/api/v1/namespaces/heliotrope-t1/pods/{name}-abc/log"


async def test_a_followed_log_longer_than_the_bytes_starts_at_the_first_whole_line_that_fits_logs(
        cluster, kube) -> None:  # noqa: ANN001
    # The API server's limitBytes would end the stream after that many bytes: the followed read asks for as many
    # lines as the bytes hold instead.
    name = await j1_sent(kube)
    await pod_running(cluster, name)
    lines = [f"step {i} ".encode() + b"x" * 90 + b"\n" for i in range(1, 6)]  # 98 or 99 bytes each
    kubelet = FollowedKubelet(b"".join(lines))
    cluster[kmock.subresource("log")] << kubelet
    followed = await kube.follow_logs("j-1", 1, None, 250)
    assert followed.truncated
    assert await anext(followed.chunks) == (lines[3] + lines[4]).decode()
    asked = [r for r in cluster[kmock.subresource("log")] if r.params.get("follow") == "true"]
    assert asked[0].params["tailLines"] == "2"
    await followed.chunks.aclose()


async def test_a_follow_let_go_of_closes_its_stream_from_the_cluster_logs(cluster, kube) -> None:  # noqa: ANN001
    name = await j1_sent(kube)
    await pod_running(cluster, name)
    kubelet = FollowedKubelet(b"loading\n")
    cluster[kmock.subresource("log")] << kubelet
    followed = await kube.follow_logs("j-1", 1, 10, 1 << 20)
    assert await anext(followed.chunks) == "loading\n"
    await followed.chunks.aclose()  # the reader left (the broker's client went away)
    kubelet.write(b"epoch 1\n")  # the kubelet's next write finds the connection gone
    await asyncio.wait_for(kubelet.closed.wait(), 5)


@pytest.mark.parametrize("answer, error", [(400, LogsNotFound), (403, LogsUnsupported)],
                         ids=["a container that waits to start", "RBAC without pods/log"])
async def test_following_a_log_that_cannot_be_read_says_why_before_any_text_logs(
        cluster, kube, answer, error) -> None:  # noqa: ANN001
    name = await j1_sent(kube)
    await pod_running(cluster, name)
    cluster[kmock.subresource("log")] << answer << {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                     "message": "no", "code": answer}
    with pytest.raises(error):
        await kube.follow_logs("j-1", 1, 10, 4096)


async def test_following_an_ended_attempts_kept_log_sends_it_and_ends_logs(kube, monkeypatch) -> None:  # noqa: ANN001
    async def logs(job_id: str, attempt: int, tail_lines: int | None, limit_bytes: int) -> JobLogs:
        return JobLogs("epoch 1\nCUDA out of memory\n", False, "pod p")

    monkeypatch.setattr(kube, "logs", logs)
    await kube._keep_log(("j-1", 1))
    monkeypatch.undo()
    followed = await kube.follow_logs("j-1", 1, 1, 1 << 20)
    assert followed.truncated and followed.source == "pod p (kept when its Job was deleted)"
    assert [chunk async for chunk in followed.chunks] == ["CUDA out of memory\n"]
