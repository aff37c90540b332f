"""Issue 19 item 6, roles: hosts, workers and gateways prove their own keys, each may call only
what its role needs, and a host's (or its workers') calls speak only for that host."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from flashpoint.cli import keys_env, make_store
from flashpoint.config import ClusterConfig, generate_secret, load_config
from flashpoint.controller.actor import Controller
from flashpoint.controller.state.records import ReplicaPhase, ReplicaRecord
from flashpoint.errors import AuthFailed, BadRequest, Forbidden
from flashpoint.host.actor import HostManager
from flashpoint.models.sources import publish
from flashpoint.rpc import RpcServer, connect, roles
from flashpoint.rpc.roles import Credential

pytestmark = pytest.mark.timeout(120)

SECRET = generate_secret().encode()  # a strong one: weak secrets are refused (test_secrets)
V = 1  # gateway protocol version (flashpoint/gateway/remote.py)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch) -> None:
    """Neither the cluster secret nor a credential leaks in from the caller's environment."""
    monkeypatch.delenv("FLASHPOINT_SECRET", raising=False)
    monkeypatch.delenv(roles.CREDENTIAL_ENV, raising=False)


def _config(tmp_path: Path, **host: Any) -> ClusterConfig:
    return load_config(overrides={
        "secret": SECRET.decode(), "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05},
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache"), **host},
    }).with_home(tmp_path)


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[Controller]:
    cfg = _config(tmp_path)
    ctl = Controller(cfg, make_store(cfg))
    await asyncio.wait_for(ctl.start(), 30)
    try:
        yield ctl
    finally:
        await asyncio.wait_for(ctl.stop(), 30)


async def _dial(ctl: Controller, cred: Credential) -> Any:
    return await connect(ctl.rpc_url, secret=cred.key, name=cred.principal, connect_timeout_s=5)


def _registration(host_id: str) -> dict[str, Any]:
    return {"host_id": host_id, "devices": [], "ram_bytes": 0}


def _place(ctl: Controller, rid: str, host_id: str) -> None:
    """A replica the controller placed on ``host_id`` (as its state would hold it)."""
    ctl.state.replicas[rid] = ReplicaRecord(rid, "f", host_id, "cpu:0", 0,
                                               ReplicaPhase.WARM, 0.0)


async def test_a_worker_cannot_register_a_host_nor_manage_functions(controller) -> None:
    conn = await _dial(controller, Credential.derive(SECRET, roles.worker_principal("h1")))
    try:
        for method, payload in [("register_host", _registration("h1")),
                                ("heartbeat", {"host_id": "h1"}),
                                ("gw_register", {"v": V, "spec": {"name": "x", "model": "noop"}}),
                                ("gw_delete", {"v": V, "name": "x"}),
                                ("gw_functions", {"v": V})]:
            with pytest.raises(Forbidden):
                await conn.call(method, payload, timeout_s=5)
        assert "h1" not in controller.state.hosts
    finally:
        await conn.close()


async def test_a_host_speaks_only_for_its_own_id(controller) -> None:
    conn = await _dial(controller, Credential.derive(SECRET, roles.host_principal("h1")))
    try:
        await conn.call("register_host", _registration("h1"), timeout_s=5)
        assert "h1" in controller.state.hosts
        for method, payload in [("register_host", _registration("h2")),
                                ("heartbeat", {"host_id": "h2"}),
                                ("host_draining", {"host_id": "h2", "remaining_s": 1.0}),
                                ("gw_register", {"v": V, "spec": {"name": "x", "model": "noop"}}),
                                ("gw_delete", {"v": V, "name": "x"}),
                                ("replica_ready", {"replica_id": "r1", "host_id": "h1"})]:
            with pytest.raises(Forbidden):
                await conn.call(method, payload, timeout_s=5)
        assert "h2" not in controller.state.hosts
        _place(controller, "r2", "h2")
        # Reporting another host's replica as its own does not make the controller forget it.
        await conn.call("register_host", {**_registration("h1"),
                                          "replicas": [["r2", "f", "cpu:9", True]]}, timeout_s=5)
        assert controller.state.replicas["r2"].host_id == "h2"
        with pytest.raises(Forbidden):  # another host's replica
            await conn.call("replica_failed", {"replica_id": "r2", "reason": "x"}, timeout_s=5)
        assert "r2" in controller.state.replicas
    finally:
        await conn.close()


async def test_a_worker_claims_only_its_own_hosts_replicas(controller) -> None:
    _place(controller, "r2", "h2")
    intruder = await _dial(controller, Credential.derive(SECRET, roles.worker_principal("h1")))
    owner = await _dial(controller, Credential.derive(SECRET, roles.worker_principal("h2")))
    try:
        for payload in [{"replica_id": "r2", "host_id": "h2"},  # placed on h2
                        {"replica_id": "r2", "host_id": "h1"},  # lying about the host
                        {"replica_id": "r9", "host_id": "h2"}]:  # unknown, in h2's name
            with pytest.raises(Forbidden):
                await intruder.call("replica_ready", payload, timeout_s=5)
        assert "r2" not in controller.workers and "r9" not in controller.workers
        await owner.call("replica_ready", {"replica_id": "r2", "host_id": "h2"}, timeout_s=5)
        handle = controller.workers["r2"]
        assert handle.conn.peer_name == "worker/h2" and handle.host_id == "h2"
    finally:
        await intruder.close()
        await owner.close()


