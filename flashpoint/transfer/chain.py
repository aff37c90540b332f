"""TCP-chained multicast: streaming a segment down a chain of hosts, cut-through.

One hop, upstream U to downstream D, on one data connection:

    U -> D  header {"op": "chain", transfer_id, manifest, chain (the rest), fallback,
                    stall_timeout_s, orphan_grace_s, timeout_s, position, upstream}
    D -> U  header {"ok": true, "host_id", "bitmap", "first_missing"}   (D's verified chunks)
    U -> D  frames of every chunk D lacks, in order, as soon as U has the bytes, then END
            (or ABORT: U cannot deliver the rest, D pulls it from the fallback sources)
    D -> U  header {"type": "progress", ...} every heartbeat, then
            {"type": "done", "completed": [...], "failed": [...]} once D's segment is
            complete and D's own downstream answered (completion runs tail -> head),
            or {"type": "superseded"} when a node nearer the head has taken U's place

Keepalive frames (U -> D) and progress headers (D -> U) make silence mean a hung peer in
both directions, so ``stall_timeout_s`` bounds every wait without bounding the transfer.
A downstream that fails (connect, handshake, a stalled or broken send, silence, EOF) is
declared dead: U calls ``splice(chain, dead)`` and resumes the new first node from its own
bitmap, so the survivors re-receive nothing they already verified. ``splice`` runs at the
head only; relays splice with :func:`~flashpoint.transfer.plan.drop_dead` (a callback cannot
cross the wire). A node told it was superseded (or refused with Conflict) stops relaying
and splices nothing: it was itself spliced out, and a live node feeds its downstream.

This module holds the sending side (:func:`forward_chunks`, :func:`relay_downstream`,
:func:`send_chain`) and the receiving loop (:func:`receive_stream`); the receiver's state
machine lives in :mod:`flashpoint.transfer.dataplane`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flashpoint.errors import (
    BadRequest,
    DeadlineExceeded,
    FlashpointError,
    ProtocolError,
    from_wire,
)
from flashpoint.log import bind_ids, clear_ids, get_logger
from flashpoint.transfer.plan import (
    Endpoint,
    FaultPlan,
    drop_dead,
    merge_hosts,
    missing_chunks,
    unpack_bitmap,
)
from flashpoint.transfer.segment import Segment
from flashpoint.transfer.sources import ChunkSource, PeerSource, RegistrySource, fill
from flashpoint.transfer.wire import (
    BYTES_RECEIVED,
    BYTES_SENT,
    CHAIN_SPLICES,
    FLAG_ABORT,
    FLAG_DATA,
    FLAG_END,
    FLAG_KEEPALIVE,
    DataConn,
)

log = get_logger(__name__)

# Cut-through granularity: a relay forwards as soon as PIECE_MIN new bytes of a chunk have
# landed (or the chunk is whole), in frames of at most PIECE_MAX. 256 KiB costs ~4 ms per
# hop on a 500 Mbit/s link; smaller pieces only add per-frame Python overhead.
PIECE_MIN = 256 * 1024
PIECE_MAX = 1024 * 1024
CONNECT_TIMEOUT_S = 5.0

class Superseded(Exception):
    """The downstream has a live upstream nearer the head (we were spliced out): stop
    relaying to it, and do not splice around it either."""


Splice = Callable[[Sequence[Endpoint], Endpoint], Sequence[Endpoint]]


@dataclass
class ChainResult:
    """Outcome of a chain (or of one node's part of it: itself and everything downstream)."""

    transfer_id: str
    completed: list[str]  # host_ids holding verified, byte-identical data
    failed: list[str]
    bytes_sent: int
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {"transfer_id": self.transfer_id, "completed": self.completed,
                "failed": self.failed, "bytes_sent": self.bytes_sent, "seconds": self.seconds}


def heartbeat_interval(stall_timeout_s: float) -> float:
    """A few heartbeats per stall timeout, so one late packet never looks like a hang."""
    return max(0.02, min(1.0, stall_timeout_s / 4))


def fallback_to_wire(fallback: Sequence[ChunkSource | Endpoint]) -> list[object]:
    """Fallback sources as a chain header carries them: peers by endpoint, the registry as
    ``"registry"`` (each receiver then uses its own registry client)."""
    out: list[object] = []
    for src in fallback:
        if isinstance(src, Endpoint):
            out.append(src.to_wire())
        elif isinstance(src, PeerSource):
            out.append(src.endpoint.to_wire())
        elif isinstance(src, RegistrySource) or getattr(src, "name", None) == "registry":
            out.append("registry")
        else:
            raise BadRequest(f"fallback {src!r} cannot be named on the wire")
    return out


class _Pacer:
    """Caps a sender at ``rate_bps`` (fault plans, benchmarks); free when None."""

    def __init__(self, rate_bps: float | None) -> None:
        self.rate_bps = rate_bps
        self.t0 = time.monotonic()
        self.sent = 0

    async def pace(self, nbytes: int) -> None:
        if not self.rate_bps:
            return
        self.sent += nbytes
        ahead_s = self.sent * 8 / self.rate_bps - (time.monotonic() - self.t0)
        if ahead_s > 0:
            await asyncio.sleep(ahead_s)


@dataclass
class SendOptions:
    """What a sender (head or relay) needs to run its downstream part of a chain."""

    secret: bytes
    transfer_id: str
    manifest_json: str
    fallback_wire: list[object]
    host_id: str
    role: str = "head"  # metrics label: "head" or "relay"
    position: int = 0  # hops from the head (the head is 0)
    splice: Splice = drop_dead
    stall_timeout_s: float = 10.0
    orphan_grace_s: float = 2.0
    deadline: float = field(default_factory=lambda: time.monotonic() + 3600.0)
    fault: FaultPlan | None = None
    rate_bps: float | None = None
    # Set once a downstream hop is open (or there is none left): a relay answers its own
    # upstream only then, so a chain is wired end to end before bulk data queues on its
    # links and delays every later hop's handshake packets (capped links bufferbloat).
    hop_open: asyncio.Event | None = None

    def remaining_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"transfer {self.transfer_id} ran past its deadline")
        return left


