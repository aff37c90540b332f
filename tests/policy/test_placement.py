"""Receiver selection (thesis §5.2.3): holders first, then one GPU per new host."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.policy.placement import (
    COMPUTE_EPSILON,
    Placement,
    PlacementDecision,
    PlacementRequest,
    place,
    select_receivers,
)
from flashpoint.policy.snapshot import ClusterSnapshot, DeviceSnapshot, HostSnapshot

M = "m@1"


def dev(host: str, did: str, free: int = 100, replicas: int = 0, compute: float = 1.0,
        total: int = 100) -> DeviceSnapshot:
    return DeviceSnapshot(host, did, "cuda", total, free, replicas, compute_free=compute)


def gpus(host: str, n: int, free: int = 100) -> tuple[DeviceSnapshot, ...]:
    return tuple(dev(host, f"g{i}", free) for i in range(n))


def host(hid: str, devs: tuple[DeviceSnapshot, ...], *, alive: bool = True,
         draining: bool = False, ram: int = 1000, cached: tuple[str, ...] = (), leaf: str = "",
         hops: int = 0) -> HostSnapshot:
    return HostSnapshot(hid, alive, draining, ram, frozenset(cached), devs, leaf=leaf, hops=hops)


def snap(*hosts: HostSnapshot) -> ClusterSnapshot:
    return ClusterSnapshot(0.0, hosts)


def req(count: int = 1, device_bytes: int = 10, host_bytes: int = 10, compute: float = 0.0,
        process_bytes: int = 0) -> PlacementRequest:
    return PlacementRequest("f", M, count, device_bytes, host_bytes, compute=compute,
                            process_bytes=process_bytes)


def hosts_of(d: PlacementDecision) -> list[str]:
    return [p.host_id for p in d.placements]


# the thesis's two stages -----------------------------------------------------------------
def test_primed_host_is_filled_first_then_one_gpu_per_new_host():
    """Listing 5.1 as printed would take only g0 of the holder (its inner ``break``) and
    visit hosts in list order; the prose fills the holder, then primes one GPU per host."""
    s = snap(host("b", gpus("b", 4)), host("a", gpus("a", 4), cached=(M,)),
             host("c", gpus("c", 4)), host("d", gpus("d", 4)))
    d = select_receivers(s, req(count=7))
    assert d.placements == (Placement("a", "g0"), Placement("a", "g1"), Placement("a", "g2"),
                            Placement("a", "g3"), Placement("b", "g0"), Placement("c", "g0"),
                            Placement("d", "g0"))
    assert d.unplaced == 0 and d.reason == ""
    assert d.downloads == ("b", "c", "d")


def test_fewer_replicas_than_holder_gpus_stay_on_holders():
    s = snap(host("a", gpus("a", 4), cached=(M,)), host("b", gpus("b", 4)))
    d = select_receivers(s, req(count=3))
    assert hosts_of(d) == ["a", "a", "a"] and d.downloads == ()


def test_one_gpu_per_new_host_before_a_second_on_any():
    s = snap(*(host(h, gpus(h, 8)) for h in ("a", "b", "c")))
    d = select_receivers(s, req(count=3))
    assert sorted(hosts_of(d)) == ["a", "b", "c"]


def test_stage3_packs_primed_hosts_then_stacks_holders_first():
    s = snap(host("h", (dev("h", "g0", 30),), cached=(M,)),
             host("n", (dev("n", "g0", 30), dev("n", "g1", 20))))
    d = select_receivers(s, req(count=6))
    assert d.placements == (
        Placement("h", "g0"),  # stage 1: the holder's GPU
        Placement("n", "g0"),  # stage 2: one GPU on the new host
        Placement("n", "g1"),  # stage 3a: the primed host's other GPU shares the download
        Placement("h", "g0"), Placement("h", "g0"),  # 3b: a second replica, holders first
        Placement("n", "g0"),  # then the primed host's GPU with the most free memory
    )
    assert d.unplaced == 0 and d.downloads == ("n",)


# order --------------------------------------------------------------------------------------
def test_new_hosts_under_a_senders_leaf_first_then_hops_replicas_id():
    sender = host("s", (dev("s", "g0", 0),), cached=(M,), leaf="L1")  # holds M, GPU full
    s = snap(sender,
             host("a", gpus("a", 1), leaf="L2", hops=0),
             host("b", gpus("b", 1), leaf="L1", hops=5),
             host("c", (dev("c", "g0", replicas=3),), leaf="L1", hops=1),
             host("e", gpus("e", 1), leaf="L1", hops=1),
             host("d", gpus("d", 1), leaf="L1", hops=1))
    assert hosts_of(select_receivers(s, req(count=5))) == ["d", "e", "c", "b", "a"]


def test_leaf_of_a_dead_or_draining_holder_or_an_empty_leaf_is_no_sender():
    for bad in (dict(alive=False), dict(draining=True)):
        s = snap(host("s", gpus("s", 1), cached=(M,), leaf="L1", **bad),
                 host("a", gpus("a", 1), leaf="L0"), host("b", gpus("b", 1), leaf="L1"))
        assert hosts_of(select_receivers(s, req(count=1))) == ["a"]
    s = snap(host("s", (dev("s", "g0", 0),), cached=(M,)),
             host("a", gpus("a", 1), hops=2), host("b", gpus("b", 1)))
    assert hosts_of(select_receivers(s, req(count=1))) == ["b"]  # "" matches nothing: hops


def test_holder_hosts_fewer_replicas_first_and_devices_most_free_then_replicas_then_id():
    s = snap(host("x", (dev("x", "g0", replicas=2),), cached=(M,)),
             host("y", (dev("y", "g0", 50), dev("y", "g1", 80), dev("y", "g2", 80, replicas=1),
                        dev("y", "g3", 80, replicas=1)), cached=(M,)))
    d = select_receivers(s, req(count=4))
    # y has 2 replicas, x has 2: tie -> id "x" first
    assert d.placements[0] == Placement("x", "g0")
    assert [p.device_id for p in d.placements[1:]] == ["g1", "g2", "g3"]


# eligibility --------------------------------------------------------------------------------
def test_device_memory_and_compute_must_both_fit():
    s = snap(host("a", (dev("a", "g0", 9), dev("a", "g1", 50, compute=0.2),
                        dev("a", "g2", 10, compute=0.5)), cached=(M,)))
    assert hosts_of(select_receivers(s, req(count=1, compute=0.5))) == ["a"]
    assert select_receivers(s, req(count=1, compute=0.5)).placements[0].device_id == "g2"
    d = select_receivers(s, req(count=3, compute=0.5))
    assert len(d.placements) == 1 and d.unplaced == 2


def test_compute_reservation_allows_exactly_ten_tenths():
    s = snap(host("a", (dev("a", "g0", 1000),), cached=(M,)))
    d = select_receivers(s, req(count=12, compute=0.1))
    assert len(d.placements) == 10 and d.unplaced == 2
    assert "compute" in d.reason


def test_new_host_needs_ram_for_download_and_process_holder_for_process_only():
    new = lambda ram: snap(host("a", gpus("a", 1), ram=ram))  # noqa: E731
    assert len(place(new(15), req(host_bytes=10, process_bytes=5))) == 1
    assert place(new(14), req(host_bytes=10, process_bytes=5)) == []
    held = lambda ram: snap(host("a", gpus("a", 1), ram=ram, cached=(M,)))  # noqa: E731
    assert len(place(held(5), req(host_bytes=10, process_bytes=5))) == 1
    assert place(held(4), req(host_bytes=10, process_bytes=5)) == []


def test_dead_and_draining_hosts_are_never_used():
    s = snap(host("dead", gpus("dead", 2), alive=False, cached=(M,)),
             host("drain", gpus("drain", 2), draining=True, cached=(M,)),
             host("ok", (dev("ok", "g0", 15),)))
    d = select_receivers(s, req(count=5))
    assert hosts_of(d) == ["ok"] and d.unplaced == 4


# reservations within one decision -----------------------------------------------------------
def test_host_ram_is_reserved_per_process_and_once_per_download():
    # holder: RAM for 3 processes only, so 3 of its 8 GPUs
    s = snap(host("a", gpus("a", 8), ram=30, cached=(M,)))
    d = select_receivers(s, req(count=8, process_bytes=10))
    assert len(d.placements) == 3 and d.unplaced == 5 and "RAM" in d.reason
    # new host: one download (40) + 2 processes (2 x 10); the second GPU shares the download
    s = snap(host("b", gpus("b", 4), ram=60))
    d = select_receivers(s, req(count=4, host_bytes=40, process_bytes=10))
    assert hosts_of(d) == ["b", "b"] and d.downloads == ("b",)


def test_device_memory_and_compute_are_reserved_across_the_decision():
    s = snap(host("a", (dev("a", "g0", 30), dev("a", "g1", 25)), cached=(M,)))
    d = select_receivers(s, req(count=5))
    assert [p.device_id for p in d.placements] == ["g0", "g1", "g0", "g1", "g0"]
    s = snap(host("a", gpus("a", 2, free=1000), cached=(M,)))
    d = select_receivers(s, req(count=5, compute=0.5))
    assert [p.device_id for p in d.placements] == ["g0", "g1", "g0", "g1"] and d.unplaced == 1


# reasons and the API ------------------------------------------------------------------------
@pytest.mark.parametrize("cluster,request_,expected", [
    (snap(), req(count=2), "the cluster has no hosts"),
    (snap(host("a", gpus("a", 1), alive=False)), req(), "no host is alive and not draining"),
    (snap(host("a", gpus("a", 1, free=5))), req(device_bytes=6),
     "no live non-draining host has a device with 6 free bytes"),
    (snap(host("a", (dev("a", "g0", compute=0.3),))), req(compute=0.5),
     "no device with 10 free bytes has 0.5 of its compute free"),
    (snap(host("a", gpus("a", 1), ram=5)), req(host_bytes=10), "lack RAM to download the model"),
])
def test_reason_names_the_binding_constraint(cluster, request_, expected):
    d = select_receivers(cluster, request_)
    assert d.placements == () and d.unplaced == request_.count and expected in d.reason


def test_partial_placement_says_how_many():
    d = select_receivers(snap(host("a", (dev("a", "g0", 25),))), req(count=3))
    assert d.unplaced == 1 and d.reason.startswith("placed 2 of 3: ")


def test_zero_or_negative_count_places_nothing_and_no_reason():
    for count in (0, -3):
        assert select_receivers(snap(host("a", gpus("a", 1))), req(count=count)) == \
            PlacementDecision((), 0, "", ())


def test_invalid_requests_raise():
    with pytest.raises(ValueError):
        req(device_bytes=-1)
    with pytest.raises(ValueError):
        req(compute=float("nan"))


def test_place_is_the_placements_as_a_list():
    s = snap(host("a", gpus("a", 2), cached=(M,)), host("b", gpus("b", 2)))
    assert place(s, req(count=3)) == list(select_receivers(s, req(count=3)).placements)
    assert isinstance(place(s, req(count=3)), list)


def test_old_positional_constructors_still_work():
    r = PlacementRequest("f", M, 1, 10, 10)
    assert r.compute == 0.0 and r.process_bytes == 0
    assert DeviceSnapshot("a", "g0", "cpu", 1, 1, 0).compute_free == 1.0
    h = HostSnapshot("a", True, False, 1, frozenset(), ())
    assert h.leaf == "" and h.hops == 0


# properties ---------------------------------------------------------------------------------
@st.composite
def clusters(draw: st.DrawFn, dense: bool = False) -> ClusterSnapshot:
    """Small clusters; ``dense`` ones have at least two hosts with a GPU each, so the stages
    meet more often than hypothesis's bias towards empty examples would let them."""
    hosts = []
    for i in range(draw(st.integers(2 if dense else 0, 6))):
        hid = f"h{i}"
        devs = tuple(
            DeviceSnapshot(hid, f"g{j}", "cuda", 1000, draw(st.integers(0, 1000)),
                           draw(st.integers(0, 3)),
                           compute_free=draw(st.sampled_from([0.0, 0.25, 0.5, 0.7, 1.0])))
            for j in range(draw(st.integers(1 if dense else 0, 4))))
        # mostly usable hosts, so the stages have something to choose between
        hosts.append(HostSnapshot(
            hid, draw(st.sampled_from([True, True, True, False])),
            draw(st.sampled_from([False, False, False, True])), draw(st.integers(0, 1000)),
            frozenset(draw(st.sets(st.sampled_from([M, "x@1"])))), devs,
            leaf=draw(st.sampled_from(["", "L0", "L1"])), hops=draw(st.integers(0, 3))))
    return ClusterSnapshot(0.0, tuple(hosts))


