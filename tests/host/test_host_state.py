"""HostState driven with no network: events in, commands out, against hand-worked
expectations (device bytes, host RAM, the warm pool's order, hold and refill decisions)."""

from __future__ import annotations

import pytest

from flashpoint.errors import BadRequest, NoCapacity
from flashpoint.host import state as hs

MB = 1 << 20


def _host(pool: int = 2) -> hs.HostState:
    st = hs.HostState("h1", warm_pool_size=pool)
    assert st.handle(hs.DevicesReported((("cuda:0", 1000 * MB), ("cpu:0", 100 * MB)))) == []
    return st


def _ask(rid: str, device: str = "cuda:0", mb: int = 400, **kw) -> hs.ReplicaRequested:
    return hs.ReplicaRequested(rid, "f", device, mb * MB, 64 * MB, **kw)


def test_reservations_add_up_and_refuse_an_overcommit() -> None:
    st = _host()
    assert st.handle(_ask("r1", model_key="m@1")) == [hs.ReserveHostMemory("r1", 64 * MB)]
    assert st.handle(_ask("r2", model_key="m@1")) == [hs.ReserveHostMemory("r2", 64 * MB)]
    assert st.device_used == {"cuda:0": 800 * MB}
    # 800 + 400 > 1000: refused, and nothing is recorded for it.
    with pytest.raises(NoCapacity) as info:
        st.handle(_ask("r3"))
    assert f"{400 * MB} bytes needed, {200 * MB} free" in info.value.message
    assert set(st.replicas) == {"r1", "r2"} and st.device_used["cuda:0"] == 800 * MB
    # 200 MB still fit exactly.
    assert st.handle(_ask("r4", mb=200)) == [hs.ReserveHostMemory("r4", 64 * MB)]
    assert st.device_used["cuda:0"] == 1000 * MB
    with pytest.raises(BadRequest):
        st.handle(_ask("r5", device="cuda:9"))


def test_a_repeated_deploy_reserves_once_and_gone_releases_once() -> None:
    st = _host()
    st.handle(_ask("r1"))
    assert st.handle(_ask("r1")) == []  # idempotent by replica id
    assert st.device_used["cuda:0"] == 400 * MB
    assert st.handle(hs.ReplicaGone("r1")) == [hs.ReleaseReplica("r1", 64 * MB)]
    assert st.handle(hs.ReplicaGone("r1")) == []  # a second release gives back nothing
    assert st.device_used["cuda:0"] == 0 and st.replicas == {}


def test_refused_host_memory_frees_the_device_and_releases_no_ram() -> None:
    st = _host()
    st.handle(_ask("r1"))
    assert st.handle(hs.HostMemoryRefused("r1")) == [hs.ReleaseReplica("r1", 0)]
    assert st.device_used["cuda:0"] == 0 and "r1" not in st.replicas


def test_stopping_a_weights_exporter_names_its_readers() -> None:
    st = _host()
    slot = {"key": "m@1/gpu0"}
    for rid in ("exp", "rd", "other"):
        st.handle(_ask(rid, mb=100, model_key="m@1"))
    st.handle(hs.WorkerAssigned("exp", slot))
    st.handle(hs.ReplicaLoaded("exp", "exporter"))
    st.handle(hs.WorkerAssigned("rd", dict(slot)))
    st.handle(hs.ReplicaLoaded("rd", "reader"))
    st.handle(hs.WorkerAssigned("other", None))
    assert st.handle(hs.ReplicaGone("exp")) == [hs.ReleaseReplica("exp", 64 * MB, ("rd",))]
    assert st.handle(hs.ReplicaGone("rd")) == [hs.ReleaseReplica("rd", 64 * MB)]


