"""Flashpoint across real hosts: a controller, host managers and an S3 registry as separate
processes in network namespaces, joined by rate-capped links (issue 3, item 6).

Each test builds its own lab (see flashpoint/testing/netcluster.py) and checks model bytes end to end:
every host's cache file is hashed against the published blob (read back from S3 and checked
in the first test). Placement
is deterministic (equal hosts are ranked by id, flashpoint/policy/placement.py), so a chain
of hosts host0..host3 is headed by host0 and runs host0 -> host1 -> host2 -> host3; the tests
read the actual chain from the head's ``chain_start`` log line and assert it where it matters.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flashpoint.models import build, example_inputs, run_example
from flashpoint.models.sources import publish
from flashpoint.registry import LocalStore
from flashpoint.registry.manifest import Manifest
from flashpoint.testing.harness import ClusterFactory, NetnsCluster
from flashpoint.testing.netcluster import REGISTRY, S3_PORT, NetCluster, sha256_file
from flashpoint.transfer.obtain import DATAPLANE_FAULT_ENV

pytestmark = pytest.mark.timeout(180)

MODEL = "bert20"
VERSION = "1"
KEY = f"{MODEL}@{VERSION}"
# ~23.5 MB of random weights in 1 MiB chunks: ~4 s through a 50 Mbit/s link.
CONFIG = {"preset": "tiny", "vocab_size": 16384, "hidden_size": 256, "intermediate_size": 1024}
CHUNK_BYTES = 1 << 20
RATE_MBIT = 50
FUNCTION = "bert-fn"


@dataclass(frozen=True)
class Model:
    manifest: Manifest
    blob: Path
    sha256: str


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The model built once per module into a local store; each cluster puts it into S3."""
    store = LocalStore(tmp_path_factory.mktemp("model") / "registry")
    manifest = asyncio.run(publish(store, "bert", CONFIG, VERSION, chunk_size=CHUNK_BYTES,
                                   model_name=MODEL))
    blob = store.blob_path(MODEL, VERSION)
    assert 16 << 20 < manifest.blob_size < 32 << 20 and manifest.num_chunks > 8
    return Model(manifest, blob, sha256_file(blob))


@pytest.fixture
async def start_cluster(make_cluster: ClusterFactory, model: Model
                        ) -> Callable[..., Awaitable[NetCluster]]:
    """``await start_cluster(num_hosts, **kw)``: a running netns cluster (``make_cluster(...,
    netns=True)``: stopped and leak-checked at teardown) whose S3 registry holds the model;
    returns its NetCluster (logs, kills, cache files). ``kw`` goes to NetCluster.start."""

    async def start(num_hosts: int, **kw: Any) -> NetCluster:
        kw.setdefault("rate_mbit", RATE_MBIT)
        c = await make_cluster(num_hosts, models=(), netns=True, **kw)
        assert isinstance(c, NetnsCluster)
        await c.net.publish(model.manifest, model.blob)
        return c.net

    return start


def _chain_of(c: NetCluster) -> tuple[str, list[str]]:
    """(head, receivers after it) of the one chain some host headed, from its log."""
    heads = [(h, e) for h in c.host_ids for e in c.events(h, "chain_start")]
    assert len(heads) == 1, f"expected exactly one chain head, got {heads}"
    head, event = heads[0]
    return head, [str(ep).split(":")[0] for ep in event["chain"]]


async def _wait_chain(c: NetCluster) -> tuple[str, list[str]]:
    async def probe() -> tuple[bool, Any]:
        heads = [h for h in c.host_ids if c.events(h, "chain_start")]
        return bool(heads), heads
    await c.wait("a host to head the registry chain", probe, 30.0, interval_s=0.05)
    return _chain_of(c)


def _assert_identical(c: NetCluster, hosts: list[str], model: Model) -> None:
    for h in hosts:
        path = c.cache_file(h, KEY)
        assert path.stat().st_size == model.manifest.blob_size, h
        assert sha256_file(path) == model.sha256, f"{h}: cached blob differs from the registry's"


def _inputs() -> tuple[dict[str, Any], torch.Tensor]:
    """An invoke body's inputs and the logits the original model gives for them."""
    module, config = build("bert", CONFIG)
    arrays = example_inputs("bert", config, batch=1)
    body = {name: {"data": a.ravel().tolist(), "shape": list(a.shape), "datatype": "INT64"}
            for name, a in arrays.items()}
    return body, run_example(module, arrays)


