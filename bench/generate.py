"""Text generation served by Flashpoint against ``transformers`` in process (issue 21 item 7).

A GPT-2-small-sized causal LM with random weights (12 layers, 768 hidden, 12 heads, 1,024
positions, GPT-2's 50,257-word vocabulary; a word-level tokenizer over that many words, so
the LM head costs what GPT-2's does) is built here once and cached under the temp dir,
pushed as ``flashpoint model push`` would, and served by a local cluster (one host, one
replica, continuous batching). Measured side by side in one run:

1. **tokens/s at 1, 8 and 32 concurrent streams** through the served path (the OpenAI
   route, ``stream: true``, server-sent events read by aiohttp) against one-at-a-time
   ``model.generate`` in this process (greedy, same prompts and ``max_tokens``; the same
   torch thread count as the worker). Target: ≥ 3× at 8 streams.
2. **TTFT** (client-side, request sent to first token event): warm (the replica up), and
   from host RAM (a scale from zero of a new function over the same model, whose bytes the
   host's cache holds: the replica's source is ``local``).
3. **TPOT** p50/p99 over the streams of each concurrency: ``(last − first token) / (n − 1)``.
4. **Migration gap** (issue 21 item 5), with ``--migration``: ``bench/migration.py``'s
   measurement, run after the rest (its own two-host cluster, a spot drain mid-stream, a
   small Llama-style model: one trial at 2 and at 16 streams); printed as each moved
   stream's gap against the destination's prefill + 2 TPOT, and its summary goes into the
   JSON line's ``migration``. ``python bench/migration.py`` runs it alone, with more trials.

    python bench/generate.py                  # GPT-2-small size, ~3-6 minutes on 2 vCPUs
    python bench/generate.py --quick          # tiny model, seconds (the smoke test's run)
    python bench/generate.py --streams 1,8 --max-tokens 16 --cold-rounds 1

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: completion_stream

from completion_stream import stream_completion  # noqa: E402

from flashpoint.config import load_config  # noqa: E402

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
              "vocab_size": 50257}
PROMPTS = ("the cluster scales", "a cold start fetches bytes from a peer", "gpus are shared",
           "a spot eviction drains", "the model is split into stages", "requests wait in a queue",
           "the host keeps models in memory", "the controller places replicas")


def build_gpt2_small(directory: Path) -> Path:
    """A GPT-2-small-sized random model and a word-level tokenizer of 50,257 words (the
    words of the prompts first, then fillers) in ``directory``; reused when present."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    if (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    words = sorted({w for p in PROMPTS for w in p.split()})
    vocab_words = special + words
    vocab_words += [f"w{i}" for i in range(GPT2_SMALL["vocab_size"] - len(vocab_words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab_words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", vocab_words.index("[CLS]"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   bos_token="[CLS]", eos_token="[SEP]")
    fast.save_pretrained(str(directory))
    torch.manual_seed(0)
    config = GPT2Config(**GPT2_SMALL, bos_token_id=fast.bos_token_id,
                        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    GPT2LMHeadModel(config).eval().save_pretrained(str(directory))
    return directory


def model_dir(quick: bool) -> Path:
    """The cached model directory (tiny for --quick, else GPT-2-small size)."""
    from flashpoint.models.tiny_hf import make_causal_lm

    tag = hashlib.sha256(json.dumps([quick, GPT2_SMALL, PROMPTS]).encode()).hexdigest()[:10]
    d = Path(tempfile.gettempdir()) / f"flashpoint-bench-generate-{tag}"
    if quick:
        return d if (d / "model.safetensors").is_file() else make_causal_lm(d, size="tiny")
    return build_gpt2_small(d)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (an observed value)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


class Baseline:
    """One-at-a-time greedy ``generate`` in this process (the model loaded once)."""

    def __init__(self, directory: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.tok = AutoTokenizer.from_pretrained(str(directory))
        self.model = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
        self.run([PROMPTS[0]], 2)  # warm-up: the first call pays for lazy set-up

    def run(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        """Tokens/s over ``prompts``, one after another, ``max_tokens`` new tokens each."""
        import torch

        ids = [torch.tensor([self.tok(p).input_ids]) for p in prompts]
        with torch.inference_mode():
            tokens, t0 = 0, time.perf_counter()
            for x in ids:
                out = self.model.generate(x, max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False,
                                          pad_token_id=self.tok.pad_token_id)
                tokens += out.shape[1] - x.shape[1]
            wall = time.perf_counter() - t0
        return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def stream_one(session: Any, url: str, fn: str, prompt: str,
                     max_tokens: int) -> dict[str, Any]:
    """One streamed completion over the OpenAI route; client-side times."""
    t0 = time.perf_counter()
    out = await stream_completion(session, url, fn, prompt, max_tokens)
    return {"ttft_s": (out.first or t0) - t0, "n": out.tokens,
            "done_s": time.perf_counter() - t0, "tpot_s": out.tpot()}


async def concurrent(session: Any, url: str, fn: str, streams: int, max_tokens: int,
                     rounds: int) -> dict[str, Any]:
    """``streams`` streams at once, ``rounds`` times: aggregate tokens/s, TTFT and TPOT."""
    tokens, wall, ttfts, tpots = 0, 0.0, [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        res = await asyncio.gather(*(stream_one(session, url, fn, PROMPTS[i % len(PROMPTS)],
                                                max_tokens) for i in range(streams)))
        wall += time.perf_counter() - t0
        tokens += sum(r["n"] for r in res)
        ttfts += [r["ttft_s"] for r in res]
        tpots += [r["tpot_s"] for r in res if r["tpot_s"] is not None]
    return {"streams": streams, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": pct(ttfts, 50) * 1e3, "ttft_p99_ms": pct(ttfts, 99) * 1e3,
            "tpot_p50_ms": pct(tpots, 50) * 1e3, "tpot_p99_ms": pct(tpots, 99) * 1e3}


async def served(directory: Path, args: argparse.Namespace, base: Baseline) -> dict[str, Any]:
    import aiohttp

    from flashpoint.cluster import LocalCluster
    from flashpoint.models.sources import publish_source
    from flashpoint.registry import make_store

    home = Path(tempfile.mkdtemp(prefix="flashpoint-bench-generate-"))
    cfg = load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "loop_interval_s": 0.05},
        "host": {"cpu_devices": 2, "warm_pool_size": 1, "torch_threads": args.threads,
                 "device_memory_bytes": 8 << 30, "cache_dir": str(home / "cache")},
    }).with_home(home)
    store = make_store(cfg)
    t0 = time.perf_counter()
    manifest = await publish_source(store, "lm", directory)
    push_s = time.perf_counter() - t0
    out: dict[str, Any] = {"model_bytes": manifest.blob_size, "push_s": push_s}
    spec = {"max_batch_size": max(args.streams), "replica_concurrency": max(args.streams),
            "max_replicas": 1, "keep_alive_s": 600}
    async with LocalCluster(cfg, hosts=1, store=store) as cluster:
        url = cluster.controller.url
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async def register(name: str) -> None:
                async with s.post(f"{url}/v1/functions", json={"name": name, "model": "lm",
                                                               **spec}) as r:
                    assert r.status in (200, 201), await r.text()

            async def source_of(name: str) -> str:
                async with s.get(f"{url}/v1/status") as r:
                    status = await r.json()
                return ",".join(x.get("source") or "-" for x in status["replicas"]
                                if x["function"] == name)

            # the first start comes from the registry and leaves the bytes in host RAM
            await register("gen")
            first = await stream_one(s, url, "gen", PROMPTS[0], args.max_tokens)
            out["ttft_registry_ms"] = first["ttft_s"] * 1e3
            warm = [await stream_one(s, url, "gen", PROMPTS[i % len(PROMPTS)], 4)
                    for i in range(args.warm_samples)]
            out["ttft_warm_ms"] = [w["ttft_s"] * 1e3 for w in warm]
            # scale from zero out of host RAM: a new function over the same model each round
            cold, sources = [], []
            for i in range(args.cold_rounds):
                name = f"cold-{i}"
                # a user's new function finds a warm worker waiting (the pool refills after
                # each start): time the start, not a Python + torch spawn
                await asyncio.gather(*(h.wait_pool_ready(120) for h in cluster.hosts))
                await register(name)
                r = await stream_one(s, url, name, PROMPTS[0], 4)
                cold.append(r["ttft_s"] * 1e3)
                sources.append(await source_of(name))
                async with s.delete(f"{url}/v1/functions/{name}") as resp:
                    assert resp.status in (200, 204), await resp.text()
                for _ in range(200):  # bounded: its replica leaves the device
                    if not await source_of(name):
                        break
                    await asyncio.sleep(0.05)
            out["ttft_ram_ms"], out["ram_sources"] = cold, sources
            # each level right after its own baseline run (the cluster idle meanwhile): on a
            # shared machine the load drifts, and the ratio should compare like with like
            out["levels"] = []
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.baseline_prompts)]
            for n in args.streams:
                b = await asyncio.to_thread(base.run, prompts, args.max_tokens)
                level = await concurrent(s, url, "gen", n, args.max_tokens, args.rounds)
                level["baseline_tokens_per_s"] = b["tokens_per_s"]
                level["ratio"] = level["tokens_per_s"] / b["tokens_per_s"]
                out["levels"].append(level)
    shutil.rmtree(home, ignore_errors=True)  # its registry and cache copies of the model
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 and 2 streams")
    ap.add_argument("--streams", default="1,8,32", help="concurrency levels, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="repeats of each concurrency level")
    ap.add_argument("--baseline-prompts", type=int, default=4,
                    help="generate calls in each level's baseline run")
    ap.add_argument("--cold-rounds", type=int, default=3)
    ap.add_argument("--warm-samples", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads, for the worker and the in-process baseline alike")
    ap.add_argument("--migration", action="store_true",
                    help="also measure the migration gap (bench/migration.py, one trial)")
    args = ap.parse_args()
    if args.quick:
        args.streams, args.max_tokens, args.rounds = "1,2", 6, 1
        args.baseline_prompts, args.cold_rounds, args.warm_samples = 2, 1, 2
    args.streams = [int(x) for x in str(args.streams).split(",")]
    os.environ.setdefault("FLASHPOINT_PRELOAD_TRANSFORMERS", "1")
    t_build = time.perf_counter()
    directory = model_dir(args.quick)
    build_s = time.perf_counter() - t_build
    base = Baseline(directory, args.threads)
    srv = asyncio.run(served(directory, args, base))
    gap = None
    if args.migration:  # its own clusters, one after another: after this one has stopped
        from migration import run as run_migration  # bench/migration.py, beside this file

        gap = run_migration(["--streams", "2", "16", "--trials", "1"])
    rows = srv["levels"]
    print(f"\nText generation: {'tiny' if args.quick else 'GPT-2-small-sized'} random model "
          f"({srv['model_bytes'] / 1e6:.0f} MB), max_tokens {args.max_tokens}, "
          f"{args.threads} torch threads, {platform.machine()} {os.cpu_count()} vCPU")
    print("baseline: one-at-a-time generate in process, run just before each level\n")
    header = ["streams", "served tok/s", "generate tok/s", "ratio vs generate", "TTFT p50 ms",
              "TTFT p99 ms",
              "TPOT p50 ms", "TPOT p99 ms"]
    print(" | ".join(header))
    for lv in rows:
        print(" | ".join([str(lv["streams"]), f"{lv['tokens_per_s']:.1f}",
                          f"{lv['baseline_tokens_per_s']:.1f}", f"{lv['ratio']:.2f}x",
                          f"{lv['ttft_p50_ms']:.1f}", f"{lv['ttft_p99_ms']:.1f}",
                          f"{lv['tpot_p50_ms']:.1f}", f"{lv['tpot_p99_ms']:.1f}"]))
    warm = srv["ttft_warm_ms"]
    print(f"\nTTFT warm (1 stream): median {statistics.median(warm):.1f} ms over {len(warm)}")
    print(f"TTFT from host RAM (scale from zero, source {srv['ram_sources']}): "
          f"median {statistics.median(srv['ttft_ram_ms']):.1f} ms "
          f"({', '.join(f'{x:.0f}' for x in srv['ttft_ram_ms'])})")
    print(f"TTFT from the registry (first start): {srv['ttft_registry_ms']:.1f} ms")
    for key, m in (gap or {}).items():
        if key.startswith("streams_"):
            print(f"migration gap, {key.split('_')[1]} streams: p50 {m['gap_ms_p50']:.1f} ms, "
                  f"max {m['gap_ms_max']:.1f} ms; target gap <= prefill + 2 TPOT met by "
                  f"{m['met']} of {m['moved']} moved")
    eight = next((lv for lv in rows if lv["streams"] == 8), None)
    if eight is not None:
        print(f"target >= 3x at 8 streams: {'met' if eight['ratio'] >= 3 else 'NOT met'} "
              f"({eight['ratio']:.2f}x)")
    print(json.dumps({"bench": "generate", "quick": args.quick, "max_tokens": args.max_tokens,
                      "threads": args.threads, "build_s": build_s,
                      "levels": rows, "ttft_warm_ms": warm, "ttft_ram_ms": srv["ttft_ram_ms"],
                      "ram_sources": srv["ram_sources"],
                      "ttft_registry_ms": srv["ttft_registry_ms"],
                      "model_bytes": srv["model_bytes"], "migration": gap}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
