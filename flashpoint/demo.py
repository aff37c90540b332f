"""``flashpoint demo``: a whole serving story on this machine, printed as tables.

Starts a local cluster on embedded defaults (a fresh state directory), publishes built-in
models, registers functions over the HTTP API, sends a first request (a scale from zero),
then a burst, and prints real model outputs, the cold-start breakdown and latency
percentiles. Then a partitioned cold start (a profiled model split over two hosts, served
as a pipeline, completed into whole replicas), a Hugging Face text classifier and a
causal language model built here (the latter streams a short generation over the
OpenAI-compatible route after a scale from zero, its tokens printed as they arrive), and a
scale-out that shows every source of model bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from flashpoint.config import ClusterConfig


def example_request(io_inputs: list[dict[str, Any]], batch: int, seed: int) -> dict[str, Any]:
    """Native-API inputs for a signature: small ids for integer inputs, noise for floats."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in io_inputs:
        shape = [batch] + [16 if s < 0 else s for s in t["shape"][1:]]
        if t["datatype"].startswith("INT"):
            data = rng.integers(1, 100, size=shape).ravel().tolist()
        else:
            data = rng.standard_normal(size=shape).astype(np.float32).ravel().tolist()
        out[t["name"]] = {"data": data, "shape": shape, "datatype": t["datatype"]}
    return out


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    body = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


async def run_demo(cfg: ClusterConfig, *, hosts: int, preset: str, requests: int,
                   concurrency: int) -> int:
    from flashpoint.cluster import LocalCluster
    from flashpoint.models.sources import publish
    from flashpoint.registry import make_store

    home = Path(tempfile.mkdtemp(prefix="flashpoint-demo-"))
    cfg = cfg.with_home(home)
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(cfg.controller, listen_port=0))
    store = make_store(cfg)
    models = [("bert", preset), ("resnet", "tiny")]
    print(f"flashpoint demo: state in {home}")
    for kind, pre in models:
        t0 = time.perf_counter()
        m = await publish(store, kind, preset=pre, version="1", model_name=kind)
        print(f"  pushed {kind} ({pre}): {m.blob_size / 1e6:.1f} MB, {len(m.layers)} layers, "
              f"{time.perf_counter() - t0:.2f}s")
    # Size each CPU device to hold one bert replica, so the scale-out at the end has to
    # cross hosts and shows all three sources (registry, own RAM, a peer's RAM).
    bert_bytes = (await store.get_manifest("bert", "1")).blob_size
    cfg = dataclasses.replace(cfg, host=dataclasses.replace(
        cfg.host, device_memory_bytes=bert_bytes * 3 // 2 + cfg.controller.replica_overhead_bytes))
    async with LocalCluster(cfg, hosts=hosts, store=store) as cluster:
        url = cluster.controller.url
        print(f"  cluster up: controller {url}, {hosts} host(s)")
        cold_rows, lat_rows = [], []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            for kind, _ in models:
                fn = f"{kind}-fn"
                async with s.post(f"{url}/v1/functions", json={
                    "name": fn, "model": kind, "max_batch_size": 8, "keep_alive_s": 60,
                }) as r:
                    info = await r.json()
                    assert r.status == 201, info
                io = [t for t in info["spec"]["inputs"]]
                t0 = time.perf_counter()
                async with s.post(f"{url}/v1/functions/{fn}/invoke",
                                  json={"inputs": example_request(io, 1, 0)}) as r:
                    first = await r.json()
                    assert r.status == 200, first
                wall = time.perf_counter() - t0
                tm = first["timings_s"]
                cold_rows.append([fn, f"{tm.get('fetch', 0) * 1e3:.1f}", f"{tm.get('load', 0) * 1e3:.1f}",
                                  f"{tm.get('to_device', 0) * 1e3:.1f}",
                                  f"{tm.get('first_inference', 0) * 1e3:.1f}",
                                  f"{wall * 1e3:.1f}", first.get("cold_start_source") or "-"])
                out_name, out = next(iter(first["outputs"].items()))
                print(f"  {fn} first response ({'cold' if first['cold'] else 'warm'}): "
                      f"{out_name} shape={out['shape']} values={np.round(out['data'][:4], 4).tolist()}")
                sem = asyncio.Semaphore(concurrency)
                samples: list[float] = []
                errors = 0

                async def one(i: int, fn: str = fn, io: list = io, sem: asyncio.Semaphore = sem,
                              samples: list[float] = samples) -> None:
                    nonlocal errors
                    async with sem:
                        t = time.perf_counter()
                        async with s.post(f"{url}/v1/functions/{fn}/invoke",
                                          json={"inputs": example_request(io, 1, i)}) as r:
                            await r.read()
                            if r.status != 200:
                                errors += 1
                                return
                        samples.append(time.perf_counter() - t)

                t0 = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(requests)))
                elapsed = time.perf_counter() - t0
                pc = percentiles(samples) if samples else {"p50_ms": 0, "p90_ms": 0, "p99_ms": 0}
                lat_rows.append([fn, str(len(samples)), str(errors), f"{len(samples) / elapsed:.1f}",
                                 f"{pc['p50_ms']:.2f}", f"{pc['p90_ms']:.2f}", f"{pc['p99_ms']:.2f}"])
            part_lines = await _partitioned_cold_start(s, url, store, preset)
            # The partitioned start took warm workers; a user's first request to a new model
            # would find the pool full again, so wait for that rather than time a spawn.
            await asyncio.gather(*(h.wait_pool_ready(60) for h in cluster.hosts))
            hf_lines = await _hugging_face_text(s, url, store, home)
            print("\nA causal language model (built here, pushed, scaled from zero), streamed:")
            gen_lines = await stream_generation(s, url, store, home)
            # Scale bert-fn out to every device: the new replicas show the sourcing hierarchy
            # (own RAM on the host that has the model, a chain from it for the other host).
            want = hosts * cfg.host.cpu_devices - 1  # one device holds resnet-fn
            async with s.post(f"{url}/v1/functions", json={
                "name": "bert-fn", "model": "bert", "max_batch_size": 8, "keep_alive_s": 60,
                "min_replicas": want,
            }) as r:
                assert r.status in (200, 201), await r.text()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                async with s.get(f"{url}/v1/status") as r:
                    status = await r.json()
                if sum(x["function"] == "bert-fn" and x["phase"] == "warm"
                       for x in status["replicas"]) >= want:
                    break
                await asyncio.sleep(0.2)
        print("\nCold start (scale from zero), ms:")
        print(_table(cold_rows, ["function", "fetch", "load", "to_device", "first_infer",
                                 "request_to_response", "source"]))
        print(f"\nBurst of {requests} requests at concurrency {concurrency}:")
        print(_table(lat_rows, ["function", "ok", "errors", "req/s", "p50_ms", "p90_ms", "p99_ms"]))
        print("\nReplicas and where each cold start got its model bytes "
              "(local = own RAM, chain:<host> = a peer's RAM over a TCP chain, registry):")
        print(_table([[r["replica_id"], r["host_id"], r["phase"], r.get("source") or "-"]
                      for r in status["replicas"]], ["replica", "host", "phase", "source"]))
        print("\nPartitioned cold start (bert v2, profiled; at most 2 stages, 2 GPUs wanted):")
        print("\n".join(part_lines))
        print("\nA Hugging Face text classifier (a directory built here, pushed as a user would):")
        print("\n".join(hf_lines))
        print("\nThe streamed generation (OpenAI /v1/completions, stream: true):")
        print("\n".join(gen_lines))
    return 0 if all(r[2] == "0" for r in lat_rows) else 1


