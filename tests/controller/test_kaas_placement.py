"""ControllerState keeps ``kaas_replicas`` KaaS executor replicas placed (pure, no I/O)."""

from __future__ import annotations

from flashpoint.controller.state.events import (
    DeployKaas,
    ForgetReplica,
    FunctionUpserted,
    HostHeartbeat,
    ReplicaFailed,
    ReplicaWarmed,
    StopReplica,
    Tick,
)
from flashpoint.controller.state.records import MAX_CONSECUTIVE_START_FAILURES, ReplicaPhase
from flashpoint.kaas import KAAS_FUNCTION

from .test_controller_state import GIB, MIB, new_state, of, register, spec


def test_places_the_wanted_executors_once_and_accounts_their_memory():
    st = new_state(kaas_replicas=2, kaas_cache_bytes=512 * MIB)
    register(st, "h1", mem=4 * GIB)
    register(st, "h2", mem=4 * GIB)
    deploys = of(st.handle(Tick(1.0, {})), DeployKaas)
    assert len(deploys) == 2 and {d.host_id for d in deploys} == {"h1", "h2"}
    assert all(d.cache_bytes == 512 * MIB and d.device_bytes == 512 * MIB for d in deploys)
    assert of(st.handle(Tick(1.1, {})), DeployKaas) == []  # starting ones count
    free = {d.host_id: d.memory_free_bytes for h in st.snapshot(1.2).hosts for d in h.devices}
    assert free == {"h1": 3584 * MIB, "h2": 3584 * MIB}
    assert {r.function for r in st.replicas.values()} == {KAAS_FUNCTION}


def test_model_replicas_share_the_device_memory_ledger():
    st = new_state(kaas_replicas=1, kaas_cache_bytes=3 * GIB)
    register(st, "h1", mem=4 * GIB)
    st.handle(Tick(1.0, {}))
    st.handle(FunctionUpserted(spec("fn", min_replicas=1), 2 * GIB))
    cmds = st.handle(Tick(2.0, {}))
    assert [c for c in cmds if type(c).__name__ == "DeployReplica"] == []  # no room left
    assert st.functions["fn"].unplaced


def test_lost_executor_is_replaced_and_repeated_start_failures_stop_the_retries():
    st = new_state(kaas_replicas=1)
    register(st, "h1")
    (d,) = of(st.handle(Tick(1.0, {})), DeployKaas)
    st.handle(ReplicaWarmed(d.replica_id, {}, 1.5))
    assert st.replicas[d.replica_id].phase == ReplicaPhase.WARM
    assert ForgetReplica(d.replica_id) in st.handle(ReplicaFailed(d.replica_id, "died", False))
    rid = d.replica_id
    for i in range(MAX_CONSECUTIVE_START_FAILURES):
        (d,) = of(st.handle(Tick(2.0 + i, {})), DeployKaas)
        assert d.replica_id != rid
        st.handle(ReplicaFailed(d.replica_id, "no CUDA", during_start=True))
    assert st.kaas_broken == "no CUDA"
    assert of(st.handle(Tick(10.0, {})), DeployKaas) == []


def test_a_restarted_controller_adopts_running_executors():
    st = new_state(kaas_replicas=1)
    register(st, "h1", replicas=[("_kaas-old1", KAAS_FUNCTION, "cpu:0", True)])
    assert st.replicas["_kaas-old1"].phase == ReplicaPhase.WARM
    assert of(st.handle(Tick(1.0, {})), DeployKaas) == []
    # Without KaaS configured, the same report is an unknown replica: stopped.
    st2 = new_state()
    cmds = register(st2, "h1", replicas=[("_kaas-old1", KAAS_FUNCTION, "cpu:0", True)])
    assert StopReplica("_kaas-old1", "h1") in cmds
    assert of(st2.handle(HostHeartbeat("h1", frozenset(), 1.0, frozenset())), DeployKaas) == []


def test_config_checks_the_kaas_fields():
    import pytest

    from flashpoint.config import load_config
    from flashpoint.errors import BadRequest

    assert load_config(overrides={"controller": {"kaas_workers": 2}}).controller.kaas_workers == 2
    for bad in ({"kaas_policy": "nope"}, {"kaas_workers": -1}, {"kaas_cache_bytes": 0}):
        with pytest.raises(BadRequest):
            load_config(overrides={"controller": bad})
