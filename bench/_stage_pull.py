"""Bench helper (bench/partition.py): pull one stage's chunks from a peer, then serve the stage.

``node get`` fetches whole blobs only, so this pulls just the chunks covering layers
FIRST..LAST (``byte_range_for_layers`` -> ``chunks_for_range``) with ``PeerSource`` +
``fill(indices=...)`` into a blob-sized sparse file (only those chunks are written, each
verified against the manifest's sha256), prints ``{"event": "pulled", ...}``, then runs
``flashpoint.pipeline.stage`` over that file with the remaining arguments:

    python bench/_stage_pull.py --from id:addr:port --manifest M --out PATH --first I --last J
        [--exec-stage | --prestarted] -- <stage args without --manifest/--blob/--first/--last>

Default: the stage runs in this process, with ``flashpoint.pipeline.stage`` (and torch)
imported, the manifest parsed and the stage's layers built on ``meta``
(``stage.prepare_stage``) on a thread *while* the chunks arrive, as a host's pre-started
worker has torch imported before a model is assigned; after the pull the stage only maps its
byte range and binds the weights. ``--exec-stage``: exec ``python -m
flashpoint.pipeline.stage`` after the pull instead (a cold process, torch imported after the
bytes are in). ``--prestarted``: do that preparation first, print ``{"event": "ready",
"pid"}`` and start pulling only on SIGUSR1 (a worker started, and torch imported, before the
model was assigned). The cluster secret comes from ``FLASHPOINT_SECRET`` (or
``--secret-env``). Timestamps (``time.monotonic()``, system-wide) ride on the events:
``pulled`` has ``t_start`` (this script's start), ``t_pull0``, ``t_pull1``; ``imported`` has
``t_imported``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

T_START = time.monotonic()  # before the project's imports
# No cyclic GC while starting: the collections that importing torch triggers cost ~10% of
# the import's CPU (~0.3 CPU-s on the 2-vCPU dev VM); re-enabled before serving.
gc.disable()
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flashpoint.config import secret_from_env  # noqa: E402
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
            "seconds": round(time.monotonic() - t0, 4), "stats": stats, "t_pull0": t0,
            "t_pull1": time.monotonic()}


def prepare(manifest_path: str, first: str, last: str) -> tuple[float, tuple]:
    """Import the stage module (torch) and build the stage's layers on ``meta``: all a
    stage needs before its bytes; returns when the import was done, and the prepared
    stage for ``stage.main``."""
    from flashpoint.pipeline import stage  # imports torch

    t_imported = time.monotonic()
    try:
        import uvloop  # noqa: F401  (stage.main runs on it when installed)
    except ImportError:
        pass
    prepared = stage.prepare_stage(manifest_path, stage._layer(first), stage._layer(last))
    return t_imported, prepared


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
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--exec-stage", action="store_true")
    mode.add_argument("--prestarted", action="store_true",
                      help="prepare first, print ready, pull on SIGUSR1")
    args = ap.parse_args(argv)
    if args.prestarted:  # blocked before anyone can know our pid: the signal waits for us
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    secret = secret_from_env(args.secret_env)
    manifest = Manifest.from_json(Path(args.manifest).read_text())
    full = ["--manifest", args.manifest, "--blob", args.out, "--first", args.first,
            "--last", args.last, "--secret-env", args.secret_env, *stage_args]

    done: list[tuple[float, tuple]] = []
    failed: list[BaseException] = []

    def preimport() -> None:
        try:
            done.append(prepare(args.manifest, args.first, args.last))
        except BaseException as exc:  # reported after the pull
            failed.append(exc)

    t = None
    if args.prestarted:
        preimport()
        emit("ready", pid=os.getpid())
        signal.sigwait({signal.SIGUSR1})
    elif not args.exec_stage:
        t = threading.Thread(target=preimport, name="preimport", daemon=True)
        t.start()
    info = asyncio.run(pull(args, manifest, secret))
    emit("pulled", t_start=T_START, **info)
    if args.exec_stage:
        os.execv(sys.executable, [sys.executable, "-m", "flashpoint.pipeline.stage", *full])
    if t is not None:
        t.join(120.0)
    if not done:
        emit("error", message=f"stage import failed: {failed!r}")
        return 2
    t_imported, prepared = done[0]
    emit("imported", t_imported=t_imported)
    gc.freeze()  # what start-up allocated stays: later collections need not scan it
    gc.enable()
    from flashpoint.pipeline import stage

    return stage.main(full, prepared=prepared)


if __name__ == "__main__":
    sys.exit(main())