async def test_one_registry_chain_fills_four_hosts(start_cluster: Any, model: Model) -> None:
    c = await start_cluster(4)
    await c.deploy(FUNCTION, MODEL, min_replicas=4, max_replicas=4)
    warm = await c.wait_warm(FUNCTION, c.host_ids, timeout_s=60.0)
    # The controller planned one chain, headed from the registry by its first receiver.
    head, rest = _chain_of(c)
    assert sorted([head, *rest]) == sorted(c.host_ids), (head, rest)
    assert {h: r["source"] for h, r in warm.items()} == dict.fromkeys(c.host_ids, "chain:registry")
    # Every cold start moved bytes, and its timings say how long that took.
    fetch_s = {h: r["timings_s"].get("fetch", 0.0) for h, r in warm.items()}
    assert all(s > 0 for s in fetch_s.values()), fetch_s
    # Only the head read the blob from the registry: the others got it down the chain.
    assert c.registry_blob_readers(MODEL, VERSION) == {c.addr(head)}
    # Every host's cache holds exactly the registry's blob (read back from S3 here; the other
    # tests compare with the same bytes through model.sha256).
    registry_blob = await asyncio.to_thread(c.download_blob, MODEL, VERSION)
    assert hashlib.sha256(registry_blob).hexdigest() == model.sha256
    _assert_identical(c, c.host_ids, model)
    assert all(KEY in h["cached_models"] for h in (await c.status())["hosts"])
    body, expected = _inputs()
    reply = await c.invoke(FUNCTION, body)
    logits = reply["outputs"]["logits"]
    got = torch.tensor(np.asarray(logits["data"], np.float32).reshape(logits["shape"]))
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)


async def test_relay_killed_mid_stream_survivors_end_identical(start_cluster: Any,
                                                               model: Model) -> None:
    c = await start_cluster(4)
    ref = model.blob.read_bytes()
    n = model.manifest.num_chunks
    await c.deploy(FUNCTION, MODEL, min_replicas=4, max_replicas=4)
    head, rest = await _wait_chain(c)
    victim = rest[0]  # the 2nd host of the chain: the first relay
    path = c.cache_file(victim, KEY)

    def chunks_in() -> int:
        """Leading chunks of the victim's cache file that already hold the registry's bytes."""
        try:
            data = path.read_bytes()
        except OSError:
            return 0
        for i in range(n):
            start, end = model.manifest.chunk_range(i)
            if data[start:end] != ref[start:end]:
                return i
        return n

    async def probe() -> tuple[bool, Any]:
        got = chunks_in()
        return got >= n // 5, got
    await c.wait(f"{victim} to hold a fifth of the model", probe, 30.0, interval_s=0.03)
    killed = c.kill_host(victim)
    held = chunks_in()
    assert held < n, f"{victim} held all {n} chunks when killed: the test needs a lower rate"
    survivors = [h for h in c.host_ids if h != victim]
    await c.wait_warm(FUNCTION, survivors, timeout_s=60.0)
    _assert_identical(c, survivors, model)
    dead = [e for e in c.events(head, "downstream_dead") if str(e.get("peer")).startswith(victim)]
    assert dead, f"{head} never declared {victim} dead (killed pids {killed}, {held}/{n} chunks)"


async def test_peer_serves_the_model_while_the_registry_is_cut_off(start_cluster: Any,
                                                                   model: Model) -> None:
    c = await start_cluster(2)
    await c.deploy(FUNCTION, MODEL, min_replicas=1, max_replicas=2)
    (a,) = await c.wait_warm(FUNCTION, count=1, timeout_s=60.0)
    (b,) = [h for h in c.host_ids if h != a]

    async def a_holds_it() -> tuple[bool, Any]:
        hosts = {h["host_id"]: h["cached_models"] for h in (await c.status())["hosts"]}
        return KEY in hosts.get(a, []), hosts
    await c.wait(f"{a} to report {KEY} cached", a_holds_it, 10.0)

    c.lab.set_link(REGISTRY, up=False)
    with pytest.raises(OSError):  # the registry is gone for everyone, the root ns included
        socket.create_connection((c.registry_addr, S3_PORT), timeout=1.0).close()
    await c.deploy(FUNCTION, MODEL, min_replicas=2, max_replicas=2)
    warm = await c.wait_warm(FUNCTION, [a, b], timeout_s=60.0)
    assert warm[b]["source"] == f"chain:{a}", warm[b]
    assert warm[b]["timings_s"]["fetch"] > 0, warm[b]
    _assert_identical(c, [a, b], model)
    assert c.addr(b) not in c.registry_blob_readers(MODEL, VERSION)


