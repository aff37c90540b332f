"""Cold starts from each source of the hierarchy: S3 registry, a peer's RAM, own RAM.

The thesis's Fig 8.5 measured on our code. One run publishes a built-in model (default BERT
large, ~1.3 GB) to an S3 registry (moto's server on loopback, over real HTTP), brings up a
two-host local cluster, and measures request-to-first-response for:

- ``s3``: host0 has nothing; its worker's bytes come from the registry;
- ``peer``: a second function on the same model lands on host1 (host0's device is busy),
  which gets the bytes from host0's RAM over a TCP chain;
- ``ram``: scale-from-zero again on a host that still holds the bytes (repeated).

Each row splits the cold start into fetch / load / to_device / first_inference as the
platform timed them, plus the wall time the client saw, then every phase of the request
(``flashpoint/controller/cold_timings.COLD_PHASES``: decision, placement, deploy RPC, host,
worker, hand-off, ready to dispatch, the request itself) and their sum against the wall;
a JSON line ends the output.

    python bench/coldstart.py [--model bert --preset large --repeats 3] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashpoint.config import load_config  # noqa: E402
from flashpoint.controller.cold_timings import COLD_PHASES, phases_sum_s  # noqa: E402


async def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


async def main(args: argparse.Namespace) -> dict:
    import boto3

    from flashpoint.cluster import LocalCluster
    from flashpoint.models import zoo
    from flashpoint.models.sources import publish
    from flashpoint.registry.s3 import S3Store
    from flashpoint.spec import FunctionSpec

    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    port = _free_port()
    moto = _start_moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    home = Path(tempfile.mkdtemp(prefix="fp-bench-cold-"))
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="models")
        store = S3Store("models", "bench", endpoint_url=endpoint, part_size_bytes=64 << 20)
        t0 = time.perf_counter()
        manifest = await publish(store, args.model, args.preset, "1", model_name="m")
        size = manifest.blob_size
        print(f"published {args.model}/{args.preset} to S3 (moto): {size / 1e6:.1f} MB "
              f"in {time.perf_counter() - t0:.1f}s", flush=True)
        cfg = load_config(overrides={
            "controller": {"listen_port": 0}, "log_level": "WARNING",
            # One device per host with room for one replica: the second function must go to
            # the other host, which then sources from the first host's RAM.
            # Each host stands for a machine of this one's size (they never compute at
            # the same time here): its one device gets every core (policy/cpu_threads.py).
            "host": {"cpu_devices": 1, "warm_pool_size": 1,
                     "cpu_cores": args.cpu_cores or len(os.sched_getaffinity(0)),
                     "device_memory_bytes": int(size * 1.5) + (100 << 20),
                     "cache_bytes": 3 * size, "host_memory_bytes": 8 * size,
                     **({"torch_threads": args.torch_threads} if args.torch_threads else {}),
                     **({"cache_dir": args.cache_dir} if args.cache_dir else {})},
        }).with_home(home)
        inputs = {k: np.asarray(v) for k, v in
                  zoo.example_inputs(args.model, zoo.resolve_config(args.model, args.preset), 1).items()}
        rows: list[dict] = []
        async with LocalCluster(cfg, hosts=2, store=store) as cluster:
            ctl = cluster.controller
            threads = cluster.hosts[0].pool.torch_threads  # what the workers got

            async def cold(fn: str, label: str) -> None:
                await _until(lambda: not ctl.state.replicas_of(fn), 120, f"{fn} scaled to zero")
                await asyncio.gather(*(h.wait_pool_ready(120) for h in cluster.hosts))
                await asyncio.sleep(0.5)  # let refilled workers settle (no CPU stolen)
                t = time.perf_counter()
                res = await ctl.invoke(fn, inputs, request_id=f"{label}-{len(rows)}", timeout_s=600)
                wall = time.perf_counter() - t
                assert res.cold, "expected a scale from zero"
                host = ctl.state.replicas[res.replica_id].host_id
                row = {"row": label, "function": fn, "host": host, "source": res.cold_start_source,
                       "wall_s": wall, **{k: res.timings_s.get(k, 0.0) for k in
                                          ("fetch", *COLD_PHASES)},
                       "phases_sum_s": phases_sum_s(res.timings_s),
                       # the worker's own compute for the request (inside ``request``)
                       "worker_inference_s": res.timings_s.get("inference", 0.0)}
                rows.append(row)
                print(f"{label:5s} {fn} on {host} source={row['source']:14s} wall={wall * 1e3:8.1f}ms "
                      f"fetch={row['fetch'] * 1e3:8.1f} load={row['load'] * 1e3:7.1f} "
                      f"to_device={row['to_device'] * 1e3:6.1f} "
                      f"first_inference={row['first_inference'] * 1e3:7.1f}", flush=True)
                print("      " + " ".join(f"{k}={row[k] * 1e3:.1f}" for k in COLD_PHASES)
                      + f" (worker inference={row['worker_inference_s'] * 1e3:.1f})"
                      + f"  sum={row['phases_sum_s'] * 1e3:.1f}ms"
                      f" ({row['phases_sum_s'] / wall * 100:.1f}% of wall)", flush=True)

            # f stays warm on host0 (long keep-alive) so g cannot go there.
            await ctl.register_function(FunctionSpec(name="f", model="m", keep_alive_s=3600))
            await ctl.register_function(FunctionSpec(name="g", model="m", keep_alive_s=0.2))
            await cold("f", "s3")
            await _until(lambda: any("m@1" in h.cached_models for h in ctl.state.hosts.values()),
                         30, "host0 reporting the model cached")
            await cold("g", "peer")
            for _ in range(args.repeats):
                await cold("g", "ram")
    finally:
        moto.terminate()
        try:
            moto.wait(10)
        except subprocess.TimeoutExpired:
            moto.kill()
            moto.wait(10)
    by = {label: [r for r in rows if r["row"] == label] for label in ("s3", "peer", "ram")}

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in by[label])

    out = {"bench": "coldstart", "machine": f"{platform.machine()} {os.cpu_count()} cpu",
           "model": args.model, "preset": args.preset, "model_bytes": size,
           "torch_threads": threads, "cpu_cores": cfg.host.cpu_cores,
           "cache_dir": cfg.host.cache_dir,
           "s3_wall_s": med("s3", "wall_s"), "peer_wall_s": med("peer", "wall_s"),
           "ram_wall_s_median": med("ram", "wall_s"),
           "sources": {label: by[label][0]["source"] for label in by}, "rows": rows}
    print("\nsource  wall_ms  fetch_ms  load_ms  to_device_ms  first_inference_ms")
    for label in ("s3", "peer", "ram"):
        print(f"{label:6s} {med(label, 'wall_s') * 1e3:8.1f} {med(label, 'fetch') * 1e3:9.1f} "
              f"{med(label, 'load') * 1e3:8.1f} {med(label, 'to_device') * 1e3:13.1f} "
              f"{med(label, 'first_inference') * 1e3:19.1f}")
    print("\nmedian phases (ms):")
    for label in ("s3", "peer", "ram"):
        print(f"{label:6s} " + " ".join(f"{k}={med(label, k) * 1e3:.1f}" for k in COLD_PHASES)
              + f"  sum={med(label, 'phases_sum_s') * 1e3:.1f} wall={med(label, 'wall_s') * 1e3:.1f}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert")
    ap.add_argument("--preset", default="large")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="[host] torch_threads for the workers (0: the configured default)")
    ap.add_argument("--cpu-cores", type=int, default=0,
                    help="[host] cpu_cores of each host (0: this machine's cores)")
    ap.add_argument("--cache-dir", default="",
                    help="[host] cache_dir (default: a directory in /dev/shm), e.g. on a tmpfs "
                         "mounted with huge=within_size")
    import uvloop

    print(json.dumps(uvloop.run(main(ap.parse_args()))))
