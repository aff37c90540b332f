"""Text progress for ``flashpoint deploy --wait``: transfer bars drawn from ``/v1/status``,
and a roll-out's line (old and new versions' warm replicas) from ``GET /v1/functions/NAME``.

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


def rolling(view: dict[str, Any]) -> bool:
    """Whether a function's roll-out view (``GET /v1/functions/NAME``'s ``rollout``) is a
    version change under way: another version is named and the split is not yet settled."""
    return bool(view) and view.get("previous_version") is not None \
        and view.get("phase") in ("rolling", "canary")


def _warm_of(view: dict[str, Any]) -> tuple[dict[str, int], dict[str, int], int]:
    """Warm replicas of the target version, warm of the others (by model key), and how
    many of any version are starting or stopping."""
    target_suffix = f"@{view.get('version')}"
    new: dict[str, int] = {}
    old: dict[str, int] = {}
    moving = 0
    for key, counts in sorted((view.get("replicas") or {}).items()):
        side = new if key.endswith(target_suffix) else old
        if counts.get("warm", 0):
            side[key] = int(counts["warm"])
        moving += int(counts.get("starting", 0)) + int(counts.get("stopping", 0))
    return new, old, moving


def rollout_line(function: str, view: dict[str, Any], previous: str | None = None) -> str:
    """One line saying where a roll-out stands: old and new versions' warm replicas.
    ``previous`` names the old version once a settled view no longer does."""
    new, old, moving = _warm_of(view)
    new_n, old_n = sum(new.values()), sum(old.values())
    canary = f", canary {view['canary_pct']:g}%" if view.get("canary_pct") is not None else ""
    reason = f": {view['reason']}" if view.get("reason") else ""
    old_version = view.get("previous_version") or previous
    return (f"{function}: roll-out {old_version} -> {view.get('version')} "
            f"({view.get('phase')}{canary}) old {old_n} warm, new {new_n} warm, "
            f"{moving} starting/stopping{reason}")


def rollout_done(view: dict[str, Any]) -> bool:
    """Whether a roll-out has settled: nothing starting or stopping, and either every
    replica on the target version (stable; none at all for a function scaled to zero) or a
    canary's split in place (a warm replica of each side)."""
    new, old, moving = _warm_of(view)
    if moving:
        return False
    if view.get("phase") == "stable":
        return not old
    if view.get("phase") == "canary":
        return bool(new) and bool(old)
    return False


def rollout_failed(view: dict[str, Any]) -> bool:
    """Whether the target version's replicas kept failing to start (the old one serves)."""
    return view.get("phase") == "failed"
