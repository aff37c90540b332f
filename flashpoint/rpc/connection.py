"""One symmetric RPC connection over an authenticated channel.

Either side may ``call`` or ``notify`` the other; each side serves its own explicit handler
table. A handler is ``async def handler(conn, payload) -> dict | None``; it gets the
connection so a server can keep it as a handle to call back. Handlers run as tasks under the
caller's deadline; a CANCEL frame cancels them. A caller that times out or is cancelled sends
CANCEL. When the channel dies, every pending call fails with :class:`PeerLost`.

The caller's hot path creates no task: one future per call, resolved by the reader task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from flashpoint.errors import (
    DeadlineExceeded,
    FlashpointError,
    FrameTooLarge,
    PeerLost,
    ProtocolError,
    from_wire,
)
from flashpoint.log import bind_ids, get_logger
from flashpoint.rpc import frames, metrics
from flashpoint.rpc.channel import Channel

log = get_logger(__name__)

Handler = Callable[["RpcConnection", dict[str, Any]], Awaitable[dict[str, Any] | None]]
CloseCallback = Callable[["RpcConnection"], None]

NOTIFY_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 10.0


class RpcConnection:
    """A live RPC connection. Build through ``connect()`` or ``RpcServer``; call ``start()``
    once (it starts the reader task) before use."""

    def __init__(
        self,
        channel: Channel,
        handlers: Mapping[str, Handler],
        *,
        name: str,
        peer_name: str = "",
        max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
        on_close: CloseCallback | None = None,
        notify_timeout_s: float = NOTIFY_TIMEOUT_S,
    ) -> None:
        self._channel = channel
        self._handlers = dict(handlers)
        self.name = name
        self.peer_name = peer_name or channel.peer
        self._max = max_frame_bytes
        self._notify_timeout_s = notify_timeout_s
        self._close_callbacks: list[CloseCallback] = [on_close] if on_close else []
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._serving: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._closing = False
        self._finishing = False
        self._closed = asyncio.Event()
        self.close_reason: FlashpointError | None = None

    def __repr__(self) -> str:
        return f"RpcConnection({self.name!r} <-> {self.peer_name!r})"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("connection already started")
        self._reader = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"rpc-reader:{self.name}<-{self.peer_name}"
        )
        metrics.CONNECTIONS.inc()

    @property
    def closed(self) -> bool:
        return self._closing

    def add_close_callback(self, callback: CloseCallback) -> None:
        """``callback(conn)`` runs once, synchronously, when the connection closes."""
        if self._closed.is_set():
            callback(self)
        else:
            self._close_callbacks.append(callback)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        """Close the connection: fail pending calls, cancel running handlers. Idempotent."""
        reader = self._reader
        if reader is None:
            await self._finish(PeerLost("connection closed locally", peer=self.peer_name))
            return
        if reader is asyncio.current_task():
            return  # closing from a close callback: the reader is finishing already
        if not self._closing:
            self._closing = True
            reader.cancel()
        await asyncio.wait([reader])
        # A reader cancelled before its first step never ran its ``finally``.
        await self._finish(PeerLost("connection closed locally", peer=self.peer_name))

    # -- calls -----------------------------------------------------------------------------

    async def call(
        self, method: str, payload: dict[str, Any], *, timeout_s: float, trace: str | None = None
    ) -> dict[str, Any]:
        """Call ``method`` on the peer; returns its reply payload or raises its typed error.

        Raises DeadlineExceeded after ``timeout_s``, PeerLost if the connection dies,
        FrameTooLarge (before sending) if the request is over the frame limit.
        """
        if self._closing:
            raise PeerLost(f"connection to {self.peer_name} is closed", peer=self.peer_name)
        _check_outgoing(method, payload, trace)
        if not timeout_s > 0:  # also NaN
            raise DeadlineExceeded(f"{method}: no time left (timeout_s={timeout_s})", method=method)
        timeout_s = min(timeout_s, frames.MAX_TIMEOUT_S)
        self._next_id += 1
        rid = self._next_id
        data = frames.encode(frames.Request(rid, method, payload, timeout_s, trace), self._max)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        started = time.perf_counter()
        outcome = "ok"
        try:
            async with asyncio.timeout(timeout_s):
                # A send interrupted by the deadline or a cancel may still have gone out, so
                # both paths below send CANCEL; the peer ignores ids it does not know.
                await self._channel.send(data)
                return await fut
        except TimeoutError:
            outcome = DeadlineExceeded.code
            self._send_cancel(rid)
            raise DeadlineExceeded(
                f"{method} on {self.peer_name} took longer than {timeout_s}s",
                method=method,
                timeout_s=timeout_s,
            ) from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            if fut.cancelled() or not fut.done():  # awaiting it, it was cancelled with us
                self._send_cancel(rid)
            raise
        except FlashpointError as exc:
            outcome = exc.code
            raise
        finally:
            self._pending.pop(rid, None)
            metrics.observe_call(method, outcome, time.perf_counter() - started)

    async def notify(
        self,
        method: str,
        payload: dict[str, Any],
        *,
        timeout_s: float = SEND_TIMEOUT_S,
        trace: str | None = None,
    ) -> None:
        """Send a one-way message; returns once it is handed to the channel."""
        if self._closing:
            raise PeerLost(f"connection to {self.peer_name} is closed", peer=self.peer_name)
        _check_outgoing(method, payload, trace)
        data = frames.encode(frames.Notify(method, payload, trace), self._max)
        try:
            async with asyncio.timeout(timeout_s):
                await self._channel.send(data)
        except TimeoutError:
            raise DeadlineExceeded(f"notify {method} to {self.peer_name} stalled", method=method) from None

    def _send_cancel(self, rid: int) -> None:
        if self._closing:
            return
        self._spawn(self._send_quietly(frames.encode(frames.Cancel(rid))), f"rpc-cancel:{rid}")

    async def _send_quietly(self, data: bytes) -> None:
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await self._channel.send(data)
        except (TimeoutError, FlashpointError):
            pass

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- reading and serving ---------------------------------------------------------------

    async def _read_loop(self) -> None:
        reason: FlashpointError = PeerLost("connection closed locally", peer=self.peer_name)
        try:
            while True:
                data = await self._channel.recv()
                self._dispatch(frames.decode(data, self._max))
        except PeerLost as exc:
            reason = exc
        except (FrameTooLarge, ProtocolError) as exc:
            log.warning("rpc peer violated the protocol", peer=self.peer_name, error=exc.message)
            reason = PeerLost(f"connection to {self.peer_name} dropped: {exc.message}", peer=self.peer_name)
            await self._send_quietly(frames.encode(frames.Error(0, exc.to_wire())))
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug here must not leave callers hanging
            log.exception("rpc reader crashed", peer=self.peer_name)
            reason = PeerLost(f"connection to {self.peer_name} failed", peer=self.peer_name)
        finally:
            await self._finish(reason)

    def _dispatch(self, frame: frames.Frame) -> None:
        if type(frame) is frames.Response:
            fut = self._pending.get(frame.id)
            if fut is not None and not fut.done():
                fut.set_result(frame.payload)
        elif type(frame) is frames.Request:
            if frame.id in self._serving:
                raise ProtocolError(f"duplicate request id {frame.id}")
            task = asyncio.get_running_loop().create_task(
                self._serve(frame), name=f"rpc-handler:{frame.method}:{frame.id}"
            )
            self._serving[frame.id] = task
        elif type(frame) is frames.Error:
            fut = self._pending.get(frame.id)
            if fut is not None and not fut.done():
                fut.set_exception(from_wire(frame.error))
            elif frame.id == 0:
                log.warning("rpc peer reported an error", peer=self.peer_name, error=frame.error)
        elif type(frame) is frames.Cancel:
            task = self._serving.get(frame.id)
            if task is not None:
                task.cancel()
        elif type(frame) is frames.Notify:
            self._spawn(self._serve_notify(frame), f"rpc-notify:{frame.method}")
        else:
            raise ProtocolError(f"unexpected {type(frame).__name__} frame after the handshake")

    async def _serve(self, req: frames.Request) -> None:
        handler = self._handlers.get(req.method)
        label = req.method if handler is not None else "<unknown>"
        try:
            if handler is None:
                raise ProtocolError(f"unknown method {req.method!r}", method=req.method)
            if req.trace is not None:
                bind_ids(request_id=req.trace)
            deadline = asyncio.timeout(req.timeout_s)
            try:
                async with deadline:
                    result = await handler(self, req.payload)
            except TimeoutError:
                if not deadline.expired():
                    raise
                raise DeadlineExceeded(
                    f"{req.method} took longer than {req.timeout_s}s", method=req.method
                ) from None
            if result is None:
                result = {}
            elif not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not dict")
            reply: bytes = self._encode_reply(frames.Response(req.id, result), req.method)
            outcome = "ok"
        except asyncio.CancelledError:
            metrics.observe_handled(label, "cancelled")
            raise  # the caller gave up (CANCEL) or we are closing: nobody wants a reply
        except FlashpointError as exc:
            outcome = exc.code
            reply = frames.encode(frames.Error(req.id, exc.to_wire()))
        except Exception as exc:
            log.exception("rpc handler failed", method=req.method, peer=self.peer_name)
            outcome = "internal"
            err = FlashpointError(
                f"internal error in {req.method}: {type(exc).__name__}", exc_type=type(exc).__name__
            )
            reply = frames.encode(frames.Error(req.id, err.to_wire()))
        finally:
            self._serving.pop(req.id, None)
        metrics.observe_handled(label, outcome)
        await self._send_quietly(reply)

    def _encode_reply(self, frame: frames.Response, method: str) -> bytes:
        try:
            return frames.encode(frame, self._max)
        except FlashpointError as exc:  # too large or unencodable: tell the caller why
            log.warning("rpc reply not sendable", method=method, error=exc.message)
            return frames.encode(frames.Error(frame.id, exc.to_wire()))

    async def _serve_notify(self, note: frames.Notify) -> None:
        handler = self._handlers.get(note.method)
        if handler is None:
            log.warning("rpc notify for unknown method", method=note.method, peer=self.peer_name)
            metrics.observe_handled("<unknown>", ProtocolError.code)
            return
        if note.trace is not None:
            bind_ids(request_id=note.trace)
        try:
            async with asyncio.timeout(self._notify_timeout_s):
                await handler(self, note.payload)
            metrics.observe_handled(note.method, "ok")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("rpc notify handler failed", method=note.method, error=repr(exc), exc_info=True)
            metrics.observe_handled(note.method, getattr(exc, "code", "internal"))

    async def _finish(self, reason: FlashpointError) -> None:
        if self._finishing:
            await self._closed.wait()
            return
        self._finishing = True
        self._closing = True
        self.close_reason = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PeerLost(reason.message, peer=self.peer_name))
        self._pending.clear()
        tasks = [*self._serving.values(), *self._background]
        for task in tasks:
            task.cancel()
        await self._channel.close()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        if self._reader is not None:
            metrics.CONNECTIONS.dec()
        self._closed.set()
        log.info("rpc connection closed", name=self.name, peer=self.peer_name, reason=reason.message)
        for callback in self._close_callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("rpc close callback failed", peer=self.peer_name)


def _check_outgoing(method: str, payload: Any, trace: str | None) -> None:
    """Refuse locally what the peer would treat as a protocol violation (and drop us for)."""
    if not isinstance(method, str) or not 0 < len(method) <= frames.MAX_METHOD_CHARS:
        raise ProtocolError(f"invalid method name {method!r:.60}")
    if not isinstance(payload, dict):
        raise ProtocolError(f"payload must be a dict, not {type(payload).__name__}")
    if trace is not None and (not isinstance(trace, str) or len(trace) > frames.MAX_METHOD_CHARS):
        raise ProtocolError("trace must be a short string")