async def test_corrupted_forwarded_chunk_is_repaired_downstream(start_cluster: Any,
                                                                model: Model) -> None:
    bad_chunk = 3
    fault = json.dumps({"corrupt_forward": [bad_chunk]})
    c = await start_cluster(4, host_env={"host1": {DATAPLANE_FAULT_ENV: fault}})
    assert c.events("host1", "dataplane_fault_injected"), "host1 did not pick up its fault plan"
    await c.deploy(FUNCTION, MODEL, min_replicas=4, max_replicas=4)
    warm = await c.wait_warm(FUNCTION, c.host_ids, timeout_s=60.0)
    # Placement ranks equal hosts by id, so host1 (the faulty one) is the first relay.
    assert _chain_of(c) == ("host0", ["host1", "host2", "host3"]), _chain_of(c)
    _assert_identical(c, c.host_ids, model)
    assert {h: r["source"] for h, r in warm.items()} == dict.fromkeys(c.host_ids, "chain:registry")

    def bad(host: str) -> list[int]:
        return [e.get("chunk") for e in c.events(host, "chunk_verify_failed")]
    # host1 flipped a byte of chunk 3 in what it forwarded; host2 caught it by its sha256 and
    # refetched it (host3 may or may not see the bad copy: host2 relays cut-through, before
    # its own verification). The head and host1 itself never saw a bad chunk.
    assert bad_chunk in bad("host2"), bad("host2")
    (done,) = c.events("host2", "receive_done")
    assert done["pulled"] == {"registry": model.manifest.chunk_range(bad_chunk)[1]
                              - model.manifest.chunk_range(bad_chunk)[0]}, done
    assert set(bad("host3")) <= {bad_chunk}, bad("host3")
    assert bad("host0") == bad("host1") == []


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The same weights as ``model``, published as version 2 with per-layer profiles (what
    a function needs to be partitioned)."""
    store = LocalStore(tmp_path_factory.mktemp("profiled") / "registry")
    manifest = asyncio.run(publish(store, "bert", CONFIG, "2", chunk_size=CHUNK_BYTES,
                                   model_name=MODEL, profile=True))
    blob = store.blob_path(MODEL, "2")
    return Model(manifest, blob, sha256_file(blob))


async def test_partitioned_scale_up_serves_across_hosts_then_completes(
        start_cluster: Any, profiled: Model) -> None:
    """Issue 4 end to end over real TCP: the controller splits a scale-up by two GPUs into
    two stages on two hosts (each pulls its own range from S3 first), serves the first
    request through the pipeline, and dissolves the group into two whole replicas once both
    hosts hold every byte (verified against the registry's blob)."""
    # The cost model matches the lab: each host's link is the bottleneck.
    c = await start_cluster(2, registry_capped=False, controller={
        "partition_bandwidth_bps": RATE_MBIT * 1e6, "partition_overhead_s": 0.2})
    await c.publish(profiled.manifest, profiled.blob)
    await c.deploy("part-fn", MODEL, model_version="2", max_stages=2, min_replicas=2,
                   max_replicas=2, keep_alive_s=300)
    body, expected = _inputs()
    reply = await c.invoke("part-fn", body)
    assert reply["cold_start_source"] == "pipeline:2", reply["cold_start_source"]
    logits = reply["outputs"]["logits"]
    got = torch.tensor(np.asarray(logits["data"], np.float32).reshape(logits["shape"]))
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)
    stages = [r for r in (await c.status())["replicas"] if r["function"] == "part-fn"]
    assert sorted(r["host_id"] for r in stages) == c.host_ids
    assert {r["group_id"] for r in stages} == {reply["replica_id"]}
    first, second = sorted(stages, key=lambda r: r["stage"][0])
    assert first["stage"][0] == 0 and second["stage"][0] == first["stage"][1] + 1
    assert second["stage"][1] == len(profiled.manifest.layers) - 1

    async def dissolved() -> tuple[bool, Any]:
        status = await c.status()
        mine = [(r["host_id"], r["phase"]) for r in status["replicas"]
                if r["function"] == "part-fn"]
        groups = [g for g in status["groups"] if g["function"] == "part-fn"]
        return not groups and len(mine) == 2 and all(p == "warm" for _, p in mine), (mine, groups)
    await c.wait("the group dissolved into two whole replicas", dissolved, 60.0)
    for h in c.host_ids:
        path = c.cache_file(h, f"{MODEL}@2")
        assert sha256_file(path) == profiled.sha256, f"{h}: cached blob differs"
    reply = await c.invoke("part-fn", body)
    assert reply["replica_id"] in {r["replica_id"] for r in stages}
    logits = reply["outputs"]["logits"]
    got = torch.tensor(np.asarray(logits["data"], np.float32).reshape(logits["shape"]))
    assert torch.allclose(got, expected, atol=1e-4)


