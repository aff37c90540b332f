"""Python clients for the native ``/v1`` API of a controller or a stand-alone gateway.

    async with AsyncClient("http://127.0.0.1:8080", api_key=KEY) as fp:
        await fp.deploy("bert-fn", "bert", max_batch_size=4)
        result = await fp.invoke("bert-fn", {"input_ids": np.array([[1, 2, 3]])})
        result.outputs["logits"]            # a numpy array, dtype and shape as served

    with Client("http://127.0.0.1:8080") as fp:   # the same methods, blocking
        fp.invoke("bert-fn", {"input_ids": ids}).outputs

Errors are the server's own: an error body ``{"error", "code", "details"?}`` is raised as the
:class:`~flashpoint.errors.FlashpointError` subclass of that ``code`` (a 404 for an unknown
function is :class:`~flashpoint.errors.FunctionNotFound`, a missing API key
:class:`~flashpoint.errors.Unauthorized`); a server that cannot be reached is
:class:`~flashpoint.errors.ConnectFailed` (retryable, a 503-class error), a dropped connection
:class:`~flashpoint.errors.PeerLost`, an answer that does not come in time
:class:`~flashpoint.errors.DeadlineExceeded`. No aiohttp exception leaves this module.

Every request has a deadline: ``connect_timeout_s`` to connect, ``timeout_s`` for the whole
call (an invoke with its own ``timeout_s`` waits that long plus ``invoke_margin_s``, so the
server's own deadline error arrives first).

:class:`Client` runs an :class:`AsyncClient` on an event loop in a thread of its own (started
on the first call, stopped by :meth:`Client.close`), so it works the same outside and inside a
running event loop; called from a coroutine it blocks that loop until the answer comes, so
code that already runs in a loop should use :class:`AsyncClient`.
"""

from __future__ import annotations

import asyncio
import base64
import math
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from flashpoint.errors import (
    BadRequest,
    ConnectFailed,
    DeadlineExceeded,
    FlashpointError,
    ModelFailed,
    NotFound,
    PeerLost,
    ProtocolError,
    RemoteError,
    Unauthorized,
    Unavailable,
    from_wire,
)

__all__ = ["AsyncClient", "Client", "DeployedFunction", "InvokeResponse"]

DEFAULT_URL = "http://127.0.0.1:8080"
_T = TypeVar("_T")


@dataclass(frozen=True)
class InvokeResponse:
    """One invoke's answer: outputs as numpy arrays (dtype and shape as the server sent them;
    BF16 as float32, BYTES as an object array of ``bytes``) and where its time went."""

    outputs: dict[str, np.ndarray]
    cold: bool = False
    timings_s: dict[str, float] = field(default_factory=dict)
    replica_id: str = ""
    cold_start_source: str = ""
    request_id: str = ""
    stored: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeployedFunction:
    """A registered function as ``GET /v1/functions/{name}`` shows it. ``spec`` is the
    server's spec as plain data (a newer server may carry fields this client does not know)."""

    name: str
    model: str
    model_version: str
    ready: bool
    replicas_warm: int
    replicas_starting: int
    queued: int
    spec: dict[str, Any]

    @classmethod
    def from_wire(cls, d: Any) -> DeployedFunction:
        try:
            spec = dict(d["spec"])
            return cls(name=str(spec["name"]), model=str(spec["model"]),
                       model_version=str(spec["model_version"]), ready=bool(d["ready"]),
                       replicas_warm=int(d["replicas_warm"]),
                       replicas_starting=int(d["replicas_starting"]), queued=int(d["queued"]),
                       spec=spec)
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed function record: {e!r:.200}") from None


# -- bodies ----------------------------------------------------------------------------------


def encode_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: array}`` -> the native body's ``{name: {data (flat), shape, datatype}}``."""
    from flashpoint.gateway import oip

    out: dict[str, Any] = {}
    for name, value in inputs.items():
        arr = np.asarray(value)
        if arr.dtype == object or arr.dtype.kind in "SU":
            try:
                data: list[Any] = [x.decode() if isinstance(x, bytes) else str(x)
                                   for x in arr.ravel()]
            except UnicodeDecodeError:
                raise BadRequest(f"input {name!r}: BYTES elements must be UTF-8 in a JSON "
                                 "body") from None
            datatype = "BYTES"
        else:
            try:
                datatype = oip.datatype_of(name, arr)
            except ModelFailed:
                raise BadRequest(f"input {name!r}: unsupported dtype {arr.dtype}") from None
            data = arr.ravel().tolist()
        out[name] = {"data": data, "shape": list(arr.shape), "datatype": datatype}
    return out


