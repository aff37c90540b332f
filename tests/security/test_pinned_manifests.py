"""Issue 19 item 1, pinned manifests: a data-plane peer (it has the cluster secret) pushes a
manifest of its own for a model version; nothing any worker loads may change because of it.

The controller pins the registry manifest's digest in every deploy and transfer it orders;
hosts receive only announced transfers, key cached models by digest, and refuse a manifest
or chunk that does not match (transfer/admission.py, HostCache.entry_for)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from flashpoint.errors import Forbidden, IntegrityError
from flashpoint.registry.manifest import Manifest
from flashpoint.testing.harness import ClusterFactory
from flashpoint.transfer.admission import TransferAdmission
from flashpoint.transfer.cache import HostCache
from flashpoint.transfer.chain import send_chain
from flashpoint.transfer.dataplane import DataPlaneServer
from flashpoint.transfer.node import make_synthetic
from flashpoint.transfer.segment import Segment

pytestmark = pytest.mark.timeout(120)

SECRET = b"pinned-manifest-test-secret"
CHUNK = 64 * 1024


def _forge(directory: Path, real: Manifest, *, entry_point: str | None = None,
           config: dict[str, Any] | None = None) -> tuple[Path, Manifest]:
    """Mallory's blob for ``real``'s name and version: other bytes, a manifest whose chunk
    hashes match them (so every chunk verifies against the forged manifest)."""
    forged = make_synthetic(directory / "forged", None, size_bytes=real.blob_size,
                            chunk_size=real.chunk_size, seed=666)
    manifest = dataclasses.replace(
        real, chunk_sha256=forged.chunk_sha256, entry_point=entry_point or real.entry_point,
        config=real.config if config is None else config)
    return directory / "forged", manifest


class _BlobSource:
    """The registry, for a cache test: serves the real blob's bytes."""

    name = "registry"

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read_into(self, manifest: Manifest, index: int, dest: memoryview) -> None:
        start, end = manifest.chunk_range(index)
        dest[:] = self.data[start:end]


@pytest.fixture
def real(tmp_path: Path) -> tuple[Path, Manifest]:
    path = tmp_path / "real"
    return path, make_synthetic(path, None, size_bytes=1 << 20, chunk_size=CHUNK, seed=1,
                                name="bert", version="1")


def test_the_digest_pins_every_field_and_survives_the_wire(real: tuple[Path, Manifest]) -> None:
    _, m = real
    assert Manifest.from_json(m.to_json()).digest == m.digest
    assert len(m.digest) == 64
    for change in ({"entry_point": "subprocess:Popen"}, {"config": {"args": ["id"]}},
                   {"chunk_sha256": (m.chunk_sha256[1], m.chunk_sha256[0],
                                     *m.chunk_sha256[2:])},
                   {"trusted_code": True}):
        assert dataclasses.replace(m, **change).digest != m.digest, change


async def test_a_cached_copy_with_another_digest_is_a_miss_and_refetched(
        tmp_path: Path, real: tuple[Path, Manifest]) -> None:
    path, m = real
    fpath, forged = _forge(tmp_path, m, entry_point="subprocess:Popen")
    cache = HostCache(tmp_path / "cache", 16 << 20, "h1")
    cache.start()
    try:
        # Mallory's copy got in (say, before this fix): it is held complete as bert@1.
        await cache.ensure(forged, [_BlobSource(fpath.read_bytes())])
        assert cache.get("bert@1") is not None
        entry, hit = await cache.ensure(m, [_BlobSource(path.read_bytes())])
        assert not hit, "a copy of another manifest was taken as a cache hit"
        assert entry.digest == m.digest
        assert hashlib.sha256(entry.path.read_bytes()).digest() == \
            hashlib.sha256(path.read_bytes()).digest()
        # In use, a copy of another digest is refused rather than replaced under its reader.
        cache.pin("bert@1")
        with pytest.raises(IntegrityError):
            cache.entry_for(forged)
    finally:
        cache.close()


async def test_admission_waits_for_the_announcement_then_checks_the_digest(
        real: tuple[Path, Manifest]) -> None:
    _, m = real
    adm = TransferAdmission()
    with pytest.raises(Forbidden):
        await adm.admit("t-unknown", m, wait_s=0.05)
    late = asyncio.ensure_future(adm.admit("t-1", m, wait_s=5.0))
    await asyncio.sleep(0)  # admit is waiting now: the announcement wakes it (no polling)
    adm.announce("t-1", m.digest)
    await asyncio.wait_for(late, 5.0)
    with pytest.raises(IntegrityError):
        await adm.admit("t-1", dataclasses.replace(m, entry_point="os:system"), wait_s=0.05)


