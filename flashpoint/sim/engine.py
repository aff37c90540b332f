"""A discrete-event engine on a binary heap of ``(time, seq, handle)`` entries.

Events are plain callbacks: the simulator feeds stimuli to the same state classes the actors
use (STYLE.md §1, §11), so an event is "call this method at this time", not a coroutine.

Why our own heap rather than SimPy (the thesis's stack, seed 004 §6):

* **Determinism we can state in one line.** Events at the same time run in the order they
  were scheduled (``seq`` is a counter that only grows), whatever the callbacks are.
* **Cancellation.** Flow-level networks reschedule their next completion on every change;
  a SimPy ``Timeout`` cannot be withdrawn, only outrun with interrupts or condition events.
  Here ``engine.cancel(handle)`` is O(1) (lazy deletion) and the heap is compacted when cancelled
  entries dominate it, so it cannot grow without bound.
* **Cost and weight.** One tuple and one small object per event, no generator resumption,
  no dependency. ``bench/sim_engine.py`` measures events/s (and SimPy's, where installed;
  it was not on the dev box). There, on two shared cores: ~0.4 M events/s with 1,000
  self-rescheduling timers; with 1 M events pending at once the run is bound by ``heapq``
  itself (popping 1 M bare tuples takes ~90% of our time), a floor SimPy shares, since it
  keeps the same kind of heap of ``(time, priority, id, event)`` tuples.

Times are floats in seconds (``now_s``). The engine never reads a wall clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Final

__all__ = ["Engine", "EventHandle", "EventLimitExceeded", "DEFAULT_MAX_EVENTS"]

Callback = Callable[[], None]

#: Per ``run()`` call. A runaway simulation (a callback that reschedules itself at zero delay
#: forever) stops with an error instead of hanging a test or a sweep.
DEFAULT_MAX_EVENTS: Final = 50_000_000

#: Compact the heap when it holds at least this many entries and most of them are cancelled.
_COMPACT_MIN_ENTRIES: Final = 1024


class EventLimitExceeded(RuntimeError):
    """``run()`` would process more than ``max_events`` events: the simulation is runaway.

    A simulator bug, not a cluster error, hence not in :mod:`flashpoint.errors`. The engine
    stays consistent: the event that would have exceeded the limit is still queued.
    """


class EventHandle:
    """A scheduled event; pass it to :meth:`Engine.cancel` to withdraw it before it runs."""

    __slots__ = ("at_s", "seq", "_fn")

    def __init__(self, at_s: float, seq: int, fn: Callback) -> None:
        self.at_s = at_s
        self.seq = seq
        # None once the event has run or been cancelled: one field, no separate state enum.
        self._fn: Callback | None = fn

    @property
    def pending(self) -> bool:
        """True until the event runs or is cancelled."""
        return self._fn is not None

    def __repr__(self) -> str:
        return f"EventHandle(at_s={self.at_s!r}, seq={self.seq}, pending={self.pending})"


class Engine:
    """Discrete-event loop: ``schedule`` callbacks, then ``run`` them in (time, seq) order.

    Callbacks take no arguments (bind them with a lambda or ``functools.partial``) and may
    schedule or cancel further events, including at the current time.
    """

    def __init__(self, start_s: float = 0.0, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if not math.isfinite(start_s):
            raise ValueError(f"start_s must be finite, got {start_s!r}")
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._now_s = float(start_s)
        self.max_events = max_events
        self._heap: list[tuple[float, int, EventHandle]] = []
        self._seq = 0
        self._cancelled_in_heap = 0
        self._processed = 0

    # --- clock and counters --------------------------------------------------------------

    @property
    def now_s(self) -> float:
        """Simulated time of the event being run, or where the last ``run()`` stopped."""
        return self._now_s

    @property
    def events_processed(self) -> int:
        """Events run since the engine was created (cancelled ones are not counted)."""
        return self._processed

    @property
    def pending(self) -> int:
        """Events scheduled and neither run nor cancelled."""
        return len(self._heap) - self._cancelled_in_heap

    @property
    def heap_entries(self) -> int:
        """Heap size including cancelled entries not yet dropped (a memory diagnostic)."""
        return len(self._heap)

    def peek_s(self) -> float:
        """Time of the next pending event, or ``inf`` when there is none."""
        self._drop_cancelled_head()
        return self._heap[0][0] if self._heap else math.inf

    # --- scheduling ----------------------------------------------------------------------

    def schedule(self, at_s: float, fn: Callback) -> EventHandle:
        """Run ``fn`` at absolute time ``at_s`` (>= ``now_s``); returns a cancellable handle."""
        # `not (at_s >= now)` also rejects NaN, which would corrupt the heap order silently.
        if not (at_s >= self._now_s) or at_s == math.inf:
            raise ValueError(f"cannot schedule at {at_s!r}: now is {self._now_s!r}")
        seq = self._seq
        self._seq = seq + 1
        handle = EventHandle(float(at_s), seq, fn)
        heapq.heappush(self._heap, (handle.at_s, seq, handle))
        return handle

    def schedule_in(self, delay_s: float, fn: Callback) -> EventHandle:
        """Run ``fn`` after ``delay_s`` (>= 0) seconds of simulated time."""
        if not (delay_s >= 0.0):
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        return self.schedule(self._now_s + delay_s, fn)

    def cancel(self, handle: EventHandle) -> bool:
        """Withdraw ``handle``; True if it was pending. Cancelling twice is harmless."""
        if handle._fn is None:
            return False
        handle._fn = None  # lazy deletion: the heap entry is skipped when it surfaces
        self._cancelled_in_heap += 1
        self._maybe_compact()
        return True

    # --- running -------------------------------------------------------------------------

    def run(self, until_s: float = math.inf, max_events: int | None = None) -> int:
        """Run events with time <= ``until_s``, in (time, seq) order; return how many ran.

        Events scheduled at exactly ``until_s`` run. Afterwards ``now_s`` is ``until_s`` when
        it is finite (the clock advances over an idle tail) and the last event's time when it
        is not. Raises :class:`EventLimitExceeded` before running event ``max_events + 1``.
        """
        if until_s < self._now_s:  # also lets NaN through to the check below
            raise ValueError(f"until_s {until_s!r} is before now {self._now_s!r}")
        if math.isnan(until_s):
            raise ValueError("until_s is NaN")
        limit = self.max_events if max_events is None else max_events
        heap = self._heap
        pop = heapq.heappop
        ran = 0
        # Bounded: every pass pops one entry or breaks; live events are capped by `limit`.
        while heap:
            at_s, _, handle = heap[0]
            if at_s > until_s:
                break
            fn = handle._fn
            if fn is None:
                pop(heap)
                self._cancelled_in_heap -= 1
                continue
            if ran >= limit:
                raise EventLimitExceeded(
                    f"more than {limit} events before t={until_s!r}s (now {self._now_s!r}s)"
                )
            pop(heap)
            handle._fn = None
            self._now_s = at_s
            ran += 1
            self._processed += 1
            fn()
        if until_s != math.inf:
            self._now_s = until_s
        return ran

    # --- internals -----------------------------------------------------------------------

    def _drop_cancelled_head(self) -> None:
        heap = self._heap
        while heap and heap[0][2]._fn is None:
            heapq.heappop(heap)
            self._cancelled_in_heap -= 1

    def _maybe_compact(self) -> None:
        # Rebuild when more than half the heap is dead weight: amortised O(1) per cancel, and
        # the heap stays within twice the live events however often callers reschedule.
        n = len(self._heap)
        if n >= _COMPACT_MIN_ENTRIES and 2 * self._cancelled_in_heap > n:
            self._heap[:] = [e for e in self._heap if e[2]._fn is not None]
            heapq.heapify(self._heap)
            self._cancelled_in_heap = 0
