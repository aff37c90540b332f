"""The simulator against our measured cold starts and multicast runs (issue 7, item 6).

Two modes. The last line of either is one JSON object.

* No flags (seconds, any user): ``flashpoint.sim.validation``'s rows against the numbers
  recorded in bench/RESULTS.md. The cold-start tier rows there are *calibrated* (their link
  rates are fitted from the very fetches compared); the multicast rows are predicted from
  one point-to-point calibration.

* ``--measure`` (root; a few minutes): the cold start per source tier *predicted* from
  inputs measured independently of the cold starts compared, then compared with a fresh
  cold start of the same model measured in the same run, on network-namespace hosts:

  1. **host-RAM → torch load**: what the worker times as load (parse the manifest, mmap the
     cached blob, ``load_module``; timed apart from the fetch) in cold starts of *other
     sizes* of the model in the same cluster (bert small and base by default, ``--repeats``
     each, median), fitted as ``a + b × bytes`` and evaluated at the compared model's size;
  2. **peer link**: raw TCP goodput between two lab hosts (``host0`` → ``host1``) at the tc
     cap, a plain socket stream of ``--tcp-mb`` (not the chain protocol, not the model);
  3. **registry**: ``S3Store.read_ranges`` goodput from ``host0``'s namespace on a
     *different* object (the bert-base probe published for 1), in ``registry_span_bytes``
     spans, as the host's registry source reads;
  4. then a :class:`~flashpoint.testing.netcluster.NetCluster` (moto S3, controller, two
     hosts; the registry and every host uplink capped at ``--rate-mbit``) measures the cold
     starts of ``bench/coldstart.py``'s model from each tier as that bench does: ``f`` from
     the registry, ``g`` on the other host from ``f``'s host's RAM over a chain (peer),
     ``g`` again from its own RAM (ram, ``--repeats`` times). Compared per tier: fetch +
     load + to_device as the platform timed them, against
     :func:`flashpoint.sim.validation.predicted_tiers`.

      sudo .venv/bin/python bench/sim_validate.py --measure [--rate-mbit 150 --preset large]

Only lab addresses (private namespaces made here) are contacted; every process the lab
started is stopped by PID on exit, and the namespaces are removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashpoint.sim.validation import (  # noqa: E402
    TOLERANCE,
    TierInputs,
    ValidationRow,
    cold_start_tiers,
    fit_load,
    multicast_modes,
    predicted_tiers,
)

CHUNK_BYTES = 4 << 20
TCP_PORT = 5301

_SINK = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.settimeout(120); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(json.dumps({"bytes": n, "s": time.perf_counter() - t0}))
"""

_SEND = r"""
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
block = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(block)
c.close()
"""

_S3_READ = r"""
import asyncio, json, sys, time
from flashpoint.registry import S3Store
async def main(url, bucket, name, version, span):
    async with S3Store(bucket, endpoint_url=url, region="us-east-1") as s:
        m = await s.get_manifest(name, version)
        ranges = [(o, min(o + span, m.blob_size)) for o in range(0, m.blob_size, span)]
        t = time.perf_counter()
        data = await s.read_ranges(name, version, ranges)
        dt = time.perf_counter() - t
    print(json.dumps({"bytes": sum(map(len, data)), "s": dt}))
asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
"""


def print_rows(rows: list[ValidationRow]) -> None:
    print(f"{'case':<26} {'measured s':>11} {'simulated s':>12} {'sim÷meas':>8} {'kind':>10}  within")
    for r in rows:
        kind = "calibrated" if r.calibrated else "predicted"
        print(f"{r.case:<26} {r.measured_s:>11.4f} {r.simulated_s:>12.4f} {r.ratio:>8.4f} "
              f"{kind:>10}  {'yes' if r.within else 'NO'}  {r.note}", flush=True)


def rows_json(rows: list[ValidationRow]) -> list[dict[str, Any]]:
    return [{"case": r.case, "measured_s": round(r.measured_s, 4),
             "simulated_s": round(r.simulated_s, 4), "ratio_sim_over_measured": round(r.ratio, 4),
             "measured_over_predicted": round(1 / r.ratio, 4), "calibrated": r.calibrated}
            for r in rows]