async def test_the_data_plane_refuses_unannounced_and_forged_pushes(
        tmp_path: Path, real: tuple[Path, Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    import flashpoint.transfer.admission as admission_mod

    monkeypatch.setattr(admission_mod, "ANNOUNCE_WAIT_S", 0.2)
    monkeypatch.setattr(TransferAdmission.admit, "__defaults__", (0.2,))
    path, m = real
    fpath, forged = _forge(tmp_path, m, entry_point="subprocess:Popen",
                           config={"/bin/touch": 0, str(tmp_path / "pwned"): 0})
    cache = HostCache(tmp_path / "cache", 16 << 20, "victim")
    cache.start()
    adm = TransferAdmission()
    server = DataPlaneServer(cache, SECRET, host_id="victim", admission=adm)
    ep = await server.start()
    evil = Segment.open_complete(fpath, forged)
    good = Segment.open_complete(path, m)
    try:
        async def push(seg: Segment, tid: str) -> Any:
            return await send_chain(seg, [ep], secret=SECRET, transfer_id=tid,
                                    host_id="mallory", stall_timeout_s=5.0, timeout_s=30.0)

        r = await push(evil, "evil-1")  # nobody announced it
        assert r.completed == [] and r.failed == ["victim"]
        adm.announce("deploy-1", m.digest)  # a real deploy's chain, with the pinned digest
        r = await push(evil, "deploy-1")  # Mallory rides on its transfer id
        assert r.completed == [] and r.failed == ["victim"]
        assert cache.keys() == [] and cache.entry("bert@1") is None
        r = await push(good, "deploy-1")  # the controller's own transfer still works
        assert r.completed == ["victim"]
        assert cache.get("bert@1").digest == m.digest
        assert not (tmp_path / "pwned").exists()
    finally:
        evil.close()
        good.close()
        await server.stop()
        cache.close()


# -- the whole story, on a real one-host cluster ---------------------------------------------


def cluster_config(tmp_path: Path) -> Any:
    from flashpoint.config import load_config

    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05},
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache")},
    }).with_home(tmp_path)


async def wait_for(what: str, cond: Any, timeout_s: float, state: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded; says what was reached on a timeout
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}"
                         + (f"; state: {state()}" if state is not None else ""))



async def test_a_forged_push_changes_nothing_that_any_worker_loads(make_cluster: ClusterFactory,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashpoint.host.actor import HostManager
    from flashpoint.models.sources import publish
    from flashpoint.registry import make_store

    loads: list[dict[str, Any]] = []
    real_take = HostManager._take_worker

    async def recording_take(self: HostManager) -> Any:
        """Record what the host tells a worker to load (its manifest and its bytes)."""
        w = await real_take(self)
        call = w.conn.call

        async def spy(method: str, payload: dict[str, Any], **kw: Any) -> Any:
            if method == "load_replica":
                loads.append({"manifest_json": payload["manifest_json"],
                              "blob_sha256": hashlib.sha256(
                                  Path(payload["cache_path"]).read_bytes()).hexdigest()})
            return await call(method, payload, **kw)

        w.conn.call = spy
        return w

    monkeypatch.setattr(HostManager, "_take_worker", recording_take)
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    real = await publish(store, "noop", "tiny", "1", model_name="noop")
    real_blob_sha = hashlib.sha256(store.blob_path("noop", "1").read_bytes()).hexdigest()
    # Mallory's noop@1: a built-in entry point (a worker would load it without a word) over
    # other bytes, and another config.
    fpath, forged = _forge(tmp_path, real, config={**real.config, "forged": True})
    c = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    evil = Segment.open_complete(fpath, forged)
    try:
        host = c.hosts[0]
        result = await send_chain(evil, [host.data_endpoint], secret=cfg.secret.encode(),
                                  transfer_id="mallory-1", host_id="mallory",
                                  stall_timeout_s=5.0, timeout_s=30.0)
        assert result.completed == [], "the host took a push nobody announced"
        assert host.cache.entry("noop@1") is None
        url = c.controller.url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{url}/v1/functions", json={
                    "name": "f", "model": "noop", "min_replicas": 1}) as r:
                assert r.status == 201, await r.text()
            await wait_for("replica warm", lambda: any(
                r.phase == "warm" for r in c.controller.state.replicas.values()), 60,
                state=lambda: {k: r.phase for k, r in c.controller.state.replicas.items()})
        assert loads, "no worker loaded anything"
        for load in loads:
            assert Manifest.from_json(load["manifest_json"]).digest == real.digest
            assert load["blob_sha256"] == real_blob_sha
        assert host.cache.get("noop@1").digest == real.digest
    finally:
        evil.close()
        await asyncio.wait_for(c.stop(), 60)
