"""The dashboard's routes on the gateway: the static shell is open, the data needs a key,
only the package's own files are served, and ``/v1/ui/state`` nests the controller's status
into the views the page draws (gateway/ui/view.py)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from flashpoint.gateway.ui import ASSETS, load_assets
from flashpoint.gateway.ui.view import source_tier, ui_state

from .conftest import ADMIN_KEY, INVOKE_KEY, FakeBackend, ThreadedServer

GIB = 1 << 30


def status_of_two_hosts() -> dict[str, Any]:
    """A ``cluster_status()`` as the controller builds it: host h0 with a MIG GPU (two slices)
    and a CPU unit, h1 draining under a spot notice and receiving a chain from h0."""
    return {
        "uptime_s": 12.5,
        "hosts": [
            {"host_id": "h0", "alive": True, "draining": False, "last_seen_s_ago": 0.1,
             "cached_models": ["bert@1"], "transfers": {},
             "devices": [{"device_id": "gpu:0/mig:0", "kind": "gpu", "memory_bytes": 10 * GIB},
                         {"device_id": "gpu:0/mig:1", "kind": "gpu", "memory_bytes": 10 * GIB},
                         {"device_id": "cpu:0", "kind": "cpu", "memory_bytes": 4 * GIB}]},
            {"host_id": "h1", "alive": True, "draining": True, "last_seen_s_ago": 0.2,
             "cached_models": [], "transfers": {"bert@1": [300, 1000]},
             "devices": [{"device_id": "cpu:0", "kind": "cpu", "memory_bytes": 4 * GIB}]},
        ],
        "replicas": [
            {"replica_id": "r1", "function": "f", "host_id": "h0", "device_id": "gpu:0/mig:1",
             "phase": "warm", "inflight": 2, "timings_s": {"load": 0.5}, "stage": None,
             "group_id": None, "source": "registry"},
            {"replica_id": "r2", "function": "f", "host_id": "h0", "device_id": "cpu:0",
             "phase": "starting", "inflight": 0, "timings_s": {}, "stage": None,
             "group_id": None, "source": ""},
        ],
        "groups": [],
        "functions": [{"spec": {"name": "f", "model": "bert", "model_version": "1",
                                "slo_ms": 100}, "ready": True, "replicas_warm": 1,
                       "replicas_starting": 1, "queued": 3, "rollout": {}}],
        "scaling": [{"function": "f", "planned": 2, "requested": 2, "observed": 1,
                     "reason": "demand"}],
        "slo": [{"function": "f", "met": 9, "missed": 1, "compliance": 0.9}],
        "cost": {"total_usd": 1.5}, "replacements": [], "mig": None,
        "kaas": {"executors_wanted": 0, "executors": 0, "broken": "", "unplaced": ""},
        "ui": {
            "requests": {"f": {"count": 10, "rate_per_s": 2.0, "p50_s": 0.01, "p99_s": 0.2}},
            "decisions": [{"function": "f", "desired": 2, "previous": 1, "reason": "demand",
                           "actions": ["deploy r2 on h0/cpu:0"], "age_s": 1.0}],
            "cold_starts": [{"replica_id": "r1", "function": "f", "source": "registry",
                             "phases_s": {"request": 0.01, "decision": 0.001, "load": 0.5,
                                          "obtain": 0.3, "fetch": 0.25}, "age_s": 3.0}],
            "chains": [{"transfer_id": "t1", "sender": "h0", "model_key": "bert@1",
                        "receivers": ["h1"], "active": True, "age_s": 0.5}],
            "replicas": {"r1": {"device_bytes": 123, "model_key": "bert@1", "age_s": 4.0}},
            "hosts": {"h0": {"ram_bytes": 64 * GIB, "leaf": "", "gpu_sharing": "none",
                             "drain_in_s": None,
                             "gpus": [{"gpu_index": 0, "model": "A100", "mig": True}],
                             "devices": {"gpu:0/mig:0": {"gpu_index": 0, "mig_profile": "2g.10gb"},
                                         "gpu:0/mig:1": {"gpu_index": 0, "mig_profile": "2g.10gb"},
                                         "cpu:0": {"gpu_index": -1, "mig_profile": ""}}},
                      "h1": {"ram_bytes": 8 * GIB, "leaf": "", "gpu_sharing": "none",
                             "drain_in_s": 95.0, "gpus": [], "devices": {}}},
        },
    }


@pytest.mark.parametrize(("source", "tier"), [
    ("local", "ram"), ("chain:h3", "peer"), ("peer:h2", "peer"), ("registry", "registry"),
    ("chain:registry", "registry"), ("registry+peer:h2", "peer"), ("pipeline:2", "pipeline"),
    ("kaas", "kaas"), ("", "unknown")])
def test_source_tiers(source: str, tier: str) -> None:
    assert source_tier(source) == tier


def test_the_views_nest_the_status() -> None:
    s = ui_state(status_of_two_hosts())
    h0, h1 = s["hosts"]
    assert [g["gpu_index"] for g in h0["gpus"]] == [0] and h0["gpus"][0]["mig"] is True
    slices = h0["gpus"][0]["devices"]
    assert [d["device_id"] for d in slices] == ["gpu:0/mig:0", "gpu:0/mig:1"]
    assert [r["replica_id"] for r in slices[1]["replicas"]] == ["r1"]
    assert slices[1]["replicas"][0]["device_bytes"] == 123
    assert slices[1]["replicas"][0]["tier"] == "registry"
    assert [d["device_id"] for d in h0["cpu_devices"]] == ["cpu:0"]
    assert h0["cpu_devices"][0]["replicas"][0]["replica_id"] == "r2"
    assert h0["spot_notice"] is False and h1["spot_notice"] is True and h1["drain_in_s"] == 95.0
    (f,) = s["functions"]
    assert f["replicas_by_phase"] == {"warm": 1, "starting": 1} and f["queued"] == 3
    assert (f["rate_per_s"], f["p99_s"], f["slo"]["compliance"]) == (2.0, 0.2, 0.9)
    assert f["decisions"][0]["reason"] == "demand"
    (w,) = s["waterfall"]  # r2 has no timings yet: no row
    # phases in the breakdown's order (controller/cold_timings.py), fetch kept aside
    assert [p for p, _ in w["phases"]] == ["decision", "obtain", "load", "request"]
    assert w["complete"] and w["tier"] == "registry" and w["fetch_s"] == 0.25
    (t,) = s["transfers"]
    assert (t["sender"], t["receiver"], t["relays"]) == ("h0", ["h1"], [])
    assert t["hops"] == [{"host_id": "h1", "state": "receiving", "verified_bytes": 300,
                          "total_bytes": 1000}]
    assert [(g["host_id"], [sl["profile"] for sl in g["slices"]]) for g in s["mig"]["gpus"]] == [
        ("h0", ["2g.10gb", "2g.10gb"])]


def test_only_the_packaged_files_are_assets() -> None:
    assets = load_assets()
    assert set(assets) == set(ASSETS)
    page = assets["index.html"].decode()
    # every asset is local: nothing the page loads comes from another origin
    assert "http://" not in page and "https://" not in page and "/ui/static/app.js" in page


async def test_the_shell_is_open_and_the_data_needs_a_key(auth_server: ThreadedServer,
                                                          backend: FakeBackend) -> None:
    backend.cluster_status = status_of_two_hosts  # type: ignore[method-assign]
    url = auth_server.url
    async with aiohttp.ClientSession() as s:
        for path, kind in (("/ui", "text/html"), ("/ui/", "text/html"),
                           ("/ui/static/app.js", "text/javascript"),
                           ("/ui/static/style.css", "text/css")):
            async with s.get(url + path) as r:
                assert r.status == 200 and r.content_type == kind, path
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        for path in ("/ui/static/nope.js", "/ui/static/..%2F__init__.py",
                     "/ui/static/index.html"):
            async with s.get(url + path) as r:
                assert r.status == 404, path
        async with s.get(f"{url}/v1/ui/auth") as r:
            assert (await r.json()) == {"key_required": True}
        async with s.get(f"{url}/v1/ui/state") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
        async with s.get(f"{url}/v1/ui/state",
                         headers={"Authorization": "Bearer not-a-key-000000"}) as r:
            assert r.status == 401
        for key in (INVOKE_KEY, ADMIN_KEY):
            async with s.get(f"{url}/v1/ui/state",
                             headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
                body = await r.json()
                assert [h["host_id"] for h in body["hosts"]] == ["h0", "h1"]


async def test_without_keys_the_page_is_told_so(server: ThreadedServer,
                                                backend: FakeBackend) -> None:
    backend.cluster_status = status_of_two_hosts  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{server.url}/v1/ui/auth") as r:
            assert (await r.json()) == {"key_required": False}
        async with s.get(f"{server.url}/v1/ui/state") as r:
            assert r.status == 200 and (await r.json())["functions"][0]["name"] == "f"
