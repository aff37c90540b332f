"""The data-plane server: serves ``get`` pulls and ``status``, and receives/relays chains.

One :class:`DataPlaneServer` per host listens on the data port. Each connection is
authenticated (:mod:`flashpoint.transfer.wire`), then runs one op:

* ``get``: stream the requested chunks this host has verified; name the others as missing.
  Several ``get``s may follow on one connection (a :class:`PeerSource` reuses it).
* ``status``: this host's transfers and their progress.
* ``chain``: this host becomes a receiver (and relay) of a chain transfer; see
  :class:`ChainReceiver` for its states.

Segments come from a :class:`SegmentProvider` (the host cache in production,
:class:`flashpoint.transfer.node.DirSegmentProvider` for the standalone node and tests).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from flashpoint.errors import (
    AuthFailed,
    BadRequest,
    Conflict,
    DeadlineExceeded,
    FlashpointError,
    IntegrityError,
    NoCapacity,
    ProtocolError,
    TransferFailed,
)
from flashpoint.log import bind_ids, get_logger
from flashpoint.registry.manifest import Manifest
from flashpoint.transfer.admission import TransferAdmission
from flashpoint.transfer.chain import (
    ChainResult,
    SendOptions,
    done_message,
    receive_stream,
    relay_downstream,
    send_acks,
)
from flashpoint.transfer.plan import Endpoint, FaultPlan, pack_bitmap
from flashpoint.transfer.segment import Segment, SegmentProvider
from flashpoint.transfer.sources import (
    ChunkSource,
    PeerSource,
    fill,
    reply_error,
    serve_get,
    sources_from_wire,
)
from flashpoint.transfer.wire import (
    FLAG_ABORT,
    VERIFY_FAILURES,
    DataConn,
    accept_loop,
    listen_socket,
)

log = get_logger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
HEADER_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 30.0  # an idle pulled connection is dropped after this
STOP_TIMEOUT_S = 5.0
DOWNSTREAM_WAIT_S = 5.0  # the longest a receiver delays its reply for its downstream hop
FINISHED_TTL_S = 600.0  # how long a finished transfer's state stays visible


class ChainReceiver:
    """Receiver-side state of one chain transfer on one host.

    States: ``receiving`` (an upstream streams into the segment), ``orphaned`` (the upstream
    died; waiting ``orphan_grace_s`` for a spliced-in one), ``pulling`` (filling what is
    missing from the fallback sources, after the grace, an ABORT, or bad chunks at the end),
    ``done`` / ``failed``. Exactly one writer (an upstream stream or a pull) runs at a time;
    a new upstream supersedes the old writer only if the old stream is gone or the new
    upstream sits nearer the head (a lower ``position``), so a node wrongly spliced out
    cannot take its old place back. The downstream relay runs from the start, cut-through,
    independently of which writer feeds the segment.
    """

    def __init__(self, server: DataPlaneServer, segment: Segment, header: dict[str, Any]) -> None:
        self.server = server
        self.segment = segment
        self.transfer_id: str = header["transfer_id"]
        self.rest = [Endpoint.from_wire(e) for e in header.get("chain", [])]
        self.stall_timeout_s = float(header.get("stall_timeout_s", 10.0))
        self.orphan_grace_s = float(header.get("orphan_grace_s", 2.0))
        self.deadline = time.monotonic() + float(header.get("timeout_s", 3600.0))
        self.position = int(header.get("position", 1))
        self.fallback = sources_from_wire(header.get("fallback", []), secret=server.secret,
                                          host_id=server.host_id, registry=server.registry_source)
        self.state = "receiving"
        self.upstream = str(header.get("upstream", ""))
        self.stalled = False
        self.bytes_streamed = 0
        self.pulled: dict[str, int] = {}
        self.error: BaseException | None = None
        self.t0 = time.perf_counter()
        self.result: asyncio.Future[ChainResult] = asyncio.get_running_loop().create_future()
        self._conn: DataConn | None = None
        self._stream_task: asyncio.Task | None = None
        self._pull_task: asyncio.Task | None = None
        self._outcomes: asyncio.Queue[tuple[DataConn | None, str]] = asyncio.Queue()
        self._attached = asyncio.Event()
        self._attach_lock = asyncio.Lock()
        self._verify_q: asyncio.Queue[int] = asyncio.Queue()
        self._bad: set[int] = set()  # chunks that arrived with bad bytes at least once
        self._generation = 0  # bumped by every attach: a pull in preparation checks it
        self._fatal: BaseException | None = None  # this host cannot hold the blob at all
        self.finished_at: float | None = None
        self._relay_opts = SendOptions(
            secret=server.secret, transfer_id=self.transfer_id,
            manifest_json=header["manifest"], fallback_wire=list(header.get("fallback", [])),
            host_id=server.host_id, role="relay", position=self.position,
            stall_timeout_s=self.stall_timeout_s, orphan_grace_s=self.orphan_grace_s,
            deadline=self.deadline, fault=server.fault, hop_open=asyncio.Event())
        if not self.rest:
            self._relay_opts.hop_open.set()

    @property
    def finished(self) -> bool:
        return self.result.done()

    @property
    def downstream_open(self) -> asyncio.Event:
        """Set once this node's downstream hop is open (or it has none, or gave up)."""
        assert self._relay_opts.hop_open is not None
        return self._relay_opts.hop_open

    def status(self) -> dict[str, Any]:
        return {"key": self.segment.key, "state": self.state, "position": self.position,
                "valid_bytes": self.segment.valid_bytes,
                "received_bytes": self.segment.received_bytes,
                "blob_size": self.segment.manifest.blob_size, "upstream": self.upstream,
                "pulled": dict(self.pulled)}

    def start(self) -> None:
        self.segment.clear_failure()  # a retry after a failed receive starts clean
        self._verify_task = self.server.spawn(self._verifier(), f"dp-verify-{self.transfer_id}")
        self.server.spawn(self._allocate(), f"dp-alloc-{self.transfer_id}")
        self.server.spawn(self._main(), f"dp-rx-{self.transfer_id}")

    async def _allocate(self) -> None:
        if self.segment.complete:
            return
        try:
            await self.segment.preallocate()
        except NoCapacity as exc:
            self._fatal = exc
            self._attached.set()  # wake an orphan wait: the state machine sees _fatal
            self._outcomes.put_nowait((None, "fatal"))

    # -- writers ---------------------------------------------------------------------------

    async def attach(self, conn: DataConn, position: int, upstream: str) -> None:
        """Make ``conn`` the upstream (superseding the current writer); Conflict if refused."""
        async with self._attach_lock:
            live = self._stream_task is not None and not self._stream_task.done()
            if live and position >= self.position:
                raise Conflict(f"{self.server.host_id} already has a live upstream at position "
                               f"{self.position}")
            old_conn = self._conn
            if old_conn is not None and old_conn is not conn:
                self.server.superseded.add(old_conn)  # before its handler wakes up
            for task in (self._stream_task, self._pull_task):
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.wait([task])
            await self._verify_q.join()  # nothing half-verified when the new writer starts
            self.segment.reset_partial()
            self.position, self.upstream, self._conn = position, upstream, conn
            self._generation += 1
            self.state = "receiving"
            self._attached.set()

    def run_stream(self, conn: DataConn) -> asyncio.Task:
        """Start reading the attached upstream; its outcome feeds the state machine."""
        async def stream() -> str:
            try:
                flags = await receive_stream(
                    conn, self.segment, stall_timeout_s=self.stall_timeout_s,
                    on_landed=self._landed,
                    stall_after_bytes=self.server.fault.stall_after_bytes if self.server.fault else None,
                    on_stall=self._on_stall)
                kind = "aborted" if flags & FLAG_ABORT else "ended"
                log.info("upstream_" + kind, upstream=self.upstream,
                         valid_bytes=self.segment.valid_bytes)
            except (FlashpointError, OSError) as exc:
                log.warning("upstream_lost", upstream=self.upstream, error=repr(exc)[:200])
                kind = "lost"
            self._outcomes.put_nowait((conn, kind))
            return kind
        self._stream_task = self.server.spawn(stream(), f"dp-stream-{self.transfer_id}")
        return self._stream_task

    def _on_stall(self) -> None:
        self.stalled = True

    def _landed(self, index: int) -> None:
        fault = self.server.fault
        if fault is not None and index in fault.corrupt_store:
            self.segment.chunk_view(index)[0] ^= 0xFF
        self.bytes_streamed += self.segment.chunk_len(index)
        self._verify_q.put_nowait(index)

    async def _verifier(self) -> None:
        """Hash landed chunks in a worker thread (forwarding never waits on it)."""
        while True:
            index = await self._verify_q.get()
            try:
                if self.segment.has(index):
                    continue
                if await asyncio.to_thread(self.segment.verify, index):
                    self.segment.mark(index)
                else:
                    VERIFY_FAILURES.labels("chain").inc()
                    self._bad.add(index)
                    log.warning("chunk_verify_failed", chunk=index, upstream=self.upstream)
                    self.segment.unmark_received(index)
            finally:
                self._verify_q.task_done()

    async def _pull(self) -> bool:
        """Fill what is missing from the fallback sources; False if a new upstream took over."""
        generation = self._generation
        await self._verify_q.join()
        if generation != self._generation:
            return False  # an upstream attached meanwhile: it is the writer now
        missing = self.segment.missing()
        if not missing:
            return True
        self.state = "pulling"
        log.info("pulling_from_fallback", chunks=len(missing), sources=[s.name for s in self.fallback])
        self._pull_task = self.server.spawn(
            fill(self.segment, self.fallback, indices=missing,
                 timeout_s=max(0.1, self.deadline - time.monotonic())),
            f"dp-pull-{self.transfer_id}")
        await asyncio.wait([self._pull_task])
        if self._pull_task.cancelled():
            return False
        exc = self._pull_task.exception()
        if isinstance(exc, TransferFailed) and exc.details.get("chunk") in self._bad:
            # The stream did deliver this chunk, with bad bytes: an integrity failure even
            # when no fallback could be reached.
            exc = IntegrityError(exc.message, **exc.details)
        if exc is not None:
            raise exc
        for name, n in self._pull_task.result().items():
            self.pulled[name] = self.pulled.get(name, 0) + n
        return True

    # -- main -------------------------------------------------------------------------------

    async def _main(self) -> None:
        bind_ids(transfer_id=self.transfer_id)
        relay = None
        if self.rest:
            relay = self.server.spawn(relay_downstream(self.segment, self.rest, self._relay_opts),
                                      f"dp-relay-{self.transfer_id}")
        own_ok = False
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                await self._until_filled()
            if not self.segment.complete:
                raise TransferFailed(f"{self.segment.key}: incomplete after the stream ended")
            self.server.segments.on_complete(self.segment)
            own_ok = True
            self.state = "done"
        except TimeoutError:
            self.error = DeadlineExceeded(f"transfer {self.transfer_id} ran past its deadline")
        except Exception as exc:
            self.error = exc
        if self.error is not None:
            for task in (self._stream_task, self._pull_task):
                if task is not None and not task.done():
                    task.cancel()
            self.state = "failed"
            log.error("receive_failed", model=self.segment.key, error=repr(self.error)[:300])
            self.segment.fail(self.error)  # the relay ABORTs: downstream pulls for itself
        completed: list[str] = []
        failed: list[str] = []
        sent = 0
        if relay is not None:
            try:
                completed, failed, sent = await relay
            except Exception as exc:
                log.error("relay_failed", error=repr(exc)[:300])
                failed = [e.host_id for e in self.rest]
        me = [self.server.host_id]
        result = ChainResult(self.transfer_id, (me if own_ok else []) + completed,
                             ([] if own_ok else me) + failed, sent, time.perf_counter() - self.t0)
        for src in self.fallback:
            if isinstance(src, PeerSource):
                await src.aclose()
        log.info("receive_done", model=self.segment.key, ok=own_ok, completed=result.completed,
                 failed=result.failed, seconds=round(result.seconds, 3), pulled=self.pulled)
        self._verify_task.cancel()
        self.finished_at = time.monotonic()
        self.result.set_result(result)
        self.server.transfer_finished(self)

    async def _until_filled(self) -> None:
        while True:
            conn, kind = await self._outcomes.get()
            if self._fatal is not None:
                raise self._fatal
            if conn is not self._conn:
                continue  # a superseded upstream's last word
            if kind == "lost":
                self.state = "orphaned"
                self._conn = None
                self._attached.clear()
                try:
                    async with asyncio.timeout(self.orphan_grace_s):
                        await self._attached.wait()
                    if self._fatal is not None:
                        raise self._fatal
                    continue  # a spliced-in upstream took over
                except TimeoutError:
                    log.warning("orphaned", grace_s=self.orphan_grace_s)
            if await self._pull():
                return


