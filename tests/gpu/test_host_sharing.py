"""Host-side GPU sharing on fake NVML devices: MPS daemons per GPU/MIG unit against the
fake ``nvidia-cuda-mps-control`` (tests/gpu/fake_mps_control.py), the absent-binary case,
the worker env, and the config check. The tokens mode is in tests/gpu_hook/test_host_tokens.py
(it needs the hook and the fake libcuda built)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from flashpoint.config import load_config
from flashpoint.errors import BadRequest, Conflict
from flashpoint.gpu.fake_nvml import FakeGpu, FakeNvml
from flashpoint.gpu.host_sharing import GpuShare, HostSharing, SharingMode, bind_env
from flashpoint.gpu.inventory import discover
from flashpoint.gpu.mig import apply_geometry
from flashpoint.gpu.mps import PID_FILE
from flashpoint.gpu.worker_env import apply_env
from flashpoint.procs import pid_alive

from .fake_mps import install_fake_mps

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_bin(tmp_path: Path) -> str:
    return install_fake_mps(tmp_path)


@pytest.fixture
def run_dir():
    d = Path(f"/tmp/fpu-{os.getpid()}-{time.monotonic_ns() % 10**8}")  # short: pipe paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def _mixed_devices():
    """One whole A100 and one H100 with MIG on, cut into 4g + 3g: three placement units."""
    nvml = FakeNvml([FakeGpu("A100-40GB", mig_current=False), FakeGpu("H100-80GB")])

    async def drained() -> None:
        return None

    nvml.nvmlInit()
    try:
        await apply_geometry(nvml, 1, ["4g", "3g"], drained)
    finally:
        nvml.nvmlShutdown()
    return discover(0, 0, nvml)


async def test_mps_daemon_per_gpu_and_mig_unit(fake_bin, run_dir):
    devices = await _mixed_devices()
    assert [d.device_id.split("/")[0] for d in devices] == ["cuda:0", "cuda:1", "cuda:1"]
    assert devices[0].uuid.startswith("GPU-")
    assert all(d.uuid.startswith("MIG-") and d.gpu_index == 1 for d in devices[1:])
    assert sorted(d.mig_profile[:2] for d in devices[1:]) == ["3g", "4g"]
    sharing = HostSharing(SharingMode.MPS, run_dir, mps_search_path=fake_bin)
    await sharing.start(devices)
    pids: list[int] = []
    try:
        units = [sharing.units[d.device_id] for d in devices]
        pids = [u.daemon.pid for u in units]
        assert len(set(pids)) == 3 and all(pid_alive(p) for p in pids)
        assert len({u.daemon.pipe_dir for u in units}) == 3  # own pipe and log dirs
        for u in units:  # each daemon serves exactly its unit
            assert f"devices={u.device.uuid}" in (u.daemon.log_dir / "control.log").read_text()
            assert (u.daemon.pipe_dir / PID_FILE).read_text() == str(u.daemon.pid)
        env = sharing.attach("rep-1", devices[1], GpuShare(0.25, 0.25, 1.0, 3 << 30))
        assert env == {"CUDA_VISIBLE_DEVICES": devices[1].uuid,
                       "CUDA_MPS_PIPE_DIRECTORY": str(units[1].daemon.pipe_dir),
                       "CUDA_MPS_LOG_DIRECTORY": str(units[1].daemon.log_dir),
                       "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                       "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M"}
        # no share: bound to its unit's daemon, no caps
        env0 = sharing.attach("rep-0", devices[0], None)
        assert env0["CUDA_MPS_PIPE_DIRECTORY"] == str(units[0].daemon.pipe_dir)
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env0
        with pytest.raises(Conflict):  # MPS fixes the share at the client's start
            sharing.set_share("rep-1", GpuShare(0.5, 0.5, 1.0))
        assert await sharing.check_health() == {d.device_id: True for d in devices}
        # A daemon that died is noticed and started again.
        os.kill(pids[2], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while pid_alive(pids[2]) and time.monotonic() < deadline:
            time.sleep(0.02)
        health = await sharing.check_health()
        assert health[devices[2].device_id] is True
        new_pid = units[2].daemon.pid
        assert new_pid not in pids and pid_alive(new_pid)
        pids.append(new_pid)
        st = sharing.status()
        assert st["mode"] == "mps" and st["units"][devices[2].device_id]["mps_pid"] == new_pid
    finally:
        await sharing.stop()
    assert not any(pid_alive(p) for p in pids)  # every daemon stopped with the host
    assert sharing.units == {}


async def test_mps_binary_absent_runs_without_mps(run_dir, tmp_path, caplog):
    devices = discover(0, 0, FakeNvml.with_gpus("A100-40GB", mig=False))
    empty = tmp_path / "empty"
    empty.mkdir()
    sharing = HostSharing(SharingMode.MPS, run_dir, mps_search_path=str(empty))
    await sharing.start(devices)  # no crash
    try:
        assert sharing.units[devices[0].device_id].daemon is None
        assert any("not found" in n and "without MPS" in n for n in sharing.notes)
        env = sharing.attach("rep-1", devices[0], GpuShare(0.5, 0.5, 1.0, 1 << 30))
        assert env == {"CUDA_VISIBLE_DEVICES": devices[0].uuid}  # bound, not shared
        assert sharing.status()["notes"] == sharing.notes
    finally:
        await sharing.stop()


def test_cpu_units_are_not_shared_and_none_mode_binds_only():
    cpu = discover(2, 1 << 30, FakeNvml(driver_loaded=False))
    assert [d.kind for d in cpu] == ["cpu", "cpu"] and bind_env(cpu[0]) == {}
    gpu = discover(0, 0, FakeNvml.with_gpus("H100-80GB", mig=False))[0]
    assert bind_env(gpu) == {"CUDA_VISIBLE_DEVICES": gpu.uuid}
    none = HostSharing(SharingMode.NONE, Path("/tmp/unused"))
    assert none.attach("r", gpu, None) == {"CUDA_VISIBLE_DEVICES": gpu.uuid}
    with pytest.raises(BadRequest):  # a share where nothing could enforce it
        none.attach("r2", gpu, GpuShare(0.5, 0.5, 1.0))
    assert none.spawn_env() == {}


def test_share_wire_and_validation():
    s = GpuShare(0.305, 0.3, 0.6, 1 << 30, False)
    assert GpuShare.from_wire(s.to_wire()) == s
    assert s.thread_percentage == 31  # rounded up, never below the share
    assert GpuShare(1.0, 1.0, 1.0).thread_percentage == 100
    assert GpuShare.from_wire({"sm_share": 0.4}) == GpuShare(0.4, 0.4, 1.0)
    for bad in ({"sm_share": 0}, {"sm_share": 1.5}, {"sm_share": 0.5, "time_request": 0.9,
                                                     "time_limit": 0.5},
                {"sm_share": 0.5, "memory_bytes": -1}, {"sm_share": True}, {"nope": 1}, [],
                {"sm_share": 0.5, "extra": 1}):
        with pytest.raises(BadRequest):
            GpuShare.from_wire(bad)


def test_worker_env_before_and_after_cuda_init(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    env = {"CUDA_VISIBLE_DEVICES": "MIG-x", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    assert apply_env(env, cuda_initialized=lambda: False) == env
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "MIG-x"
    # the same values again: nothing changes, so CUDA being up does not matter
    assert apply_env(env, cuda_initialized=lambda: True) == {}
    with pytest.raises(Conflict) as e:  # CUDA would never see the new value
        apply_env({"CUDA_VISIBLE_DEVICES": "MIG-y"}, cuda_initialized=lambda: True)
    assert e.value.details["variables"] == ["CUDA_VISIBLE_DEVICES"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "MIG-x"
    for bad in ({"LD_PRELOAD": "/x.so"}, {"PATH": "/"}, {"CUDA_VISIBLE_DEVICES": 3}):
        with pytest.raises(BadRequest):
            apply_env(bad, cuda_initialized=lambda: False)


def test_config_validates_sharing_mode_and_fake_gpus():
    assert load_config(overrides={"host": {"gpu_sharing": "mps"}}).host.gpu_sharing == "mps"
    with pytest.raises(BadRequest, match="none.*mps.*tokens"):
        load_config(overrides={"host": {"gpu_sharing": "mig"}})
    with pytest.raises(BadRequest, match="fake_gpus"):
        load_config(overrides={"host": {"fake_gpus": ["V100"]}})
    cfg = load_config(overrides={"host": {"fake_gpus": ["A100-40GB"], "fake_gpu_mig": True}})
    assert cfg.host.fake_gpus == ["A100-40GB"]
