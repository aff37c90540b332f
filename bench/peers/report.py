"""Ratios, targets, the printed table and the JSON line of the peer benchmark (pure: no I/O
but returning strings, so it is tested without servers)."""

from __future__ import annotations

import json
import statistics
from typing import Any

CONCURRENCIES = (1, 8, 64)
RPS_TARGET_X = 10.0  # Flashpoint >= 10x Ray Serve's default req/s at c=1 and c=64 (issue 24)
COLD_TARGET_X = 0.2  # Flashpoint's scale-from-zero from host RAM <= 0.2x Ray Serve's


def with_floor(row: dict[str, Any], floor: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``row`` plus its req/s, p50 and p99 divided by the floor's at the same concurrency."""
    f = floor.get(row["concurrency"])
    out = dict(row)
    for key in ("rps", "p50_ms", "p99_ms"):
        ok = f is not None and row.get(key) is not None and f.get(key)
        out[f"{key}_x_floor"] = row[key] / f[key] if ok else None
    return out


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and r.get("status", "ok") == "ok":
            return r
    return None


def targets(warm: list[dict[str, Any]], cold: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets as ratios in this run; ``met`` is None where a side is missing."""
    out: dict[str, Any] = {}
    for conc in (1, 64):
        fp = _find(warm, platform="flashpoint", workload="noop", concurrency=conc)
        ray = _find(warm, platform="ray", setting="default", workload="noop", concurrency=conc)
        ratio = fp["rps"] / ray["rps"] if fp and ray and ray["rps"] else None
        out[f"noop_c{conc}_rps_vs_ray_default"] = {
            "ratio": ratio, "target": f">= {RPS_TARGET_X:g}",
            "met": None if ratio is None else ratio >= RPS_TARGET_X}
    fp = _find(cold, platform="flashpoint", model="big")
    ray = _find(cold, platform="ray", model="big")
    ratio = fp["wall_s"] / ray["wall_s"] if fp and ray and ray["wall_s"] else None
    out["cold_big_vs_ray"] = {"ratio": ratio, "target": f"<= {COLD_TARGET_X:g}",
                              "met": None if ratio is None else ratio <= COLD_TARGET_X}
    return out


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict[str, Any]) -> str:
    """The human-readable table of one run's ``result`` (the JSON line's object)."""
    lines = ["== warm invoke (closed loop; x floor = divided by the bare aiohttp floor, same run)",
             f"{'platform':10s} {'setting':8s} {'workload':8s} {'c':>3s} {'req/s':>9s} "
             f"{'p50 ms':>8s} {'p99 ms':>8s} {'rps/fl':>7s} {'p50/fl':>7s} {'p99/fl':>7s} "
             f"{'err':>4s}"]
    for r in result.get("warm", []):
        if r.get("status", "ok") != "ok":
            lines.append(f"{r['platform']:10s} {r.get('setting', ''):8s} "
                         f"{r.get('workload', ''):8s}  not run: {r.get('reason', '')}")
            continue
        lines.append(
            f"{r['platform']:10s} {r['setting']:8s} {r['workload']:8s} {r['concurrency']:>3d} "
            f"{_f(r['rps'], '9.1f')} {_f(r['p50_ms'], '8.2f')} {_f(r['p99_ms'], '8.2f')} "
            f"{_f(r.get('rps_x_floor'), '7.3f')} {_f(r.get('p50_ms_x_floor'), '7.2f')} "
            f"{_f(r.get('p99_ms_x_floor'), '7.2f')} {r['errors']:>4d}")
    lines += ["", "== scale from zero to first response",
              f"{'platform':10s} {'model':5s} {'median s':>9s} {'runs':>5s}  from / path"]
    for r in result.get("cold", []):
        if r.get("status", "ok") != "ok":
            lines.append(f"{r['platform']:10s} {r['model']:5s}  not run: {r.get('reason', '')}")
            continue
        lines.append(f"{r['platform']:10s} {r['model']:5s} {_f(r['wall_s'], '9.3f')} "
                     f"{len(r['walls_s']):>5d}  {r['source']}")
    plan = result.get("plan", {})
    lines += ["", "== burst from zero to 4 replicas (open loop"
              + (f"; {plan['burst_offered_replicas']:g} replicas' worth of a "
                 f"{plan['burst_service_s'] * 1e3:.1f} ms single-request service time"
                 if plan.get("burst_service_s") else "") + ")",
              f"{'platform':10s} {'rate/s':>7s} {'sent':>5s} {'failed':>6s} {'replicas':>8s} "
              f"{'4th serves at s':>15s} {'p50 ms':>8s} {'p99 ms':>8s}"]
    for r in result.get("burst", []):
        if r.get("status", "ok") != "ok":
            lines.append(f"{r['platform']:10s}  not run: {r.get('reason', '')}")
            continue
        lines.append(f"{r['platform']:10s} {r['rate_hz']:>7.1f} {r['sent']:>5d} "
                     f"{r['failed']:>6d} {r['replicas_seen']:>8d} "
                     f"{_f(r['time_to_nth_replica_s'], '15.2f')} "
                     f"{_f(r.get('p50_ms'), '8.1f')} {_f(r.get('p99_ms'), '8.1f')}")
    lines += ["", "== targets (ratios in this run)"]
    for name, t in result.get("targets", {}).items():
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"{name:34s} {_f(t['ratio'], '9.3f')}  target {t['target']:6s} {verdict}")
    return "\n".join(lines)


def json_line(result: dict[str, Any]) -> str:
    """The run's result as one JSON line (what scripts read)."""
    return json.dumps(result, sort_keys=True, default=str)