async def test_each_key_is_bound_to_its_principal(controller) -> None:
    h1 = Credential.derive(SECRET, roles.host_principal("h1"))
    w1 = Credential.derive(SECRET, roles.worker_principal("h1"))
    for name, key in [(roles.host_principal("h2"), h1.key),  # h1's key, h2's name
                      (roles.host_principal("h1"), w1.key),  # a worker's key as its host
                      ("gateway", h1.key),
                      ("admin", h1.key)]:  # a role key is not the cluster secret
        with pytest.raises(AuthFailed):
            await _dial(controller, Credential(name, key))
    gw = await _dial(controller, Credential.derive(SECRET, "gateway"))
    admin = await _dial(controller, Credential("admin", SECRET))
    try:
        reply = await gw.call("gw_functions", {"v": V}, timeout_s=5)
        assert reply["functions"] == []
        with pytest.raises(Forbidden):
            await gw.call("register_host", _registration("h1"), timeout_s=5)
        await admin.call("register_host", _registration("h3"), timeout_s=5)  # the secret: all
        assert "h3" in controller.state.hosts
    finally:
        await gw.close()
        await admin.close()


async def test_a_hosts_worker_server_admits_only_its_own_workers() -> None:
    host_key = Credential.derive(SECRET, roles.host_principal("h1")).key

    async def hello(conn: Any, payload: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "peer": conn.peer_name}

    server = RpcServer({"worker_hello": hello}, secret=roles.host_keyring("h1", host_key))
    host, port = await server.start("127.0.0.1", 0)
    url = f"ws://{host}:{port}/rpc"
    try:
        mine = Credential(roles.worker_principal("h1"), roles.worker_key(host_key))
        assert mine == Credential.derive(SECRET, roles.worker_principal("h1"))
        conn = await connect(url, secret=mine.key, name=mine.principal, connect_timeout_s=5)
        assert (await conn.call("worker_hello", {}, timeout_s=5))["peer"] == "worker/h1"
        await conn.close()
        for cred in [Credential.derive(SECRET, roles.worker_principal("h2")),
                     Credential(roles.worker_principal("h1"), host_key),
                     Credential("admin", SECRET)]:
            with pytest.raises(AuthFailed):
                await connect(url, secret=cred.key, name=cred.principal, connect_timeout_s=5)
    finally:
        await server.stop()


def test_a_host_takes_only_its_own_credential(tmp_path: Path, monkeypatch) -> None:
    cfg = _config(tmp_path)
    derived = HostManager(cfg, None, host_id="h1")
    assert derived.credential == Credential.derive(SECRET, "host/h1")
    assert derived.secret == roles.data_key(SECRET) != SECRET  # the data plane's key only
    h1 = Credential.derive(SECRET, "host/h1")
    data = roles.data_key(SECRET).decode()
    monkeypatch.setenv(roles.CREDENTIAL_ENV, h1.token())
    given = HostManager(load_config(overrides={"secret": data}).with_home(tmp_path), None,
                        host_id="h1")
    assert given.credential == h1 and given.secret == data.encode()
    with pytest.raises(BadRequest, match="host/h1"):
        HostManager(cfg, None, host_id="h2")
    monkeypatch.setenv(roles.CREDENTIAL_ENV, "host/h1:not-hex")
    with pytest.raises(BadRequest):
        HostManager(cfg, None, host_id="h1")
    with pytest.raises(SystemExit, match="needs the cluster secret"):  # a random one: useless
        keys_env(load_config(), "gateway", None)


async def test_a_host_given_only_its_keys_serves_and_its_workers_hold_no_secret(
        tmp_path: Path, monkeypatch) -> None:
    cfg = _config(tmp_path)
    store = make_store(cfg)
    await publish(store, "noop", "tiny", "1", model_name="noop")
    # What `flashpoint keys host h1` prints for the host's environment file: no cluster secret.
    env_file = dict(line.split("=", 1) for line in keys_env(cfg, "host", "h1").splitlines())
    assert SECRET.decode() not in env_file.values()
    ctl = Controller(cfg, store)
    await asyncio.wait_for(ctl.start(), 30)
    monkeypatch.setenv(roles.CREDENTIAL_ENV, env_file[roles.CREDENTIAL_ENV])
    host = HostManager(dataclasses.replace(
        cfg, secret=env_file["FLASHPOINT_SECRET"],
        host=dataclasses.replace(cfg.host, controller_url=ctl.rpc_url)), store, host_id="h1")
    pids: list[int] = []
    try:
        await asyncio.wait_for(host.start(), 60)
        await host.wait_pool_ready(60)
        pids = [w.proc.pid for w in host.workers.values()]
        assert pids and "h1" in ctl.state.hosts
        for pid in pids:
            env = dict(kv.split(b"=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            assert SECRET not in env.values()
            assert env[b"FLASHPOINT_SECRET"] == roles.data_key(SECRET)
            assert Credential.parse(env[roles.CREDENTIAL_ENV.encode()].decode()) == \
                Credential.derive(SECRET, roles.worker_principal("h1"))
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        body = {"inputs": {"x": {"data": x.ravel().tolist(), "shape": [2, 3],
                                 "datatype": "FP32"}}}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{ctl.url}/v1/functions", json={"name": "nf", "model": "noop"}) as r:
                assert r.status == 201, await r.text()
            async with s.post(f"{ctl.url}/v1/functions/nf/invoke", json=body) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
        np.testing.assert_allclose(np.asarray(out["outputs"]["y"]["data"]).reshape(2, 3), x)
        assert ctl.workers[out["replica_id"]].conn.peer_name == "worker/h1"
    finally:
        await asyncio.wait_for(ctl.stop(), 30)
        await asyncio.wait_for(host.stop(), 30)
    for pid in pids:  # leak check
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text().lower(), f"worker {pid} leaked"
