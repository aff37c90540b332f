"""The hook preloaded into real processes against a fake libcuda.so.1 and a live manager.

Shares are measured from what the fake driver recorded (busy-wait time per process) and
cross-checked with the manager's accounting and the programs' own wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flashpoint.gpu.tokens import TokenManager
from flashpoint.policy.tokens import TenantQuota

from .conftest import HookKit

pytestmark = pytest.mark.timeout(60)


class Launched:
    """One launcher process; stopped by PID in ``stop`` whatever happened."""

    def __init__(self, proc: asyncio.subprocess.Process, stats: Path) -> None:
        self.proc, self.stats = proc, stats
        self.out: dict = {}
        self.stderr = ""

    async def wait(self, timeout_s: float) -> dict:
        out, err = await asyncio.wait_for(self.proc.communicate(), timeout_s)
        self.stderr = err.decode()
        assert self.proc.returncode == 0, self.stderr
        self.out = json.loads(out.decode())
        self.out.update(json.loads(self.stats.read_text()))
        return self.out

    def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)


async def launch(kit: HookKit, tmp: Path, tenant: int, sock: Path | str | None, seconds: float,
                 how: str = "proc", idle_us: int = 0, sync_every: int = 4, **env: str) -> Launched:
    stats = tmp / f"stats-{tenant}-{time.monotonic_ns()}.json"
    e = kit.env(FP_HOOK_TENANT=str(tenant), FAKE_CUDA_STATS=str(stats), **env)
    if sock is not None:
        e["FP_HOOK_SOCKET"] = str(sock)
    proc = await asyncio.create_subprocess_exec(str(kit.launcher), "run", str(seconds), "1000",
                                                str(sync_every), how, str(idle_us), env=e,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return Launched(proc, stats)


@contextlib.asynccontextmanager
async def manager(sock: Path, quotas: dict[int, TenantQuota]):
    """A running token manager with ``quotas``; stopped however the body ends."""
    mgr = TokenManager(sock)
    for tenant, quota in quotas.items():
        mgr.set_quota(tenant, quota)
    await mgr.start()
    try:
        yield mgr
    finally:
        await mgr.stop()


async def run_all(launches: list, timeout_s: float) -> list[dict]:
    """Start each launch (awaitables of :class:`Launched`), wait for every one; each is
    stopped by PID whatever happened."""
    procs: list[Launched] = []
    try:
        for start in launches:
            procs.append(await start)
        return [await p.wait(timeout_s) for p in procs]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def sock(tmp_path) -> Path:
    # Unix socket paths are limited to 108 bytes; pytest's tmp paths can be long.
    path = Path(f"/tmp/fp-test-{os.getpid()}-{time.monotonic_ns()}.sock")
    yield path
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def within_runs(measure, check, runs: int = 3) -> Any:
    """Measure up to ``runs`` times until ``check(result)`` holds; fail naming every run.

    The shares are wall time on a shared 2-vCPU VM: a slow spell of the VM can keep a
    tenant's process off the CPU for part of its token, so one run can fall outside a
    +-3% band for reasons that are not the scheduler's. A scheduler that gets the shares
    wrong fails every run."""
    seen = []
    for i in range(runs):
        result = await measure(i)
        if check(result):
            return result
        seen.append(result)
    pytest.fail(f"no run of {runs} within the band: {seen}")


async def test_two_tenants_reach_30_70_shares(kit, tmp_path, sock):
    async def measure(i: int) -> dict:
        path = Path(f"{sock}.{i}")
        try:
            async with manager(path, {1: TenantQuota(0.3, 0.3),
                                      2: TenantQuota(0.7, 0.7)}) as mgr:
                # one resolves the driver through cuGetProcAddress, the other through dlsym
                a, b = await run_all([launch(kit, tmp_path, 1, path, 5.0, "proc"),
                                      launch(kit, tmp_path, 2, path, 5.0, "dlsym")], 15.0)
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        usage = mgr.usage_by_tenant()
        return {"share": a["busy_ns"] / (a["busy_ns"] + b["busy_ns"]),
                "mgr_share": usage[1] / (usage[1] + usage[2]),
                "a_of_wall": a["busy_ns"] / a["wall_ns"], "b_of_wall": b["busy_ns"] / b["wall_ns"],
                "cublas": a["cublas"]}

    got = await within_runs(measure, lambda r: (
        abs(r["share"] - 0.30) <= 0.03 and abs(r["mgr_share"] - 0.30) <= 0.03
        # against each program's own wall time: nobody runs past its cap
        and r["a_of_wall"] <= 0.33 and r["b_of_wall"] <= 0.73))
    assert got["cublas"] == 42  # cu+lowercase names pass through dlsym untouched


async def test_idle_neighbour_lets_a_tenant_rise_to_its_limit(kit, tmp_path, sock):
    # request 30%, limit 60%; tenant 2 idles
    async def measure(i: int) -> float:
        path = Path(f"{sock}.{i}")
        try:
            async with manager(path, {1: TenantQuota(0.3, 0.6), 2: TenantQuota(0.7, 1.0)}):
                (a,) = await run_all([launch(kit, tmp_path, 1, path, 2.0)], 10.0)
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return a["busy_ns"] / a["wall_ns"]

    await within_runs(measure, lambda of_wall: 0.55 <= of_wall <= 0.63)


async def test_token_returned_early_when_tenant_syncs_and_idles(kit, tmp_path, sock):
    # A is bursty: 1 ms of work, sync, 20 ms idle.  B is saturated.  Were A to keep each
    # 10 ms token until expiry (+ 2 ms grace), B would get ~61% (measured with the early
    # return disabled); returning it 2 ms after the sync leaves B ~83%.
    async with manager(sock, {1: TenantQuota(0.5, 1.0), 2: TenantQuota(0.5, 1.0)}):
        a, b = await run_all([launch(kit, tmp_path, 1, sock, 2.0, idle_us=20000, sync_every=1),
                              launch(kit, tmp_path, 2, sock, 2.0)], 10.0)
    assert a["launches"] > 40  # A was not starved either
    assert b["busy_ns"] / b["wall_ns"] >= 0.75, (a, b)


async def test_best_effort_held_to_its_request_while_slo_tenant_is_active(kit, tmp_path, sock):
    # Dilu: an active SLO-sensitive tenant (bursty) keeps the best-effort tenant at
    # factor x request (factor 1 without KLC stretch) instead of its 100% limit.
    async with manager(sock, {1: TenantQuota(0.5, 1.0, slo_sensitive=True),
                              2: TenantQuota(0.3, 1.0)}):
        a, b = await run_all([launch(kit, tmp_path, 1, sock, 2.0, idle_us=20000, sync_every=1),
                              launch(kit, tmp_path, 2, sock, 2.0)], 10.0)
    assert a["launches"] > 40
    # without the SLO tenant's priority the best-effort one would get ~85% (test above)
    assert 0.2 <= b["busy_ns"] / b["wall_ns"] <= 0.4, (a, b)


async def test_live_quota_change_takes_effect(kit, tmp_path, sock):
    async with manager(sock, {1: TenantQuota(0.2, 0.2)}) as mgr:
        raise_quota = asyncio.get_running_loop().call_later(
            1.0, mgr.set_quota, 1, TenantQuota(0.8, 0.8))  # half-way through the 2 s run
        try:
            (a,) = await run_all([launch(kit, tmp_path, 1, sock, 2.0)], 10.0)
        finally:
            raise_quota.cancel()
    # ~1 s at 20% then ~1 s at 80%: about 50% overall, far from either alone
    assert 0.40 <= a["busy_ns"] / a["wall_ns"] <= 0.58, a


async def test_directly_linked_app_and_its_forked_child_are_gated(kit, tmp_path, sock):
    mgr = TokenManager(sock)
    mgr.set_quota(1, TenantQuota(0.4, 0.4))
    await mgr.start()
    stats = tmp_path / "linked.json"
    proc = await asyncio.create_subprocess_exec(
        str(kit.linked), "2.0", env=kit.env(FP_HOOK_SOCKET=str(sock), FP_HOOK_TENANT="1",
                                            FAKE_CUDA_STATS=str(stats)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 15.0)
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)
        await mgr.stop()
    assert proc.returncode == 0, err.decode()
    runs = {r["who"]: r for r in map(json.loads, out.decode().splitlines())}
    parent = json.loads(stats.read_text())
    child = json.loads(Path(str(stats) + ".child").read_text())
    # each process is its own client at the tenant's 40%; one connection each, no confusion
    assert 0.32 <= parent["busy_ns"] / runs["parent"]["wall_ns"] <= 0.47, (parent, runs)
    assert 0.32 <= child["busy_ns"] / runs["child"]["wall_ns"] <= 0.47, (child, runs)
    assert "ungated" not in err.decode()
    assert mgr.state.tenant_grants[1] > 100


async def test_per_thread_stream_variant_is_hooked(kit, tmp_path, sock):
    async with manager(sock, {1: TenantQuota(0.5, 0.5)}):
        (a,) = await run_all([launch(kit, tmp_path, 1, sock, 1.0, "ptds")], 10.0)
    assert a["launches_ptsz"] == a["launches"] > 0  # the driver's _ptsz entry was called...
    # ...through the gate (ungated: ~1.0); wide bounds: a 1 s run on shared vCPUs is noisy
    assert 0.35 <= a["busy_ns"] / a["wall_ns"] <= 0.65


async def test_manager_killed_program_continues(kit, tmp_path, sock):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    mgr = subprocess.Popen([sys.executable, "-m", "flashpoint.gpu.tokens", "--socket", str(sock),
                            "--quota", "1=0.2:0.2"], env=env, stdout=subprocess.PIPE, text=True)
    p = None
    try:
        assert json.loads(mgr.stdout.readline())["listening"] == str(sock)
        p = await launch(kit, tmp_path, 1, sock, 3.0, FP_HOOK_RETRY_MS="300")
        await asyncio.sleep(1.0)
        os.kill(mgr.pid, signal.SIGKILL)
        t0 = time.monotonic()
        a = await p.wait(10.0)
        assert time.monotonic() - t0 < 2.6  # the 2 s left, plus far less than a timeout of slack
    finally:
        if p:
            p.stop()
        if mgr.poll() is None:
            mgr.kill()
        mgr.wait(5)
    # ~1 s gated at 20% then ~2 s ungated: well above 20%
    assert a["busy_ns"] / a["wall_ns"] >= 0.55, a
    assert "running ungated" in p.stderr


async def test_no_manager_fails_open_quickly(kit, tmp_path):
    p = await launch(kit, tmp_path, 1, "/tmp/fp-test-no-such.sock", 0.5)
    try:
        a = await p.wait(5.0)
    finally:
        p.stop()
    assert a["busy_ns"] / a["wall_ns"] >= 0.9
    assert "running ungated" in p.stderr


async def test_silent_manager_grant_times_out(kit, tmp_path, sock):
    # Listens (so connect succeeds) but never accepts or answers: the grant wait must end.
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(8)
    p = None
    try:
        t0 = time.monotonic()
        p = await launch(kit, tmp_path, 1, sock, 0.5, FP_HOOK_GRANT_TIMEOUT_MS="200",
                         FP_HOOK_RETRY_MS="10000")
        a = await p.wait(5.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        if p:
            p.stop()
        srv.close()
    assert a["launches"] > 0 and "no grant" in p.stderr


def test_memory_limit_oom_at_the_right_byte(kit):
    mib = 1 << 20
    env = kit.env(FP_HOOK_MEM_LIMIT_BYTES=str(10 * mib + 100), FAKE_DEVICE_BYTES=str(1 << 30))
    out = subprocess.run([str(kit.launcher), "mem", str(mib), "100"], env=env, capture_output=True,
                         text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["ok_chunks"] == 10 and r["error"] == 2  # CUDA_ERROR_OUT_OF_MEMORY on the 11th MiB
    # cuMemGetInfo, cuDeviceTotalMem and NVML (v1 and v2, resolved through dlsym) agree
    assert r["total"] == r["total_mem"] == r["nvml_total"] == r["nvml_v2_total"] == 10 * mib + 100
    assert r["free"] == r["nvml_free"] == 100
    assert r["free_after_release"] == mib + 100  # the free was accounted


def test_without_limit_the_device_is_reported_unchanged(kit):
    env = kit.env(FAKE_DEVICE_BYTES=str(8 << 20))
    out = subprocess.run([str(kit.launcher), "mem", str(1 << 20), "100"], env=env, capture_output=True,
                         text=True, timeout=20)
    r = json.loads(out.stdout)
    assert r["ok_chunks"] == 8 and r["error"] == 2 and r["total"] == r["nvml_total"] == 8 << 20
