"""MPS daemons against a fake nvidia-cuda-mps-control on PATH, and the absent-binary case."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashpoint.errors import BadRequest, MpsUnavailable
from flashpoint.gpu.mps import (
    PID_FILE,
    MpsConfig,
    MpsDaemon,
    find_control_binary,
    per_device_configs,
)
from flashpoint.procs import pid_alive

from .fake_mps import install_fake_mps


@pytest.fixture
def fake_bin(tmp_path: Path) -> str:
    """A PATH whose only entry holds the fake control binary."""
    return install_fake_mps(tmp_path)


def _cfg(root: Path, path: str, **kw) -> MpsConfig:
    return MpsConfig(root, search_path=path, command_timeout_s=10, start_timeout_s=10,
                     stop_timeout_s=kw.pop("stop_timeout_s", 5), **kw)


async def test_start_health_stop(tmp_path, fake_bin):
    d = MpsDaemon(_cfg(tmp_path / "gpu0", fake_bin, device="MIG-abc"))
    await d.start()
    pid = d.pid
    try:
        assert pid is not None and pid_alive(pid)
        assert (d.pipe_dir / PID_FILE).read_text() == str(pid)
        assert await d.healthy()
        assert "devices=MIG-abc" in (d.log_dir / "control.log").read_text()
        # a second daemon on the same pipe directory is refused; one of its own is fine
        with pytest.raises(MpsUnavailable) as e:
            await MpsDaemon(_cfg(tmp_path / "gpu0", fake_bin)).start()
        assert e.value.details["reason"] == "already_running"
        async with MpsDaemon(_cfg(tmp_path / "gpu1", fake_bin)) as other:
            assert other.pid != pid and await other.healthy()
            other_pid = other.pid
        assert not pid_alive(other_pid)
    finally:
        await d.stop()
    assert not pid_alive(pid)
    assert not await d.healthy()
    assert "quit" in (d.log_dir / "control.log").read_text()  # stopped by quit, not a kill
    await d.stop()  # idempotent


async def test_daemon_ignoring_quit_is_killed_by_pid(tmp_path, fake_bin, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_IGNORE_QUIT", "1")
    d = MpsDaemon(_cfg(tmp_path / "g", fake_bin, stop_timeout_s=0.3))
    await d.start()
    pid = d.pid
    await d.stop()
    assert not pid_alive(pid)


async def test_absent_binary_is_typed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_control_binary(path=str(empty)) is None
    d = MpsDaemon(_cfg(tmp_path / "g", str(empty)))
    with pytest.raises(MpsUnavailable) as e:
        await d.start()
    assert e.value.details["reason"] == "binary_missing"
    assert "not installed" in e.value.message
    assert not (tmp_path / "g").exists()  # nothing made, nothing to clean
    await d.stop()


async def test_failing_start_is_typed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text("#!/bin/sh\necho 'cannot start: no GPU' >&2\nexit 3\n")
    exe.chmod(0o755)
    with pytest.raises(MpsUnavailable) as e:
        await MpsDaemon(_cfg(tmp_path / "g", str(bin_dir))).start()
    assert e.value.details["reason"] == "start_failed" and "no GPU" in e.value.message


def test_client_env(tmp_path):
    d = MpsDaemon(MpsConfig(tmp_path, device="0"))
    env = d.client_env(active_thread_percentage=30, pinned_mem_limit_bytes=3 * 2**30)
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
                   "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
                   "CUDA_VISIBLE_DEVICES": "0",
                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M"}
    for bad in (0, 101):
        with pytest.raises(BadRequest):
            d.client_env(active_thread_percentage=bad)
    with pytest.raises(BadRequest):
        d.client_env(pinned_mem_limit_bytes=10)


async def test_pipe_dir_too_long(tmp_path, fake_bin):
    deep = tmp_path / ("x" * 100)
    with pytest.raises(MpsUnavailable) as e:
        await MpsDaemon(_cfg(deep, fake_bin)).start()
    assert e.value.details["reason"] == "pipe_dir_too_long"
    assert os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is None  # nothing leaked into our env


async def test_one_daemon_per_mig_instance(tmp_path, fake_bin):
    cfgs = per_device_configs(tmp_path, ["MIG-aaa", "MIG-bbb", "0"], search_path=fake_bin)
    assert len({c.pipe_dir for c in cfgs}) == 3
    daemons = [MpsDaemon(c) for c in cfgs]
    try:
        for d in daemons:
            await d.start()
        assert len({d.pid for d in daemons}) == 3
        assert daemons[1].client_env()["CUDA_VISIBLE_DEVICES"] == "MIG-bbb"
        assert all([await d.healthy() for d in daemons])
        pids = [d.pid for d in daemons]
    finally:
        for d in daemons:
            await d.stop()
    assert not any(pid_alive(p) for p in pids)
    assert not pid_alive(0) and not pid_alive(-1)  # process groups are never "a daemon"
