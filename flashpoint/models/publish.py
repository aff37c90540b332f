"""Publishing models into a store, and loading them back from blob bytes, zero-copy.

``publish`` builds a built-in model, streams its weights in layer order into a blob file
(tensor by tensor: the weights are in memory once, not twice) and ``put``s it with its
manifest. ``load_module`` is what a worker calls on a blob in (shared) memory: it rebuilds
the empty module from the manifest's entry point on the ``meta`` device and assigns
tensors that are views over the buffer, so loading copies no weight bytes on CPU.
"""

from __future__ import annotations

import asyncio
import importlib
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashpoint.errors import BadRequest, RegistryError
from flashpoint.ids import validate_name, validate_version
from flashpoint.models import zoo
from flashpoint.registry.format import LayerTensors, build_blob, from_state_dict, tensor_views
from flashpoint.registry.local import TMP_DIR, LocalStore
from flashpoint.registry.manifest import (
    DEFAULT_CHUNK_SIZE,
    BlobLayout,
    IoSignature,
    Manifest,
    layer_range,
    make_manifest,
    tensors_for_layers,
)
from flashpoint.registry.store import ModelStore


def module_layers(module: nn.Module) -> LayerTensors:
    """A module's state dict grouped by layer, for :func:`build_blob`.

    Layers are ``module.layer_names()`` when it has one, else its top-level children.
    """
    if hasattr(module, "layer_names"):
        names = list(module.layer_names())
    else:
        names = [n for n, _ in module.named_children()]
    return from_state_dict(module.state_dict(), names)


def write_module_blob(
    module: nn.Module, path: str | Path, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> BlobLayout:
    """Stream a module's weights, in layer order, into a blob file."""
    _, layout = build_blob(module_layers(module), chunk_size=chunk_size, path=path)
    return layout


def _staging_dir(store: ModelStore, tmp_dir: str | Path | None) -> Path | None:
    if tmp_dir is not None:
        return Path(tmp_dir)
    if isinstance(store, LocalStore):  # same filesystem, and never a RAM-backed /tmp
        staging = store.root / TMP_DIR
        staging.mkdir(parents=True, exist_ok=True)
        return staging
    return None


async def publish_module(
    store: ModelStore,
    build: Callable[[], nn.Module],
    *,
    name: str,
    version: str,
    entry_point: str,
    config: Mapping[str, Any],
    io: IoSignature,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    profiles: Mapping[str, Mapping[str, float]] | None = None,
    tmp_dir: str | Path | None = None,
) -> Manifest:
    """Build a module (in a thread), write its blob to a temp file and put it in ``store``.

    ``build`` is called off the event loop and its module dropped once the blob is written.
    """
    validate_name(name, "model name")
    validate_version(version)

    def write(path: Path) -> BlobLayout:
        return write_module_blob(build(), path, chunk_size=chunk_size)

    staging = _staging_dir(store, tmp_dir)
    with tempfile.TemporaryDirectory(prefix="publish-", dir=staging) as td:
        path = Path(td) / "weights.safetensors"
        layout = await asyncio.to_thread(write, path)
        manifest = make_manifest(
            name=name, version=version, layout=layout, entry_point=entry_point,
            config=config, io=io, profiles=profiles,
        )
        await store.put(manifest, path)
    return manifest


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
) -> Manifest:
    """Publish built-in model ``name`` (a preset or config overrides) into ``store``.

    The registry name is ``model_name``, by default ``"<name>-<preset>"`` for a preset
    (``bert-tiny``) and ``name`` for a config dict.
    """
    model = zoo.get(name)
    config = model.resolve(preset)
    if model_name is None:
        model_name = f"{name}-{preset}" if isinstance(preset, str) else name
    return await publish_module(
        store,
        lambda: model.build_from_config(config, seed=seed),
        name=model_name, version=version, entry_point=model.entry_point, config=config,
        io=zoo.io_signature(name, config), chunk_size=chunk_size, profiles=profiles,
        tmp_dir=tmp_dir,
    )


def resolve_entry_point(entry_point: str) -> Callable[[Mapping[str, Any]], nn.Module]:
    """Import ``"package.module:function"``; RegistryError when it cannot be found."""
    module_name, _, attr = entry_point.partition(":")
    if not module_name or not attr:
        raise BadRequest(f"entry point {entry_point!r} must look like 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RegistryError(f"entry point {entry_point!r} not importable: {e}") from e
    if not callable(fn):
        raise RegistryError(f"entry point {entry_point!r} is not callable")
    return fn


def _empty_module(manifest: Manifest) -> nn.Module:
    module = resolve_entry_point(manifest.entry_point)(manifest.config)
    if not isinstance(module, nn.Module):
        raise RegistryError(f"entry point {manifest.entry_point!r} returned no nn.Module")
    return module


def _finish(module: nn.Module, device: str | torch.device) -> nn.Module:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            raise RegistryError(f"module tensor {name!r} has no weights in the blob")
    module.requires_grad_(False)
    module.eval()
    if torch.device(device).type != "cpu":
        module.to(device)
    return module


def load_module(
    manifest: Manifest,
    buffer: Any,
    device: str | torch.device = "cpu",
    *,
    buffer_offset: int = 0,
) -> nn.Module:
    """The whole model over blob bytes in ``buffer`` (zero-copy on CPU), in eval mode.

    On CPU the module's weights *are* the buffer's memory: keep the buffer alive and
    unchanged while the module is used (the tensors hold a reference to it).
    """
    module = _empty_module(manifest)
    views = tensor_views(manifest, buffer, buffer_offset=buffer_offset)
    try:
        module.load_state_dict(views, strict=True, assign=True)
    except RuntimeError as e:
        raise RegistryError(f"blob does not fit {manifest.entry_point}: {e}") from e
    return _finish(module, device)


def load_stage(
    manifest: Manifest,
    buffer: Any,
    first: int | str,
    last: int | str,
    device: str | torch.device = "cpu",
    *,
    buffer_offset: int = 0,
) -> nn.Sequential:
    """Layers ``first..last`` (inclusive) as an ``nn.Sequential``: a pipeline stage.

    ``buffer`` may hold just the stage's byte range (pass ``buffer_offset`` = its start,
    from :func:`~flashpoint.registry.byte_range_for_layers`). Layer names must be module
    paths of the entry point's module (``layers.3``), as for the built-in models.
    """
    i, j = layer_range(manifest, first, last)
    module = _empty_module(manifest)
    views = tensor_views(
        manifest, buffer, buffer_offset=buffer_offset,
        names=tensors_for_layers(manifest, i, j),
    )
    parts: list[nn.Module] = []
    for layer in manifest.layers[i:j + 1]:
        try:
            sub = module.get_submodule(layer.name)
        except AttributeError as e:
            raise RegistryError(f"layer {layer.name!r} is not a submodule: {e}") from e
        prefix = layer.name + "."
        sub_state = {n[len(prefix):]: views[n] for n in layer.tensors}
        try:
            sub.load_state_dict(sub_state, strict=True, assign=True)
        except RuntimeError as e:
            raise RegistryError(f"layer {layer.name!r} does not fit the blob: {e}") from e
        parts.append(sub)
    stage = nn.Sequential(*parts)
    _finish(stage, device)
    return stage
