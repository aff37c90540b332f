"""The worker's live-migration RPC methods (issue 21 item 5; messages/migration.py), over
its generation loop (:class:`~flashpoint.worker.generation.GenerationLoop`):

- ``hand_off``: the sequences leave at the next token boundary (their ``infer`` calls
  answer ``InferHandedOff``);
- ``snapshot_sequences``: read them without stopping them (a multi-round move's first
  round, on the source);
- ``park_sequences``: prefill them ahead of their resume (on the destination), answered
  once the caches are ready or refused;
- ``unpark_sequences``: drop parks nothing will resume.

A replica that does not generate answers each with nothing done (zero, empty, or every park
refused with ``not_generating``), so the controller falls back to the plain move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashpoint.messages.base import handler
from flashpoint.messages.migration import (
    HandOffAccepted,
    HandOffSequences,
    ParkResult,
    ParkSequences,
    SequenceSnapshots,
    SequencesParked,
    SnapshotSequences,
    Unparked,
    UnparkSequences,
)


def migration_methods(loop_of: Callable[[], Any]) -> dict[str, Any]:
    """The RPC method table entries; ``loop_of()`` is the worker's batcher now (a
    generation loop, another batcher, or None while loading)."""

    def gen() -> Any:
        loop = loop_of()
        return loop if hasattr(loop, "hand_off") else None  # a generation loop's only

    async def hand_off(conn: Any, msg: HandOffSequences) -> HandOffAccepted:
        """The controller takes these streamed sequences elsewhere; each leaves at the next
        token boundary and its ``infer`` call answers InferHandedOff."""
        loop = gen()
        return HandOffAccepted(handing_off=loop.hand_off(msg.request_ids) if loop else 0)

    async def snapshot(conn: Any, msg: SnapshotSequences) -> SequenceSnapshots:
        loop = gen()
        return SequenceSnapshots(sequences=tuple(loop.snapshot(msg.request_ids))
                                 if loop else ())

    async def park(conn: Any, msg: ParkSequences) -> SequencesParked:
        loop = gen()
        if loop is None:
            return SequencesParked(results=tuple(
                ParkResult(request_id=s.request_id, parked=False, code="not_generating")
                for s in msg.sequences))
        ttl = min(max(msg.ttl_s, 0.0), 60.0)  # bounded whatever the caller asks
        return SequencesParked(results=tuple(await loop.park(msg.sequences, ttl_s=ttl)))

    async def unpark(conn: Any, msg: UnparkSequences) -> Unparked:
        loop = gen()
        return Unparked(dropped=loop.unpark(msg.request_ids) if loop else 0)

    return {"hand_off": handler(HandOffSequences, hand_off, "hand_off"),
            "snapshot_sequences": handler(SnapshotSequences, snapshot, "snapshot_sequences"),
            "park_sequences": handler(ParkSequences, park, "park_sequences"),
            "unpark_sequences": handler(UnparkSequences, unpark, "unpark_sequences")}
