"""The dashboard's data: the controller's ``cluster_status()`` reshaped into its views.

Pure: one plain dict in, one plain dict out, no I/O and no clock. It runs wherever the API
runs, the controller itself or a stand-alone gateway (whose backend's ``cluster_status()`` is
the controller's, refreshed every ``refresh_s``), so the page reads the same through both.
The history the state does not keep (latency windows, scaling decisions, cold-start
breakdowns, chains) arrives under ``status["ui"]`` (controller/ui_journal.py).

Views (keys of :func:`ui_state`'s result):

- ``hosts``: the cluster map, host -> GPU (-> MIG slices) / CPU devices -> replicas, with the
  host's RAM cache, draining and spot-notice state;
- ``functions``: rate, p50/p99, SLO compliance, queue, replicas by phase, the scaling decision
  and its reason, recent decisions;
- ``waterfall``: per replica, its cold start's phases in order and its source tier;
- ``transfers``: peer chains as sender -> relays -> receiver with each hop's progress, and
  fills in progress that no chain explains (registry pulls);
- ``mig``: per GPU its MIG geometry (and the reconfigurator's state when it runs);
- ``cost``, ``kaas``: as the controller reports them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from flashpoint.controller.cold_timings import COLD_PHASES

# The source tiers of the thesis's Fig 8.5 hierarchy, fastest first.
TIERS = ("ram", "peer", "registry", "pipeline")
_REGISTRY_SOURCES = frozenset(("registry", "chain:registry"))


def source_tier(source: str) -> str:
    """Where a replica's bytes came from, as a tier: ``ram`` (this host's own cache),
    ``peer`` (a peer chain or peer pull), ``registry``, ``pipeline`` (a partitioned start
    whose stages served it), ``kaas`` or ``unknown``."""
    if source == "local":
        return "ram"
    if source.startswith("pipeline"):
        return "pipeline"
    if source == "kaas":
        return "kaas"
    parts = [p for p in source.replace(",", "+").split("+") if p]
    if not parts:
        return "unknown"
    if all(p in _REGISTRY_SOURCES for p in parts):
        return "registry"
    return "peer"


def _replica_view(r: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    source = str(r.get("source") or "")
    return {"replica_id": r["replica_id"], "function": r["function"], "phase": r["phase"],
            "source": source, "tier": source_tier(source),
            "device_bytes": extra.get("device_bytes", 0), "model_key": extra.get("model_key", ""),
            "inflight": r.get("inflight", 0), "stage": r.get("stage"),
            "group_id": r.get("group_id")}


def _hosts(status: dict[str, Any], ui: dict[str, Any]) -> list[dict[str, Any]]:
    by_device: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in status.get("replicas", []):
        extra = ui.get("replicas", {}).get(r["replica_id"], {})
        by_device.setdefault((r["host_id"], r["device_id"]), []).append(_replica_view(r, extra))
    out = []
    for h in status.get("hosts", []):
        hx = ui.get("hosts", {}).get(h["host_id"], {})
        geometry = hx.get("devices", {})
        devices = []
        for d in h.get("devices", []):
            g = geometry.get(d["device_id"], {})
            devices.append({**d, "gpu_index": g.get("gpu_index", -1),
                            "mig_profile": g.get("mig_profile", ""),
                            "replicas": by_device.get((h["host_id"], d["device_id"]), [])})
        gpus = []
        for gpu in hx.get("gpus", []):
            gpus.append({**gpu, "devices": [d for d in devices
                                            if d["gpu_index"] == gpu["gpu_index"]]})
        known = {g["gpu_index"] for g in gpus}
        # GPU units of a GPU the host did not describe still show, as a GPU of their own.
        for idx in sorted({d["gpu_index"] for d in devices if d["gpu_index"] >= 0} - known):
            gpus.append({"gpu_index": idx, "model": "", "mig": False,
                         "devices": [d for d in devices if d["gpu_index"] == idx]})
        drain_in_s = hx.get("drain_in_s")
        out.append({
            "host_id": h["host_id"], "alive": h.get("alive", False),
            "draining": h.get("draining", False),
            "spot_notice": bool(h.get("draining")) and drain_in_s is not None,
            "drain_in_s": drain_in_s, "last_seen_s_ago": h.get("last_seen_s_ago"),
            "ram_bytes": hx.get("ram_bytes", 0), "leaf": hx.get("leaf", ""),
            "cached_models": list(h.get("cached_models", [])),
            "filling": {k: list(v) for k, v in (h.get("transfers") or {}).items()},
            "gpus": gpus,
            "cpu_devices": [d for d in devices if d["gpu_index"] < 0]})
    return out


def _functions(status: dict[str, Any], ui: dict[str, Any]) -> list[dict[str, Any]]:
    scaling = {s["function"]: s for s in status.get("scaling", [])}
    slo = {s["function"]: s for s in status.get("slo", [])}
    requests = ui.get("requests", {})
    phases: dict[str, Counter[str]] = {}
    for r in status.get("replicas", []):
        phases.setdefault(r["function"], Counter())[r["phase"]] += 1
    decisions: dict[str, list[dict[str, Any]]] = {}
    for d in ui.get("decisions", []):
        decisions.setdefault(d["function"], []).append(d)
    out = []
    for f in status.get("functions", []):
        spec = f.get("spec", {})
        name = spec.get("name", "")
        req = requests.get(name, {})
        sc = scaling.get(name, {})
        out.append({
            "name": name, "model": spec.get("model", ""),
            "model_version": spec.get("model_version", ""), "ready": f.get("ready", False),
            "queued": f.get("queued", 0), "slo_ms": spec.get("slo_ms", 0),
            "rate_per_s": req.get("rate_per_s", 0.0), "p50_s": req.get("p50_s"),
            "p99_s": req.get("p99_s"), "requests_in_window": req.get("count", 0),
            "slo": slo.get(name), "replicas_by_phase": dict(phases.get(name, {})),
            "planned": sc.get("planned", 0), "requested": sc.get("requested", 0),
            "observed": sc.get("observed", 0), "reason": sc.get("reason", ""),
            "not_ready": f.get("reason"), "decisions": decisions.get(name, [])[:10]})
    return out


def _waterfall(status: dict[str, Any], ui: dict[str, Any]) -> list[dict[str, Any]]:
    """Per replica, the breakdown of the request that waited for its start when one did
    (every phase), else the phases its host and worker timed."""
    replicas = {r["replica_id"]: r for r in status.get("replicas", [])}
    out, seen = [], set()
    order = (*COLD_PHASES,)
    for c in ui.get("cold_starts", []):
        rep = replicas.get(c["replica_id"], {})
        phases = c.get("phases_s", {})
        out.append({"replica_id": c["replica_id"], "function": c["function"],
                    "host_id": rep.get("host_id", ""), "source": c["source"],
                    "tier": source_tier(c["source"]), "complete": "decision" in phases,
                    "phases": [[k, phases[k]] for k in order if k in phases],
                    "fetch_s": phases.get("fetch"), "age_s": c.get("age_s"),
                    "live": c["replica_id"] in replicas})
        seen.add(c["replica_id"])
    for rid, r in replicas.items():
        timings = r.get("timings_s") or {}
        if rid in seen or not timings:
            continue
        source = str(r.get("source") or "")
        out.append({"replica_id": rid, "function": r["function"], "host_id": r["host_id"],
                    "source": source, "tier": source_tier(source), "complete": False,
                    "phases": [[k, float(timings[k])] for k in order if k in timings],
                    "fetch_s": timings.get("fetch"), "age_s": None, "live": True})
    return out


def _transfers(status: dict[str, Any], ui: dict[str, Any]) -> list[dict[str, Any]]:
    hosts = {h["host_id"]: h for h in status.get("hosts", [])}
    out, explained = [], set()
    for c in ui.get("chains", []):
        key = c["model_key"]
        hops = []
        for hid in c["receivers"]:
            h = hosts.get(hid, {})
            filling = (h.get("transfers") or {}).get(key)
            if filling is not None:
                state, done, total = "receiving", int(filling[0]), int(filling[1])
                explained.add((hid, key))
            elif key in h.get("cached_models", []):
                state, done, total = "done", 1, 1
            else:
                state, done, total = ("waiting" if c.get("active") else "gone"), 0, 0
            hops.append({"host_id": hid, "state": state, "verified_bytes": done,
                         "total_bytes": total})
        out.append({"transfer_id": c["transfer_id"], "model_key": key, "sender": c["sender"],
                    "relays": c["receivers"][:-1], "receiver": c["receivers"][-1:],
                    "hops": hops, "active": c.get("active", False), "age_s": c.get("age_s")})
    for hid, h in hosts.items():
        for key, (done, total) in (h.get("transfers") or {}).items():
            if (hid, key) not in explained:
                out.append({"transfer_id": "", "model_key": key, "sender": "registry",
                            "relays": [], "receiver": [hid], "active": True, "age_s": None,
                            "hops": [{"host_id": hid, "state": "receiving",
                                      "verified_bytes": int(done), "total_bytes": int(total)}]})
    return out


def _mig(hosts: list[dict[str, Any]], status: dict[str, Any]) -> dict[str, Any]:
    gpus = [{"host_id": h["host_id"], "gpu_index": g["gpu_index"], "model": g["model"],
             "mig": g["mig"],
             "slices": [{"device_id": d["device_id"], "profile": d["mig_profile"],
                         "memory_bytes": d["memory_bytes"],
                         "replicas": [r["replica_id"] for r in d["replicas"]]}
                        for d in g["devices"]]}
            for h in hosts for g in h["gpus"]]
    return {"gpus": gpus, "reconfigurator": status.get("mig")}


def ui_state(status: dict[str, Any]) -> dict[str, Any]:
    """Every view of the dashboard from one ``cluster_status()``."""
    ui = status.get("ui") or {}
    hosts = _hosts(status, ui)
    kaas_replicas = [r for r in status.get("replicas", []) if r.get("source") == "kaas"
                     or r.get("function", "").startswith("_kaas")]
    return {
        "uptime_s": status.get("uptime_s"),
        "tiers": list(TIERS),
        "phases": list(COLD_PHASES),
        "hosts": hosts,
        "functions": _functions(status, ui),
        "waterfall": _waterfall(status, ui),
        "transfers": _transfers(status, ui),
        "mig": _mig(hosts, status),
        "cost": status.get("cost") or {},
        "kaas": {**(status.get("kaas") or {}),
                 "replicas": [{"replica_id": r["replica_id"], "host_id": r["host_id"],
                               "device_id": r["device_id"], "phase": r["phase"],
                               "inflight": r.get("inflight", 0)} for r in kaas_replicas]},
        "gateway": status.get("gateway"),
    }
