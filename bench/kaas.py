"""KaaS contention experiment in small (the paper's §5.3 offline scenario) and warm overhead.

Closed loop: ``--clients`` clients each send one request at a time, for ``--rounds`` windows
of ``--duration-s`` after a warm-up (policies interleaved round by round), to a pool of
``--workers`` in-process executors (CPU torch, one thread each) under each policy —
exclusive (the eTask baseline), round-robin and affinity — all in one run. Two workloads:

* ``gemm``: a chain of 3 matmuls of per-client constant ``D x D`` float32 matrices from the
  object store (the paper's cGEMM / §5.2 microbenchmark: big cacheable constants, a narrow
  input that changes every call);
* ``jacobi``: ``--jacobi-iters`` in-place Jacobi sweeps (one kernel, ``n_iters``) over a
  per-client system matrix from the object store with a fresh right-hand side per call.

Each executor's cache holds about a quarter of all clients' constants plus slack, so
affinity can keep every client warm somewhere while cache-blind round-robin and pool-
reassigning exclusive keep reloading. The CPU has no PCIe: a miss additionally waits
``bytes / --link-gbps`` (a stand-in for the host-to-device copy); ``--restart-ms`` adds a
worker restart to each exclusive reassignment (0 = only its cache is lost).

Warm overhead: a trivial graph (add of two 4-element vectors, inline) called back to back;
reported is the time in the platform excluding the kernel phase, in process (parse,
validate, schedule, make resident, copy out) and over HTTP (plus the gateway).

    python bench/kaas.py [--clients 16 --workers 4 --rounds 3 --duration-s 1.5]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from flashpoint.kaas.service import KaasService, local_service  # noqa: E402
from flashpoint.kaas.spec import KaasRequest  # noqa: E402

MIB = 1 << 20


def gemm_request(client: int, d: int, width: int, rng: np.random.Generator) -> dict[str, Any]:
    x = rng.random((d, width), dtype=np.float32)
    bufs = [{"name": "x", "kind": "input", "dtype": "float32", "shape": [d, width],
             "b64": __import__("base64").b64encode(x.tobytes()).decode()}]
    kernels = []
    prev = "x"
    for layer in range(3):
        bufs.append({"name": f"w{layer}", "kind": "input", "dtype": "float32", "shape": [d, d],
                     "key": f"gemm/{client}/w{layer}"})
        out = "y" if layer == 2 else f"t{layer}"
        bufs.append({"name": out, "kind": "output" if layer == 2 else "intermediate",
                     "dtype": "float32", "shape": [d, width]})
        kernels.append({"kernel": "matmul", "inputs": [f"w{layer}", prev], "outputs": [out]})
        prev = out
    return {"kernels": kernels, "buffers": bufs}


def jacobi_request(client: int, n: int, iters: int, rng: np.random.Generator) -> dict[str, Any]:
    b = rng.random(n, dtype=np.float32)
    return {"n_iters": iters,
            "kernels": [{"kernel": "jacobi_step", "inputs": ["A", "b", "x"], "outputs": ["x"]}],
            "buffers": [{"name": "A", "kind": "input", "dtype": "float32", "shape": [n, n],
                         "key": f"jacobi/{client}/A"},
                        {"name": "b", "kind": "input", "dtype": "float32", "shape": [n],
                         "data": b.tolist()},
                        {"name": "x", "kind": "output", "dtype": "float32", "shape": [n],
                         "fill": 0.0}]}


def populate(svc: KaasService, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    for c in range(args.clients):
        for layer in range(3):
            w = rng.random((args.gemm_dim, args.gemm_dim), dtype=np.float32) / args.gemm_dim
            svc.store.put(f"gemm/{c}/w{layer}", w.tobytes())
        a = rng.random((args.jacobi_n, args.jacobi_n), dtype=np.float32)
        a += np.eye(args.jacobi_n, dtype=np.float32) * args.jacobi_n
        svc.store.put(f"jacobi/{c}/A", a.tobytes())


def per_client_bytes(workload: str, args: argparse.Namespace) -> int:
    if workload == "gemm":
        d, w = args.gemm_dim, args.gemm_width
        return 4 * (3 * d * d + 3 * d * w)
    return 4 * (args.jacobi_n ** 2 + 2 * args.jacobi_n)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def contention(workload: str, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement window: a fresh pool, warm-up, then ``--duration-s`` counted."""
    # Room for about a quarter of the clients' working sets per executor, plus slack: the
    # pool as a whole holds everything only if each client stays on one executor.
    per_client = per_client_bytes(workload, args)
    capacity = int(per_client * (args.clients / args.workers) * 1.25) + MIB
    svc = local_service(args.workers, policy=policy, capacity_bytes=capacity,
                        host_capacity_bytes=capacity, restart_s=args.restart_ms / 1e3,
                        link_bytes_per_s=args.link_gbps * 1e9)
    populate(svc, args)
    rng = np.random.default_rng(1)
    plans = []
    for c in range(args.clients):  # a few distinct inputs per client, parsed up front
        build = gemm_request if workload == "gemm" else jacobi_request
        extra = (args.gemm_dim, args.gemm_width) if workload == "gemm" else (
            args.jacobi_n, args.jacobi_iters)
        plans.append([svc.plan(KaasRequest.from_dict(build(c, *extra, rng))) for _ in range(3)])
    latencies: list[float] = []
    counts = {"hits": 0, "misses": 0, "evictions": 0}
    loop = asyncio.get_running_loop()
    t_measure = loop.time() + args.warmup_s
    t_end = t_measure + args.duration_s

    async def client(c: int) -> None:
        i = 0
        while loop.time() < t_end:
            t0 = loop.time()
            r = await svc.invoke(plans[c][i % 3], client=f"client-{c}", request_id=f"{c}-{i}",
                                 timeout_s=120)
            t1 = loop.time()
            i += 1
            if t0 >= t_measure and t1 <= t_end:
                latencies.append(t1 - t0)
                for k in counts:
                    counts[k] += r.cache[k]

    await asyncio.gather(*(client(c) for c in range(args.clients)))
    restarts = sum(getattr(h, "restarts", 0) for h in svc.pool.handles)
    await svc.close()
    return {"latencies": latencies, "restarts": restarts, "cache_mib": capacity / MIB,
            **counts}


