"""A gateway in its own process: an ``InvokeBackend`` that forwards to the controller over RPC.

The controller process also serves the API itself (the fast path on one machine); a
stand-alone gateway (``flashpoint gateway``) is for deployments where clients must not see a
controller restart. It keeps no state of its own beyond a cached copy of the function table
(refreshed every ``refresh_s``), so:

- while the controller is down, requests wait for it to come back — within their own
  deadline — instead of failing: invocations are retried after connection failures and lost
  connections (inference is idempotent, so a request that may already have run can run
  again); registrations too (an upsert of the same spec); deletions only when they never
  reached the controller;
- errors the controller answers (unknown function, bad input, overload with Retry-After) go
  to the client as they are: retrying those would only hide them;
- a function registered through another gateway is visible here after one refresh.

The messages are ``flashpoint.messages.gateway_controller``'s; the conversions between them and
the gateway's own types live here, and the controller side is
``flashpoint.controller.gateway_service``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
import numpy as np

from flashpoint import tracing
from flashpoint.actor import Actor
from flashpoint.errors import (
    ConnectFailed,
    DeadlineExceeded,
    FlashpointError,
    FunctionNotFound,
    PeerLost,
)
from flashpoint.gateway.backend import FunctionInfo, InvokeResult, StreamChunk
from flashpoint.gateway.streams import StreamRegistry, stream_invocation
from flashpoint.log import get_logger
from flashpoint.messages.gateway_controller import (
    Ack,
    DeleteRequest,
    FunctionInfoWire,
    FunctionsReply,
    FunctionsRequest,
    GatewayMessage,
    InvokeReply,
    InvokeRequest,
    RegisterReply,
    RegisterRequest,
    decode,
    encode,
)
from flashpoint.rpc.backoff import Backoff, retry
from flashpoint.rpc.client import ReconnectingClient
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import decode_tensors, encode_tensors

log = get_logger(__name__)

R = TypeVar("R", bound=GatewayMessage)
# Reconnect quickly: a restarting controller is back within seconds and requests are waiting.
RECONNECT = Backoff(initial_s=0.05, max_s=0.5)
RETRY = Backoff(initial_s=0.02, max_s=0.5)
MAX_ATTEMPTS = 200  # bounds the retry loop; the request's deadline normally ends it first
CALL_TIMEOUT_S = 10.0  # functions/register/delete calls


def result_to_wire(result: InvokeResult) -> InvokeReply:
    return InvokeReply(outputs=encode_tensors(result.outputs), timings_s=result.timings_s,
                       replica_id=result.replica_id, cold=result.cold,
                       cold_start_source=result.cold_start_source)


def result_from_wire(reply: InvokeReply) -> InvokeResult:
    return InvokeResult(decode_tensors(reply.outputs), dict(reply.timings_s), reply.replica_id,
                        reply.cold, reply.cold_start_source)


def info_to_wire(info: FunctionInfo) -> FunctionInfoWire:
    return FunctionInfoWire(spec=info.spec.to_dict(), ready=info.ready,
                            replicas_warm=info.replicas_warm,
                            replicas_starting=info.replicas_starting, queued=info.queued,
                            rollout=info.rollout, reason=info.reason)


def info_from_wire(w: FunctionInfoWire) -> FunctionInfo:
    return FunctionInfo(FunctionSpec.from_dict(w.spec), w.ready, w.replicas_warm,
                        w.replicas_starting, w.queued,
                        dict(w.reason) if w.reason is not None else None, dict(w.rollout))


def connection_lost(exc: BaseException) -> bool:
    """Failures that say nothing about the request itself: the controller was unreachable."""
    return isinstance(exc, (ConnectFailed, PeerLost))


def never_reached(exc: BaseException) -> bool:
    """The call cannot have reached the controller (no connection was made): safe to re-send
    even what must not run twice."""
    return isinstance(exc, ConnectFailed)


class RemoteBackend(Actor):
    """``InvokeBackend`` over RPC to the controller at ``controller_url``; an
    :class:`~flashpoint.actor.Actor` owning the table's refresh loop."""

    def __init__(self, controller_url: str, *, secret: bytes, refresh_s: float = 0.5,
                 max_frame_bytes: int | None = None,
                 ssl_context: ssl.SSLContext | None = None, name: str = "gateway-admin",
                 loop_lag_interval_s: float | None = None) -> None:
        """``secret`` is the key of principal ``name`` (rpc/roles.py): ``"gateway"``'s, or
        the cluster secret itself under any non-role name. ``loop_lag_interval_s``: sample
        the event loop's lag (the stand-alone gateway's process does; see flashpoint/actor.py)."""
        super().__init__("gateway", loop_lag_interval_s=loop_lag_interval_s)
        kwargs: dict[str, Any] = {"ssl_context": ssl_context}
        if max_frame_bytes is not None:
            kwargs["max_frame_bytes"] = max_frame_bytes
        self._streams = StreamRegistry()  # streamed generations (gateway/streams.py)
        self._client = ReconnectingClient(controller_url, {"gw_chunk": self._streams.on_chunk},
                                          secret=secret, name=name, backoff=RECONNECT,
                                          **kwargs)
        self.refresh_s = refresh_s
        self._functions: dict[str, FunctionInfo] = {}
        self._status: dict[str, Any] = {}
        self._ready = False
        self._refreshed_s = 0.0  # monotonic time of the last good refresh
        self.retries = 0  # calls that met an unreachable controller and were re-sent
        self.held = 0  # calls that found no connection and waited for the controller

    async def on_start(self) -> None:
        await self._client.start()
        self.spawn(self._refresh_loop(), "refresh")

    async def on_stop(self, timeout_s: float) -> None:
        await self._client.stop()

    @property
    def connection(self) -> Any:
        """The live RPC connection to the controller, or None while (re)connecting."""
        return self._client.connection

    @property
    def connected(self) -> bool:
        return self._client.connection is not None

    # -- the function table ------------------------------------------------------------------
    async def refresh(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        reply = decode(FunctionsReply, await self._client.call(
            "gw_functions", encode(FunctionsRequest()), timeout_s=timeout_s),
            method="gw_functions", reply=True)
        self._functions = {i.spec.name: i for i in map(info_from_wire, reply.functions)}
        self._status = dict(reply.status)
        self._ready = reply.ready
        self._refreshed_s = time.monotonic()

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh(timeout_s=max(self.refresh_s * 4, 1.0))
            except FlashpointError as exc:
                log.debug("gateway_refresh_failed", error=exc.message)
            except Exception:  # never let the table go stale for good
                log.exception("gateway_refresh_crashed")
            await asyncio.sleep(self.refresh_s)

    def list_functions(self) -> list[FunctionInfo]:
        return list(self._functions.values())

    def get_function(self, name: str) -> FunctionInfo:
        info = self._functions.get(name)
        if info is None:
            raise FunctionNotFound(f"function {name!r} is not registered")
        return info

    def function_spec(self, name: str) -> FunctionSpec:
        return self.get_function(name).spec

    def cluster_status(self) -> dict[str, Any]:
        age = time.monotonic() - self._refreshed_s if self._refreshed_s else None
        return {**self._status, "gateway": {
            "controller_connected": self.connected,
            "table_age_s": round(age, 3) if age is not None else None,
            "retries": self.retries, "held": self.held}}

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return self.connected and self._ready

    # -- calls ---------------------------------------------------------------------------
    async def register_function(self, spec: FunctionSpec) -> FunctionInfo:
        reply = await self.call_retrying("gw_register", RegisterRequest(spec=spec.to_dict()),
                                         RegisterReply, CALL_TIMEOUT_S, connection_lost)
        info = info_from_wire(reply.info)
        self._functions[info.spec.name] = info
        return info

    async def delete_function(self, name: str) -> None:
        # Not idempotent in its answer (a second delete is a 404): retried only if it never
        # reached the controller.
        await self.call_retrying("gw_delete", DeleteRequest(name=name), Ack, CALL_TIMEOUT_S,
                                 never_reached)
        self._functions.pop(name, None)

    async def invoke(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                     timeout_s: float | None = None,
                     request_class: str = "strict") -> InvokeResult:
        timeout = timeout_s if timeout_s is not None else 60.0
        msg = InvokeRequest(name=name, inputs=encode_tensors(inputs), request_id=request_id,
                            timeout_s=timeout, request_class=request_class,
                            traceparent=tracing.traceparent())
        return result_from_wire(await self.call_retrying("gw_invoke", msg, InvokeReply, timeout,
                                                         connection_lost, trace=request_id))

    def invoke_stream(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                      timeout_s: float | None = None, request_class: str = "strict"
                      ) -> AsyncIterator[StreamChunk | InvokeResult]:
        """The controller's ``gw_stream``: chunks as they come, then the result. Never
        re-sent (its tokens may have gone out already); closing it early cancels the call."""
        timeout = timeout_s if timeout_s is not None else 60.0
        payload = encode(InvokeRequest(name=name, inputs=encode_tensors(inputs),
                                           request_id=request_id, timeout_s=timeout,
                                           request_class=request_class))

        async def call() -> InvokeResult:
            conn = await self._client.wait_connected(timeout)
            self._streams.sent(request_id, conn)
            return result_from_wire(decode(InvokeReply, await conn.call(
                "gw_stream", payload, timeout_s=timeout, trace=request_id),
                method="gw_stream", reply=True))

        return stream_invocation(self._streams, request_id, call)

    async def call_retrying(self, method: str, msg: GatewayMessage, reply: type[R],
                            timeout_s: float, retry_on: Callable[[BaseException], bool],
                            trace: str | None = None) -> R:
        """``method`` until it answers ``reply``, re-sent after the failures ``retry_on``
        accepts, all within ``timeout_s`` (each attempt gets what is left, and a message with
        a ``timeout_s`` of its own carries that too). Also the transport of
        ``gateway/remote_kaas.py``."""
        deadline = time.monotonic() + timeout_s
        last: list[BaseException] = []
        if self._client.connection is None:
            self.held += 1  # the call below waits for the controller (within the deadline)

        def out_of_time() -> DeadlineExceeded:
            text = f"{method}: the controller did not answer within {timeout_s:g}s"
            if last and isinstance(last[-1], FlashpointError):
                text += f" (last: {last[-1].message})"
            return DeadlineExceeded(text, timeout_s=timeout_s)

        async def attempt() -> R:
            left = deadline - time.monotonic()
            if left <= 0:
                raise out_of_time()
            sent = msg
            if "timeout_s" in msg.__struct_fields__:
                # The controller's deadline is what is left.
                sent = msgspec.structs.replace(msg, timeout_s=left)  # type: ignore[call-arg]
            return decode(reply, await self._client.call(method, encode(sent), timeout_s=left,
                                                         trace=trace),
                          method=method, reply=True)

        def retried(exc: BaseException) -> None:
            last.append(exc)
            self.retries += 1

        try:
            return await retry(attempt, attempts=MAX_ATTEMPTS, total_timeout_s=timeout_s,
                               backoff=RETRY, what=method, until_deadline=True,
                               retry_on=lambda e: isinstance(e, FlashpointError)
                               and not isinstance(e, DeadlineExceeded) and retry_on(e),
                               on_retry=retried)
        except FlashpointError as exc:
            if isinstance(exc, DeadlineExceeded) or not retry_on(exc):
                raise
            last.append(exc)
            raise out_of_time() from exc  # attempts ran out while the controller was away
