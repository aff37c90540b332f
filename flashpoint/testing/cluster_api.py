"""What a test or a benchmark asks of a running cluster over its HTTP API -- status,
deploy, invoke, waiting for a state -- the same for an in-process cluster
(:mod:`flashpoint.testing.harness`) and one of real processes in network namespaces
(:mod:`flashpoint.testing.netcluster`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp


class ClusterApi:
    """HTTP calls against ``self.url`` through ``self._http()`` (the subclass's session);
    ``diagnostics()`` is appended to a wait's timeout."""

    url: str

    def _http(self) -> aiohttp.ClientSession:
        raise NotImplementedError

    def diagnostics(self) -> str:
        """What a failed wait appends to its message (process logs, where there are any)."""
        return ""

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``."""
        async with self._http().get(self.url + "/v1/status") as r:
            body = await r.json(content_type=None)
            assert r.status == 200, body
            return body

    async def deploy(self, name: str, model: str, **spec: Any) -> dict[str, Any]:
        """``POST /v1/functions``; asserts it was accepted and returns the reply."""
        async with self._http().post(self.url + "/v1/functions",
                                     json={"name": name, "model": model, **spec}) as r:
            body = await r.json(content_type=None)
            assert r.status in (200, 201), body
            return body

    async def invoke(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """A native invoke of ``{"inputs": inputs}`` (wire tensors); asserts 200."""
        return await self.invoke_body(name, {"inputs": inputs})

    async def invoke_body(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A native invoke of any body (``{"inputs": ...}``, ``{"text": ...}``); asserts 200."""
        async with self._http().post(f"{self.url}/v1/functions/{name}/invoke", json=body) as r:
            reply = await r.json(content_type=None)
            assert r.status == 200, reply
            return reply

    async def wait(self, what: str, probe: Callable[[], Awaitable[tuple[bool, Any]]],
                   timeout_s: float, interval_s: float = 0.1) -> Any:
        """Poll ``probe`` (-> (reached, what it saw)) until reached and return what it saw;
        AssertionError naming the state, the last observation and the diagnostics after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen: Any = None
        for _ in range(int(timeout_s / interval_s) + 2):  # bounded in count and in time
            try:
                ok, seen = await probe()
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, seen = False, repr(exc)
            if ok:
                return seen
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(interval_s)
        raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}; "
                             f"last seen: {seen!r}\n{self.diagnostics()}")

    async def wait_warm(self, function: str, hosts: Sequence[str] | None = None, *,
                        count: int = 1, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
        """Wait until ``function`` has a warm replica on each of ``hosts`` and at least
        ``count`` warm replicas (from ``/v1/status``); returns host -> a warm replica."""
        async def probe() -> tuple[bool, Any]:
            reps = [r for r in (await self.status())["replicas"] if r["function"] == function]
            warm = [r for r in reps if r["phase"] == "warm"]
            by_host = {r["host_id"]: r for r in warm}
            ok = set(hosts or ()) <= set(by_host) and len(warm) >= count
            return ok, by_host if ok else [(r["host_id"], r["phase"], r["source"]) for r in reps]
        return await self.wait(f"{function} warm on {list(hosts or [])} (at least {count})",
                               probe, timeout_s)
