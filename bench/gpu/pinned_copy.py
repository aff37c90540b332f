"""Pinned host memory -> GPU copy of N bytes: the reference the platform's to_device is held to.

    python bench/gpu/pinned_copy.py BYTES [--repeats 5]

Allocates one pinned (page-locked) uint8 tensor of BYTES, copies it to ``cuda:0`` REPEATS
times (after one warm-up copy), synchronizing after each, and prints one JSON line
``{"bytes", "median_s", "min_s", "gbps"}``.  Exits 3 with a message without CUDA (a caller
that expected a GPU must fail, not read a number).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bytes", type=int)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: cannot measure a pinned copy", file=sys.stderr)
        return 3
    host = torch.empty(args.bytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(args.bytes, dtype=torch.uint8, device="cuda:0")
    dev.copy_(host, non_blocking=True)  # warm-up: context, allocator, DMA mappings
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(json.dumps({"bytes": args.bytes, "median_s": med, "min_s": min(times),
                      "gbps": args.bytes / med / 1e9}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
