"""Request queues and credit-based dispatch (the thesis's pull queue, without polling).

One FIFO per function and request class — strict requests always go before best-effort
ones (PROTEAN's reorderer, see ``policy/request_class.py``); each warm replica holds
``credits`` (how many requests it has room for). ``assign`` pairs queued requests with
replicas that have free credits, least-loaded first, so a new replica fills up at once
instead of old ones piling up work (thesis §5.2.3, Sparrow-style).
A canary (``set_canary``, policy/rollout.py) sends a set percentage of a function's requests
to its replicas of one model version and the rest to the others, by a deterministic
credit count (no randomness: 25 % is exactly every fourth request while both sides have
room; a side without room lends its turn to the other, so nothing waits for a split).
A function whose accepting replicas all sit on MIG slices (and no canary) is routed by
PROTEAN's job distribution instead (``slice_policy`` "protean", the default;
policy/slice_dispatch.py, Alg. 1): strict requests to the slice of least slowdown η,
best-effort ones packed into the smallest slices, strict still before best-effort.
Pure state: the controller actor does the sending.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from flashpoint.errors import BadRequest
from flashpoint.policy.slice_dispatch import (
    SliceReplica,
    SliceRoutingSnapshot,
    route_to_slices,
    short_profile,
)

SLICE_POLICIES = ("protean", "least_loaded")


@dataclass
class _Slot:
    function: str
    credits: int
    inflight: int = 0
    accepting: bool = True
    pool: str = ""  # the model version it runs (a canary splits requests by it)
    slice_id: str = ""  # the MIG slice it runs on ("host/device"; "" = not on a MIG slice)
    mig_profile: str = ""  # that slice's profile, "4g.20gb"
    slice: str = ""  # its short name, "4g" (Alg. 1's slice type)
    fbr: float = 0.0  # FBR of one request of its function in flight (PROTEAN Eq. 1)


@dataclass
class _Canary:
    pool: str
    pct: float
    credit: float = 0.0  # accrues pct per request; >= 100 sends one to the canary's pool


class Dispatcher:
    """Queues of opaque request items and the replicas that may take them."""

    def __init__(self, slice_policy: str = "protean", t_low: float = 0.05,
                 t_high: float = 0.95) -> None:
        """``slice_policy``: how requests of a function whose replicas all sit on MIG
        slices are routed ("protean": Alg. 1; "least_loaded"); ``t_low``/``t_high``:
        PROTEAN's BE occupancy thresholds for Alg. 1 (``[controller] protean_t_*``)."""
        if slice_policy not in SLICE_POLICIES:
            raise BadRequest(f"slice_policy {slice_policy!r}: one of {list(SLICE_POLICIES)}")
        if not 0.0 <= t_low < t_high <= 1.0:
            raise BadRequest(f"need 0 <= t_low < t_high <= 1, got {t_low}, {t_high}")
        self._protean = slice_policy == "protean"
        self._t_low, self._t_high = t_low, t_high
        # function -> (strict FIFO, best-effort FIFO)
        self._queues: dict[str, tuple[deque[Any], deque[Any]]] = {}
        self._slots: dict[str, _Slot] = {}
        self._by_function: dict[str, set[str]] = {}
        self._by_slice: dict[str, set[str]] = {}  # MIG slice -> replicas on it (any function)
        self._canary: dict[str, _Canary] = {}

    # replicas -------------------------------------------------------------------------
    def add_replica(self, replica_id: str, function: str, credits: int, pool: str = "", *,
                    slice_id: str = "", mig_profile: str = "", fbr: float = 0.0) -> None:
        """A target that takes up to ``credits`` requests of ``function`` at once. On a MIG
        slice: ``slice_id`` names the slice (replicas on one slice share it),
        ``mig_profile`` its profile ("4g.20gb"), ``fbr`` one request's FBR."""
        try:
            short = short_profile(mig_profile) if slice_id and mig_profile else ""
        except BadRequest:
            short = ""  # a profile Alg. 1 has no RDF for: routed as any other replica
        self._slots[replica_id] = _Slot(function, max(1, credits), pool=pool,
                                        slice_id=slice_id if short else "",
                                        mig_profile=mig_profile if short else "",
                                        slice=short, fbr=max(0.0, fbr))
        self._by_function.setdefault(function, set()).add(replica_id)
        if short:
            self._by_slice.setdefault(slice_id, set()).add(replica_id)

    def set_canary(self, function: str, pool: str, pct: float) -> None:
        """Send ``pct`` percent of ``function``'s requests to its replicas in ``pool``, the
        rest to its other replicas; ``pool`` "" ends the split."""
        if not pool:
            self._canary.pop(function, None)
        elif (c := self._canary.get(function)) is not None and c.pool == pool:
            c.pct = pct
        else:
            self._canary[function] = _Canary(pool, pct)

    def stop_accepting(self, replica_id: str) -> None:
        slot = self._slots.get(replica_id)
        if slot is not None:
            slot.accepting = False

    def remove_replica(self, replica_id: str) -> None:
        slot = self._slots.pop(replica_id, None)
        if slot is not None:
            self._by_function.get(slot.function, set()).discard(replica_id)
            if slot.slice_id:
                on = self._by_slice.get(slot.slice_id)
                if on is not None:
                    on.discard(replica_id)
                    if not on:
                        del self._by_slice[slot.slice_id]

    def mig_profile_of(self, replica_id: str) -> str:
        """The MIG profile of the slice ``replica_id`` runs on ("" = none, or unknown)."""
        slot = self._slots.get(replica_id)
        return slot.mig_profile if slot is not None else ""

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._slots

    def free_credits(self, replica_id: str) -> int:
        """Room for more requests on an accepting replica (0 when it takes none)."""
        slot = self._slots.get(replica_id)
        return max(0, slot.credits - slot.inflight) if slot is not None and slot.accepting else 0

    def claim(self, replica_id: str) -> bool:
        """Take one credit of ``replica_id`` for an item sent past the queue (a migrated
        sequence going to the destination chosen for it); False when it has no room. The
        item's end is :meth:`release`, as for an assigned one."""
        if self.free_credits(replica_id) <= 0:
            return False
        self._slots[replica_id].inflight += 1
        return True

    def release(self, replica_id: str) -> None:
        """A request sent to ``replica_id`` finished (either way)."""
        slot = self._slots.get(replica_id)
        if slot is not None and slot.inflight > 0:
            slot.inflight -= 1

    # queues ---------------------------------------------------------------------------
    def enqueue(self, function: str, item: Any, *, front: bool = False,
                best_effort: bool = False) -> None:
        queues = self._queues.get(function)
        if queues is None:
            queues = self._queues[function] = (deque(), deque())
        q = queues[1] if best_effort else queues[0]
        if front:
            q.appendleft(item)
        else:
            q.append(item)

    def remove(self, function: str, item: Any) -> bool:
        for q in self._queues.get(function, ()):
            try:
                q.remove(item)
                return True
            except ValueError:
                pass
        return False

    def peek(self, function: str) -> Any | None:
        """The item ``function`` would dispatch next, without removing it."""
        fronts = self.fronts(function)
        return fronts[0] if fronts else None

    def fronts(self, function: str) -> list[Any]:
        """The oldest queued item of each class of ``function`` (strict first), in place."""
        return [q[0] for q in self._queues.get(function, ()) if q]

    def drain_queue(self, function: str) -> list[Any]:
        strict, best_effort = self._queues.pop(function, ((), ()))
        return [*strict, *best_effort]

    def assign(self, function: str) -> list[tuple[Any, str]]:
        """Pair queued items of ``function`` with replicas that have free credits."""
        queues = self._queues.get(function)
        if not queues or not (queues[0] or queues[1]):
            return []
        strict, best_effort = queues
        out: list[tuple[Any, str]] = []
        candidates = [
            (rid, self._slots[rid]) for rid in self._by_function.get(function, ())
            if self._slots[rid].accepting
        ]
        canary = self._canary.get(function)
        if canary is not None:
            return self._assign_split(canary, strict, best_effort, candidates)
        if self._protean and candidates and all(c[1].slice for c in candidates):
            return self._assign_slices(strict, best_effort, candidates)
        while (strict or best_effort) and candidates:
            rid, slot = min(candidates, key=lambda c: (c[1].inflight / c[1].credits, c[0]))
            if slot.inflight >= slot.credits:
                break
            slot.inflight += 1
            out.append(((strict or best_effort).popleft(), rid))
        return out

    def _assign_slices(self, strict: deque[Any], best_effort: deque[Any],
                       candidates: list[tuple[str, _Slot]]) -> list[tuple[Any, str]]:
        """PROTEAN Alg. 1 over the slices of the function's replicas (slice_dispatch.py)."""
        replicas = tuple(SliceReplica(rid, slot.slice_id, slot.slice,
                                      slot.credits - slot.inflight)
                         for rid, slot in candidates if slot.inflight < slot.credits)
        if not replicas:
            return []
        slots = self._slots
        resident = {sid: sum(slots[r].fbr * slots[r].inflight for r in self._by_slice[sid])
                    for sid in {r.slice_id for r in replicas}}
        d = route_to_slices(SliceRoutingSnapshot(
            replicas, len(strict), len(best_effort), candidates[0][1].fbr, resident,
            self._t_low, self._t_high))
        out: list[tuple[Any, str]] = []
        for queue, chosen in ((strict, d.strict), (best_effort, d.best_effort)):
            for rid in chosen:
                slots[rid].inflight += 1
                out.append((queue.popleft(), rid))
        return out

    @staticmethod
    def _assign_split(canary: _Canary, strict: deque[Any], best_effort: deque[Any],
                      candidates: list[tuple[str, _Slot]]) -> list[tuple[Any, str]]:
        sides = ([c for c in candidates if c[1].pool == canary.pool],
                 [c for c in candidates if c[1].pool != canary.pool])
        out: list[tuple[Any, str]] = []
        while strict or best_effort:
            free = [[c for c in side if c[1].inflight < c[1].credits] for side in sides]
            if not free[0] and not free[1]:
                break
            canary.credit += canary.pct
            to_canary = canary.credit >= 100.0
            if to_canary:
                canary.credit -= 100.0
            side = free[0] if (to_canary and free[0]) or not free[1] else free[1]
            rid, slot = min(side, key=lambda c: (c[1].inflight / c[1].credits, c[0]))
            slot.inflight += 1
            out.append(((strict or best_effort).popleft(), rid))
        return out

    # views ----------------------------------------------------------------------------
    def accepting(self, function: str) -> bool:
        """Whether some warm target of ``function`` takes new requests."""
        slots = self._slots
        return any(slots[r].accepting for r in self._by_function.get(function, ()))

    def queued(self, function: str) -> int:
        queues = self._queues.get(function)
        return len(queues[0]) + len(queues[1]) if queues else 0

    def inflight(self, function: str) -> int:
        return sum(self._slots[r].inflight for r in self._by_function.get(function, ()))

    def inflight_of(self, replica_id: str) -> int:
        slot = self._slots.get(replica_id)
        return slot.inflight if slot else 0
