"""WorkerState with no network: each lifecycle of a worker (whole replica, pipeline stage and
its completion into a whole replica, KaaS executor) as events in and commands out, the
refusals as typed errors, and the ``replica_ready`` message it makes (checked against the
wire through the real frame codec)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashpoint.errors import BadRequest, Unavailable
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.controller_worker import ReplicaReady
from flashpoint.rpc import frames
from flashpoint.worker.state import (
    Announce,
    AwaitCompletion,
    BuildWhole,
    CompletionFailed,
    CompletionRequested,
    ConnectController,
    ControllerConnected,
    DropController,
    LoadFailed,
    LoadModule,
    LoadRequested,
    ReplicaCompleted,
    ReplicaKind,
    ReplicaLoaded,
    ReplyCompleted,
    ReplyLoaded,
    ReportServed,
    RequestAnswered,
    StageDissolved,
    StartServing,
    StartStageServer,
    WorkerPhase,
    WorkerState,
)

COLD = {"worker_prepare": 0.001, "load": 0.01, "to_device": 0.0, "first_inference": 0.02}


def _announced(st: WorkerState, now_s: float) -> ReplicaReady:
    """What the state sends on a connection that opened at ``now_s``."""
    [cmd] = st.handle(ControllerConnected(now_s))
    assert isinstance(cmd, Announce)
    return cmd.message


def _loaded(stage: tuple[int, int] | None = None, now_s: float = 10.0,
            kind: ReplicaKind = ReplicaKind.MODEL) -> ReplicaLoaded:
    return ReplicaLoaded("r1", "h1", "f", 4, dict(COLD), "local", now_s, kind=kind, stage=stage)


def test_whole_replica_connects_while_loading_then_serves_and_announces_once_timed():
    st = WorkerState()
    assert st.handle(LoadRequested("r1")) == [ConnectController(), LoadModule()]
    assert st.phase is WorkerPhase.LOADING and not st.announceable
    with pytest.raises(Unavailable):  # the actor waits for announceable; never early
        st.handle(ControllerConnected(1.0))
    # The connection is open already: serving starts, nothing reconnects.
    assert st.handle(_loaded(now_s=10.0)) == [StartServing()]
    assert st.phase is WorkerPhase.WARM and st.announceable
    first = _announced(st, 10.25)
    assert first == ReplicaReady(replica_id="r1", host_id="h1", function="f", credits=4,
                                 timings_s={**COLD, "announce": 0.25}, source="local",
                                 kind="model")
    # A reconnect announces again with the first announcement's phase, not a new one.
    assert _announced(st, 99.0).timings_s["announce"] == 0.25
    assert st.handle(RequestAnswered()) == [ReportServed()]
    assert st.handle(RequestAnswered()) == []  # the host is told once


def test_loads_are_idempotent_by_replica_id_and_refused_for_another():
    st = WorkerState()
    st.handle(LoadRequested("r1"))
    with pytest.raises(Unavailable):  # a retried call while the first still loads
        st.handle(LoadRequested("r1"))
    st.handle(_loaded())
    assert st.handle(LoadRequested("r1")) == [ReplyLoaded(dict(COLD))]
    with pytest.raises(BadRequest, match="another replica"):
        st.handle(LoadRequested("r2"))
    with pytest.raises(BadRequest, match="another replica"):  # same id, other kind
        st.handle(LoadRequested("r1", ReplicaKind.KAAS))


def test_a_failed_load_drops_the_connection_opened_for_it_and_frees_the_worker():
    st = WorkerState()
    st.handle(LoadRequested("r1"))
    assert st.handle(LoadFailed()) == [DropController()]
    assert st.phase is WorkerPhase.IDLE and not st.controller
    assert st.handle(LoadRequested("r2")) == [ConnectController(), LoadModule()]


def test_pipeline_stage_completes_into_a_whole_replica_then_announces():
    st = WorkerState()
    assert st.handle(LoadRequested("r1", pipeline=True)) == [LoadModule()]  # no controller
    assert st.handle(_loaded(stage=(0, 3), now_s=5.0)) == [StartStageServer()]
    assert st.phase is WorkerPhase.STAGE and not st.announceable and st.stage == (0, 3)
    assert st.handle(CompletionRequested()) == [BuildWhole()]
    assert st.handle(CompletionRequested()) == [AwaitCompletion()]  # one build at a time
    done = {"complete_load": 0.5, "complete_to_device": 0.0, "complete_first_inference": 0.1}
    # Its first announcement: the batcher starts and the controller connection opens.
    assert st.handle(ReplicaCompleted(done, now_s=7.0)) == [StartServing(), ConnectController()]
    assert st.phase is WorkerPhase.WARM and st.stage is None and st.announceable
    ready = _announced(st, 7.5)
    assert ready.timings_s == {**COLD, **done, "announce": 2.5}  # from the stage's load
    assert st.handle(CompletionRequested()) == [ReplyCompleted({})]  # whole: at once
    assert st.handle(StageDissolved()) == [] and not st.pipeline


def test_stage_without_pipeline_serves_at_once_and_reannounces_when_whole():
    st = WorkerState()
    assert st.handle(LoadRequested("r1")) == [ConnectController(), LoadModule()]
    assert st.handle(_loaded(stage=(0, 1), now_s=10.0)) == [StartServing()]
    assert st.phase is WorkerPhase.STAGE and st.announceable
    assert _announced(st, 10.5).timings_s == {**COLD, "announce": 0.5}
    st.handle(CompletionRequested())
    [cmd] = st.handle(ReplicaCompleted({"complete_load": 0.1}, now_s=12.0))
    assert cmd == Announce(ReplicaReady(  # the same replica, whole now, its phases grown
        replica_id="r1", host_id="h1", function="f", credits=4, source="local",
        timings_s={**COLD, "announce": 0.5, "complete_load": 0.1}))


def test_a_failed_completion_leaves_a_working_stage_that_may_try_again():
    st = WorkerState()
    st.handle(LoadRequested("r1", pipeline=True))
    st.handle(_loaded(stage=(0, 1)))
    assert st.handle(CompletionRequested()) == [BuildWhole()]
    assert st.handle(CompletionFailed()) == []
    assert st.phase is WorkerPhase.STAGE
    assert st.handle(CompletionRequested()) == [BuildWhole()]


@pytest.mark.parametrize("setup", ["idle", "loading", "kaas"])
def test_completion_needs_a_loaded_model(setup):
    st = WorkerState()
    if setup == "loading":
        st.handle(LoadRequested("r1"))
    elif setup == "kaas":
        st.handle(LoadRequested("k1", ReplicaKind.KAAS))
        st.handle(_loaded(kind=ReplicaKind.KAAS))
    with pytest.raises(Unavailable):
        st.handle(CompletionRequested())


def test_kaas_executor_connects_once_built_and_announces_its_kind():
    st = WorkerState()
    assert st.handle(LoadRequested("k1", ReplicaKind.KAAS)) == [LoadModule()]
    loaded = ReplicaLoaded("k1", "h1", "__kaas__", 1, {"load": 0.3}, "kaas", 0.0,
                           kind=ReplicaKind.KAAS)
    assert st.handle(loaded) == [ConnectController()]
    assert st.phase is WorkerPhase.KAAS and st.announceable
    ready = _announced(st, 50.0)
    assert ready.kind == "kaas" and ready.timings_s == {"load": 0.3}  # no announce phase
    assert st.handle(LoadRequested("k1", ReplicaKind.KAAS)) == [ReplyLoaded({"load": 0.3})]


def test_the_announcement_survives_the_frame_codec_under_its_wire_names():
    st = WorkerState()
    st.handle(LoadRequested("r1"))
    st.handle(_loaded(now_s=1.0))
    msg = _announced(st, 1.5)
    wire = frames.encode(frames.Request(id=3, method="replica_ready", payload=to_payload(msg),
                                        timeout_s=10.0))
    payload = frames.decode(wire).payload
    assert set(payload) == {"replica_id", "host_id", "function", "credits", "timings_s",
                            "source", "kind"}
    assert from_payload(ReplicaReady, payload, method="replica_ready") == msg


def test_not_an_event_is_a_type_error():
    with pytest.raises(TypeError):
        WorkerState().handle(object())  # type: ignore[arg-type]


def test_the_state_module_loads_no_io():
    """Pure: importing it pulls in no asyncio, network, torch or actor code (STYLE §1)."""
    code = ("import sys, flashpoint.worker.state\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('asyncio', 'aiohttp', 'torch', 'pynvml') or m.startswith('flashpoint.rpc') "
            "or m in ('flashpoint.worker.actor', 'flashpoint.worker.batcher', "
            "'flashpoint.worker.loading')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
