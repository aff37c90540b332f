"""``flashpoint sim reproduce``: its arguments, and the command that runs the grid
(:mod:`flashpoint.sim.experiments`) and writes the report (:mod:`flashpoint.sim.report`)
with its plots (:mod:`flashpoint.sim.plots`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from flashpoint.sim.cluster_config import Technique
from flashpoint.sim.experiments import (
    AUTOSCALERS,
    FAIR_MAX_RUNS,
    FULL,
    SMALL,
    TRACES,
    ExperimentConfig,
    run_grid,
)
from flashpoint.sim.models import THESIS_MODELS, thesis_model
from flashpoint.sim.plots import plots_markdown, write_plots
from flashpoint.sim.report import report_markdown

__all__ = ["add_arguments", "cli", "config_from_args"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``flashpoint sim reproduce``."""
    p.add_argument("--scale", choices=("small", "full"), default="small",
                   help="small: 80 GPUs × 10 min; full: the thesis's 1,600 GPUs × 1 h")
    p.add_argument("--hosts", type=int, help="hosts (8 GPUs each unless --gpus-per-host)")
    p.add_argument("--gpus-per-host", type=int, help="GPUs per host (default: the scale's)")
    p.add_argument("--hosts-per-leaf", type=int,
                   help="hosts under one leaf switch (default: the scale's)")
    p.add_argument("--duration-s", type=int,
                   help="seconds of trace to simulate (default: the scale's)")
    p.add_argument("--trace-scale", type=float, help="multiply the trace's rates")
    p.add_argument("--traces", default="twitter", help=f"comma list of {','.join(TRACES)}")
    p.add_argument("--trace-file", default="",
                   help="a request log (CSV: TIMESTAMP,ContextTokens,GeneratedTokens) for the "
                        "azure_llm trace instead of the one shipped with Flashpoint")
    p.add_argument("--models", default="t5", help=f"comma list of {','.join(THESIS_MODELS)}")
    p.add_argument("--autoscalers", default=",".join(AUTOSCALERS),
                   help=f"comma list of {','.join(AUTOSCALERS)}")
    p.add_argument("--techniques", default=",".join(t.value for t in Technique),
                   help=f"comma list of {','.join(t.value for t in Technique)}")
    p.add_argument("--seed", type=int, default=1,
                   help="random seed of the generated traces and requests (default 1)")
    p.add_argument("--decision-s", type=float,
                   help="charge this fixed decision time (default: measure it)")
    p.add_argument("--fairness", action="store_true",
                   help="tune each technique's autoscaler threshold, then its scale-down "
                        "delay, to BL's replica-seconds ±5%% (thesis §8.4; up to "
                        f"{FAIR_MAX_RUNS} runs per row)")
    p.add_argument("--start", choices=("warm", "cold"), default="warm",
                   help="warm: steady state (warm replicas, hosts holding the model); cold: "
                        "no replica and no host holding the model at t=0")
    p.add_argument("--jobs", type=int, default=1,
                   help="run rows in this many processes (same results)")
    p.add_argument("--out", help="write the markdown report here (default: stdout)")


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    cfg = FULL if args.scale == "full" else SMALL
    over: dict[str, object] = {}
    for arg, key in (("hosts", "n_hosts"), ("gpus_per_host", "gpus_per_host"),
                     ("hosts_per_leaf", "hosts_per_leaf"), ("duration_s", "duration_s"),
                     ("trace_scale", "trace_scale"), ("decision_s", "decision_s")):
        if getattr(args, arg) is not None:
            over[key] = getattr(args, arg)
    over["traces"] = tuple(t for t in args.traces.split(",") if t)
    over["models"] = tuple(m for m in args.models.split(",") if m)
    over["autoscalers"] = tuple(a for a in args.autoscalers.split(",") if a)
    over["techniques"] = tuple(Technique(t) for t in args.techniques.split(",") if t)
    over["seed"] = args.seed
    over["fairness"] = bool(getattr(args, "fairness", False))
    over["start"] = getattr(args, "start", "warm")
    over["jobs"] = getattr(args, "jobs", 1)
    over["trace_file"] = getattr(args, "trace_file", "") or ""
    return replace(cfg, **over)  # type: ignore[arg-type]


def cli(args: argparse.Namespace) -> int:
    """``flashpoint sim reproduce``: run the grid, print progress, write the report."""
    cfg = config_from_args(args)
    for kind in cfg.traces:
        if kind not in TRACES:  # unknown names fail before any run
            raise ValueError(f"unknown trace {kind!r}; known: {TRACES}")
    for name in cfg.models:
        thesis_model(name)
    t0 = time.perf_counter()
    results = run_grid(cfg, progress=True)
    wall = time.perf_counter() - t0
    text = report_markdown(results, cfg, wall)
    if args.out:
        out = Path(args.out)
        pngs = write_plots(results, out.parent, out.stem)
        out.write_text(text + plots_markdown(pngs, out))
        print(f"report: {args.out}" + (f" ({len(pngs)} plots)" if pngs else ""), file=sys.stderr)
    else:
        sys.stdout.write(text)
    events = sum(r.metrics.events for r in results)
    print(f"{len(results)} runs, {events:,} events in {wall:.2f} s wall "
          f"({events / wall if wall else 0:,.0f} events/s)", file=sys.stderr)
    return 0