def decode_outputs(raw: Any) -> dict[str, np.ndarray]:
    """The native answer's ``outputs`` -> numpy arrays (see :func:`encode_native_outputs`)."""
    from flashpoint.gateway.oip import WIRE_DTYPES

    if not isinstance(raw, dict):
        raise ProtocolError("invoke answer without an 'outputs' object")
    out: dict[str, np.ndarray] = {}
    for name, t in raw.items():
        try:
            datatype, shape, data = t["datatype"], tuple(t["shape"]), t["data"]
            if datatype == "BYTES":
                if t.get("encoding") == "base64":
                    items = [base64.b64decode(x) for x in data]
                else:
                    items = [x.encode() for x in data]
                arr = np.empty(len(items), dtype=object)
                arr[:] = items
                out[name] = arr.reshape(shape)
            elif datatype == "BF16":
                out[name] = np.asarray(data, dtype=np.float32).reshape(shape)
            else:
                out[name] = np.asarray(data, dtype=WIRE_DTYPES[datatype]).reshape(shape)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"malformed output {name!r} in the invoke answer: "
                                f"{e!r:.200}") from None
    return out


def error_from_body(status: int, body: Any, retry_after: str | None = None) -> FlashpointError:
    """The typed error a gateway's error answer stands for (``middleware.error_response``)."""
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        details = body.get("details") if isinstance(body.get("details"), dict) else {}
        err = from_wire({"code": body["code"], "message": str(body.get("error", "")),
                         "details": details})
    else:  # not ours (a proxy's page): the status alone says what kind of failure it was
        cls = {401: Unauthorized, 404: NotFound, 502: Unavailable, 503: Unavailable,
               504: DeadlineExceeded}.get(status, RemoteError)
        err = cls(f"HTTP {status}: {str(body)[:200]}")
    if retry_after and "retry_after_s" not in err.details:
        try:
            err.details["retry_after_s"] = float(retry_after)
        except ValueError:
            pass
    return err


# -- the clients -----------------------------------------------------------------------------