requests = st.builds(
    lambda c, db, hb, comp, pb: PlacementRequest("f", M, c, db, hb, compute=comp,
                                                 process_bytes=pb),
    st.integers(-1, 25), st.integers(0, 600), st.integers(0, 600),
    st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 1.0]), st.integers(0, 300))


def _fits_after(s: ClusterSnapshot, r: PlacementRequest, d: PlacementDecision) -> list[str]:
    """Devices on usable hosts that could still take a replica after the decision."""
    per_dev: dict[tuple[str, str], int] = {}
    per_host: dict[str, int] = {}
    for p in d.placements:
        per_dev[(p.host_id, p.device_id)] = per_dev.get((p.host_id, p.device_id), 0) + 1
        per_host[p.host_id] = per_host.get(p.host_id, 0) + 1
    room = []
    for h in s.hosts:
        if not h.alive or h.draining:
            continue
        has_model = M in h.cached_models or per_host.get(h.host_id, 0) > 0
        ram_used = per_host.get(h.host_id, 0) * r.process_bytes + (
            r.host_bytes if M not in h.cached_models and per_host.get(h.host_id) else 0)
        need = r.process_bytes + (0 if has_model else r.host_bytes)
        for dv in h.devices:
            n = per_dev.get((h.host_id, dv.device_id), 0)
            if (dv.memory_free_bytes - n * r.device_bytes >= r.device_bytes
                    and dv.compute_free - n * r.compute + COMPUTE_EPSILON >= r.compute
                    and h.ram_free_bytes - ram_used >= need):
                room.append(f"{h.host_id}/{dv.device_id}")
    return room


