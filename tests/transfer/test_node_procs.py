"""Real node processes: a relay or the head SIGKILLed mid-stream, and the node CLI."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from flashpoint.transfer.chain import send_chain
from flashpoint.transfer.node import fetch_status
from flashpoint.transfer.plan import FaultPlan
from flashpoint.transfer.segment import Segment

from .conftest import SECRET, SECRET_ENV, Blob, node_env, start_node, wait_until


async def run_cli(*args: str, timeout_s: float = 30.0) -> tuple[int, list[dict]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flashpoint.transfer.node", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env=node_env())
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, [json.loads(line) for line in out.decode().splitlines()]


async def received_bytes(ep, tid: str) -> int:
    st = await fetch_status(ep, SECRET)
    return st["transfers"].get(tid, {}).get("received_bytes", 0)


async def test_relay_killed_mid_stream_is_spliced_out(cluster, nodes, blob: Blob, tmp_path: Path):
    """head -> r0 (paced) -> r1 (a process, SIGKILLed) -> r2 -> r3: r0 splices r1 out and
    resumes r2 from its first missing chunk; everyone else ends byte-identical."""
    size = blob.manifest.blob_size
    r0 = await cluster.add("r0", fault=FaultPlan(forward_rate_bps=size * 8 / 2.5))
    nodes.append(await start_node(tmp_path / "r1", "r1"))
    r1 = nodes[0].endpoint
    r2, r3 = await cluster.add("r2"), await cluster.add("r3")
    seed = await cluster.add("seed", seed=blob)
    head_seg = Segment.open_complete(blob.path, blob.manifest)
    try:
        send = asyncio.create_task(send_chain(
            head_seg, [r0, r1, r2, r3], secret=SECRET, transfer_id="t-kill", fallback=[seed],
            stall_timeout_s=2.0, orphan_grace_s=8.0))
        await wait_until(lambda: _between(r1, size),
                         15, "r1 holds some but not all bytes", interval_s=0.05)
        nodes[0].kill()
        result = await asyncio.wait_for(send, 20)
    finally:
        head_seg.close()
    assert result.failed == ["r1"] and result.completed == ["r0", "r2", "r3"]
    for h in ("r0", "r2", "r3"):
        assert cluster.data(h, blob) == blob.data
        assert cluster.servers[h].transfer("t-kill").pulled == {}
    # r2 was resumed, not restarted: at most one partial chunk came twice
    assert cluster.servers["r2"].transfer("t-kill").bytes_streamed <= size + blob.manifest.chunk_size


async def _between(ep, size: int) -> bool:
    got = await received_bytes(ep, "t-kill")
    return 0.15 * size < got < 0.7 * size


async def test_head_killed_orphan_pulls_from_peer_and_keeps_relaying(cluster, blob: Blob):
    size = blob.manifest.blob_size
    r0, r1 = await cluster.add("r0"), await cluster.add("r1")
    seed = await cluster.add("seed", seed=blob)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flashpoint.transfer.node", "send", "--blob", str(blob.path),
        "--manifest", str(blob.manifest_path), "--chain", f"{r0},{r1}", "--fallback", str(seed),
        "--transfer-id", "t-head", "--orphan-grace-s", "0.3", "--rate-bps", str(size * 8 / 3),
        "--secret-env", SECRET_ENV, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, env=node_env())
    try:
        rx0 = lambda: cluster.servers["r0"].transfer("t-head")  # noqa: E731
        await wait_until(lambda: rx0() is not None and rx0().segment.valid_bytes > 0.15 * size,
                         15, "r0 holds some chunks")
        assert not rx0().segment.complete
        proc.kill()  # SIGKILL by PID
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    res0 = await cluster.servers["r0"].wait_transfer("t-head", 15)
    res1 = await cluster.servers["r1"].wait_transfer("t-head", 15)
    assert res0.completed == ["r0", "r1"] and res0.failed == [] and res1.completed == ["r1"]
    assert cluster.data("r0", blob) == blob.data and cluster.data("r1", blob) == blob.data
    assert cluster.servers["r0"].transfer("t-head").pulled["peer:seed"] > 0
    assert cluster.servers["r1"].transfer("t-head").pulled == {}


async def test_cli_serve_send_get(nodes, blob: Blob, tmp_path: Path):
    nodes.append(await start_node(tmp_path / "a", "a"))
    nodes.append(await start_node(tmp_path / "b", "b"))
    chain = ",".join(str(n.endpoint) for n in nodes)
    rc, lines = await run_cli("send", "--blob", str(blob.path), "--manifest", str(blob.manifest_path),
                              "--chain", chain, "--secret-env", SECRET_ENV, "--transfer-id", "t-cli")
    assert rc == 0, lines
    (res,) = lines
    assert res["event"] == "result" and res["completed"] == ["a", "b"] and res["failed"] == []
    assert res["transfer_id"] == "t-cli" and res["bytes_sent"] == blob.manifest.blob_size
    key = f"{blob.manifest.name}@{blob.manifest.version}"
    for d in ("a", "b"):
        assert (tmp_path / d / key).read_bytes() == blob.data
        assert json.loads((tmp_path / d / f"{key}.json").read_text())["name"] == blob.manifest.name
    # peer pull from b
    out = tmp_path / "pulled"
    rc, lines = await run_cli("get", "--from", str(nodes[1].endpoint), "--manifest",
                              str(blob.manifest_path), "--out", str(out), "--secret-env", SECRET_ENV)
    assert rc == 0 and lines[0]["event"] == "got" and out.read_bytes() == blob.data
    # a chain through a dead address exits 1 and names it
    rc, lines = await run_cli("send", "--blob", str(blob.path), "--manifest", str(blob.manifest_path),
                              "--chain", f"{nodes[0].endpoint},dead:127.0.0.1:1",
                              "--secret-env", SECRET_ENV, "--stall-timeout-s", "2")
    assert rc == 1 and lines[0]["failed"] == ["dead"] and lines[0]["completed"] == ["a"]


async def test_cli_make_blob(tmp_path: Path):
    rc, lines = await run_cli("make-blob", "--out", str(tmp_path / "b"), "--manifest",
                              str(tmp_path / "b.json"), "--size-bytes", "300000", "--chunk-size", "65536")
    assert rc == 0 and lines[0]["blob_size"] == 300000 and lines[0]["num_chunks"] == 5
    seg = Segment.open_complete(tmp_path / "b", __import__(
        "flashpoint.registry.manifest", fromlist=["Manifest"]).Manifest.from_json(
            (tmp_path / "b.json").read_text()), verify=True)
    seg.close()
