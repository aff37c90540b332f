"""Simulator speed at scale (issue 7): 1,600 GPUs and 20,000 GPUs, a 1 h Twitter-like trace.

Targets: 1,600 GPUs × 1 h at 100% trace scale in ≤ 60 s, 20,000 GPUs × 1 h in ≤ 10 min.
The big cluster keeps the thesis's shape (8 GPUs per host, 20 hosts per leaf; 2,500 hosts,
125 leaves) and by default its trace is scaled with the GPU count (×12.5), so the load per
GPU is the 1,600-GPU run's; ``--big-trace-scale 1`` runs the unscaled trace instead.
Decision time is charged as a fixed 1 ms so wall time measures the simulator, not noise.
Each row is one run: events simulated, wall seconds, events per wall second.

    .venv/bin/python bench/sim_scale.py [--skip-big] [--techniques BL,LC+MC] [--autoscaler atl]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace

from flashpoint.sim.cluster import Technique
from flashpoint.sim.experiments import FULL, rate_trace, request_log, run_one
from flashpoint.sim.models import thesis_model

SIZES = {"1600": 200, "20000": 2500}  # GPUs -> hosts (8 GPUs each)
TARGET_S = {"1600": 60.0, "20000": 600.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-big", action="store_true", help="only the 1,600-GPU runs")
    ap.add_argument("--techniques", default="BL,LC+MC")
    ap.add_argument("--autoscaler", default="atl")
    ap.add_argument("--model", default="t5")
    ap.add_argument("--duration-s", type=int, default=3600)
    ap.add_argument("--big-trace-scale", type=float, default=12.5)
    ap.add_argument("--seed", type=int, default=1)
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
    print(json.dumps({"bench": "sim_scale", "duration_s": args.duration_s, "model": args.model,
                      "python": platform.python_version(), "runs": rows}))


if __name__ == "__main__":
    main()