# --------------------------------------------------------------------------------------
# Sending
# --------------------------------------------------------------------------------------


async def forward_chunks(conn: DataConn, segment: Segment, indices: Sequence[int],
                         opts: SendOptions) -> int:
    """Stream ``indices`` of ``segment`` to ``conn`` as their bytes land (cut-through), then
    END; ABORT instead if the segment fails meanwhile. Returns payload bytes sent."""
    stall = opts.stall_timeout_s
    keepalive_s = heartbeat_interval(stall)
    fault = opts.fault
    pacer = _Pacer(opts.rate_bps or (fault.forward_rate_bps if fault else None))
    counter = BYTES_SENT.labels(opts.role)
    view = segment.view
    total = 0
    for i in indices:
        start, end = segment.manifest.chunk_range(i)
        n = end - start
        sent = 0
        while sent < n:
            want = min(n, sent + PIECE_MIN)
            have = segment.received(i)
            while have < want:
                try:
                    have = await segment.wait_received(i, want - 1, keepalive_s)
                except DeadlineExceeded:
                    # Our own upstream is slow or we are refetching: keep the link warm.
                    opts.remaining_s()
                    await conn.send_frame(0, 0, None, FLAG_KEEPALIVE, stall)
                    have = segment.received(i)
                except Exception as exc:
                    if exc is not segment.failure:
                        raise
                    log.warning("forward_aborted", chunk=i, peer=conn.peer, error=repr(exc))
                    await conn.send_frame(0, 0, None, FLAG_ABORT, stall)
                    return total
            upto = min(have, sent + PIECE_MAX)
            piece: memoryview | bytes = view[start + sent:start + upto]
            if fault is not None and i in fault.corrupt_forward and sent == 0:
                bad = bytearray(piece)
                bad[0] ^= 0xFF
                piece = bytes(bad)
            await conn.send_frame(i, sent, piece, FLAG_DATA, stall)
            counter.inc(upto - sent)
            total += upto - sent
            await pacer.pace(upto - sent)
            sent = upto
    await conn.send_frame(0, 0, None, FLAG_END, stall)
    return total


async def _read_acks(conn: DataConn, stall_timeout_s: float) -> dict:
    """Progress heartbeats until the downstream's DONE (its subtree's outcome)."""
    while True:
        h = await conn.recv_header(stall_timeout_s)
        kind = h.get("type")
        if kind == "done":
            return h
        if kind == "superseded":
            raise Superseded(f"{conn.peer} is fed by a nearer upstream now")
        if kind != "progress":
            raise ProtocolError(f"{conn.peer}: unexpected message {kind!r}")


