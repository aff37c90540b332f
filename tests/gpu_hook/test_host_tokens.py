"""A tokens host end to end on fake devices: HostSharing's token manager per GPU unit,
worker-like processes started with the hook preloaded (as the warm pool is) and configured
only afterwards from their deploy, shares measured from the fake driver's busy time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashpoint.errors import Conflict, NotFound
from flashpoint.gpu.fake_nvml import FakeNvml
from flashpoint.gpu.host_sharing import GpuShare, HostSharing, SharingMode
from flashpoint.gpu.inventory import discover

from .conftest import HookKit

pytestmark = pytest.mark.timeout(90)
WORKER = Path(__file__).with_name("hooked_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir():
    # Short: Unix socket paths are limited to 108 bytes.
    d = Path(f"/tmp/fpt-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


async def start_worker(kit: HookKit, sharing: HostSharing, tmp: Path, name: str
                       ) -> tuple[asyncio.subprocess.Process, Path]:
    """A warm-pool worker: the hook preloaded by the host's spawn env, nothing else yet."""
    stats = tmp / f"stats-{name}.json"
    env = kit.env(**sharing.spawn_env(), PYTHONPATH=str(ROOT), FAKE_CUDA_STATS=str(stats))
    assert env["LD_PRELOAD"] == str(kit.hook) and "FP_HOOK_SOCKET" not in env
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(WORKER), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    return proc, stats


def _held(unit: str, tenant: int) -> float:
    """The tokens manager's held-seconds counter of ``tenant`` on ``unit`` (0 before any)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("flashpoint_tokens_held_seconds_total",
                                     {"unit": unit, "tenant": str(tenant)}) or 0.0


async def test_tokens_host_shares_30_70_through_late_configured_hook(kit, tmp_path, run_dir):
    nvml = FakeNvml.with_gpus("A100-40GB", mig=False)
    devices = discover(0, 0, nvml)
    assert [d.kind for d in devices] == ["cuda"] and devices[0].uuid.startswith("GPU-")
    sharing = HostSharing(SharingMode.TOKENS, run_dir, hook_path=kit.hook)
    await sharing.start(devices)
    procs: list[asyncio.subprocess.Process] = []
    try:
        unit = sharing.units[devices[0].device_id]
        assert unit.manager is not None and Path(unit.socket_path).exists()
        a_env = sharing.attach("rep-a", devices[0], GpuShare(0.3, 0.3, 0.3, 64 << 20))
        b_env = sharing.attach("rep-b", devices[0], GpuShare(0.7, 0.7, 0.7))
        assert a_env["CUDA_VISIBLE_DEVICES"] == devices[0].uuid
        assert a_env["FP_HOOK_SOCKET"] == unit.socket_path
        assert a_env["FP_HOOK_MEM_LIMIT_BYTES"] == str(64 << 20)
        ta, tb = int(a_env["FP_HOOK_TENANT"]), int(b_env["FP_HOOK_TENANT"])
        assert ta != tb and 0 not in (ta, tb)
        # The counters are process-wide and another test's unit may have had the same name
        # and tenant ids: this run's held time is what it adds.
        held_before = [_held(devices[0].device_id, t) for t in (ta, tb)]
        (pa, sa), (pb, sb) = [await start_worker(kit, sharing, tmp_path, n) for n in "ab"]
        procs = [pa, pb]
        sharing.bind_worker("rep-a", pa.pid)  # as the host does before the deploy
        sharing.bind_worker("rep-b", pb.pid)
        await asyncio.sleep(0.3)  # they sit in the pool, hook loaded, unconfigured
        outs = await asyncio.wait_for(asyncio.gather(*(
            p.communicate(json.dumps({"env": e, "seconds": 4.0, "kernel_us": 1000}).encode()
                          + b"\n") for p, e in ((pa, a_env), (pb, b_env)))), 30)
        for p, (_out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err.decode()
        res = [json.loads(o.decode()) | json.loads(s.read_text()) for (o, _), s in
               zip(outs, (sa, sb), strict=True)]
        usage = unit.manager.usage_by_tenant()
    finally:
        await kill_procs(procs)
        await sharing.stop()
    a, b = res
    assert a["socket_seen"] == unit.socket_path  # the deploy's env reached the process
    share = a["busy_ns"] / (a["busy_ns"] + b["busy_ns"])
    print(f"tokens host: tenant shares {share:.3f}/{1 - share:.3f} "
          f"(busy {a['busy_ns'] / 1e9:.2f}s/{b['busy_ns'] / 1e9:.2f}s), manager {usage}")
    # The hook took its socket and tenant from the late env: the manager charged both.
    assert usage.get(ta, 0) > 0 and usage.get(tb, 0) > 0
    assert abs(share - 0.30) <= 0.04, (share, a, b)
    mgr_share = usage[ta] / (usage[ta] + usage[tb])
    assert abs(mgr_share - 0.30) <= 0.04, usage
    assert not Path(unit.socket_path).exists()  # stopped with the host
    # Prometheus: grants and their waits, each tenant's held time and share
    from prometheus_client import REGISTRY

    unit_label = {"unit": devices[0].device_id}
    assert REGISTRY.get_sample_value("flashpoint_tokens_grants_total", unit_label) > 100
    assert REGISTRY.get_sample_value("flashpoint_tokens_wait_seconds_count", unit_label) > 100
    held = [_held(devices[0].device_id, t) - h0
            for t, h0 in zip((ta, tb), held_before, strict=True)]
    assert abs(held[0] * 1e9 - usage[ta]) < 0.3e9 and abs(held[1] * 1e9 - usage[tb]) < 0.3e9
    share_a = REGISTRY.get_sample_value("flashpoint_tokens_share", {**unit_label, "tenant": str(ta)})
    assert 0.2 <= share_a <= 0.4, share_a  # the last ~1 s window


async def test_live_quota_change_and_refusals(kit, run_dir):
    nvml = FakeNvml.with_gpus("A100-40GB", mig=False)
    devices = discover(0, 0, nvml)
    sharing = HostSharing(SharingMode.TOKENS, run_dir, hook_path=kit.hook)
    await sharing.start(devices)
    try:
        env = sharing.attach("rep-a", devices[0], GpuShare(0.3, 0.3, 0.3))
        tenant = int(env["FP_HOOK_TENANT"])
        mgr = sharing.units[devices[0].device_id].manager
        assert mgr.state.quota(tenant).request == pytest.approx(0.3)
        reply = sharing.set_share("rep-a", GpuShare(0.6, 0.5, 0.8, slo_sensitive=False))
        assert reply["tenant"] == tenant
        q = mgr.state.quota(tenant)
        assert (q.request, q.limit, q.sm_share, q.slo_sensitive) == (0.5, 0.8, 0.6, False)
        with pytest.raises(NotFound):
            sharing.set_share("nobody", GpuShare(0.5, 0.5, 0.5))
        assert sharing.attach("rep-a", devices[0], None) == env  # idempotent by replica id
        sharing.detach("rep-a")
        with pytest.raises(NotFound):
            sharing.set_share("rep-a", GpuShare(0.5, 0.5, 0.5))
    finally:
        await sharing.stop()
    # MPS fixes a client's share at its start: a live change is a Conflict, not a no-op.
    mps = HostSharing(SharingMode.MPS, run_dir / "m", mps_search_path=str(run_dir / "none"))
    await mps.start(devices)
    try:
        mps.attach("rep-m", devices[0], GpuShare(0.5, 0.5, 0.5))
        with pytest.raises(Conflict):
            mps.set_share("rep-m", GpuShare(0.6, 0.6, 0.6))
    finally:
        await mps.stop()


class AllocWorker:
    """A hooked worker-like process in alloc mode, driven line by line (bounded waits)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def cmd(self, obj: dict, timeout_s: float = 10.0) -> dict:
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        assert line, (await self.proc.stderr.read()).decode()
        return json.loads(line)

    async def exit(self) -> None:
        self.proc.stdin.write(b'{"exit": true}\n')
        await self.proc.stdin.drain()
        await asyncio.wait_for(self.proc.wait(), 10)

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)


