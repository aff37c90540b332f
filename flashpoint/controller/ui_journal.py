"""What the operator's dashboard (``/ui``) shows that the controller's state does not keep.

The state classes hold the present (replicas, hosts, the autoscaler's last decision); the
dashboard also wants a little recent history, which this journal records and nothing
decides on:

- per function, the latencies of the requests of the last ``window_s`` (request rate,
  p50 and p99);
- the scaling decisions that changed something (the planned count moved, or replicas were
  deployed or stopped), each with the autoscaler's reason at that moment;
- the full cold-start breakdown (controller/cold_timings.py) of the request that waited
  for each replica's start, and where its bytes came from;
- the peer chains the controller started (sender, then receivers in chain order).

Every collection is bounded (``max_entries``), so a long-running controller holds a fixed
amount. No clock is read here: every method takes ``now_s`` (the controller's
``time.monotonic``), and :meth:`view` reports ages, never timestamps.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashpoint.controller.cold_timings import COLD_PHASES
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import DeployReplica, StartChain, StopReplica
from flashpoint.ids import ModelKey

# How many latencies a function keeps: enough for a p99 over a busy minute, bounded memory.
MAX_LATENCIES = 4096


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile of ascending ``sorted_values`` (nearest rank); 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.999999) - 1))
    return sorted_values[rank]


@dataclass
class UiJournal:
    """Bounded recent history for the dashboard; see the module docstring."""

    window_s: float = 60.0
    max_entries: int = 100
    _latencies: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _decisions: deque[dict[str, Any]] = field(default_factory=deque)
    _desired: dict[str, int] = field(default_factory=dict)
    _cold: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    _chains: deque[dict[str, Any]] = field(default_factory=deque)

    # -- recording ---------------------------------------------------------------------
    def request_done(self, function: str, latency_s: float, now_s: float) -> None:
        """One request of ``function`` answered after ``latency_s``."""
        window = self._latencies.get(function)
        if window is None:
            window = self._latencies[function] = deque(maxlen=MAX_LATENCIES)
        window.append((now_s, latency_s))

    def cold_start(self, replica_id: str, function: str, source: str,
                   timings_s: Mapping[str, float], now_s: float) -> None:
        """The request that waited for ``replica_id``'s start: its phases (the keys of
        COLD_PHASES it has, plus ``fetch``) and where the model's bytes came from."""
        if replica_id in self._cold:
            return  # the first request's breakdown is the replica's cold start
        phases = {k: round(float(timings_s[k]), 6) for k in (*COLD_PHASES, "fetch")
                  if k in timings_s}
        self._cold[replica_id] = {"replica_id": replica_id, "function": function,
                                  "source": source, "phases_s": phases, "at_s": now_s}
        while len(self._cold) > self.max_entries:
            self._cold.popitem(last=False)

    def observe(self, cmds: Iterable[Any], state: ControllerState, now_s: float) -> None:
        """One control step's commands: record chains, and the scaling decisions that
        changed the planned count or deployed or stopped replicas."""
        changed: dict[str, list[str]] = {}
        for cmd in cmds:
            match cmd:
                case DeployReplica():
                    changed.setdefault(cmd.spec.name, []).append(
                        f"deploy {cmd.replica_id} on {cmd.host_id}/{cmd.device_id}")
                case StopReplica():
                    rep = state.replicas.get(cmd.replica_id)
                    if rep is not None:
                        changed.setdefault(rep.function, []).append(f"stop {cmd.replica_id}")
                case StartChain():
                    self._push(self._chains, {
                        "transfer_id": cmd.transfer_id, "sender": cmd.sender,
                        "model_key": ModelKey.of(cmd.model, cmd.version),
                        "receivers": list(cmd.receivers), "at_s": now_s})
        for name, fn in state.functions.items():
            if name not in self._desired and fn.desired == 0 and name not in changed:
                self._desired[name] = 0  # newly registered, nothing decided yet
                continue
            if self._desired.get(name) != fn.desired or name in changed:
                self._push(self._decisions, {
                    "function": name, "desired": fn.desired,
                    "previous": self._desired.get(name), "reason": fn.reason,
                    "actions": changed.get(name, []), "at_s": now_s})
                self._desired[name] = fn.desired
        for name in [n for n in self._desired if n not in state.functions]:
            del self._desired[name]

    def _push(self, log: deque[dict[str, Any]], entry: dict[str, Any]) -> None:
        log.append(entry)
        while len(log) > self.max_entries:
            log.popleft()

    # -- the view -----------------------------------------------------------------------
    def view(self, state: ControllerState, now_s: float) -> dict[str, Any]:
        """Plain data for ``cluster_status()["ui"]``: the journal, and what the state knows
        that the status does not list (replica memory, drain deadlines, GPU geometry)."""
        inbound = {tid for tid, _sender in state.inbound.values()}
        return {
            "requests": self._requests(now_s),
            "decisions": [_aged(d, now_s) for d in reversed(self._decisions)],
            "cold_starts": [_aged(c, now_s) for c in reversed(self._cold.values())],
            "chains": [{**_aged(c, now_s), "active": c["transfer_id"] in inbound}
                       for c in reversed(self._chains)],
            "replicas": {r.replica_id: {"device_bytes": r.device_bytes,
                                        "model_key": r.model_key,
                                        "age_s": round(now_s - r.requested_s, 3)}
                         for r in state.replicas.values()},
            "hosts": {h.host_id: {
                "ram_bytes": h.ram_bytes, "leaf": h.leaf, "gpu_sharing": h.gpu_sharing,
                "drain_in_s": (round(h.drain_deadline_s - now_s, 3)
                               if h.drain_deadline_s is not None else None),
                "gpus": [{"gpu_index": g.gpu_index, "model": g.model, "mig": g.mig}
                         for g in h.gpus],
                "devices": {d.device_id: {"gpu_index": d.gpu_index,
                                          "mig_profile": d.mig_profile}
                            for d in h.devices.values()}}
                for h in state.hosts.values()},
        }

    def _requests(self, now_s: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name, window in list(self._latencies.items()):
            while window and window[0][0] < now_s - self.window_s:
                window.popleft()
            if not window:
                del self._latencies[name]
                continue
            lat = sorted(v for _t, v in window)
            span_s = max(1.0, min(self.window_s, now_s - window[0][0]))
            out[name] = {"count": len(lat), "rate_per_s": round(len(lat) / span_s, 3),
                         "p50_s": round(quantile(lat, 0.50), 6),
                         "p99_s": round(quantile(lat, 0.99), 6)}
        return out


def _aged(entry: dict[str, Any], now_s: float) -> dict[str, Any]:
    """``entry`` with its monotonic ``at_s`` as an age (clocks differ between processes)."""
    out = {k: v for k, v in entry.items() if k != "at_s"}
    out["age_s"] = round(now_s - entry["at_s"], 3)
    return out
