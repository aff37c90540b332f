"""CUDA MPS control daemons: one per GPU or per MIG instance, each with its own directories.

A daemon started with ``CUDA_MPS_PIPE_DIRECTORY=D`` serves exactly the clients whose
environment names the same ``D``; giving every GPU (or MIG instance: the MIG user guide's
"MIG with CUDA MPS") its own pipe and log directory keeps daemons apart, and lets a host run
several. The daemon serves the devices in its ``CUDA_VISIBLE_DEVICES`` at start.

Commands (CUDA MPS guide): ``nvidia-cuda-mps-control -d`` starts the daemon and returns;
the daemon writes ``nvidia-cuda-mps-control.pid`` into the pipe directory; commands such as
``quit`` or ``get_default_active_thread_percentage`` are written to the same binary's stdin.

Every wait has a deadline. Processes are stopped by PID: the daemon's PID from its own pid
file, MPS servers' PIDs from ``get_server_list``; never by name. Where the binary is absent
the caller gets :class:`~flashpoint.errors.MpsUnavailable` and runs without MPS.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from flashpoint.errors import BadRequest, MpsUnavailable
from flashpoint.procs import pid_alive

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
# Unix socket paths are limited to 108 bytes; the daemon creates "control_privileged" in the
# pipe directory, so a longer directory makes it fail in a way that is hard to read.
_MAX_PIPE_DIR_LEN = 107 - len("/control_privileged")
_POLL_S = 0.05  # the daemon is not our child (it daemonises): no event to wait on


def find_control_binary(binary: str = CONTROL_BINARY, path: str | None = None) -> str | None:
    """Full path of the MPS control binary, or ``None`` where MPS is not installed."""
    return shutil.which(binary, path=path)


@dataclass(frozen=True)
class MpsConfig:
    """Where one daemon keeps its pipes and logs, which device it serves, and its deadlines."""

    root_dir: Path  # pipe/ and log/ are made under it
    device: str = ""  # CUDA_VISIBLE_DEVICES of the daemon: "0", "GPU-..." or "MIG-..."; "" inherits
    binary: str = CONTROL_BINARY
    search_path: str | None = None  # PATH to find the binary in; None = this process's PATH
    command_timeout_s: float = 10.0
    start_timeout_s: float = 10.0
    stop_timeout_s: float = 10.0

    @property
    def pipe_dir(self) -> Path:
        return self.root_dir / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.root_dir / "log"


def per_device_configs(root_dir: Path, devices: Sequence[str], **kw: Any) -> list[MpsConfig]:
    """One config per GPU (``"0"``, ``"GPU-..."``) or MIG instance (``"MIG-..."``), each with
    its own directory under ``root_dir``, so their daemons never share a pipe."""
    out = []
    for i, dev in enumerate(devices):
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in dev)[:40]
        out.append(MpsConfig(root_dir / f"{i}-{safe}", device=dev, **kw))
    return out


class MpsDaemon:
    """One MPS control daemon. ``start()``/``stop()`` are async and bounded; ``stop()`` is
    idempotent, and ``async with`` stops the daemon on the way out."""

    def __init__(self, config: MpsConfig) -> None:
        self.config = config
        self.pid: int | None = None
        self._binary: str | None = None

    @property
    def pipe_dir(self) -> Path:
        return self.config.pipe_dir

    @property
    def log_dir(self) -> Path:
        return self.config.log_dir

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.search_path is not None:
            env["PATH"] = self.config.search_path
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        if self.config.device:
            env["CUDA_VISIBLE_DEVICES"] = self.config.device
        return env

    def client_env(self, active_thread_percentage: int | None = None,
                   pinned_mem_limit_bytes: int | None = None) -> dict[str, str]:
        """Environment for a worker that uses this daemon.

        ``active_thread_percentage`` caps the worker's share of SMs (fixed for the process's
        lifetime); ``pinned_mem_limit_bytes`` caps its device memory. The worker sees only
        the daemon's device, so the memory limit names device ordinal 0.
        """
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
               "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        if self.config.device:
            env["CUDA_VISIBLE_DEVICES"] = self.config.device
        if active_thread_percentage is not None:
            if not 1 <= active_thread_percentage <= 100:
                raise BadRequest("active_thread_percentage must be within 1..100")
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(active_thread_percentage))
        if pinned_mem_limit_bytes is not None:
            if pinned_mem_limit_bytes < 2**20:
                raise BadRequest("pinned_mem_limit_bytes must be at least 1 MiB")
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={pinned_mem_limit_bytes // 2**20}M"
        return env

    async def _run(self, args: list[str], stdin: str = "") -> tuple[int, str, str]:
        """Run the control binary once, bounded by ``command_timeout_s``; kill it by PID if late."""
        assert self._binary is not None
        proc = await asyncio.create_subprocess_exec(
            self._binary, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self._env(), start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode()),
                                              self.config.command_timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5.0)
            raise MpsUnavailable(f"{self.config.binary} {' '.join(args)} did not answer in "
                                 f"{self.config.command_timeout_s} s", reason="timeout") from None
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    def _read_pid(self) -> int | None:
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid > 1 else None  # never let a bad file make us signal a group

    async def start(self) -> None:
        """Start the daemon and wait until its pid file exists and it answers a command."""
        self._binary = find_control_binary(self.config.binary, self.config.search_path)
        if self._binary is None:
            raise MpsUnavailable(f"{self.config.binary} not found on PATH: MPS is not installed "
                                 "here; running without MPS", reason="binary_missing")
        if len(str(self.pipe_dir)) > _MAX_PIPE_DIR_LEN:
            raise MpsUnavailable(f"MPS pipe directory {self.pipe_dir} is longer than "
                                 f"{_MAX_PIPE_DIR_LEN} bytes (Unix socket limit)",
                                 reason="pipe_dir_too_long")
        old = self._read_pid()
        if old is not None and pid_alive(old):
            raise MpsUnavailable(f"an MPS daemon (pid {old}) already owns {self.pipe_dir}",
                                 reason="already_running", pid=old)
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        rc, out, err = await self._run(["-d"])
        if rc != 0:
            raise MpsUnavailable(f"{self.config.binary} -d failed (rc {rc}): {(err or out).strip()}",
                                 reason="start_failed", rc=rc)
        deadline = time.monotonic() + self.config.start_timeout_s
        while (pid := self._read_pid()) is None or not pid_alive(pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(MpsUnavailable):  # no PID to kill: ask it to go
                    await self._run([], "quit\n")
                raise MpsUnavailable(f"MPS daemon wrote no live pid file in {self.pipe_dir} "
                                     f"within {self.config.start_timeout_s} s",
                                     reason="start_timeout")
            await asyncio.sleep(_POLL_S)
        self.pid = pid
        if not await self.healthy():
            await self.stop()
            raise MpsUnavailable("MPS daemon started but does not answer commands",
                                 reason="unhealthy")

    async def healthy(self) -> bool:
        """The daemon runs and answers ``get_default_active_thread_percentage``."""
        if self.pid is None or not pid_alive(self.pid) or self._binary is None:
            return False
        try:
            rc, out, _ = await self._run([], "get_default_active_thread_percentage\n")
        except MpsUnavailable:
            return False
        return rc == 0 and bool(out.strip())

    async def server_pids(self) -> list[int]:
        """PIDs of the MPS servers this daemon started (``get_server_list``)."""
        if self.pid is None or self._binary is None:
            return []
        try:
            rc, out, _ = await self._run([], "get_server_list\n")
        except MpsUnavailable:
            return []
        return [int(t) for t in out.split() if t.isdigit() and int(t) > 1] if rc == 0 else []

    async def stop(self) -> None:
        """Ask the daemon to quit; if it is still there after ``stop_timeout_s``, SIGTERM and
        then SIGKILL it and its servers by PID. Safe to call twice."""
        pid = self.pid
        if pid is None:
            return
        servers = await self.server_pids()
        if pid_alive(pid):
            with contextlib.suppress(MpsUnavailable):
                await self._run([], "quit\n")
        if not await self._wait_gone([pid, *servers], self.config.stop_timeout_s):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for p in (pid, *servers):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p, sig)
                if await self._wait_gone([pid, *servers], 2.0):
                    break
        self.pid = None

    @staticmethod
    async def _wait_gone(pids: list[int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while any(pid_alive(p) for p in pids):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    async def __aenter__(self) -> MpsDaemon:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()
