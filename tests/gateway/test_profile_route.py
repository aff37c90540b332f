"""POST /v1/functions/{name}/profile over a real socket with a fake profiler: admin only
(an invoke key is refused), an unknown function is 404 before the body is read, a bad body
is 400, ``inputs`` reach the profiler decoded, and each run is audited."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from flashpoint.errors import Conflict
from flashpoint.gateway import GatewayConfig
from flashpoint.gateway.app import add_routes
from flashpoint.policy.profile_trials import ProfileRequest

from .conftest import ADMIN_KEY, INVOKE_KEY, FakeBackend, ThreadedServer


class FakeProfiler:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ProfileRequest, Any]] = []

    async def profile(self, name: str, req: ProfileRequest,
                      inputs: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        self.calls.append((name, req, inputs))
        if name == "busy":
            raise Conflict("no live host shares its GPUs")
        return {"function": name, "stored": ["fast_profile"]}


async def test_profile_route(backend: FakeBackend, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    cfg = GatewayConfig(api_keys={ADMIN_KEY: "admin", INVOKE_KEY: "invoke"},
                        audit_log_path=str(audit))
    profiler = FakeProfiler()
    app = web.Application(client_max_size=cfg.max_body_bytes)
    add_routes(app, backend, cfg, profiler=profiler)
    server = ThreadedServer(app, auto_decompress=False).start()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        async with aiohttp.ClientSession(server.url) as s:
            async with s.post("/v1/functions/double/profile", json={},
                              headers={"Authorization": f"Bearer {INVOKE_KEY}"}) as r:
                assert r.status == 403
            async with s.post("/v1/functions/double/profile", json={}) as r:
                assert r.status == 401
            async with s.post("/v1/functions/nope/profile", json={}, headers=admin) as r:
                assert r.status == 404 and (await r.json())["code"] == "function_not_found"
            async with s.post("/v1/functions/double/profile", json={"quotas": [2]},
                              headers=admin) as r:
                assert r.status == 400 and "quotas" in (await r.json())["error"]
            body = {"sm_shares": [0.25, 1], "requests": 3, "inputs": {
                "x": {"data": [1.5, 2.5], "shape": [1, 2], "datatype": "FP32"}}}
            async with s.post("/v1/functions/double/profile", json=body, headers=admin) as r:
                assert r.status == 200, await r.text()
                assert await r.json() == {"function": "double", "stored": ["fast_profile"]}
            async with s.post("/v1/functions/double/profile", headers=admin) as r:
                assert r.status == 200  # no body: the defaults
        assert len(profiler.calls) == 2
        name, req, inputs = profiler.calls[0]
        assert (name, req.sm_shares, req.requests) == ("double", (0.25, 1.0), 3)
        assert inputs["x"].dtype == np.float32 and inputs["x"].tolist() == [[1.5, 2.5]]
        assert profiler.calls[1][1] == ProfileRequest() and profiler.calls[1][2] is None
        assert "busy" in backend.functions  # a registered function whose profiler refuses
        async with aiohttp.ClientSession(server.url) as s:
            async with s.post("/v1/functions/busy/profile", json={}, headers=admin) as r:
                assert r.status == 409 and (await r.json())["code"] == "conflict"
    finally:
        server.stop()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(a["action"], a["target"], a["outcome"]) for a in records] == [
        ("profile", "double", "ok"), ("profile", "double", "ok"), ("profile", "busy", "conflict")]
