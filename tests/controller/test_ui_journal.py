"""The dashboard's journal (controller/ui_journal.py): latency quantiles against numpy's,
a bounded memory, scaling decisions recorded when they change something, the first
request's cold-start breakdown per replica, and chains with whether they still run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from flashpoint.controller.state.events import DeployReplica, StartChain
from flashpoint.controller.ui_journal import UiJournal, quantile
from flashpoint.spec import FunctionSpec


@dataclass
class Fn:
    desired: int = 0
    reason: str = ""


@dataclass
class FakeState:
    """The few ControllerState fields the journal reads."""

    functions: dict[str, Fn] = field(default_factory=dict)
    replicas: dict[str, Any] = field(default_factory=dict)
    hosts: dict[str, Any] = field(default_factory=dict)
    inbound: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_quantile_is_numpys_nearest_rank(n: int, q: float) -> None:
    values = sorted(np.random.default_rng(n).exponential(size=n).tolist())
    assert quantile(values, q) == pytest.approx(np.quantile(values, q, method="inverted_cdf"))


def test_request_window_rate_and_tails() -> None:
    j = UiJournal(window_s=10.0)
    lat = np.linspace(0.001, 0.1, 50)
    for i, v in enumerate(lat):
        j.request_done("f", float(v), now_s=100.0 + i * 0.1)  # 50 requests over 5 s
    r = j.view(FakeState(), now_s=105.0)["requests"]["f"]
    assert r["count"] == 50 and r["rate_per_s"] == pytest.approx(10.0)
    assert r["p50_s"] == pytest.approx(np.quantile(lat, 0.5, method="inverted_cdf"), abs=1e-6)
    assert r["p99_s"] == pytest.approx(np.quantile(lat, 0.99, method="inverted_cdf"), abs=1e-6)
    # past the window the function's requests are forgotten
    assert j.view(FakeState(), now_s=120.0)["requests"] == {}


def test_decisions_are_recorded_when_they_change_something() -> None:
    j, st = UiJournal(max_entries=5), FakeState(functions={"f": Fn()})
    j.observe([], st, 1.0)  # registered, nothing decided: nothing to show
    assert j.view(st, 1.0)["decisions"] == []
    st.functions["f"] = Fn(1, "demand")
    spec = FunctionSpec(name="f", model="noop")
    j.observe([DeployReplica("r1", "h0", "cpu:0", spec)], st, 2.0)
    j.observe([], st, 3.0)  # same decision again: not repeated
    (d,) = j.view(st, 4.0)["decisions"]
    assert d == {"function": "f", "desired": 1, "previous": 0, "reason": "demand",
                 "actions": ["deploy r1 on h0/cpu:0"], "age_s": 2.0}
    for i in range(10):  # bounded, newest first
        st.functions["f"] = Fn(i + 2, f"step {i}")
        j.observe([], st, 5.0 + i)
    decisions = j.view(st, 20.0)["decisions"]
    assert len(decisions) == 5 and decisions[0]["reason"] == "step 9"


def test_cold_starts_keep_the_first_request_and_stay_bounded() -> None:
    j = UiJournal(max_entries=3)
    j.cold_start("r1", "f", "registry", {"decision": 0.1, "load": 0.2, "queue": 9.0}, 1.0)
    j.cold_start("r1", "f", "local", {"load": 5.0}, 2.0)  # a later request: not its start
    (c,) = j.view(FakeState(), 3.0)["cold_starts"]
    assert c == {"replica_id": "r1", "function": "f", "source": "registry",
                 "phases_s": {"decision": 0.1, "load": 0.2}, "age_s": 2.0}
    for i in range(2, 6):
        j.cold_start(f"r{i}", "f", "local", {"load": 1.0}, float(i))
    assert [c["replica_id"] for c in j.view(FakeState(), 9.0)["cold_starts"]] == [
        "r5", "r4", "r3"]


def test_chains_say_whether_they_still_run() -> None:
    j, st = UiJournal(), FakeState()
    j.observe([StartChain("t1", "h0", "bert", "1", ("h1", "h2"))], st, 1.0)
    st.inbound[("h2", "bert@1")] = ("t1", "h0")
    (c,) = j.view(st, 2.0)["chains"]
    assert (c["sender"], c["receivers"], c["model_key"], c["active"]) == (
        "h0", ["h1", "h2"], "bert@1", True)
    st.inbound.clear()
    assert j.view(st, 3.0)["chains"][0]["active"] is False
