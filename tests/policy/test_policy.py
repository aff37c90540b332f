"""Pure policies: autoscale.decide and placement.place."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint.policy.autoscale import concurrency_target, decide
from flashpoint.policy.placement import Placement, PlacementRequest, place
from flashpoint.policy.snapshot import (
    ClusterSnapshot,
    DeviceSnapshot,
    FunctionLoadSnapshot,
    HostSnapshot,
)


def ld(**kw) -> FunctionLoadSnapshot:
    base = dict(name="f", now_s=100.0, queued=0, inflight=0, replicas_warm=0, replicas_starting=0,
                last_request_s=None, min_replicas=0, max_replicas=10, replica_concurrency=4,
                keep_alive_s=30.0)
    base.update(kw)
    return FunctionLoadSnapshot(**base)


# autoscale --------------------------------------------------------------------------------
def test_no_load_no_replicas_stays_zero():
    assert decide(ld()).desired == 0


def test_scale_from_zero_on_first_request():
    d = decide(ld(queued=1, last_request_s=100.0))
    assert d.desired == 1 and d.reason == "demand"


def test_concurrency_target():
    assert concurrency_target(ld(queued=0, inflight=0)) == 0
    assert concurrency_target(ld(queued=4)) == 1
    assert concurrency_target(ld(queued=4, inflight=1)) == 2
    assert concurrency_target(ld(queued=9, replica_concurrency=3)) == 3


def test_scale_up_follows_demand_and_max_bound():
    assert decide(ld(queued=17, replicas_warm=1)).desired == 5
    d = decide(ld(queued=1000, replicas_warm=1, max_replicas=3))
    assert d.desired == 3 and d.reason.endswith("+bounds")


def test_min_bound():
    d = decide(ld(min_replicas=2))
    assert d.desired == 2 and "bounds" in d.reason
    assert decide(ld(min_replicas=2, replicas_warm=5, last_request_s=0.0)).desired == 2


def test_keep_alive_holds_replicas_until_expired():
    base = dict(replicas_warm=3, keep_alive_s=30.0, last_request_s=80.0)
    d = decide(ld(now_s=109.9, **base))
    assert d.desired == 3 and d.reason == "keep_alive"
    d = decide(ld(now_s=110.0, **base))
    assert d.desired == 0 and d.reason == "idle"
    d = decide(ld(now_s=110.0, queued=5, **base))
    assert d.desired == 2 and d.reason == "demand"


def test_never_invoked_with_replicas_scales_to_min():
    assert decide(ld(replicas_warm=2, replicas_starting=1)).desired == 0
    assert decide(ld(replicas_warm=2, min_replicas=1)).desired == 1


def test_starting_replicas_count_as_current():
    d = decide(ld(queued=4, replicas_starting=1, last_request_s=100.0))
    assert d.desired == 1


@settings(max_examples=100, deadline=None)
@given(queued=st.integers(0, 10_000), inflight=st.integers(0, 10_000), warm=st.integers(0, 50),
       starting=st.integers(0, 50), mn=st.integers(0, 20), extra=st.integers(0, 20),
       conc=st.integers(1, 64), last=st.one_of(st.none(), st.floats(0, 200)),
       keep=st.floats(0, 100))
def test_property_decide_within_bounds(queued, inflight, warm, starting, mn, extra, conc, last, keep):
    mx = max(1, mn + extra)
    d = decide(ld(queued=queued, inflight=inflight, replicas_warm=warm, replicas_starting=starting,
                  min_replicas=mn, max_replicas=mx, replica_concurrency=conc, last_request_s=last,
                  keep_alive_s=keep))
    assert mn <= d.desired <= mx
    if queued + inflight > 0 and warm + starting == 0:
        assert d.desired >= 1


# placement --------------------------------------------------------------------------------
def dev(host: str, did: str, free: int, replicas: int = 0, total: int = 100) -> DeviceSnapshot:
    return DeviceSnapshot(host, did, "cpu", total, free, replicas)


def host(hid: str, *devs: DeviceSnapshot, alive=True, draining=False, ram=1000, cached=()) -> HostSnapshot:
    return HostSnapshot(hid, alive, draining, ram, frozenset(cached), tuple(devs))


def req(count=1, device_bytes=10, host_bytes=10, model="m@1") -> PlacementRequest:
    return PlacementRequest("f", model, count, device_bytes, host_bytes)


def test_prefers_cached_host_over_more_free_memory():
    snap = ClusterSnapshot(0.0, (
        host("a", dev("a", "d0", 100)),
        host("b", dev("b", "d0", 20), cached={"m@1"}),
    ))
    assert place(snap, req()) == [Placement("b", "d0")]


def test_most_free_then_fewer_replicas_then_id():
    snap = ClusterSnapshot(0.0, (host("a", dev("a", "d0", 50), dev("a", "d1", 80)),))
    assert place(snap, req()) == [Placement("a", "d1")]
    snap = ClusterSnapshot(0.0, (host("a", dev("a", "d0", 50, 2), dev("a", "d1", 50, 1)),))
    assert place(snap, req()) == [Placement("a", "d1")]
    snap = ClusterSnapshot(0.0, (host("b", dev("b", "d0", 50)), host("a", dev("a", "d0", 50))))
    assert place(snap, req()) == [Placement("a", "d0")]


def test_skips_draining_and_dead_hosts():
    snap = ClusterSnapshot(0.0, (
        host("dead", dev("dead", "d0", 100), alive=False, cached={"m@1"}),
        host("drain", dev("drain", "d0", 100), draining=True, cached={"m@1"}),
        host("ok", dev("ok", "d0", 15)),
    ))
    assert place(snap, req(count=5)) == [Placement("ok", "d0")]
    only_bad = ClusterSnapshot(0.0, snap.hosts[:2])
    assert place(only_bad, req()) == []


def test_reserves_memory_across_one_decision():
    snap = ClusterSnapshot(0.0, (host("a", dev("a", "d0", 30), dev("a", "d1", 25)),))
    out = place(snap, req(count=5))
    # d0 30 -> 20, d1 25 -> 15, d0 20 -> 10, d1 15 -> 5, d0 10 -> 0
    assert out == [Placement("a", "d0"), Placement("a", "d1"), Placement("a", "d0"),
                   Placement("a", "d1"), Placement("a", "d0")]


def test_returns_fewer_when_full():
    snap = ClusterSnapshot(0.0, (host("a", dev("a", "d0", 25)),))
    assert place(snap, req(count=4)) == [Placement("a", "d0"), Placement("a", "d0")]
    assert place(snap, req(count=1, device_bytes=26)) == []
    assert place(ClusterSnapshot(0.0, ()), req(count=3)) == []


def test_host_ram_needed_for_uncached_model_and_download_is_shared():
    snap = ClusterSnapshot(0.0, (
        host("a", dev("a", "d0", 100), dev("a", "d1", 100), ram=15),
        host("b", dev("b", "d0", 100), ram=5),
    ))
    out = place(snap, req(count=3, device_bytes=10, host_bytes=10))
    # b has too little RAM for a cold copy; a downloads once and places on both devices
    assert {p.host_id for p in out} == {"a"}
    assert len(out) == 3
    cached_small_ram = ClusterSnapshot(0.0, (host("b", dev("b", "d0", 100), ram=0, cached={"m@1"}),))
    assert place(cached_small_ram, req(host_bytes=10)) == [Placement("b", "d0")]


@st.composite
def clusters(draw):
    hosts = []
    for h in range(draw(st.integers(0, 4))):
        hid = f"h{h}"
        devs = tuple(
            dev(hid, f"d{i}", draw(st.integers(0, 1000)), draw(st.integers(0, 5)), total=1000)
            for i in range(draw(st.integers(0, 3)))
        )
        hosts.append(host(hid, *devs, alive=draw(st.booleans()), draining=draw(st.booleans()),
                          ram=draw(st.integers(0, 1000)),
                          cached=draw(st.sets(st.sampled_from(["m@1", "x@1"])))))
    return ClusterSnapshot(0.0, tuple(hosts))


@settings(max_examples=120, deadline=None)
@given(snap=clusters(), count=st.integers(0, 20), dbytes=st.integers(1, 600),
       hbytes=st.integers(0, 600))
def test_property_place_never_overcommits(snap, count, dbytes, hbytes):
    out = place(snap, req(count=count, device_bytes=dbytes, host_bytes=hbytes))
    assert len(out) <= count
    free = {(d.host_id, d.device_id): d.memory_free_bytes for h in snap.hosts for d in h.devices}
    usable = {h.host_id for h in snap.hosts if h.alive and not h.draining}
    used: dict[tuple[str, str], int] = {}
    for p in out:
        assert p.host_id in usable
        key = (p.host_id, p.device_id)
        used[key] = used.get(key, 0) + dbytes
    for key, b in used.items():
        assert b <= free[key]
    # host RAM: each uncached host used pays one download that must fit
    for h in snap.hosts:
        if h.host_id in {p.host_id for p in out} and "m@1" not in h.cached_models:
            assert hbytes <= h.ram_free_bytes
