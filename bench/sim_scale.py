"""Simulator speed at scale (issue 7): 1,600 GPUs and 20,000 GPUs, a 1 h Twitter-like trace.

Targets: 1,600 GPUs × 1 h at 100% trace scale in ≤ 60 s, 20,000 GPUs × 1 h in ≤ 10 min.
The big cluster keeps the thesis's shape (8 GPUs per host, 20 hosts per leaf; 2,500 hosts,
125 leaves) and by default its trace is scaled with the GPU count (×12.5), so the load per
GPU is the 1,600-GPU run's; ``--big-trace-scale 1`` runs the unscaled trace instead.
Decision time is charged as a fixed 1 ms so wall time measures the simulator, not noise.
Each row is one run: events simulated, wall seconds, events per wall second.

A second table isolates the flow network (the max-min recompute on every flow start and
finish): ``--network-flows`` random flows (1 in 50 from the registry, sizes up to 12 GB,
starts over 60 s) on the 2,500-host topology, once with the incremental recompute (only the
changed flows' connected component) and once re-filling every active flow, as before; the
completion times must agree.

    .venv/bin/python bench/sim_scale.py [--skip-big] [--techniques BL,LC+MC] [--autoscaler atl]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Iterable
from dataclasses import replace

from flashpoint.sim.cluster_config import Technique
from flashpoint.sim.engine import Engine
from flashpoint.sim.experiments import FULL, rate_trace, request_log, run_one
from flashpoint.sim.models import thesis_model
from flashpoint.sim.network import CLOUD, Flow, FlowNetwork, LinkId, Topology

SIZES = {"1600": 200, "20000": 2500}  # GPUs -> hosts (8 GPUs each)
TARGET_S = {"1600": 60.0, "20000": 600.0}


class FullRecompute(FlowNetwork):
    """The network as it was: every change re-fills every active flow (the reference)."""

    def _component(self, links: Iterable[LinkId]) -> list[Flow]:
        return list(self.active_flows.values())


def network_run(cls: type[FlowNetwork], n_flows: int, seed: int) -> tuple[int, float, list[float]]:
    rng = random.Random(seed)
    topo = Topology(n_hosts=2500)
    engine = Engine()
    net = cls(engine, topo)
    done: list[float] = []
    for i in range(n_flows):
        src = CLOUD if i % 50 == 0 else rng.randrange(topo.n_hosts)
        dst = rng.randrange(topo.n_hosts)
        if dst == src:
            dst = (dst + 1) % topo.n_hosts
        size = rng.randrange(1, 12 * 10**9)
        engine.schedule(rng.random() * 60.0, lambda s=src, d=dst, b=size: net.start_flow(
            s, d, b, lambda f: done.append(f.finished_s)))
    t0 = time.perf_counter()
    events = engine.run()
    return events, time.perf_counter() - t0, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-big", action="store_true", help="only the 1,600-GPU runs")
    ap.add_argument("--techniques", default="BL,LC+MC")
    ap.add_argument("--autoscaler", default="atl")
    ap.add_argument("--model", default="t5")
    ap.add_argument("--duration-s", type=int, default=3600)
    ap.add_argument("--big-trace-scale", type=float, default=12.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--network-flows", type=int, default=3000, help="0 skips the network table")
    args = ap.parse_args()
    techniques = [Technique(t) for t in args.techniques.split(",") if t]
    model = thesis_model(args.model)
    rows = []
    print(f"{'GPUs':>6} {'technique':>9} {'requests':>9} {'events':>10} {'wall s':>8} "
          f"{'events/s':>9} {'target s':>8}")
    for gpus, hosts in SIZES.items():
        if args.skip_big and gpus != "1600":
            continue
        scale = 1.0 if gpus == "1600" else args.big_trace_scale
        cfg = replace(FULL, n_hosts=hosts, duration_s=args.duration_s, trace_scale=scale,
                      decision_s=0.001, seed=args.seed)
        log = request_log("twitter", cfg)
        trace = rate_trace("twitter", cfg)
        for tech in techniques:
            t0 = time.perf_counter()
            r = run_one("twitter", log, trace, model, args.autoscaler, tech, cfg)
            total_s = time.perf_counter() - t0
            m = r.metrics
            row = {"gpus": int(gpus), "hosts": hosts, "trace_scale": scale,
                   "technique": tech.value, "autoscaler": args.autoscaler,
                   "requests": len(log), "events": m.events, "wall_s": round(total_s, 2),
                   "events_per_s": round(m.events / total_s), "target_s": TARGET_S[gpus],
                   "met": total_s <= TARGET_S[gpus], "cold_starts": len(m.cold_starts_s),
                   "unserved": m.unserved}
            rows.append(row)
            print(f"{gpus:>6} {tech.value:>9} {len(log):>9,} {m.events:>10,} {total_s:>8.2f} "
                  f"{m.events / total_s:>9,.0f} {TARGET_S[gpus]:>8.0f}", flush=True)
    network = {}
    if args.network_flows > 0:
        print(f"\n{'flow network, 2,500 hosts':<26} {'flows':>6} {'events':>7} {'wall s':>7} "
              f"{'events/s':>9}")
        times: dict[str, list[float]] = {}
        for label, cls in (("incremental", FlowNetwork), ("full recompute", FullRecompute)):
            events, wall, done = network_run(cls, args.network_flows, args.seed)
            times[label] = done
            network[label] = {"flows": args.network_flows, "events": events,
                              "wall_s": round(wall, 3), "events_per_s": round(events / wall)}
            print(f"{label:<26} {args.network_flows:>6} {events:>7} {wall:>7.2f} "
                  f"{events / wall:>9,.0f}", flush=True)
        a, b = times["incremental"], times["full recompute"]
        worst = max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(a, b, strict=True))
        network["max_rel_diff_completion"] = worst
        network["speedup"] = round(network["full recompute"]["wall_s"]
                                   / network["incremental"]["wall_s"], 2)
        print(f"speedup {network['speedup']}x; completion times agree to {worst:.1e} (relative)")
    print(json.dumps({"bench": "sim_scale", "duration_s": args.duration_s, "model": args.model,
                      "python": platform.python_version(), "runs": rows, "network": network}))


if __name__ == "__main__":
    main()
