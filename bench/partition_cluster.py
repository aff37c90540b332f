"""Partitioned cold start through the whole system: controller, host managers, workers, S3.

`bench/partition.py` drives stage processes by hand; this one lets Flashpoint do it. A
:class:`~flashpoint.testing.netcluster.NetCluster` runs moto's S3 server, the controller and
``--hosts`` + 1 host managers as processes in network namespaces. Every stage host's link is
capped at ``--rate-mbit`` each way; the controller's cost model is told the same rate.

Where the bytes come from. The thesis's parallel part loads assume independent paths
(§4.1.2). Moto's S3 server cannot be one here: it re-reads the whole object for every ranged
GET and tops out near 25 MB/s on this 2-vCPU VM, below even one capped link, so every
transfer would measure moto. By default (``--source peer``) the model is therefore first
placed in the RAM of a well-connected peer, ``host0`` (uncapped link), by a seed function
whose replica also fills host0's only device; the measured function's GPUs are then all on
hosts that must fetch, and its stages pull their byte ranges from host0's RAM over their own
capped links (the thesis's LC+MC+MP). ``--source registry`` skips the seed and pulls from S3.

For k = 1, 2, 4 (one model version per k, so no stage host holds it): register a function
with ``max_stages = k`` and ``min_replicas = max_replicas = k`` — one scale-up by k GPUs, which
the controller plans (Eq 4.14 with x = 1), places one stage per host, links into a pipeline
and later dissolves into k whole replicas — then invoke it at once. Reported per k:

* **TTFR**: registration → first response (what a user of a scaled-from-zero function sees);
* **ready**: registration → the function first has somewhere to serve (its group linked
  into a pipeline, or for k = 1 its replica warm): the cold start without the first pass;
* **steady**: median latency of ``--requests`` sequential requests right after, counting only
  those the pipeline served (k > 1) — the pipelining penalty;
* **complete**: registration → every stage whole and the group dissolved;
* the plan the controller chose (stage layer ranges, from ``/v1/status``) and the analytical
  ``C + I(p)`` from the same profiles and cost model, raw and with the per-stage overhead
  calibrated from k = 1 (``measured(1) − C(1) − I(1)``).

Outputs of every k are checked allclose against the model run in this process.

    sudo .venv/bin/python bench/partition_cluster.py [--rate-mbit 250 --preset base] [--quick]

The last line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # partition_lab

import partition_lab as lab  # noqa: E402

from flashpoint.models import build, example_inputs, run_example  # noqa: E402
from flashpoint.models.sources import publish  # noqa: E402
from flashpoint.partition.model import CostModel, LayerProfile  # noqa: E402
from flashpoint.partition.table import plan_table  # noqa: E402
from flashpoint.registry import LocalStore  # noqa: E402
from flashpoint.testing.netcluster import NetCluster  # noqa: E402

MODEL = "bertp"
KS = (1, 2, 4)
CHUNK_BYTES = 4 << 20


def _body(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {n: {"data": a.ravel().tolist(), "shape": list(a.shape), "datatype": "INT64"}
            for n, a in arrays.items()}


HF_TEXT = "a cold start fetches the model bytes from a peer and the cluster scales to zero"


def _hf_reference(directory: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """transformers' logits for the request text, and the native body ``{"text": ...}``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    with torch.inference_mode():
        logits = model(**tok([HF_TEXT], return_tensors="pt")).logits.numpy()
    return logits, {"text": HF_TEXT}


def _logits(reply: dict[str, Any]) -> np.ndarray:
    out = reply["outputs"]["logits"]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


