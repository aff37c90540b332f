"""A worker's cold load from host RAM with and without the weights prefault (issue 20 item 7).

Publishes a built-in model (default BERT base) into a temporary registry, copies its blob
to /dev/shm as the host's RAM cache holds it (a tmpfs file), then runs
``flashpoint.worker.loading.load`` (map, build, warm up) in a fresh process per round,
alternating prefault on and off. Per round it reports the wall time of the load, its
``load`` and ``first_inference`` phases, the CPU time of the thread that loads (the
critical path when a spare core takes the prefault) and of the whole process (the work
done on every thread), and the page faults the loading thread took. On a loaded machine the
wall times are noise; the CPU times are what the change moves.

    python bench/prefault.py [--model bert --preset base --rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_CHILD = r"""
import json, resource, sys, time
from flashpoint.messages.host_worker import LoadReplica
from flashpoint.spec import FunctionSpec
from flashpoint.worker import loading

manifest_json, cache_path, prefault = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
import torch
torch.set_num_threads(1)  # the worker's default ([host] torch_threads)
spec = FunctionSpec(name="f", model="m")
msg = LoadReplica(replica_id="r", manifest_json=open(manifest_json).read(), device="cpu",
                  cache_path=cache_path, spec=spec.to_dict(), controller_url="ws://127.0.0.1:1/rpc")
r0 = resource.getrusage(resource.RUSAGE_THREAD)
p0 = time.process_time()
c0 = time.thread_time()
t0 = time.perf_counter()
loaded = loading.load(msg, spec, t0, prefault)
wall = time.perf_counter() - t0
thread_cpu = time.thread_time() - c0
proc_cpu = time.process_time() - p0
r1 = resource.getrusage(resource.RUSAGE_THREAD)
print(json.dumps({"wall_s": wall, "thread_cpu_s": thread_cpu, "process_cpu_s": proc_cpu,
                  "thread_minflt": r1.ru_minflt - r0.ru_minflt,
                  "load_s": loaded.timings_s["load"],
                  "first_inference_s": loaded.timings_s["first_inference"]}))
"""


async def _publish(args: argparse.Namespace, root: Path) -> tuple[Path, Path]:
    from flashpoint.models.sources import publish
    from flashpoint.registry.local import LocalStore

    store = LocalStore(root / "registry")
    manifest = await publish(store, args.model, args.preset, "1", model_name="m")
    manifest_json = root / "manifest.json"
    manifest_json.write_text(manifest.to_json())
    return manifest_json, store.blob_path("m", "1")


def main(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="fp-bench-prefault-"))
    shm = Path(tempfile.mkdtemp(prefix="fp-bench-prefault-", dir="/dev/shm"))
    try:
        manifest_json, blob = asyncio.run(_publish(args, root))
        cache = shm / "m@1"
        shutil.copyfile(blob, cache)  # the host's RAM cache is a tmpfs file
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        rows: list[dict] = []
        for i in range(args.rounds):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                out = subprocess.run([sys.executable, "-c", _CHILD, str(manifest_json),
                                      str(cache), mode], env=env, capture_output=True,
                                     text=True, timeout=300, check=True)
                row = {"round": i, "prefault": mode, **json.loads(out.stdout.splitlines()[-1])}
                rows.append(row)
                print(f"round {i} prefault={mode:3s} wall={row['wall_s'] * 1e3:7.1f}ms "
                      f"load={row['load_s'] * 1e3:6.1f} "
                      f"first_inference={row['first_inference_s'] * 1e3:6.1f} "
                      f"thread_cpu={row['thread_cpu_s'] * 1e3:6.1f} "
                      f"process_cpu={row['process_cpu_s'] * 1e3:6.1f} "
                      f"thread_faults={row['thread_minflt']}", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    keys = ("wall_s", "load_s", "first_inference_s", "thread_cpu_s", "process_cpu_s",
            "thread_minflt")
    med = {mode: {k: statistics.median(r[k] for r in rows if r["prefault"] == mode)
                  for k in keys} for mode in ("off", "on")}
    print("\nmedians      " + " ".join(f"{k:>18s}" for k in keys))
    for mode in ("off", "on"):
        print(f"prefault={mode:3s} " + " ".join(
            f"{med[mode][k] * (1 if k == 'thread_minflt' else 1e3):18.1f}" for k in keys))
    return {"bench": "prefault", "model": args.model, "preset": args.preset,
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "medians": med, "rows": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert")
    ap.add_argument("--preset", default="base")
    ap.add_argument("--rounds", type=int, default=8)
    print(json.dumps(main(ap.parse_args())))
