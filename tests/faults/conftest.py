"""Servers for the fault-injection fuzz tests: the gateway and an RPC server on 127.0.0.1.

Each runs on an event loop in a background thread, started once per test module, so the
synchronous hypothesis tests can drive them with ordinary sockets (``http.client``, raw TCP)
or submit client coroutines to the same loop with a hard timeout (:meth:`LoopThread.run`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
from aiohttp import web

from flashpoint.errors import BadRequest, Conflict, FunctionNotFound
from flashpoint.gateway import RUNNER_KWARGS, FunctionInfo, GatewayConfig, InvokeResult, make_app
from flashpoint.rpc import RpcConnection, RpcServer
from flashpoint.spec import FunctionSpec, TensorSpec

T = TypeVar("T")

SECRET = b"fault-fuzz-cluster-secret"
ADMIN_KEY = "fuzz-admin-key-0123456789"
INVOKE_KEY = "fuzz-invoke-key-0123456789"
# The fuzzers may register or delete functions; these stay put so the liveness probe works.
RESERVED = frozenset(("echo", "typed"))
RPC_MAX_FRAME_BYTES = 64 * 1024


class LoopThread:
    """An asyncio loop running in a daemon thread; ``run`` waits with a hard timeout."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self) -> LoopThread:
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise AssertionError(f"coroutine did not finish within {timeout_s} s (a hang)") from None

    def stop(self) -> None:
        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            if rest:
                await asyncio.wait(rest, timeout=2.0)

        if self._thread.is_alive():
            self.run(cancel_rest(), timeout_s=5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
        self.loop.close()


class EchoBackend:
    """An in-memory InvokeBackend whose every function returns ``{"<input>_out": input}``.

    Functions that declare inputs check names and datatypes (BadRequest otherwise), as the
    controller does, so a declared output type always fits what the echo returns. Only
    FlashpointErrors leave it: a 500 in the fuzz tests is then the gateway's own fault.
    """

    def __init__(self) -> None:
        t = TensorSpec
        self.functions: dict[str, FunctionSpec] = {
            "echo": FunctionSpec(name="echo", model="echo"),
            "typed": FunctionSpec(name="typed", model="echo", inputs=(t("x", "FP32", (-1,)),),
                                  outputs=(t("x_out", "FP32", (-1,)),)),
        }

    @staticmethod
    def _info(spec: FunctionSpec) -> FunctionInfo:
        return FunctionInfo(spec=spec, ready=True, replicas_warm=1, replicas_starting=0, queued=0)

    async def register_function(self, spec: FunctionSpec) -> FunctionInfo:
        if spec.name in RESERVED:
            raise Conflict(f"function {spec.name!r} is reserved by the fuzz tests")
        if len(self.functions) < 256:  # bounded: the fuzzer registers many
            self.functions[spec.name] = spec
        return self._info(spec)

    async def delete_function(self, name: str) -> None:
        if name in RESERVED:
            raise Conflict(f"function {name!r} is reserved by the fuzz tests")
        if self.functions.pop(name, None) is None:
            raise FunctionNotFound(f"function {name!r} not found")

    def list_functions(self) -> list[FunctionInfo]:
        return [self._info(s) for s in self.functions.values()]

    def function_spec(self, name: str) -> FunctionSpec:
        return self.get_function(name).spec

    def get_function(self, name: str) -> FunctionInfo:
        spec = self.functions.get(name)
        if spec is None:
            raise FunctionNotFound(f"function {name!r} not found")
        return self._info(spec)

    async def invoke(self, name: str, inputs: dict[str, np.ndarray], *, request_id: str,
                     timeout_s: float | None = None,
                     request_class: str = "strict") -> InvokeResult:
        spec = self.get_function(name).spec
        if spec.inputs:
            want = {t.name: t.datatype for t in spec.inputs}
            if set(inputs) != set(want) or any(
                inputs[k].dtype != np.float32 for k, dt in want.items() if dt == "FP32"
            ):
                raise BadRequest(f"inputs do not match {name!r}'s signature {want}")
        return InvokeResult(outputs={f"{k}_out": v for k, v in inputs.items()},
                            timings_s={"total": 0.0}, replica_id="rep-fuzz")

    def cluster_status(self) -> dict[str, Any]:
        return {"hosts": [], "functions": len(self.functions)}

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return True


class GatewayServer:
    """The gateway app served as in production (``RUNNER_KWARGS``) on 127.0.0.1:<port>."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.backend = EchoBackend()
        self.loop = LoopThread("fuzz-gateway").start()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _start(self) -> None:
        app = make_app(self.backend, self.config)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.25, **RUNNER_KWARGS)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> GatewayServer:
        self.loop.run(self._start())
        return self

    def stop(self) -> None:
        if self.runner is not None:
            self.loop.run(self.runner.cleanup())
        self.loop.stop()


# Small limits keep bombs and oversized bodies cheap to build; a short body timeout keeps a
# request whose body never fully arrives from stalling a test.
FUZZ_CONFIG = dict(deadline_grace_s=0.1, max_body_bytes=128 * 1024,
                   max_decompressed_bytes=256 * 1024, max_tensor_bytes=1 << 20,
                   body_read_timeout_s=2.0)


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayServer]:
    server = GatewayServer(GatewayConfig(**FUZZ_CONFIG)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_gateway() -> Iterator[GatewayServer]:
    server = GatewayServer(GatewayConfig(api_keys={ADMIN_KEY: "admin", INVOKE_KEY: "invoke"},
                                         **FUZZ_CONFIG)).start()
    yield server
    server.stop()


async def _echo(conn: RpcConnection, payload: dict[str, Any]) -> dict[str, Any]:
    return payload


class RpcFuzzServer:
    """An RpcServer with one ``echo`` method, served over WebSockets on 127.0.0.1."""

    def __init__(self) -> None:
        self.loop = LoopThread("fuzz-rpc").start()
        self.server = RpcServer({"echo": _echo}, secret=SECRET, name="fuzz-server",
                                max_frame_bytes=RPC_MAX_FRAME_BYTES, heartbeat_s=None,
                                handshake_timeout_s=2.0)
        self.url = ""

    def start(self) -> RpcFuzzServer:
        host, port = self.loop.run(self.server.start("127.0.0.1", 0))
        self.url = f"ws://{host}:{port}/rpc"
        return self

    def stop(self) -> None:
        self.loop.run(self.server.stop(timeout_s=5.0), timeout_s=10.0)
        self.loop.stop()


@pytest.fixture(scope="module")
def rpc_server() -> Iterator[RpcFuzzServer]:
    server = RpcFuzzServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread("fuzz-loop").start()
    yield lt
    lt.stop()