async def run_k(c: NetCluster, k: int, version: str, body: dict[str, Any],
                expected: np.ndarray, requests: int, seed: bool) -> dict[str, Any]:
    fn = f"part-k{k}"
    if seed:
        await lab.seed_peer(c, f"seed-k{k}", MODEL, version, timeout_s=300)
    t0 = time.monotonic()
    await c.deploy(fn, MODEL, model_version=version, max_stages=k, min_replicas=k,
                   max_replicas=k, keep_alive_s=600, timeout_s=300)
    ready: list[float] = []
    watcher = asyncio.ensure_future(lab.watch_ready(c, fn, t0, ready, polls=6000))
    assert c.session is not None
    # A slow link's whole-model cold start outlasts the cluster client's 30 s default.
    async with c.session.post(f"{c.url}/v1/functions/{fn}/invoke", json=body,
                              timeout=aiohttp.ClientTimeout(total=600)) as r:
        first = await r.json(content_type=None)
        assert r.status == 200, first
    ttfr = time.monotonic() - t0
    await asyncio.wait_for(watcher, 10)
    np.testing.assert_allclose(_logits(first), expected, rtol=1e-3, atol=1e-4)
    status = await c.status()
    reps = sorted((r for r in status["replicas"] if r["function"] == fn),
                  key=lambda r: (r.get("stage") or [0])[0])
    stages = [r.get("stage") for r in reps if r.get("group_id")]
    lat, by_pipeline = [], 0
    for _ in range(requests):
        t = time.monotonic()
        reply = await c.invoke_body(fn, body)
        dt = time.monotonic() - t
        np.testing.assert_allclose(_logits(reply), expected, rtol=1e-3, atol=1e-4)
        if k == 1 or reply["replica_id"] == first["replica_id"]:
            lat.append(dt)
            by_pipeline += k > 1

    await lab.wait_whole(c, fn, k, 300.0)
    done_s = time.monotonic() - t0
    await lab.remove(c, fn, (fn, f"seed-k{k}") if seed else (fn,))
    return {"k": k, "ttfr_s": ttfr, "ready_s": ready[0] if ready else None,
            "served_by": first["cold_start_source"],
            "stages": stages, "steady_ms": statistics.median(lat) * 1e3 if lat else None,
            "steady_samples": len(lat), "complete_s": done_s}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    lab.use_fake_aws()
    tmp = Path(tempfile.mkdtemp(prefix="fp-partition-cluster-"))
    store = LocalStore(tmp / "models")
    rate_bps = args.rate_mbit * 1e6
    cost = CostModel(rate_bps, rate_bps, args.overhead_s, 0.0005)
    manifests = {}
    hf_dir = None
    if args.hf:  # a Hugging Face BERT directory of the preset's shape, pushed as a user would
        from flashpoint.models.tiny_hf import make_text_classifier

        hf_dir = await asyncio.to_thread(make_text_classifier, tmp / "hf-bert", size=args.preset)
    for k in KS:
        t = time.monotonic()
        if hf_dir is not None:
            from flashpoint.models.sources import PushOptions, publish_source

            manifests[k] = await publish_source(store, MODEL, hf_dir, version=str(k),
                                                options=PushOptions(profile=True),
                                                chunk_size=CHUNK_BYTES)
        else:
            manifests[k] = await publish(store, "bert", args.preset, str(k), CHUNK_BYTES,
                                         model_name=MODEL, profile=True)
        print(lab.published_line(MODEL, str(k), args.preset, manifests[k], t), flush=True)
    if hf_dir is not None:
        expected, body = _hf_reference(hf_dir)
    else:
        module, config = build("bert", args.preset)
        arrays = example_inputs("bert", config, batch=1)
        expected = run_example(module, arrays).numpy()
        del module
        body = {"inputs": _body(arrays)}

    seed = args.source == "peer"
    c = await lab.start_cluster(tmp / "lab", args, model_bytes=manifests[1].blob_size,
                                timeout_s=300.0, peer=seed)
    rows = []
    try:
        for k in KS:
            await lab.publish_k(c, store, MODEL, manifests[k], str(k))
            row = await run_k(c, k, str(k), body, expected, args.requests, seed)
            rows.append(row)
            steady = f"{row['steady_ms']:.1f} ms" if row["steady_ms"] is not None else "-"
            print(f"  k={k}: TTFR {row['ttfr_s']:.2f}s via {row['served_by']}, steady "
                  f"{steady} ({row['steady_samples']} samples), whole after "
                  f"{row['complete_s']:.1f}s, stages {row['stages']}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            await c.aclose()
    # Analytical, from the same profiles and cost model the controller planned with.
    profiles = [LayerProfile.from_manifest(layer.name, layer.profile)
                for layer in manifests[1].layers]
    table = plan_table(profiles, cost, p_max=max(KS), x_max=8)
    base = rows[0]
    pred1 = table.lookup(1, 1)
    calib = base["ttfr_s"] - (pred1.terms.cold_s + pred1.terms.inference_s) + args.overhead_s
    for row in rows:
        plan = table.lookup(1, row["k"])
        pure = plan.terms.cold_s - args.overhead_s + plan.terms.inference_s
        row.update(plan_p=plan.p, plan_cuts=list(plan.cuts), predicted_pure_s=pure,
                   predicted_cal_s=pure + calib, ttfr_ratio=row["ttfr_s"] / base["ttfr_s"],
                   target_ratio=1.2 / row["k"],
                   ready_ratio=(row["ready_s"] / base["ready_s"]
                                if row["ready_s"] and base["ready_s"] else None),
                   steady_ratio=(row["steady_ms"] / base["steady_ms"]
                                 if row["steady_ms"] and base["steady_ms"] else None))
    return {"bench": "partition_cluster", "preset": args.preset, "hf": args.hf, "hosts": args.hosts,
            "span_mb": args.span_mb, "source": args.source,
            "rate_mbit": args.rate_mbit, "overhead_s": args.overhead_s,
            "model_mb": manifests[1].blob_size / 1e6, "calibrated_overhead_s": calib,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base")
    lab.add_lab_arguments(ap)
    ap.add_argument("--source", choices=("peer", "registry"), default="peer")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small model, fewer requests")
    ap.add_argument("--hf", action="store_true",
                    help="a Hugging Face BERT directory of the preset's shape, asked in text")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.requests = "small", 5
    lab.require_root("bench/partition_cluster.py")
    summary = asyncio.run(main_async(args))
    print(f"\nPartitioned cold start through the controller: {summary['preset']} "
          f"({summary['model_mb']:.1f} MB), {args.hosts} stage hosts, links "
          f"{args.rate_mbit:g} Mbit/s, bytes from the {args.source}")
    print(f"{'k':>2} {'TTFR s':>8} {'÷k=1':>6} {'target':>7} {'pred s':>7} {'ready s':>8} "
          f"{'÷k=1':>6} {'steady ms':>10} {'÷k=1':>6} {'whole s':>8}  stages")
    for r in summary["rows"]:
        steady = f"{r['steady_ms']:.1f}" if r["steady_ms"] else "-"
        ratio = f"{r['steady_ratio']:.2f}" if r["steady_ratio"] else "-"
        rdy = f"{r['ready_s']:.2f}" if r["ready_s"] else "-"
        rdy_ratio = f"{r['ready_ratio']:.3f}" if r["ready_ratio"] else "-"
        print(f"{r['k']:>2} {r['ttfr_s']:>8.2f} {r['ttfr_ratio']:>6.3f} {r['target_ratio']:>7.2f} "
              f"{r['predicted_cal_s']:>7.2f} {rdy:>8} {rdy_ratio:>6} {steady:>10} {ratio:>6} "
              f"{r['complete_s']:>8.1f}  {r['stages']}")
    print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
