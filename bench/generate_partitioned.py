"""Partitioned cold start for generation (issue 21 item 6): TTFT at k = 1, 2, 4 stages.

A :class:`~flashpoint.testing.netcluster.NetCluster` runs moto's S3 server, the controller
and ``--hosts`` + 1 host managers as processes in network namespaces; every stage host's link
is capped at ``--rate-mbit`` each way (tc), and the controller's cost model is told the same
rate. As in ``bench/partition_cluster.py`` the model is first placed in the RAM of a
well-connected peer, ``host0`` (uncapped), by a seed function whose replica fills host0's
only device (moto's server is slower than one capped link); the measured function's GPUs are
all on hosts that must fetch, over their own capped links.

The model is a GPT-2 causal LM (``tiny_hf.make_causal_lm``, ``--preset``'s shape, random
weights, pushed with ``--profile``). For k = 1, 2, 4 (one model version per k, so no stage
host holds it): register a function with ``max_stages = k`` and ``min_replicas =
max_replicas = k`` and at once stream one greedy completion over the OpenAI route. With
k > 1 its first tokens come from the pipeline of stages (each token step recomputes the
sequence through every stage: no KV cache in the pipeline), and once the stages are whole
replicas the sequence moves to one of them (live migration). Reported per k:

* **TTFT**: registration → the first streamed token (what a user of a scaled-from-zero
  generation function sees);
* **ready**: registration → the function first has somewhere to serve (its group linked,
  or for k = 1 its replica warm);
* **pipeline tokens**: tokens streamed before the sequence moved (``migrations`` from the
  controller's ``flashpoint_migrations_total``; 0 moves: every token came from where it began);
* **TPOT**: the stream's mean time per output token after the first;
* **whole**: registration → every stage whole and the group dissolved.

The streamed text is checked against ``transformers``' greedy ``generate`` in this process.

    sudo .venv/bin/python bench/generate_partitioned.py [--rate-mbit 250 --preset base] [--quick]

The last line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # completion_stream, partition_lab

import partition_lab as lab  # noqa: E402
from completion_stream import stream_completion  # noqa: E402

from flashpoint.models.sources import PushOptions, publish_source  # noqa: E402
from flashpoint.models.tiny_hf import make_causal_lm  # noqa: E402
from flashpoint.registry import LocalStore  # noqa: E402
from flashpoint.testing.netcluster import NetCluster  # noqa: E402

MODEL = "gptp"
KS = (1, 2, 4)
CHUNK_BYTES = 4 << 20
PROMPT = "a spot eviction drains the host"


def _reference(directory: Path, max_tokens: int) -> str:
    """transformers' greedy continuation of PROMPT, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    ids = tok(PROMPT).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    return tok.decode(out, skip_special_tokens=True)


async def _migrations(c: NetCluster) -> float:
    """The controller's flashpoint_migrations_total, all causes."""
    assert c.session is not None
    async with c.session.get(f"{c.url}/metrics") as r:
        text = await r.text()
    return sum(float(m.group(1)) for m in re.finditer(
        r"^flashpoint_migrations_total\{[^}]*\} (\S+)$", text, re.M))


async def _stream(c: NetCluster, fn: str, max_tokens: int, t0: float) -> dict[str, Any]:
    """One streamed greedy completion; times from ``t0`` (registration)."""
    assert c.session is not None
    out = await stream_completion(c.session, c.url, fn, PROMPT, max_tokens,
                                  clock=time.monotonic,
                                  timeout=aiohttp.ClientTimeout(total=900))
    tpot = out.tpot()
    return {"ttft_s": (out.first or t0) - t0, "text": out.text, "tokens": out.tokens,
            "tpot_ms": tpot * 1e3 if tpot is not None else None,
            "done_s": time.monotonic() - t0}