def recorded() -> None:
    rows = cold_start_tiers() + multicast_modes()
    print_rows(rows)
    predicted = [r for r in rows if not r.calibrated]
    print(json.dumps({
        "bench": "sim_validate", "mode": "recorded", "tolerance": TOLERANCE,
        "all_within": all(r.within for r in rows),
        "worst_predicted_ratio": min((r.ratio for r in predicted), key=lambda x: -abs(x - 1)),
        "rows": rows_json(rows)}))


# --- --measure -------------------------------------------------------------------------------
def tcp_goodput(lab: Any, src: int, dst: int, mb: int) -> dict[str, float]:
    """Raw TCP from lab host ``src`` to ``dst``: bytes over first-to-last-byte seconds."""
    sink = lab.exec(dst, [sys.executable, "-c", _SINK, lab.host(dst).addr, str(TCP_PORT)],
                    stdout=__import__("subprocess").PIPE, text=True)
    try:
        lab.run(src, [sys.executable, "-c", _SEND, lab.host(dst).addr, str(TCP_PORT), str(mb)],
                timeout_s=300, check=True)
        out, _ = sink.communicate(timeout=60)
    finally:
        lab.stop(sink)
    rec = json.loads(out.strip().splitlines()[-1])
    return {"bytes": rec["bytes"], "s": rec["s"], "bps": rec["bytes"] * 8 / rec["s"]}


def s3_goodput(c: Any, host_index: int, name: str, version: str, span: int) -> dict[str, float]:
    from flashpoint.testing.netcluster import BUCKET

    cp = c.lab.run(host_index, [sys.executable, "-c", _S3_READ, c.s3_url, BUCKET, name, version,
                                str(span)], timeout_s=600, env={**c.env})
    if cp.returncode != 0:
        raise RuntimeError(f"S3 probe read failed: {cp.stderr[-2000:]}")
    rec = json.loads(cp.stdout.strip().splitlines()[-1])
    return {"bytes": rec["bytes"], "s": rec["s"], "bps": rec["bytes"] * 8 / rec["s"]}