async def _run_hop(target: Endpoint, rest: Sequence[Endpoint], segment: Segment,
                   opts: SendOptions, bytes_out: list[int]) -> dict:
    """One attempt at one downstream: open, learn its bitmap, stream, wait for DONE."""
    stall = opts.stall_timeout_s
    conn = await DataConn.connect(target, opts.secret, name=opts.host_id,
                                  timeout_s=min(CONNECT_TIMEOUT_S, stall))
    tasks: list[asyncio.Task] = []
    try:
        await conn.send_header({
            "op": "chain", "transfer_id": opts.transfer_id, "manifest": opts.manifest_json,
            "chain": [e.to_wire() for e in rest], "fallback": opts.fallback_wire,
            "stall_timeout_s": stall, "orphan_grace_s": opts.orphan_grace_s,
            "timeout_s": opts.remaining_s(), "position": opts.position + 1,
            "upstream": opts.host_id,
        }, stall)
        reply = await conn.recv_header(stall)
        if not reply.get("ok"):
            err = from_wire(reply.get("error"))
            if err.code == "conflict":
                raise Superseded(err.message)
            raise err
        marked = unpack_bitmap(reply.get("bitmap", b""), segment.manifest.num_chunks)
        todo = missing_chunks(marked)
        log.info("hop_open", peer=str(target), missing_chunks=len(todo),
                 first_missing=reply.get("first_missing"))
        if opts.hop_open is not None:
            opts.hop_open.set()

        async def forward() -> None:
            bytes_out[0] += await forward_chunks(conn, segment, todo, opts)

        fwd = asyncio.create_task(forward(), name=f"dp-forward-{target.host_id}")
        ack = asyncio.create_task(_read_acks(conn, stall), name=f"dp-acks-{target.host_id}")
        tasks = [fwd, ack]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return await ack  # the forwarder finished (END sent): the DONE follows
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001 - already reported through `done`
                pass
        conn.close()


async def relay_downstream(segment: Segment, chain: Sequence[Endpoint],
                           opts: SendOptions) -> tuple[list[str], list[str], int]:
    """Stream ``segment`` down ``chain`` until its first live node answers DONE, splicing out
    every node that fails. Returns (completed, failed, bytes_sent)."""
    try:
        return await _relay(segment, list(chain), opts)
    finally:
        if opts.hop_open is not None:
            opts.hop_open.set()


async def _relay(segment: Segment, chain: list[Endpoint],
                 opts: SendOptions) -> tuple[list[str], list[str], int]:
    failed: list[str] = []
    bytes_out = [0]
    while chain:
        target = chain[0]
        try:
            done = await _run_hop(target, chain[1:], segment, opts, bytes_out)
        except Superseded as exc:
            log.info("relay_superseded", peer=str(target), detail=str(exc)[:200])
            return [], failed, bytes_out[0]
        except (FlashpointError, OSError) as exc:
            code = getattr(exc, "code", type(exc).__name__)
            log.warning("downstream_dead", peer=str(target), error=code, detail=str(exc)[:200])
            opts.remaining_s()  # past the deadline: stop splicing, report it
            failed.append(target.host_id)
            CHAIN_SPLICES.inc()
            spliced = list(opts.splice(chain, target))
            chain = drop_dead(spliced, target)  # a splice that keeps the dead node would loop
            continue
        return (list(done.get("completed", [])), merge_hosts(failed, done.get("failed", [])),
                bytes_out[0])
    return [], failed, bytes_out[0]


async def send_chain(segment: Segment, chain: Sequence[Endpoint], *, secret: bytes, transfer_id: str,
                     upstream: Sequence[ChunkSource] = (),
                     fallback: Sequence[ChunkSource | Endpoint] = (),
                     splice: Splice = drop_dead, stall_timeout_s: float = 10.0,
                     timeout_s: float = 3600.0, orphan_grace_s: float = 2.0,
                     host_id: str = "head", rate_bps: float | None = None,
                     fault: FaultPlan | None = None) -> ChainResult:
    """Head of a chain.

    ``segment`` is complete (a peer's RAM) or being filled here from ``upstream`` pull
    sources (the registry as a sender: the head is itself a receiver and forwards each chunk
    once verified). Streams chunks cut-through to ``chain[0]``, which relays to ``chain[1]``,
    ... Returns when the tail -> head completion ack arrives: ``completed`` lists the hosts
    holding verified bytes, ``failed`` the dead or failed ones. ``fallback`` is what receivers
    pull from when their upstream dies or sends a bad chunk. DeadlineExceeded past
    ``timeout_s``; a silent or stuck hop costs at most ``stall_timeout_s``.
    """
    bind_ids(transfer_id=transfer_id)
    t0 = time.perf_counter()
    if not segment.complete and not upstream:
        raise BadRequest(f"{segment.key}: segment incomplete and no upstream sources to fill it")
    opts = SendOptions(secret=secret, transfer_id=transfer_id,
                       manifest_json=segment.manifest.to_json(),
                       fallback_wire=fallback_to_wire(fallback), host_id=host_id, role="head",
                       splice=splice, stall_timeout_s=stall_timeout_s,
                       orphan_grace_s=orphan_grace_s, deadline=time.monotonic() + timeout_s,
                       fault=fault, rate_bps=rate_bps)
    fill_task: asyncio.Task | None = None
    if not segment.complete:
        async def pull() -> None:
            try:
                await fill(segment, upstream, timeout_s=timeout_s)
            except Exception as exc:
                # Receivers are told to ABORT and use their fallbacks; the head reports it.
                log.error("head_fill_failed", model=segment.key, error=repr(exc))
                segment.fail(exc)
                raise
        fill_task = asyncio.create_task(pull(), name=f"dp-head-fill-{transfer_id}")
    log.info("chain_start", model=segment.key, chain=[str(e) for e in chain])
    try:
        async with asyncio.timeout(timeout_s):
            completed, failed, sent = await relay_downstream(segment, chain, opts)
            if fill_task is not None:
                await asyncio.wait([fill_task])
    except TimeoutError:
        raise DeadlineExceeded(f"transfer {transfer_id} took over {timeout_s}s") from None
    finally:
        clear_ids("transfer_id")
        if fill_task is not None:
            if not fill_task.done():
                fill_task.cancel()
                await asyncio.wait([fill_task])
            if not fill_task.cancelled() and fill_task.exception() is not None:
                log.error("head_segment_incomplete", model=segment.key)
    result = ChainResult(transfer_id, completed, failed, sent, time.perf_counter() - t0)
    log.info("chain_done", transfer_id=transfer_id, completed=completed, failed=failed, bytes_sent=sent,
             seconds=round(result.seconds, 3))
    return result