async def run_k(c: NetCluster, k: int, version: str, max_tokens: int,
                expected: str) -> dict[str, Any]:
    fn = f"genpart-k{k}"
    await lab.seed_peer(c, f"seed-k{k}", MODEL, version, timeout_s=600)
    moved_before = await _migrations(c)
    t0 = time.monotonic()
    await c.deploy(fn, MODEL, model_version=version, max_stages=k, min_replicas=k,
                   max_replicas=k, keep_alive_s=600, timeout_s=600)
    ready: list[float] = []
    groups_seen: list[int] = []
    watcher = asyncio.ensure_future(lab.watch_ready(c, fn, t0, ready, polls=12000,
                                                    stages_seen=groups_seen))
    out = await _stream(c, fn, max_tokens, t0)
    await asyncio.wait_for(watcher, 10)
    if out["text"] != expected:
        raise AssertionError(f"k={k}: streamed text differs from transformers' greedy "
                             f"generate:\n{out['text']!r}\n{expected!r}")
    moved = await _migrations(c) - moved_before
    await lab.wait_whole(c, fn, k, 600.0)
    whole_s = time.monotonic() - t0
    await lab.remove(c, fn, (fn, f"seed-k{k}"))
    return {"k": k, "ttft_s": out["ttft_s"], "ready_s": ready[0] if ready else None,
            "tokens": out["tokens"], "tpot_ms": out["tpot_ms"], "done_s": out["done_s"],
            "migrations": moved, "stages_seen": max(groups_seen, default=0),
            "whole_s": whole_s}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    lab.use_fake_aws()
    tmp = Path(tempfile.mkdtemp(prefix="fp-generate-partitioned-"))
    store = LocalStore(tmp / "models")
    source = await asyncio.to_thread(make_causal_lm, tmp / "gpt2", family="gpt2",
                                     size=args.preset, seed=2)
    manifests = {}
    for k in KS:
        t = time.monotonic()
        manifests[k] = await publish_source(store, MODEL, source, version=str(k),
                                            options=PushOptions(profile=True),
                                            chunk_size=CHUNK_BYTES)
        print(lab.published_line(MODEL, str(k), args.preset, manifests[k], t), flush=True)
    expected = await asyncio.to_thread(_reference, source, args.max_tokens)
    c = await lab.start_cluster(tmp / "lab", args, model_bytes=manifests[1].blob_size,
                                timeout_s=600.0, peer=True)
    rows = []
    try:
        for k in KS:
            await lab.publish_k(c, store, MODEL, manifests[k], str(k))
            row = await run_k(c, k, str(k), args.max_tokens, expected)
            rows.append(row)
            print(f"  k={k}: TTFT {row['ttft_s']:.2f}s (ready {row['ready_s']:.2f}s), "
                  f"{row['tokens']} tokens, TPOT {row['tpot_ms'] or 0:.1f} ms, moved "
                  f"{row['migrations']:g}x, whole after {row['whole_s']:.1f}s", flush=True)
    finally:
        with contextlib.suppress(Exception):
            await c.aclose()
    base = rows[0]
    for row in rows:
        row["ttft_ratio"] = row["ttft_s"] / base["ttft_s"]
    return {"bench": "generate_partitioned", "preset": args.preset, "hosts": args.hosts,
            "rate_mbit": args.rate_mbit, "overhead_s": args.overhead_s,
            "max_tokens": args.max_tokens, "model_mb": manifests[1].blob_size / 1e6,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base", help="tiny_hf size: tiny, small, base")
    lab.add_lab_arguments(ap)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="the small model, 16 tokens")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.max_tokens = "small", 16
    lab.require_root("bench/generate_partitioned.py")
    summary = asyncio.run(main_async(args))
    print(f"\nPartitioned cold start of a generation: GPT-2 {summary['preset']} "
          f"({summary['model_mb']:.1f} MB), {args.hosts} stage hosts, links "
          f"{args.rate_mbit:g} Mbit/s, bytes from a peer's RAM")
    print(f"{'k':>2} {'TTFT s':>8} {'÷k=1':>6} {'ready s':>8} {'tokens':>7} {'moved':>6} "
          f"{'TPOT ms':>8} {'whole s':>8}")
    for r in summary["rows"]:
        print(f"{r['k']:>2} {r['ttft_s']:>8.2f} {r['ttft_ratio']:>6.3f} "
              f"{r['ready_s'] or 0:>8.2f} {r['tokens']:>7} {r['migrations']:>6g} "
              f"{r['tpot_ms'] or 0:>8.1f} {r['whole_s']:>8.1f}")
    print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