def moto_read_rate(c: Any, name: str, version: str, repeats: int = 3) -> dict[str, float]:
    """Moto's cost per ranged GET, from the root namespace: it re-reads the *whole* object
    for every GET (bench/multicast.py's docstring), so a 1 MiB GET of the probe takes about
    object size / its read rate. Median of ``repeats``; returns the read rate in bytes/s."""
    import boto3

    from flashpoint.testing.netcluster import BUCKET

    s3 = boto3.client("s3", endpoint_url=c.s3_url, region_name="us-east-1")
    try:
        key = f"{name}/{version}/blob"
        size = s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            s3.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-1048575")["Body"].read()
            times.append(time.perf_counter() - t)
    finally:
        s3.close()
    per_get = statistics.median(times)
    return {"object_bytes": size, "get_1mib_s": per_get, "read_Bps": size / per_get}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from flashpoint.models import zoo
    from flashpoint.models.sources import publish
    from flashpoint.registry import LocalStore
    from flashpoint.testing.netcluster import FAKE_AWS_ENV, FIRST_HOST, REGISTRY, UNSET_ENV, NetCluster
    from flashpoint.testing.netns import NetLab

    os.environ.update(FAKE_AWS_ENV)
    for key in UNSET_ENV:
        os.environ.pop(key, None)
    tmp = Path(tempfile.mkdtemp(prefix="fp-sim-validate-"))
    store = LocalStore(tmp / "models")
    t = time.monotonic()
    big = await publish(store, "bert", args.preset, "1", CHUNK_BYTES, model_name="m")
    print(f"published bert/{args.preset}: {big.blob_size / 1e6:.1f} MB "
          f"({time.monotonic() - t:.1f} s)", flush=True)
    probes = {}
    for preset in args.load_presets.split(","):
        probes[preset] = await publish(store, "bert", preset, "1", CHUNK_BYTES,
                                       model_name=f"probe-{preset}")
    size = big.blob_size
    def body_of(preset: str) -> dict[str, Any]:
        arrays = zoo.example_inputs("bert", zoo.resolve_config("bert", preset), 1)
        return {n: {"data": v.ravel().tolist(), "shape": list(v.shape), "datatype": "INT64"}
                for n, v in arrays.items()}

    body = body_of(args.preset)
    (tmp / "lab").mkdir()
    c = await NetCluster.start(
        NetLab, tmp / "lab", 2, rate_mbit=args.rate_mbit, registry_capped=True,
        device_memory_bytes=int(size * 1.5) + (100 << 20),
        controller={"cold_start_timeout_s": 900.0, "deploy_timeout_s": 900.0},
        host={"registry_span_bytes": args.span_mb << 20, "cache_bytes": 3 * size,
              "host_memory_bytes": 8 * size, "chain_wait_s": 900.0},
        # A host's fill of the model is bounded by its deploy timeout (60 s by default):
        # 1.3 GB at 150 Mbit/s takes ~75 s.
        host_controller={"deploy_timeout_s": 900.0})
    measured: dict[str, list[dict[str, Any]]] = {"registry": [], "peer": [], "ram": []}
    try:
        assert c.session is not None

        async def cold(fn: str, tier: str, inputs: dict[str, Any],
                       into: list[dict[str, Any]]) -> None:
            async def scaled_to_zero() -> tuple[bool, Any]:
                st = await c.status()
                return not [r for r in st["replicas"] if r["function"] == fn], None

            await c.wait(f"{fn} scaled to zero", scaled_to_zero, 120.0)
            await c.wait("every host's warm worker connected", c._pools_ready, 120.0)
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            async with c.session.post(f"{c.url}/v1/functions/{fn}/invoke",
                                      json={"inputs": inputs},
                                      timeout=aiohttp.ClientTimeout(total=1200)) as r:
                reply = await r.json(content_type=None)
                assert r.status == 200, reply
            wall = time.monotonic() - t0
            tm = reply.get("timings_s", {})
            row = {"tier": tier, "function": fn, "source": reply.get("cold_start_source"),
                   "wall_s": wall, **{k: float(tm.get(k, 0.0)) for k in
                                      ("fetch", "load", "to_device", "first_inference")}}
            into.append(row)
            print(f"{tier:8s} {fn} source={row['source']!s:16s} wall={wall:7.2f}s "
                  f"fetch={row['fetch']:7.2f}s load={row['load'] * 1e3:7.1f}ms "
                  f"to_device={row['to_device'] * 1e3:5.1f}ms", flush=True)

        # 1. the worker's load time for other sizes of the model: cold starts of the probe
        # models in this cluster (the same worker code and contention; load is timed apart
        # from the fetch), median per size, fitted as a + b × bytes.
        load_points, load_rows = [], {}
        for preset, m in probes.items():
            await c.publish(m, store.blob_path(f"probe-{preset}", "1"))
            await c.deploy(f"load-{preset}", f"probe-{preset}", keep_alive_s=0.2, timeout_s=900)
            load_rows[preset] = []
            for _ in range(args.repeats):
                await cold(f"load-{preset}", "load", body_of(preset), load_rows[preset])
            load_points.append((m.blob_size, statistics.median(
                r["load"] for r in load_rows[preset])))
        a, b = fit_load(load_points)
        load_pred = a + b * size
        print(f"load fit: {a * 1e3:.1f} ms + {b * 1e9:.3f} ms/GB → {load_pred * 1e3:.1f} ms for "
              f"{size / 1e6:.1f} MB", flush=True)
        # 2. raw TCP at the cap: host0 -> host1 (a peer link), registry -> host0.
        peer_tcp = tcp_goodput(c.lab, FIRST_HOST, FIRST_HOST + 1, args.tcp_mb)
        reg_tcp = tcp_goodput(c.lab, REGISTRY, FIRST_HOST, args.tcp_mb)
        print(f"raw TCP host0→host1 {peer_tcp['bps'] / 1e6:.1f} Mbit/s, registry→host0 "
              f"{reg_tcp['bps'] / 1e6:.1f} Mbit/s (cap {args.rate_mbit:g})", flush=True)
        # 3. registry GETs on a different object (the probe), from host0's namespace.
        probe = args.load_presets.split(",")[-1]  # published for 1
        reg_get = s3_goodput(c, FIRST_HOST, f"probe-{probe}", "1", args.span_mb << 20)
        print(f"S3 GET probe-{probe} ({reg_get['bytes'] / 1e6:.1f} MB) from host0: "
              f"{reg_get['bps'] / 1e6:.1f} Mbit/s", flush=True)
        moto = moto_read_rate(c, f"probe-{probe}", "1")
        print(f"moto: a 1 MiB GET of probe-{probe} takes {moto['get_1mib_s'] * 1e3:.0f} ms "
              f"(re-reads the object at {moto['read_Bps'] / 1e9:.2f} GB/s)", flush=True)
        # 4. the measured cold starts, as bench/coldstart.py does them.
        await c.publish(big, store.blob_path("m", "1"))
        await c.deploy("f", "m", keep_alive_s=3600, timeout_s=900)
        await c.deploy("g", "m", keep_alive_s=0.2, timeout_s=900)

        await cold("f", "registry", body, measured["registry"])

        async def cached() -> tuple[bool, Any]:
            st = await c.status()
            return any("m@1" in h.get("cached_models", []) for h in st["hosts"]), None

        await c.wait("a host reporting the model cached", cached, 60.0)
        await cold("g", "peer", body, measured["peer"])
        for _ in range(args.repeats):
            await cold("g", "ram", body, measured["ram"])
    finally:
        with contextlib.suppress(Exception):
            await c.aclose()
    # Compared per tier: fetch + load + to_device (medians over the tier's runs).
    meas = {tier: tuple(statistics.median(r[k] for r in rows) for k in
                        ("fetch", "load", "to_device"))
            for tier, rows in measured.items() if rows}
    tier_in = TierInputs(size, registry_bps=reg_get["bps"], peer_bps=peer_tcp["bps"],
                         start_s=load_pred)
    rows = predicted_tiers(tier_in, meas)  # type: ignore[arg-type]
    # The registry again, with moto's per-GET whole-object re-read. The host's registry
    # source reads ``span`` bytes per ranged GET and its 4 fill workers take chunks in
    # order, so they wait on the same span: the GETs run about one at a time, each paying
    # moto's re-read of the whole object (at the rate measured on the probe) and then the
    # span's transfer over the link. The simulator gets the effective registry rate that
    # implies for this object.
    span = args.span_mb << 20
    n_gets = -(-size // span)
    per_get_s = size / moto["read_Bps"] + span * 8 / reg_get["bps"]
    serial_s = n_gets * per_get_s
    eff_bps = size * 8 / serial_s
    moto_rows = predicted_tiers(TierInputs(size, eff_bps, peer_tcp["bps"], load_pred),
                                {"registry": meas["registry"]})  # type: ignore[dict-item]
    moto_rows = [ValidationRow(r.case + " (+moto, serial spans)", r.measured_s, r.simulated_s,
                               calibrated=False,
                               note=f"{n_gets} GETs × ({size / 1e9:.2f} GB re-read at "
                                    f"{moto['read_Bps'] / 1e9:.2f} GB/s + {span / 2**20:.0f} MiB "
                                    f"at {reg_get['bps'] / 1e6:.0f} Mbit/s) = {serial_s:.1f} s")
                 for r in moto_rows]
    rows += moto_rows
    return {"bench": "sim_validate", "mode": "measure", "tolerance": TOLERANCE,
            "rate_mbit": args.rate_mbit, "span_mb": args.span_mb, "model": f"bert/{args.preset}",
            "model_bytes": size,
            "inputs": {"load_points": load_points, "load_fit_a_s": a, "load_fit_b_s_per_byte": b,
                       "load_predicted_s": load_pred, "peer_tcp": peer_tcp,
                       "registry_tcp": reg_tcp, "registry_get": reg_get, "moto": moto,
                       "registry_effective_bps": eff_bps},
            "cold_starts": measured, "load_cold_starts": load_rows, "rows": rows_json(rows),
            "all_within": all(r.within for r in rows), "_rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true",
                    help="measure the inputs and fresh cold starts on netns hosts (root)")
    ap.add_argument("--rate-mbit", type=float, default=150.0,
                    help="tc cap of the registry's and every host's uplink")
    ap.add_argument("--preset", default="large", help="bert preset whose cold starts compare")
    ap.add_argument("--load-presets", default="small,base",
                    help="other bert sizes the load time is fitted on (the last is also the "
                         "registry probe object)")
    ap.add_argument("--span-mb", type=int, default=32, help="registry ranged-GET span")
    ap.add_argument("--tcp-mb", type=int, default=64, help="raw TCP probe size")
    ap.add_argument("--repeats", type=int, default=5,
                    help="own-RAM cold starts, and cold starts per load-probe size")
    args = ap.parse_args()
    if not args.measure:
        recorded()
        return
    if os.geteuid() != 0:
        sys.exit("--measure builds network namespaces: run it as root")
    import uvloop

    out = uvloop.run(measure(args))
    rows = out.pop("_rows")
    print()
    print_rows(rows)
    for r in rows:
        print(f"{r.case}: measured ÷ predicted = {1 / r.ratio:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
