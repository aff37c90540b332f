"""Soak: a bounded run at ~80% of capacity with a spot eviction every minute (issue 6, item 7).

A :class:`~flashpoint.cluster.LocalCluster` of ``--hosts`` spot hosts, each watching its own
eviction-notice file; the cluster's provider replaces an evicted host with a new spot host
that watches its own file too. One function (tiny BERT, one replica per host).

1. **Capacity**: closed loop, ``--concurrency`` clients for ``--probe-s`` seconds: the
   sustained req/s R.
2. **Soak**: open loop at ``--load`` × R (default 0.8) for ``--minutes``; every
   ``--evict-every-s`` the oldest live host gets its notice (``--lead-s`` to go). Every
   request is checked: status 200 and the right output shape, else counted as failed.

Reported: requests, failures (target 0), latency percentiles, evictions and the kinds of the
replacements, the cost meter, and this process's RSS (the controller and every host manager
live in it) after the first minute vs at the end (target growth < 5%). Worker processes are
separate and replaced with their hosts; the count alive at the end is reported too.

    python bench/soak.py [--minutes 5] [--quick]

The last line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flashpoint.cluster import LocalCluster  # noqa: E402
from flashpoint.config import load_config  # noqa: E402
from flashpoint.models import zoo  # noqa: E402
from flashpoint.models.sources import publish  # noqa: E402
from flashpoint.registry.local import LocalStore  # noqa: E402

FN = "soak-fn"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="fp-soak-"))
    notices = tmp / "notices"
    notices.mkdir()
    cfg = load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05,
                       "drain_margin_s": 5.0},
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "cache_dir": str(tmp / "cache"), "spot_poll_interval_s": 0.2},
    }).with_home(tmp)
    store = LocalStore(cfg.registry.root)
    manifest = await publish(store, "bert", "tiny", "1", model_name="bert")
    x = zoo.example_inputs("bert", manifest.config, 1, seed=0)["input_ids"]
    body = {"inputs": {"input_ids": {"data": x.ravel().tolist(), "shape": list(x.shape),
                                     "datatype": "INT64"}}}

    def host_config(kind: str, host_id: str) -> dict[str, Any]:
        return {"spot_notice": f"file:{notices / host_id}"}

    cluster = LocalCluster(cfg, hosts=0, store=store)
    cluster.provider.host_config = host_config
    await cluster.start()
    for _ in range(args.hosts):
        hid = cluster.next_host_id()
        await cluster.add_host(kind="spot", **host_config("spot", hid))
    url = cluster.controller.url
    worker_pids: set[int] = set()
    out: dict[str, Any] = {"bench": "soak", "hosts": args.hosts}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(f"{url}/v1/functions", json={
                    "name": FN, "model": "bert", "min_replicas": args.hosts,
                    "max_replicas": args.hosts, "keep_alive_s": 3600,
                    "replica_concurrency": 16}) as r:
                assert r.status == 201, await r.text()
            deadline = time.monotonic() + 120
            while sum(r.phase == "warm" for r in cluster.controller.state.replicas.values()) \
                    < args.hosts:
                assert time.monotonic() < deadline, "replicas never warmed"
                await asyncio.sleep(0.2)

            async def one() -> tuple[bool, float]:
                t = time.monotonic()
                try:
                    async with s.post(f"{url}/v1/functions/{FN}/invoke", json=body) as r:
                        reply = await r.json(content_type=None)
                        ok = r.status == 200 and reply["outputs"]["logits"]["shape"] == [1, 2]
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                    ok = False
                return ok, time.monotonic() - t

            # 1. capacity (closed loop)
            done = 0
            stop_at = time.monotonic() + args.probe_s

            async def closed() -> None:
                nonlocal done
                while time.monotonic() < stop_at:
                    ok, _ = await one()
                    done += ok

            t0 = time.monotonic()
            await asyncio.gather(*(closed() for _ in range(args.concurrency)))
            capacity = done / (time.monotonic() - t0)
            rate = args.load * capacity
            print(f"  capacity {capacity:.1f} req/s; soaking at {rate:.1f} req/s "
                  f"for {args.minutes} min", flush=True)

            # 2. soak (open loop) with evictions
            results: list[tuple[bool, float]] = []
            pending: set[asyncio.Task] = set()
            evictions: list[dict[str, Any]] = []
            rss_first_minute: int | None = None
            start = time.monotonic()
            end = start + args.minutes * 60
            next_evict = start + args.evict_every_s
            sent = 0
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if rss_first_minute is None and now - start >= min(60.0, args.minutes * 30):
                    rss_first_minute = rss_bytes()
                if now >= next_evict:
                    live = [h for h in cluster.hosts if not h.evicted.is_set() and h.notice is None]
                    if len(live) > 1:
                        victim = live[0]
                        (notices / victim.host_id).write_text(
                            json.dumps({"action": "terminate", "seconds": args.lead_s}))
                        evictions.append({"host_id": victim.host_id, "at_s": round(now - start, 1)})
                        print(f"  t={now - start:.0f}s evict {victim.host_id}", flush=True)
                    next_evict += args.evict_every_s
                for h in cluster.hosts:
                    worker_pids.update(w.proc.pid for w in h.workers.values() if w.proc)
                # Open loop: requests leave on schedule whatever the replies do.
                due = int((now - start) * rate) - sent
                for _ in range(max(0, min(due, 1000))):
                    task = asyncio.ensure_future(one())
                    task.add_done_callback(lambda t: results.append(t.result()))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    sent += 1
                await asyncio.sleep(0.005)
            if pending:
                await asyncio.wait(pending, timeout=120)
            rss_end = rss_bytes()
            lat = sorted(d for ok, d in results if ok)
            failed = sum(not ok for ok, _ in results) + len(pending)
            status = cluster.controller.cluster_status()
            out.update(
                capacity_rps=capacity, load=args.load, rate_rps=rate, minutes=args.minutes,
                sent=sent, ok=len(lat), failed=failed,
                p50_ms=statistics.median(lat) * 1e3 if lat else None,
                p99_ms=float(np.percentile(lat, 99)) * 1e3 if lat else None,
                evictions=evictions, replacements=status["replacements"], cost=status["cost"],
                rss_after_first_minute=rss_first_minute, rss_end=rss_end,
                rss_growth=(rss_end / rss_first_minute - 1.0) if rss_first_minute else None,
                workers_seen=len(worker_pids),
                workers_alive_end=sum(alive(p) for p in worker_pids),
            )
    finally:
        await cluster.stop()
    out["workers_left_after_stop"] = sum(alive(p) for p in worker_pids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--evict-every-s", type=float, default=60.0)
    ap.add_argument("--lead-s", type=float, default=20.0, help="notice to eviction")
    ap.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--probe-s", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="2 minutes, an eviction every 40 s")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.evict_every_s, args.probe_s = 2.0, 40.0, 5.0
    r = asyncio.run(main_async(args))
    growth = f"{r['rss_growth'] * 100:.2f}%" if r["rss_growth"] is not None else "-"
    print(f"\nSoak: {r['minutes']} min at {r['rate_rps']:.1f} req/s ({r['load']:.0%} of "
          f"{r['capacity_rps']:.1f}), {len(r['evictions'])} evictions")
    print(f"  sent {r['sent']}, ok {r['ok']}, failed {r['failed']} (target 0) — "
          f"{'met' if r['failed'] == 0 else 'NOT met'}")
    print(f"  latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms")
    print(f"  RSS {r['rss_after_first_minute'] / 2**20:.1f} MiB -> {r['rss_end'] / 2**20:.1f} MiB "
          f"({growth}, target < 5%) — "
          f"{'met' if r['rss_growth'] is not None and r['rss_growth'] < 0.05 else 'NOT met'}")
    print(f"  replacements: {[(x.get('host_id'), x.get('kind')) for x in r['replacements']]}")
    print(f"  workers: {r['workers_seen']} seen, {r['workers_alive_end']} alive at the end, "
          f"{r['workers_left_after_stop']} left after stop")
    print(json.dumps(r, default=float))


if __name__ == "__main__":
    main()
