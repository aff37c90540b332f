"""Time receiver selection (thesis §5.2.3) at cluster scale (target < 1 s).

Cluster: 250 hosts x 8 GPUs = 2,000 GPUs, 25 hosts per leaf switch (10 leaves), hops 2 or 4
to the registry, 3 hosts dead and 3 draining. GPUs have 80 GB with mixed free memory
(80/64/48/32/16 GB) and mixed free compute; hosts have 64/256/512 GB of free RAM. A replica
needs 6 GB and 0.1 of a GPU, a download 12 GB and a worker process 2 GB of host RAM, so a GPU
takes 2 to 10 replicas and some hosts run out of RAM first: every constraint binds somewhere.

Two workloads, timing only :func:`select_receivers` (building the next snapshot is the
controller's cost and is reported apart):

* ``one``: 10,000 replicas of one model in one decision; 20 hosts over 3 leaves hold it.
  Median of ``--repeats`` runs.
* ``many``: 1,000 scale-ups of 10 replicas, cycling over 20 models (2 holder hosts each);
  each decision sees the cluster as the previous ones left it (reservations applied, primed
  hosts now holding the model).

The reference point: Dilu schedules 3,200 instances in 1.12 s. The last line is one JSON
object.

    .venv/bin/python bench/placement.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import time

from flashpoint.policy.placement import PlacementDecision, PlacementRequest, select_receivers
from flashpoint.policy.snapshot import ClusterSnapshot, DeviceSnapshot, HostSnapshot

TARGET_S = 1.0
DILU_S, DILU_INSTANCES = 1.12, 3200
GB = 1_000_000_000
HOSTS, GPUS_PER_HOST, HOSTS_PER_LEAF = 250, 8, 25


def cluster(seed: int, holders: dict[str, list[int]]) -> ClusterSnapshot:
    """The benchmark cluster; ``holders`` maps a model key to the host indices holding it."""
    rng = random.Random(seed)
    held: dict[int, set[str]] = {}
    for key, idx in holders.items():
        for i in idx:
            held.setdefault(i, set()).add(key)
    dead = set(rng.sample(range(HOSTS), 6))
    draining = set(sorted(dead)[:3])
    hosts = []
    for i in range(HOSTS):
        hid = f"h{i:03d}"
        devs = tuple(
            DeviceSnapshot(hid, f"cuda:{g}", "cuda", 80 * GB,
                           rng.choice((80, 64, 48, 32, 16)) * GB, rng.choice((0, 0, 0, 1, 2)),
                           compute_free=rng.choice((1.0, 1.0, 0.8, 0.5)))
            for g in range(GPUS_PER_HOST))
        hosts.append(HostSnapshot(hid, alive=i not in dead - draining, draining=i in draining,
                                  ram_free_bytes=rng.choice((64, 256, 512)) * GB,
                                  cached_models=frozenset(held.get(i, ())), devices=devs,
                                  leaf=f"leaf{i // HOSTS_PER_LEAF}", hops=rng.choice((2, 4))))
    return ClusterSnapshot(0.0, tuple(hosts))


def request(model: str, count: int) -> PlacementRequest:
    return PlacementRequest("f-" + model, model, count, device_bytes=6 * GB, host_bytes=12 * GB,
                            compute=0.1, process_bytes=2 * GB)


def apply(snap: ClusterSnapshot, req: PlacementRequest, dec: PlacementDecision) -> ClusterSnapshot:
    """The cluster after a decision: reservations taken, primed hosts holding the model."""
    per_dev: dict[tuple[str, str], int] = {}
    for p in dec.placements:
        per_dev[(p.host_id, p.device_id)] = per_dev.get((p.host_id, p.device_id), 0) + 1
    touched = {p.host_id for p in dec.placements}
    primed = set(dec.downloads)
    hosts = []
    for h in snap.hosts:
        if h.host_id not in touched:
            hosts.append(h)
            continue
        devs = []
        n_host = 0
        for d in h.devices:
            n = per_dev.get((h.host_id, d.device_id), 0)
            n_host += n
            devs.append(d if not n else dataclasses.replace(
                d, memory_free_bytes=d.memory_free_bytes - n * req.device_bytes,
                replicas=d.replicas + n, compute_free=d.compute_free - n * req.compute))
        ram = h.ram_free_bytes - n_host * req.process_bytes
        cached = h.cached_models
        if h.host_id in primed:
            ram -= req.host_bytes
            cached = cached | {req.model_key}
        hosts.append(dataclasses.replace(h, ram_free_bytes=ram, cached_models=cached,
                                         devices=tuple(devs)))
    return ClusterSnapshot(snap.now_s, tuple(hosts))


def check(snap: ClusterSnapshot) -> None:
    """Nothing over-committed (untimed)."""
    for h in snap.hosts:
        assert h.ram_free_bytes >= 0, h.host_id
        for d in h.devices:
            assert d.memory_free_bytes >= 0 and d.compute_free > -1e-6, (h.host_id, d.device_id)


def bench_one(repeats: int) -> dict:
    rng = random.Random(1)
    holder_idx = rng.sample(range(0, 3 * HOSTS_PER_LEAF), 20)  # all under leaves 0-2
    snap = cluster(0, {"big@1": holder_idx})
    req = request("big@1", 10_000)
    times = []
    dec = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        dec = select_receivers(snap, req)
        times.append(time.perf_counter() - t0)
    assert dec is not None
    check(apply(snap, req, dec))
    gpus = len({(p.host_id, p.device_id) for p in dec.placements})
    med = statistics.median(times)
    print(f"one   10,000 replicas / 2,000 GPUs in one decision: median {med:.3f} s  "
          f"min {min(times):.3f}  max {max(times):.3f} ({repeats} runs)")
    print(f"      placed {len(dec.placements)} on {gpus} GPUs, primed {len(dec.downloads)} "
          f"hosts, unplaced {dec.unplaced}" + (f" ({dec.reason})" if dec.reason else ""))
    return {"replicas": req.count, "median_s": med, "min_s": min(times), "max_s": max(times),
            "placed": len(dec.placements), "gpus_used": gpus, "primed_hosts": len(dec.downloads),
            "unplaced": dec.unplaced}


def bench_many(requests: int, per_request: int) -> dict:
    rng = random.Random(2)
    models = [f"m{i}@1" for i in range(20)]
    snap = cluster(0, {m: rng.sample(range(HOSTS), 2) for m in models})
    decide_s: list[float] = []
    update_s = 0.0
    placed = unplaced = 0
    for i in range(requests):
        req = request(models[i % len(models)], per_request)
        t0 = time.perf_counter()
        dec = select_receivers(snap, req)
        decide_s.append(time.perf_counter() - t0)
        placed += len(dec.placements)
        unplaced += dec.unplaced
        t0 = time.perf_counter()
        snap = apply(snap, req, dec)
        update_s += time.perf_counter() - t0
    check(snap)
    total = sum(decide_s)
    p99 = sorted(decide_s)[int(0.99 * (len(decide_s) - 1))]
    print(f"many  {requests:,} scale-ups of {per_request}: total {total:.3f} s, "
          f"mean {1e3 * total / requests:.3f} ms, p99 {1e3 * p99:.3f} ms per decision "
          f"(snapshot updates apart: {update_s:.3f} s)")
    print(f"      placed {placed}, unplaced {unplaced}")
    return {"requests": requests, "per_request": per_request, "total_s": total,
            "mean_ms": 1e3 * total / requests, "p99_ms": 1e3 * p99, "snapshot_update_s": update_s,
            "placed": placed, "unplaced": unplaced}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    one = bench_one(max(1, a.repeats))
    many = bench_many(1000, 10)
    dilu_per_k = DILU_S / DILU_INSTANCES * 1000
    print(f"{'workload':<28}{'time s':>10}{'target s':>10}{'ratio':>8}{'ms/1k replicas':>16}")
    for name, t, n in (("one: 10,000 in 1 decision", one["median_s"], one["placed"]),
                       ("many: 1,000 x 10", many["total_s"], many["placed"])):
        print(f"{name:<28}{t:>10.3f}{TARGET_S:>10.3f}{t / TARGET_S:>8.3f}"
              f"{1e3 * t / max(1, n) * 1000:>16.2f}")
    print(f"{'Dilu: 3,200 instances':<28}{DILU_S:>10.3f}{'':>10}{'':>8}{dilu_per_k * 1e3:>16.2f}")
    met = one["median_s"] < TARGET_S and many["total_s"] < TARGET_S
    print(f"placement under {TARGET_S} s: {'met' if met else 'NOT met'}")
    print(json.dumps({"bench": "placement", "machine": platform.processor() or platform.machine(),
                      "hosts": HOSTS, "gpus": HOSTS * GPUS_PER_HOST, "one": one, "many": many,
                      "target_s": TARGET_S, "dilu_s_per_3200": DILU_S, "target_met": met}))


if __name__ == "__main__":
    main()