async def _partitioned_cold_start(s: aiohttp.ClientSession, url: str, store: Any,
                                  preset: str) -> list[str]:
    """Register a function over a profiled model that no host holds, wanting two replicas:
    the controller plans the scale-up (thesis Eq 4.14) and, where the plan splits the
    model, starts one stage per host, serves them as a pipeline, and dissolves the group
    once both hosts hold the whole model. Returns the lines to print; deletes the function
    after, so the scale-out that follows has the devices."""
    from flashpoint.models.sources import publish

    m = await publish(store, "bert", preset=preset, version="2", model_name="bert", profile=True)
    lines = [f"  pushed bert v2 with per-layer profiles ({len(m.layers)} layers)"]
    async with s.post(f"{url}/v1/functions", json={
        "name": "bert-part", "model": "bert", "model_version": "2", "max_stages": 2,
        "min_replicas": 2, "max_replicas": 2, "keep_alive_s": 60,
    }) as r:
        info = await r.json()
        assert r.status == 201, info
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/functions/bert-part/invoke",
                      json={"inputs": example_request(info["spec"]["inputs"], 1, 0)}) as r:
        first = await r.json()
        assert r.status == 200, first
    lines.append(f"  first response after {(time.perf_counter() - t0) * 1e3:.1f} ms, served by "
                 f"{first['replica_id']} (source: {first.get('cold_start_source') or '-'})")
    async with s.get(f"{url}/v1/status") as r:
        status = await r.json()
    stages = [x for x in status["replicas"] if x["function"] == "bert-part"]
    rows = [[x["replica_id"], x["host_id"], str(x.get("stage") or "whole"),
             x.get("group_id") or "-", x["phase"]] for x in stages]
    lines.append(_table(rows, ["replica", "host", "layers", "group", "phase"]))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        async with s.get(f"{url}/v1/status") as r:
            status = await r.json()
        mine = [x for x in status["replicas"] if x["function"] == "bert-part"]
        if not any(g["function"] == "bert-part" for g in status["groups"]) \
                and mine and all(x["phase"] == "warm" for x in mine):
            lines.append(f"  completed: {len(mine)} whole replicas, group dissolved, "
                         f"{(time.perf_counter() - t0):.1f} s after the first request")
            break
        await asyncio.sleep(0.2)
    else:
        lines.append("  the group did not complete within 120 s")
    async with s.delete(f"{url}/v1/functions/bert-part") as r:
        assert r.status in (200, 204), await r.text()
    return lines


