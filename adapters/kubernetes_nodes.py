"""Kubernetes Nodes as heliotrope's inventory: which GPUs a Node offers, how Nodes group into node groups,
and where a Pod the cluster already placed sits in that inventory.

Also the reading back of what runs already: a Job's or Pod's attempt, whether a Job ended, and what an
active Job of this site asks (for re-entering it into the ledgers after a broker restart).

Units: whole GPUs; MIG slices per profile (7 compute slices a GPU); times in POSIX seconds. Pure: no I/O;
the adapter (``adapters.kubernetes``) reads the Nodes, Pods and Jobs and calls these.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker import ids
from broker.models import GpuRequest, NodeGroup, Toleration, mig_slices
from policies.quota import Ask
from policies.inventory import KIB_PER_GIB, MIG_SLICES_PER_GPU, MILLI_PER_GPU, Inventory, MigProfile, Placement, Slot

log = logging.getLogger("adapters.kubernetes")

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB
# The share of a GPU's nominal memory its driver may keep from what it reports (ECC, reserved pages): a
# memory label this close below the model's nominal size is that size (``_parts``).
DRIVER_RESERVED_SHARE = 0.1
REPLICAS_LABEL = "nvidia.com/gpu.replicas"  # > 1: each GPU shared by that many Pods (time-slicing, MPS)
STRATEGY_LABEL = "nvidia.com/mig.strategy"  # "single": MIG slices of one profile, advertised as nvidia.com/gpu
JOB_LABEL = "heliotrope.io/job-id"
ATTEMPT_LABEL = "heliotrope.io/attempt"
JOB_ANNOTATION = "heliotrope.io/job-id"  # the full id (a label value is at most 63 characters)
ASK_ANNOTATION = "heliotrope.io/ask"  # JSON: priority, preemptible, min_run_s, checkpointable (for adoption)


def product_model(product: str) -> str:
    """The canonical model of a GFD product label (``NVIDIA-A100-SXM4-80GB``, or ``...-MIG-1g.10gb`` under
    the single MIG strategy); ``ids.UnknownIdentifier`` if unknown."""
    return ids.gpu_model(re.sub(r"-MIG-.*$", "", product, flags=re.IGNORECASE))


def single_profile(product: str) -> str | None:
    """The MIG profile of a product label of the single MIG strategy (``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``
    → ``1g.5gb``); None for a whole GPU's label."""
    match = re.search(r"-MIG-(.+)$", product, flags=re.IGNORECASE)
    return match.group(1).lower() if match else None


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """What one Node offers: ``gpus`` whole GPUs, ``mig_gpus`` GPUs in MIG mode serving ``mig`` slices.
    ``single``: under the device plugin's single MIG strategy, the profile whose slices it advertises as
    ``nvidia.com/gpu`` (so a Pod asks ``nvidia.com/gpu`` for them); None otherwise."""

    name: str
    model: str
    product: str
    gpus: int
    mig_gpus: int
    mig: dict[str, int]
    memory_gib: float | None
    single: str | None = None


