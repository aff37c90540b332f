"""Text-generation requests counted in tokens, and measured in the units users judge.

Issue 21 item 4. The controller's :class:`TokenLedger` follows every request of a
text-generation function from admission to its answer:

- **load in tokens** (:class:`~flashpoint.policy.snapshot.TokenLoad`, fed to the
  autoscaler every tick): each sequence counts its prompt (estimated from its bytes, the
  controller has no tokenizer) plus ``max_tokens`` while queued, and what it may still ask
  (``policy/token_load.outstanding_tokens``) once on a replica; arriving tokens per second;
  the peak tokens per second a replica of the function has served;
- **time to first token** (``flashpoint_ttft_seconds``, labelled ``start`` = ``warm`` or
  ``cold``): from the request's arrival at the controller, so a scale from zero is in it;
  for a streamed request the first ``gen_chunk`` that reached the controller, for a whole
  answer the worker's own first-token time after dispatch. A scale-from-zero request's
  TTFT is also broken into its cold-start phases (``flashpoint_ttft_phase_seconds``: the
  phases of ``controller/cold_timings.py`` before ``request``, then ``first_token``);
- **time per output token** (``flashpoint_tpot_seconds``): from the first token to the
  last over the tokens between them;
- **tokens**: ``flashpoint_generation_tokens_total`` (``kind`` = ``prompt`` /
  ``completion``, the counts the replica's tokenizer made), tokens per replica
  (``flashpoint_generation_replica_tokens_total``) and smoothed tokens/s per function and
  per replica (gauges).

The ledger reads no clock: callers pass ``now_s`` (``time.monotonic``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from flashpoint.controller.cold_timings import COLD_PHASES
from flashpoint.controller.state.rates import RateMeter
from flashpoint.policy.snapshot import TokenLoad
from flashpoint.tensors import EncodedTensor
from flashpoint.policy.token_load import (
    DEFAULT_MAX_TOKENS,
    estimate_prompt_tokens,
    outstanding_tokens,
    tpot_s,
)

TTFT = Histogram("flashpoint_ttft_seconds",
                 "Time to first token of a generation request from its arrival (cold starts in)",
                 ["function", "start"],
                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
TTFT_PHASES = Histogram("flashpoint_ttft_phase_seconds",
                        "A scale-from-zero generation request's time to first token by phase",
                        ["function", "phase"],
                        buckets=(.001, .01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60))
TPOT = Histogram("flashpoint_tpot_seconds", "Time per output token after the first",
                 ["function"], buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
TOKENS = Counter("flashpoint_generation_tokens_total",
                 "Tokens of answered generation requests, as the replica's tokenizer counted",
                 ["function", "kind"])
REPLICA_TOKENS = Counter("flashpoint_generation_replica_tokens_total",
                         "Tokens generated, by replica", ["function", "replica"])
OUTSTANDING = Gauge("flashpoint_generation_tokens_outstanding",
                    "Tokens generation requests may still ask (prompt + max_tokens)",
                    ["function", "where"])
TOKEN_RATE = Gauge("flashpoint_generation_tokens_per_second",
                   "Tokens generated per second, smoothed", ["function"])
REPLICA_TOKEN_RATE = Gauge("flashpoint_generation_replica_tokens_per_second",
                           "Tokens (prompt + generated) a replica served per second, smoothed",
                           ["function", "replica"])

# Phases of a cold TTFT: the scale from zero up to dispatch, then the wait for the token.
TTFT_COLD_PHASES = tuple(p for p in COLD_PHASES if p != "request")


@dataclass
class _Sequence:
    function: str
    prompt_tokens: int  # estimated until the answer says
    max_tokens: int
    arrived_s: float
    replica: str = ""  # "" = queued
    generated: int = 0  # tokens seen so far (streamed chunks)
    first_s: float | None = None  # first chunk's arrival
    last_s: float | None = None  # latest chunk's arrival


def request_shape(inputs: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """(estimated prompt tokens, max_tokens) of a generation request's inputs."""
    # A stand-alone gateway's inputs arrive still encoded (tensors.EncodedTensor): these few
    # small ones are decoded here, the rest go on to the worker untouched.
    inputs = {k: (v.decode() if isinstance(v, EncodedTensor) else v) for k, v in inputs.items()
              if k in ("text", "messages", "max_tokens")}
    size = 0
    for name in ("text", "messages"):
        arr = inputs.get(name)
        if arr is not None:
            for item in arr.reshape(-1):
                size += len(item) if isinstance(item, bytes | str) else 0
    mt = inputs.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS
    if mt is not None and mt.size == 1 and mt.dtype.kind in "iu":
        max_tokens = max(0, int(mt.reshape(-1)[0]))
    return estimate_prompt_tokens(size), max_tokens


