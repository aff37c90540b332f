"""bench/peers: the report's ratios, targets, table and JSON line, the loopback-only
network namespace helper (root only), and ``flashpoint up`` as the benchmark drives it
(fp_up.py). The full run needs the peers' venvs and is not part of the suite."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"


def _load(name: str, *, as_plain: bool = False) -> ModuleType:
    """bench/peers/<name>.py under a name of its own: on sys.path as plain ``netns`` it
    would shadow the tests/netns package (whose conftest pytest imports as ``netns.conftest``).
    ``as_plain``: also under its plain name, for a sibling that imports it so (fp_up imports
    ``platforms``; no package of the suite has that name)."""
    spec = importlib.util.spec_from_file_location(f"bench_peers_{name}", PEERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    if as_plain:
        sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


netns = _load("netns")
report = _load("report")
platforms = _load("platforms", as_plain=True)
fp_up = _load("fp_up")


def _warm(platform: str, setting: str, conc: int, rps: float, p50: float = 1.0,
          workload: str = "noop") -> dict:
    return {"platform": platform, "setting": setting, "workload": workload, "concurrency": conc,
            "rps": rps, "p50_ms": p50, "p99_ms": 2 * p50, "ok": 10, "errors": 0}


def test_with_floor_divides_by_the_same_concurrency():
    floor = {1: {"rps": 1000.0, "p50_ms": 0.5, "p99_ms": 1.0},
             64: {"rps": 4000.0, "p50_ms": 10.0, "p99_ms": 20.0}}
    row = report.with_floor(_warm("ray", "default", 64, 200.0, p50=40.0), floor)
    assert row["rps_x_floor"] == pytest.approx(0.05)
    assert row["p50_ms_x_floor"] == pytest.approx(4.0)
    assert row["p99_ms_x_floor"] == pytest.approx(4.0)
    missing = report.with_floor(_warm("ray", "default", 8, 200.0), floor)
    assert missing["rps_x_floor"] is None


def test_targets_met_missed_and_unmeasured():
    warm = [_warm("flashpoint", "default", 1, 1500.0), _warm("ray", "default", 1, 100.0),
            _warm("flashpoint", "default", 64, 900.0), _warm("ray", "default", 64, 100.0),
            _warm("ray", "tuned", 64, 1.0)]
    cold = [{"platform": "flashpoint", "model": "big", "wall_s": 0.5},
            {"platform": "ray", "model": "big", "wall_s": 4.0}]
    t = report.targets(warm, cold)
    assert t["noop_c1_rps_vs_ray_default"]["ratio"] == pytest.approx(15.0)
    assert t["noop_c1_rps_vs_ray_default"]["met"] is True
    assert t["noop_c64_rps_vs_ray_default"]["ratio"] == pytest.approx(9.0)  # not the tuned row
    assert t["noop_c64_rps_vs_ray_default"]["met"] is False
    assert t["cold_big_vs_ray"]["ratio"] == pytest.approx(0.125)
    assert t["cold_big_vs_ray"]["met"] is True
    none = report.targets(warm[:1] + [{"platform": "ray", "status": "not run", "reason": "x"}],
                          [])
    assert none["noop_c1_rps_vs_ray_default"]["met"] is None
    assert none["cold_big_vs_ray"]["ratio"] is None


def test_table_keeps_rows_of_peers_that_did_not_run_and_json_is_one_line():
    result = {
        "warm": [report.with_floor(_warm("flashpoint", "default", 1, 1234.5),
                                   {1: {"rps": 2469.0, "p50_ms": 0.5, "p99_ms": 1.0}}),
                 {"platform": "bentoml", "status": "not run", "reason": "venv: pip failed"}],
        "cold": [{"platform": "ray", "model": "big", "wall_s": 4.1, "walls_s": [4.1],
                  "source": "page cache"}],
        "burst": [{"platform": "bentoml", "status": "not run", "reason": "no autoscaler"}],
        "targets": report.targets([], []),
    }
    text = report.table(result)
    assert "1234.5" in text and "0.500" in text  # req/s and its ratio to the floor
    assert "bentoml" in text and "venv: pip failed" in text and "no autoscaler" in text
    assert "4.100" in text and "not measured" in text
    line = report.json_line(result)
    assert "\n" not in line
    assert json.loads(line)["warm"][1]["reason"] == "venv: pip failed"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2")
@pytest.mark.timeout(60)
def test_namespace_has_only_loopback_and_is_swept_and_deleted():
    name = netns.namespace_name(os.getpid() + 7_000_000)  # not the name a real run would use
    with netns.LoopbackNamespace(name) as ns:
        assert netns.interfaces_in(ns.name) == ["lo"]
        up = subprocess.run([*ns.prefix(), "ip", "-o", "addr", "show", "lo"],
                            capture_output=True, text=True, timeout=10)
        assert "127.0.0.1" in up.stdout
        # a process left inside is stopped by PID when the namespace goes
        proc = subprocess.Popen([*ns.prefix(), "sleep", "60"])
        try:
            for _ in range(100):  # bounded: until `ip netns exec` has entered the namespace
                if proc.pid in netns.pids_in(ns.name):
                    break
            assert proc.pid in netns.pids_in(ns.name)
        except BaseException:
            proc.kill()
            proc.wait(10)
            raise
    assert proc.pid in ns.leftover_pids
    t0 = time.monotonic()
    proc.wait(15)  # already reaped by the sweep; it must not run its 60 s
    assert time.monotonic() - t0 < 15
    assert not os.path.exists(f"/proc/{proc.pid}")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    assert name not in listed.stdout.split()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2")
@pytest.mark.timeout(60)
def test_namespace_deleted_when_the_body_raises():
    name = netns.namespace_name(os.getpid() + 8_000_000)
    with pytest.raises(ValueError), netns.LoopbackNamespace(name):
        raise ValueError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    assert name not in listed.stdout.split()


def test_up_config_is_toml_that_flashpoint_loads(tmp_path: Path) -> None:
    import tomllib

    from flashpoint.config import load_config

    config = {"log_level": "WARNING", "controller": {"listen_port": 0},
              "host": {"cpu_devices": 4, "warm_pool_size": 4, "cache_bytes": 5 * 2**30,
                       "metrics_listen": "127.0.0.1:0"}}
    text = fp_up.to_toml(config)
    assert tomllib.loads(text) == config
    path = tmp_path / "c.toml"
    path.write_text(text)
    cfg = load_config(path)
    assert (cfg.host.cpu_devices, cfg.host.warm_pool_size, cfg.host.cache_bytes) == (
        4, 4, 5 * 2**30)


def test_idle_workers_reads_the_host_gauge() -> None:
    text = ('# HELP flashpoint_host_workers Worker processes of this host by state\n'
            '# TYPE flashpoint_host_workers gauge\n'
            'flashpoint_host_workers{host="host0",state="starting"} 1.0\n'
            'flashpoint_host_workers{host="host0",state="idle"} 3.0\n'
            'flashpoint_host_workers{host="host0",state="serving"} 2.0\n')
    assert fp_up.idle_workers(text) == 3
    assert fp_up.idle_workers("# nothing here\n") is None


@pytest.mark.timeout(240)
async def test_flashpoint_up_as_the_benchmark_drives_it(tmp_path: Path) -> None:
    """A real ``flashpoint up`` process: banner parsed, a function registered and answered
    over HTTP, its warm pool seen full on the host's /metrics, then stopped by PID with its
    process group (workers included) gone."""
    from flashpoint.models.sources import publish
    from flashpoint.registry.local import LocalStore

    await publish(LocalStore(tmp_path / "registry"), "noop", preset="tiny", version="1",
                  model_name="noop")
    config = {"log_level": "WARNING", "controller": {"listen_port": 0},
              "host": {"cpu_devices": 1, "warm_pool_size": 1, "cache_dir": str(tmp_path / "c"),
                       "metrics_listen": "127.0.0.1:0"}}
    server = fp_up.FlashpointUp(config, tmp_path, tmp_path / "up.log")
    try:
        await server.start()
        assert server.url.startswith("http://127.0.0.1:")
        assert server.host_metrics_url.endswith("/metrics")
        await server.register({"name": "fpup_noop", "model": "noop", "min_replicas": 1,
                               "max_replicas": 1, "keep_alive_s": 600})
        body = {"inputs": {"x": {"data": [1.0, 2.0], "shape": [1, 2], "datatype": "FP32"}}}
        async with aiohttp.ClientSession() as s, s.post(
                f"{server.url}/v1/functions/fpup_noop/invoke", json=body) as r:
            reply = await r.json()
            assert r.status == 200, reply
        assert reply["outputs"]["y"]["data"] == [1.0, 2.0]  # the no-op's identity
        assert [rep["function"] for rep in await server.replicas("fpup_noop")] == ["fpup_noop"]
        await server.wait_pool_ready(120)  # the replica took the pool's worker; refilled
    finally:
        await server.stop()
    assert server.proc is not None and server.proc.returncode is not None
    with pytest.raises(ProcessLookupError):  # its group (its workers) is gone too
        os.killpg(server.proc.pid, 0)