# --------------------------------------------------------------------------------------
# Receiving
# --------------------------------------------------------------------------------------


def done_message(result: ChainResult) -> dict[str, object]:
    return {"type": "done", "completed": result.completed, "failed": result.failed}


async def send_acks(conn: DataConn, result: asyncio.Future[ChainResult], *, stall_timeout_s: float,
                    progress: Callable[[], dict | None]) -> None:
    """Receiver -> upstream: a progress heartbeat every interval (silence means a hung node;
    ``progress()`` returning None sends nothing, a fault plan's hang), then DONE once this
    node and its downstream finished."""
    hb = heartbeat_interval(stall_timeout_s)
    while not result.done():
        await asyncio.wait([result], timeout=hb)
        if not result.done() and (p := progress()) is not None:
            await conn.send_header({"type": "progress", **p}, stall_timeout_s)
    await conn.send_header(done_message(result.result()), stall_timeout_s)


async def receive_stream(conn: DataConn, segment: Segment, *, stall_timeout_s: float,
                         on_landed: Callable[[int], None] | None = None,
                         stall_after_bytes: int | None = None,
                         on_stall: Callable[[], None] | None = None) -> int:
    """Read frames from an upstream straight into the segment's mmap until END or ABORT
    (returned). Progress is noted per socket read, so this node's own forwarders relay
    bytes as they land; ``on_landed(i)`` fires when chunk ``i`` is whole (to verify it).
    PeerLost / DeadlineExceeded when the upstream dies or goes silent."""
    manifest = segment.manifest
    view = segment.view
    counter = BYTES_RECEIVED.labels("chain")
    scratch: memoryview | None = None
    total = 0
    while True:
        i, off, n, flags = await conn.recv_frame_header(stall_timeout_s)
        if flags & FLAG_KEEPALIVE:
            continue
        if flags & (FLAG_END | FLAG_ABORT):
            return flags & (FLAG_END | FLAG_ABORT)
        if flags != FLAG_DATA or i >= manifest.num_chunks:
            raise ProtocolError(f"{conn.peer}: bad frame {(i, off, n, flags)}")
        start, end = manifest.chunk_range(i)
        if off + n > end - start:
            raise ProtocolError(f"{conn.peer}: frame past the end of chunk {i}")
        if segment.has(i):
            # Already verified here: never let unverified bytes overwrite it.
            if scratch is None:
                scratch = memoryview(bytearray(PIECE_MAX))
            left = n
            while left:
                left -= await conn.recv_into(scratch[:min(left, len(scratch))], stall_timeout_s)
            continue
        if off != segment.received(i):
            raise ProtocolError(f"{conn.peer}: chunk {i} frame at {off}, have {segment.received(i)}")
        pos, stop = start + off, start + off + n
        if stop > segment.allocated_bytes:
            await segment.wait_allocated(stop, stall_timeout_s)
        while pos < stop:
            got = await conn.recv_into(view[pos:stop], stall_timeout_s)
            pos += got
            segment.note_received(i, got)
        counter.inc(n)
        total += n
        if segment.received(i) == end - start and on_landed is not None:
            on_landed(i)
        if stall_after_bytes is not None and total >= stall_after_bytes:
            if on_stall is not None:
                on_stall()
            await asyncio.sleep(3600)  # fault plan: a hung process (cancelled by stop())
        # The socket fast path may never block on a fast link: yield so forwarders and
        # heartbeats run between frames.
        await asyncio.sleep(0)