@settings(max_examples=300, deadline=None)
@given(s=clusters(), r=requests)
def test_property_reservations_never_exceed_capacity(s: ClusterSnapshot, r: PlacementRequest):
    d = select_receivers(s, r)
    hosts = {h.host_id: h for h in s.hosts}
    devs = {(dv.host_id, dv.device_id): dv for h in s.hosts for dv in h.devices}
    per_dev: dict[tuple[str, str], int] = {}
    per_host: dict[str, int] = {}
    for p in d.placements:
        h = hosts[p.host_id]
        assert h.alive and not h.draining
        assert (p.host_id, p.device_id) in devs
        per_dev[(p.host_id, p.device_id)] = per_dev.get((p.host_id, p.device_id), 0) + 1
        per_host[p.host_id] = per_host.get(p.host_id, 0) + 1
    for key, n in per_dev.items():
        assert n * r.device_bytes <= devs[key].memory_free_bytes
        assert n * r.compute <= devs[key].compute_free + n * COMPUTE_EPSILON
    for hid, n in per_host.items():
        download = 0 if M in hosts[hid].cached_models else r.host_bytes
        assert download + n * r.process_bytes <= hosts[hid].ram_free_bytes
    # downloads: exactly the hosts used that did not hold the model, in first-use order
    first_use = list(dict.fromkeys(p.host_id for p in d.placements))
    assert list(d.downloads) == [h for h in first_use if M not in hosts[h].cached_models]