async def test_a_killed_controller_restarts_without_losing_functions_or_duplicating_replicas(
        start_cluster: Any, model: Model) -> None:
    """Issue 6, item 2: SIGKILL the controller process; started again on the same state, it
    still knows every function (SQLite), the hosts re-register and report their replicas,
    and it adopts them — the same replica ids, the same worker processes, no duplicate."""
    c = await start_cluster(2)
    await c.deploy(FUNCTION, MODEL, min_replicas=2, max_replicas=2, keep_alive_s=600)
    await c.wait_warm(FUNCTION, c.host_ids, timeout_s=60.0)
    before = sorted(r["replica_id"] for r in (await c.status())["replicas"])
    body, expected = _inputs()
    await c.invoke(FUNCTION, body)

    async def pools_full() -> tuple[bool, Any]:
        # one replica worker + the refilled warm pool (1) per host: a host refills its pool
        # once its new replica has answered (or after [host] refill_hold_s)
        counts = {h: len(c.worker_pids(h)) for h in c.host_ids}
        return all(n == 2 for n in counts.values()), counts

    await c.wait("every host's warm pool refilled", pools_full, 30.0)
    workers = {h: sorted(c.worker_pids(h)) for h in c.host_ids}

    c.kill_controller()
    await c.restart_controller()

    status = await c.status()
    assert [f["spec"]["name"] for f in status["functions"]] == [FUNCTION]
    await c.wait_warm(FUNCTION, c.host_ids, count=2, timeout_s=30.0)
    await asyncio.sleep(2.0)  # a few control-loop ticks: nothing more may be started
    status = await c.status()
    assert sorted(r["replica_id"] for r in status["replicas"]) == before
    assert {h: sorted(c.worker_pids(h)) for h in c.host_ids} == workers
    reply = await c.invoke(FUNCTION, body)
    logits = reply["outputs"]["logits"]
    got = torch.tensor(np.asarray(logits["data"], np.float32).reshape(logits["shape"]))
    assert torch.allclose(got, expected, atol=1e-4)


async def test_clients_of_a_standalone_gateway_see_latency_not_errors_across_a_controller_kill(
        start_cluster: Any, model: Model) -> None:
    """Issue 6, item 2: clients invoke through ``flashpoint gateway`` while the controller is
    SIGKILLed and restarted: every request gets its correct answer, the ones caught in the
    outage only later."""
    c = await start_cluster(2)
    await c.deploy(FUNCTION, MODEL, min_replicas=2, max_replicas=2, keep_alive_s=600)
    await c.wait_warm(FUNCTION, c.host_ids, timeout_s=60.0)
    await c.start_gateway()
    assert c.session is not None
    session = c.session

    async def gateway_knows() -> tuple[bool, Any]:
        async with session.get(f"{c.gateway_url}/v1/functions/{FUNCTION}") as r:
            return r.status == 200, r.status
    await c.wait("the gateway knowing the function", gateway_knows, 30.0)
    body, expected = _inputs()
    failures: list[Any] = []
    served: list[float] = []  # completion times (monotonic)
    latencies: list[float] = []
    stop = asyncio.Event()

    async def client() -> None:
        for _ in range(10_000):  # bounded; ends when stopped
            if stop.is_set():
                return
            t0 = asyncio.get_running_loop().time()
            async with session.post(f"{c.gateway_url}/v1/functions/{FUNCTION}/invoke",
                                    json={"inputs": body, "timeout_s": 60}) as r:
                reply = await r.json(content_type=None)
            latencies.append(asyncio.get_running_loop().time() - t0)
            if r.status != 200:
                failures.append((r.status, reply))
                continue
            logits = reply["outputs"]["logits"]
            got = torch.tensor(np.asarray(logits["data"], np.float32).reshape(logits["shape"]))
            if not torch.allclose(got, expected, atol=1e-4):
                failures.append("wrong output")
            served.append(asyncio.get_running_loop().time())

    clients = [asyncio.ensure_future(client()) for _ in range(3)]
    try:
        await asyncio.sleep(1.0)
        before = len(served)
        c.kill_controller()
        killed_at = asyncio.get_running_loop().time()
        await asyncio.sleep(1.0)  # requests keep arriving at the gateway with no controller
        await c.restart_controller()
        await c.wait_warm(FUNCTION, c.host_ids, count=2, timeout_s=30.0)
        await asyncio.sleep(2.0)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 90)
    assert not failures, failures[:5]
    assert before > 0 and any(t > killed_at + 1.0 for t in served), "no request served after"
    async with session.get(f"{c.gateway_url}/v1/status") as r:
        status = await r.json()
    gw = status["gateway"]
    # The outage reached requests: in flight at the kill (re-sent) or arriving during it
    # (held until the controller was back). Which of the two depends on the kill's timing.
    assert gw["controller_connected"] and gw["retries"] + gw["held"] >= 1, gw
    print(f"\ncontroller killed under load through the gateway: {len(served)} requests served, "
          f"{len(failures)} failed, {gw['retries']} re-sent and {gw['held']} held by the gateway, "
          f"max latency {max(latencies):.2f}s, p50 {sorted(latencies)[len(latencies) // 2]:.3f}s")
