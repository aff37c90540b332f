"""A ``flashpoint up`` process started by a test, as an operator starts it: its stdout read
line by line on a thread (a readline blocks), its banner parsed, stopped by PID."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

BANNER_END = "Stop with Ctrl-C."


class UpProcess:
    """``flashpoint --config CONFIG --home HOME up --hosts N`` with ``env``; its stderr goes
    to ``stderr`` (a file, or a pipe)."""

    def __init__(self, config: Path, home: Path, *, env: dict[str, str],
                 stderr: IO[Any] | int = subprocess.PIPE, hosts: int = 1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashpoint.cli", "--config", str(config), "--home",
             str(home), "up", "--hosts", str(hosts)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, stdin=subprocess.DEVNULL, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:  # ends when stdout closes
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def banner(self, timeout_s: float) -> list[str]:
        """stdout lines up to the banner's last one, or AssertionError with what came instead."""
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(lines) < 50:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break  # stdout closed: it exited
            lines.append(line.rstrip("\n"))
            if line.strip() == BANNER_END:
                return lines
        raise AssertionError(f"no banner within {timeout_s}s; stdout so far: {lines}")

    @staticmethod
    def api_url(banner: list[str]) -> str:
        """The API URL of a banner's ``API`` line."""
        return next(x for x in banner if x.strip().startswith("API ")).split()[1]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within a minute."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
