"""A site's GPU inventory: where a job's GPUs go (whole, shared, MIG), all or none, never over-allocated,
and why a job that does not fit does not."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker.models import GpuRequest, NodeGroup, SiteSpec
from policies.inventory import (
    KIB_PER_GIB,
    AllocationError,
    Inventory,
    MigProfile,
    Placement,
    Slot,
)
from tests.builders import site

GIB = KIB_PER_GIB
A100_80_MIG = ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]
A100_40_MIG = ["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]


# --- builders -----------------------------------------------------------------------------------------


def group(model: str = "h100-80gb", per_node: int = 8, nodes: int = 1, **more: Any) -> dict[str, Any]:
    return {"model": model, "gpus_per_node": per_node, "nodes": nodes, **more}


def inventory(*groups: dict[str, Any]) -> Inventory:
    return Inventory.from_spec(site("s", gpus=list(groups) or [group()]))


def req(count: int = 1, **more: Any) -> GpuRequest:
    return GpuRequest(count=count, **more)


def hold(inv: Inventory, job: str, node: str, gpus: int, model: str = "h100-80gb") -> None:
    """Give ``job`` the first ``gpus`` free GPUs of ``node`` (to set up a fragmented site)."""
    use = {(g.node, g.device) for g in inv.gpus() if g.milli}
    devices = [d for d in range(64) if (node, d) not in use][:gpus]
    slots = tuple(Slot(node, d, 1000, 80 * GIB) for d in devices)
    inv.commit(job, Placement(model, slots, float(gpus)))


def place(inv: Inventory, job: str, request: GpuRequest, model: str | None = None) -> Placement:
    found = inv.find(request, model)
    assert isinstance(found, Placement), found
    inv.commit(job, found)
    return found


def nodes_free(inv: Inventory) -> dict[str, int]:
    return dict(sorted(Counter(g.node for g in inv.gpus() if not g.mig and not g.milli).items()))


# --- whole GPUs and topology --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "request_", "node"),
    [
        ({"0-0": 5, "0-1": 2}, req(3, topology="node"), "0-0"),
        ({"0-0": 5, "0-1": 2}, req(6, topology="node"), "0-1"),
        ({"0-0": 5, "0-1": 2}, req(7, topology="node"), "0-2"),
        ({"0-0": 5, "0-1": 2}, req(8, topology="node"), "0-2"),
        ({}, req(8, topology="node"), "0-0"),
    ],
    ids=[
        "three GPUs on one node go to the fullest node that has three free",
        "six GPUs skip a node with three free and take the node with six",
        "seven GPUs on one node take the only node with seven free",
        "a full node's worth takes an untouched node",
        "on an empty site the first node is chosen",
    ],
)
def test_topology_node_takes_the_fullest_node_that_fits(held: dict[str, int], request_: GpuRequest,
                                                        node: str) -> None:
    inv = inventory(group(nodes=3))
    for i, (n, k) in enumerate(held.items()):
        hold(inv, f"held-{i}", n, k)
    found = inv.find(request_)
    assert isinstance(found, Placement), found
    assert found.nodes == (node,)
    assert len(found.slots) == request_.count


def test_topology_node_refuses_a_fragmented_site_and_names_the_largest_block() -> None:
    inv = inventory(group(nodes=3))
    hold(inv, "a", "0-0", 2)
    hold(inv, "b", "0-1", 3)
    hold(inv, "c", "0-2", 5)
    assert sum(nodes_free(inv).values()) == 14  # plenty free overall ...
    found = inv.find(req(8, topology="node"))
    assert found == "8 h100-80gb on one node needed; the largest free block is 6 on node 0-0"
    assert isinstance(inv.find(req(8)), Placement)  # ... so "any" fits


def test_topology_any_fills_the_fullest_nodes_first_and_keeps_whole_nodes_free() -> None:
    inv = inventory(group(nodes=3))
    hold(inv, "a", "0-1", 6)
    found = place(inv, "j", req(3))
    assert [s.node for s in found.slots] == ["0-1", "0-1", "0-0"]
    assert nodes_free(inv) == {"0-0": 7, "0-2": 8}


def test_a_gang_that_does_not_fit_takes_nothing() -> None:
    inv = inventory(group(nodes=2))
    hold(inv, "a", "0-0", 5)
    before = inv.gpus()
    assert inv.find(req(12)) == "12 h100-80gb needed; 11 free"
    assert inv.gpus() == before


@pytest.mark.parametrize(
    ("held", "request_", "nodes"),
    [
        ({"0-0": 2}, req(6, topology="nvlink"), {"0-0", "0-1"}),
        ({"1-0": 3, "2-0": 1}, req(4, topology="nvlink"), {"1-0", "1-1"}),
        ({"0-0": 4, "0-1": 4, "1-0": 4}, req(4, topology="nvlink"), {"1-1"}),
        ({}, req(3, topology="nvlink"), {"2-0"}),
    ],
    ids=[
        "six GPUs go to the fuller NVLink domain that has six free, across its nodes",
        "four GPUs go to the domain with five free rather than the one with eight, fullest node first",
        "between a domain and a lone node with as many free, the lower node number wins",
        "three GPUs fit best on a lone 4-GPU node of a group without nvlink_domain",
    ],
)
def test_topology_nvlink_takes_the_fullest_domain_that_fits(held: dict[str, int], request_: GpuRequest,
                                                            nodes: set[str]) -> None:
    inv = inventory(group(per_node=4, nodes=2, nvlink_domain="nvl-a"),
                    group(per_node=4, nodes=2, nvlink_domain="nvl-b"),
                    group(per_node=4, nodes=1))
    for i, (n, k) in enumerate(held.items()):
        hold(inv, f"held-{i}", n, k)
    found = inv.find(request_)
    assert isinstance(found, Placement), found
    assert set(found.nodes) == nodes


def test_topology_nvlink_refuses_when_no_domain_has_enough_free() -> None:
    inv = inventory(group(per_node=4, nodes=2, nvlink_domain="nvl-a"),
                    group(per_node=4, nodes=2, nvlink_domain="nvl-b"))
    hold(inv, "a", "0-0", 3)
    hold(inv, "b", "1-1", 2)
    assert inv.find(req(7, topology="nvlink")) == (
        "7 h100-80gb in one NVLink domain needed; the largest free domain is NVLink domain nvl-b with 6")
    lone = inventory(group(per_node=4, nodes=3))
    hold(lone, "a", "0-0", 1)
    assert lone.find(req(5, topology="nvlink")) == (
        "5 h100-80gb in one NVLink domain needed; the largest free domain is node 0-1 with 4 (its node group "
        "has no nvlink_domain, so each node is its own domain)")


@pytest.mark.parametrize(
    ("memory_gib", "expected"),
    [
        (None, "a100-40gb"),
        (40, "a100-40gb"),
        (60, "a100-80gb"),
        (100, "a100-40gb here has 40 GiB per GPU; the job needs 100 GiB each; "
              "a100-80gb here has 80 GiB per GPU; the job needs 100 GiB each"),
    ],
    ids=[
        "without a memory minimum the smaller GPU is used first",
        "a minimum the smaller GPU meets exactly is enough",
        "a minimum above the smaller GPU's memory goes to the larger one",
        "a minimum no GPU meets is refused, naming each model's memory",
    ],
)
def test_memory_minimum_for_whole_gpus(memory_gib: float | None, expected: str) -> None:
    inv = inventory(group("a100-80gb", nodes=1), group("a100-40gb", nodes=1))
    found = inv.find(req(2, memory_gib=memory_gib))
    assert (found.model if isinstance(found, Placement) else found) == expected


def test_models_are_tried_from_least_memory_and_each_reason_is_given() -> None:
    inv = inventory(group("h100-80gb", nodes=1), group("l4", per_node=4), group("a100-40gb", per_node=4))
    assert place(inv, "j1", req(4)).model == "l4"
    assert place(inv, "j2", req(4)).model == "a100-40gb"
    assert place(inv, "j3", req(4)).model == "h100-80gb"
    assert inv.find(req(5)) == "5 l4 needed; 0 free; 5 a100-40gb needed; 0 free; 5 h100-80gb needed; 4 free"
    assert inv.find(req(1), "b200-180gb") == "no b200-180gb at this site"
    assert place(inv, "j4", req(1), model="h100-80gb").model == "h100-80gb"  # the broker's choice wins


# --- a share of one GPU -------------------------------------------------------------------------------


def test_two_40_gib_shared_jobs_fill_one_80_gib_gpu_and_a_third_goes_elsewhere() -> None:
    inv = inventory(group(per_node=2))
    shared = req(shared=True, memory_gib=40)
    a, b, c = (place(inv, j, shared) for j in ("a", "b", "c"))
    assert a.slots[0].device == b.slots[0].device != c.slots[0].device
    assert a.slots[0].milli == 500 and a.gpus == 0.5
    assert inv.find(req(shared=True, memory_gib=50)) == (
        "no h100-80gb has 625/1000 and 50 GiB free: none is empty and the least used shared one, 0-0/1, has "
        "500/1000 and 40 GiB free")


@pytest.mark.parametrize(
    ("jobs", "devices"),
    [
        ([req(milli=600), req(milli=300), req(milli=500), req(milli=100)], [0, 0, 1, 0]),
        ([req(milli=200, memory_gib=60), req(milli=200, memory_gib=30), req(milli=100, memory_gib=20)], [0, 1, 0]),
        ([req(milli=500), req(milli=400), req(milli=100)], [0, 0, 0]),
    ],
    ids=[
        "compute shares pack onto the fullest GPU they fit on",
        "memory decides: 30 GiB does not fit beside 60 GiB on an 80 GiB GPU, 20 GiB does",
        "a GPU is shared up to exactly 1000 milli",
    ],
)
def test_fractional_jobs_pack_best_fit(jobs: list[GpuRequest], devices: list[int]) -> None:
    inv = inventory(group(per_node=4))
    got = [place(inv, f"j{i}", r).slots[0].device for i, r in enumerate(jobs)]
    assert got == devices


def test_a_fractional_job_takes_an_empty_gpu_on_the_fullest_node() -> None:
    inv = inventory(group(nodes=2))
    hold(inv, "a", "0-1", 7)
    found = place(inv, "f", req(milli=250))
    assert (found.slots[0].node, found.slots[0].device) == ("0-1", 7)
    assert isinstance(inv.find(req(8, topology="node")), Placement)  # node 0-0 stays whole


def test_a_share_charges_the_larger_of_compute_and_memory() -> None:
    inv = inventory(group(per_node=1))
    assert inv.find(req(milli=100, memory_gib=40)).gpus == pytest.approx(0.5)  # type: ignore[union-attr]
    assert inv.charge(req(milli=100, memory_gib=40), "h100-80gb") == pytest.approx(0.5)
    assert inv.charge(req(milli=300), "h100-80gb") == pytest.approx(0.3)
    assert inv.find(req(shared=True, memory_gib=100)) == (
        "h100-80gb here has 80 GiB per GPU; the job takes 100 GiB of one")


# --- MIG ----------------------------------------------------------------------------------------------


def test_a_mig_gpu_holds_any_mix_up_to_seven_slices_and_its_memory() -> None:
    inv = inventory(group("a100-80gb", per_node=2, mig_profiles=A100_80_MIG))
    for j, profile in enumerate(["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]):
        found = place(inv, f"j{j}", req(mig_profile=profile))
        assert found.slots[0].device == 0, profile  # the fullest GPU with room
    assert place(inv, "j4", req(mig_profile="1g.10gb")).slots[0].device == 1
    assert inv.find(req(mig_profile="7g.80gb")) == "1 MIG slices 7g.80gb of a100-80gb needed; 0 fit"
    assert inv.free()["a100-80gb"].mig_free_slices == {"1g.10gb": 6, "2g.20gb": 3, "3g.40gb": 1, "7g.80gb": 0}


def test_mig_slices_are_all_or_none_and_charge_their_share() -> None:
    inv = inventory(group("a100-80gb", per_node=2, mig_profiles=A100_80_MIG))
    found = place(inv, "a", req(4, mig_profile="2g.20gb"))
    assert [s.device for s in found.slots] == [0, 0, 0, 1]
    assert found.gpus == pytest.approx(8 / 7)
    assert inv.find(req(3, mig_profile="2g.20gb")) == "3 MIG slices 2g.20gb of a100-80gb needed; 2 fit"
    with pytest.raises(AllocationError, match="GPU 0-0/0 has 1 MIG compute slices and 20 GiB free"):
        inv.commit("b", found)


def test_mig_gpus_serve_only_mig_slices() -> None:
    inv = inventory(group("a100-80gb", per_node=2, mig_profiles=["1g.10gb", "7g.80gb"]), group("l4", per_node=1))
    assert inv.find(req(1), "a100-80gb") == (
        "every a100-80gb here is MIG-partitioned (profiles 1g.10gb, 7g.80gb); ask for a mig_profile")
    assert str(inv.find(req(milli=100), "a100-80gb")).startswith("every a100-80gb here is MIG-partitioned")
    assert inv.find(req(mig_profile="3g.40gb")) == (
        "no l4 here offers MIG profile 3g.40gb (its GPUs are not MIG-partitioned); "
        "no a100-80gb here offers MIG profile 3g.40gb (offered: 1g.10gb, 7g.80gb)")
    assert place(inv, "w", req(1)).model == "l4"
    with pytest.raises(AllocationError, match="MIG-partitioned"):
        inv.commit("x", Placement("a100-80gb", (Slot("0-0", 0, 1000, 80 * GIB),), 1.0))


def test_a_mig_profile_larger_than_the_gpu_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="7g.80gb needs 80 GiB, more than a a100-40gb GPU here has"):
        inventory(group("a100-40gb", per_node=1, mig_profiles=["7g.80gb"]))


# --- commit, release, what-if -------------------------------------------------------------------------


def test_commit_refuses_to_over_allocate_and_changes_nothing() -> None:
    inv = inventory(group(per_node=2))
    found = place(inv, "a", req(2))
    before = inv.gpus()
    with pytest.raises(AllocationError, match="has 0/1000 compute"):
        inv.commit("b", found)
    with pytest.raises(AllocationError, match="already holds GPUs"):
        inv.commit("a", found)
    with pytest.raises(AllocationError, match="no node '9-9'"):
        inv.commit("c", Placement("h100-80gb", (Slot("9-9", 0, 1000, 80 * GIB),), 1.0))
    assert inv.gpus() == before
    assert inv.release("a") == found
    assert inv.release("a") is None


def test_releasing_a_victim_shows_where_a_job_would_fit_without_changing_anything() -> None:
    inv = inventory(group(nodes=2))
    hold(inv, "small", "0-0", 2)
    hold(inv, "big", "0-1", 7)
    before = inv.gpus()
    assert isinstance(inv.find(req(8, topology="node")), str)
    found = inv.find(req(8, topology="node"), releasing=["big", "nobody"])
    assert isinstance(found, Placement) and found.nodes == ("0-1",)
    assert inv.gpus() == before


def _frac_on(node: str, device: int, milli: int) -> Placement:
    return Placement("h100-80gb", (Slot(node, device, milli, milli * 80 * GIB // 1000),), milli / 1000)


@pytest.mark.parametrize(
    ("groups", "setup", "request_", "victims", "expected"),
    [
        ([group(per_node=4, nodes=3)], [("v", req(2)), ("o", req(2, topology="node"))],
         req(2, topology="node"), ["v"], [("0-0", 0), ("0-0", 1)]),
        ([group(per_node=4, nodes=3)], [("v", req(2)), ("x", _frac_on("0-1", 0, 10)), ("y", _frac_on("0-1", 1, 10))],
         req(2, topology="node"), ["v"], [("0-1", 2), ("0-1", 3)]),
        ([group(per_node=2)], [("v", req(milli=500)), ("o", req(milli=500)), ("w", req(1))],
         req(1), ["v"], "1 h100-80gb needed; 0 free"),
        ([group(per_node=2, nodes=2)], [("w", req(1)), ("f", _frac_on("0-1", 0, 300))],
         req(milli=500), ["f"], [("0-0", 1)]),
        ([group("a100-80gb", per_node=2, mig_profiles=A100_80_MIG)],
         [("v", req(2, mig_profile="3g.40gb")), ("o", req(mig_profile="1g.10gb"))],
         req(mig_profile="7g.80gb"), ["v"], [("0-0", 0)]),
    ],
    ids=[
        "the GPUs a victim frees are the best fit for a gang of their size",
        "a victim first in its bucket is skipped and the next node with that many free is found",
        "releasing one of two jobs sharing a GPU does not free the GPU",
        "a GPU the victim leaves empty counts as empty, not as shared",
        "releasing MIG slices makes room for a larger slice",
    ],
)
def test_find_as_if_released_agrees_with_releasing(
    groups: list[dict[str, Any]], setup: list[tuple[str, GpuRequest | Placement]], request_: GpuRequest,
    victims: list[str], expected: list[tuple[str, int]] | str,
) -> None:
    inv = inventory(*groups)
    for job, what in setup:
        inv.commit(job, what) if isinstance(what, Placement) else place(inv, job, what)
    before = inv.gpus()
    found = inv.find(request_, releasing=victims)
    assert inv.gpus() == before
    assert (found if isinstance(found, str) else [(s.node, s.device) for s in found.slots]) == expected
    for job in victims:
        inv.release(job)
    assert inv.find(request_) == found


def test_mig_best_fit_prefers_the_gpu_with_more_memory_used_at_equal_slices() -> None:
    inv = inventory(group("a100-40gb", per_node=2, mig_profiles=A100_40_MIG))
    slot = lambda device, profile, gib: Slot("0-0", device, 0, gib * GIB, profile)  # noqa: E731
    inv.commit("a", Placement("a100-40gb", (slot(0, "1g.5gb", 5), slot(0, "2g.10gb", 10)), 3 / 7))
    inv.commit("b", Placement("a100-40gb", (slot(1, "3g.20gb", 20),), 3 / 7))
    assert place(inv, "c", req(mig_profile="1g.5gb")).slots[0].device == 1


def test_commit_refuses_shares_that_add_up_to_more_than_a_gpu() -> None:
    inv = inventory(group(per_node=1))
    inv.commit("a", _frac_on("0-0", 0, 600))
    with pytest.raises(AllocationError, match="has 400/1000 compute"):
        inv.commit("b", Placement("h100-80gb", (Slot("0-0", 0, 401, GIB),), 0.401))
    with pytest.raises(AllocationError, match="32 GiB"):
        inv.commit("c", Placement("h100-80gb", (Slot("0-0", 0, 100, 33 * GIB),), 0.4))
    inv.commit("d", _frac_on("0-0", 0, 400))
    assert [(g.milli, g.used_kib) for g in inv.gpus()] == [(1000, 80 * GIB)]


def test_capacity_and_free_report_what_a_snapshot_needs() -> None:
    inv = inventory(group(per_node=4), group("a100-80gb", per_node=2, mig_profiles=A100_80_MIG))
    place(inv, "a", req(2))
    place(inv, "b", req(milli=300))
    place(inv, "c", req(mig_profile="3g.40gb"))
    assert inv.capacity() == {"h100-80gb": 4, "a100-80gb": 2}
    free = inv.free()
    h100 = free["h100-80gb"]
    assert (h100.total_gpus, h100.free_gpus, h100.used_gpus, h100.shared_free_milli) == (4, 1, 3, 700)
    assert h100.capacity().memory_gib_per_gpu == 80
    a100 = free["a100-80gb"]
    assert (a100.free_gpus, a100.used_gpus) == (0, 1)
    assert a100.mig_free_slices == {"1g.10gb": 11, "2g.20gb": 5, "3g.40gb": 3, "7g.80gb": 1}


# --- properties ---------------------------------------------------------------------------------------

MODELS = ["h100-80gb", "l4", "a100-80gb", "a100-40gb"]
MIG_BY_MODEL = {"a100-80gb": A100_80_MIG, "a100-40gb": A100_40_MIG}


@st.composite
def node_groups(draw: st.DrawFn) -> NodeGroup:
    model = draw(st.sampled_from(MODELS))
    mig = model in MIG_BY_MODEL and draw(st.integers(0, 2)) > 0
    return NodeGroup(
        model=model,
        gpus_per_node=draw(st.integers(1, 4)),
        nodes=draw(st.integers(1, 3)),
        nvlink_domain=draw(st.sampled_from([None, None, "nvl-a", "nvl-b"])),
        mig_profiles=draw(st.lists(st.sampled_from(MIG_BY_MODEL[model]), min_size=3, unique=True)) if mig else [],
    )


def specs() -> st.SearchStrategy[SiteSpec]:
    mig = node_groups().filter(lambda g: bool(g.mig_profiles))
    groups = st.tuples(st.lists(node_groups(), min_size=1, max_size=3), st.lists(mig, max_size=1))
    return groups.map(lambda gs: site("s", gpus=gs[0] + gs[1]))


def requests_for(spec: SiteSpec) -> st.SearchStrategy[GpuRequest]:
    """Requests of every kind, mostly for models and MIG profiles the site has, so that most can fit."""
    models = st.sampled_from([None, *sorted(spec.total_gpus()), "h100-80gb"])
    profiles = sorted({p for g in spec.gpus for p in g.mig_profiles}) or A100_80_MIG
    return st.one_of(
        st.builds(GpuRequest, count=st.integers(1, 6), model=models, memory_gib=st.sampled_from([None, 24, 40, 80]),
                  topology=st.sampled_from(["any", "node", "nvlink"])),
        st.builds(GpuRequest, milli=st.sampled_from([100, 250, 300, 500, 700, 999]) | st.integers(1, 999),
                  model=models, memory_gib=st.sampled_from([None, 0.5, 5, 12.25, 30, 40])),
        st.builds(GpuRequest, shared=st.just(True), model=models,
                  memory_gib=st.sampled_from([1, 8, 20, 33.3, 40, 70])),
        st.builds(GpuRequest, count=st.integers(1, 6), mig_profile=st.sampled_from(profiles),
                  model=st.sampled_from([None, "a100-80gb", "a100-40gb"])),
    )


def _domain(spec: SiteSpec, node: str) -> str:
    g = spec.gpus[int(node.split("-")[0])]
    return g.nvlink_domain or f"node {node}"


class InventoryMachine(RuleBasedStateMachine):
    """Random find/commit/release sequences against a random site, checked after every step."""

    @initialize(spec=specs())
    def start(self, spec: SiteSpec) -> None:
        self.spec = spec
        self.requests = requests_for(spec)
        self.inv = Inventory.from_spec(spec)
        self.fresh = Inventory.from_spec(spec)
        self.held: dict[str, Placement] = {}
        self.serial = 0

    def _new_id(self) -> str:
        self.serial += 1
        return f"j{self.serial}"

    @rule(data=st.data(), name_model=st.booleans())
    def find_and_commit(self, data: st.DataObject, name_model: bool) -> None:
        request = data.draw(self.requests)
        model = (request.model or "h100-80gb") if name_model else None
        before = self.inv.gpus()
        found = self.inv.find(request, model)
        assert self.inv.gpus() == before, "find changed the inventory"
        if isinstance(found, str):
            assert found
            self._assert_truly_full(request, model or request.model, before)
            return
        self._assert_shape(request, model or request.model, found)
        job = self._new_id()
        self.inv.commit(job, found)
        self.held[job] = found

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(sorted(self.held)))
        assert self.inv.release(job) == self.held.pop(job)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def find_as_if_released_agrees_with_releasing(self, data: st.DataObject) -> None:
        request = data.draw(self.requests)
        victims = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True))
        before = self.inv.gpus()
        what_if = self.inv.find(request, releasing=[*victims, "not-held"])
        assert self.inv.gpus() == before
        for job in victims:
            self.inv.release(job)
        assert self.inv.find(request) == what_if
        for job in victims:
            self.inv.commit(job, self.held[job])  # what was released can be taken back exactly
        assert self.inv.gpus() == before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def commit_again_never_over_allocates(self, data: st.DataObject) -> None:
        placement = self.held[data.draw(st.sampled_from(sorted(self.held)))]
        before = self.inv.gpus()
        job = self._new_id()
        try:
            self.inv.commit(job, placement)
        except AllocationError:
            assert self.inv.gpus() == before
        else:
            self.held[job] = placement  # a share or MIG slice that fits twice; the invariants check it

    @rule(data=st.data())
    def releasing_everything_gives_a_fresh_inventory(self, data: st.DataObject) -> None:
        probes = data.draw(st.lists(self.requests, max_size=4))
        for job in list(self.held):
            self.inv.release(job)
        self.held.clear()
        assert self.inv.gpus() == self.fresh.gpus()
        assert self.inv.free() == self.fresh.free()
        for probe in probes:
            assert self.inv.find(probe) == self.fresh.find(probe)

    @invariant()
    def never_over_allocated(self) -> None:
        if not hasattr(self, "inv"):
            return
        expected: dict[tuple[str, int], list[int]] = {}
        whole: Counter[tuple[str, int]] = Counter()
        slots_on: Counter[tuple[str, int]] = Counter()
        for p in self.held.values():
            for s in p.slots:
                e = expected.setdefault((s.node, s.device), [0, 0, 0])
                e[0] += s.milli
                e[1] += s.memory_kib
                e[2] += MigProfile.parse(s.mig_profile).slices if s.mig_profile else 0
                slots_on[(s.node, s.device)] += 1
                whole[(s.node, s.device)] += s.milli == 1000
        for g in self.inv.gpus():
            key = (g.node, g.device)
            assert 0 <= g.milli <= 1000 and 0 <= g.used_kib <= g.memory_kib and 0 <= g.mig_slices <= 7
            assert [g.milli, g.used_kib, g.mig_slices] == expected.get(key, [0, 0, 0]), key
            assert not g.mig or g.milli == 0
            assert not whole[key] or slots_on[key] == 1, f"whole GPU {key} is shared"
        for model, free in self.inv.free().items():
            mine = [g for g in self.inv.gpus() if g.model == model]
            assert free.free_gpus == sum(1 for g in mine if not g.mig and not g.milli)
            assert free.used_gpus == sum(1 for g in mine if g.milli or g.mig_slices)

    # --- helpers ---

    def _assert_shape(self, request: GpuRequest, model: str | None, found: Placement) -> None:
        if model:
            assert found.model == model
        by_key = {(g.node, g.device): g for g in self.inv.gpus()}
        gpus = [by_key[(s.node, s.device)] for s in found.slots]
        assert all(g.model == found.model for g in gpus)
        if request.mig_profile:
            assert len(found.slots) == request.count
            assert all(s.mig_profile == request.mig_profile and g.mig for s, g in zip(found.slots, gpus))
            assert found.gpus == pytest.approx(request.count * MigProfile.parse(request.mig_profile).slices / 7)
        elif request.fractional:
            (slot,) = found.slots
            assert not gpus[0].mig and 1 <= slot.milli <= 1000
            if request.milli < 1000:
                assert slot.milli == request.milli
            if request.memory_gib:
                assert slot.memory_kib >= request.memory_gib * GIB
        else:
            assert len({(s.node, s.device) for s in found.slots}) == request.count == len(found.slots)
            assert all(not g.mig and g.milli == 0 and s.milli == 1000 for s, g in zip(found.slots, gpus))
            assert found.gpus == request.count
            if request.memory_gib:
                assert all(g.memory_kib >= request.memory_gib * GIB for g in gpus)
            if request.topology == "node":
                assert len(found.nodes) == 1
            if request.topology == "nvlink":
                assert len({_domain(self.spec, n) for n in found.nodes}) == 1

    def _assert_truly_full(self, request: GpuRequest, model: str | None, gpus: list[Any]) -> None:
        """A refusal is right: no model (the one named, else any) has room by a brute-force count."""
        for m in [model] if model else MODELS:
            mine = [g for g in gpus if g.model == m]
            if request.mig_profile:
                p = MigProfile.parse(request.mig_profile)
                offering = {f"{i}-" for i, g in enumerate(self.spec.gpus) if request.mig_profile in g.mig_profiles}
                room = sum(min((7 - g.mig_slices) // p.slices, (g.memory_kib - g.used_kib) // p.memory_kib)
                           for g in mine if g.mig and g.node.split("-")[0] + "-" in offering)
                assert room < request.count, f"{request.count} {p.name} fit on {m}: {room}"
            elif request.fractional:
                for g in mine:
                    if g.mig:
                        continue
                    kib = (math.ceil(request.memory_gib * GIB) if request.memory_gib else
                           request.milli * g.memory_kib // 1000)
                    milli = request.milli if request.milli < 1000 else -(-1000 * kib // g.memory_kib)
                    assert g.milli + milli > 1000 or g.used_kib + kib > g.memory_kib, f"{g} had room"
            else:
                ok = [g for g in mine if not g.mig and not g.milli
                      and (not request.memory_gib or g.memory_kib >= request.memory_gib * GIB)]
                if request.topology == "any":
                    blocks = [len(ok)]
                elif request.topology == "node":
                    blocks = list(Counter(g.node for g in ok).values())
                else:
                    blocks = list(Counter(_domain(self.spec, g.node) for g in ok).values())
                assert max(blocks, default=0) < request.count, f"{request} fits on {m}"


TestInventoryProperties = InventoryMachine.TestCase
TestInventoryProperties.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_usage_per_model_is_what_every_gpu_holds_summed_and_follows_each_change() -> None:
    """``usage()`` (kept up to date at each change, for snapshots) agrees with a scan of every GPU: whole,
    shared and MIG GPUs, after commits and releases."""
    inv = inventory(group("a100-80gb", per_node=4, nodes=2),
                    group("a100-80gb", per_node=2, mig_profiles=["1g.10gb", "3g.40gb"]), group("h100-80gb"))

    def scanned() -> dict[str, tuple[int, int, int, float]]:
        out: dict[str, list[float]] = {}
        for g in inv.gpus():
            t = out.setdefault(g.model, [0, 0, 0, 0.0])
            t[0] += 1
            t[1] += g.memory_kib
            t[2] += g.used_kib
            t[3] += g.mig_slices / 7 if g.mig else g.milli / 1000
        return {m: (int(a), int(b), int(c), pytest.approx(d)) for m, (a, b, c, d) in out.items()}

    def summed() -> dict[str, tuple[int, int, int, float]]:
        return {m: (u.gpus, u.memory_kib, u.used_kib, u.busy) for m, u in inv.usage().items()}

    assert summed() == scanned()
    asks = [("w", GpuRequest(count=3, model="a100-80gb")), ("f", GpuRequest(milli=250, model="h100-80gb")),
            ("m", GpuRequest(mig_profile="3g.40gb", model="a100-80gb")), ("x", GpuRequest(count=2, model="h100-80gb"))]
    for job_id, req in asks:
        placement = inv.find(req)
        assert isinstance(placement, Placement), placement
        inv.commit(job_id, placement)
        assert summed() == scanned()
    assert inv.usage()["h100-80gb"].busy == pytest.approx(2.25)
    for job_id in ("f", "w", "m"):
        inv.release(job_id)
        assert summed() == scanned()
    assert inv.usage()["a100-80gb"].busy == 0 and inv.usage()["a100-80gb"].used_kib == 0
