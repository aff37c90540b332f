"""A network namespace with nothing but loopback, for the whole measured run.

Ray resolves its node address to the machine's interface even when told 127.0.0.1; inside
a namespace whose only interface is ``lo`` there is nothing else to resolve to, and no
server of the run can be reached from (or reach) anything but this machine's loopback.
Needs root (``ip netns add``). :class:`LoopbackNamespace` deletes the namespace on exit even
when the body raised, after stopping by PID every process still inside it (all of them
were started by this run: the namespace is new and named for it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import TracebackType

STOP_GRACE_S = 10.0


def _ip(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)


def namespace_name(pid: int | None = None) -> str:
    """A name unique to this run (``fppeers<pid>``), short enough for ``ip``."""
    return f"fppeers{pid if pid is not None else os.getpid()}"


def exec_prefix(name: str) -> list[str]:
    """The argv prefix that runs a command inside namespace ``name``."""
    return ["ip", "netns", "exec", name]


def pids_in(name: str) -> list[int]:
    """PIDs of the processes inside namespace ``name`` (empty when it does not exist)."""
    out = _ip("netns", "pids", name)
    if out.returncode != 0:
        return []
    return [int(p) for p in out.stdout.split() if p.strip().isdigit()]


def interfaces_in(name: str) -> list[str]:
    """Names of the links inside namespace ``name``."""
    out = _ip("netns", "exec", name, "ip", "-o", "link", "show")
    if out.returncode != 0:
        raise RuntimeError(f"listing links in {name}: {out.stderr.strip()}")
    return [line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines()
            if line.count(":") >= 2]


def stop_pids(pids: list[int], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM each PID, wait up to ``grace_s`` for all, SIGKILL what is left; returns the
    PIDs that needed SIGKILL."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.1)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (another process's child not yet reaped) is gone for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return ""


class LoopbackNamespace:
    """``with LoopbackNamespace() as ns:`` creates namespace ``ns.name`` with ``lo`` up and
    nothing else; on exit stops by PID what is still inside and deletes it."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or namespace_name()
        self.leftover_pids: list[int] = []
        self.leftover_cmdlines: list[str] = []

    def __enter__(self) -> LoopbackNamespace:
        out = _ip("netns", "add", self.name)
        if out.returncode != 0:
            raise RuntimeError(f"ip netns add {self.name}: {out.stderr.strip()} "
                               "(creating a network namespace needs root)")
        try:
            up = _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            if up.returncode != 0:
                raise RuntimeError(f"bringing lo up in {self.name}: {up.stderr.strip()}")
            links = interfaces_in(self.name)
            if links != ["lo"]:
                raise RuntimeError(f"namespace {self.name} has links {links}, expected only lo")
        except BaseException:
            self.delete()
            raise
        return self

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this namespace."""
        return exec_prefix(self.name)

    def delete(self) -> None:
        """Stop what is left inside (by PID), then delete the namespace."""
        self.leftover_pids = pids_in(self.name)
        self.leftover_cmdlines = [_cmdline(p) for p in self.leftover_pids]
        if self.leftover_pids:
            stop_pids(self.leftover_pids)
        out = _ip("netns", "delete", self.name)
        if out.returncode != 0 and self.name in _ip("netns", "list").stdout.split():
            raise RuntimeError(f"ip netns delete {self.name}: {out.stderr.strip()}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.delete()
