"""Plain-text tables of ``/v1/status`` and ``/v1/functions`` for people (``--json`` for
programs). Pure functions of the API's JSON, so they are tested without a terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Left-aligned columns two spaces apart; ``-`` for an empty cell."""
    cells = [list(header)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in cells]


def size(size_bytes: int) -> str:
    """``1.5 GiB`` and the like."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def status_lines(status: dict[str, Any]) -> list[str]:
    """HOSTS, REPLICAS and FUNCTIONS of a cluster status, each a titled table."""
    hosts = status.get("hosts", [])
    host_rows = [(h["host_id"], _host_state(h), _devices(h.get("devices", [])),
                  len(h.get("cached_models", [])), f"{h.get('last_seen_s_ago', 0):.1f}s ago")
                 for h in hosts]
    replicas = status.get("replicas", [])
    replica_rows = [(r["replica_id"], r["function"], r["host_id"], r.get("device_id"),
                     r["phase"], r.get("inflight", 0), r.get("source"))
                    for r in replicas]
    functions = status.get("functions", [])
    out = [f"HOSTS ({len(hosts)})"]
    out += table(("HOST", "STATE", "DEVICES", "CACHED MODELS", "LAST SEEN"), host_rows)
    out += ["", f"REPLICAS ({len(replicas)})"]
    out += table(("REPLICA", "FUNCTION", "HOST", "DEVICE", "PHASE", "INFLIGHT", "SOURCE"),
                 replica_rows)
    out += ["", f"FUNCTIONS ({len(functions)})"] + function_lines(functions)
    return out


def function_lines(functions: list[dict[str, Any]]) -> list[str]:
    """One row per registered function (the ``/v1/functions`` list)."""
    rows = []
    for f in functions:
        spec = f["spec"]
        ready = "yes" if f.get("ready") else f"no: {(f.get('reason') or {}).get('code', '?')}"
        rows.append((spec["name"], f"{spec['model']}@{spec['model_version']}", ready,
                     f.get("replicas_warm", 0), f.get("replicas_starting", 0), f.get("queued", 0),
                     f"{spec['min_replicas']}..{spec['max_replicas']}", spec["max_batch_size"]))
    return table(("FUNCTION", "MODEL", "READY", "WARM", "STARTING", "QUEUED", "REPLICAS",
                  "BATCH"), rows)


def _host_state(host: dict[str, Any]) -> str:
    if not host.get("alive", True):
        return "lost"
    return "draining" if host.get("draining") else "alive"


def _devices(devices: list[dict[str, Any]]) -> str:
    """``2 cpu (4.0 GiB each)``, or one such part per kind of device."""
    by_kind: dict[str, list[int]] = {}
    for d in devices:
        by_kind.setdefault(str(d.get("kind", "?")), []).append(int(d.get("memory_bytes", 0)))
    return ", ".join(f"{len(m)} {kind} ({size(max(m))})" for kind, m in sorted(by_kind.items()))


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return str(value)


def profile_lines(answer: dict[str, Any]) -> list[str]:
    """A profiler run (``POST /v1/functions/{name}/profile``): its trials as a table, then
    the profiles stored and the share the function resolves to now."""
    rows = []
    for t in answer.get("trials", []):
        p = t["point"]
        rows.append((f"{p['sm_share']:g}", f"{p['time_quota']:g}", p["batch"], p["replicas"],
                     t["ok"], t["failed"], f"{t['throughput_rps']:.1f}",
                     f"{t['p99_latency_s'] * 1000:.1f}", t.get("device")))
    out = [f"TRIALS of {answer.get('function')} ({len(rows)})"]
    out += table(("SM", "QUOTA", "BATCH", "REPLICAS", "OK", "FAILED", "RPS", "P99 MS", "DEVICE"),
                 rows)
    protean = answer.get("protean_profile")
    if protean:
        out.append(f"PROTEAN  slice {protean['slice']}: solo {protean['solo_s'] * 1000:.1f} ms, "
                   f"FBR {protean['fbr']:.3f}" + (" (upper bound)" if protean["fbr_bounded"]
                                                  else ""))
    dilu = answer.get("dilu_profile")
    if dilu:
        out.append(f"DILU     request {dilu['sm_request']:g}, limit {dilu['sm_limit']:g} at "
                   f"IBS {dilu['ibs']}: {dilu['throughput_rps']:.1f} rps ({dilu['trials']} "
                   "trials)")
    out += [f"note: {n}" for n in answer.get("notes", [])]
    share = answer.get("share") or {}
    out.append(f"stored: {', '.join(answer.get('stored', [])) or 'nothing'}; share now "
               f"sm {share.get('sm_share', 0):g}, quota {share.get('time_quota', 0):g}"
               + (f" ({share['reason']})" if share.get("reason") else ""))
    return out
