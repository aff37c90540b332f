"""Partitioned cold start: analytical table (thesis Fig 4.5) and a real run over capped links.

**1. Analytical table.** Every built-in model in the list is published with
``profile=True`` (per-layer bytes, CPU exec time on this machine, output bytes) into a
temporary LocalStore; with ``CostModel(bandwidth_bps = link_bps = --rate-mbit,
overhead_s = 0)`` the exact solver (``best_plan_with_parts``, x = 1, P = p) gives for
p = 1, 2, 4, 8 the best contiguous plan. Reported: cold-start speedup ``C(1)/C(p)`` (C =
longest part's transfer) and inference penalty ``I(p)/I(1)`` (execution plus activation
transfers, one request through the pipeline).

**2. Real run** (root, network namespaces). One NetLab: host 0 is the sender (``node serve``
holding the blob; uplink uncapped), hosts 1..4 the stage hosts, each with its downlink and
uplink capped at ``--rate-mbit`` (independent capped paths, as the thesis assumes for
parallel part loads; the sender's uplink is not the shared bottleneck), plus a root-namespace
link for the client. For k = 1, 2, 4 the solver picks the cuts; at t0 every stage host
starts ``bench/_stage_pull.py`` (``node get`` cannot fetch a chunk subset), which pulls only
that stage's chunks from the sender and then serves ``flashpoint.pipeline.stage`` over the
pulled file with its ``--next`` hop. Once every stage prints ``listening`` the client
(``PipelineClient`` in the root namespace) sends the first request. Time to first response
(TTFR) = t0 → first reply. Then steady latency = median of ``--requests`` sequential
requests. Every k's output is checked allclose against k = 1's.

Prediction per k: ``C + I(p)`` (Eq 4.7 with y = 1) from the same profiles and rate, with
overhead_s = 0 ("pure") and with one fixed per-part overhead calibrated from k = 1's
measurement (``measured(1) - pure(1)``, "cal").

How a stage process starts (``bench/_stage_pull.py``). By default it starts at t0 and
imports torch, parses the manifest and builds its layers on ``meta`` on a thread *while* its
bytes arrive; after the pull it maps its byte range and binds the weights (milliseconds).
``--exec-stage`` starts a cold ``python -m flashpoint.pipeline.stage`` after the pull instead.
``--prestarted`` starts every stage process before t0 and lets it do that preparation, then
t0 is when the stages are told (SIGUSR1) to pull: a host's worker that was up, torch
imported, before the model was assigned. The default is CPU-bound at k = 4 on a small VM:
every stage process spends ~2.5-3 CPU-s importing torch, so four of them alone need ~5-7 s
of the dev VM's two vCPUs, longer than the pulls. Each stage runs ``--torch-threads``
intra-op threads (default 1): with one request in flight one stage computes at a time, and 2
threads on the 2-vCPU dev VM make a forward ~1.7x faster when nothing else runs, but 2-3x
slower when anything else competes for the cores (OpenMP splits the work statically), so 1
is the robust choice.

Each k prints a per-stage timeline (seconds after t0): process start, torch imported, pull,
layers bound, listening, its part of the first request (received/started/computed/forwarded)
and the CPU seconds the process used up to the first response.

    sudo .venv/bin/python bench/partition.py [--model bert-base --rate-mbit 250] [--quick]
        [--exec-stage | --prestarted] [--torch-threads N]

The last line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.multicast import LabProc  # noqa: E402
from flashpoint.models import zoo  # noqa: E402
from flashpoint.models.sources import publish  # noqa: E402
from flashpoint.partition.model import CostModel, LayerProfile, Plan  # noqa: E402
from flashpoint.partition.solver import best_plan_with_parts  # noqa: E402
from flashpoint.pipeline.client import PipelineClient  # noqa: E402
from flashpoint.registry.local import LocalStore  # noqa: E402
from flashpoint.registry.manifest import Manifest  # noqa: E402
from flashpoint.testing.netns import NetLab  # noqa: E402
from flashpoint.transfer.plan import Endpoint  # noqa: E402

SECRET_ENV = "FP_BENCH_SECRET"
SENDER_PORT, STAGE_PORT = 7000, 7100
MODELS = ["bert-small", "bert-base", "bert-large", "resnet-small", "resnet-base", "resnet-large"]
QUICK_MODELS = ["bert-small", "resnet-small"]
PS = (1, 2, 4, 8)
KS = (1, 2, 4)


def profiles_of(manifest: Manifest) -> list[LayerProfile]:
    return [LayerProfile.from_manifest(layer.name, layer.profile) for layer in manifest.layers]


def plan_for(profiles: list[LayerProfile], cost: CostModel, p: int) -> Plan:
    return best_plan_with_parts(p, profiles, cost, 1, p)


def first_response_s(plan: Plan) -> float:
    """``T(p, 1, p) = C + I(p)``: cold start of the slowest part, then one pass."""
    return plan.terms.cold_s + plan.terms.inference_s


async def publish_all(store: LocalStore, models: list[str]) -> dict[str, Manifest]:
    out = {}
    for m in models:
        name, preset = m.split("-", 1)
        t = time.monotonic()
        out[m] = await publish(store, name, preset, profile=True)
        print(f"  published {m}: {out[m].blob_size / 1e6:.1f} MB, {len(out[m].layers)} layers "
              f"({time.monotonic() - t:.1f}s)", flush=True)
    return out


def analytical(manifests: dict[str, Manifest], cost: CostModel) -> list[dict[str, Any]]:
    rows = []
    for m, man in manifests.items():
        prof = profiles_of(man)
        base = plan_for(prof, cost, 1)
        for p in PS:
            if p > len(prof):
                continue
            pl = plan_for(prof, cost, p)
            rows.append({"model": m, "p": p, "cuts": list(pl.cuts), "cold_s": pl.terms.cold_s,
                         "inference_s": pl.terms.inference_s,
                         "cold_speedup": base.terms.cold_s / pl.terms.cold_s,
                         "inference_penalty": pl.terms.inference_s / base.terms.inference_s})
    return rows


def print_analytical(rows: list[dict[str, Any]], rate: float) -> None:
    print(f"\nAnalytical (Fig 4.5 style), link {rate:g} Mbit/s, overhead 0, x=1, P=p; "
          "exec times profiled on this CPU")
    print(f"{'model':<14}{'p':>3}  {'C(p) s':>8} {'speedup':>8}  {'I(p) ms':>9} {'penalty':>8}  cuts")
    for r in rows:
        print(f"{r['model']:<14}{r['p']:>3}  {r['cold_s']:>8.3f} {r['cold_speedup']:>7.2f}x  "
              f"{r['inference_s'] * 1e3:>9.2f} {r['inference_penalty']:>7.3f}x  {r['cuts']}")


# --------------------------------------------------------------------------------------
# Real run
# --------------------------------------------------------------------------------------


async def infer_once(client: PipelineClient, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return await client.infer(inputs, timeout_s=60.0)


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_k(lab: NetLab, k: int, plan: Plan, man_path: Path, man: Manifest, work: Path,
          env: dict[str, str], inputs: dict[str, np.ndarray], n_req: int, mode: str,
          torch_threads: int, timeout_s: float) -> dict[str, Any]:
    """One pipeline of k stages; ``mode``: "" (import during the pull), "exec-stage" or
    "prestarted" (see bench/_stage_pull.py)."""
    bounds = (0, *plan.cuts, len(man.layers))
    stage_hosts = [1 + i for i in range(k)]
    sender = f"sender:{lab.hosts[0].addr}:{SENDER_PORT}"
    procs: list[LabProc] = []
    outs = []
    try:
        t0 = time.monotonic()
        for i in range(k):
            h = stage_hosts[i]
            out = work / f"k{k}-s{i}.blob"
            outs.append(out)
            nxt = (["--next", f"s{i + 1}:{lab.hosts[h + 1].addr}:{STAGE_PORT}"]
                   if i + 1 < k else [])
            argv = [sys.executable, str(REPO / "bench" / "_stage_pull.py"), "--from", sender,
                    "--manifest", str(man_path), "--out", str(out), "--first", str(bounds[i]),
                    "--last", str(bounds[i + 1] - 1), "--secret-env", SECRET_ENV,
                    *([f"--{mode}"] if mode else []), "--",
                    "--listen", lab.hosts[h].addr, "--port", str(STAGE_PORT),
                    "--stage-id", f"s{i}", "--torch-threads", str(torch_threads), "--events",
                    *nxt]
            procs.append(LabProc(lab, h, argv, f"k{k}-s{i}", env))
        cpu0 = {}
        if mode == "prestarted":  # workers up, torch imported: the model is assigned now
            ready = [p.wait_json(lambda o: o.get("event") == "ready", timeout_s)[1]
                     for p in procs]
            cpu0 = {o["pid"]: cpu_s(o["pid"]) or 0.0 for o in ready}
            t0 = time.monotonic()
            for o in ready:
                os.kill(o["pid"], signal.SIGUSR1)
        pulled = [p.wait_json(lambda o: o.get("event") == "pulled", timeout_s) for p in procs]
        listening = [p.wait_json(lambda o: o.get("event") == "listening", timeout_s)
                     for p in procs]
        t_ready = max(t for t, _ in listening)
        t_client: list[float] = []

        async def client_side() -> tuple[float, np.ndarray, list[float]]:
            ep = Endpoint("s0", lab.hosts[stage_hosts[0]].addr, STAGE_PORT)
            async with PipelineClient(ep, env[SECRET_ENV].encode(), timeout_s=60.0) as c:
                t_client.append(time.monotonic())
                first = await infer_once(c, inputs)
                t_first = time.monotonic()
                t_client.append(t_first)
                t_client.extend(cpu_s(o["pid"]) or 0.0 for _, o in listening)
                lats = []
                for _ in range(n_req):
                    s = time.perf_counter()
                    await infer_once(c, inputs)
                    lats.append(time.perf_counter() - s)
            return t_first, first, lats

        t_first, output, lats = asyncio.run(asyncio.wait_for(client_side(), timeout_s))

        def rel(x: float | None) -> float | None:
            return None if x is None else round(x - t0, 3)

        timeline = []
        for i, p in enumerate(procs):
            (_, pu), (_, li) = pulled[i], listening[i]
            im = ({} if mode == "exec-stage" else  # the exec'd stage imports after the pull
                  p.wait_json(lambda o: o.get("event") == "imported", timeout_s)[1])
            _, rq = p.wait_json(lambda o: o.get("event") == "request", timeout_s)
            timeline.append({
                "proc_start": rel(pu["t_start"]), "imported": rel(im.get("t_imported")),
                "pull": [rel(pu["t_pull0"]), rel(pu["t_pull1"])],
                "load": [rel(li["t_load0"]), rel(li["t_load1"])],
                "listening": rel(listening[i][0]),
                "first_request": [rel(rq["received_s"]), rel(rq["started_s"]),
                                  rel(rq["computed_s"]), rel(rq["forwarded_s"])],
                "cpu_to_first_s": round(t_client[2 + i] - cpu0.get(li["pid"], 0.0), 2)})
        return {
            "k": k, "cuts": list(plan.cuts),
            "stage_bytes": [o["bytes"] for _, o in pulled],
            "pull_s": [round(t - t0, 3) for t, _ in pulled],
            "listening_s": [round(t - t0, 3) for t, _ in listening],
            "ready_s": round(t_ready - t0, 3), "ttfr_s": t_first - t0,
            "client_send_s": round(t_client[0] - t0, 3),
            "steady_ms": statistics.median(lats) * 1e3, "output": output,
            "timeline": timeline,
        }
    finally:
        for p in procs:
            lab.stop(p.proc)
        for o in outs:
            o.unlink(missing_ok=True)


def print_timeline(row: dict[str, Any]) -> None:
    """Per stage, seconds after t0: when the process started, torch was imported, its pull
    ran, its layers were bound, it listened, and its part of the first request (received,
    started, computed, forwarded); CPU seconds it used up to the first response."""
    for i, tl in enumerate(row["timeline"]):
        imported = "-" if tl["imported"] is None else f"{tl['imported']:.2f}"
        print(f"    s{i}: start {tl['proc_start']:.2f} imported {imported} pull "
              f"{tl['pull'][0]:.2f}-{tl['pull'][1]:.2f} load {tl['load'][0]:.2f}-"
              f"{tl['load'][1]:.2f} listening {tl['listening']:.2f} 1st req "
              f"{'/'.join(f'{x:.3f}' for x in tl['first_request'])} cpu "
              f"{tl['cpu_to_first_s']:.2f}s", flush=True)
    print(f"    client sends {row['client_send_s']:.3f}, first response {row['ttfr_s']:.3f}",
          flush=True)


def real_run(args: argparse.Namespace, model: str, man: Manifest, store: LocalStore,
             cost: CostModel) -> list[dict[str, Any]]:
    ok, why = NetLab.available()
    if not ok:
        raise SystemExit(f"the real run needs network namespaces (root): {why}")
    NetLab.sweep_stale()
    name, preset = model.split("-", 1)
    inputs = zoo.example_inputs(name, zoo.resolve_config(name, preset), 1)
    prof = profiles_of(man)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO),
               FLASHPOINT_LOG_LEVEL="WARNING", **{SECRET_ENV: secrets.token_hex(32)})
    rates = [None] + [args.rate_mbit] * max(KS)
    rows = []
    with NetLab(1 + max(KS), rate_mbit=rates, ingress_rate_mbit=rates, root_link=True) as lab:
        work = Path(args.work_dir) / f"fp-partition-{lab.tag}"
        sender = None
        try:
            (work / "sender").mkdir(parents=True)
            key = f"{man.name}@{man.version}"
            shutil.copyfile(store.blob_path(man.name, man.version), work / "sender" / key)
            man_path = work / "manifest.json"
            man_path.write_text(man.to_json())
            (work / "sender" / f"{key}.json").write_text(man.to_json())
            print(f"\nlab {lab.tag} {lab.subnet}: sender h0 (uplink uncapped), stage hosts "
                  f"h1..h{max(KS)} at {args.rate_mbit:g} Mbit/s each way; {model} "
                  f"{man.blob_size / 1e6:.1f} MB", flush=True)
            sender = LabProc(lab, 0, [sys.executable, "-m", "flashpoint.transfer.node", "serve",
                                      "--listen", lab.hosts[0].addr, "--port", str(SENDER_PORT),
                                      "--dir", str(work / "sender"), "--secret-env", SECRET_ENV],
                             "sender", env)
            sender.wait_json(lambda o: o.get("event") == "listening", 60.0)
            for k in KS:
                plan = plan_for(prof, cost, k)
                mode = ("exec-stage" if args.exec_stage else
                        "prestarted" if args.prestarted else "")
                row = run_k(lab, k, plan, man_path, man, work, env, inputs, args.requests,
                            mode, args.torch_threads, args.timeout_s)
                row["pure_pred_s"] = first_response_s(plan)
                rows.append(row)
                print(f"  k={k}: TTFR {row['ttfr_s']:.2f}s (pulls {row['pull_s']}, ready "
                      f"{row['ready_s']}s), steady {row['steady_ms']:.1f} ms", flush=True)
                print_timeline(row)
        finally:
            if sender is not None:
                lab.stop(sender.proc)
            shutil.rmtree(work, ignore_errors=True)
    base = rows[0]
    overhead = base["ttfr_s"] - base["pure_pred_s"]
    ref = base["output"]
    for r in rows:
        r["ratio"] = r["ttfr_s"] / base["ttfr_s"]
        r["target_ratio"] = 1.2 / r["k"]
        r["target_met"] = r["ratio"] <= r["target_ratio"]
        r["cal_pred_s"] = r["pure_pred_s"] + overhead
        r["pred_ratio"] = r["cal_pred_s"] / base["cal_pred_s"]
        r["steady_vs_1"] = r["steady_ms"] / base["steady_ms"]
        r["allclose_vs_k1"] = bool(np.allclose(r["output"], ref, rtol=1e-4,
                                               atol=1e-5))
        r["max_abs_diff"] = float(np.max(np.abs(r["output"] - ref)))
        del r["output"]
    return rows


def print_real(rows: list[dict[str, Any]]) -> None:
    print("\nReal partitioned cold start (TTFR = start of pulls -> first response)")
    print(f"{'k':>2} {'TTFR s':>7} {'ratio':>6} {'1.2/k':>6} {'met':>4} {'pred pure':>9} "
          f"{'pred cal':>8} {'pred ratio':>10} {'steady ms':>9} {'vs k=1':>7} {'allclose':>8}")
    for r in rows:
        print(f"{r['k']:>2} {r['ttfr_s']:>7.2f} {r['ratio']:>6.3f} {r['target_ratio']:>6.3f} "
              f"{'yes' if r['target_met'] else 'no':>4} {r['pure_pred_s']:>9.2f} "
              f"{r['cal_pred_s']:>8.2f} {r['pred_ratio']:>10.3f} {r['steady_ms']:>9.1f} "
              f"{r['steady_vs_1']:>6.2f}x {str(r['allclose_vs_k1']):>8}")


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="real-run model (default bert-base; "
                    "--quick: bert-small)")
    ap.add_argument("--rate-mbit", type=float, default=None,
                    help="stage hosts' link cap (default 250; --quick: 50)")
    ap.add_argument("--requests", type=int, default=20, help="steady-latency requests")
    ap.add_argument("--models", default=None, help="analytical-table models, comma-separated")
    ap.add_argument("--quick", action="store_true", help="small models, short run")
    ap.add_argument("--no-real", action="store_true", help="analytical table only")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--exec-stage", action="store_true",
                      help="cold `python -m flashpoint.pipeline.stage` after each pull")
    mode.add_argument("--prestarted", action="store_true",
                      help="stage processes started and torch imported before t0")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads per stage (see the module docstring)")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="bound on every wait")
    ap.add_argument("--work-dir", default="/dev/shm")
    args = ap.parse_args()
    model = args.model or ("bert-small" if args.quick else "bert-base")
    args.rate_mbit = args.rate_mbit or (50.0 if args.quick else 250.0)
    models = (args.models.split(",") if args.models else
              (QUICK_MODELS if args.quick else MODELS))
    if model not in models:
        models.append(model)
    signal.signal(signal.SIGTERM, _sigterm)
    cost = CostModel(bandwidth_bps=args.rate_mbit * 1e6, link_bps=args.rate_mbit * 1e6)
    tmp = Path(tempfile.mkdtemp(prefix="fp-partition-store-", dir=args.work_dir))
    real: list[dict[str, Any]] = []
    try:
        store = LocalStore(tmp)
        print(f"publishing {models} with profile=True into {tmp}", flush=True)
        manifests = asyncio.run(publish_all(store, models))
        table = analytical(manifests, cost)
        print_analytical(table, args.rate_mbit)
        if not args.no_real:
            real = real_run(args, model, manifests[model], store, cost)
            print_real(real)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {"bench": "partition", "model": model, "rate_mbit": args.rate_mbit,
               "torch_threads": args.torch_threads,
               "exec_stage": args.exec_stage, "prestarted": args.prestarted,
               "analytical": table, "real": real,
               "target_met": all(r["target_met"] for r in real[1:]) if real else None}
    print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