async def _hugging_face_text(s: aiohttp.ClientSession, url: str, store: Any,
                             home: Path) -> list[str]:
    """Build a small random-weight BERT classifier directory (config.json, safetensors,
    tokenizer), push it through the same pipeline as ``flashpoint model push``, deploy it
    and send it text; returns the lines to print."""
    from flashpoint.models.sources import publish_source
    from flashpoint.models.tiny_hf import make_text_classifier

    directory = await asyncio.to_thread(make_text_classifier, home / "sentiment-model")
    t0 = time.perf_counter()
    m = await publish_source(store, "sentiment", directory)
    lines = [f"  pushed sentiment from {directory}: {m.blob_size / 1e6:.2f} MB, task {m.task}, "
             f"files {sorted(m.files)}, {time.perf_counter() - t0:.2f}s"]
    async with s.post(f"{url}/v1/functions", json={
            "name": "sentiment-fn", "model": "sentiment", "keep_alive_s": 60}) as r:
        assert r.status == 201, await r.text()
    texts = ["this movie was great", "the food was terrible and the service slow"]
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/functions/sentiment-fn/invoke", json={"text": texts}) as r:
        body = await r.json()
        assert r.status == 200, body
    wall = time.perf_counter() - t0
    labels = body["outputs"]["label"]
    scores = body["outputs"]["score"]
    k = labels["shape"][1]
    for i, text in enumerate(texts):
        best, score = labels["data"][i * k], scores["data"][i * k]
        lines.append(f"  {text!r:48} -> {best} ({score:.3f})")
    lines.append(f"  first response ({'cold' if body['cold'] else 'warm'}, from "
                 f"{body.get('cold_start_source') or '-'}) after {wall * 1e3:.1f} ms ("
                 + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in body["timings_s"].items()
                             if k in ("fetch", "load", "first_inference", "total"))
                 + " ms); the weights are random, so the labels are too")
    async with s.delete(f"{url}/v1/functions/sentiment-fn") as r:  # its device for the scale-out
        assert r.status in (200, 204), await r.text()
    return lines


GENERATION_PROMPT = "the cluster scales"


async def stream_generation(s: aiohttp.ClientSession, url: str, store: Any, home: Path, *,
                            max_tokens: int = 12, delete: bool = True) -> list[str]:
    """Build a tiny random-weight GPT-2 directory (``tiny_hf.make_causal_lm``), push it,
    deploy it (no replica yet) and stream a greedy completion over the OpenAI route
    (``stream: true``): the first token waits for the scale from zero; each token is
    printed as its event arrives. Returns the lines to print after; deletes the function
    (its device goes to the scale-out) unless ``delete`` is False."""
    import json

    from flashpoint.models.sources import publish_source
    from flashpoint.models.tiny_hf import make_causal_lm

    directory = await asyncio.to_thread(make_causal_lm, home / "tiny-gpt2", family="gpt2")
    m = await publish_source(store, "tiny-gpt2", directory)
    async with s.post(f"{url}/v1/functions", json={
            "name": "gpt2-fn", "model": "tiny-gpt2", "keep_alive_s": 60}) as r:
        assert r.status == 201, await r.text()
    body = {"model": "gpt2-fn", "prompt": GENERATION_PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first_s = None
    usage: dict[str, int] = {}
    pieces: list[str] = []
    print(f"  {GENERATION_PROMPT} ->", end="", flush=True)
    async with s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first_s = first_s if first_s is not None else time.perf_counter() - t0
                    pieces.append(choice["text"])
                    print(choice["text"], end="", flush=True)  # as it arrives
            usage = event.get("usage") or usage
    wall = time.perf_counter() - t0
    print(flush=True)
    n = int(usage.get("completion_tokens", 0))
    lines = [f"  pushed tiny-gpt2 ({m.blob_size / 1e3:.0f} kB, task {m.task}); "
             f"{GENERATION_PROMPT!r} -> {''.join(pieces)!r}",
             f"  {n} tokens (prompt {usage.get('prompt_tokens', 0)}); first token after "
             f"{(first_s or 0) * 1e3:.0f} ms (a scale from zero), all after {wall * 1e3:.0f} ms;"
             " random weights, so the words are too"]
    if delete:
        async with s.delete(f"{url}/v1/functions/gpt2-fn") as r:
            assert r.status in (200, 204), await r.text()
    return lines
