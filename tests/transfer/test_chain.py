"""TCP-chained multicast over loopback with in-process data-plane servers."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from flashpoint.errors import IntegrityError
from flashpoint.registry.local import LocalStore
from flashpoint.transfer.chain import send_chain
from flashpoint.transfer.plan import Endpoint, FaultPlan
from flashpoint.transfer.segment import Segment
from flashpoint.transfer.sources import PeerSource, RegistrySource, fill
from flashpoint.transfer.wire import BYTES_SENT, VERIFY_FAILURES

from .conftest import CHUNK, SECRET, wait_until


@pytest.fixture
def head_seg(blob):
    s = Segment.open_complete(blob.path, blob.manifest)
    yield s
    s.close()


async def test_chain_of_four_completes_tail_to_head(cluster, blob, head_seg):
    eps = [await cluster.add(f"r{i}") for i in range(4)]
    sent_before = BYTES_SENT.labels("relay")._value.get()
    result = await send_chain(head_seg, eps, secret=SECRET, transfer_id="t-happy", stall_timeout_s=5)
    assert result.completed == ["r0", "r1", "r2", "r3"] and result.failed == []
    assert result.bytes_sent == blob.manifest.blob_size and result.transfer_id == "t-happy"
    for i in range(4):
        assert cluster.data(f"r{i}", blob) == blob.data and cluster.complete_on_disk(f"r{i}", blob)
        part = await cluster.servers[f"r{i}"].wait_transfer("t-happy", 5)
        assert part.completed == [f"r{j}" for j in range(i, 4)]
        rx = cluster.servers[f"r{i}"].transfer("t-happy")
        assert rx.state == "done" and rx.pulled == {} and rx.bytes_streamed == blob.manifest.blob_size
    # three relays forwarded the whole blob once each
    assert BYTES_SENT.labels("relay")._value.get() - sent_before == 3 * blob.manifest.blob_size


async def test_receiver_resumes_from_its_bitmap(cluster, blob, head_seg):
    """A receiver that already holds some verified chunks is sent only the rest."""
    ep = await cluster.add("r0")
    seg = cluster.providers["r0"].open_for_receive(blob.manifest)
    have = list(range(0, blob.manifest.num_chunks, 2))
    await fill(seg, [PeerSource(await cluster.add("seed", seed=blob), SECRET)], indices=have)
    result = await send_chain(head_seg, [ep], secret=SECRET, transfer_id="t-resume")
    assert result.completed == ["r0"]
    assert result.bytes_sent == blob.manifest.blob_size - sum(
        len(seg.chunk_view(i)) for i in have)
    assert cluster.data("r0", blob) == blob.data


async def test_corrupt_chunks_are_refetched_from_fallback(cluster, blob, head_seg, tmp_path):
    store = LocalStore(tmp_path / "reg")
    await store.put(blob.manifest, blob.path)
    reg = RegistrySource(store)
    fault = FaultPlan(corrupt_forward=frozenset({3}), corrupt_store=frozenset({5}))
    eps = [await cluster.add("r0", fault=fault, registry_source=reg),
           await cluster.add("r1", registry_source=reg),
           await cluster.add("r2", registry_source=reg)]
    before = VERIFY_FAILURES.labels("chain")._value.get()
    result = await send_chain(head_seg, eps, secret=SECRET, transfer_id="t-bad",
                              fallback=[reg], stall_timeout_s=5)
    assert result.completed == ["r0", "r1", "r2"] and result.failed == []
    for h in ("r0", "r1", "r2"):
        assert cluster.data(h, blob) == blob.data
    rx = {h: cluster.servers[h].transfer("t-bad") for h in ("r0", "r1", "r2")}
    assert rx["r0"].pulled["registry"] == CHUNK  # its own copy of chunk 5
    # r1 got chunk 3 corrupt (and chunk 5 too if r0 forwarded it after the flip); r2 only
    # sees what r1 forwarded before r1's own verification reset those chunks.
    assert rx["r1"].pulled["registry"] in (CHUNK, 2 * CHUNK)
    assert rx["r2"].pulled.get("registry", 0) in (0, CHUNK, 2 * CHUNK)
    assert VERIFY_FAILURES.labels("chain")._value.get() - before >= 2


async def test_no_good_source_fails_the_receiver_with_integrity_error(cluster, blob, head_seg):
    eps = [await cluster.add("r0", fault=FaultPlan(corrupt_forward=frozenset({2}))),
           await cluster.add("r1")]
    result = await send_chain(head_seg, eps, secret=SECRET, transfer_id="t-nogood", stall_timeout_s=5)
    assert result.completed == ["r0"] and result.failed == ["r1"]
    with pytest.raises(IntegrityError) as ei:
        await cluster.servers["r1"].wait_transfer("t-nogood", 5)
    assert ei.value.details["chunk"] == 2
    seg = cluster.servers["r1"].transfer("t-nogood").segment
    assert not seg.has(2) and seg.missing() == [2]
    assert not cluster.complete_on_disk("r1", blob)


async def test_stalled_relay_is_declared_dead_and_spliced(cluster, blob, head_seg):
    eps = [await cluster.add("r0", fault=FaultPlan(stall_after_bytes=4 * CHUNK)),
           await cluster.add("r1"), await cluster.add("r2")]
    t0 = time.monotonic()
    result = await send_chain(head_seg, eps, secret=SECRET, transfer_id="t-stall",
                              stall_timeout_s=1.0, orphan_grace_s=5.0)
    assert time.monotonic() - t0 < 6
    assert result.completed == ["r1", "r2"] and result.failed == ["r0"]
    for h in ("r1", "r2"):
        assert cluster.data(h, blob) == blob.data
        assert cluster.servers[h].transfer("t-stall").pulled == {}  # resumed by the chain


async def test_downstream_that_never_reads_is_bounded(cluster, blob, head_seg):
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)  # accepts (kernel backlog) and never reads
    silent = Endpoint("silent", "127.0.0.1", lst.getsockname()[1])
    try:
        r1 = await cluster.add("r1")
        t0 = time.monotonic()
        result = await send_chain(head_seg, [silent, r1], secret=SECRET, transfer_id="t-silent",
                                  stall_timeout_s=0.5)
        assert time.monotonic() - t0 < 4
        assert result.completed == ["r1"] and result.failed == ["silent"]
    finally:
        lst.close()


async def test_dead_endpoint_and_custom_splice(cluster, blob, head_seg):
    r1 = await cluster.add("r1")
    dead = Endpoint("dead", "127.0.0.1", 1)
    calls = []

    def splice(chain, d):
        calls.append((list(chain), d))
        return [e for e in chain if e != d]

    result = await send_chain(head_seg, [dead, r1], secret=SECRET, transfer_id="t-dead", splice=splice)
    assert result.completed == ["r1"] and result.failed == ["dead"]
    assert calls == [([dead, r1], dead)]


async def test_head_lost_receivers_pull_from_registry(cluster, blob, head_seg, tmp_path):
    store = LocalStore(tmp_path / "reg")
    await store.put(blob.manifest, blob.path)
    reg = RegistrySource(store)
    eps = [await cluster.add("r0", registry_source=reg), await cluster.add("r1", registry_source=reg)]
    head = asyncio.create_task(send_chain(
        head_seg, eps, secret=SECRET, transfer_id="t-orphan", fallback=[reg], orphan_grace_s=0.2,
        rate_bps=blob.manifest.blob_size * 8 / 2.0))
    rx0 = lambda: cluster.servers["r0"].transfer("t-orphan")  # noqa: E731
    await wait_until(lambda: rx0() is not None and rx0().segment.valid_bytes > 8 * CHUNK, 10,
                     "r0 has some chunks")
    head.cancel()  # the head process goes away: its sockets close
    await asyncio.wait([head])
    res0 = await cluster.servers["r0"].wait_transfer("t-orphan", 15)
    res1 = await cluster.servers["r1"].wait_transfer("t-orphan", 15)
    assert res0.completed == ["r0", "r1"] and res1.completed == ["r1"]
    assert cluster.data("r0", blob) == blob.data and cluster.data("r1", blob) == blob.data
    assert rx0().pulled["registry"] > 0  # the orphan pulled the rest ...
    assert cluster.servers["r1"].transfer("t-orphan").pulled == {}  # ... and kept relaying


async def test_head_filling_from_upstream_sources(cluster, blob, tmp_path):
    """The registry as a sender: the head pulls and forwards each verified chunk."""
    store = LocalStore(tmp_path / "reg")
    await store.put(blob.manifest, blob.path)
    seg = Segment(tmp_path / "headseg", blob.manifest)
    try:
        eps = [await cluster.add("r0"), await cluster.add("r1")]
        result = await send_chain(seg, eps, secret=SECRET, transfer_id="t-up",
                                  upstream=[RegistrySource(store)])
        assert result.completed == ["r0", "r1"] and seg.complete
        assert cluster.data("r1", blob) == blob.data
    finally:
        seg.close()


async def test_status_reports_transfers(cluster, blob, head_seg):
    from flashpoint.transfer.node import fetch_status

    ep = await cluster.add("r0")
    await send_chain(head_seg, [ep], secret=SECRET, transfer_id="t-st")
    st = await fetch_status(ep, SECRET)
    assert st["transfers"]["t-st"]["state"] == "done"
    assert st["transfers"]["t-st"]["valid_bytes"] == blob.manifest.blob_size


async def test_stop_mid_transfer_leaves_no_tasks(cluster, blob, head_seg):
    """Stopping every server mid-stream: the head reports them failed, no task survives
    (the cluster fixture checks for leftover dp- tasks)."""
    eps = [await cluster.add("r0"), await cluster.add("r1")]
    head = asyncio.create_task(send_chain(
        head_seg, eps, secret=SECRET, transfer_id="t-stop", stall_timeout_s=1.0,
        rate_bps=blob.manifest.blob_size * 8 / 3.0))
    waiter = asyncio.create_task(cluster.servers["r1"].wait_transfer("t-stop", 10))
    await wait_until(lambda: cluster.servers["r1"].transfer("t-stop") is not None
                     and cluster.servers["r1"].transfer("t-stop").segment.valid_bytes > 0, 10,
                     "r1 is receiving")
    for s in cluster.servers.values():
        await s.stop()
    result = await asyncio.wait_for(head, 10)
    assert result.completed == [] and set(result.failed) == {"r0", "r1"}
    with pytest.raises(Exception):  # noqa: B017 - TransferFailed: the server stopped
        await waiter


async def test_receiver_without_space_fails_cleanly(cluster, blob, head_seg, monkeypatch):
    import errno
    import os

    from flashpoint.errors import NoCapacity

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    eps = [await cluster.add("r0"), await cluster.add("r1")]
    result = await send_chain(head_seg, eps, secret=SECRET, transfer_id="t-full", stall_timeout_s=2)
    assert result.completed == [] and set(result.failed) == {"r0", "r1"}
    with pytest.raises(NoCapacity):
        await cluster.servers["r0"].wait_transfer("t-full", 5)