def read_node(node: dict[str, Any], tolerations: Sequence[Toleration] = (),
              node_selector: Mapping[str, str] | None = None) -> NodeGpus | str:
    """A Node's GPUs, or why it is left out: no GPUs, cordoned, not Ready, without a label of ``node_selector``
    (the Pods' nodeSelector), a NoSchedule or NoExecute taint none of ``tolerations`` (the Pods') tolerates, GPUs
    shared by time-slicing or MPS (GPU feature discovery's ``nvidia.com/gpu.replicas`` above 1, or a product
    label ending ``-SHARED``: its ``nvidia.com/gpu`` are shares, not GPUs), or no known GPU product."""
    meta, status = node.get("metadata", {}), node.get("status", {})
    name = meta.get("name", "?")
    labels = meta.get("labels") or {}
    allocatable = status.get("allocatable") or {}
    gpus = int(allocatable.get(GPU, "0") or 0)
    mig: dict[str, int] = {}
    for key, value in allocatable.items():
        if key.startswith(MIG_PREFIX) and int(value or 0) > 0:
            profile = key[len(MIG_PREFIX):]
            try:
                mig_slices(profile)
            except ValueError:
                log.warning("node %s: MIG resource %s is not a profile heliotrope knows; left out", name, key)
                continue
            mig[profile] = int(value)
    if not gpus and not mig:
        return f"node {name} has no allocatable {GPU} or {MIG_PREFIX}* resources"
    if (node.get("spec") or {}).get("unschedulable"):
        return f"node {name} is cordoned"
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    if ready and ready[0].get("status") != "True":
        return f"node {name} is not Ready"
    for key, value in (node_selector or {}).items():
        if labels.get(key) != value:
            return f"node {name} has no label {key}={value} (adapter.node_selector)"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(t.tolerates(taint) for t in tolerations):
            shown = f"{taint.get('key')}={taint['value']}" if taint.get("value") else f"{taint.get('key')}"
            return (f"node {name} is tainted {shown}:{taint.get('effect')}, which no toleration of "
                    "adapter.tolerations tolerates")
    product = labels.get(PRODUCT_LABEL)
    if not product:
        return f"node {name} has GPUs but no {PRODUCT_LABEL} label (install NVIDIA GPU feature discovery)"
    replicas = labels.get(REPLICAS_LABEL, "1")
    if (replicas.isdigit() and int(replicas) > 1) or product.upper().endswith("-SHARED"):
        # The device plugin's time-slicing or MPS: each nvidia.com/gpu is a share of a GPU, not a GPU
        return (f"node {name} shares each GPU among {replicas} Pods (the device plugin's time-slicing or MPS, "
                f"{PRODUCT_LABEL}={product}); heliotrope hands out whole GPUs or MIG slices only")
    try:
        model = product_model(product)
    except ids.UnknownIdentifier as e:
        return f"node {name}: {e}"
    memory_mib = labels.get(MEMORY_LABEL)
    memory_gib = round(int(memory_mib) / 1024, 1) if memory_mib and memory_mib.isdigit() else None
    single = single_profile(product)
    if single is not None or (labels.get(STRATEGY_LABEL) == "single" and gpus):
        # The single strategy: each nvidia.com/gpu is a MIG slice of the product label's profile, the count
        # and memory labels are the slices', and the physical GPUs are the fewest that hold those slices.
        if single is None:
            return f"node {name} uses the single MIG strategy, but its {PRODUCT_LABEL} label {product} names no profile"
        try:
            slices = mig_slices(single)
        except ValueError:
            return (f"node {name}: its {PRODUCT_LABEL} label {product} names MIG profile {single}, which "
                    "heliotrope does not know")
        if mig:
            return f"node {name} advertises MIG slices both as {GPU} (single strategy) and as {MIG_PREFIX}*"
        # As many of the profile as fit one GPU, in compute slices and in memory, as the inventory places them
        # (an A100 40GB holds seven 1g.5gb, three 2g.10gb, two 3g.20gb, one 4g.20gb)
        profile = MigProfile.parse(single)
        per_gpu = max(min(MIG_SLICES_PER_GPU // slices,
                          int(ids.GPU_MODEL_BY_ID[model].memory_gib * KIB_PER_GIB // profile.memory_kib)), 1)
        return NodeGpus(name, model, product, 0, max(math.ceil(gpus / per_gpu), 1), {single: gpus}, None, single)
    mig_gpus = 0
    if mig:
        counted = int(labels.get(COUNT_LABEL, "0") or 0) - gpus
        needed = math.ceil(sum(mig_slices(p) * n for p, n in mig.items()) / 7)
        mig_gpus = max(counted, needed, 1)
    return NodeGpus(name, model, product, gpus, mig_gpus, mig, memory_gib)


def _parts(n: NodeGpus) -> list[tuple[str, int, tuple[str, ...], float | None]]:
    """The node-group keys of a node's whole-GPU part and MIG part (either may be absent).

    The memory label (what the driver reports, e.g. 81559 MiB, 79.6 GiB, for an H100 80GB) sizes the whole
    GPUs only. The MIG part keeps the model's memory: MIG profile names carry nominal memory (an H100 80GB
    holds a 7g.80gb, or a 4g.40gb beside a 3g.40gb), so sizing its GPUs by the label refused slices the GPU
    holds, and a 7g.80gb (7g.141gb on an H200) made the node group invalid.

    The whole GPUs take the model's nominal memory too where the label is within ``DRIVER_RESERVED_SHARE``
    of it: the driver keeps a few per cent for itself (81,559 MiB of an H100 80GB, 23,034 of an L4 24GB, 15,109
    of a T4 16GB with ECC on), and a job that asks ``memory_gib: 80`` of an H100 80GB, as its users say it,
    was refused. A label further below the nominal (a smaller variant that a product name does not tell
    apart) sizes them."""
    nominal = ids.GPU_MODEL_BY_ID[n.model].memory_gib
    memory = n.memory_gib if n.memory_gib and n.memory_gib < nominal * (1 - DRIVER_RESERVED_SHARE) else None
    out = []
    if n.gpus:
        out.append((n.model, n.gpus, (), memory))
    if n.mig_gpus:
        out.append((n.model, n.mig_gpus, tuple(sorted(n.mig)), None))
    return out


def node_groups(nodes: list[NodeGpus]) -> list[NodeGroup]:
    """Identical nodes grouped, whole-GPU and MIG parts apart, in a stable order."""
    counts: dict[tuple[str, int, tuple[str, ...], float | None], int] = {}
    for n in nodes:
        for key in _parts(n):
            counts[key] = counts.get(key, 0) + 1
    return [NodeGroup(model=m, gpus_per_node=per, nodes=k, mig_profiles=list(profiles), memory_gib_per_gpu=mem)
            for (m, per, profiles, mem), k in sorted(counts.items(), key=lambda kv: repr(kv[0]))]


def inventory_nodes(nodes: list[NodeGpus]) -> dict[str, list[str]]:
    """Each Node's names in the inventory built from ``node_groups(nodes)`` (``<group>-<node>``; a node with
    whole and MIG GPUs has two), nodes numbered in the order given within each group."""
    keys = sorted({key for n in nodes for key in _parts(n)}, key=repr)
    index = {key: i for i, key in enumerate(keys)}
    seen = [0] * len(keys)
    out: dict[str, list[str]] = {}
    for n in nodes:
        for key in _parts(n):
            g = index[key]
            out.setdefault(n.name, []).append(f"{g}-{seen[g]}")
            seen[g] += 1
    return out


def place_on(inventory: Inventory, req: GpuRequest, model: str, nodes: Collection[str],
             partial: bool = False) -> Placement | None:
    """``req`` (whole GPUs or MIG slices) on the free GPUs of ``nodes`` (inventory names) of ``model``, where a
    Pod already runs: the cluster chose the node, not the inventory. ``partial``: take what is free there
    (for Pods the ledger did not expect); else None when it does not all fit."""
    gpus = [g for g in inventory.gpus() if g.node in nodes and g.model == model]
    slots: list[Slot] = []
    if req.mig_profile is None:
        for g in gpus:
            if len(slots) < req.count and not g.mig and g.milli == 0:
                slots.append(Slot(g.node, g.device, MILLI_PER_GPU, g.memory_kib))
        charge = float(len(slots))
    else:
        p = MigProfile.parse(req.mig_profile)
        for g in gpus:
            used, kib = g.mig_slices, g.used_kib
            while g.mig and len(slots) < req.count and used + p.slices <= MIG_SLICES_PER_GPU \
                    and kib + p.memory_kib <= g.memory_kib:
                slots.append(Slot(g.node, g.device, 0, p.memory_kib, p.name))
                used, kib = used + p.slices, kib + p.memory_kib
        charge = len(slots) * p.slices / MIG_SLICES_PER_GPU
    if not slots or (len(slots) < req.count and not partial):
        return None
    return Placement(model, tuple(slots), charge)


def pod_gpus(pod: dict[str, Any]) -> GpuRequest | None:
    """What a Pod asks of GPUs: whole ``nvidia.com/gpu`` or one MIG profile's slices, summed over its
    containers' limits (else requests); None when it asks for none."""
    whole, mig = 0, {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        resources = c.get("resources") or {}
        amounts = resources.get("limits") or resources.get("requests") or {}
        for key, value in amounts.items():
            try:
                n = int(value)
            except (TypeError, ValueError):
                continue
            if key == GPU:
                whole += n
            elif key.startswith(MIG_PREFIX):
                mig[key[len(MIG_PREFIX):]] = mig.get(key[len(MIG_PREFIX):], 0) + n
    if whole > 0:
        return GpuRequest(count=whole)
    for profile, n in sorted(mig.items()):
        if n > 0:
            with contextlib.suppress(ValueError):
                return GpuRequest(count=n, mig_profile=profile)
    return None


def attempt_key(meta: dict[str, Any]) -> tuple[str, int] | None:
    """(job id, attempt) from a Job's or Pod's metadata; None if it carries none."""
    labels = meta.get("labels") or {}
    try:
        return ((meta.get("annotations") or {}).get(JOB_ANNOTATION) or labels[JOB_LABEL], int(labels[ATTEMPT_LABEL]))
    except (KeyError, ValueError):
        return None


def job_ended(status: dict[str, Any]) -> bool:
    """A Job that is Complete or Failed (its GPUs are free)."""
    done = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    return bool(done & {"Complete", "Failed"}) or (status.get("succeeded") or 0) > 0 or (status.get("failed") or 0) > 0


def _timestamp(value: str | None) -> float | None:
    """POSIX seconds of an RFC 3339 time such as ``2024-05-01T12:00:00Z``; None if absent or unreadable."""
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None
    except ValueError:
        return None


def job_ask(obj: dict[str, Any], key: str, tenant: str) -> tuple[GpuRequest, Ask, float | None] | str:
    """What a Job this site made asks, read back from the cluster (a broker restart): its GPUs (container
    limits), the ask for the quota book (model from its node affinity, the rest from its annotation) and its
    start (``status.startTime``, else ``metadata.creationTimestamp``; POSIX seconds); or why it cannot be read."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    template = (obj.get("spec") or {}).get("template") or {}
    req = pod_gpus(template)
    terms = (((template.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms") or [{}]
    products = [v for e in terms[0].get("matchExpressions") or [] if e.get("key") == PRODUCT_LABEL
                for v in e.get("values") or []]
    try:
        model = product_model(products[0]) if products else None
    except ids.UnknownIdentifier:
        model = None
    if req is None or model is None:
        return (f"Job {meta.get('namespace')}/{meta.get('name')} has no GPU limits or {PRODUCT_LABEL} affinity "
                "that heliotrope reads")
    if req.mig_profile is None and (profile := single_profile(products[0])) is not None:
        req = GpuRequest(count=req.count, mig_profile=profile)  # slices of a single-strategy node
    try:
        extra = json.loads((meta.get("annotations") or {}).get(ASK_ANNOTATION, "{}"))
    except ValueError:
        extra = {}
    ask = Ask(key, tenant, float(req.count), model, int(extra.get("priority", 0)),
              bool(extra.get("preemptible", False)), extra.get("min_run_s"), bool(extra.get("checkpointable", False)))
    return req, ask, _timestamp(status.get("startTime") or meta.get("creationTimestamp"))
