"""Text progress bars for model transfers, drawn from ``/v1/status`` (``flashpoint deploy --wait``).

Hosts report fills in progress with every heartbeat (``transfers``: model -> verified and
total bytes); the controller passes them through in its status. Rendering is a pure function
so it is tested without a terminal.
"""

from __future__ import annotations

from typing import Any

BAR_WIDTH = 30


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    frac = 0.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
    filled = int(frac * width)
    return "[" + "#" * filled + "." * (width - filled) + f"] {frac * 100:5.1f}%"


def render(status: dict[str, Any], function: str) -> list[str]:
    """One line per host transfer in progress, then one per replica of ``function``."""
    lines: list[str] = []
    for host in status.get("hosts", []):
        for model, (done, total) in sorted((host.get("transfers") or {}).items()):
            lines.append(f"{host['host_id']:>12} {model:<24} {bar(int(done), int(total))} "
                         f"{int(done) / 1e6:8.1f}/{int(total) / 1e6:.1f} MB")
    for rep in status.get("replicas", []):
        if rep.get("function") == function:
            src = f" from {rep['source']}" if rep.get("source") else ""
            lines.append(f"{rep['host_id']:>12} {rep['replica_id']:<24} {rep['phase']}{src}")
    return lines


def ready(status: dict[str, Any], function: str, want: int) -> bool:
    warm = [r for r in status.get("replicas", [])
            if r.get("function") == function and r.get("phase") == "warm"]
    return len(warm) >= want
