"""A site's GPU inventory: which GPUs of which nodes a job takes, all or none, never more than there is.

Pure and synchronous (no I/O, no clock, no settings): every adapter asks ``Inventory.find`` whether and where
a job's GPUs fit, commits what it found and releases it when the job ends. There is no switch to turn it
off; an adapter whose cluster places GPUs itself may use only ``Inventory.free`` for counts.

Units: GPUs; thousandths of a GPU's compute (milli); memory in KiB, exact integers (1 GiB = 1,048,576 KiB; a
job's memory is rounded up to a KiB, a GPU's down); MIG compute slices, 7 per GPU.

The site: node groups → nodes named ``<group>-<node>`` (``0-3`` is node 3 of the spec's first group) → GPUs
numbered from 0 on each node. A node group with ``mig_profiles`` is in MIG mode: its GPUs serve MIG slices
only; the others serve whole-GPU and fractional jobs.

Packing rules, chosen to keep large blocks free (ties go to the lowest node or GPU number, so every answer
is deterministic):

- Whole GPUs (``count`` GPUs with nothing on them, one model, at least ``memory_gib`` each; all or none):
  ``node``: the fullest node with ``count`` free (fewest free GPUs: best fit); ``nvlink``: the fullest NVLink
  domain with ``count`` free (nodes of a group without ``nvlink_domain`` are each their own domain), filled as
  ``any`` inside it; ``any``: from the fullest nodes first, so nodes with many free GPUs stay whole for jobs
  that need one node.
- Fractional (one GPU: ``milli`` below 1000 of its compute, or ``shared`` with ``memory_gib``): compute is
  ``milli``, or for a shared job ceil(1000 × memory_gib / GPU memory); memory is ``memory_gib``, or the
  ``milli`` share of the GPU's memory. Best fit: the fullest partly used GPU (fullness = the larger of its
  used compute and used memory, in thousandths) where both fit, else an empty GPU on the fullest node.
- MIG (``count`` slices of ``mig_profile``, all or none): the fullest MIG GPU offering the profile (most
  compute slices used, then most memory) takes as many as fit, then the next.
- ``topology`` applies to whole GPUs, as ``GpuRequest`` documents: a share is one GPU, and MIG slices go
  wherever they fit best.
- Models: the broker's choice, else the request's, else every model here from the least memory per GPU to
  the most (then by name); the first that fits wins, and the reason it does not fit names what each lacked.
- Quota charge (``Placement.gpus``): whole GPUs: ``count``; fractional: max(compute, memory share) of one
  GPU; MIG: N/7 a slice of an ``Ng.Mgb`` profile.

Not modelled: on a real GPU each MIG slice starts at one of a few fixed positions, so some mixes that add
up to 7 compute slices and the GPU's memory, or some orders of creating them, are refused there. Here a MIG
GPU holds any mix of offered slices with at most 7 compute slices and at most its memory; where a real GPU
refuses a mix this inventory accepted, the device plugin's error is the adapter's rejection.

Speed: free GPUs are kept per node and nodes in buckets by free count per node group, partly used GPUs in
one sorted list per group, MIG GPUs in buckets by slices used, all updated on commit and release. ``find``
reads these summaries instead of every GPU, and ``releasing`` overlays the few GPUs those jobs hold.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from itertools import islice
from collections.abc import Collection
from dataclasses import dataclass

from broker import ids
from broker.models import GpuRequest, ModelCapacity, NodeGroup, SiteSpec, mig_slices

KIB_PER_GIB = 1 << 20
MILLI_PER_GPU = 1000
MIG_SLICES_PER_GPU = 7


class AllocationError(ValueError):
    """A placement that cannot be committed: it would over-allocate a GPU, or does not match this site."""


def _kib_up(gib: float) -> int:
    return math.ceil(gib * KIB_PER_GIB)


def _gib(kib: int) -> str:
    return f"{kib / KIB_PER_GIB:g}"


@dataclass(frozen=True, slots=True)
class MigProfile:
    """A MIG profile ``Ng.Mgb``: ``slices`` (N) of a GPU's 7 compute slices and M GiB of its memory."""

    name: str
    slices: int
    memory_kib: int

    @classmethod
    def parse(cls, name: str) -> MigProfile:
        return cls(name, mig_slices(name), int(name.split(".")[1][:-2]) * KIB_PER_GIB)


