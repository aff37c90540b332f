"""The CUDA hook with real torch on a real GPU: overhead and 30/70 time shares.

(a) One process runs BERT-base inference (the built-in zoo model; plain torch, no cluster)
    for ``--seconds``: without the hook, with the hook preloaded but no manager (pure
    interception), and with the hook and a token manager granting a 100% quota.
    Target: throughput overhead <= 3%.
(b) Two such processes at once, quotas 30% / 70% (request = limit).  Each one's GPU-time
    share is measured from the manager's accounting and from the throughput ratio (the
    same model, so throughput is proportional to GPU time).  Target: within +-5%.

Torch's CUDA runtime resolves the driver with dlsym + cuGetProcAddress; the hook
interposes both, and the manager's grant count proves launches reached the gate.

Prints a table and a final JSON line; every loop is bounded in time; children are killed
by PID; exits 0 with a clear message when CUDA is absent.

    PYTHONPATH=. python3 bench/gpu/hook_torch.py --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STARTUP_S = 180.0  # model build + CUDA init + warm-up, on top of --seconds


# ---------------------------------------------------------------- worker process
def build_model(preset: str, dtype: str, device: str):  # -> (model, vocab, seq)
    import torch

    dt = getattr(torch, dtype)
    try:
        from flashpoint.models import bert

        cfg = bert.resolve(preset)
        model = bert.build_from_config(cfg)
        vocab, seq = cfg.vocab_size, cfg.seq_len
    except Exception as e:  # noqa: BLE001 - a zoo/torch mismatch must not kill the benchmark
        print(f"zoo model unavailable ({e!r}); using a plain torch encoder", file=sys.stderr)
        vocab, seq = 30522, 128
        layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, 768), torch.nn.TransformerEncoder(layer, 12))
    return model.to(device, dt).eval(), vocab, seq


def worker(args: argparse.Namespace) -> None:
    import torch

    model, vocab, seq = build_model(args.preset, args.dtype, args.device)
    ids = torch.randint(0, vocab, (args.batch, seq), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.inference_mode():
        t_end = time.monotonic() + 5.0
        for _ in range(20):  # warm-up, bounded in count and time
            model(ids)
            sync()
            if time.monotonic() > t_end:
                break
        if args.barrier:  # start measuring together with the sibling processes (bounded wait)
            Path(args.barrier, f"ready-{os.getpid()}").touch()
            t_end = time.monotonic() + 120.0
            while len(list(Path(args.barrier).glob("ready-*"))) < args.parties and time.monotonic() < t_end:
                time.sleep(0.005)
        n, t0 = 0, time.monotonic()
        deadline = t0 + args.seconds
        while time.monotonic() < deadline and n < 10_000_000:
            model(ids)
            sync()  # per-batch sync, as a serving loop does
            n += 1
        dt = time.monotonic() - t0
    print(json.dumps({"batches": n, "seconds": dt, "throughput": n * args.batch / dt}), flush=True)


# ---------------------------------------------------------------- orchestrator
async def run_workers(args: argparse.Namespace, envs: list[dict[str, str]]) -> list[dict]:
    import tempfile

    barrier = tempfile.mkdtemp(prefix="fp-hook-torch-")
    procs: list[asyncio.subprocess.Process] = []
    try:
        for env in envs:
            cmd = [sys.executable, __file__, "--worker", "--seconds", str(args.seconds),
                   "--preset", args.preset, "--batch", str(args.batch), "--dtype", args.dtype,
                   "--device", args.device, "--barrier", barrier, "--parties", str(len(envs))]
            procs.append(await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE,
                                                              stderr=subprocess.PIPE))
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)),
                                      args.seconds + STARTUP_S)
    finally:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.wait(), 10)
    results = []
    for p, (out, err) in zip(procs, outs, strict=True):
        hook_lines = [ln for ln in err.decode(errors="replace").splitlines() if "fp_hook" in ln]
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}): {err.decode(errors='replace')[-3000:]}")
        r = json.loads(out.decode().strip().splitlines()[-1])
        r["hook_log"] = hook_lines[-5:]
        results.append(r)
    return results


def base_env(hook: Path | None, sock: str | None = None, tenant: int = 0) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("LD_PRELOAD", None)
    for k in [k for k in env if k.startswith("FP_HOOK_")]:
        env.pop(k)
    if hook is not None:
        env["LD_PRELOAD"] = str(hook)
    if sock is not None:
        env["FP_HOOK_SOCKET"] = sock
        env["FP_HOOK_TENANT"] = str(tenant)
    return env


async def orchestrate(args: argparse.Namespace) -> dict:
    from flashpoint.gpu.hookbuild import build_hook
    from flashpoint.gpu.tokens import TokenManager
    from flashpoint.policy.tokens import TenantQuota, TokenConfig

    hook = build_hook()
    sock = f"/tmp/fp-hook-torch-{os.getpid()}.sock"
    res: dict = {"bench": "hook_torch", "seconds": args.seconds, "preset": args.preset, "batch": args.batch,
                 "dtype": args.dtype, "hook": str(hook), "token_ms": args.token_ms,
                 "window_ms": args.window_ms}

    # (a) overhead
    [plain] = await run_workers(args, [base_env(None)])
    [hooked] = await run_workers(args, [base_env(hook)])
    cfg = TokenConfig(window_ns=int(args.window_ms * 1e6), token_ns=int(args.token_ms * 1e6))
    mgr = TokenManager(sock, cfg)
    mgr.set_quota(1, TenantQuota(1.0, 1.0))
    await mgr.start()
    try:
        [gated] = await run_workers(args, [base_env(hook, sock, 1)])
    finally:
        await mgr.stop()
    res["overhead"] = {
        "plain_throughput": plain["throughput"],
        "hook_only_throughput": hooked["throughput"],
        "hook_manager_throughput": gated["throughput"],
        "hook_only_overhead": 1 - hooked["throughput"] / plain["throughput"],
        "hook_manager_overhead": 1 - gated["throughput"] / plain["throughput"],
        "grants": mgr.state.tenant_grants.get(1, 0),
    }

    # (b) 30 / 70
    mgr = TokenManager(sock, cfg)
    mgr.set_quota(1, TenantQuota(0.3, 0.3))
    mgr.set_quota(2, TenantQuota(0.7, 0.7))
    await mgr.start()
    try:
        a, b = await run_workers(args, [base_env(hook, sock, 1), base_env(hook, sock, 2)])
    finally:
        await mgr.stop()
    usage = mgr.usage_by_tenant()
    total = max(1, usage.get(1, 0) + usage.get(2, 0))
    res["shares"] = {
        "quota_a": 0.3,
        "share_a_manager": usage.get(1, 0) / total,
        "share_a_throughput": a["throughput"] / (a["throughput"] + b["throughput"]),
        "throughput_a": a["throughput"], "throughput_b": b["throughput"],
        "solo_fraction_a": a["throughput"] / plain["throughput"],
        "solo_fraction_b": b["throughput"] / plain["throughput"],
        "grants": {str(k): v for k, v in mgr.state.tenant_grants.items()},
        "hook_log": a["hook_log"] + b["hook_log"],
    }
    o, s = res["overhead"], res["shares"]
    res["pass"] = {
        "overhead_le_3pct": o["hook_manager_overhead"] <= 0.03,
        "share_manager_within_5pct": abs(s["share_a_manager"] - 0.3) <= 0.05,
        "share_throughput_within_5pct": abs(s["share_a_throughput"] - 0.3) <= 0.05,
        "hook_engaged": o["grants"] > 0 and len(s["grants"]) == 2
        and all(v > 0 for v in s["grants"].values()),
    }
    return res


def print_table(r: dict) -> None:
    o, s = r["overhead"], r["shares"]
    print(f"model bert/{r['preset']} batch {r['batch']} {r['dtype']}, {r['seconds']} s per run, "
          f"token {r['token_ms']} ms / window {r['window_ms']} ms")
    print(f"{'run':<28}{'samples/s':>12}{'overhead':>10}")
    print(f"{'no hook':<28}{o['plain_throughput']:>12.1f}{'':>10}")
    print(f"{'hook, no manager':<28}{o['hook_only_throughput']:>12.1f}{o['hook_only_overhead']:>10.2%}")
    print(f"{'hook + manager (100%)':<28}{o['hook_manager_throughput']:>12.1f}"
          f"{o['hook_manager_overhead']:>10.2%}   grants={o['grants']}")
    print(f"{'30/70: tenant A':<28}{s['throughput_a']:>12.1f}   share(manager)={s['share_a_manager']:.3f}"
          f" share(throughput)={s['share_a_throughput']:.3f} (target 0.300 +-0.05)")
    print(f"{'30/70: tenant B':<28}{s['throughput_b']:>12.1f}   grants={s['grants']}")
    print("checks:", ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in r["pass"].items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--preset", default="base")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--token-ms", type=float, default=10.0, help="token length granted by the manager")
    p.add_argument("--window-ms", type=float, default=100.0, help="quota accounting window")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # --device cpu: a dry run of the plumbing on a machine without CUDA (nothing is gated)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    p.add_argument("--barrier", default="", help=argparse.SUPPRESS)
    p.add_argument("--parties", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    try:
        import torch

        has_cuda = torch.cuda.is_available() or args.device == "cpu"
    except Exception as e:  # noqa: BLE001 - no/broken torch means no CUDA here
        has_cuda, why = False, f"torch unavailable: {e!r}"
    else:
        why = "torch.cuda.is_available() is False"
    if not has_cuda:
        print(f"no CUDA device ({why}); nothing to measure")
        print(json.dumps({"bench": "hook_torch", "skipped": "no CUDA", "reason": why}))
        return 0
    try:  # the manager side needs flashpoint's own dependencies (structlog, ...)
        import flashpoint.gpu.tokens  # noqa: F401
    except ImportError as e:
        print(f"cannot import the token manager ({e}); install flashpoint's dependencies "
              f"(pip install -e {ROOT}) or put the repo root on PYTHONPATH", file=sys.stderr)
        return 2
    res = asyncio.run(orchestrate(args))
    print_table(res)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
