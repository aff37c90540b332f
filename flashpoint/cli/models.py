"""``flashpoint model push | list | delete``: the model registry from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from flashpoint.cli.tables import size, table
from flashpoint.config import ClusterConfig
from flashpoint.errors import ModelNotFound
from flashpoint.registry import make_store


async def push(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    """``model push NAME [SOURCE]``: SOURCE a directory or archive the user brings, or a
    built-in model; without SOURCE, NAME is a built-in model (``push bert --preset small``).
    Any error is one line and exit 1, before anything is uploaded."""
    from flashpoint.models.sources import PushOptions, publish_source
    from flashpoint.models.sources.base import parse_tensor_spec

    if args.source is None:
        name, source = args.name or args.model, args.model
    else:
        name, source = args.model, args.source
    bar = _PushProgress(sys.stderr)
    try:
        options = PushOptions(trust_code=args.trust_code, truncate=args.truncate,
                              top_k=args.top_k, preset=args.preset, profile=args.profile,
                              profile_device=args.profile_device,
                              inputs=tuple(parse_tensor_spec(t) for t in args.input or ()))
        manifest = await publish_source(make_store(cfg), name, source, version=args.version,
                                        fmt=args.format, options=options, progress=bar)
    finally:
        bar.done()  # the error line (or the JSON) starts on a line of its own
    out: dict[str, Any] = {"model": manifest.name, "version": manifest.version,
                           "format": manifest.source_format, "task": manifest.task,
                           "bytes": manifest.blob_size, "layers": len(manifest.layers),
                           "files": sorted(manifest.files)}
    if args.profile:
        out["profile"] = {layer.name: layer.profile for layer in manifest.layers}
    print(json.dumps(out))


class _PushProgress:
    """One line on a terminal, redrawn per phase of a push (load, write, verify, upload)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.drawn = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        from flashpoint.progress import bar

        line = f"{phase:<7} {bar(done, total)}  {time.monotonic() - self.started:6.1f}s"
        if total > 1:
            line += f"  {total / 1e6:.1f} MB"
        if self.tty:
            self.stream.write("\r" + line)
            self.drawn = True
        elif done >= total:  # not a terminal: one line per finished phase
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


async def _model_list(cfg: ClusterConfig, as_json: bool) -> None:
    store = make_store(cfg)
    rows = []
    for name, version in await store.list_models():
        m = await store.get_manifest(name, version)
        rows.append({"name": name, "version": version, "size_bytes": m.blob_size,
                     "layers": len(m.layers), "entry_point": m.entry_point})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for line in table(("NAME", "VERSION", "SIZE", "LAYERS", "ENTRY POINT"),
                      [(r["name"], r["version"], size(r["size_bytes"]), r["layers"],
                        r["entry_point"]) for r in rows]):
        print(line)


async def _model_delete(cfg: ClusterConfig, name: str, version: str | None) -> None:
    """Delete one version, or every version of ``name``; a missing one is a one-line error."""
    store = make_store(cfg)
    if version is None:
        versions = [v for n, v in await store.list_models() if n == name]
        if not versions:
            raise ModelNotFound(f"model {name} not found in the registry (`flashpoint model "
                                "list` shows what it holds)", name=name)
    else:
        versions = [version]
    for v in versions:
        await store.delete(name, v)
        print(json.dumps({"deleted": name, "version": v}))


async def model_admin(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    """``model list`` and ``model delete`` (registry errors propagate: one line each)."""
    if args.model_cmd == "list":
        await _model_list(cfg, args.json)
    else:
        await _model_delete(cfg, args.model, args.version)
