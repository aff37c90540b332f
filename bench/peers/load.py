"""HTTP load for the peer benchmark, run in a process of its own (never the servers' loop).

Every loop here is bounded in count and in time: a closed loop stops after ``requests``
answers or ``max_s`` seconds, an open loop sends ``rate_hz × duration_s`` requests and waits
at most ``timeout_s`` for the last, a poll gives up at its deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import numpy as np


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else None


async def closed_loop(url: str, body: Any, concurrency: int, requests: int, max_s: float,
                      warmup: int = 20, timeout_s: float = 60.0) -> dict[str, Any]:
    """``concurrency`` clients send back-to-back requests until ``requests`` are answered or
    ``max_s`` has passed; req/s counts answers with status 200."""
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    lat: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        for _ in range(warmup):
            async with s.post(url, data=payload, headers=headers) as r:
                await r.read()
        remaining = requests
        stop_at = time.perf_counter() + max_s

        async def client() -> None:
            nonlocal remaining, errors
            while remaining > 0 and time.perf_counter() < stop_at:
                remaining -= 1
                t = time.perf_counter()
                try:
                    async with s.post(url, data=payload, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))),
                               max_s + timeout_s + 5)
        elapsed = time.perf_counter() - t0
    return {"concurrency": concurrency, "ok": len(lat), "errors": errors, "elapsed_s": elapsed,
            "rps": len(lat) / elapsed if elapsed else 0.0,
            "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99)}


async def one(url: str, body: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """One request; its wall time and the parsed reply (raises on a non-200)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t = time.perf_counter()
        async with s.post(url, json=body) as r:
            text = await r.text()
            wall = time.perf_counter() - t
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {text[:300]}")
    return {"wall_s": wall, "reply": json.loads(text)}


def _exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (it exited; its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def first_success(url: str, body: Any, t0_wall: float, timeout_s: float,
                        every_s: float = 0.05, pid: int | None = None) -> dict[str, Any]:
    """Poll ``url`` until a request is answered with 200 (a server just started); returns the
    time from ``t0_wall`` (``time.time()`` when the server was started) to that answer.
    Gives up at once when the server's process ``pid`` has exited."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.post(url, json=body) as r:
                    text = await r.text()
                    if r.status == 200:
                        return {"wall_s": time.time() - t0_wall, "reply": json.loads(text)}
            except (TimeoutError, aiohttp.ClientError):
                pass
            if pid is not None and _exited(pid):
                raise RuntimeError(f"{url}: the server (pid {pid}) exited before answering")
            await asyncio.sleep(every_s)
    raise TimeoutError(f"{url}: no answer within {timeout_s}s of the server's start")


async def open_loop(url: str, body: Any, rate_hz: float, duration_s: float,
                    timeout_s: float = 60.0, replicas_wanted: int = 4) -> dict[str, Any]:
    """Send requests at ``rate_hz`` for ``duration_s`` whatever the answers (open loop);
    reports when the ``replicas_wanted``-th distinct replica first answered (from the
    ``replica`` / ``replica_id`` field of replies), how many requests failed and why (HTTP
    status or exception name), and the p50/p99 latency of those answered."""
    n = int(rate_hz * duration_s)
    first_seen: dict[str, float] = {}
    failed = 0
    failed_by: dict[str, int] = {}

    def fail(why: str) -> None:
        nonlocal failed
        failed += 1
        failed_by[why] = failed_by.get(why, 0) + 1
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = time.perf_counter()

        async def send(i: int) -> None:
            delay = t0 + i / rate_hz - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t = time.perf_counter()
            try:
                async with s.post(url, json=body) as r:
                    text = await r.text()
                    if r.status != 200:
                        fail(f"HTTP {r.status}")
                        return
            except (TimeoutError, aiohttp.ClientError) as e:
                fail(type(e).__name__)
                return
            done = time.perf_counter()
            lat.append(done - t)
            reply = json.loads(text)
            rid = str(reply.get("replica") or reply.get("replica_id") or "")
            first_seen.setdefault(rid, done - t0)

        await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(n))),
                               duration_s + timeout_s + 10)
    order = sorted(first_seen.values())
    return {"rate_hz": rate_hz, "duration_s": duration_s, "sent": n, "failed": failed,
            "failed_by": failed_by,
            "replicas_seen": len(first_seen),
            "time_to_nth_replica_s": order[replicas_wanted - 1] if len(order) >= replicas_wanted
            else None, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99)}


def run(kind: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Entry point for the load process: ``run("closed_loop", url, body, ...)``."""
    fn = {"closed_loop": closed_loop, "one": one, "first_success": first_success,
          "open_loop": open_loop}[kind]
    try:
        import uvloop

        return uvloop.run(fn(*args, **kwargs))
    except ImportError:
        return asyncio.run(fn(*args, **kwargs))
