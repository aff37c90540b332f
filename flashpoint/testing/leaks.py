"""What a test cluster may leave behind, found from /proc and the event loop (the harness's
leak checks, :mod:`flashpoint.testing.harness`).

A :class:`Baseline` is taken before a cluster starts; :func:`find_leaks` compares the process
with it after the cluster stopped and returns one line per leak (empty: nothing leaked).
Three kinds are looked for, each attributable to the cluster:

* processes: live descendants of this process that did not exist at the baseline, and any
  PID the cluster reported starting (workers, or NetCluster's processes, which are reparented
  when their host dies) that is still alive;
* asyncio tasks: tasks created since the baseline, still pending, whose coroutine is
  Flashpoint code (``flashpoint/``, not the test helpers in ``flashpoint/testing/``): a test's
  own tasks are the test's business;
* listening sockets: TCP and Unix sockets in LISTEN state held by this process that were
  not there at the baseline.

Linux only (it reads /proc); no psutil.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import flashpoint

_PACKAGE_DIR = str(Path(flashpoint.__file__).resolve().parent) + os.sep
_TESTING_DIR = _PACKAGE_DIR + "testing" + os.sep
_TCP_LISTEN = "0A"
_UNIX_ACCEPTCON = 0x10000  # __SO_ACCEPTCON in /proc/net/unix "Flags": a listening socket


# -- processes --------------------------------------------------------------------------


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: only its exit status is left)."""
    st = _ppid_and_state(pid)
    return st is not None and st[1] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _ppid_and_state(int(entry))) is not None and st[1] != "Z":
            children.setdefault(st[0], []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    """``pid``'s command line, space-joined ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# -- sockets ----------------------------------------------------------------------------


def _socket_inodes() -> set[str]:
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def _tcp_addr(hex_addr: str) -> str:
    host, port = hex_addr.rsplit(":", 1)
    if len(host) == 8:  # IPv4, little-endian
        host = ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))
    else:
        host = "[ipv6]"
    return f"{host}:{int(port, 16)}"


def listening_sockets() -> dict[str, str]:
    """inode -> description of every listening TCP or Unix socket this process holds."""
    mine = _socket_inodes()
    out: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[3] == _TCP_LISTEN and parts[9] in mine:
                    out[parts[9]] = f"tcp {_tcp_addr(parts[1])}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) > 6 and parts[6] in mine and int(parts[3], 16) & _UNIX_ACCEPTCON:
                out[parts[6]] = f"unix {parts[7] if len(parts) > 7 else '(unnamed)'}"
    return out


# -- tasks ------------------------------------------------------------------------------


def _task_file(task: asyncio.Task) -> str:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    return code.co_filename if code is not None else ""


def flashpoint_task(task: asyncio.Task) -> bool:
    """Whether ``task`` runs Flashpoint code (not a test helper's)."""
    path = _task_file(task)
    return path.startswith(_PACKAGE_DIR) and not path.startswith(_TESTING_DIR)


def describe_task(task: asyncio.Task) -> str:
    coro = task.get_coro()
    return f"task {task.get_name()!r} running {getattr(coro, '__qualname__', coro)!r}"


# -- baseline and check -----------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """What existed before a cluster started: none of it counts as the cluster's leak."""

    children: frozenset[int]
    tasks: frozenset[asyncio.Task]
    listeners: frozenset[str]

    @classmethod
    def take(cls) -> Baseline:
        try:
            tasks = frozenset(asyncio.all_tasks())
        except RuntimeError:  # no running loop: no tasks
            tasks = frozenset()
        return cls(frozenset(descendants(os.getpid())), tasks, frozenset(listening_sockets()))


async def find_leaks(baseline: Baseline, started_pids: Iterable[int] = (),
                     grace_s: float = 5.0) -> list[str]:
    """One line per leak since ``baseline``; waits up to ``grace_s`` for what is still
    finishing (a process being reaped, a task completing its cancellation) first. Leaked
    processes are SIGKILLed and leaked tasks cancelled afterwards, so one leak does not
    spill into the next test."""
    me = asyncio.current_task()
    started = set(started_pids)

    def procs() -> set[int]:
        return {p for p in (descendants(os.getpid()) - baseline.children) | started if alive(p)}

    def tasks() -> set[asyncio.Task]:
        return {t for t in asyncio.all_tasks() - baseline.tasks
                if t is not me and not t.done() and flashpoint_task(t)}

    def sockets() -> dict[str, str]:
        return {k: v for k, v in listening_sockets().items() if k not in baseline.listeners}

    deadline = time.monotonic() + grace_s
    for _ in range(int(grace_s / 0.05) + 1):  # bounded in count and in time
        left_procs, left_tasks, left_socks = procs(), tasks(), sockets()
        if not (left_procs or left_tasks or left_socks) or time.monotonic() >= deadline:
            break
        if left_tasks:  # wake when one finishes rather than on a timer
            await asyncio.wait(left_tasks, timeout=0.05)
        else:
            await asyncio.sleep(0.05)
    out = [f"process {p} still running: {cmdline(p)[:200]!r}" for p in sorted(left_procs)]
    out += [describe_task(t) + " still pending" for t in
            sorted(left_tasks, key=lambda t: t.get_name())]
    out += [f"listening socket left open: {d} (inode {i})" for i, d in sorted(left_socks.items())]
    for p in left_procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    for t in left_tasks:
        t.cancel()
    return out
