"""Scaling generation on tokens (policy/token_load.py) and the controller's token ledger
(controller/token_metrics.py), driven with hand-computed loads and a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from flashpoint.controller.token_metrics import TOKENS, TPOT, TTFT, TokenLedger, request_shape
from flashpoint.errors import BadRequest
from flashpoint.policy.autoscale import make_autoscaler
from flashpoint.policy.snapshot import FunctionLoadSnapshot, TokenLoad
from flashpoint.policy.token_load import (
    DEFAULT_MAX_TOKENS,
    TokensParams,
    estimate_prompt_tokens,
    outstanding_tokens,
    tokens,
    tpot_s,
)


def ld(tok: TokenLoad | None = None, **kw) -> FunctionLoadSnapshot:
    base = dict(name="g", now_s=100.0, queued=0, inflight=0, replicas_warm=1,
                replicas_starting=0, last_request_s=99.0, min_replicas=0, max_replicas=100,
                replica_concurrency=16, keep_alive_s=30.0, tokens=tok)
    base.update(kw)
    return FunctionLoadSnapshot(**base)


def test_helpers():
    assert estimate_prompt_tokens(0) == 1 and estimate_prompt_tokens(4) == 1
    assert estimate_prompt_tokens(5) == 2 and estimate_prompt_tokens(400) == 100
    assert outstanding_tokens(10, 20, 0) == 30  # prompt until the first token
    assert outstanding_tokens(10, 20, 5) == 15
    assert outstanding_tokens(10, 20, 25) == 0
    assert tpot_s(1.0, 2.0, 5) == pytest.approx(0.25)
    assert tpot_s(1.0, 1.0, 1) is None and tpot_s(2.0, 1.0, 3) is None


def test_tokens_scales_on_outstanding_work_and_arrivals():
    params = TokensParams(replica_tokens_per_s=100.0, drain_s=2.0, target_utilisation=0.5)
    # 3 sequences, 1000 tokens outstanding: 1000 / (100 * 2) = 5, capped at 3 sequences
    p, _ = tokens(ld(TokenLoad(400, 600, 0.0, 0.0, 3), queued=1, inflight=2), params, None)
    assert p.desired == 3 and p.reason.startswith("tokens:1000tok")
    # 8 sequences: 5 replicas drain it in 2 s
    p, _ = tokens(ld(TokenLoad(400, 600, 0.0, 0.0, 8), inflight=8), params, None)
    assert p.desired == 5
    # arrivals: 160 tok/s at 50 % of 100 tok/s per replica = 4 (sequences cap at 8)
    p, _ = tokens(ld(TokenLoad(0, 100, 160.0, 0.0, 8), inflight=8), params, None)
    assert p.desired == 4
    # the concurrency rule is the floor: 40 requests at 16 each = 3
    p, _ = tokens(ld(TokenLoad(0, 10, 0.0, 0.0, 40), inflight=40), params, None)
    assert p.desired == 3 and p.reason == "tokens:concurrency"


def test_tokens_capacity_measured_or_unknown():
    tok = TokenLoad(0, 900, 0.0, 150.0, 6)  # a replica was seen serving 150 tok/s
    p, _ = tokens(ld(tok, inflight=6), TokensParams(drain_s=2.0), None)
    assert p.desired == 3  # 900 / (150 * 2)
    p, _ = tokens(ld(TokenLoad(0, 900, 0.0, 0.0, 6), inflight=6), TokensParams(), None)
    assert p.desired == 1 and p.reason == "tokens:unprofiled"
    p, _ = tokens(ld(None, inflight=20), TokensParams(replica_tokens_per_s=1.0), None)
    assert p.desired == 2 and p.reason == "tokens:no-token-load"


def test_tokens_plugin_behind_the_wrapper():
    a = make_autoscaler("tokens", {"replica_tokens_per_s": 50, "drain_s": 1})
    d, _ = a.decide(ld(TokenLoad(0, 300, 0.0, 0.0, 4), inflight=4, max_replicas=2))
    assert d.desired == 2 and d.reason.endswith("+bounds")
    with pytest.raises(BadRequest):
        make_autoscaler("tokens", {"drain_s": 0})
    with pytest.raises(BadRequest):
        TokensParams(target_utilisation=1.5)


def _text(s: str, max_tokens: int | None = None) -> dict[str, np.ndarray]:
    out = {"text": np.array([s.encode()], dtype=object)}
    if max_tokens is not None:
        out["max_tokens"] = np.array([max_tokens], dtype=np.int64)
    return out


def _answer(prompt: int, completion: int) -> dict[str, np.ndarray]:
    return {"prompt_tokens": np.array([prompt], dtype=np.int64),
            "completion_tokens": np.array([completion], dtype=np.int64)}


def _sample(metric, name: str, labels: dict[str, str]) -> float:
    for fam in metric.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_request_shape():
    assert request_shape(_text("x" * 40, 7)) == (10, 7)
    assert request_shape(_text("abc")) == (1, DEFAULT_MAX_TOKENS)


def test_request_shape_of_inputs_a_standalone_gateway_forwards_encoded():
    from flashpoint.tensors import check_encoded_tensors, encode_tensors

    forwarded = check_encoded_tensors(encode_tensors(_text("x" * 40, 7)))
    assert request_shape(forwarded) == (10, 7)


def test_ledger_streamed_request():
    fn = "ledger-stream"
    led = TokenLedger(tau_s=1.0)
    led.step(0.0)
    led.admitted(fn, "r1", _text("x" * 40, 5), 10.0)  # ~10 prompt + 5
    led.step(10.0)
    assert led.load(fn) == TokenLoad(15, 0, led.load(fn).arrival_token_rate, 0.0, 1)
    led.sent("r1", "rep-a")
    led.step(10.1)
    assert led.load(fn).inflight_tokens == 15 and led.load(fn).queued_tokens == 0
    # chunks 0..4 at 10.5, 10.6, ... (index 2 overtakes index 1)
    for index, at in ((0, 10.5), (2, 10.7), (1, 10.6), (3, 10.8), (4, 10.9)):
        led.chunk("r1", index, 100 + index, at)
    led.step(11.0)
    assert led.load(fn).inflight_tokens == 0 and led.load(fn).replica_token_rate > 0
    out = led.finished("r1", _answer(12, 5), {}, cold=False, now_s=11.0)
    assert out["ttft"] == pytest.approx(0.5) and out["tpot"] == pytest.approx(0.1)
    assert _sample(TOKENS, "flashpoint_generation_tokens_total",
                   {"function": fn, "kind": "prompt"}) == 12
    assert _sample(TOKENS, "flashpoint_generation_tokens_total",
                   {"function": fn, "kind": "completion"}) == 5
    assert _sample(TTFT, "flashpoint_ttft_seconds_count", {"function": fn, "start": "warm"}) == 1
    assert _sample(TPOT, "flashpoint_tpot_seconds_sum", {"function": fn}) == pytest.approx(0.1)
    led.step(11.1)
    assert led.load(fn).sequences == 0


def test_ledger_whole_answer_and_cold_phases():
    fn = "ledger-whole"
    led = TokenLedger()
    led.admitted(fn, "r2", _text("hello", 4), 0.0)
    led.sent("r2", "rep-b")
    timings = {"queue": 2.0, "batch_wait": 0.25, "inference": 0.3, "decision": 0.1,
               "placement": 0.1, "obtain": 1.0, "ready_to_dispatch": 0.5, "request": 0.55}
    out = led.finished("r2", _answer(3, 4), timings, cold=True, now_s=2.55)
    assert out == {"ttft": pytest.approx(2.25), "tpot": pytest.approx(0.1)}
    assert _sample(TTFT, "flashpoint_ttft_seconds_count", {"function": fn, "start": "cold"}) == 1
    from flashpoint.controller.token_metrics import TTFT_PHASES

    assert _sample(TTFT_PHASES, "flashpoint_ttft_phase_seconds_sum",
                   {"function": fn, "phase": "first_token"}) == pytest.approx(2.25 - 1.7)
    # a request that failed leaves no trace
    led.admitted(fn, "r3", _text("hello"), 3.0)
    led.ended("r3")
    assert led.finished("r3", _answer(1, 1), {}, cold=False, now_s=4.0) == {}


def test_controller_state_hands_the_token_load_to_the_autoscaler():
    from flashpoint.controller.state.core import ControllerState
    from flashpoint.controller.state.events import (
        DeployReplica,
        DeviceRecord,
        FunctionLoad,
        FunctionUpserted,
        HostRegistered,
        Tick,
    )
    from flashpoint.spec import FunctionSpec

    st = ControllerState(heartbeat_timeout_s=60.0, replica_overhead_bytes=0,
                         autoscaler=make_autoscaler("tokens", {"replica_tokens_per_s": 100,
                                                               "drain_s": 1}))
    devs = tuple(DeviceRecord(f"cpu:{i}", "cpu", 4 << 30) for i in range(8))
    st.handle(HostRegistered("h1", devs, 16 << 30, frozenset(), (), 0.0))
    st.handle(FunctionUpserted(FunctionSpec(name="g", model="m", max_replicas=8), 10 << 20))
    # 4 requests: the concurrency rule wants 1 replica (16 each); 350 tokens at 100 tok/s
    # per replica, drained within 1 s, want 4
    tok = TokenLoad(350, 0, 0.0, 0.0, 4)
    cmds = st.handle(Tick(1.0, {"g": FunctionLoad(4, 0, 1.0, tokens=tok)}))
    assert len([c for c in cmds if isinstance(c, DeployReplica)]) == 4
    assert st.functions["g"].reason.startswith("tokens:350tok")
    # the same load without tokens: the concurrency rule, one replica
    st.handle(FunctionUpserted(FunctionSpec(name="h", model="m", max_replicas=8), 10 << 20))
    cmds = st.handle(Tick(1.1, {"h": FunctionLoad(4, 0, 1.1)}))
    assert len([c for c in cmds if isinstance(c, DeployReplica) and c.spec.name == "h"]) == 1