def summarise(workload: str, policy: str, windows: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    lat = [x for w in windows for x in w["latencies"]]
    hits = sum(w["hits"] for w in windows)
    lookups = hits + sum(w["misses"] for w in windows)
    return {"workload": workload, "policy": policy,
            "req_s": len(lat) / (args.duration_s * len(windows)),
            "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "hit_rate": hits / lookups if lookups else 0.0,
            "evictions": sum(w["evictions"] for w in windows),
            "restarts": sum(w["restarts"] for w in windows), "requests": len(lat),
            "cache_mib": round(windows[0]["cache_mib"], 1)}


async def warm_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Platform time per trivial call, excluding the kernel phase."""
    svc = local_service(1, policy="affinity", capacity_bytes=MIB)
    body = {"kernels": [{"kernel": "add", "inputs": ["a", "b"], "outputs": ["y"]}],
            "buffers": [{"name": "a", "kind": "input", "dtype": "float32", "shape": [4],
                         "data": [1, 2, 3, 4]},
                        {"name": "b", "kind": "input", "dtype": "float32", "shape": [4],
                         "key": "ones"},
                        {"name": "y", "kind": "output", "dtype": "float32", "shape": [4]}]}
    svc.store.put("ones", np.ones(4, np.float32).tobytes())
    inproc: list[float] = []
    kernel_share: list[float] = []
    for i in range(args.overhead_calls + 50):
        t0 = time.perf_counter()
        plan = svc.plan(KaasRequest.from_dict(body))
        r = await svc.invoke(plan, client="c", request_id=str(i))
        total = time.perf_counter() - t0
        if i >= 50:  # warm-up
            inproc.append(total - r.timings_s["kernels"])
            kernel_share.append(r.timings_s["kernels"])
    http = await _http_overhead(svc, body, args.overhead_calls // 2)
    await svc.close()
    return {"inproc_p50_ms": pct(inproc, 50) * 1e3, "inproc_p99_ms": pct(inproc, 99) * 1e3,
            "inproc_mean_ms": statistics.fmean(inproc) * 1e3,
            "kernel_p50_ms": pct(kernel_share, 50) * 1e3,
            "http_p50_ms": pct(http, 50) * 1e3, "http_p99_ms": pct(http, 99) * 1e3}


async def _http_overhead(svc: KaasService, body: dict[str, Any], calls: int) -> list[float]:
    import aiohttp
    from aiohttp import web

    from flashpoint.gateway import RUNNER_KWARGS, GatewayConfig, make_app

    class NoFunctions:  # the native API is not used here
        def is_live(self) -> bool:
            return True

    app = make_app(NoFunctions(), GatewayConfig(), kaas=svc)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None, **RUNNER_KWARGS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    out: list[float] = []
    payload = json.dumps(body).encode()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            for i in range(calls + 20):
                t0 = time.perf_counter()
                async with s.post("/v1/kaas/invoke", data=payload,
                                  headers={"Content-Type": "application/json"}) as r:
                    res = await r.json()
                total = time.perf_counter() - t0
                if i >= 20:
                    out.append(total - res["timings_s"]["kernels"])
    finally:
        await runner.cleanup()
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = []
    policies = args.policies.split(",")
    for workload in args.workloads.split(","):
        # Rounds interleave the policies so background load on a shared machine falls on
        # all of them alike; each policy's windows are pooled.
        windows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for _ in range(args.rounds):
            for policy in policies:
                windows[policy].append(await contention(workload, policy, args))
        rows += [summarise(workload, p, windows[p], args) for p in policies]
    overhead = await warm_overhead(args)
    return {"rows": rows, "overhead": overhead}


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"KaaS contention: {args.clients} clients (closed loop), {args.workers} executors "
          f"(CPU torch, 1 thread each), {args.rounds} rounds x {args.duration_s:g} s after "
          f"{args.warmup_s:g} s warm-up per policy, interleaved; link {args.link_gbps:g} GB/s "
          f"on misses, exclusive restart {args.restart_ms:g} ms")
    print(f"gemm: 3 x ({args.gemm_dim}x{args.gemm_dim}) constants x ({args.gemm_dim}x"
          f"{args.gemm_width}); jacobi: n={args.jacobi_n}, {args.jacobi_iters} sweeps")
    print(f"{'workload':8} {'policy':12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'hit rate':>8} {'evict':>7} {'restarts':>8} {'cache MiB':>9}")
    for r in result["rows"]:
        print(f"{r['workload']:8} {r['policy']:12} {r['req_s']:8.1f} {r['p50_ms']:8.2f} "
              f"{r['p99_ms']:8.2f} {r['hit_rate']:8.2f} {r['evictions']:7d} "
              f"{r['restarts']:8d} {r['cache_mib']:9.1f}")
    o = result["overhead"]
    print(f"warm overhead (trivial graph, excluding kernels): in process p50 "
          f"{o['inproc_p50_ms']:.3f} ms p99 {o['inproc_p99_ms']:.3f} ms; over HTTP p50 "
          f"{o['http_p50_ms']:.3f} ms p99 {o['http_p99_ms']:.3f} ms (target <= 1 ms)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--duration-s", type=float, default=1.5)
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="gemm,jacobi")
    p.add_argument("--policies", default="exclusive,round_robin,affinity")
    p.add_argument("--gemm-dim", type=int, default=1024)
    p.add_argument("--gemm-width", type=int, default=16)
    p.add_argument("--jacobi-n", type=int, default=256)
    p.add_argument("--jacobi-iters", type=int, default=100)
    p.add_argument("--link-gbps", type=float, default=4.0)
    p.add_argument("--restart-ms", type=float, default=0.0)
    p.add_argument("--overhead-calls", type=int, default=1000)
    args = p.parse_args()
    result = asyncio.run(main(args))
    report(result, args)
    print(json.dumps({"bench": "kaas", "python": platform.python_version(),
                      "args": vars(args), **result}, default=float))
