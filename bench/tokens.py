"""Token manager benchmark, no GPU needed: grant round trip and share accuracy.

* Round trip: a client on the Unix socket sends REQUEST and waits for GRANT, N times, with
  the GPU free (what a launch pays when its token has run out and nobody competes).
* Share accuracy: two launcher processes with the hook preloaded, against a fake
  libcuda.so.1 whose "kernels" busy-wait, run at the same time under each quota pair; the
  share is measured from the fake driver's busy time and from the manager's accounting.
  ``busy/span`` is both programs' busy time over the span they ran together; above 1 means
  a kernel launched just before a token expired overlapped the next holder (overuse, which
  is charged back to its tenant).

Prints a table and a final JSON line.  Usage::

    PYTHONPATH=. python bench/tokens.py [--seconds 3] [--rtt-n 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashpoint.gpu.hookbuild import build_hook  # noqa: E402
from flashpoint.gpu.token_client import TokenClient  # noqa: E402
from flashpoint.gpu.tokens import TokenManager  # noqa: E402
from flashpoint.policy.tokens import TenantQuota  # noqa: E402

CSRC = ROOT / "tests" / "gpu_hook" / "csrc"
PAIRS = ((0.1, 0.9), (0.3, 0.7), (0.5, 0.5))


def build_kit(d: Path) -> tuple[Path, Path]:
    """The fake driver and the launcher (test sources), built into ``d``."""
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1", "-o",
                    str(d / "libcuda.so.1"), str(CSRC / "fake_cuda.c")], check=True, timeout=60)
    subprocess.run(["gcc", "-O2", "-o", str(d / "launcher"), str(CSRC / "launcher.c"), "-ldl"],
                   check=True, timeout=60)
    return d / "libcuda.so.1", d / "launcher"


def rtt_client(sock: str, n: int, deadline_s: float) -> list[float]:
    """Blocking REQUEST -> GRANT round trips in microseconds (bounded by count and time).

    :class:`TokenClient` matches each GRANT to its request by seq and applies the MEM cap
    the manager sends after HELLO (reading that MEM as the first GRANT was issue 22's crash)."""
    out: list[float] = []
    with TokenClient(sock, tenant=9, timeout_s=2.0) as client:
        end = time.monotonic() + deadline_s
        for _ in range(n):
            if time.monotonic() > end:
                break
            t0 = time.perf_counter_ns()
            client.request(used_ns=1000)
            out.append((time.perf_counter_ns() - t0) / 1000)
    return out


async def run_pair(hook: Path, libdir: Path, launcher: Path, sock: str, tmp: Path, qa: float, qb: float,
                   seconds: float) -> dict:
    mgr = TokenManager(sock)
    mgr.set_quota(1, TenantQuota(qa, qa))
    mgr.set_quota(2, TenantQuota(qb, qb))
    await mgr.start()
    procs = []
    try:
        for tenant in (1, 2):
            env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(hook), "LD_LIBRARY_PATH": str(libdir),
                   "FP_HOOK_LIBCUDA": str(libdir / "libcuda.so.1"), "FP_HOOK_SOCKET": sock,
                   "FP_HOOK_TENANT": str(tenant), "FAKE_CUDA_STATS": str(tmp / f"s{tenant}.json")}
            procs.append(await asyncio.create_subprocess_exec(
                str(launcher), "run", str(seconds), "1000", "4", "proc", env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = [await asyncio.wait_for(p.communicate(), seconds + 10) for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        await mgr.stop()
    busy = [json.loads((tmp / f"s{t}.json").read_text())["busy_ns"] for t in (1, 2)]
    runs = [json.loads(o[0]) for o in outs]
    span_ns = max(r["t1_ns"] for r in runs) - min(r["t0_ns"] for r in runs)  # CLOCK_MONOTONIC
    usage = mgr.usage_by_tenant()
    share = busy[0] / sum(busy)
    return {"quota_a": qa, "quota_b": qb, "share_a": round(share, 4),
            "error_abs": round(abs(share - qa / (qa + qb)), 4),
            "mgr_share_a": round(usage[1] / (usage[1] + usage[2]), 4),
            "busy_over_span": round(sum(busy) / span_ns, 4)}


async def main_async(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="fp-bench-tokens-"))
    hook = build_hook()
    fake, launcher = build_kit(tmp)
    sock = f"/tmp/fp-bench-{os.getpid()}.sock"
    mgr = TokenManager(sock)
    mgr.set_quota(9, TenantQuota(1.0, 1.0))
    await mgr.start()
    try:
        rtts = await asyncio.to_thread(rtt_client, sock, args.rtt_n, 30.0)
    finally:
        await mgr.stop()
    q = statistics.quantiles(rtts, n=100)
    rtt = {"n": len(rtts), "p50_us": round(statistics.median(rtts), 1), "p99_us": round(q[98], 1)}
    pairs = [await run_pair(hook, tmp, launcher, sock, tmp, a, b, args.seconds) for a, b in PAIRS]
    return {"bench": "tokens", "seconds_per_pair": args.seconds, "grant_rtt": rtt, "shares": pairs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rtt-n", type=int, default=3000)
    res = asyncio.run(main_async(p.parse_args()))
    r = res["grant_rtt"]
    print(f"grant round trip (Python client, idle GPU): n={r['n']} p50={r['p50_us']} us p99={r['p99_us']} us")
    print(f"{'quotas':>10} {'share_a':>8} {'|err|':>7} {'mgr_share_a':>12} {'busy/span':>12}")
    for s in res["shares"]:
        print(f"{s['quota_a']:.1f}/{s['quota_b']:.1f}".rjust(10),
              f"{s['share_a']:8.4f} {s['error_abs']:7.4f} {s['mgr_share_a']:12.4f}",
              f"{s['busy_over_span']:12.4f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
