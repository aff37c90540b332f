"""StageServer: one stage of a partitioned model, serving activation frames over TCP.

Pipeline semantics (thesis §4.1.3, DESIGN "Partitioned inference"): a stage runs one
request at a time, in arrival order, and takes the next one only after it has forwarded the
current one's output to the next stage (the send has completed). Requests overlap *across*
stages: while stage k+1 computes request n, stage k computes request n+1.

Reply path: results travel back along the same connections, in reverse. The client connects
to the first stage; each stage connects to its next hop (lazily, on its first request) and
keeps that one link; the last stage writes each RESULT on the link its request came in on,
and every stage relays RESULT and ERROR frames from its downstream link to the upstream link
the request came from. So no stage needs to reach the client, one authenticated connection
per hop carries both directions, and a lost stage is seen at once by the stage before it
(EOF on its downstream link), which fails every request it had forwarded there with a typed
ERROR (PeerLost) that travels back to the client. Request ids are link-local (each stage
renumbers what it forwards and maps replies back), so many clients can share a first
stage; the client's ``trace_id`` travels unchanged for the logs.

Flow control: received requests wait in a bounded inbox (``max_queued``); when it is full
the stage stops reading, TCP pushes back, and the previous stage's forward waits, so it
does not take its next request either. The model runs on one dedicated thread (the event
loop keeps relaying replies and accepting connections meanwhile).

Runnable as a process (tests, benchmarks)::

    python -m flashpoint.pipeline.stage --manifest PATH --blob PATH --first I --last J
        (--listen ADDR --port P | --listen-fd FD) [--next id:addr:port] [--stage-id ID]
        [--device cpu] [--secret-env VAR] [--torch-threads N] [--max-queued N] [--events]

It maps the stage's byte range of the blob copy-on-write (MAP_PRIVATE), builds layers I..J
with ``load_stage`` (no parameter initialisation, no weight copy), prints ``{"event":
"listening", "addr", "port", "stage_id", "pid", "layers", "t_load0", "t_load1"}`` (the
``time.monotonic()`` span of that load) on stdout, with
``--events`` one ``{"event": "request", ...}`` line (a :class:`StageRecord`) per request,
and serves until SIGTERM. With ``--listen-fd`` it serves a listening socket its parent bound
(a host manager, or a test): every stage's address is then known before any stage has
loaded, so a whole pipeline can start at once, each stage naming its next hop.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import mmap
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flashpoint.errors import (
    AuthFailed,
    DeadlineExceeded,
    FlashpointError,
    ModelFailed,
    PeerLost,
    ProtocolError,
)
from flashpoint.log import get_logger
from flashpoint.pipeline.frames import (
    MAX_FRAME_BYTES,
    Frame,
    FrameKind,
    encode_error,
    encode_frame,
    set_request_id,
)
from flashpoint.pipeline.link import ActivationLink
from flashpoint.transfer.plan import Endpoint
from flashpoint.transfer.wire import DataConn, accept_loop, listen_socket, tune_socket

log = get_logger(__name__)

STOP_TIMEOUT_S = 5.0
RECORDS_KEPT = 1024
U64_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class StageRecord:
    """What one stage did with one request (``time.monotonic()`` seconds; the clock is
    system-wide on Linux, so records of stages on one host compare)."""

    stage_id: str
    trace_id: int
    request_id: int  # on the upstream link
    received_s: float
    started_s: float
    computed_s: float
    forwarded_s: float  # the output was sent on (or, at the last stage, returned)
    outcome: str  # forwarded | returned | failed | dropped
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Queued:
    upstream: ActivationLink
    frame: Frame
    received_s: float


@dataclass
class _Route:
    """A request forwarded downstream, waiting for its reply."""

    upstream: ActivationLink
    request_id: int
    trace_id: int
    downstream: ActivationLink
    created_s: float


class StageServer:
    """Serves one stage (``module``: layers first..last, or any callable on tensors)."""

    def __init__(
        self,
        module: Callable[..., Any],
        *,
        host: str,
        port: int,
        secret: bytes,
        next_hop: Endpoint | None,
        device: str = "cpu",
        stage_id: str = "stage",
        max_queued: int = 4,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        connect_timeout_s: float = 5.0,
        handshake_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        idle_timeout_s: float = 3600.0,
        reply_timeout_s: float = 300.0,
        on_record: Callable[[StageRecord], None] | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        if max_queued < 1:
            raise ValueError("max_queued must be at least 1")
        self.module = module
        self.host = host
        self.port = port
        self.secret = secret
        self.next_hop = next_hop
        self.device = device
        self.stage_id = stage_id
        self.max_queued = max_queued
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout_s = connect_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.on_record = on_record
        self.records: collections.deque[StageRecord] = collections.deque(maxlen=RECORDS_KEPT)
        self.endpoint: Endpoint | None = None
        self._sock: socket.socket | None = sock  # a listening socket handed over, if any
        self._tasks: set[asyncio.Task[Any]] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._inbox: asyncio.Queue[_Queued] | None = None
        self._upstreams: set[ActivationLink] = set()
        self._down: ActivationLink | None = None
        self._routes: dict[int, _Route] = {}
        self._next_id = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Endpoint:
        """Bind, listen and start serving (or serve the listening socket handed over as
        ``sock``: its owner knew the address before the stage was built); returns the
        bound address."""
        if self._sock is None:
            self._sock = await self._bind()
        else:
            tune_socket(self._sock)
        sock = self._sock
        addr, port = sock.getsockname()[:2]
        self.endpoint = Endpoint(self.stage_id, addr, port)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"fp-stage-{self.stage_id}")
        self._inbox = asyncio.Queue(self.max_queued)
        self._spawn(self._accept_loop(), f"pipe-accept-{self.stage_id}")
        self._spawn(self._work_loop(), f"pipe-work-{self.stage_id}")
        log.info("stage_listening", stage_id=self.stage_id, addr=addr, port=port,
                 next_hop=str(self.next_hop) if self.next_hop else None)
        return self.endpoint

    async def _bind(self) -> socket.socket:
        return await listen_socket(self.host, self.port)

    async def stop(self) -> None:
        """Cancel every task, close every link and the listening socket (bounded)."""
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=STOP_TIMEOUT_S)
            if pending:
                log.error("stage_stop_timeout", tasks=[t.get_name() for t in pending])
        for link in [*self._upstreams, *([self._down] if self._down else [])]:
            link.close()
        self._upstreams.clear()
        self._down = None
        self._routes.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("stage_task_failed", task=task.get_name(), error=repr(task.exception()))

    # -- upstream: requests in, replies out --------------------------------------------------

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        await accept_loop(self._sock, lambda sock, peer: self._spawn(
            self._serve_upstream(sock, peer), f"pipe-up-{self.stage_id}"), "stage_accept_failed")

    async def _serve_upstream(self, sock: socket.socket, peer: str) -> None:
        conn = DataConn(sock, peer)
        try:
            await conn.server_handshake(self.secret, self.handshake_timeout_s)
        except AuthFailed as exc:
            log.warning("stage_auth_failed", stage_id=self.stage_id, peer=peer, error=exc.message)
            conn.close()  # refused without a word
            return
        except BaseException:
            conn.close()
            raise
        link = ActivationLink(conn, max_frame_bytes=self.max_frame_bytes)
        self._upstreams.add(link)
        assert self._inbox is not None
        try:
            while True:
                frame = await link.recv(self.idle_timeout_s, self.io_timeout_s)
                if frame.head.kind is not FrameKind.REQUEST:
                    raise ProtocolError(f"upstream {peer} sent a {frame.head.kind.name} frame")
                await self._inbox.put(_Queued(link, frame, time.monotonic()))
        except (PeerLost, DeadlineExceeded) as exc:
            log.debug("stage_upstream_closed", stage_id=self.stage_id, peer=peer, error=exc.message)
        except FlashpointError as exc:
            log.warning("stage_upstream_bad_frame", stage_id=self.stage_id, peer=peer,
                        error=exc.message)
        finally:
            link.close()
            self._upstreams.discard(link)

    async def _reply(self, upstream: ActivationLink, buffers: list[Any], trace_id: int) -> bool:
        """Send a RESULT or ERROR upstream; a failed send closes that link (its client
        sees PeerLost), never this stage."""
        if upstream.closed:
            return False
        try:
            await upstream.send(buffers, self.io_timeout_s)
            return True
        except FlashpointError as exc:
            log.warning("stage_reply_failed", stage_id=self.stage_id, peer=upstream.peer,
                        trace_id=trace_id, error=exc.message)
            upstream.close()
            return False

    # -- the stage: one request at a time -----------------------------------------------------

    async def _work_loop(self) -> None:
        assert self._inbox is not None
        while True:
            item = await self._inbox.get()
            try:
                await self._handle(item)
            except Exception as exc:  # the loop survives anything one request does
                log.error("stage_request_failed", stage_id=self.stage_id,
                          trace_id=item.frame.head.trace_id, error=repr(exc))

    async def _handle(self, item: _Queued) -> None:
        head = item.frame.head
        started = time.monotonic()

        def record(outcome: str, computed: float, error: str = "") -> None:
            rec = StageRecord(self.stage_id, head.trace_id, head.request_id, item.received_s,
                              started, computed, time.monotonic(), outcome, error)
            self.records.append(rec)
            if self.on_record is not None:
                self.on_record(rec)

        if item.upstream.closed:  # nobody is waiting for this one any more
            record("dropped", started)
            return
        last = self.next_hop is None
        kind = FrameKind.RESULT if last else FrameKind.REQUEST
        loop = asyncio.get_running_loop()
        try:
            payload = await loop.run_in_executor(self._executor, self._compute, item.frame, kind)
        except Exception as exc:
            err = exc if isinstance(exc, FlashpointError) else ModelFailed(
                f"stage {self.stage_id}: {type(exc).__name__}: {exc}"[:500], stage=self.stage_id)
            await self._reply(item.upstream, encode_error(head.request_id, head.trace_id, err),
                              head.trace_id)
            record("failed", time.monotonic(), err.code)
            return
        computed = time.monotonic()
        if last:
            ok = await self._reply(item.upstream, set_request_id(payload, head.request_id),
                                   head.trace_id)
            record("returned" if ok else "dropped", computed)
            return
        err = await self._forward(item.upstream, head.request_id, head.trace_id, payload)
        if err is not None:
            await self._reply(item.upstream, encode_error(head.request_id, head.trace_id, err),
                              head.trace_id)
            record("failed", computed, err.code)
        else:
            record("forwarded", computed)

    def _compute(self, frame: Frame, kind: FrameKind) -> list[Any]:
        """On the stage thread: run the module and encode its outputs (request id 0)."""
        with torch.inference_mode():
            args = frame.tensors_torch()  # BYTES come as numpy object arrays
            if self.device != "cpu":
                args = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]
            out = self.module(*args)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            outs = [o.detach().cpu().contiguous() if isinstance(o, torch.Tensor) else o
                    for o in outs]
            return encode_frame(kind, 0, frame.head.trace_id, outs)

    # -- downstream: requests out, replies in ---------------------------------------------

    async def _forward(self, upstream: ActivationLink, request_id: int, trace_id: int,
                       payload: list[Any]) -> FlashpointError | None:
        """Send one request to the next stage; the error to return upstream if it failed."""
        await self._expire_routes()
        try:
            link = await self._downstream_link()
        except FlashpointError as exc:
            return self._lost(exc)
        self._next_id = (self._next_id + 1) & U64_MASK
        hop_id = self._next_id
        self._routes[hop_id] = _Route(upstream, request_id, trace_id, link, time.monotonic())
        try:
            await link.send(set_request_id(payload, hop_id), self.io_timeout_s)
        except FlashpointError as exc:
            link.close()
            if self._routes.pop(hop_id, None) is None:
                return None  # the link's reader has already failed it upstream
            return self._lost(exc)
        return None

    async def _downstream_link(self) -> ActivationLink:
        assert self.next_hop is not None
        link = self._down
        if link is not None and not link.closed:
            return link
        link = await ActivationLink.connect(self.next_hop, self.secret, name=self.stage_id,
                                           timeout_s=self.connect_timeout_s,
                                           max_frame_bytes=self.max_frame_bytes)
        self._down = link
        self._spawn(self._read_downstream(link), f"pipe-down-{self.stage_id}")
        return link

    def _lost(self, exc: FlashpointError | None) -> FlashpointError:
        assert self.next_hop is not None
        nxt = self.next_hop.host_id
        if isinstance(exc, AuthFailed):
            return AuthFailed(f"stage {self.stage_id}: next stage {nxt}: {exc.message}",
                              stage=self.stage_id, next_stage=nxt)
        why = exc.message if exc is not None else "connection closed"
        return PeerLost(f"stage {self.stage_id}: next stage {nxt} lost: {why}",
                        stage=self.stage_id, next_stage=nxt,
                        cause=exc.code if exc is not None else "closed")

    async def _read_downstream(self, link: ActivationLink) -> None:
        """Relay replies upstream; when the link dies, fail what it still owed."""
        error: FlashpointError | None = None
        try:
            while True:
                frame = await link.recv(self.idle_timeout_s, self.io_timeout_s)
                if frame.head.kind is FrameKind.REQUEST:
                    raise ProtocolError(f"next stage {link.peer} sent a REQUEST upstream")
                route = self._routes.pop(frame.head.request_id, None)
                if route is None:
                    log.debug("stage_reply_unmatched", stage_id=self.stage_id,
                              trace_id=frame.head.trace_id)
                    continue
                await self._reply(route.upstream, frame.relabel(route.request_id), route.trace_id)
        except FlashpointError as exc:
            error = exc
        finally:
            link.close()
            if self._down is link:
                self._down = None
        log.warning("stage_next_lost", stage_id=self.stage_id, peer=link.peer,
                    error=error.message if error else "")
        owed = [(hop, r) for hop, r in self._routes.items() if r.downstream is link]
        for hop, _ in owed:
            del self._routes[hop]
        lost = self._lost(error)
        for _, r in owed:
            await self._reply(r.upstream, encode_error(r.request_id, r.trace_id, lost), r.trace_id)

    async def _expire_routes(self) -> None:
        """Fail requests whose reply is overdue (the next stage hangs but stays connected)."""
        cutoff = time.monotonic() - self.reply_timeout_s
        expired = []
        for hop, r in self._routes.items():  # insertion order = age order
            if r.created_s >= cutoff:
                break
            expired.append(hop)
        for hop in expired:
            r = self._routes.pop(hop)
            err = DeadlineExceeded(f"stage {self.stage_id}: no reply from the next stage in "
                                   f"{self.reply_timeout_s}s", stage=self.stage_id)
            await self._reply(r.upstream, encode_error(r.request_id, r.trace_id, err), r.trace_id)


# -- the stage process -----------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _layer(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def prepare_stage(manifest_path: str, first: int | str, last: int | str) -> tuple[Any, Any]:
    """What a stage can build before its bytes arrive: the manifest and the stage's layers
    on ``meta`` (``stage_skeleton``); pass both to :func:`load_stage_process`."""
    from flashpoint.models.publish import stage_skeleton
    from flashpoint.registry.manifest import Manifest

    manifest = Manifest.from_json(Path(manifest_path).read_text())
    return manifest, stage_skeleton(manifest, first, last)


def load_stage_process(manifest_path: str, blob_path: str, first: int | str, last: int | str,
                       device: str, *, prepared: tuple[Any, Any] | None = None,
                       ) -> tuple[Any, list[str], mmap.mmap]:
    """Map the stage's bytes of the blob copy-on-write and build layers first..last over
    them (no weight copy); ``prepared``: :func:`prepare_stage`'s result, built earlier."""
    from flashpoint.models.publish import load_stage
    from flashpoint.registry.manifest import byte_range_for_layers, layer_range

    manifest, skeleton = prepared if prepared is not None else prepare_stage(
        manifest_path, first, last)
    start, end = byte_range_for_layers(manifest, first, last)
    offset = start - start % mmap.ALLOCATIONGRANULARITY  # only this stage's pages are mapped
    with open(blob_path, "rb") as fh:
        # MAP_PRIVATE: a stray write copies a page instead of changing the shared bytes
        mapping = mmap.mmap(fh.fileno(), max(end - offset, 1), flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    module = load_stage(manifest, memoryview(mapping), first, last, device=device,
                        buffer_offset=offset, skeleton=skeleton)
    i, j = layer_range(manifest, first, last)
    return module, [layer.name for layer in manifest.layers[i:j + 1]], mapping


async def _serve(args: argparse.Namespace, prepared: tuple[Any, Any] | None = None) -> int:
    from flashpoint.config import secret_from_env

    secret = secret_from_env(args.secret_env)  # no built-in fallback; weak ones refused
    first, last = _layer(args.first), _layer(args.last)
    t_load0 = time.monotonic()
    module, layers, mapping = await asyncio.to_thread(
        load_stage_process, args.manifest, args.blob, first, last, args.device,
        prepared=prepared)
    t_load1 = time.monotonic()
    stage_id = args.stage_id or f"stage-{args.first}-{args.last}"
    server = StageServer(
        module, host=args.listen, port=args.port, secret=secret,
        next_hop=Endpoint.parse(args.next) if args.next else None, device=args.device,
        stage_id=stage_id, max_queued=args.max_queued,
        on_record=(lambda r: emit("request", **r.to_dict())) if args.events else None,
        sock=socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else None)
    ep = await server.start()
    emit("listening", addr=ep.addr, port=ep.port, stage_id=stage_id, pid=os.getpid(),
         layers=layers, next=args.next or None, t_load0=t_load0, t_load1=t_load1)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()
    # ``mapping`` stays open until the process exits: the stage's weights are views of it
    del mapping
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashpoint.pipeline.stage")
    p.add_argument("--manifest", required=True)
    p.add_argument("--blob", required=True)
    p.add_argument("--first", required=True, help="first layer (index or name)")
    p.add_argument("--last", required=True, help="last layer, inclusive (index or name)")
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--listen-fd", type=int, default=None,
                   help="serve this inherited listening socket instead of binding ADDR:PORT")
    p.add_argument("--next", default="", help="next stage as id:addr:port; none for the last")
    p.add_argument("--stage-id", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-queued", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--secret-env", default="FLASHPOINT_SECRET")
    p.add_argument("--events", action="store_true", help="one JSON line per request")
    return p


def main(argv: list[str] | None = None, *, prepared: tuple[Any, Any] | None = None) -> int:
    """The stage process; ``prepared``: :func:`prepare_stage`'s result for these
    arguments' manifest and layers, when the caller built it ahead (bench/_stage_pull.py)."""
    from flashpoint.log import configure

    args = _parser().parse_args(argv)
    configure(os.environ.get("FLASHPOINT_LOG_LEVEL", "WARNING"))
    torch.set_num_threads(args.torch_threads)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(_serve(args, prepared))
    except FlashpointError as exc:
        emit("error", code=exc.code, message=exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(main())
