"""Read the GPU inventory, then measure two MPS workers at different SM shares.

    python bench/gpu/inventory_mps.py [--seconds 10] [--model resnet --preset small --batch 64]
                                      [--shares 30,70]

1. Inventory through flashpoint.gpu.nvml (the code the host uses): GPUs, memory, MIG mode,
   GPU/compute instances, MIG UUIDs, utilisation. READ ONLY: this script never changes MIG
   mode, never creates or destroys instances and never resets a GPU.
2. Solo profile without MPS (the whole GPU, one worker).
3. If ``nvidia-cuda-mps-control`` exists: a private MPS daemon (pipe/log dirs in a temp dir),
   each worker alone at its SM share (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) as its solo
   profile, then both together; throughput of each against its solo profile. The daemon is
   stopped in a ``finally``. If MPS cannot start, that is reported and the rest still runs.

Workers are child processes running a built-in model (flashpoint.models zoo; a plain torch
CNN if the zoo cannot be imported) on CUDA in a loop bounded by ``--seconds``; the parent
starts them together once both are warm, waits with deadlines and kills late ones by PID.
Without a GPU it prints "no GPU" and exits 0. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # runnable from a checkout without installing flashpoint
    sys.path.insert(0, str(ROOT))

WARMUP_BUDGET_S = 120.0  # model build + CUDA init + warm-up, per worker


# ---------------------------------------------------------------- worker (child process) ---

def _build(model: str, preset: str, batch: int, device: str) -> tuple[Any, Any, str]:
    import torch

    try:
        from flashpoint.models import zoo

        module, config = zoo.build(model, preset)
        (array,) = zoo.example_inputs(model, config, batch).values()
        x = torch.from_numpy(array)
        label = f"{model}/{preset}"
    except Exception as exc:  # zoo needs numpy etc.; a plain CNN keeps the bench usable
        print(f"zoo unavailable ({exc!r}); using a plain torch CNN", file=sys.stderr)
        nn = torch.nn
        module = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3), nn.ReLU(), nn.Conv2d(64, 128, 3, 2, 1), nn.ReLU(),
            nn.Conv2d(128, 256, 3, 2, 1), nn.ReLU(), nn.Conv2d(256, 512, 3, 2, 1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)).eval()
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        label = "plain-cnn"
    return module.to(device).eval(), x.to(device), label


def worker_main(args: argparse.Namespace) -> int:
    """Child: build, warm up, print READY, wait for GO on stdin, loop for --seconds."""
    # A watchdog in case the parent vanishes without closing our stdin.
    signal.alarm(int(WARMUP_BUDGET_S + args.seconds + 60))
    import torch

    device = "cpu" if args.cpu else "cuda"
    module, x, label = _build(args.model, args.preset, args.batch, device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        warm_end = time.perf_counter() + 10.0
        for _ in range(20):  # bounded by count and by time
            module(x)
            sync()
            if time.perf_counter() > warm_end:
                break
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":  # EOF: the parent gave up on us
            return 1
        lat: list[float] = []
        start = time.perf_counter()
        end = start + args.seconds
        while (t0 := time.perf_counter()) < end:
            module(x)
            sync()
            lat.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
    lat.sort()
    print("RESULT " + json.dumps({
        "model": label, "batch": args.batch, "iterations": len(lat), "elapsed_s": elapsed,
        "items_per_s": len(lat) * args.batch / elapsed if elapsed > 0 else 0.0,
        "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
        "sm_share_env": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "torch": torch.__version__}), flush=True)
    return 0


# ---------------------------------------------------------------------------- parent ---

async def _readline(proc: asyncio.subprocess.Process, timeout_s: float) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    return line.decode(errors="replace").strip()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)  # by PID, this child only
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)


async def run_workers(args: argparse.Namespace, envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Run one worker per env together; their timed loops start at the same moment."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for extra in envs:
            env = {**os.environ, **extra}
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).resolve()), "--worker",
                "--seconds", str(args.seconds), "--model", args.model, "--preset", args.preset,
                "--batch", str(args.batch), *(["--cpu"] if args.cpu else []), env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=None))
        for p in procs:
            deadline = time.monotonic() + WARMUP_BUDGET_S
            while (line := await _readline(p, max(0.1, deadline - time.monotonic()))) != "READY":
                if not line and p.stdout is not None and p.stdout.at_eof():
                    raise RuntimeError(f"worker pid {p.pid} exited before READY")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"GO\n")
            await p.stdin.drain()
        out = []
        for p in procs:
            deadline = time.monotonic() + args.seconds + 60
            while not (line := await _readline(p, max(0.1, deadline - time.monotonic()))
                       ).startswith("RESULT "):
                if not line and p.stdout is not None and p.stdout.at_eof():
                    raise RuntimeError(f"worker pid {p.pid} exited without a result")
            out.append(json.loads(line[len("RESULT "):]))
            await asyncio.wait_for(p.wait(), 30)
        return out
    finally:
        for p in procs:
            await _kill(p)


def print_inventory(gpus: Any) -> None:
    for g in gpus:
        mig = {None: "n/a", True: "on", False: "off"}
        print(f"GPU {g.index}: {g.name} {g.uuid} memory {g.memory_used_bytes / 2**30:.1f}/"
              f"{g.memory_total_bytes / 2**30:.1f} GiB, MIG current {mig[g.mig_current]} "
              f"pending {mig[g.mig_pending]}, util "
              f"{'n/a' if g.utilization_gpu_pct is None else str(g.utilization_gpu_pct) + '%'}")
        for gi in g.gpu_instances:
            print(f"  GI {gi.gi_id} {gi.profile_name} placement {gi.start}:{gi.size} "
                  f"{gi.memory_mb} MiB")
            for ci in gi.compute_instances:
                print(f"    CI {ci.ci_id} slices {ci.start}:{ci.size} {ci.mig_uuid}")
        if g.mig_current and not g.gpu_instances:
            for d in g.mig_devices:
                print(f"  MIG device GI {d.gi_id} CI {d.ci_id} {d.name} {d.uuid}")
        for note in g.notes:
            print(f"  note: {note}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"gpu": False, "gpus": [], "mps": {"started": False}}
    try:
        from flashpoint.gpu.nvml import load_nvml, read_inventory
    except ImportError as exc:
        report["reason"] = f"pynvml not importable: {exc}"
        print(f"no GPU: {report['reason']}")
        return report
    if args.fake_nvml:  # self-test without a GPU: the fake NVML, workers on the CPU
        from flashpoint.gpu.fake_nvml import FakeNvml

        nvml = load_nvml(FakeNvml.with_gpus(args.fake_nvml, mig=False))
    else:
        nvml = load_nvml()
    if nvml is None:
        report["reason"] = "NVML did not initialise (no driver or no GPU)"
        print(f"no GPU: {report['reason']}")
        return report
    try:
        gpus = read_inventory(nvml)
    finally:
        nvml.nvmlShutdown()
    report["gpus"] = [g.to_dict() for g in gpus]
    print_inventory(gpus)
    if not gpus:
        report["reason"] = "NVML sees no GPU"
        print("no GPU: NVML sees none")
        return report
    try:
        import torch

        cuda_ok = args.cpu or torch.cuda.is_available()
    except ImportError:
        cuda_ok = False
    if not cuda_ok:
        report["reason"] = "torch has no CUDA here"
        print("no GPU usable from torch; inventory only")
        return report
    report["gpu"] = True
    g0 = gpus[0]
    device = "0"
    if g0.mig_current:  # bind to the first MIG device; MPS on a MIG-mode GPU needs one
        uuids = [d.uuid for d in g0.mig_devices]
        if not uuids:
            report["reason"] = "MIG is on but no instances exist (this script creates none)"
            print(report["reason"])
            return report
        device = uuids[0]
    report["device"] = device
    shares = [int(s) for s in args.shares.split(",")]

    solo_full = (await run_workers(args, [{"CUDA_VISIBLE_DEVICES": device}]))[0]
    report["solo_full_gpu"] = solo_full
    rows = [("alone, no MPS", "100", solo_full["items_per_s"], None)]

    from flashpoint.errors import MpsUnavailable
    from flashpoint.gpu.mps import MpsConfig, MpsDaemon, find_control_binary

    if find_control_binary() is None:
        report["mps"] = {"started": False, "reason": "nvidia-cuda-mps-control not found"}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="fp-mps-"))
        daemon = MpsDaemon(MpsConfig(tmp, device=device))
        try:
            await daemon.start()
            report["mps"] = {"started": True, "pid": daemon.pid, "pipe_dir": str(daemon.pipe_dir)}
            envs = [daemon.client_env(active_thread_percentage=s) for s in shares]
            solos = [(await run_workers(args, [e]))[0] for e in envs]
            together = await run_workers(args, envs)
            report["mps"].update(solo=solos, together=together)
            if len(together) != len(shares):
                raise RuntimeError("a worker gave no result")
            for s, solo, co in zip(shares, solos, together, strict=True):
                rows.append((f"alone, MPS {s}%", str(s), solo["items_per_s"], None))
                rows.append((f"together, MPS {s}%", str(s), co["items_per_s"],
                             co["items_per_s"] / solo["items_per_s"]))
        except MpsUnavailable as exc:
            report["mps"] = {"started": False, "reason": exc.message}
        except (RuntimeError, TimeoutError) as exc:  # a worker failed under MPS: report it
            report["mps"]["error"] = repr(exc)
            print(f"MPS run failed: {exc!r}")
        finally:
            await daemon.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    if not report["mps"].get("started"):
        print(f"MPS not used: {report['mps'].get('reason')}")
    print(f"\nmodel {solo_full['model']} batch {args.batch}, {args.seconds} s per run, "
          f"torch {solo_full['torch']}")
    print(f"{'run':<22}{'SM %':>6}{'items/s':>12}{'vs solo':>10}")
    for name, share, ips, ratio in rows:
        print(f"{name:<22}{share:>6}{ips:>12.1f}{'' if ratio is None else f'{ratio:.2f}':>10}")
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shares", default="30,70", help="SM percentages of the two workers")
    # Self-test switches (tests/gpu/test_gpu_bench_script.py): a fake NVML of this model and
    # workers on the CPU, so the whole flow runs on a machine without a GPU.
    ap.add_argument("--fake-nvml", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return worker_main(args)
    report = asyncio.run(main_async(args))
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
