"""Issue 19 item 4: no anonymous admins beyond loopback. HTTP without API keys listens on
loopback only unless --insecure (a warning at every start); /metrics can require a key."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from flashpoint.config import (
    ClusterConfig,
    check_http_auth,
    generate_secret,
    load_config,
)
from flashpoint.errors import BadRequest
from flashpoint.gateway import GatewayConfig, make_app

KEY = generate_secret()


def test_keyless_http_stays_on_loopback_unless_insecure():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_http_auth({}, host, False, "the controller's HTTP API")  # the local demo
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(BadRequest, match="without \\[gateway\\] api_keys.*--insecure"):
            check_http_auth({}, host, False, "the controller's HTTP API")
        check_http_auth({KEY: "admin"}, host, False, "the controller's HTTP API")
    for keys in ({}, {KEY: "admin"}):  # --insecure warns at every start, keys or not
        with structlog.testing.capture_logs() as logs:
            check_http_auth(keys, "0.0.0.0", True, "the gateway")
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["insecure_http"]


def test_insecure_comes_from_the_command_line_only(tmp_path: Path):
    from flashpoint.cli import _config

    p = tmp_path / "c.toml"
    p.write_text("insecure = true\n")
    with pytest.raises(BadRequest, match="insecure"):
        load_config(p)
    assert ClusterConfig().insecure is False
    import argparse

    cfg = _config(argparse.Namespace(config=None, home=None, insecure=True))
    assert cfg.insecure is True


async def test_controller_refuses_keyless_http_beyond_loopback(tmp_path: Path):
    from flashpoint.controller.actor import Controller
    from flashpoint.registry import make_store

    cfg = load_config(overrides={"secret": generate_secret(), "log_level": "WARNING",
                                 "controller": {"listen_host": "0.0.0.0", "listen_port": 0}}
                      ).with_home(tmp_path)
    ctl = Controller(cfg, make_store(cfg))
    try:
        with pytest.raises(BadRequest, match="api_keys"):
            await ctl.start()
        assert not ctl.url  # refused before it listened
    finally:
        await ctl.stop()


async def test_standalone_gateway_refuses_keyless_http_beyond_loopback():
    from flashpoint.gateway.standalone import StandaloneGateway

    cfg = load_config(overrides={"secret": generate_secret(),
                                 "gateway": {"listen_host": "0.0.0.0", "listen_port": 0}})
    with pytest.raises(BadRequest, match="api_keys"):
        await StandaloneGateway.start(cfg)


class _NoFunctions:
    def list_functions(self) -> list:
        return []

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return True


@pytest.mark.parametrize("required", [False, True])
async def test_metrics_can_require_a_key(required: bool):
    config = GatewayConfig(api_keys={KEY: "invoke"}, metrics_require_key=required)
    assert config.metrics_require_key is required
    async with TestClient(TestServer(make_app(_NoFunctions(), config))) as client:
        anonymous = await client.get("/metrics")
        keyed = await client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        wrong = await client.get("/metrics", headers={"Authorization": "Bearer not-a-key-at-all"})
        assert keyed.status == 200 and "flashpoint_gateway_requests" in await keyed.text()
        assert (anonymous.status, wrong.status) == ((401, 401) if required else (200, 200))


async def test_metrics_key_needs_keys_configured_to_mean_anything():
    # Without keys /metrics answers everyone (a keyless cluster is loopback-only).
    config = GatewayConfig(metrics_require_key=True)
    async with TestClient(TestServer(make_app(_NoFunctions(), config))) as client:
        assert (await client.get("/metrics")).status == 200


def test_the_command_line_refuses_in_one_line(tmp_path: Path):
    import os
    import subprocess
    import sys

    p = tmp_path / "c.toml"
    p.write_text('[controller]\nlisten_host = "0.0.0.0"\nlisten_port = 0\n')
    env = {**os.environ, "FLASHPOINT_SECRET": generate_secret()}
    # subprocess.run kills the process at the timeout: none outlives the test
    r = subprocess.run([sys.executable, "-m", "flashpoint.cli", "--config", str(p), "--home",
                        str(tmp_path), "controller"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().endswith("set api_keys (`flashpoint secret generate` makes one) "
                                     "or pass --insecure")


async def test_a_hosts_own_metrics_can_require_a_key():
    """A host's /metrics (`[host] metrics_listen`) honours `[gateway] metrics_require_key`
    with the cluster's API keys, as the controller's does."""
    import aiohttp

    from flashpoint.exposition import MetricsEndpoint

    for keys, anonymous_status in ((None, 200), ([KEY], 401)):
        endpoint = MetricsEndpoint("127.0.0.1:0", keys=keys)
        url = await endpoint.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                async with s.get(f"{url}/metrics") as r:
                    assert r.status == anonymous_status
                async with s.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}) as r:
                    assert r.status == (401 if keys else 200)
                async with s.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
                    assert r.status == 200 and "python_info" in await r.text()
        finally:
            await endpoint.stop()
