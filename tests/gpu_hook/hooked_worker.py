"""A worker-like Python process for tests/gpu_hook/test_host_tokens.py.

Started the way a tokens host starts its warm pool: the hook in ``LD_PRELOAD`` but no
socket or tenant yet. It then reads one JSON line, its "deploy" (``{"env", "seconds",
"kernel_us"}``), applies ``env`` with the worker's own ``apply_env`` (as ``load_replica``
does) *before* it loads the driver, and launches busy-wait kernels of the fake
``libcuda.so.1`` through ctypes (so through the hook's ``dlsym``), synchronising every four
launches, for ``seconds``. Optional ``delay_s`` idles before the first launch and
``linger_s`` idles after the last one (the process, and its hook's connection, stay: a
tenant whose demand rises and falls). Prints ``{"launches", "wall_ns", "socket_seen"}``;
the fake driver writes its busy time to ``FAKE_CUDA_STATS`` at exit.

With ``"mode": "alloc"`` it serves memory commands instead, one JSON line each:
``{"alloc": N, "chunk": BYTES}`` allocates up to N chunks (stopping at the first error) and
prints ``{"ok", "error", "free", "total"}`` (``cuMemGetInfo`` after); ``{"exit": true}`` ends.
"""

import ctypes
import json
import os
import sys
import time

from flashpoint.gpu.worker_env import apply_env


def main() -> int:
    msg = json.loads(sys.stdin.readline())
    loaded = False  # this process initialises "CUDA" only below
    apply_env(msg["env"], cuda_initialized=lambda: loaded)
    cuda = ctypes.CDLL("libcuda.so.1")
    loaded = True
    cuda.cuInit(0)
    if msg.get("mode") == "alloc":
        return serve_alloc(cuda)
    ns = ctypes.c_uint64(int(msg["kernel_us"]) * 1000)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(ns))
    launch = cuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                  ctypes.c_void_p, ctypes.c_void_p]
    time.sleep(float(msg.get("delay_s", 0.0)))  # the workload's shape: no demand yet
    t0 = time.monotonic_ns()
    end = t0 + int(float(msg["seconds"]) * 1e9)
    n = 0
    while time.monotonic_ns() < end and n < 1_000_000:
        if launch(None, 1, 1, 1, 1, 1, 1, 0, None, ctypes.cast(params, ctypes.c_void_p), None):
            return 3
        n += 1
        if n % 4 == 0:
            cuda.cuCtxSynchronize()
    cuda.cuCtxSynchronize()
    time.sleep(float(msg.get("linger_s", 0.0)))  # demand gone, the process still there
    print(json.dumps({"launches": n, "wall_ns": time.monotonic_ns() - t0,
                      "socket_seen": os.environ.get("FP_HOOK_SOCKET", "")}), flush=True)
    return 0


def serve_alloc(cuda: ctypes.CDLL) -> int:
    alloc = cuda.cuMemAlloc_v2
    alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    info = cuda.cuMemGetInfo_v2
    info.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    for _ in range(100):  # bounded
        cmd = json.loads(sys.stdin.readline() or '{"exit": true}')
        if cmd.get("exit"):
            return 0
        ok, err = 0, 0
        for _ in range(int(cmd["alloc"])):
            p = ctypes.c_uint64(0)
            err = alloc(ctypes.byref(p), int(cmd["chunk"]))
            if err:
                break
            ok += 1
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        info(ctypes.byref(free), ctypes.byref(total))
        print(json.dumps({"ok": ok, "error": err, "free": free.value, "total": total.value}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
