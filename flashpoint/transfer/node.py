"""A standalone data-plane node process (tests, benchmarks, network namespaces).

    python -m flashpoint.transfer.node serve --listen ADDR --port P --dir DIR
        [--secret-env VAR] [--rate-log] [--host-id ID] [--registry DIR] [--fault JSON]
    python -m flashpoint.transfer.node send --blob PATH --manifest PATH --chain id:addr:port,...
        [--secret-env VAR] [--transfer-id ID] [--fallback id:addr:port,...|registry]
        [--stall-timeout-s S] [--orphan-grace-s S] [--timeout-s S] [--rate-bps B]
    python -m flashpoint.transfer.node get --from id:addr:port --manifest PATH --out PATH
        [--secret-env VAR]
    python -m flashpoint.transfer.node make-blob --out PATH --manifest PATH --size-bytes N
        [--chunk-size C] [--seed S] [--name NAME] [--version V]

stdout carries JSON lines only (``{"event": ...}``); logs go to stderr. ``serve`` prints
``{"event": "listening", "addr", "port"}`` once bound, ``{"event": "transfer_done", ...}``
whenever a chain finishes here (and, with ``--rate-log``, ``{"event": "rate", ...}`` each
second per active transfer), and serves until SIGTERM. Received complete segments land as
``DIR/<name>@<version>`` with the manifest as ``DIR/<name>@<version>.json``. ``send`` prints
the ChainResult fields and exits 0 when every receiver completed, 1 otherwise.
The cluster secret comes from the environment variable ``--secret-env`` (default
``FLASHPOINT_SECRET``): there is no built-in one, and a weak one is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import struct
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from flashpoint.config import secret_from_env
from flashpoint.errors import Conflict, FlashpointError
from flashpoint.log import configure, get_logger
from flashpoint.registry.chunks import ChunkHasher
from flashpoint.registry.manifest import (
    ALIGN_BYTES,
    IoSignature,
    LayerInfo,
    Manifest,
    TensorInfo,
    align_up,
)
from flashpoint.transfer.chain import send_chain
from flashpoint.transfer.dataplane import ChainReceiver, DataPlaneServer
from flashpoint.transfer.plan import Endpoint, FaultPlan, parse_endpoints
from flashpoint.transfer.segment import Segment, segment_key
from flashpoint.transfer.sources import ChunkSource, PeerSource, RegistrySource, fill
from flashpoint.transfer.wire import DataConn

log = get_logger(__name__)


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout (the benchmark harness reads these)."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def make_synthetic(blob_path: Path, manifest_path: Path | None, *, size_bytes: int,
                   chunk_size: int = 4 * 1024 * 1024, seed: int = 0, name: str = "synthetic",
                   version: str = "1") -> Manifest:
    """Write a valid safetensors blob of ~``size_bytes`` (one U8 tensor of pseudo-random
    bytes) and return its manifest with real per-chunk sha256 (written if a path is given)."""
    data_len = max(1, size_bytes - 128)
    for _ in range(3):  # the header length depends on the digits of data_len
        header = json.dumps({"__metadata__": {"format": "pt"},
                             "w": {"dtype": "U8", "shape": [data_len], "data_offsets": [0, data_len]}},
                            separators=(",", ":")).encode()
        data_offset = align_up(8 + len(header), ALIGN_BYTES)
        data_len = max(1, size_bytes - data_offset)
    header += b" " * (data_offset - 8 - len(header))
    hasher = ChunkHasher(chunk_size)
    rng = random.Random(seed)
    with open(blob_path, "wb") as f:
        prefix = struct.pack("<Q", len(header)) + header
        hasher.update(prefix)
        f.write(prefix)
        left = data_len
        while left:
            piece = rng.randbytes(min(left, 4 * 1024 * 1024))
            hasher.update(piece)
            f.write(piece)
            left -= len(piece)
    blob_size = data_offset + data_len
    manifest = Manifest.from_json(Manifest(
        name=name, version=version, blob_size=blob_size, data_offset=data_offset,
        chunk_size=chunk_size, chunk_sha256=tuple(hasher.finish()),
        tensors={"w": TensorInfo("U8", (data_len,), data_offset, blob_size)},
        layers=(LayerInfo("layers.0", ("w",), data_offset, blob_size),),
        entry_point="flashpoint.models.noop:build", config={"synthetic": True},
        io=IoSignature((), ())).to_json())
    if manifest_path is not None:
        Path(manifest_path).write_text(manifest.to_json())
    return manifest


class DirSegmentProvider:
    """Segments as files ``DIR/<name>@<version>``; a complete one also gets its manifest as
    ``DIR/<name>@<version>.json``, written last (its presence means "complete")."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._segments: dict[str, Segment] = {}

    def lookup(self, key: str) -> Segment | None:
        return self._segments.get(key)

    def open_for_receive(self, manifest: Manifest) -> Segment:
        key = segment_key(manifest)
        seg = self._segments.get(key)
        if seg is not None:
            if seg.manifest.chunk_sha256 != manifest.chunk_sha256:
                raise Conflict(f"{key}: a different blob is already held under this name")
            return seg
        (self.directory / f"{key}.json").unlink(missing_ok=True)
        seg = Segment(self.directory / key, manifest)
        self._segments[key] = seg
        return seg

    def add_complete(self, blob_path: Path, manifest: Manifest, *, verify: bool = False) -> Segment:
        """Serve an existing complete blob (a seed peer)."""
        seg = Segment.open_complete(Path(blob_path), manifest, verify=verify)
        self._segments[seg.key] = seg
        return seg

    def load_existing(self) -> list[str]:
        """Register every complete blob already in the directory (blob + manifest JSON)."""
        keys = []
        for mpath in sorted(self.directory.glob("*.json")):
            blob = mpath.with_suffix("")
            if blob.is_file() and blob.name not in self._segments:
                manifest = Manifest.from_json(mpath.read_text())
                if segment_key(manifest) == blob.name:
                    keys.append(self.add_complete(blob, manifest).key)
        return keys

    def on_complete(self, segment: Segment) -> None:
        final = self.directory / f"{segment.key}.json"
        tmp = self.directory / f".{segment.key}.json.tmp"
        tmp.write_text(segment.manifest.to_json())
        os.replace(tmp, final)

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