class TokenLedger:
    """See the module docstring. One per controller."""

    def __init__(self, tau_s: float = 5.0) -> None:
        self._seqs: dict[str, _Sequence] = {}
        self._arrivals = RateMeter(tau_s)  # tokens (prompt + max_tokens) per function
        self._generated = RateMeter(tau_s)  # tokens generated per function
        self._served = RateMeter(tau_s)  # tokens (prompt + generated) per replica
        self._replica_fn: dict[str, str] = {}
        self._peak: dict[str, float] = {}  # function -> peak tokens/s of one replica
        self._loads: dict[str, TokenLoad] = {}
        self._replica_counters: dict[tuple[str, str], Any] = {}

    # -- one request -------------------------------------------------------------------
    def admitted(self, function: str, request_id: str, inputs: Mapping[str, np.ndarray],
                 now_s: float) -> None:
        """A generation request entered the queue."""
        prompt, max_tokens = request_shape(inputs)
        self._seqs[request_id] = _Sequence(function, prompt, max_tokens, now_s)
        self._arrivals.add(function, prompt + max_tokens)

    def sent(self, request_id: str, replica_id: str) -> None:
        """It went to ``replica_id`` (again, on a retry)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.replica = replica_id
            self._replica_fn[replica_id] = seq.function

    def chunk(self, request_id: str, index: int, token_id: int | None, now_s: float) -> None:
        """A streamed chunk arrived (chunks may arrive out of order; ``index`` from 0)."""
        seq = self._seqs.get(request_id)
        if seq is None or token_id is None:
            return
        if seq.first_s is None:
            seq.first_s = now_s
        seq.last_s = now_s if seq.last_s is None else max(seq.last_s, now_s)
        if index + 1 > seq.generated:
            self._count(seq, index + 1 - seq.generated)

    def relay(self, handler: Callable[[Any, dict[str, Any]], Awaitable[None]],
              clock: Callable[[], float]) -> Callable[[Any, dict[str, Any]], Awaitable[None]]:
        """``handler`` (the ``gen_chunk`` one) with every chunk noted here first."""
        async def on_chunk(conn: Any, payload: dict[str, Any]) -> None:
            index, token = payload.get("index"), payload.get("token_id")
            if isinstance(index, int) and (token is None or isinstance(token, int)):
                self.chunk(str(payload.get("request_id", "")), index, token, clock())
            await handler(conn, payload)
        return on_chunk

    def finished(self, request_id: str, outputs: Mapping[str, np.ndarray],
                 timings: Mapping[str, float], *, cold: bool, now_s: float) -> dict[str, float]:
        """It was answered: record its metrics; returns ``ttft`` and ``tpot`` (seconds) for
        its timings. ``timings``: the request's so far (``queue``, the worker's
        ``batch_wait`` and ``inference``, and the cold-start phases of a scale from zero)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None or "completion_tokens" not in outputs:
            return {}
        completion = int(outputs["completion_tokens"].reshape(-1)[0])
        prompt = int(outputs["prompt_tokens"].reshape(-1)[0]) if "prompt_tokens" in outputs \
            else seq.prompt_tokens
        if completion > seq.generated:
            self._count(seq, completion - seq.generated)
        if seq.replica:
            self._served.add(seq.replica, prompt)
        TOKENS.labels(seq.function, "prompt").inc(prompt)
        TOKENS.labels(seq.function, "completion").inc(completion)
        out: dict[str, float] = {}
        if seq.first_s is not None:  # streamed: the controller saw the tokens come
            ttft = seq.first_s - seq.arrived_s
            tpot = tpot_s(seq.first_s, seq.last_s or seq.first_s, seq.generated)
        elif completion > 0:  # whole answer: the worker timed its first token
            ttft = float(timings.get("queue", 0.0)) + float(timings.get("batch_wait", 0.0))
            tpot = (float(timings.get("inference", 0.0)) / (completion - 1)
                    if completion > 1 else None)
        else:
            return out
        out["ttft"] = ttft
        TTFT.labels(seq.function, "cold" if cold else "warm").observe(ttft)
        if tpot is not None:
            out["tpot"] = tpot
            TPOT.labels(seq.function).observe(tpot)
        if cold and "request" in timings:  # the scale from zero's phases, then the token
            before = sum(float(timings.get(p, 0.0)) for p in TTFT_COLD_PHASES)
            if ttft >= before:
                for phase in TTFT_COLD_PHASES:
                    TTFT_PHASES.labels(seq.function, phase).observe(float(timings.get(phase, 0.0)))
                TTFT_PHASES.labels(seq.function, "first_token").observe(ttft - before)
        return out

    def ended(self, request_id: str) -> None:
        """It left, answered or not (idempotent)."""
        self._seqs.pop(request_id, None)

    def _count(self, seq: _Sequence, n: int) -> None:
        seq.generated += n
        self._generated.add(seq.function, n)
        if seq.replica:
            self._served.add(seq.replica, n)
            key = (seq.function, seq.replica)
            counter = self._replica_counters.get(key)
            if counter is None:
                counter = self._replica_counters[key] = REPLICA_TOKENS.labels(*key)
            counter.inc(n)

    # -- per control step --------------------------------------------------------------
    def step(self, now_s: float) -> None:
        """Fold the counts into rates and refresh the loads and gauges (each tick)."""
        for meter in (self._arrivals, self._generated, self._served):
            meter.update(now_s)
        busy: dict[str, set[str]] = {}
        queued: dict[str, int] = {}
        inflight: dict[str, int] = {}
        sequences: dict[str, int] = {}
        for seq in self._seqs.values():
            fn = seq.function
            left = outstanding_tokens(seq.prompt_tokens, seq.max_tokens, seq.generated)
            sequences[fn] = sequences.get(fn, 0) + 1
            if seq.replica:
                inflight[fn] = inflight.get(fn, 0) + left
                busy.setdefault(fn, set()).add(seq.replica)
            else:
                queued[fn] = queued.get(fn, 0) + left
        for rid, fn in list(self._replica_fn.items()):
            rate = self._served.rate(rid)
            self._peak[fn] = max(self._peak.get(fn, 0.0), rate)
            if rate < 0.01 and rid not in busy.get(fn, ()):  # idle or gone: drop its series
                self._replica_fn.pop(rid)
                self._served.forget(rid)
                _remove(REPLICA_TOKEN_RATE, fn, rid)
            else:
                REPLICA_TOKEN_RATE.labels(fn, rid).set(rate)
        functions = set(self._loads) | set(sequences)
        self._loads = {}
        for fn in functions:
            load = TokenLoad(queued.get(fn, 0), inflight.get(fn, 0), self._arrivals.rate(fn),
                             self._peak.get(fn, 0.0), sequences.get(fn, 0))
            if load.arrival_token_rate > 0.01 or load.sequences:  # still a live series
                self._loads[fn] = load
            OUTSTANDING.labels(fn, "queued").set(load.queued_tokens)
            OUTSTANDING.labels(fn, "inflight").set(load.inflight_tokens)
            TOKEN_RATE.labels(fn).set(self._generated.rate(fn))

    def load(self, function: str) -> TokenLoad | None:
        """``function``'s token load as of the last :meth:`step`; None if it has had no
        generation request lately (not a generation function, or idle)."""
        return self._loads.get(function)

    def forget(self, function: str) -> None:
        """The function was deleted."""
        self._loads.pop(function, None)
        self._peak.pop(function, None)
        self._arrivals.forget(function)
        self._generated.forget(function)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass
