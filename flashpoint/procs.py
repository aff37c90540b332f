"""Whether a process we started is still running."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it has exited, nobody reaped it).

    PIDs below 2 are never "alive": 0 and -1 would address process groups in ``os.kill``.
    """
    if pid < 2:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