async def fetch_status(endpoint: Endpoint, secret: bytes, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """A peer's ``status`` (its transfers and their progress); for tests and benchmarks."""
    conn = await DataConn.connect(endpoint, secret, name="status", timeout_s=timeout_s)
    try:
        await conn.send_header({"op": "status"}, timeout_s)
        return await conn.recv_header(timeout_s)
    finally:
        conn.close()


def _secret(var: str) -> bytes:
    return secret_from_env(var)


async def _serve(args: argparse.Namespace) -> int:
    provider = DirSegmentProvider(Path(args.dir))
    provider.load_existing()
    registry = None
    if args.registry:
        from flashpoint.registry.local import LocalStore
        registry = RegistrySource(LocalStore(args.registry))
    fault = FaultPlan.from_dict(json.loads(args.fault)) if args.fault else None

    def finished(rx: ChainReceiver) -> None:
        res = rx.result.result()
        emit("transfer_done", transfer_id=rx.transfer_id, key=rx.segment.key,
             ok=rx.error is None, error=None if rx.error is None else repr(rx.error),
             completed=res.completed, failed=res.failed, seconds=round(res.seconds, 4),
             pulled=rx.pulled)

    server = DataPlaneServer(provider, _secret(args.secret_env), host_id=args.host_id or
                             f"node-{args.port}", listen_host=args.listen, port=args.port,
                             fault=fault, registry_source=registry, on_finished=finished)
    ep = await server.start()
    emit("listening", addr=ep.addr, port=ep.port, host_id=ep.host_id, pid=os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        last: dict[str, tuple[float, int]] = {}
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
            if args.rate_log:
                now = time.monotonic()
                for tid, st in server.status()["transfers"].items():
                    if st["state"] in ("done", "failed"):
                        continue
                    t_prev, b_prev = last.get(tid, (now - 1.0, 0))
                    rate = (st["received_bytes"] - b_prev) * 8 / max(1e-6, now - t_prev) / 1e6
                    last[tid] = (now, st["received_bytes"])
                    emit("rate", transfer_id=tid, state=st["state"], valid_bytes=st["valid_bytes"],
                         received_bytes=st["received_bytes"], mbps=round(rate, 2))
    finally:
        await server.stop()
        provider.close()
    return 0


def _fallback(text: str | None) -> list[ChunkSource | Endpoint]:
    out: list[ChunkSource | Endpoint] = []
    for part in (text or "").split(","):
        part = part.strip()
        if part == "registry":
            out.append(RegistrySource(None))  # named on the wire only; receivers use their own
        elif part:
            out.append(Endpoint.parse(part))
    return out


async def _send(args: argparse.Namespace) -> int:
    manifest = Manifest.from_json(Path(args.manifest).read_text())
    seg = Segment.open_complete(Path(args.blob), manifest)
    try:
        result = await send_chain(
            seg, parse_endpoints(args.chain), secret=_secret(args.secret_env),
            transfer_id=args.transfer_id or uuid.uuid4().hex[:12], fallback=_fallback(args.fallback),
            stall_timeout_s=args.stall_timeout_s, orphan_grace_s=args.orphan_grace_s,
            timeout_s=args.timeout_s, rate_bps=args.rate_bps, host_id=args.host_id)
    finally:
        seg.close()
    mbps = manifest.blob_size * 8 / max(result.seconds, 1e-9) / 1e6
    emit("result", **result.to_dict(), blob_size=manifest.blob_size, mbps=round(mbps, 2),
         MBps=round(manifest.blob_size / max(result.seconds, 1e-9) / 1e6, 2))
    return 0 if not result.failed else 1


async def _get(args: argparse.Namespace) -> int:
    manifest = Manifest.from_json(Path(args.manifest).read_text())
    src = PeerSource(Endpoint.parse(args.from_), _secret(args.secret_env))
    seg = Segment(Path(args.out), manifest)
    t0 = time.perf_counter()
    try:
        await seg.preallocate()
        stats = await fill(seg, [src], concurrency=args.concurrency, timeout_s=args.timeout_s)
    finally:
        await src.aclose()
        seg.close()
    dt = time.perf_counter() - t0
    emit("got", bytes=manifest.blob_size, seconds=round(dt, 4), stats=stats,
         MBps=round(manifest.blob_size / max(dt, 1e-9) / 1e6, 2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashpoint.transfer.node")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--dir", required=True)
    s.add_argument("--host-id", default="")
    s.add_argument("--rate-log", action="store_true")
    s.add_argument("--registry", default="", help="LocalStore root for 'registry' fallbacks")
    s.add_argument("--fault", default="", help="FaultPlan as JSON (tests)")
    t = sub.add_parser("send")
    t.add_argument("--blob", required=True)
    t.add_argument("--manifest", required=True)
    t.add_argument("--chain", required=True)
    t.add_argument("--transfer-id", default="")
    t.add_argument("--host-id", default="head")
    t.add_argument("--fallback", default="")
    t.add_argument("--stall-timeout-s", type=float, default=10.0)
    t.add_argument("--orphan-grace-s", type=float, default=2.0)
    t.add_argument("--timeout-s", type=float, default=3600.0)
    t.add_argument("--rate-bps", type=float, default=None)
    g = sub.add_parser("get")
    g.add_argument("--from", dest="from_", required=True)
    g.add_argument("--manifest", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--concurrency", type=int, default=4)
    g.add_argument("--timeout-s", type=float, default=3600.0)
    m = sub.add_parser("make-blob")
    m.add_argument("--out", required=True)
    m.add_argument("--manifest", required=True)
    m.add_argument("--size-bytes", type=int, required=True)
    m.add_argument("--chunk-size", type=int, default=4 * 1024 * 1024)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--name", default="synthetic")
    m.add_argument("--version", default="1")
    for sp in (s, t, g):
        sp.add_argument("--secret-env", default="FLASHPOINT_SECRET")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure(os.environ.get("FLASHPOINT_LOG_LEVEL", "WARNING"))
    if args.cmd == "make-blob":
        man = make_synthetic(Path(args.out), Path(args.manifest), size_bytes=args.size_bytes,
                             chunk_size=args.chunk_size, seed=args.seed, name=args.name,
                             version=args.version)
        emit("made", blob=args.out, manifest=args.manifest, blob_size=man.blob_size,
             num_chunks=man.num_chunks)
        return 0
    run = {"serve": _serve, "send": _send, "get": _get}[args.cmd]
    try:
        import uvloop  # the fast loop where installed; plain asyncio otherwise
        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(run(args))
    except FlashpointError as exc:
        emit("error", code=exc.code, message=exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(main())