@settings(max_examples=300, deadline=None)
@given(s=clusters(), r=requests)
def test_property_every_replica_placed_or_explained(s: ClusterSnapshot, r: PlacementRequest):
    d = select_receivers(s, r)
    assert len(d.placements) + d.unplaced == max(0, r.count)
    assert d.unplaced >= 0
    assert bool(d.reason) == (d.unplaced > 0)
    if d.unplaced:
        assert _fits_after(s, r, d) == []  # greedy to exhaustion: nothing left had room


@settings(max_examples=200, deadline=None)
@given(s=clusters(), r=requests, seed=st.integers(0, 2**32 - 1))
def test_property_deterministic_and_independent_of_listing_order(s: ClusterSnapshot,
                                                                 r: PlacementRequest, seed: int):
    d = select_receivers(s, r)
    assert select_receivers(s, r) == d
    rng = random.Random(seed)
    shuffled = [HostSnapshot(h.host_id, h.alive, h.draining, h.ram_free_bytes, h.cached_models,
                             tuple(rng.sample(h.devices, len(h.devices))), leaf=h.leaf,
                             hops=h.hops) for h in s.hosts]
    rng.shuffle(shuffled)
    assert select_receivers(ClusterSnapshot(s.now_s, tuple(shuffled)), r) == d


@settings(max_examples=400, deadline=None)
@given(s=clusters(dense=True), r=requests)
def test_property_two_stages(s: ClusterSnapshot, r: PlacementRequest):
    """Before the first replica on a new host, every holder GPU that fit got one (unless its
    host ran out of RAM for processes); before any new host gets a second replica, every new
    host that could take the download got one. Checked on the prefix of the decision, so
    it holds however many replicas were asked for."""
    d = select_receivers(s, r)
    hosts = {h.host_id: h for h in s.hosts}
    usable = [h for h in s.hosts if h.alive and not h.draining]

    def fits(dv: DeviceSnapshot) -> bool:
        return (dv.memory_free_bytes >= r.device_bytes
                and dv.compute_free + COMPUTE_EPSILON >= r.compute)

    def is_new(p: Placement) -> bool:
        return M not in hosts[p.host_id].cached_models

    first_new = next((i for i, p in enumerate(d.placements) if is_new(p)), None)
    if first_new is not None:
        stage1 = d.placements[:first_new]
        for h in (h for h in usable if M in h.cached_models):
            ram_left = h.ram_free_bytes - sum(p.host_id == h.host_id for p in stage1) * \
                r.process_bytes
            for dv in h.devices:
                if fits(dv) and Placement(h.host_id, dv.device_id) not in stage1:
                    assert ram_left < r.process_bytes, (h.host_id, dv.device_id)
    seen: set[str] = set()
    second = None
    for i, p in enumerate(d.placements):
        if is_new(p) and p.host_id in seen:
            second = i
            break
        seen.add(p.host_id)
    if second is not None:
        primed = {p.host_id for p in d.placements[:second]}
        for h in (h for h in usable if M not in h.cached_models):
            if h.ram_free_bytes >= r.host_bytes + r.process_bytes and any(map(fits, h.devices)):
                assert h.host_id in primed, h.host_id
