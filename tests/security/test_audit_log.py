"""Issue 19 item 13: an audit log of admin actions (register, delete, roll-out, MIG change)
naming the API key behind each (its fingerprint, never the key)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from flashpoint.config import GatewayConfig, generate_secret
from flashpoint.errors import FunctionNotFound, ModelNotFound
from flashpoint.gateway import FunctionInfo, make_app
from flashpoint.spec import FunctionSpec

ADMIN, INVOKE = generate_secret(), generate_secret()
GB = 10**9


def key_name(key: str) -> str:
    return f"key:{hashlib.sha256(key.encode()).hexdigest()[:12]}"


class Functions:
    """Just enough of an InvokeBackend to register and delete functions."""

    def __init__(self) -> None:
        self.specs: dict[str, FunctionSpec] = {}

    def _info(self, spec: FunctionSpec) -> FunctionInfo:
        return FunctionInfo(spec=spec, ready=True, replicas_warm=0, replicas_starting=0,
                            queued=0)

    async def register_function(self, spec: FunctionSpec) -> FunctionInfo:
        if spec.model == "missing":
            raise ModelNotFound("no such model")
        self.specs[spec.name] = spec
        return self._info(spec)

    async def delete_function(self, name: str) -> None:
        self.specs.pop(name)

    def get_function(self, name: str) -> FunctionInfo:
        if name not in self.specs:
            raise FunctionNotFound(f"function {name!r} not found")
        return self._info(self.specs[name])

    def list_functions(self) -> list[FunctionInfo]:
        return [self._info(s) for s in self.specs.values()]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_gateway_admin_actions_are_audited_with_the_keys_name(tmp_path: Path):
    path = tmp_path / "audit.jsonl"
    config = GatewayConfig(api_keys={ADMIN: "admin", INVOKE: "invoke"},
                           audit_log_path=str(path))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    fn = {"name": "f", "model": "m", "model_version": "1"}
    async with TestClient(TestServer(make_app(Functions(), config))) as client:
        with structlog.testing.capture_logs() as logs:
            assert (await client.post("/v1/functions", json=fn, headers=admin)).status == 201
            r = await client.post("/v1/functions", json={**fn, "max_batch_size": 2},
                                  headers={**admin, "X-Request-Id": "req-same-version"})
            assert r.status == 201
            r = await client.post("/v1/functions", json={**fn, "model_version": "2"},
                                  headers=admin)
            assert r.status == 201
            r = await client.post("/v1/functions", json={**fn, "name": "g", "model": "missing"},
                                  headers=admin)
            assert r.status == 404
            # not an admin: refused before anything happens, so nothing to audit
            r = await client.delete("/v1/functions/f", headers={"Authorization": f"Bearer {INVOKE}"})
            assert r.status == 403
            assert (await client.delete("/v1/functions/f", headers=admin)).status == 200
    records = read(path)
    assert [(r["action"], r["target"], r["outcome"]) for r in records] == [
        ("register", "f", "ok"), ("update", "f", "ok"), ("rollout", "f", "ok"),
        ("register", "g", "model_not_found"), ("delete", "f", "ok")]
    assert {r["principal"] for r in records} == {key_name(ADMIN)}
    assert records[1]["request_id"] == "req-same-version"
    assert records[2]["details"] == {"model": "m", "model_version": "2", "canary_pct": 100.0,
                                     "previous_version": "1"}
    assert ADMIN not in path.read_text()  # the key's name, never the key
    assert path.stat().st_mode & 0o077 == 0
    assert [e["action"] for e in logs if e["event"] == "audit"] == [r["action"] for r in records]


async def test_keyless_loopback_admin_actions_are_audited_as_anonymous(tmp_path: Path):
    path = tmp_path / "audit.jsonl"
    config = GatewayConfig(audit_log_path=str(path))
    async with TestClient(TestServer(make_app(Functions(), config))) as client:
        r = await client.post("/v1/functions", json={"name": "f", "model": "m"})
        assert r.status == 201
    assert [(r["action"], r["principal"]) for r in read(path)] == [("register", "anonymous")]


@pytest.mark.parametrize("fail", [False, True])
async def test_mig_changes_are_audited(tmp_path: Path, fail: bool):
    from flashpoint.audit import AuditLog
    from flashpoint.config import load_config
    from flashpoint.controller.handles import HostHandle
    from flashpoint.controller.mig_driver import MigDriver
    from flashpoint.controller.state.core import ControllerState
    from flashpoint.controller.state.events import (
        DeviceRecord,
        FunctionUpserted,
        GpuRecord,
        HostRegistered,
    )
    from flashpoint.errors import GpuBusy

    class Conn:
        async def call(self, method, payload, timeout_s):
            if fail:
                raise GpuBusy("runs replicas", gpu=0, replicas=["x"])
            return {"gpu_index": 0, "slices": []}

    st = ControllerState(heartbeat_timeout_s=5.0, replica_overhead_bytes=0)
    st.handle(HostRegistered("h0", (DeviceRecord("cuda:0/gi0ci0", "cuda", 40 * GB, 0,
                                                 "7g.40gb"),), 64 * GB, frozenset(), (), 0.0,
                             gpus=(GpuRecord(0, "A100-40GB", True),)))
    st.handle(FunctionUpserted(FunctionSpec(name="be", model="m", max_batch_size=1,
                                            batch_memory_bytes=2 * GB), 100 << 20))
    spawned: list = []
    now = [0.0]
    path = tmp_path / "audit.jsonl"
    cc = load_config(overrides={"controller": {"mig_interval_s": 1.0}}).controller
    driver = MigDriver(cc, st, {"h0": HostHandle(Conn())}, lambda cmds: None,
                       lambda coro, name: spawned.append(coro), lambda: now[0],
                       AuditLog(str(path)))
    for _ in range(4):
        driver.be_began("be")
    for k in range(4):  # the 4th mismatch with 7g: reconfigure
        now[0] = k + 1.0
        driver.step(now[0])
    (coro,) = spawned
    await coro
    (rec,) = read(path)
    assert (rec["action"], rec["principal"], rec["target"]) == ("mig_change", "controller:mig",
                                                                "h0/gpu0")
    assert rec["outcome"] == ("gpu_busy" if fail else "ok")
    assert rec["details"] == {"geometry": ["4g", "2g", "1g"]}