def test_a_stage_is_reported_whole_only_once_completed() -> None:
    st = _host()
    st.handle(_ask("s1", model_key="m@1", stage=(0, 3), pipeline=True))
    st.handle(_ask("w1", model_key="m@1"))
    assert [r.serving_whole for r in st.replicas.values()] == [False, False]
    st.handle(hs.ReplicaLoaded("s1", "", ("h1", "10.0.0.1", 7000)))
    st.handle(hs.ReplicaLoaded("w1"))
    assert (st.replicas["s1"].serving_whole, st.replicas["w1"].serving_whole) == (False, True)
    assert st.replicas["s1"].pipeline_endpoint == ("h1", "10.0.0.1", 7000)
    st.handle(hs.StageCompleted("s1", True))
    assert st.replicas["s1"].serving_whole
    st.handle(hs.StageDissolved("s1"))
    assert st.replicas["s1"].pipeline_endpoint is None and st.replicas["s1"].serving_whole


def test_refill_waits_for_a_stage_hold_or_a_whole_replicas_first_answer() -> None:
    st = _host()
    st.handle(_ask("s1", mb=100, model_key="m@1", stage=(0, 3)))
    st.handle(_ask("w1", mb=100, model_key="m@1"))
    st.handle(_ask("w2", mb=100, model_key="m@2"))
    st.handle(_ask("k1", mb=100))  # a KaaS executor: no model key
    st.handle(hs.ReplicaLoaded("w1"))
    assert st.handle(hs.ColdStartEnded("s1")) == [hs.RefillPool(after_hold="m@1")]
    assert st.handle(hs.ColdStartEnded("w1")) == [hs.RefillPool(after_first_answer=True)]
    # w2 failed to load: nobody answers, so the refill does not wait for it.
    assert st.handle(hs.ColdStartEnded("w2")) == [hs.RefillPool()]
    assert st.handle(hs.ColdStartEnded("k1")) == [hs.RefillPool()]


def test_completion_releases_the_stage_models_hold_once_a_worker_runs_it() -> None:
    st = _host()
    st.handle(_ask("s1", model_key="m@1", stage=(0, 3)))
    assert st.handle(hs.CompletionAsked("s1")) == []  # no worker yet: nothing to release
    st.handle(hs.WorkerAssigned("s1"))
    assert st.handle(hs.CompletionAsked("s1")) == [hs.ReleaseHold("m@1", "group answered")]
    assert st.handle(hs.CompletionAsked("nobody")) == []


def test_the_warm_pool_hands_out_the_oldest_and_refills_one_at_a_time() -> None:
    st = _host(pool=2)
    # Empty pool: a start spawns its own worker.
    assert st.handle(hs.WorkerWanted("r1")) == [hs.SpawnWorker("r1")]
    # Refill: one spawn at a time, never more than the pool's size in flight or idle.
    assert st.handle(hs.PoolRefillDue()) == [hs.SpawnWorker()]
    assert st.handle(hs.PoolRefillDue()) == [hs.SpawnWorker()]
    assert st.handle(hs.PoolRefillDue()) == []  # 2 spawning
    st.handle(hs.PoolSpawnEnded("w-a"))
    st.handle(hs.PoolSpawnEnded())  # a failed spawn frees its slot
    assert st.spawning == 0 and st.idle == ["w-a"] and not st.pool_full()
    assert st.handle(hs.PoolRefillDue()) == [hs.SpawnWorker()]
    st.handle(hs.PoolSpawnEnded("w-b"))
    assert st.pool_full() and st.handle(hs.PoolRefillDue()) == []
    assert st.handle(hs.WorkerWanted("r2")) == [hs.UseWorker("w-a")]  # oldest first
    st.handle(hs.WorkerExited("w-b"))  # died while idle: never handed out
    assert st.idle == [] and st.handle(hs.WorkerWanted("r3")) == [hs.SpawnWorker("r3")]
    st.handle(hs.Stopping())
    assert st.handle(hs.PoolRefillDue()) == []  # a stopping host spawns nothing


def test_an_unknown_event_is_an_error() -> None:
    with pytest.raises(TypeError):
        _host().handle(object())  # type: ignore[arg-type]
