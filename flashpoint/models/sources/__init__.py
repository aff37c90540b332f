"""Publishing a model a user brings: one pipeline, one adapter per source format.

``publish_source`` detects the format (or takes ``fmt``), has its adapter check and
describe the source (:class:`~flashpoint.models.sources.base.Prepared`) -- a missing or
inconsistent file is an ``UnsupportedModel`` naming it, before anything is uploaded --
loads the model once, writes its weights in execution order with the files it carries
into one blob, loads that blob back the way a worker will and answers one request
through its serving task (so a model that cannot serve fails here, not at its third cold
start), and only then puts blob and manifest in the store.

Formats: ``hf`` (a Hugging Face directory), ``torchscript`` / ``export`` (``.pt`` /
``.pt2`` archives), ``handler`` (a bundle of user code, admin-trusted only), ``zoo`` (the
built-in models; :func:`publish` is the short way to push one).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flashpoint.errors import UnsupportedModel
from flashpoint.models import zoo as model_zoo  # not "zoo": that is the .zoo adapter module here
from flashpoint.models.sources.archive import ExportedArchive, TorchScriptArchive
from flashpoint.models.sources.base import Prepared, PushOptions, SourceFormat
from flashpoint.models.sources.handler import HandlerBundle
from flashpoint.models.sources.hf import HuggingFaceDirectory
from flashpoint.models.sources.zoo import BuiltIn
from flashpoint.registry.manifest import DEFAULT_CHUNK_SIZE, Manifest
from flashpoint.registry.store import ModelStore

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: phases ``load``, ``write``, ``verify``, ``upload``."""

FORMATS: dict[str, SourceFormat] = {
    f.name: f for f in (BuiltIn(), HuggingFaceDirectory(), TorchScriptArchive(),
                        ExportedArchive(), HandlerBundle())
}


def register(fmt: SourceFormat) -> None:
    """Add a format adapter (detection tries them in registration order)."""
    FORMATS[fmt.name] = fmt


def detect(source: str | Path) -> SourceFormat:
    """The adapter for ``source``; UnsupportedModel saying what was expected."""
    path = Path(source)
    for fmt in FORMATS.values():
        if fmt.matches(path):
            return fmt
    if not path.exists():
        raise UnsupportedModel(f"{source}: no such file or directory (nor a built-in model: "
                               "bert, resnet, noop)")
    raise UnsupportedModel(
        f"{source}: not a model source Flashpoint knows (expected a Hugging Face directory "
        "with config.json, a TorchScript .pt or torch.export .pt2 archive, or a handler "
        "directory with flashpoint.toml)")


def prepare(source: str | Path, fmt: str | None, options: PushOptions) -> Prepared:
    """Detect (or take) the format and let its adapter check and describe ``source``."""
    if fmt is not None:
        adapter = FORMATS.get(fmt)
        if adapter is None:
            raise UnsupportedModel(f"unknown format {fmt!r} (choose one of {sorted(FORMATS)})")
    else:
        adapter = detect(source)
    return adapter.prepare(Path(source), options)


