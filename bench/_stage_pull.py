"""Bench helper (bench/partition.py): pull one stage's chunks from a peer, then serve the stage.

``node get`` fetches whole blobs only, so this pulls just the chunks covering layers
FIRST..LAST (``byte_range_for_layers`` -> ``chunks_for_range``) with ``PeerSource`` +
``fill(indices=...)`` into a blob-sized sparse file (only those chunks are written, each
verified against the manifest's sha256), prints ``{"event": "pulled", ...}``, then runs
``flashpoint.pipeline.stage`` over that file with the remaining arguments:

    python bench/_stage_pull.py --from id:addr:port --manifest M --out PATH --first I --last J
        [--exec-stage] -- <stage args without --manifest/--blob/--first/--last>

Default: the stage runs in this process, with ``flashpoint.pipeline.stage`` (and torch)
imported on a thread *while* the chunks arrive, as a host's pre-started worker has torch
imported before a model is assigned. ``--exec-stage``: exec ``python -m
flashpoint.pipeline.stage`` after the pull instead (a cold process, torch imported after the
bytes are in). The cluster secret comes from ``FLASHPOINT_SECRET`` (or ``--secret-env``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flashpoint.config import DEFAULT_SECRET  # noqa: E402
from flashpoint.registry.manifest import Manifest, byte_range_for_layers  # noqa: E402
from flashpoint.transfer.plan import Endpoint  # noqa: E402
from flashpoint.transfer.segment import Segment  # noqa: E402
from flashpoint.transfer.sources import PeerSource, fill  # noqa: E402


def emit(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def pull(args: argparse.Namespace, manifest: Manifest, secret: bytes) -> dict:
    first = int(args.first) if args.first.isdigit() else args.first
    last = int(args.last) if args.last.isdigit() else args.last
    start, end = byte_range_for_layers(manifest, first, last)
    indices = list(manifest.chunks_for_range(start, end))
    src = PeerSource(Endpoint.parse(args.from_), secret, timeout_s=args.timeout_s)
    seg = Segment(Path(args.out), manifest)  # blob-sized, sparse: only pulled chunks use RAM
    t0 = time.monotonic()
    try:
        stats = await fill(seg, [src], indices=indices, concurrency=args.concurrency,
                           timeout_s=args.timeout_s)
    finally:
        await src.aclose()
        seg.close()
    nbytes = sum(manifest.chunk_range(i)[1] - manifest.chunk_range(i)[0] for i in indices)
    return {"chunks": len(indices), "bytes": nbytes, "range": [start, end],
            "seconds": round(time.monotonic() - t0, 4), "stats": stats}


def main() -> int:
    argv = sys.argv[1:]
    stage_args: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, stage_args = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(prog="bench/_stage_pull.py")
    ap.add_argument("--from", dest="from_", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--first", required=True)
    ap.add_argument("--last", required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--secret-env", default="FLASHPOINT_SECRET")
    ap.add_argument("--exec-stage", action="store_true")
    args = ap.parse_args(argv)
    secret = (os.environ.get(args.secret_env) or DEFAULT_SECRET).encode()
    manifest = Manifest.from_json(Path(args.manifest).read_text())
    full = ["--manifest", args.manifest, "--blob", args.out, "--first", args.first,
            "--last", args.last, "--secret-env", args.secret_env, *stage_args]

    imported: list[BaseException] = []

    def preimport() -> None:
        try:
            import flashpoint.pipeline.stage  # noqa: F401  (imports torch)
        except BaseException as exc:  # reported after the pull
            imported.append(exc)

    t = None
    if not args.exec_stage:
        t = threading.Thread(target=preimport, name="preimport", daemon=True)
        t.start()
    info = asyncio.run(pull(args, manifest, secret))
    emit("pulled", **info)
    if args.exec_stage:
        os.execv(sys.executable, [sys.executable, "-m", "flashpoint.pipeline.stage", *full])
    assert t is not None
    t.join(120.0)
    if t.is_alive() or imported:
        emit("error", message=f"stage import failed: {imported!r}")
        return 2
    from flashpoint.pipeline import stage

    return stage.main(full)


if __name__ == "__main__":
    sys.exit(main())