class AsyncClient:
    """The native API over aiohttp; see the module docstring. Use as ``async with`` or call
    :meth:`close`; the HTTP session opens on the first request."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None,
                 timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
                 invoke_margin_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.invoke_margin_s = invoke_margin_s
        self._session: Any = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # -- functions ---------------------------------------------------------------------------

    async def deploy(self, name: str, model: str, version: str = "1",
                     **spec_fields: Any) -> DeployedFunction:
        """Register (or replace) function ``name`` over ``model``@``version``; the other
        ``POST /v1/functions`` fields (``max_batch_size``, ``min_replicas``, ``slo_ms``, ...)
        go as keywords."""
        body = {"name": name, "model": model, "model_version": version, **spec_fields}
        return DeployedFunction.from_wire(await self._call("POST", "/v1/functions", body))

    async def rollout(self, name: str, version: str,
                      canary_pct: float | None = None) -> DeployedFunction:
        """Deploy function ``name`` again with model version ``version``, its other fields
        as registered. ``canary_pct`` (the share of requests the new version takes while the
        old one still serves) is sent only when given. The tensor signature is left for the
        server to take from the new version's manifest."""
        spec = (await self.function(name)).spec
        for key in ("inputs", "outputs", "canary_pct"):
            spec.pop(key, None)
        spec["model_version"] = version
        if canary_pct is not None:
            spec["canary_pct"] = canary_pct
        return DeployedFunction.from_wire(await self._call("POST", "/v1/functions", spec))

    async def functions(self) -> list[DeployedFunction]:
        raw = await self._call("GET", "/v1/functions")
        if not isinstance(raw, list):
            raise ProtocolError("GET /v1/functions did not answer a list")
        return [DeployedFunction.from_wire(d) for d in raw]

    async def function(self, name: str) -> DeployedFunction:
        return DeployedFunction.from_wire(await self._call("GET", f"/v1/functions/{name}"))

    async def delete(self, name: str) -> None:
        """Delete function ``name`` (its replicas stop); FunctionNotFound when unknown."""
        await self._call("DELETE", f"/v1/functions/{name}")

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: hosts, devices, replicas, queues, SLOs, as plain data."""
        raw = await self._call("GET", "/v1/status")
        if not isinstance(raw, dict):
            raise ProtocolError("GET /v1/status did not answer an object")
        return raw

    async def invoke(self, name: str, inputs: Mapping[str, Any] | None = None, *,
                     text: str | list[str] | None = None, image: bytes | None = None,
                     request_class: str | None = None,
                     timeout_s: float | None = None) -> InvokeResponse:
        """Run one request: exactly one of ``inputs`` (``{name: numpy array}``, batch
        dimension first), ``text`` or ``image`` (raw encoded bytes, sent as base64) for
        functions whose gateway decodes those. ``request_class`` is ``"strict"`` or
        ``"best_effort"``; ``timeout_s`` is the request's deadline on the server."""
        given = [k for k, v in (("inputs", inputs), ("text", text), ("image", image))
                 if v is not None]
        if len(given) != 1:
            raise BadRequest(f"invoke needs exactly one of inputs, text, image; got {given}")
        body: dict[str, Any]
        if inputs is not None:
            body = {"inputs": encode_inputs(inputs)}
        elif text is not None:
            body = {"text": text}
        else:
            assert image is not None
            body = {"image": base64.b64encode(image).decode()}
        if request_class is not None:
            body["request_class"] = request_class
        deadline_s = self.timeout_s
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
            deadline_s = timeout_s + self.invoke_margin_s
        raw = await self._call("POST", f"/v1/functions/{name}/invoke", body,
                               timeout_s=deadline_s)
        if not isinstance(raw, dict):
            raise ProtocolError("invoke did not answer an object")
        return InvokeResponse(
            outputs=decode_outputs(raw.get("outputs")), cold=bool(raw.get("cold", False)),
            timings_s=dict(raw.get("timings_s") or {}), replica_id=str(raw.get("replica_id", "")),
            cold_start_source=str(raw.get("cold_start_source") or ""),
            request_id=str(raw.get("request_id", "")), stored=dict(raw.get("stored") or {}))

    # -- models ------------------------------------------------------------------------------

    async def push(self, name: str, source: str, *, version: str = "1",
                   format: str | None = None, trust_code: bool = False,
                   inputs: Sequence[str] = (), store: Any = None, config: Any = None) -> Any:
        """Publish model ``source`` (a path or URI) to the registry as ``name``@``version``
        and return its :class:`~flashpoint.registry.manifest.Manifest`.

        This writes to the registry directly, not over HTTP: to ``store`` when given, else to
        the store of ``config`` (a :class:`~flashpoint.config.ClusterConfig`; default: the
        embedded defaults), the same registry ``flashpoint model push`` writes to. The work
        is :func:`flashpoint.models.sources.publish_source` (``format`` picks the source's
        format when it cannot be told from the source; ``trust_code`` allows formats that run
        the source's own code; ``inputs``: ``"x:FP32:-1,16"`` specs, which a TorchScript
        archive needs); it imports torch, so it is imported only here."""
        from flashpoint.models.sources import PushOptions, publish_source
        from flashpoint.models.sources.base import parse_tensor_spec

        if store is None:
            from flashpoint.config import load_config
            from flashpoint.registry import open_store

            store = open_store((config if config is not None else load_config()).registry)
        options = PushOptions(trust_code=trust_code,
                              inputs=tuple(parse_tensor_spec(t) for t in inputs))
        return await publish_source(store, name, source, version=version, fmt=format,
                                    options=options)

    # -- the wire ----------------------------------------------------------------------------

    async def _call(self, method: str, path: str, body: Any = None, *,
                    timeout_s: float | None = None) -> Any:
        import aiohttp
        import orjson

        if self._session is None:
            self._session = aiohttp.ClientSession()
        total_s = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=total_s, connect=min(self.connect_timeout_s, total_s))
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            headers["Content-Type"] = "application/json"
        url = self.url + path
        try:
            async with self._session.request(method, url, data=data, headers=headers,
                                             timeout=timeout) as r:
                raw = await r.read()
                status, retry_after = r.status, r.headers.get("Retry-After")
        except aiohttp.ClientConnectorError as e:
            raise ConnectFailed(f"cannot reach {self.url}: {e.os_error or e}") from None
        except aiohttp.ConnectionTimeoutError:
            raise ConnectFailed(f"cannot reach {self.url}: no connection within "
                                f"{self.connect_timeout_s}s") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
            raise PeerLost(f"{method} {url}: the connection dropped ({e})") from None
        except TimeoutError:
            raise DeadlineExceeded(f"{method} {url}: no answer within {total_s}s") from None
        except aiohttp.ClientError as e:
            raise Unavailable(f"{method} {url}: {type(e).__name__}: {e}") from None
        try:
            parsed = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            parsed = raw.decode(errors="replace")
        if status >= 400:
            raise error_from_body(status, parsed, retry_after)
        if isinstance(parsed, str):
            raise ProtocolError(f"{method} {url}: the answer is not JSON: {parsed[:200]!r}")
        return parsed