@dataclass(frozen=True, slots=True)
class Slot:
    """What a job takes of one GPU: ``device`` (its number on ``node``), ``milli`` thousandths of its compute
    (1000: the whole GPU; 0 for a MIG slice, whose compute is its profile's slices) and ``memory_kib``."""

    node: str
    device: int
    milli: int
    memory_kib: int
    mig_profile: str | None = None

    @property
    def memory_gib(self) -> float:
        return self.memory_kib / KIB_PER_GIB


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a job's GPUs are: one slot per whole GPU, per MIG slice, or one for a share of a GPU.
    ``gpus`` is the quota charge in GPUs (fractions count as their share)."""

    model: str
    slots: tuple[Slot, ...]
    gpus: float

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes used, each once, in slot order."""
        return tuple(dict.fromkeys(s.node for s in self.slots))


@dataclass(frozen=True, slots=True)
class ModelFree:
    """What a capacity snapshot needs of one model. ``free_gpus``: GPUs with nothing on them that serve
    whole-GPU jobs (MIG GPUs never do); ``used_gpus``: GPUs with anything on them, MIG included;
    ``shared_free_milli``: the most a fractional job could still take of a GPU already shared (the smaller of
    its free compute and free memory, in thousandths); ``mig_free_slices``: per profile, the slices that
    could still be made if only that profile were asked for."""

    model: str
    total_gpus: int
    free_gpus: int
    used_gpus: int
    shared_free_milli: int
    memory_gib_per_gpu: float
    mig_free_slices: dict[str, int]

    def capacity(self) -> ModelCapacity:
        return ModelCapacity(model=self.model, total_gpus=self.total_gpus, free_gpus=self.free_gpus,
                             used_gpus=self.used_gpus, shared_free_milli=self.shared_free_milli,
                             memory_gib_per_gpu=self.memory_gib_per_gpu, mig_free_slices=self.mig_free_slices)


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One GPU and what is on it (``mig_slices``: compute slices held by MIG slices)."""

    node: str
    device: int
    model: str
    memory_kib: int
    mig: bool
    milli: int
    used_kib: int
    mig_slices: int


@dataclass(frozen=True, slots=True)
class ModelUse:
    """The GPUs of one model and what they hold in all: ``busy`` in GPUs (a shared GPU counts its compute
    share, a MIG GPU its slices held over seven), ``used_kib`` of ``memory_kib``."""

    model: str
    gpus: int
    memory_kib: int
    used_kib: int
    busy: float


class _Group:
    """One node group: its nodes ``first_node..end_node-1`` and GPUs ``first_gpu..end_gpu-1``, and the
    summaries kept up to date: free GPUs in all, nodes by free GPUs (``buckets[k]``), partly used GPUs as
    sorted ``(-fullness, gpu)`` keys (``shared``), MIG GPUs by compute slices used (``mig_buckets[s]``)."""

    __slots__ = ("index", "model", "per_node", "memory_gib", "mem_kib", "domain", "profiles", "first_node",
                 "end_node", "first_gpu", "end_gpu", "free", "buckets", "shared", "mig_buckets", "milli", "slices",
                 "used_kib")

    def __init__(self, index: int, spec_group: NodeGroup, first_node: int, first_gpu: int) -> None:
        self.index, self.model, self.per_node = index, spec_group.model, spec_group.gpus_per_node
        self.memory_gib: float = spec_group.gpu_memory_gib
        self.mem_kib = math.floor(self.memory_gib * KIB_PER_GIB)
        self.domain: str | None = spec_group.nvlink_domain
        self.profiles = {p: MigProfile.parse(p) for p in spec_group.mig_profiles}  # NodeGroup checked they fit
        self.first_node, self.end_node = first_node, first_node + spec_group.nodes
        self.first_gpu, self.end_gpu = first_gpu, first_gpu + spec_group.gpus
        nodes = set(range(self.first_node, self.end_node))
        self.free = 0 if self.profiles else spec_group.gpus
        self.buckets: list[set[int]] = [set() for _ in range(self.per_node + 1)]
        if not self.profiles:
            self.buckets[self.per_node] = nodes
        self.shared: list[tuple[int, int]] = []
        self.mig_buckets: list[set[int]] = [set() for _ in range(MIG_SLICES_PER_GPU + 1)]
        if self.profiles:
            self.mig_buckets[0] = set(range(self.first_gpu, self.end_gpu))
        self.milli = self.slices = self.used_kib = 0  # held over all its GPUs: compute, MIG slices, memory


class _View:
    """The inventory as if the jobs in ``releasing`` were gone: what they hold per GPU, and per node and
    group how many more GPUs would be free. Costs the size of those jobs' placements, not of the site."""

    __slots__ = ("milli", "kib", "slices", "gpus", "nodes", "groups")

    def __init__(self, inv: Inventory, releasing: Collection[str]) -> None:
        self.milli: dict[int, int] = {}
        self.kib: dict[int, int] = {}
        self.slices: dict[int, int] = {}
        self.nodes: dict[int, int] = {}
        self.groups: dict[int, int] = {}
        for job in set(releasing):
            held = inv._jobs.get(job)
            for gpu, milli, kib, slices in held[1] if held else ():
                self.milli[gpu] = self.milli.get(gpu, 0) + milli
                self.kib[gpu] = self.kib.get(gpu, 0) + kib
                self.slices[gpu] = self.slices.get(gpu, 0) + slices
        self.gpus = set(self.milli)
        for gpu, milli in self.milli.items():
            if milli and inv._milli[gpu] == milli:  # nothing else on it: a free GPU once released
                node = inv._gpu_node[gpu]
                self.nodes[node] = self.nodes.get(node, 0) + 1
                g = inv._node_group[node].index
                self.groups[g] = self.groups.get(g, 0) + 1


