"""Models users bring (issue 18, item 11), measured side by side in one run.

1. Scale from zero out of host RAM: a random-weight Hugging Face BERT-base directory
   (``*ForSequenceClassification``, 30,522-word vocabulary, ~438 MB) pushed with
   ``publish_source``, against the built-in ``bert`` base (~438 MB), on one host. Both
   first cold-start once from the registry (which leaves the bytes in the host's RAM
   cache); then rounds alternate the two, each a scale from zero sourced from ``local``.
   Target: HF ÷ built-in ≤ 1.2 (median of the rounds' ratios).
2. What text and images cost per request, in the worker's own code (no network):
   ``Serving.prepare`` (tokenize; decode + preprocess) and ``finish`` (labels), for one
   input and for 64 in one request.
3. Warm invoke over the native HTTP API at concurrency 1 and 64: a tiny HF text model
   asked in text against the tiny built-in BERT given token ids of the same length, so the
   difference is what tokenizing and labelling cost end to end.

    python bench/hf_models.py [--rounds 5] [--requests 2000]

Prints tables and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashpoint.config import load_config  # noqa: E402

TEXT = "a cold start fetches the model bytes from a peer and the cluster scales to zero"


async def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def cold_from_ram(rounds: int, home: Path) -> dict[str, Any]:
    from flashpoint.cluster import LocalCluster
    from flashpoint.models.sources import publish, publish_source
    from flashpoint.models.tiny_hf import make_text_classifier
    from flashpoint.registry.local import LocalStore
    from flashpoint.spec import FunctionSpec

    os.environ["FLASHPOINT_PRELOAD_TRANSFORMERS"] = "1"  # as deployed: idle workers import it
    store = LocalStore(home / "registry")
    hf_dir = await asyncio.to_thread(make_text_classifier, home / "hf-bert-base", size="base")
    t0 = time.perf_counter()
    hf = await publish_source(store, "hfbert", hf_dir)
    hf_push_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    zb = await publish(store, "bert", "base", "1", model_name="zbert")
    zoo_push_s = time.perf_counter() - t0
    print(f"pushed hf bert-base {hf.blob_size / 1e6:.1f} MB in {hf_push_s:.1f}s; built-in bert "
          f"base {zb.blob_size / 1e6:.1f} MB in {zoo_push_s:.1f}s", flush=True)
    size = max(hf.blob_size, zb.blob_size)
    cfg = load_config(overrides={
        "controller": {"listen_port": 0}, "log_level": "WARNING",
        "host": {"cpu_devices": 1, "warm_pool_size": 1,
                 "device_memory_bytes": int(size * 1.5) + (100 << 20),
                 "cache_bytes": 3 * size, "host_memory_bytes": 8 * size},
    }).with_home(home)
    ids = np.arange(1, 17, dtype=np.int64).reshape(1, 16)  # 16 tokens, as TEXT tokenizes to
    text = np.array([TEXT.encode()], dtype=object)
    rows: list[dict[str, Any]] = []
    async with LocalCluster(cfg, hosts=1, store=store) as cluster:
        ctl = cluster.controller

        async def cold(fn: str, inputs: dict[str, np.ndarray], label: str) -> dict[str, Any]:
            await _until(lambda: not ctl.state.replicas_of(fn), 120, f"{fn} scaled to zero")
            await asyncio.gather(*(h.wait_pool_ready(120) for h in cluster.hosts))
            await asyncio.sleep(0.5)  # refilled workers settle (no CPU stolen)
            t = time.perf_counter()
            res = await ctl.invoke(fn, inputs, request_id=f"{label}-{len(rows)}", timeout_s=600)
            wall = time.perf_counter() - t
            assert res.cold, "expected a scale from zero"
            row = {"model": label, "source": res.cold_start_source, "wall_s": wall,
                   **{k: res.timings_s.get(k, 0.0)
                      for k in ("fetch", "load", "to_device", "first_inference")},
                   "phases": dict(res.timings_s)}
            rows.append(row)
            print(f"{label:8s} source={row['source']:9s} wall={wall * 1e3:8.1f}ms "
                  f"fetch={row['fetch'] * 1e3:7.1f} load={row['load'] * 1e3:7.1f} "
                  f"first_inference={row['first_inference'] * 1e3:7.1f}", flush=True)
            return row

        for name, model in (("hf", "hfbert"), ("builtin", "zbert")):
            await ctl.register_function(FunctionSpec(name=name, model=model, keep_alive_s=0.2))
        await cold("hf", {"text": text}, "hf-first")
        await cold("builtin", {"input_ids": ids}, "zoo-first")
        ratios = []
        for i in range(rounds):
            order = [("hf", {"text": text}), ("builtin", {"input_ids": ids})]
            if i % 2:
                order.reverse()
            got = {fn: await cold(fn, inputs, fn) for fn, inputs in order}
            assert got["hf"]["source"] == got["builtin"]["source"] == "local", got
            ratios.append(got["hf"]["wall_s"] / got["builtin"]["wall_s"])
    hf_rows = [r for r in rows if r["model"] == "hf"]
    zoo_rows = [r for r in rows if r["model"] == "builtin"]
    return {
        "hf_bytes": hf.blob_size, "builtin_bytes": zb.blob_size,
        "hf_wall_s_median": statistics.median(r["wall_s"] for r in hf_rows),
        "builtin_wall_s_median": statistics.median(r["wall_s"] for r in zoo_rows),
        "ratio_median": statistics.median(ratios), "ratios": ratios,
        "target": 1.2, "met": statistics.median(ratios) <= 1.2,
        "hf_push_s": hf_push_s, "builtin_push_s": zoo_push_s, "rows": rows,
    }


def prepare_costs(home: Path, repeats: int) -> dict[str, Any]:
    """Microseconds per request of prepare/finish, in this process, on served models built
    the way a worker builds them (published, then read back from the blob)."""
    from PIL import Image

    from flashpoint.models import serving
    from flashpoint.models.publish import read_files
    from flashpoint.models.sources import publish_source
    from flashpoint.models.tiny_hf import make_image_classifier, make_text_classifier
    from flashpoint.registry.local import LocalStore

    out: dict[str, Any] = {}
    store = LocalStore(home / "registry-cost")
    text_dir = make_text_classifier(home / "cost-text")
    image_dir = make_image_classifier(home / "cost-image", family="vit", size="base")
    for task, directory in (("text", text_dir), ("image", image_dir)):
        manifest = asyncio.run(publish_source(store, f"cost-{task}", directory))
        blob = asyncio.run(store.read_range(manifest.name, "1", 0, manifest.blob_size))
        served = serving.for_manifest(manifest, read_files(manifest, bytearray(blob)))
        if task == "text":
            one = {"text": np.array([TEXT.encode()], dtype=object)}
            many = {"text": np.array([(TEXT + " great" * (i % 8)).encode() for i in range(64)],
                                     dtype=object)}
            cases = {"1 text": one, "64 texts": many}
        else:
            rng = np.random.default_rng(0)
            cases = {}
            for label, (w, h) in (("224x224 jpeg", (224, 224)), ("640x480 jpeg", (640, 480))):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                    buf, format="JPEG", quality=90)
                cases[label] = {"image": np.array([buf.getvalue()], dtype=object)}
        for label, request in cases.items():
            served.prepare(request)  # warm
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                served.prepare(request)
                times.append(time.perf_counter() - t)
            rows = next(iter(request.values())).shape[0]
            logits = np.random.default_rng(1).standard_normal((rows, 2 if task == "text" else 3))
            t = time.perf_counter()
            for _ in range(repeats):
                served.finish({"logits": logits.astype(np.float32)})
            finish_us = (time.perf_counter() - t) / repeats * 1e6
            out[label] = {"prepare_us_median": statistics.median(times) * 1e6,
                          "finish_us": finish_us}
            print(f"{label:14s} prepare {statistics.median(times) * 1e6:9.1f} us   "
                  f"finish {finish_us:7.1f} us", flush=True)
    return out


async def warm_invoke(home: Path, requests: int) -> dict[str, Any]:
    import aiohttp

    from flashpoint.cluster import LocalCluster
    from flashpoint.models.sources import publish, publish_source
    from flashpoint.models.tiny_hf import make_text_classifier
    from flashpoint.registry.local import LocalStore

    store = LocalStore(home / "registry-warm")
    d = make_text_classifier(home / "warm-text")
    await publish_source(store, "hftiny", d)
    await publish(store, "bert", "tiny", "1", model_name="zbtiny")
    cfg = load_config(overrides={"controller": {"listen_port": 0}, "log_level": "WARNING",
                                 "host": {"cpu_devices": 1, "warm_pool_size": 1}}
                      ).with_home(home / "warm")
    ids = {"input_ids": {"data": list(range(1, 17)), "shape": [1, 16], "datatype": "INT64"}}
    bodies = {"hf-text": {"text": TEXT}, "builtin-ids": {"inputs": ids}}
    results: dict[str, Any] = {}
    async with LocalCluster(cfg, hosts=1, store=store) as cluster:
        url = cluster.controller.url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            for fn, model in (("hf-text", "hftiny"), ("builtin-ids", "zbtiny")):
                async with s.post(f"{url}/v1/functions", json={
                        "name": fn, "model": model, "min_replicas": 1, "max_replicas": 1,
                        "max_batch_size": 64, "replica_concurrency": 64}) as r:
                    assert r.status == 201, await r.text()
                async with s.post(f"{url}/v1/functions/{fn}/invoke", json=bodies[fn]) as r:
                    assert r.status == 200, await r.text()

            async def run(fn: str, conc: int, n: int) -> dict[str, float]:
                lat: list[float] = []
                sem = asyncio.Semaphore(conc)

                async def one() -> None:
                    async with sem:
                        t = time.perf_counter()
                        async with s.post(f"{url}/v1/functions/{fn}/invoke",
                                          json=bodies[fn]) as r:
                            await r.read()
                            assert r.status == 200
                        lat.append(time.perf_counter() - t)

                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(n)))
                el = time.perf_counter() - t0
                return {"rps": n / el, "p50_ms": float(np.percentile(lat, 50) * 1e3),
                        "p99_ms": float(np.percentile(lat, 99) * 1e3)}

            for conc in (1, 64):
                n = requests if conc == 64 else max(requests // 4, 100)
                for rnd in range(3):  # interleaved rounds: the VM's slow spells hit both
                    for fn in ("hf-text", "builtin-ids"):
                        res = await run(fn, conc, n)
                        results.setdefault(f"c{conc}", {}).setdefault(fn, []).append(res)
                        print(f"c={conc:<3d} round {rnd} {fn:12s} {res['rps']:8.1f} req/s "
                              f"p50 {res['p50_ms']:6.2f} ms p99 {res['p99_ms']:6.2f} ms",
                              flush=True)
    summary = {}
    for c, per in results.items():
        hf_rps = [r["rps"] for r in per["hf-text"]]
        zb_rps = [r["rps"] for r in per["builtin-ids"]]
        hf_p50 = [r["p50_ms"] for r in per["hf-text"]]
        zb_p50 = [r["p50_ms"] for r in per["builtin-ids"]]
        summary[c] = {
            "hf_rps_median": statistics.median(hf_rps), "builtin_rps_median": statistics.median(zb_rps),
            "rps_ratio_median": statistics.median(h / z for h, z in zip(hf_rps, zb_rps, strict=True)),
            "p50_delta_ms_median": statistics.median(h - z for h, z in
                                                     zip(hf_p50, zb_p50, strict=True)),
        }
    return summary


async def main(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="fp-bench-hf-"))
    out: dict[str, Any] = {"bench": "hf_models",
                           "machine": f"{platform.machine()} {os.cpu_count()} cpu"}
    if "cold" in args.parts:
        print("== scale from zero out of host RAM: HF BERT-base vs built-in bert base", flush=True)
        out["cold_from_ram"] = await cold_from_ram(args.rounds, home)
        c = out["cold_from_ram"]
        print(f"hf {c['hf_wall_s_median'] * 1e3:.1f} ms, built-in "
              f"{c['builtin_wall_s_median'] * 1e3:.1f} ms, ratio {c['ratio_median']:.3f} "
              f"(target <= 1.2: {'met' if c['met'] else 'MISSED'})", flush=True)
    if "prepare" in args.parts:
        print("== per-request cost in the worker's code", flush=True)
        out["prepare"] = await asyncio.to_thread(prepare_costs, home, args.repeats)
    if "warm" in args.parts:
        print("== warm invoke, text vs token ids (native API)", flush=True)
        out["warm"] = await warm_invoke(home, args.requests)
        for c, v in out["warm"].items():
            print(f"{c}: hf {v['hf_rps_median']:.1f} req/s, built-in {v['builtin_rps_median']:.1f}"
                  f" req/s, ratio {v['rps_ratio_median']:.3f}, p50 +{v['p50_delta_ms_median']:.2f} ms")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--parts", nargs="+", default=["cold", "prepare", "warm"],
                    choices=["cold", "prepare", "warm"])
    import uvloop

    print(json.dumps(uvloop.run(main(ap.parse_args())), default=float))
