"""The bursty hour (issue 22 item 5) on the simulator: T5, TSK, BL/GF/LC/LC+MC, the thesis's
1,600 GPUs, a cold start; before (no scale-up cap, no governor), with Kubernetes' scale-up
policies only, and with the governor too. ``python bench/sim_bursty.py [--seed N]``."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from flashpoint.sim import experiments as E
from flashpoint.sim.models import thesis_model
from flashpoint.sim.traces import requests_from_rates

MODES = {"before": E.BURSTY_BEFORE, "hpa only": (("governor", 0),), "after": E.BURSTY_AFTER}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    trace = E.bursty_trace(args.seed)
    log = requests_from_rates(trace, args.seed)
    print(f"trace: median {statistics.median(trace.rates)} req/s, peak {max(trace.rates):.1f}, "
          f"{sum(r > 0 for r in trace.rates)} burst seconds, {len(log)} requests")
    cfg = replace(E.FULL, seed=args.seed, decision_s=0.001, start="cold")
    print("| mode | technique | served | unserved | cold starts | avg cold start s | avg e2e s "
          "| peak starting | replica-s |\n|---|---|---|---|---|---|---|---|---|")
    for mode, over in MODES.items():
        t0 = time.perf_counter()
        for tech in E.BURSTY_TECHNIQUES:
            m = E.run_one("bursty", log, trace, thesis_model("t5"), "tsk", tech, cfg, over).metrics
            served = len(m.latencies_s)
            e2e = sum(m.latencies_s) / served if served else float("nan")
            print(f"| {mode} | {tech} | {served} | {m.unserved} | {len(m.cold_starts_s)} | "
                  f"{m.avg_cold_start_s:.1f} | {e2e:.2f} | {m.peak_starting} | {m.replica_s:,.0f} |",
                  flush=True)
        print(f"<!-- {mode}: {time.perf_counter() - t0:.1f} s wall -->", flush=True)


if __name__ == "__main__":
    main()