class Inventory:
    """GPUs of one site and the jobs holding them. Build with :meth:`from_spec`."""

    def __init__(self, spec: SiteSpec) -> None:
        self._groups: list[_Group] = []
        self._node_names: list[str] = []
        self._node_group: list[_Group] = []
        self._node_first_gpu: list[int] = []
        self._gpu_node: list[int] = []
        node = gpu = 0
        for i, sg in enumerate(spec.gpus):
            g = _Group(i, sg, node, gpu)
            self._groups.append(g)
            for n in range(sg.nodes):
                self._node_names.append(f"{i}-{n}")
                self._node_group.append(g)
                self._node_first_gpu.append(gpu)
                self._gpu_node.extend([node] * sg.gpus_per_node)
                node, gpu = node + 1, gpu + sg.gpus_per_node
        self._node_index = {name: n for n, name in enumerate(self._node_names)}
        self._node_free = [0 if g.profiles else g.per_node for g in self._node_group]
        self._milli = [0] * gpu
        self._kib = [0] * gpu
        self._slices = [0] * gpu
        self._jobs: dict[str, tuple[Placement, tuple[tuple[int, int, int, int], ...]]] = {}
        self._by_model: dict[str, list[_Group]] = {}
        for g in self._groups:
            self._by_model.setdefault(g.model, []).append(g)
        self._memory_gib = {m: max(g.memory_gib for g in gs) for m, gs in self._by_model.items()}
        self._model_order = sorted(self._by_model, key=lambda m: (self._memory_gib[m], m))

    @classmethod
    def from_spec(cls, spec: SiteSpec) -> Inventory:
        return cls(spec)

    # --- queries --------------------------------------------------------------------------------------

    def find(self, req: GpuRequest, model: str | None = None, *,
             releasing: Collection[str] = ()) -> Placement | str:
        """Where ``req`` fits now, on ``model`` (else the request's model, else the first model that fits,
        least memory per GPU first), as if the jobs in ``releasing`` were gone; or why it does not fit.
        Changes nothing. Job ids in ``releasing`` that hold nothing here are ignored."""
        view = _View(self, releasing)
        chosen = model or req.model
        reasons = []
        for m in [chosen] if chosen else self._model_order:
            if m not in self._by_model:
                reasons.append(f"no {m} at this site")
                continue
            if req.mig_profile is not None:
                found = self._find_mig(req, m, view)
            elif req.fractional:
                found = self._find_fraction(req, m, view)
            else:
                found = self._find_whole(req, m, view)
            if isinstance(found, Placement):
                return found
            reasons.append(found)
        return "; ".join(reasons)

    def charge(self, req: GpuRequest, model: str) -> float:
        """The quota charge, in GPUs, of ``req`` on ``model`` wherever it goes here. For a fractional job on a
        model whose node groups differ in memory, the largest (so a quota check never admits more than the
        ledger later counts)."""
        if req.mig_profile is not None:
            return req.count * MigProfile.parse(req.mig_profile).slices / MIG_SLICES_PER_GPU
        if not req.fractional:
            return float(req.count)
        mems = [g.mem_kib for g in self._by_model.get(model, ()) if not g.profiles]
        mems = mems or [ids.GPU_MODEL_BY_ID[model].memory_gib * KIB_PER_GIB]
        return max(_fraction_charge(*_share(req, k), k) for k in mems)

    def capacity(self) -> dict[str, int]:
        """GPUs per model, MIG GPUs included."""
        return {m: sum(g.end_gpu - g.first_gpu for g in gs) for m, gs in self._by_model.items()}

    def free(self) -> dict[str, ModelFree]:
        """Per model, what a capacity snapshot reports (see :class:`ModelFree`). Scans partly used and MIG
        GPUs only; for snapshots, not for every admission."""
        out = {}
        for model, groups in self._by_model.items():
            total = free = used = shared = 0
            mig: dict[str, int] = {}
            for g in groups:
                total += g.end_gpu - g.first_gpu
                if not g.profiles:
                    free += g.free
                    used += g.end_gpu - g.first_gpu - g.free
                    for _, gpu in g.shared:
                        room = min(MILLI_PER_GPU - self._milli[gpu],
                                   (g.mem_kib - self._kib[gpu]) * MILLI_PER_GPU // g.mem_kib)
                        shared = max(shared, room)
                    continue
                used += g.end_gpu - g.first_gpu - len(g.mig_buckets[0])
                for p in g.profiles.values():
                    n = len(g.mig_buckets[0]) * min(MIG_SLICES_PER_GPU // p.slices, g.mem_kib // p.memory_kib)
                    for s in range(1, MIG_SLICES_PER_GPU - p.slices + 1):
                        for gpu in g.mig_buckets[s]:
                            n += min((MIG_SLICES_PER_GPU - s) // p.slices,
                                     (g.mem_kib - self._kib[gpu]) // p.memory_kib)
                    mig[p.name] = mig.get(p.name, 0) + n
            out[model] = ModelFree(model, total, free, used, shared, self._memory_gib[model], mig)
        return out

    def usage(self) -> dict[str, ModelUse]:
        """Per model, what its GPUs hold in all (for telemetry): O(node groups), kept up to date at each
        change, so a snapshot of a site with a million GPUs costs no more than one with eight."""
        out: dict[str, ModelUse] = {}
        for model, groups in self._by_model.items():
            gpus = sum(g.end_gpu - g.first_gpu for g in groups)
            busy = sum(g.milli / MILLI_PER_GPU + g.slices / MIG_SLICES_PER_GPU for g in groups)
            out[model] = ModelUse(model, gpus, sum(g.mem_kib * (g.end_gpu - g.first_gpu) for g in groups),
                                  sum(g.used_kib for g in groups), busy)
        return out

    def gpus(self) -> list[GpuUse]:
        """Every GPU and what is on it, in node order (for telemetry and tests; scans every GPU)."""
        return [GpuUse(self._node_names[n], gpu - self._node_first_gpu[n], self._node_group[n].model,
                       self._node_group[n].mem_kib, bool(self._node_group[n].profiles), self._milli[gpu],
                       self._kib[gpu], self._slices[gpu])
                for gpu, n in enumerate(self._gpu_node)]

    # --- changes --------------------------------------------------------------------------------------

    def commit(self, job_id: str, placement: Placement) -> None:
        """Give ``placement``'s GPUs to ``job_id``; raise :class:`AllocationError`, changing nothing, if a slot
        names no GPU of this site, does not match its GPU, or would over-allocate it."""
        if job_id in self._jobs:
            raise AllocationError(f"job {job_id} already holds GPUs here; release it first")
        takes = [self._take(slot, placement.model) for slot in placement.slots]
        per_gpu: dict[int, list[int]] = {}
        for gpu, milli, kib, slices in takes:
            t = per_gpu.setdefault(gpu, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + milli, t[1] + kib, t[2] + slices
        for gpu, (milli, kib, slices) in per_gpu.items():
            mem = self._node_group[self._gpu_node[gpu]].mem_kib
            if slices and (self._slices[gpu] + slices > MIG_SLICES_PER_GPU or self._kib[gpu] + kib > mem):
                free, need = f"{MIG_SLICES_PER_GPU - self._slices[gpu]} MIG compute slices", f"{slices}"
            elif not slices and (self._milli[gpu] + milli > MILLI_PER_GPU or self._kib[gpu] + kib > mem):
                free, need = f"{MILLI_PER_GPU - self._milli[gpu]}/1000 compute", f"{milli}/1000"
            else:
                continue
            raise AllocationError(
                f"job {job_id}: GPU {self._gpu_name(gpu)} has {free} and {_gib(mem - self._kib[gpu])} GiB free; the "
                f"placement needs {need} and {_gib(kib)} GiB there; find a placement again")
        for gpu, (milli, kib, slices) in per_gpu.items():
            self._change(gpu, milli, kib, slices)
        self._jobs[job_id] = (placement, tuple(takes))

    def release(self, job_id: str) -> Placement | None:
        """Free what ``job_id`` holds and return its placement (None: it holds nothing here)."""
        held = self._jobs.pop(job_id, None)
        if held is None:
            return None
        for gpu, milli, kib, slices in held[1]:
            self._change(gpu, -milli, -kib, -slices)
        return held[0]

    # --- whole GPUs -----------------------------------------------------------------------------------

    def _find_whole(self, req: GpuRequest, model: str, view: _View) -> Placement | str:
        groups = [g for g in self._by_model[model] if not g.profiles]
        if not groups:
            return self._all_mig(model)
        if req.memory_gib is not None:
            groups = [g for g in groups if g.mem_kib >= _kib_up(req.memory_gib)]
            if not groups:
                return (f"{model} here has {self._memory_gib[model]:g} GiB per GPU; the job needs "
                        f"{req.memory_gib:g} GiB each")
        count = req.count
        if req.topology == "node":
            found = self._on_one_node(groups, count, view)
        elif req.topology == "nvlink":
            found = self._in_one_domain(groups, count, view)
        else:
            found = self._fill(groups, count, view)
            if found is None:
                free = sum(self._group_free(g, view) for g in groups)
                found = f"{count} {model} needed; {free} free"
        if isinstance(found, str):
            return found
        slots = tuple(self._slot(gpu, MILLI_PER_GPU, self._node_group[self._gpu_node[gpu]].mem_kib)
                      for gpu in found)
        return Placement(model, slots, float(count))

    def _on_one_node(self, groups: list[_Group], count: int, view: _View) -> list[int] | str:
        model, top = groups[0].model, max(g.per_node for g in groups)
        if count > top:
            return f"{count} {model} on one node needed; nodes here have at most {top}"
        for k in range(count, top + 1):
            nodes = self._nodes_with_free(groups, k, view, 1)
            if nodes:
                return self._free_on(nodes[0], count, view)
        k, node = self._largest_block(groups, view)
        where = f"{k} on node {self._node_names[node]}" if k else "0: every node is in use"
        return f"{count} {model} on one node needed; the largest free block is {where}"

    def _in_one_domain(self, groups: list[_Group], count: int, view: _View) -> list[int] | str:
        model = groups[0].model
        domains: dict[str, list[_Group]] = {}
        for g in groups:
            if g.domain is not None:
                domains.setdefault(g.domain, []).append(g)
        loose = [g for g in groups if g.domain is None]  # each node is its own domain
        best: tuple[int, int, str | None] | None = None  # (free, first node, domain; None: that node)
        largest: tuple[int, int, str | None] = (0, -1, None)
        for name, members in domains.items():
            free = sum(self._group_free(g, view) for g in members)
            key = (free, members[0].first_node, name)
            if free >= count and (best is None or key[:2] < best[:2]):
                best = key
            if free > largest[0]:
                largest = key
        if loose:
            for k in range(count, max(g.per_node for g in loose) + 1):
                nodes = self._nodes_with_free(loose, k, view, 1)
                if nodes:
                    if best is None or (k, nodes[0]) < best[:2]:
                        best = (k, nodes[0], None)
                    break
            k, node = self._largest_block(loose, view)
            if k > largest[0]:
                largest = (k, node, None)
        if best is not None:
            if best[2] is None:
                return self._free_on(best[1], count, view)
            return self._fill(domains[best[2]], count, view) or []  # it has count free: never None
        free, node, name = largest
        where = (f"NVLink domain {name} with {free}" if name is not None
                 else f"node {self._node_names[node]} with {free} (its node group has no nvlink_domain, so "
                      f"each node is its own domain)" if free else "none: every GPU is in use")
        return f"{count} {model} in one NVLink domain needed; the largest free domain is {where}"

    def _fill(self, groups: list[_Group], count: int, view: _View) -> list[int] | None:
        """``count`` free GPUs from the fullest nodes of ``groups`` first; None: fewer are free."""
        if sum(self._group_free(g, view) for g in groups) < count:
            return None
        out: list[int] = []
        for k in range(1, max(g.per_node for g in groups) + 1):
            for node in self._nodes_with_free(groups, k, view, -(-(count - len(out)) // k)):
                out += self._free_on(node, min(k, count - len(out)), view)
            if len(out) == count:
                break
        return out

    def _largest_block(self, groups: list[_Group], view: _View) -> tuple[int, int]:
        for k in range(max(g.per_node for g in groups), 0, -1):
            nodes = self._nodes_with_free(groups, k, view, 1)
            if nodes:
                return k, nodes[0]
        return 0, -1

    def _nodes_with_free(self, groups: list[_Group], k: int, view: _View, limit: int) -> list[int]:
        """Up to ``limit`` nodes of ``groups`` (in node order) with exactly ``k`` free GPUs in ``view``,
        lowest first."""
        out: list[int] = []
        for g in groups:
            if k > g.per_node:
                continue
            bucket, want = g.buckets[k], limit - len(out)
            moved = [n for n in view.nodes if g.first_node <= n < g.end_node] if view.nodes else ()
            if moved:
                picks = [n for n in heapq.nsmallest(want + len(moved), bucket) if n not in view.nodes]
                picks += [n for n in moved if self._node_free[n] + view.nodes[n] == k]
                picks.sort()
            else:
                picks = heapq.nsmallest(want, bucket)
            out += picks[:want]
            if len(out) == limit:
                break
        return out

    def _free_on(self, node: int, count: int, view: _View) -> list[int]:
        first = self._node_first_gpu[node]
        out = []
        for gpu in range(first, first + self._node_group[node].per_node):
            if self._milli[gpu] == view.milli.get(gpu, 0):
                out.append(gpu)
                if len(out) == count:
                    break
        return out

    def _group_free(self, g: _Group, view: _View) -> int:
        return g.free + view.groups.get(g.index, 0)

    # --- a share of one GPU ---------------------------------------------------------------------------

    def _find_fraction(self, req: GpuRequest, model: str, view: _View) -> Placement | str:
        groups = [g for g in self._by_model[model] if not g.profiles]
        if not groups:
            return self._all_mig(model)
        fitting = [g for g in groups if _share(req, g.mem_kib)[1] <= g.mem_kib]
        if not fitting:
            return (f"{model} here has {self._memory_gib[model]:g} GiB per GPU; the job takes "
                    f"{req.memory_gib:g} GiB of one")
        best: tuple[int, int] | None = None  # (-fullness, gpu): the fullest partly used GPU that fits
        for g in fitting:
            milli, kib = _share(req, g.mem_kib)
            # A GPU fuller than this has too little compute or memory left: skip those without a look.
            bound = max(MILLI_PER_GPU - milli, (g.mem_kib - kib) * MILLI_PER_GPU // g.mem_kib)
            for key in islice(g.shared, bisect_left(g.shared, (-bound, -1)), None):
                if best is not None and key >= best:
                    break
                gpu = key[1]
                if (gpu not in view.gpus and self._milli[gpu] + milli <= MILLI_PER_GPU
                        and self._kib[gpu] + kib <= g.mem_kib):
                    best = key
                    break
            for gpu, m, k in self._shared_in_view(g, view):
                if m + milli <= MILLI_PER_GPU and k + kib <= g.mem_kib:
                    key = (-_fullness(m, k, g.mem_kib), gpu)
                    if best is None or key < best:
                        best = key
        gpu = best[1] if best is not None else None
        if gpu is None:
            for k in range(1, max(g.per_node for g in fitting) + 1):
                nodes = self._nodes_with_free(fitting, k, view, 1)
                if nodes:
                    gpu = self._free_on(nodes[0], 1, view)[0]
                    break
        if gpu is None:
            return self._no_share(req, model, fitting, view)
        mem = self._node_group[self._gpu_node[gpu]].mem_kib
        milli, kib = _share(req, mem)
        return Placement(model, (self._slot(gpu, milli, kib),), _fraction_charge(milli, kib, mem))

    def _shared_in_view(self, g: _Group, view: _View) -> list[tuple[int, int, int]]:
        """(gpu, milli, KiB) of the GPUs of ``g`` that jobs in ``releasing`` hold and that stay partly used."""
        out = []
        for gpu in view.gpus:
            if g.first_gpu <= gpu < g.end_gpu:
                m, k = self._milli[gpu] - view.milli[gpu], self._kib[gpu] - view.kib[gpu]
                if 0 < m < MILLI_PER_GPU:
                    out.append((gpu, m, k))
        return out

    def _no_share(self, req: GpuRequest, model: str, groups: list[_Group], view: _View) -> str:
        """Why a share does not fit, naming the least used shared GPU (found without scanning them all)."""
        milli, kib = _share(req, groups[0].mem_kib)
        least: tuple[int, int] | None = None  # the largest (-fullness, gpu) key
        for g in groups:
            for key in reversed(g.shared):
                if key[1] not in view.gpus:
                    least = key if least is None else max(least, key)
                    break
            for gpu, m, k in self._shared_in_view(g, view):
                key = (-_fullness(m, k, g.mem_kib), gpu)
                least = key if least is None else max(least, key)
        head = f"no {model} has {milli}/1000 and {_gib(kib)} GiB free: none is empty"
        if least is None:
            return head + " or shared"
        gpu = least[1]
        mem = self._node_group[self._gpu_node[gpu]].mem_kib
        m, k = self._milli[gpu] - view.milli.get(gpu, 0), self._kib[gpu] - view.kib.get(gpu, 0)
        return (f"{head} and the least used shared one, {self._gpu_name(gpu)}, has {MILLI_PER_GPU - m}/1000 and "
                f"{_gib(mem - k)} GiB free")

    # --- MIG slices -----------------------------------------------------------------------------------

    def _find_mig(self, req: GpuRequest, model: str, view: _View) -> Placement | str:
        p = MigProfile.parse(req.mig_profile or "")
        groups = [g for g in self._by_model[model] if p.name in g.profiles]
        if not groups:
            offered = sorted({q for g in self._by_model[model] for q in g.profiles})
            return (f"no {model} here offers MIG profile {p.name} "
                    + (f"(offered: {', '.join(offered)})" if offered else "(its GPUs are not MIG-partitioned)"))
        remaining, taken = req.count, []
        for s in range(MIG_SLICES_PER_GPU - p.slices, -1, -1):
            for gpu in self._mig_with(groups, s, view, remaining if s == 0 else None):
                mem = self._node_group[self._gpu_node[gpu]].mem_kib
                n = min((MIG_SLICES_PER_GPU - s) // p.slices,
                        (mem - self._kib[gpu] + view.kib.get(gpu, 0)) // p.memory_kib, remaining)
                if n > 0:
                    taken += [gpu] * n
                    remaining -= n
                    if not remaining:
                        break
            if not remaining:
                break
        if remaining:
            return f"{req.count} MIG slices {p.name} of {model} needed; {req.count - remaining} fit"
        slots = tuple(self._slot(gpu, 0, p.memory_kib, p.name) for gpu in taken)
        return Placement(model, slots, req.count * p.slices / MIG_SLICES_PER_GPU)

    def _mig_with(self, groups: list[_Group], s: int, view: _View, limit: int | None) -> list[int]:
        """MIG GPUs of ``groups`` with ``s`` slices used in ``view``, most memory used first, then by number;
        at most ``limit`` (for s = 0, where all use none)."""
        out: list[int] = []
        for g in groups:
            moved = [gpu for gpu in view.gpus if g.first_gpu <= gpu < g.end_gpu]
            bucket = g.mig_buckets[s]
            members = heapq.nsmallest(limit + len(moved), bucket) if limit is not None else list(bucket)
            out += [gpu for gpu in members if gpu not in view.gpus]
            out += [gpu for gpu in moved if self._slices[gpu] - view.slices[gpu] == s]
        out.sort(key=lambda gpu: (view.kib.get(gpu, 0) - self._kib[gpu], gpu))
        return out if limit is None else out[:limit]

    # --- bookkeeping ----------------------------------------------------------------------------------

    def _all_mig(self, model: str) -> str:
        offered = sorted({q for g in self._by_model[model] for q in g.profiles})
        return f"every {model} here is MIG-partitioned (profiles {', '.join(offered)}); ask for a mig_profile"

    def _slot(self, gpu: int, milli: int, kib: int, profile: str | None = None) -> Slot:
        node = self._gpu_node[gpu]
        return Slot(self._node_names[node], gpu - self._node_first_gpu[node], milli, kib, profile)

    def _gpu_name(self, gpu: int) -> str:
        node = self._gpu_node[gpu]
        return f"{self._node_names[node]}/{gpu - self._node_first_gpu[node]}"

    def _take(self, slot: Slot, model: str) -> tuple[int, int, int, int]:
        """A slot as (gpu, milli, KiB, MIG slices), checked against the GPU it names."""
        node = self._node_index.get(slot.node)
        if node is None:
            raise AllocationError(f"no node {slot.node!r} at this site")
        g = self._node_group[node]
        if not 0 <= slot.device < g.per_node:
            raise AllocationError(f"node {slot.node} has GPUs 0 to {g.per_node - 1}, not {slot.device}")
        if g.model != model:
            raise AllocationError(f"node {slot.node} has {g.model}, not {model}")
        gpu = self._node_first_gpu[node] + slot.device
        if slot.mig_profile is not None:
            p = g.profiles.get(slot.mig_profile)
            if p is None or slot.memory_kib != p.memory_kib or slot.milli:
                raise AllocationError(f"node {slot.node} offers no MIG slice {slot.mig_profile} as given")
            return gpu, 0, p.memory_kib, p.slices
        if g.profiles:
            raise AllocationError(f"node {slot.node}'s GPUs are MIG-partitioned; they take MIG slices only")
        if not 1 <= slot.milli <= MILLI_PER_GPU or slot.memory_kib < 0:
            raise AllocationError(f"a slot takes 1 to 1000 milli and some memory, not {slot.milli} milli and "
                                  f"{slot.memory_kib} KiB")
        return gpu, slot.milli, slot.memory_kib, 0

    def _change(self, gpu: int, milli: int, kib: int, slices: int) -> None:
        """Add (or with negative amounts, remove) use of one GPU and keep the summaries up to date."""
        node = self._gpu_node[gpu]
        g = self._node_group[node]
        g.milli, g.slices, g.used_kib = g.milli + milli, g.slices + slices, g.used_kib + kib
        if g.profiles:
            g.mig_buckets[self._slices[gpu]].discard(gpu)
            self._slices[gpu] += slices
            self._kib[gpu] += kib
            g.mig_buckets[self._slices[gpu]].add(gpu)
            return
        old = self._milli[gpu]
        if 0 < old < MILLI_PER_GPU:
            g.shared.pop(bisect_left(g.shared, (-_fullness(old, self._kib[gpu], g.mem_kib), gpu)))
        new = self._milli[gpu] = old + milli
        self._kib[gpu] += kib
        if 0 < new < MILLI_PER_GPU:
            insort(g.shared, (-_fullness(new, self._kib[gpu], g.mem_kib), gpu))
        if (old == 0) != (new == 0):
            free = self._node_free[node]
            g.buckets[free].discard(node)
            free = self._node_free[node] = free + (1 if new == 0 else -1)
            g.buckets[free].add(node)
            g.free += 1 if new == 0 else -1


def _share(req: GpuRequest, mem_kib: int) -> tuple[int, int]:
    """(milli, KiB) a fractional request takes of a GPU with ``mem_kib``; more than the GPU has if too big."""
    kib = _kib_up(req.memory_gib) if req.memory_gib is not None else req.milli * mem_kib // MILLI_PER_GPU
    milli = req.milli if req.milli < MILLI_PER_GPU else -(-MILLI_PER_GPU * kib // mem_kib)
    return milli, kib


def _fraction_charge(milli: int, kib: int, mem_kib: int) -> float:
    return max(milli * mem_kib, kib * MILLI_PER_GPU) / (MILLI_PER_GPU * mem_kib)


def _fullness(milli: int, kib: int, mem_kib: int) -> int:
    """How full a GPU is, in thousandths: the larger of its used compute and used memory."""
    return max(milli, kib * MILLI_PER_GPU // mem_kib)
