"""How many intra-op threads a CPU worker's torch gets (pure; ``[host] torch_threads``).

A CPU device is a placement unit, like a GPU: the host's cores are shared among its CPU
devices, and a replica on a device computes with that device's share. One thread per
worker (the old fixed default) left a one-device host computing on one core of many: bert
base at 128 tokens took ~240 ms on one of this VM's two vCPUs and ~150 ms on both (see
bench/RESULTS.md, issue 20 item 7). More threads than the share would oversubscribe the
cores when every device is busy, which intra-op thread pools handle badly (their threads
spin while they wait for each other).

On a GPU host a worker's torch computes on the GPU; its CPU side is light, and many workers
share a GPU (MPS, tokens, MIG slices), so each keeps one thread.
"""

from __future__ import annotations


def intra_op_threads(configured: int, cores: int, cpu_devices: int, gpus: int) -> int:
    """``configured`` when set (> 0); else, on a CPU-only host, the cores divided evenly
    among its CPU devices (at least one); on a GPU host, one."""
    if configured > 0:
        return configured
    if gpus > 0:
        return 1
    return max(1, cores // max(1, cpu_devices))


def usable_cores(configured: int, available: int) -> int:
    """The cores a host's CPU devices share: ``[host] cpu_cores`` when set, else what this
    process may run on."""
    return configured if configured > 0 else max(1, available)