def verify_blob(manifest: Manifest, blob_path: str | Path) -> None:
    """Load a written blob the way a worker does and answer its warm-up request; raises
    what a worker would (RegistryError, a BadRequest subclass) as UnsupportedModel."""
    import torch

    from flashpoint.errors import FlashpointError
    from flashpoint.models import serving
    from flashpoint.models.publish import load_module, read_files

    with open(blob_path, "rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        try:
            module = load_module(manifest, memoryview(mapping))
            served = serving.for_manifest(manifest, read_files(manifest, memoryview(mapping)))
            if getattr(served, "generates", False):  # a causal LM: a short generation
                _generate_once(served, module)
            else:
                request = served.prepare(served.warmup_request())
                with torch.inference_mode():
                    out = module(*(torch.from_numpy(request[n]) for n in served.module_inputs))
                outs = out if isinstance(out, (tuple, list)) else (out,)
                served.finish({n: o.detach().cpu().numpy()
                               for n, o in zip(served.module_outputs, outs, strict=False)})
        except FlashpointError as e:
            raise UnsupportedModel(f"{manifest.name}: does not serve once published: "
                                   f"{e.message}"[:500]) from None
        except Exception as e:  # the model's own code raised on its warm-up request
            raise UnsupportedModel(f"{manifest.name}: its first inference failed: "
                                   f"{type(e).__name__}: {e}"[:500]) from None
        del module
    finally:
        try:
            mapping.close()
        except BufferError:  # a view still alive: the mapping goes with the last one
            pass


async def publish_source(
    store: ModelStore,
    name: str,
    source: str | Path,
    *,
    version: str = "1",
    fmt: str | None = None,
    trust_code: bool = False,
    options: PushOptions | None = None,
    progress: Progress | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    tmp_dir: str | Path | None = None,
) -> Manifest:
    """Publish ``source`` as ``name@version``; see the module docstring."""
    import asyncio

    from flashpoint.models.publish import publish_module

    opts = options or PushOptions()
    if trust_code and not opts.trust_code:
        from dataclasses import replace

        opts = replace(opts, trust_code=True)
    note = progress or (lambda phase, done, total: None)
    note("load", 0, 1)
    prepared = await asyncio.to_thread(prepare, source, fmt, opts)

    def build() -> Any:
        module = prepared.build()
        note("load", 1, 1)
        return module

    def verify(manifest: Manifest, path: Path) -> None:
        note("verify", 0, 1)
        verify_blob(manifest, path)
        note("verify", 1, 1)

    return await publish_module(
        store, build, name=name, version=version, entry_point=prepared.entry_point,
        config=prepared.config, io=prepared.io, chunk_size=chunk_size, tmp_dir=tmp_dir,
        profiles=opts.profiles or None, profiler=prepared.profiler, files=prepared.files,
        layer_plan=prepared.layer_plan, task=prepared.task,
        source_format=_format_name(source, fmt), trusted_code=prepared.trusted_code,
        verify=verify, on_put=lambda done, total: note("upload", done, total),
    )


def _format_name(source: str | Path, fmt: str | None) -> str:
    return fmt if fmt is not None else detect(source).name


__all__ = ["FORMATS", "Prepared", "PushOptions", "detect", "prepare", "publish_source",
           "register", "verify_blob"]


async def publish(
    store: ModelStore,
    name: str,
    preset: str | Mapping[str, Any] = "tiny",
    version: str = "1",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    model_name: str | None = None,
    seed: int = 0,
    profiles: Mapping[str, Mapping[str, float]] | None = None,
    tmp_dir: str | Path | None = None,
    profile: bool = False,
    profile_device: str = "cpu",
    profile_batch: int = 1,
) -> Manifest:
    """Publish built-in model ``name`` (a preset or config overrides) into ``store``.

    The registry name is ``model_name``, by default ``"<name>-<preset>"`` for a preset
    (``bert-tiny``) and ``name`` for a config dict. With ``profile=True`` every layer's
    ``bytes``, ``exec_time_s`` and ``output_bytes`` are measured on ``profile_device`` for
    a batch of ``profile_batch`` example inputs
    (:func:`~flashpoint.models.profile.profile_layers`) and written into the manifest.
    The built-in models are one format of :func:`publish_source` (``fmt="zoo"``).
    """
    model_zoo.get(name)
    if model_name is None:
        model_name = f"{name}-{preset}" if isinstance(preset, str) else name
    options = PushOptions(
        preset=preset if isinstance(preset, str) else "tiny",
        extra=dict(preset) if not isinstance(preset, str) else {}, seed=seed, profile=profile,
        profile_device=profile_device, profile_batch=profile_batch, profiles=profiles or {})
    return await publish_source(store, model_name, name, version=version, fmt="zoo",
                                options=options, chunk_size=chunk_size, tmp_dir=tmp_dir)


def _generate_once(served: Any, module: Any) -> None:
    """Its warm-up request through a generation engine of its own, to the end."""
    engine = served.build_engine(module, max_running=1)
    request = served.prepare(served.warmup_request())
    engine.add(list(request.prompt_ids), request.params)
    for _ in range(request.params.max_tokens + 1):
        engine.step()
        if engine.idle:
            return
    raise UnsupportedModel("its warm-up generation did not finish")
