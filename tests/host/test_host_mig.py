"""MIG geometries applied by the host (host/gpu.py) on fake NVML GPUs: refused while
busy, typed errors, new slices become placement units with their own MPS daemons; and the
same across the RPC boundary in a local cluster (typed errors with their codes, the
controller sees the slices)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest
from gpu.fake_mps import install_fake_mps

from flashpoint.config import HostConfig, load_config
from flashpoint.errors import BadRequest, GpuBusy, InvalidGeometry, MigUnavailable, NotFound
from flashpoint.host.gpu import HostGpu
from flashpoint.procs import pid_alive
from flashpoint.testing.harness import ClusterFactory

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch) -> str:
    bin_dir = install_fake_mps(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


@pytest.fixture
def run_dir():
    d = Path(f"/tmp/fpm-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _hc(run_dir: Path, **kw) -> HostConfig:
    return dataclasses.replace(HostConfig(), fake_gpus=["A100-40GB", "A100-40GB"],
                               fake_gpu_mig=True, sharing_dir=str(run_dir), **kw)


async def test_apply_geometry_refuses_while_busy_then_reports_slices(fake_path, run_dir):
    gpu = HostGpu(_hc(run_dir, gpu_sharing="mps"), "h0")
    busy: dict[int, list[str]] = {0: ["rep-1"]}
    try:
        assert await gpu.start() == []  # MIG on, no instances yet: no placement unit
        await gpu.apply_mig(1, ["3g", "2g", "2g"],
                            lambda i: busy.get(i, []))
        first = [d for d in gpu.devices if d.gpu_index == 1]
        assert sorted(d.mig_profile for d in first) == ["2g.10gb", "2g.10gb", "3g.20gb"]
        assert all(d.uuid.startswith("MIG-") for d in first)
        daemons = {d.device_id: gpu.sharing.units[d.device_id].daemon.pid for d in first}
        assert all(pid_alive(p) for p in daemons.values())
        # GPU 0 runs a replica: refused with the replicas named, nothing touched
        with pytest.raises(GpuBusy) as e:
            await gpu.apply_mig(0, ["7g"], lambda i: busy.get(i, []))
        assert e.value.details["replicas"] == ["rep-1"] and gpu.draining == set()
        # invalid geometry: typed, before anything else, even though the GPU is busy
        with pytest.raises(InvalidGeometry):
            await gpu.apply_mig(0, ["4g", "4g"],
                                lambda i: busy.get(i, []))
        with pytest.raises(NotFound):
            await gpu.apply_mig(7, ["7g"], lambda i: [])
        with pytest.raises(BadRequest):
            await gpu.apply_mig("1", ["7g"], lambda i: [])
        # reconfigure GPU 1 again: the old slices' daemons go, the new slice gets one
        reply = await gpu.apply_mig(1, ["7g"], lambda i: [])
        (new,) = [d for d in gpu.devices if d.gpu_index == 1]
        assert reply["slices"][0]["uuid"] == new.uuid and reply["slices"][0]["device_id"] == new.device_id
        assert new.mig_profile == "7g.40gb"
        assert not any(pid_alive(p) for p in daemons.values())
        assert set(gpu.sharing.units) == {new.device_id}
        assert gpu.sharing.attach("r", new, None)["CUDA_VISIBLE_DEVICES"] == new.uuid
    finally:
        await gpu.stop()


async def test_deploys_refused_while_draining_and_mig_off_is_typed(run_dir):
    gpu = HostGpu(dataclasses.replace(HostConfig(), fake_gpus=["H100-80GB"],
                                      sharing_dir=str(run_dir)), "h0")
    try:
        (d,) = await gpu.start()  # MIG off: the whole GPU is the unit
        with pytest.raises(MigUnavailable):
            await gpu.apply_mig(0, ["7g"], lambda i: [])
        assert gpu.draining == set()
        gpu.draining.add(0)
        from flashpoint.errors import Unavailable

        with pytest.raises(Unavailable):
            gpu.check_deployable(d)
    finally:
        await gpu.stop()


async def test_apply_mig_over_rpc_and_controller_sees_slices(make_cluster: ClusterFactory, tmp_path):
    cfg = load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05},
        "host": {"warm_pool_size": 0, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp_path / "cache"), "fake_gpus": ["A100-80GB"],
                 "fake_gpu_mig": True},
    }).with_home(tmp_path)
    c = await make_cluster(hosts=1, models=(), config=cfg, start_timeout_s=60)
    host_id = c.hosts[0].host_id
    conn = c.controller.hosts[host_id].conn
    assert c.controller.state.hosts[host_id].devices == {}
    with pytest.raises(InvalidGeometry) as e:  # the typed error crosses the wire
        await conn.call("apply_mig", {"gpu_index": 0, "geometry": ["5g"]}, timeout_s=10)
    assert e.value.code == "invalid_geometry"
    reply = await conn.call("apply_mig", {"gpu_index": 0, "geometry": ["4g", "3g"]},
                            timeout_s=10)
    ids = sorted(s["device_id"] for s in reply["slices"])
    assert len(ids) == 2
    deadline = time.monotonic() + 10
    while sorted(c.controller.state.hosts[host_id].devices) != ids:
        assert time.monotonic() < deadline, c.controller.state.hosts[host_id].devices
        await asyncio.sleep(0.05)
    mem = {d.device_id: d.memory_bytes for d in c.controller.state.hosts[host_id].devices.values()}
    assert set(mem.values()) == {40 << 30}  # A100-80GB: 4g.40gb and 3g.40gb
    assert sorted(d.mig_profile for d in c.hosts[0].devices) == ["3g.40gb", "4g.40gb"]


async def test_weight_slot_only_for_real_gpus_with_share_weights(run_dir):
    from flashpoint.gpu.fake_nvml import FakeNvml
    from flashpoint.gpu.weight_share import slot_key

    fake = HostGpu(_hc(run_dir, share_weights=True), "h0")  # fake GPUs: never
    real_like = HostGpu(dataclasses.replace(HostConfig(), share_weights=True,
                                            sharing_dir=str(run_dir / "r")),
                        "h1", nvml=FakeNvml.with_gpus("H100-80GB", mig=False))
    off = HostGpu(dataclasses.replace(HostConfig(), sharing_dir=str(run_dir / "o")), "h2",
                  nvml=FakeNvml.with_gpus("H100-80GB", mig=False))
    try:
        await fake.start()
        await fake.apply_mig(0, ["7g"], lambda i: [])
        assert fake.weight_slot(fake.devices[0], "bert@1") is None
        (d,) = await real_like.start()
        slot = real_like.weight_slot(d, "bert@1")
        assert slot == {"dir": str(run_dir / "r" / "weights"), "key": slot_key("bert@1", d.uuid)}
        assert real_like.weight_slot(d, "bert@2")["key"] != slot["key"]
        (d2,) = await off.start()
        assert off.weight_slot(d2, "bert@1") is None
    finally:
        for g in (fake, real_like, off):
            await g.stop()


async def test_a_run_dir_the_host_made_is_removed_at_stop():
    gpu = HostGpu(dataclasses.replace(HostConfig(), fake_gpus=["H100-80GB"],
                                      gpu_sharing="tokens"), "h0")
    from flashpoint.gpu.hookbuild import find_compiler

    try:
        find_compiler()
    except Exception:
        pytest.skip("the hook needs a C compiler")
    await gpu.start()
    run_dir = gpu.sharing.run_dir
    sock = Path(gpu.sharing.units["cuda:0"].socket_path)
    assert run_dir.name.startswith("fpsh-") and sock.exists()
    await gpu.stop()
    assert not run_dir.exists()
