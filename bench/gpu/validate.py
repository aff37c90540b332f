"""Every GPU check in one command, within a time budget (issue 22 item 9).

    bench/gpu/validate.sh [--dry-run] [--budget-s 470]      (results in $OUT or ./gpu-results)

Parts, each a child process with its own deadline (killed by its process group when late),
each writing ``<part>.json`` with ``status`` pass / fail / skipped and what it checked:

* ``cuda_ipc``    tests/gpu/test_weight_share.py's CUDA IPC test: two processes, one copy
                  of the weights on the GPU.
* ``kaas_cupy``   tests/kaas/test_gpu.py: a KaaS chain on CUDA against the CPU, and a CuPy
                  raw kernel (CuPy missing is a failure here, not a skip).
* ``pytest_gpu``  every other ``gpu``-marked test (``pytest -m gpu``; the three above run
                  as their own parts).
* ``hook_torch``  bench/gpu/hook_torch.py: the hook with torch, 30/70 throughput shares
                  within +-5% and hook + manager overhead <= 3%.
* ``mps``         bench/gpu/inventory_mps.py: read-only NVML/MIG inventory, then two MPS
                  workers at 30% and 70% SMs, each together against its solo profile.
* ``serve_cuda``  bench/gpu/serve_cuda.py: a one-host cluster serving on CUDA, cold-start
                  phases incl. to_device, outputs against the CPU; then host cache -> GPU
                  (to_device) within 1.2x a pinned-memory copy of the same bytes
                  (bench/gpu/pinned_copy.py).

A part passes only on evidence: a skipped GPU test, a bench that printed "skipped", or a
missing number is a failure on a machine with a GPU.  Nothing here changes MIG mode,
creates or destroys MIG instances or resets a GPU.  Without a GPU (or with ``--dry-run``)
every part is written as skipped with the reason, the summary says so, and it exits 0.
Exit status: 0 when every part passed (or all were skipped without a GPU), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "gpu"
PY = sys.executable
DEFAULT_BUDGET_S = 470.0  # the whole run must end within 8 minutes on one H100
MIN_PART_S = 20.0  # a part given less than this is failed as "out of budget", not started

IPC_TEST = "tests/gpu/test_weight_share.py::test_cuda_ipc_weights_shared_between_two_processes"
KAAS_TEST = "tests/kaas/test_gpu.py"
TORCH_HOOK_TEST = "tests/gpu_hook/test_gpu_torch.py"  # the same bench as part hook_torch
SHARE_TOL = 0.05
OVERHEAD_MAX = 0.03
MPS_TOGETHER_MIN = 0.8  # each MPS worker keeps >= 80% of its solo throughput at its share
PINNED_RATIO_MAX = 1.2


@dataclass
class Ran:
    """One finished (or killed) child process."""

    rc: int
    out: str
    err: str
    wall_s: float
    timed_out: bool


def run(cmd: list[str], timeout_s: float) -> Ran:
    """Run ``cmd`` in its own process group; kill that group (by the child's pid) when late."""
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                                   if os.environ.get("PYTHONPATH") else ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created: the child and its workers
        out, err = proc.communicate(timeout=30)
        timed_out = True
    return Ran(proc.returncode, out, err, time.monotonic() - t0, timed_out)


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that parses as a JSON object (benches print one last)."""
    for line in reversed(text.strip().splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return None


def junit_counts(path: Path) -> dict[str, Any]:
    """Tests, failures and skips (with their reasons) from a pytest junit XML file."""
    res: dict[str, Any] = {"tests": 0, "passed": 0, "failed": [], "skipped": []}
    if not path.exists():
        return res
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        res["tests"] += 1
        if case.find("skipped") is not None:
            res["skipped"].append(f"{name}: {case.find('skipped').get('message', '')}")
        elif case.find("failure") is not None or case.find("error") is not None:
            res["failed"].append(name)
        else:
            res["passed"] += 1
    return res


# ---------------------------------------------------------------- judging (pure)
def judge_pytest(ran: Ran, counts: dict[str, Any], want_at_least: int = 1) -> dict[str, Any]:
    """Pass only if tests ran, none failed and none skipped (a skipped GPU test checked nothing)."""
    problems = []
    if ran.timed_out:
        problems.append("timed out")
    if counts["tests"] < want_at_least:
        problems.append(f"{counts['tests']} tests ran, expected at least {want_at_least}")
    if counts["failed"]:
        problems.append(f"failed: {counts['failed']}")
    if counts["skipped"]:
        problems.append(f"skipped on a GPU machine: {counts['skipped']}")
    if ran.rc != 0 and not problems:
        problems.append(f"pytest exited {ran.rc}: {ran.err[-500:] or ran.out[-500:]}")
    return {"status": "fail" if problems else "pass", "problems": problems, **counts}


def judge_hook_torch(res: dict[str, Any] | None) -> dict[str, Any]:
    """Shares 30/70 within +-5% (throughput and manager) and overhead <= 3%."""
    if res is None:
        return {"status": "fail", "problems": ["no JSON result"]}
    if "skipped" in res:
        return {"status": "fail", "problems": [f"bench skipped on a GPU machine: {res}"]}
    try:
        o, s = res["overhead"], res["shares"]
        checks = {
            "share_throughput": abs(s["share_a_throughput"] - 0.30) <= SHARE_TOL,
            "share_manager": abs(s["share_a_manager"] - 0.30) <= SHARE_TOL,
            "overhead": o["hook_manager_overhead"] <= OVERHEAD_MAX,
            "hook_engaged": bool(res["pass"]["hook_engaged"]),
        }
        numbers = {"share_a_throughput": s["share_a_throughput"], "share_a_manager": s["share_a_manager"],
                   "hook_manager_overhead": o["hook_manager_overhead"],
                   "hook_only_overhead": o["hook_only_overhead"]}
    except (KeyError, TypeError) as e:
        return {"status": "fail", "problems": [f"result lacks {e!r}"]}
    problems = [k for k, ok in checks.items() if not ok]
    return {"status": "fail" if problems else "pass", "problems": problems, "checks": checks,
            "numbers": numbers}


def judge_mps(res: dict[str, Any] | None, shares: tuple[int, int] = (30, 70)) -> dict[str, Any]:
    """MPS started; each worker together keeps >= 80% of its solo throughput; the smaller
    share's solo profile is slower than the larger's (the shares took effect)."""
    if res is None:
        return {"status": "fail", "problems": ["no JSON result"]}
    if not res.get("gpu"):
        return {"status": "fail", "problems": [f"no GPU used: {res.get('reason')}"]}
    mps = res.get("mps") or {}
    if not mps.get("started"):
        return {"status": "fail", "problems": [f"MPS did not start: {mps.get('reason')}"]}
    if mps.get("error"):
        return {"status": "fail", "problems": [f"MPS run failed: {mps['error']}"]}
    try:
        solo = [w["items_per_s"] for w in mps["solo"]]
        together = [w["items_per_s"] for w in mps["together"]]
    except (KeyError, TypeError) as e:
        return {"status": "fail", "problems": [f"result lacks {e!r}"]}
    if len(solo) != len(shares) or len(together) != len(shares) or min(solo) <= 0:
        return {"status": "fail", "problems": [f"incomplete: solo={solo} together={together}"]}
    ratios = [t / s for t, s in zip(together, solo, strict=True)]
    problems = [f"{sh}% worker kept {r:.2f} of its solo throughput (< {MPS_TOGETHER_MIN})"
                for sh, r in zip(shares, ratios, strict=True) if r < MPS_TOGETHER_MIN]
    if not solo[0] < solo[1]:
        problems.append(f"solo at {shares[0]}% ({solo[0]:.1f}/s) not slower than at {shares[1]}% "
                        f"({solo[1]:.1f}/s): the SM shares did not take effect")
    return {"status": "fail" if problems else "pass", "problems": problems,
            "numbers": {"solo_items_per_s": solo, "together_items_per_s": together,
                        "together_over_solo": ratios,
                        "mig": [g.get("mig_mode") for g in res.get("gpus", [])]}}


def judge_serve(res: dict[str, Any] | None, pinned: dict[str, Any] | None) -> dict[str, Any]:
    """Cold starts from host RAM with a measured to_device phase, outputs equal to the CPU's,
    and to_device within 1.2x a pinned copy of the same bytes."""
    if res is None:
        return {"status": "fail", "problems": ["no JSON result from serve_cuda"]}
    if "skipped" in res:
        return {"status": "fail", "problems": [f"serve_cuda skipped on a GPU machine: {res}"]}
    problems = []
    ram = [r for r in res.get("rows", []) if r.get("row") == "ram"]
    if not ram:
        problems.append("no scale-from-zero with the model in host RAM")
    for r in ram:
        missing = [k for k in ("fetch", "load", "to_device", "first_inference") if k not in r]
        if missing or r.get("to_device", 0) <= 0:
            problems.append(f"cold start lacks phases {missing or ['to_device > 0']}: {r}")
    if not res.get("outputs_match_cpu"):
        problems.append("GPU outputs differ from the CPU reference")
    ratio = None
    if pinned is None or not pinned.get("median_s"):
        problems.append("no pinned-copy reference")
    elif ram:
        ratio = res["ram_to_device_s_median"] / pinned["median_s"]
        if ratio > PINNED_RATIO_MAX:
            problems.append(f"to_device {res['ram_to_device_s_median'] * 1e3:.1f} ms is {ratio:.2f}x "
                            f"a pinned copy ({pinned['median_s'] * 1e3:.1f} ms), over {PINNED_RATIO_MAX}x")
    return {"status": "fail" if problems else "pass", "problems": problems,
            "numbers": {"model_bytes": res.get("model_bytes"),
                        "ram_to_device_s_median": res.get("ram_to_device_s_median"),
                        "pinned_copy_s": (pinned or {}).get("median_s"), "to_device_over_pinned": ratio,
                        "ram_wall_s_median": res.get("ram_wall_s_median"),
                        "warm_p50_ms": res.get("warm_p50_ms")}}


# ---------------------------------------------------------------- parts (run on a GPU)
def _pytest(out: Path, name: str, args: list[str], timeout_s: float, want: int) -> dict[str, Any]:
    xml = out / f"{name}.xml"
    ran = run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}", *args],
              timeout_s)
    res = judge_pytest(ran, junit_counts(xml), want)
    res["tail"] = ran.out[-2000:]
    return res


def part_cuda_ipc(out: Path, timeout_s: float) -> dict[str, Any]:
    return _pytest(out, "cuda_ipc", [IPC_TEST], timeout_s, 1)


def part_kaas_cupy(out: Path, timeout_s: float) -> dict[str, Any]:
    return _pytest(out, "kaas_cupy", [KAAS_TEST], timeout_s, 2)


def part_pytest_gpu(out: Path, timeout_s: float) -> dict[str, Any]:
    return _pytest(out, "pytest_gpu", ["-m", "gpu", "tests", f"--deselect={IPC_TEST}",
                                       f"--ignore={KAAS_TEST}", f"--ignore={TORCH_HOOK_TEST}"],
                   timeout_s, 1)


def part_hook_torch(out: Path, timeout_s: float) -> dict[str, Any]:
    ran = run([PY, str(BENCH / "hook_torch.py"), "--seconds", "5", "--preset", "small"], timeout_s)
    res = last_json(ran.out)
    verdict = judge_hook_torch(res)
    if ran.timed_out or ran.rc != 0:
        verdict = {**verdict, "status": "fail",
                   "problems": [*verdict.get("problems", []), f"rc={ran.rc} timed_out={ran.timed_out}",
                                ran.err[-1500:]]}
    return {**verdict, "result": res}


def part_mps(out: Path, timeout_s: float) -> dict[str, Any]:
    ran = run([PY, str(BENCH / "inventory_mps.py"), "--seconds", "5", "--shares", "30,70"], timeout_s)
    res = last_json(ran.out)
    verdict = judge_mps(res)
    if ran.timed_out or ran.rc != 0:
        verdict = {**verdict, "status": "fail",
                   "problems": [*verdict.get("problems", []), f"rc={ran.rc} timed_out={ran.timed_out}",
                                ran.err[-1500:]]}
    return {**verdict, "result": res}


def part_serve_cuda(out: Path, timeout_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    ran = run([PY, str(BENCH / "serve_cuda.py"), "--repeats", "2", "--warm", "50"], timeout_s)
    res = last_json(ran.out)
    pinned = None
    left = timeout_s - (time.monotonic() - t0)
    if res and res.get("model_bytes") and left > 10:
        pr = run([PY, str(BENCH / "pinned_copy.py"), str(int(res["model_bytes"]))], left)
        pinned = last_json(pr.out) if pr.rc == 0 else None
    verdict = judge_serve(res, pinned)
    if ran.timed_out or ran.rc != 0:
        verdict = {**verdict, "status": "fail",
                   "problems": [*verdict.get("problems", []), f"rc={ran.rc} timed_out={ran.timed_out}",
                                ran.err[-1500:]]}
    return {**verdict, "result": res, "pinned": pinned}


PartFn = Callable[[Path, float], dict[str, Any]]
# (name, function, its own cap in seconds); quick ones first, so a slow one cannot starve them
PARTS: list[tuple[str, PartFn, float]] = [
    ("cuda_ipc", part_cuda_ipc, 60.0),
    ("kaas_cupy", part_kaas_cupy, 60.0),
    ("pytest_gpu", part_pytest_gpu, 120.0),
    ("hook_torch", part_hook_torch, 120.0),
    ("mps", part_mps, 100.0),
    ("serve_cuda", part_serve_cuda, 130.0),
]


def gpu_present() -> tuple[bool, str]:
    """Whether torch sees a CUDA device (asked in a child: this process stays CUDA-free)."""
    try:
        ran = run([PY, "-c", "import torch, json; print(json.dumps([torch.cuda.is_available(), "
                   "torch.cuda.device_count(), torch.cuda.get_device_name(0) "
                   "if torch.cuda.is_available() else '']))"], 120.0)
    except OSError as e:
        return False, f"cannot run {PY}: {e}"
    if ran.rc != 0:
        return False, f"torch not importable: {ran.err.strip()[-300:]}"
    try:
        ok, n, name = json.loads(ran.out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"unexpected answer from torch: {ran.out[-300:]}"
    if not ok:
        return False, "torch.cuda.is_available() is False"
    return True, f"{n} CUDA device(s), first {name}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="run nothing; write every part as skipped")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if args.dry_run:
        gpu, why = False, "dry run (--dry-run)"
    else:
        gpu, why = gpu_present()
    summary: dict[str, Any] = {"gpu": gpu, "dry_run": args.dry_run, "reason": why,
                               "budget_s": args.budget_s, "passed": [], "failed": [], "skipped": [],
                               "parts": {}}
    print(f"GPU validation: {why}; results in {out}", flush=True)
    for name, fn, cap in PARTS:
        if not gpu:
            res: dict[str, Any] = {"status": "skipped", "reason": why}
        else:
            left = args.budget_s - (time.monotonic() - start)
            if left < MIN_PART_S:
                res = {"status": "fail",
                       "problems": [f"out of budget ({left:.0f} s left of {args.budget_s})"]}
            else:
                t0 = time.monotonic()
                try:
                    res = fn(out, min(cap, left))
                except Exception as e:  # noqa: BLE001 - one broken part must not hide the others
                    res = {"status": "fail", "problems": [f"part crashed: {e!r}"]}
                res["wall_s"] = round(time.monotonic() - t0, 1)
        res["part"] = name
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        bucket = {"pass": "passed", "fail": "failed", "skipped": "skipped"}[res["status"]]
        summary[bucket].append(name)
        summary["parts"][name] = {k: res[k] for k in ("status", "reason", "problems", "numbers", "wall_s")
                                  if k in res}
        detail = res.get("reason") or "; ".join(map(str, res.get("problems", []))) or ""
        print(f"{res['status'].upper():8s} {name:12s} {detail[:300]}", flush=True)
    summary["wall_s"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary[k] for k in ("gpu", "reason", "passed", "failed", "skipped", "wall_s")}))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
