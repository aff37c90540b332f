"""Strict and best-effort (BE) requests: a worker's queue discipline and SLO compliance.

The two classes are PROTEAN's (seed 000, digest 000-protean.md §3 "SLO handling"):

- a **strict** request has a deadline, SLO = 3× the batch's execution time on a whole GPU
  (7g; 2× in the paper's "tight SLO" runs) — :func:`protean_slo_s`; a **BE** request has
  none. The class is the user's annotation;
- the reorderer puts strict requests **before** BE ones before batching. There is no EDF,
  no deadline-aware dropping and no admission control, and FIFO inside each class (the
  digest's reading; the paper says nothing else);
- **SLO compliance** = the share of *strict* requests finishing within their SLO; BE
  requests are judged by P50/P99 latency instead and never enter it.

Starvation: the paper gives BE **no bound**; :class:`ClassQueue` is therefore strict-first
*strictly*: a BE request waits as long as any strict request is queued. Under sustained
strict overload BE starves. That is the paper's trade: it reports BE tails under 200 ms on
its workloads and lists the BE tail cost of deprioritising as future work. Whoever wires
this in should watch BE queue age (``oldest_s``) rather than expect a guarantee from here.

Pure: no clock (arrival times are passed in), no I/O; the worker owns an instance.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from flashpoint.errors import BadRequest

T = TypeVar("T", bound=Hashable)


class RequestClass(StrEnum):
    STRICT = "strict"
    BEST_EFFORT = "best_effort"


def protean_slo_s(exec_full_gpu_s: float, factor: float = 3.0) -> float:
    """A strict request's SLO: ``factor`` × its batch's execution time on a whole GPU."""
    if not (math.isfinite(exec_full_gpu_s) and exec_full_gpu_s > 0 and factor > 0):
        raise BadRequest("SLO needs a positive execution time and factor")
    return factor * exec_full_gpu_s


class ClassQueue(Generic[T]):
    """One worker's queue: every strict item before any BE item, FIFO within a class.

    Items are the caller's (request ids, request objects): hashable and unique while queued,
    so a cancelled caller's request can leave the queue (:meth:`remove`). Arrival times are
    the caller's clock, kept only to report the oldest wait per class.
    """

    def __init__(self) -> None:
        self._queues: dict[RequestClass, deque[tuple[T, float]]] = {
            RequestClass.STRICT: deque(), RequestClass.BEST_EFFORT: deque()}
        self._where: dict[T, RequestClass] = {}

    def push(self, item: T, cls: RequestClass, arrived_s: float = 0.0) -> None:
        """Queue ``item`` at the back of its class."""
        if item in self._where:
            raise BadRequest(f"request {item!r} is already queued")
        self._queues[RequestClass(cls)].append((item, arrived_s))
        self._where[item] = RequestClass(cls)

    def pop(self) -> tuple[T, RequestClass] | None:
        """The next item and its class: the oldest strict one, else the oldest BE one."""
        for cls in (RequestClass.STRICT, RequestClass.BEST_EFFORT):
            q = self._queues[cls]
            if q:
                item, _ = q.popleft()
                del self._where[item]
                return item, cls
        return None

    def pop_batch(self, max_items: int) -> list[tuple[T, RequestClass]]:
        """Up to ``max_items`` in :meth:`pop` order: a batch fills with strict items first
        and tops up with BE ones (PROTEAN reorders *before* batching)."""
        out: list[tuple[T, RequestClass]] = []
        for _ in range(max(0, max_items)):
            nxt = self.pop()
            if nxt is None:
                break
            out.append(nxt)
        return out

    def peek(self) -> tuple[T, RequestClass] | None:
        for cls in (RequestClass.STRICT, RequestClass.BEST_EFFORT):
            if self._queues[cls]:
                return self._queues[cls][0][0], cls
        return None

    def remove(self, item: T) -> bool:
        """Take ``item`` out wherever it is (a cancelled caller); False if not queued.
        O(n) in its class, which is fine for a worker's queue."""
        cls = self._where.pop(item, None)
        if cls is None:
            return False
        q = self._queues[cls]
        for k, (it, _) in enumerate(q):
            if it == item:
                del q[k]
                return True
        raise AssertionError("index and queue disagree")  # unreachable: kept in step above

    def depth(self, cls: RequestClass | None = None) -> int:
        """Queued items of ``cls`` (all if None)."""
        return len(self._where) if cls is None else len(self._queues[cls])

    def oldest_s(self, cls: RequestClass) -> float | None:
        """Arrival time of the oldest queued item of ``cls``, None if none (starvation
        watch for BE)."""
        q = self._queues[cls]
        return q[0][1] if q else None

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: object) -> bool:
        return item in self._where


@dataclass(frozen=True)
class SloCompliance:
    """Strict requests that met and missed their SLO; BE requests never count."""

    met: int = 0
    missed: int = 0

    def record(self, cls: RequestClass, latency_s: float, slo_s: float) -> SloCompliance:
        """The counter after one finished request (``latency_s`` end to end, queueing
        included: t = t_cold + t_queue + t_exec). Meeting the SLO exactly counts as met."""
        if RequestClass(cls) is RequestClass.BEST_EFFORT:
            return self
        if not (math.isfinite(slo_s) and slo_s > 0):
            raise BadRequest("a strict request needs an SLO > 0")
        if math.isfinite(latency_s) and latency_s <= slo_s:
            return SloCompliance(self.met + 1, self.missed)
        return SloCompliance(self.met, self.missed + 1)  # NaN/inf latency = failed = missed

    def record_failure(self, cls: RequestClass) -> SloCompliance:
        """A strict request that failed or was dropped: it missed its SLO."""
        if RequestClass(cls) is RequestClass.BEST_EFFORT:
            return self
        return SloCompliance(self.met, self.missed + 1)

    @property
    def total(self) -> int:
        return self.met + self.missed

    @property
    def compliance(self) -> float | None:
        """met / total, None before any strict request finished (not 0 and not 1: no data)."""
        return self.met / self.total if self.total else None

    def __add__(self, other: SloCompliance) -> SloCompliance:
        """Counters of several workers or windows add up."""
        return SloCompliance(self.met + other.met, self.missed + other.missed)
