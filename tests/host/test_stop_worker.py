"""Stopping a worker process: one still starting up (no connection yet, as a warm-pool
refill is for its first second or two) is sent SIGTERM at once instead of being waited for
until the kill; a worker that ignores it is still killed at the timeout. Real processes,
stopped by PID through their handles."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from flashpoint.config import HostConfig
from flashpoint.host import state as hs
from flashpoint.host.stage_hold import StageHolds
from flashpoint.host.workers import WorkerPool, WorkerProcess
from flashpoint.rpc.roles import Credential

pytestmark = pytest.mark.timeout(60)


def _pool() -> WorkerPool:
    async def on_exit(w: WorkerProcess, rc: int) -> None:
        raise AssertionError("a stopped worker is not an unasked exit")

    return WorkerPool(HostConfig(), "h0", hs.HostState("h0"),
                      credential=Credential("host:h0", b"k" * 32), secret=b"s" * 32,
                      holds=StageHolds(1.0), spawn=lambda coro, name: asyncio.ensure_future(coro),
                      spawn_env=dict, on_exit=on_exit)


async def _process(code: str) -> WorkerProcess:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                stdout=asyncio.subprocess.PIPE)
    return WorkerProcess("w-test", proc, asyncio.get_running_loop().create_future())


async def test_a_worker_not_yet_connected_is_terminated_not_waited_for() -> None:
    w = await _process("import time; time.sleep(60)")  # a worker still importing, say
    try:
        # a timeout far longer than the test's own bound: only a signal ends it in time
        async with asyncio.timeout(20):
            await _pool().stop_worker(w, timeout_s=45.0)
        assert w.proc.returncode == -signal.SIGTERM
        assert w.stopping
    finally:
        if w.proc.returncode is None:
            w.proc.kill()
            await w.proc.wait()


async def test_one_that_ignores_sigterm_is_killed_at_the_timeout() -> None:
    w = await _process("import signal, time\n"
                       "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                       "print('ready', flush=True)\n"
                       "time.sleep(60)")
    try:
        async with asyncio.timeout(20):
            assert w.proc.stdout is not None
            assert await w.proc.stdout.readline() == b"ready\n"  # its handler is set
            await _pool().stop_worker(w, timeout_s=1.0)
        assert w.proc.returncode == -signal.SIGKILL
    finally:
        if w.proc.returncode is None:
            w.proc.kill()
            await w.proc.wait()