class Client:
    """The blocking twin of :class:`AsyncClient` (same arguments, same methods): each call
    runs on an event loop in a thread this client owns, started on the first call; use it
    as ``with`` or call :meth:`close`. It works inside a running event loop too, but blocks
    that loop while it waits."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None,
                 timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
                 invoke_margin_s: float = 10.0) -> None:
        self._async = AsyncClient(url, api_key=api_key, timeout_s=timeout_s,
                                  connect_timeout_s=connect_timeout_s,
                                  invoke_margin_s=invoke_margin_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self._async.url

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._async.close(), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if not thread.is_alive():
                loop.close()

    def _run(self, coro: Coroutine[Any, Any, _T], deadline_s: float) -> _T:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name="flashpoint-client", daemon=True)
                self._thread.start()
            loop = self._loop
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            # The coroutine keeps its own deadlines; this backstop only guards the thread.
            backstop_s = deadline_s + self._async.connect_timeout_s + 5.0
            return future.result(None if math.isinf(backstop_s) else backstop_s)
        except TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"no answer from {self.url} within {deadline_s}s") from None

    def deploy(self, name: str, model: str, version: str = "1",
               **spec_fields: Any) -> DeployedFunction:
        return self._run(self._async.deploy(name, model, version, **spec_fields),
                         self._async.timeout_s)

    def rollout(self, name: str, version: str,
                canary_pct: float | None = None) -> DeployedFunction:
        return self._run(self._async.rollout(name, version, canary_pct),
                         2 * self._async.timeout_s)

    def functions(self) -> list[DeployedFunction]:
        return self._run(self._async.functions(), self._async.timeout_s)

    def function(self, name: str) -> DeployedFunction:
        return self._run(self._async.function(name), self._async.timeout_s)

    def delete(self, name: str) -> None:
        self._run(self._async.delete(name), self._async.timeout_s)

    def status(self) -> dict[str, Any]:
        return self._run(self._async.status(), self._async.timeout_s)

    def invoke(self, name: str, inputs: Mapping[str, Any] | None = None, *,
               text: str | list[str] | None = None, image: bytes | None = None,
               request_class: str | None = None,
               timeout_s: float | None = None) -> InvokeResponse:
        deadline_s = (self._async.timeout_s if timeout_s is None
                      else timeout_s + self._async.invoke_margin_s)
        return self._run(self._async.invoke(name, inputs, text=text, image=image,
                                            request_class=request_class, timeout_s=timeout_s),
                         deadline_s)

    def push(self, name: str, source: str, *, version: str = "1",
             format: str | None = None, trust_code: bool = False,
             inputs: Sequence[str] = (), store: Any = None, config: Any = None) -> Any:
        """:meth:`AsyncClient.push`, blocking (no deadline: publishing a large model takes as
        long as its bytes take to hash and write)."""
        return self._run(self._async.push(name, source, version=version, format=format,
                                          trust_code=trust_code, inputs=inputs, store=store,
                                          config=config),
                         math.inf)
