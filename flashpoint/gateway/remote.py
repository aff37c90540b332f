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

Wire forms of the gateway's types live here too; the controller side is
``flashpoint.controller.gateway_service``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from flashpoint import tracing
from flashpoint.errors import (
    ConnectFailed,
    DeadlineExceeded,
    FlashpointError,
    FunctionNotFound,
    PeerLost,
    Unavailable,
)
from flashpoint.gateway.backend import FunctionInfo, InvokeResult, StreamChunk
from flashpoint.gateway.streams import StreamRegistry, stream_invocation
from flashpoint.log import get_logger
from flashpoint.rpc.backoff import Backoff
from flashpoint.rpc.client import ReconnectingClient
from flashpoint.spec import FunctionSpec
from flashpoint.tensors import decode_tensors, encode_tensors

log = get_logger(__name__)

GATEWAY_RPC_VERSION = 1
# Reconnect quickly: a restarting controller is back within seconds and requests are waiting.
RECONNECT = Backoff(initial_s=0.05, max_s=0.5)
RETRY = Backoff(initial_s=0.02, max_s=0.5)
MAX_ATTEMPTS = 200  # bounds the retry loop; the request's deadline normally ends it first
CALL_TIMEOUT_S = 10.0  # functions/register/delete calls


def result_to_wire(result: InvokeResult) -> dict[str, Any]:
    return {"v": GATEWAY_RPC_VERSION, "outputs": encode_tensors(result.outputs),
            "timings_s": result.timings_s, "replica_id": result.replica_id,
            "cold": result.cold, "cold_start_source": result.cold_start_source}


def result_from_wire(reply: dict[str, Any]) -> InvokeResult:
    return InvokeResult(decode_tensors(reply.get("outputs")),
                        {str(k): float(v) for k, v in (reply.get("timings_s") or {}).items()},
                        str(reply.get("replica_id", "")), bool(reply.get("cold", False)),
                        str(reply.get("cold_start_source", "")))


def info_from_wire(d: dict[str, Any]) -> FunctionInfo:
    reason = d.get("reason")
    return FunctionInfo(FunctionSpec.from_dict(d["spec"]), bool(d["ready"]),
                        int(d["replicas_warm"]), int(d["replicas_starting"]), int(d["queued"]),
                        dict(reason) if isinstance(reason, dict) else None,
                        dict(d.get("rollout") or {}))


def _check_reply(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("v") != GATEWAY_RPC_VERSION:
        raise Unavailable(f"controller speaks gateway protocol {reply.get('v')!r}, "
                          f"this gateway {GATEWAY_RPC_VERSION}", retry_after_s=5.0)
    return reply


def connection_lost(exc: BaseException) -> bool:
    """Failures that say nothing about the request itself: the controller was unreachable."""
    return isinstance(exc, (ConnectFailed, PeerLost))


def never_reached(exc: BaseException) -> bool:
    """The call cannot have reached the controller (no connection was made): safe to re-send
    even what must not run twice."""
    return isinstance(exc, ConnectFailed)


class RemoteBackend:
    """``InvokeBackend`` over RPC to the controller at ``controller_url``."""

    def __init__(self, controller_url: str, *, secret: bytes, refresh_s: float = 0.5,
                 max_frame_bytes: int | None = None,
                 ssl_context: ssl.SSLContext | None = None, name: str = "gateway-admin") -> None:
        """``secret`` is the key of principal ``name`` (rpc/roles.py): ``"gateway"``'s, or
        the cluster secret itself under any non-role name."""
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
        self._task: asyncio.Task[None] | None = None
        self.retries = 0  # calls that met an unreachable controller and were re-sent
        self.held = 0  # calls that found no connection and waited for the controller

    async def start(self) -> None:
        await self._client.start()
        self._task = asyncio.get_running_loop().create_task(self._refresh_loop(),
                                                            name="gateway-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
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
        reply = _check_reply(await self._client.call(
            "gw_functions", {"v": GATEWAY_RPC_VERSION}, timeout_s=timeout_s))
        self._functions = {i.spec.name: i for i in map(info_from_wire, reply["functions"])}
        self._status = dict(reply.get("status") or {})
        self._ready = bool(reply.get("ready"))
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
        reply = await self.call_retrying(
            "gw_register", {"v": GATEWAY_RPC_VERSION, "spec": spec.to_dict()},
            CALL_TIMEOUT_S, connection_lost)
        info = info_from_wire(reply["info"])
        self._functions[info.spec.name] = info
        return info

    async def delete_function(self, name: str) -> None:
        # Not idempotent in its answer (a second delete is a 404): retried only if it never
        # reached the controller.
        await self.call_retrying("gw_delete", {"v": GATEWAY_RPC_VERSION, "name": name},
                                 CALL_TIMEOUT_S, never_reached)
        self._functions.pop(name, None)

    async def invoke(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                     timeout_s: float | None = None,
                     request_class: str = "strict") -> InvokeResult:
        timeout = timeout_s if timeout_s is not None else 60.0
        payload = {"v": GATEWAY_RPC_VERSION, "name": name, "inputs": encode_tensors(inputs),
                   "request_id": request_id, "timeout_s": timeout,
                   "request_class": request_class}
        tracing.inject(payload)  # the controller's span joins this request's trace
        return result_from_wire(await self.call_retrying("gw_invoke", payload, timeout,
                                                         connection_lost, trace=request_id))

    def invoke_stream(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                      timeout_s: float | None = None, request_class: str = "strict"
                      ) -> AsyncIterator[StreamChunk | InvokeResult]:
        """The controller's ``gw_stream``: chunks as they come, then the result. Never
        re-sent (its tokens may have gone out already); closing it early cancels the call."""
        timeout = timeout_s if timeout_s is not None else 60.0
        payload = {"v": GATEWAY_RPC_VERSION, "name": name, "inputs": encode_tensors(inputs),
                   "request_id": request_id, "timeout_s": timeout,
                   "request_class": request_class}

        async def call() -> InvokeResult:
            conn = await self._client.wait_connected(timeout)
            self._streams.sent(request_id, conn)
            return result_from_wire(_check_reply(await conn.call(
                "gw_stream", payload, timeout_s=timeout, trace=request_id)))

        return stream_invocation(self._streams, request_id, call)

    async def call_retrying(self, method: str, payload: dict[str, Any], timeout_s: float,
                            retry_on: Any, trace: str | None = None) -> dict[str, Any]:
        """``method`` until it answers, re-sent after the failures ``retry_on`` accepts,
        all within ``timeout_s`` (each attempt gets what is left). Also the transport of
        ``gateway/remote_kaas.py``."""
        deadline = time.monotonic() + timeout_s
        delays = RETRY.delays()
        last: FlashpointError | None = None
        if self._client.connection is None:
            self.held += 1  # the call below waits for the controller (within the deadline)
        for _ in range(MAX_ATTEMPTS):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if "timeout_s" in payload:
                payload["timeout_s"] = left  # the controller's deadline is what is left
            try:
                return _check_reply(await self._client.call(method, payload, timeout_s=left,
                                                            trace=trace))
            except FlashpointError as exc:
                if not retry_on(exc):
                    raise
                last = exc
                self.retries += 1
            with contextlib.suppress(StopIteration):
                await asyncio.sleep(min(next(delays), max(0.0, deadline - time.monotonic())))
        msg = f"{method}: the controller did not answer within {timeout_s:g}s"
        if last is not None:
            msg += f" (last: {last.message})"
        raise DeadlineExceeded(msg, timeout_s=timeout_s)
