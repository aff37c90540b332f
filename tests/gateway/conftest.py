"""A small in-memory InvokeBackend and a real-port gateway server for the gateway tests.

The server runs in a background thread with its own event loop so the synchronous
``tritonclient.http`` client, ``http.client`` and aiohttp clients can all drive it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from flashpoint.errors import FunctionNotFound, ModelFailed, ModelNotFound, Overloaded
from flashpoint.gateway import FunctionInfo, GatewayConfig, InvokeResult, make_app
from flashpoint.spec import FunctionSpec, TensorSpec

ADMIN_KEY = "admin-key-0123456789"
INVOKE_KEY = "invoke-key-0123456789"


class FakeBackend:
    """Functions dispatch on their ``model`` name:

    identity  -> ``{"<input>_out": input}`` for every input
    double    -> ``{"y": x * 2}``
    busy      -> Overloaded(retry_after_s=2)
    sleepy    -> sleeps 30 s, ignoring its deadline (the gateway backstop must fire)
    crash     -> RuntimeError with a secret message (must never reach the client)
    failing   -> ModelFailed
    weird     -> an output with a dtype OIP cannot carry (complex)
    """

    def __init__(self) -> None:
        self.functions: dict[str, FunctionSpec] = {}
        self.live = True
        self.ready = True
        self.calls: list[dict[str, Any]] = []
        self.not_ready: dict[str, dict[str, Any]] = {}  # function -> its not-ready reason

    def _info(self, spec: FunctionSpec) -> FunctionInfo:
        reason = self.not_ready.get(spec.name)
        return FunctionInfo(spec=spec, ready=reason is None, replicas_warm=int(reason is None),
                            replicas_starting=0, queued=0, reason=reason)

    async def register_function(self, spec: FunctionSpec) -> FunctionInfo:
        if spec.model == "missing":
            raise ModelNotFound(f"model {spec.model!r} not in the registry")
        self.functions[spec.name] = spec
        return self._info(spec)

    async def delete_function(self, name: str) -> None:
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
        self.calls.append({"name": name, "inputs": inputs, "request_id": request_id,
                           "request_class": request_class, "timeout_s": timeout_s})
        if spec.model == "identity":
            outputs = {f"{k}_out": v for k, v in inputs.items()}
        elif spec.model == "double":
            outputs = {"y": np.asarray(inputs["x"]) * 2}
        elif spec.model == "busy":
            raise Overloaded("all replicas busy", retry_after_s=2)
        elif spec.model == "sleepy":
            await asyncio.sleep(30)
            outputs = {}
        elif spec.model == "crash":
            raise RuntimeError("secret internal detail")
        elif spec.model == "failing":
            raise ModelFailed("the model raised ValueError")
        elif spec.model == "weird":
            outputs = {"z": np.zeros(2, dtype=np.complex64)}
        else:
            raise ModelFailed(f"unknown fake model {spec.model!r}")
        return InvokeResult(outputs=outputs, timings_s={"queue": 0.0, "inference": 0.001,
                                                        "total": 0.001},
                            replica_id="rep-1", cold=False)

    def cluster_status(self) -> dict[str, Any]:
        return {"hosts": [{"id": "h1", "devices": ["cpu:0"]}], "functions": len(self.functions)}

    def is_live(self) -> bool:
        return self.live

    def is_ready(self) -> bool:
        return self.ready


def default_functions() -> list[FunctionSpec]:
    t = TensorSpec
    return [
        FunctionSpec(name="identity", model="identity"),
        FunctionSpec(name="double", model="double", model_version="3",
                     inputs=(t("x", "FP32", (-1, -1)),), outputs=(t("y", "FP32", (-1, -1)),)),
        FunctionSpec(name="half", model="double", inputs=(t("x", "BF16", (-1,)),),
                     outputs=(t("y", "BF16", (-1,)),)),
        FunctionSpec(name="busy", model="busy"),
        FunctionSpec(name="slow", model="sleepy", timeout_s=0.2),
        FunctionSpec(name="crash", model="crash"),
        FunctionSpec(name="failing", model="failing"),
        FunctionSpec(name="weird", model="weird"),
    ]


class ThreadedServer:
    """The gateway app on 127.0.0.1:<random port>, served from a background thread."""

    def __init__(self, app: web.Application, *, auto_decompress: bool) -> None:
        self.app = app
        self.auto_decompress = auto_decompress
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="gateway-test-server",
                                       daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.runner = web.AppRunner(self.app, auto_decompress=self.auto_decompress,
                                    shutdown_timeout=0.25)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> ThreadedServer:
        self.thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("gateway test server did not start within 10 s")
        if self._error is not None:
            raise RuntimeError("gateway test server failed to start") from self._error
        return self

    def stop(self) -> None:
        if self.runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
            fut.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


ServerFactory = Callable[..., ThreadedServer]


@pytest.fixture
def backend() -> FakeBackend:
    b = FakeBackend()
    for spec in default_functions():
        b.functions[spec.name] = spec
    return b


@pytest.fixture
def make_server(backend: FakeBackend) -> Iterator[ServerFactory]:
    servers: list[ThreadedServer] = []

    def factory(config: GatewayConfig | None = None, *, auto_decompress: bool = False,
                app_backend: Any = None) -> ThreadedServer:
        cfg = config or GatewayConfig(deadline_grace_s=0.1)
        app = make_app(app_backend or backend, cfg)
        server = ThreadedServer(app, auto_decompress=auto_decompress).start()
        servers.append(server)
        return server

    yield factory
    for s in servers:
        s.stop()


@pytest.fixture
def server(make_server: ServerFactory) -> ThreadedServer:
    """Auth off (the local default), small limits so the limit tests stay fast.

    Runs with ``RUNNER_KWARGS`` (auto_decompress=False); tests of aiohttp's own inflation
    ask ``make_server(auto_decompress=True)``.
    """
    return make_server(GatewayConfig(deadline_grace_s=0.1, max_body_bytes=1 << 20,
                                     max_decompressed_bytes=2 << 20, max_tensor_bytes=4 << 20))


@pytest.fixture
def auth_server(make_server: ServerFactory) -> ThreadedServer:
    return make_server(GatewayConfig(api_keys={ADMIN_KEY: "admin", INVOKE_KEY: "invoke"},
                                     deadline_grace_s=0.1))