async def kill_procs(procs: list[asyncio.subprocess.Process]) -> None:
    """SIGKILL (by pid) each of ``procs`` still running, and reap it."""
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            await p.wait()


async def _wait(what: str, cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_memory_limit_is_per_replica_across_its_processes(kit, tmp_path, run_dir):
    mib = 1 << 20
    nvml = FakeNvml.with_gpus("A100-40GB", mig=False)
    devices = discover(0, 0, nvml)
    sharing = HostSharing(SharingMode.TOKENS, run_dir, hook_path=kit.hook)
    await sharing.start(devices)
    workers: list[AllocWorker] = []
    try:
        # One replica (tenant), limit 10 MiB; its env carries the same per-process limit.
        env = sharing.attach("rep", devices[0], GpuShare(0.5, 0.5, 1.0, 10 * mib))
        tenant = int(env["FP_HOOK_TENANT"])
        mgr = sharing.units[devices[0].device_id].manager
        for name in "ab":
            proc, _ = await start_worker(kit, sharing, tmp_path, name)
            sharing.bind_worker("rep", proc.pid)  # as the host does before the deploy
            w = AllocWorker(proc)
            workers.append(w)
            proc.stdin.write(json.dumps({"env": env, "mode": "alloc"}).encode() + b"\n")
        a, b = workers
        r = await a.cmd({"alloc": 6, "chunk": mib})
        assert r == {"ok": 6, "error": 0, "free": 4 * mib, "total": 10 * mib}
        await _wait("A's 6 MiB reported", lambda: mgr.memory_by_tenant().get(tenant) == 6 * mib)
        # B, the replica's second process, may hold only what A left: OOM at the 5th MiB,
        # and cuMemGetInfo agrees (its cap, not its own 10 MiB limit).
        r = await b.cmd({"alloc": 10, "chunk": mib})
        assert r == {"ok": 4, "error": 2, "free": 0, "total": 4 * mib}, r
        await _wait("B's 4 MiB reported", lambda: mgr.memory_by_tenant().get(tenant) == 10 * mib)
        # A frees by exiting: B's cap rises to the whole limit.
        await a.exit()
        await _wait("A gone", lambda: mgr.memory_by_tenant().get(tenant) == 4 * mib)
        from prometheus_client import REGISTRY

        await _wait("the memory gauge", lambda: REGISTRY.get_sample_value(
            "flashpoint_tokens_memory_bytes",
            {"unit": devices[0].device_id, "tenant": str(tenant)}) == 4 * mib)
        r = await b.cmd({"alloc": 10, "chunk": mib})
        assert r == {"ok": 6, "error": 2, "free": 0, "total": 10 * mib}, r
        await b.exit()
    finally:
        for w in workers:
            w.kill()
            await w.proc.wait()
        await sharing.stop()
