"""Flashpoint side by side with Ray Serve and BentoML: same machine, models, workloads, one run.

    python bench/peers/run.py [--quick] [--peers ray,bentoml] [--json-out FILE]

1. Outside any namespace (it needs the package index): make or reuse each peer's venv under
   ``~/.cache/flashpoint-peers/venvs`` (``envs.py``) and the model files every platform
   serves under ``~/.cache/flashpoint-peers/models`` (``artifacts.py``).
2. Create a network namespace with nothing but ``lo`` (``netns.py``; needs root) and run the
   measured part (``measure.py``) inside it: the aiohttp floor, Flashpoint (``flashpoint up``
   as its own process, as a user runs it, driven over its HTTP API), Ray Serve and BentoML,
   one after the other, all on 127.0.0.1 and unreachable from anything else.
3. Delete the namespace, even on failure, after stopping by PID whatever is still inside.

Workloads: warm invoke of a no-op and of a small torch MLP at concurrency 1, 8, 64 (req/s,
p50, p99, each divided by the floor's); scale from zero to first response of a ~537 MB
TorchScript MLP and of a BERT-base-shaped Hugging Face classifier; a burst from zero to 4
replicas under open-loop load (the ~537 MB model at 3.5 replicas' worth of its single-request
service time, measured in the same run). Every platform's small-model answers are checked against the
same in-process torch reference; a mismatch fails the run. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))

import envs  # noqa: E402
import netns  # noqa: E402
import report  # noqa: E402

INNER_TIMEOUT_S = {True: 1800.0, False: 5400.0}  # by --quick


def machine(load_at_start: tuple[float, float, float]) -> dict[str, object]:
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"arch": platform.machine(), "cpus": os.cpu_count(), "memory_gib": round(mem_gb, 1),
            "gpu": False, "python": platform.python_version(),
            "loadavg_1m_at_start": load_at_start[0], "loadavg_1m_at_end": os.getloadavg()[0]}


def outer(args: argparse.Namespace) -> int:
    load_at_start = os.getloadavg()  # before this run adds its own
    import artifacts
    import torch
    import transformers

    root = envs.cache_dir()
    peers = [p for p in args.peers.split(",") if p]
    peer_envs: dict[str, dict[str, object]] = {}
    for peer in peers:
        try:
            env = envs.ensure(peer, root)
            peer_envs[peer] = {"python": str(env.python), "versions": env.versions}
        except Exception as e:  # kept as a "not run" row saying why
            peer_envs[peer] = {"error": f"venv: {type(e).__name__}: {e}"[:400]}
            print(f"[run] {peer}: cannot be run here: {peer_envs[peer]['error']}", flush=True)
    t0 = time.monotonic()
    arts = artifacts.ensure(root)
    print(f"[run] model files ready in {time.monotonic() - t0:.1f}s under {arts.mlp.parent}",
          flush=True)
    logs = Path(tempfile.mkdtemp(prefix="fp-peers-logs-"))
    spec = {"quick": args.quick, "peers": peers, "flashpoint": not args.no_flashpoint,
            "envs": peer_envs, "logs": str(logs), "root": str(root),
            "out": str(logs / "result.json")}
    (logs / "spec.json").write_text(json.dumps(spec))
    with netns.LoopbackNamespace() as ns:
        print(f"[run] measuring inside network namespace {ns.name} (lo only); logs: {logs}",
              flush=True)
        cmd = [*ns.prefix(), sys.executable, str(Path(__file__).resolve()), "--inner",
               str(logs / "spec.json")]
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait(INNER_TIMEOUT_S[args.quick])
        except subprocess.TimeoutExpired:
            print(f"[run] the measured run passed {INNER_TIMEOUT_S[args.quick]:.0f}s; stopping",
                  flush=True)
            netns.stop_pids([proc.pid])
            rc = proc.wait(30)
        except BaseException:
            netns.stop_pids([proc.pid])
            raise
    if ns.leftover_pids:
        print(f"[run] stopped {len(ns.leftover_pids)} leftover processes in {ns.name}: "
              f"{list(zip(ns.leftover_pids, ns.leftover_cmdlines, strict=True))}", flush=True)
    out = Path(spec["out"])
    if rc != 0 or not out.exists():
        print(f"[run] FAILED (rc={rc}); logs: {logs}", flush=True)
        return rc or 1
    result = json.loads(out.read_text())
    result["machine"] = machine(load_at_start)
    result["versions"] = {"flashpoint_torch": torch.__version__,
                          "flashpoint_transformers": transformers.__version__,
                          **{p: e.get("versions", e.get("error")) for p, e in peer_envs.items()}}
    result["network"] = (f"every server on 127.0.0.1 inside network namespace {ns.name} "
                         "(lo only), Flashpoint included; load from a separate process there")
    print()
    print(report.table(result))
    print(report.json_line(result), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(report.json_line(result) + "\n")
    return 0


def raise_open_files_limit(want: int = 65536) -> int:
    """Raise this process's soft limit on open files towards its hard limit; the servers and
    the load process started from here inherit it. The burst holds one connection per
    request in flight, past the usual soft limit of 1024, and a refused socket would count
    as the platform's failure. Returns the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        return new
    return soft


def inner(spec_path: str) -> int:
    import asyncio

    import artifacts
    import measure

    raise_open_files_limit()

    spec = json.loads(Path(spec_path).read_text())
    arts = artifacts.ensure(Path(spec["root"]))
    plan = measure.Plan.of(spec["quick"])
    result = asyncio.run(measure.run(plan, arts, spec["envs"], Path(spec["logs"]),
                                     (*(["flashpoint"] if spec["flashpoint"] else []),
                                      *spec["peers"])))
    Path(spec["out"]).write_text(json.dumps(result, default=str))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    ap.add_argument("--peers", default=",".join(envs.PEERS),
                    help="comma list of peers to run (default: ray,bentoml)")
    ap.add_argument("--no-flashpoint", action="store_true",
                    help="peers only (to debug a peer; the targets are then not measured)")
    ap.add_argument("--json-out", default="", help="also write the JSON line to this file")
    ap.add_argument("--inner", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C: the outer run still deletes the namespace, the inner one
    # still stops its servers and removes its temporary registry.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.inner:
        return inner(args.inner)
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
