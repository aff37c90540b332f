"""What TLS and activation MACs cost: invoke over http:// vs https://, side by side in one run.

Two local clusters run at once over the built-in no-op model: one plain (HTTP gateway, ws://
RPC), one with TLS on the controller's port (HTTPS gateway, wss:// RPC from the host and its
worker, trusting a throw-away cluster CA). Closed-loop load from a separate process at
concurrency 1 and 64; ``--rounds`` interleaved rounds (plain, TLS, plain, TLS ...) so a slow
spell of this shared VM lands on both; the verdicts use the median over rounds of each
round's TLS/plain ratio. The load generator keeps its connections alive (as a real client
would), so the TLS handshake is paid once per connection, not per request.

Pipeline activation frames are not under TLS: each carries an HMAC-SHA256 tag
(:mod:`flashpoint.pipeline.link`); the second table times one tag per frame size (what a
frame costs its sender and again its receiver). Model bytes on the data plane (chain
multicast) are unchanged by TLS: run ``bench/multicast.py`` for those.

    python bench/tls.py [--requests 2000] [--rounds 3]

Prints a line per run and a JSON line at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import datetime
import ipaddress
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import run_in_child  # noqa: E402

from flashpoint.config import load_config  # noqa: E402

BODY = {"inputs": {"x": {"data": [1.0, 2.0, 3.0, 4.0], "shape": [1, 4], "datatype": "FP32"}}}


def _self_signed(d: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that is its own CA, and its key (PEM paths)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flashpoint-bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = d / "cert.pem", d / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def _mac_costs(repeat: int = 200) -> list[dict]:
    """Microseconds for one activation frame's tag, per frame size."""
    from flashpoint.pipeline.link import frame_tag

    key = os.urandom(32)
    rows = []
    for size in (4 << 10, 64 << 10, 384 << 10, 1 << 20, 4 << 20):
        buf = memoryview(bytearray(os.urandom(size)))
        times = []
        for i in range(repeat):
            t = time.perf_counter()
            frame_tag(key, b"fp-act c>s", i, [buf])
            times.append(time.perf_counter() - t)
        us = statistics.median(times) * 1e6
        rows.append({"frame_bytes": size, "tag_us": us, "gb_per_s": size / us / 1e3})
    return rows


async def _cluster(home: Path, *, tls: tuple[str, str] | None):
    from flashpoint.cli import make_store
    from flashpoint.cluster import LocalCluster
    from flashpoint.models.sources import publish

    cfg = load_config(overrides={"controller": {"listen_port": 0}, "log_level": "WARNING",
                                 "host": {"cpu_devices": 1, "warm_pool_size": 1,
                                          "tls_ca_path": tls[0] if tls else ""}}).with_home(home)
    if tls:
        cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
            cfg.controller, tls_cert_path=tls[0], tls_key_path=tls[1]))
    store = make_store(cfg)
    await publish(store, "noop", preset="tiny", version="1", model_name="noop")
    cluster = LocalCluster(cfg, hosts=1, store=store)
    await asyncio.wait_for(cluster.start(), 120)
    from flashpoint.spec import FunctionSpec

    await cluster.controller.register_function(FunctionSpec(
        name="noop", model="noop", keep_alive_s=600, min_replicas=1, max_replicas=1,
        replica_concurrency=64, max_batch_size=16))
    return cluster


async def main(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="fp-bench-tls-"))
    cert, key = _self_signed(home)
    (home / "plain").mkdir()
    (home / "tls").mkdir()
    plain = await _cluster(home / "plain", tls=None)
    secure = await _cluster(home / "tls", tls=(cert, key))
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    loop = asyncio.get_running_loop()
    rows: list[dict] = []
    try:
        targets = {"plain": (f"{plain.controller.url}/v1/functions/noop/invoke", None),
                   "tls": (f"{secure.controller.url}/v1/functions/noop/invoke", cert)}
        assert targets["tls"][0].startswith("https://")
        for url, ca in targets.values():  # both replicas warm, both warm pools refilled
            await loop.run_in_executor(pool, run_in_child, url, BODY, 1, 1, 1, ca)
        for c in (plain, secure):
            for host in c.hosts:
                if not await host.wait_pool_ready(120.0):
                    raise RuntimeError(f"{host.host_id}: warm pool not refilled within 120 s")
        for conc in (1, 64):
            for rnd in range(args.rounds):
                for name, (url, ca) in targets.items():
                    res = await loop.run_in_executor(pool, run_in_child, url, BODY, conc,
                                                     args.requests, 50, ca)
                    res["target"], res["round"] = name, rnd
                    rows.append(res)
                    print(f"{name:6s} c={conc:<3d} r{rnd} ok={res['ok']:<6d} "
                          f"err={res['errors']:<3d} rps={res['rps']:9.1f} "
                          f"p50={res['p50_ms']:.3f}ms p99={res['p99_ms']:.3f}ms", flush=True)
    finally:
        pool.shutdown()
        await secure.stop()
        await plain.stop()
    by = {(r["target"], r["concurrency"], r["round"]): r for r in rows}
    rounds = range(args.rounds)
    c1_delta = [by[("tls", 1, i)]["p50_ms"] - by[("plain", 1, i)]["p50_ms"] for i in rounds]
    c64_ratio = [by[("tls", 64, i)]["rps"] / by[("plain", 64, i)]["rps"] for i in rounds]
    macs = _mac_costs()
    summary = {
        "bench": "tls", "machine": f"{platform.machine()} {mp.cpu_count()} cpu",
        "rounds": args.rounds, "requests": args.requests,
        "c1_p50_plain_ms": statistics.median(by[("plain", 1, i)]["p50_ms"] for i in rounds),
        "c1_p50_tls_ms": statistics.median(by[("tls", 1, i)]["p50_ms"] for i in rounds),
        "c1_p50_delta_ms": statistics.median(c1_delta),
        "c64_rps_plain": statistics.median(by[("plain", 64, i)]["rps"] for i in rounds),
        "c64_rps_tls": statistics.median(by[("tls", 64, i)]["rps"] for i in rounds),
        "c64_rps_ratio": statistics.median(c64_ratio),
        "c1_p50_delta_ms_per_round": c1_delta, "c64_rps_ratio_per_round": c64_ratio,
        "activation_mac": macs, "rows": rows,
    }
    print(f"\nc=1  p50: plain {summary['c1_p50_plain_ms']:.3f} ms, TLS "
          f"{summary['c1_p50_tls_ms']:.3f} ms, delta (median of per-round deltas) "
          f"{summary['c1_p50_delta_ms']:+.3f} ms")
    print(f"c=64 req/s: plain {summary['c64_rps_plain']:.0f}, TLS {summary['c64_rps_tls']:.0f}, "
          f"TLS/plain (median of per-round ratios) {summary['c64_rps_ratio']:.2f}")
    print("activation frame MAC (HMAC-SHA256, one tag):")
    for m in macs:
        print(f"  {m['frame_bytes'] >> 10:6d} KiB  {m['tag_us']:9.1f} us  {m['gb_per_s']:.2f} GB/s")
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds per concurrency; ratios are per-round medians")
    import uvloop

    out = uvloop.run(main(ap.parse_args()))
    print(json.dumps(out))
