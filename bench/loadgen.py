"""Closed-loop HTTP load generator, run in its own process so it never shares the server's loop."""

from __future__ import annotations

import asyncio
import json
import ssl
import time

import aiohttp
import numpy as np


async def closed_loop(url: str, body: dict, concurrency: int, requests: int, warmup: int,
                      timeout_s: float = 60.0, ca_path: str | None = None) -> dict:
    """``concurrency`` clients each send back-to-back requests until ``requests`` are done
    (an ``https://`` url trusting ``ca_path`` when given)."""
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    tls = ssl.create_default_context(cafile=ca_path) if ca_path else True
    conn = aiohttp.TCPConnector(limit=concurrency + 4, ssl=tls)
    lat: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        for _ in range(warmup):
            async with s.post(url, data=payload, headers=headers) as r:
                await r.read()
        remaining = requests

        async def client() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                t = time.perf_counter()
                async with s.post(url, data=payload, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))), timeout_s * 10)
        elapsed = time.perf_counter() - t0
    a = np.asarray(lat) * 1e3
    return {"concurrency": concurrency, "ok": len(lat), "errors": errors,
            "rps": len(lat) / elapsed if elapsed else 0.0,
            "p50_ms": float(np.percentile(a, 50)) if len(a) else None,
            "p99_ms": float(np.percentile(a, 99)) if len(a) else None}


def run_in_child(url: str, body: dict, concurrency: int, requests: int, warmup: int,
                 ca_path: str | None = None) -> dict:
    import uvloop

    return uvloop.run(closed_loop(url, body, concurrency, requests, warmup, ca_path=ca_path))
