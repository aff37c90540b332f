"""The controller's status report (``/v1/cluster``, ``flashpoint status``, the dashboard):
a read-only view of the controller's state, its connections and its meters."""

from __future__ import annotations

from typing import Any


def cluster_status(ctl: Any, *, now_s: float, uptime_s: float) -> dict[str, Any]:
    """``ctl`` (the :class:`~flashpoint.controller.actor.Controller`, untyped here so
    that this module and the actor's import no circle) as builtins: hosts, replicas,
    pipeline groups, functions, scaling, SLOs, cost, MIG, KaaS and the dashboard's journal.
    ``now_s``: monotonic now; ``uptime_s``: the controller's."""
    now = now_s
    return {
        "uptime_s": round(uptime_s, 3),
        "hosts": [
            {"host_id": h.host_id, "alive": h.alive, "draining": h.draining,
             "last_seen_s_ago": round(now - h.last_seen_s, 3),
             "cached_models": sorted(h.cached_models),
             "transfers": (hh.transfers if (hh := ctl.hosts.get(h.host_id)) else {}),
             "devices": [{"device_id": d.device_id, "kind": d.kind, "memory_bytes": d.memory_bytes}
                         for d in h.devices.values()]}
            for h in ctl.state.hosts.values()
        ],
        "replicas": [
            {"replica_id": r.replica_id, "function": r.function, "host_id": r.host_id,
             "device_id": r.device_id, "phase": str(r.phase),
             "inflight": ctl.dispatcher.inflight_of(r.replica_id),
             "timings_s": r.timings_s,
             "stage": list(r.stage) if r.stage is not None else None,
             "group_id": r.group_id,
             # its GPU share on a sharing host and, for a FaST-profiled function, the
             # configuration (shape) RPR gave it
             "share": r.share.to_wire() if r.share is not None else None,
             "config": ctl.state.replica_config(r),
             "source": w.source if (w := ctl.workers.get(r.replica_id)) is not None else ""}
            for r in ctl.state.replicas.values()
        ],
        "groups": [
            {"group_id": g.group_id, "function": g.function, "stages": list(g.stages),
             "phase": str(g.phase), "reason": g.reason,
             "inflight": ctl.dispatcher.inflight_of(g.group_id)}
            for g in ctl.state.groups.values()
        ],
        "functions": [i.to_dict() for i in ctl.functions.infos()],
        "scaling": [{"function": name, **ctl.state.counts(name)}
                    for name in ctl.state.functions],
        "slo": [{"function": name, "met": c.met, "missed": c.missed,
                 "compliance": c.compliance} for name, c in ctl.requests.slo.items()
                if name in ctl.state.functions],
        # requests answered on MIG slices, by class and slice profile (PROTEAN's Alg. 1)
        "slices": [{"function": name, "request_class": cls, "slice": prof, "served": n}
                   for name, by in ctl.requests.slices.items() if name in ctl.state.functions
                   for (cls, prof), n in sorted(by.items())],
        "cost": ctl.cost.report(now),
        "replacements": list(ctl.replacements),
        "mig": ctl.mig.status() if ctl.mig is not None else None,
        "kaas": {"executors_wanted": ctl.cc.kaas_workers,
                 "executors": len(ctl.kaas.pool.handles),
                 "broken": ctl.state.kaas_broken, "unplaced": ctl.state.kaas_unplaced,
                 "max_buffer_bytes": ctl.kaas.max_buffer_bytes},
        "ui": ctl.ui.view(ctl.state, now),
    }