class DataPlaneServer:
    """A host's data-plane endpoint: ``get`` pulls, ``status``, chain receive and relay.

    ``registry_source`` is what receivers use when a chain's fallback list names
    ``"registry"`` (None: this host has no registry access). ``fault`` injects faults into
    what this server relays, stores or serves (tests and benchmarks only).
    """

    def __init__(self, segments: SegmentProvider, secret: bytes, *, host_id: str,
                 listen_host: str = "127.0.0.1", port: int = 0, fault: FaultPlan | None = None,
                 registry_source: ChunkSource | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 on_finished: Callable[[ChainReceiver], None] | None = None,
                 admission: TransferAdmission | None = None) -> None:
        self.segments = segments
        # None: any authenticated peer may start a chain here (the standalone node, tests);
        # a host passes its own, so only transfers the controller announced are received.
        self.admission = admission
        self.secret = secret
        self.host_id = host_id
        self.listen_host = listen_host
        self.port = port
        self.fault = fault
        self.registry_source = registry_source
        self.handshake_timeout_s = handshake_timeout_s
        self.on_finished = on_finished
        self.endpoint: Endpoint | None = None
        self.superseded: set[DataConn] = set()
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._receivers: dict[str, ChainReceiver] = {}
        self._results: dict[str, asyncio.Future[ChainResult]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Endpoint:
        """Bind and listen; returns the bound address."""
        sock = await listen_socket(self.listen_host, self.port)
        self._sock = sock
        addr, port = sock.getsockname()[:2]
        self.endpoint = Endpoint(self.host_id, addr, port)
        self.spawn(self._accept_loop(), f"dp-accept-{self.host_id}")
        log.info("dataplane_listening", host=self.host_id, addr=addr, port=port)
        return self.endpoint

    async def stop(self) -> None:
        """Cancel and await every task, close every socket; bounded by STOP_TIMEOUT_S."""
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=STOP_TIMEOUT_S)
            if pending:
                log.error("dataplane_stop_timeout", tasks=[t.get_name() for t in pending])
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for rx in self._receivers.values():
            for src in rx.fallback:
                if isinstance(src, PeerSource):
                    await src.aclose()
        for fut in self._results.values():
            if not fut.done():
                fut.set_exception(TransferFailed(f"data plane {self.host_id} stopped"))
                fut.exception()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run a task owned by this server (stop() cancels it)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("dataplane_task_failed", task=task.get_name(), error=repr(task.exception()))

    # -- transfers -------------------------------------------------------------------------

    def transfer(self, transfer_id: str) -> ChainReceiver | None:
        """Receiver-side state of a chain, if any."""
        return self._receivers.get(transfer_id)

    async def wait_transfer(self, transfer_id: str, timeout_s: float) -> ChainResult:
        """This host's part finished: the ChainResult of itself and its downstream. Raises
        this host's own failure (IntegrityError, TransferFailed, ...) if its segment failed;
        DeadlineExceeded after ``timeout_s`` (the transfer may not even have begun)."""
        fut = self._result_future(transfer_id)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise DeadlineExceeded(f"{self.host_id}: transfer {transfer_id} not finished "
                                   f"after {timeout_s}s") from None

    def _prune_finished(self) -> None:
        """Forget receivers finished long ago (their results stay readable for a while)."""
        cutoff = time.monotonic() - FINISHED_TTL_S
        for tid in [t for t, rx in self._receivers.items()
                    if rx.finished_at is not None and rx.finished_at < cutoff]:
            del self._receivers[tid]
            self._results.pop(tid, None)

    def _usable_receiver(self, tid: str) -> ChainReceiver | None:
        rx = self._receivers.get(tid)
        if rx is not None and rx.finished and rx.error is not None:
            return None  # a retry of a transfer that failed here: start over
        return rx

    def _result_future(self, transfer_id: str) -> asyncio.Future[ChainResult]:
        fut = self._results.get(transfer_id)
        if fut is None:
            fut = self._results[transfer_id] = asyncio.get_running_loop().create_future()
        return fut

    def transfer_finished(self, rx: ChainReceiver) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(rx)
            except Exception as exc:  # a reporting hook must not break the transfer
                log.error("on_finished_failed", error=repr(exc))
        fut = self._result_future(rx.transfer_id)
        if fut.done():
            return
        if rx.error is not None:
            fut.set_exception(rx.error)
            fut.exception()  # retrieved: nobody has to wait for it
        else:
            fut.set_result(rx.result.result())

    def status(self) -> dict[str, Any]:
        return {"host_id": self.host_id,
                "transfers": {tid: rx.status() for tid, rx in self._receivers.items()}}

    # -- connections -----------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        await accept_loop(self._sock, lambda sock, peer: self.spawn(
            self._serve_conn(sock, peer), f"dp-conn-{self.host_id}"), "dataplane_accept_failed")

    async def _serve_conn(self, sock: socket.socket, peer: str) -> None:
        conn = DataConn(sock, peer)
        try:
            try:
                await conn.server_handshake(self.secret, self.handshake_timeout_s)
            except AuthFailed as exc:
                log.warning("dataplane_auth_failed", peer=peer, error=exc.message)
                return  # closed without a word, before any op
            timeout_s = HEADER_TIMEOUT_S
            while True:
                header = await conn.recv_header(timeout_s)
                timeout_s = IDLE_TIMEOUT_S
                op = header.get("op")
                if op == "get":
                    await serve_get(conn, header, self.segments.lookup, self.host_id, self.fault)
                elif op == "status":
                    await conn.send_header({"ok": True, **self.status()}, HEADER_TIMEOUT_S)
                elif op == "chain":
                    await self._op_chain(conn, header)
                    return
                else:
                    await reply_error(conn, ProtocolError(f"unknown data-plane op {op!r:.40}"))
                    return
        except (FlashpointError, OSError) as exc:
            log.debug("dataplane_conn_closed", peer=peer, error=repr(exc)[:200])
        finally:
            conn.close()
            self.superseded.discard(conn)

    async def _op_chain(self, conn: DataConn, header: dict[str, Any]) -> None:
        tid = header.get("transfer_id")
        try:
            if not isinstance(tid, str) or not tid or len(tid) > 200:
                raise BadRequest("transfer_id must be a non-empty string")
            bind_ids(transfer_id=tid)
            manifest = Manifest.from_json(header.get("manifest", ""))
            if self.admission is not None:
                await self.admission.admit(tid, manifest)
            rx = self._usable_receiver(tid)
            if rx is None:
                seg = self.segments.open_for_receive(manifest)
            if rx is None:
                self._prune_finished()
                rx = ChainReceiver(self, seg, header)
                self._receivers[tid] = rx
                if (old := self._results.get(tid)) is not None and old.done():
                    del self._results[tid]
                rx.start()
            elif rx.segment.manifest.digest != manifest.digest:
                raise Conflict(f"transfer {tid} already carries another blob")
            if not rx.finished:
                await rx.attach(conn, int(header.get("position", 1)), str(header.get("upstream", "")))
        except (FlashpointError, ValueError, TypeError) as exc:
            err = exc if isinstance(exc, FlashpointError) else BadRequest(str(exc))
            log.info("chain_refused", upstream=header.get("upstream"), error=err.code)
            await reply_error(conn, err)
            return
        seg = rx.segment
        # Wire the chain end to end before data flows (see SendOptions.hop_open), but never
        # keep the upstream waiting near its stall timeout for a slow downstream.
        try:
            async with asyncio.timeout(min(rx.stall_timeout_s / 2, DOWNSTREAM_WAIT_S)):
                await rx.downstream_open.wait()
        except TimeoutError:
            log.info("replying_before_downstream_open")
        await conn.send_header({"ok": True, "host_id": self.host_id,
                                "bitmap": pack_bitmap(seg.marked_flags()),
                                "first_missing": seg.first_missing()}, HEADER_TIMEOUT_S)
        if rx.finished:  # complete here already: swallow the END, answer at once
            await receive_stream(conn, seg, stall_timeout_s=rx.stall_timeout_s)
            await conn.send_header(done_message(rx.result.result()), HEADER_TIMEOUT_S)
            return
        stream = rx.run_stream(conn)
        writer = asyncio.create_task(send_acks(
            conn, rx.result, stall_timeout_s=rx.stall_timeout_s,
            progress=lambda: None if rx.stalled else {"state": rx.state,
                                                      "valid_bytes": rx.segment.valid_bytes}),
            name=f"dp-acks-{tid}")
        try:
            await asyncio.wait([stream])
            if stream.cancelled() or stream.result() == "lost" or conn in self.superseded:
                return
            await writer  # sends DONE once this host and its downstream finished
        finally:
            for t in (writer, stream):
                t.cancel()
            await asyncio.wait([writer, stream])
            if not writer.cancelled():
                writer.exception()  # a lost upstream: nothing to tell anyone
            if conn in self.superseded and not conn.closed:
                try:  # tell the old upstream to stop relaying: a nearer node feeds us now
                    await conn.send_header({"type": "superseded", "host_id": self.host_id}, 1.0)
                except FlashpointError:
                    pass
