"""Publishing models into a store, and loading them back from blob bytes, zero-copy.

``publish_module`` streams a built module's weights in layer order into a blob file
(tensor by tensor: the weights are in memory once, not twice) and ``put``s it with its
manifest; every source format reaches it through
:func:`~flashpoint.models.sources.publish_source` (``sources.publish`` for a built-in
model). ``load_module`` is what a worker calls on a blob in (shared) memory: it rebuilds
the empty module from the manifest's entry point on the ``meta`` device and assigns
tensors that are views over the buffer, so loading copies no weight bytes on CPU. With
``copy=True`` it copies the bytes once, in bulk, into one private allocation (the CPU
stand-in for ``.to(device)``) while the module is being built, then views that copy.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import mmap
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from flashpoint.errors import BadRequest, IntegrityError, RegistryError
from flashpoint.ids import validate_name, validate_version
from flashpoint.models.module_tensors import LayerPlan, bind_tensors
from flashpoint.registry.format import LayerTensors, build_blob, from_state_dict, tensor_views
from flashpoint.registry.local import TMP_DIR, LocalStore
from flashpoint.registry.manifest import (
    DEFAULT_CHUNK_SIZE,
    FILE_TENSOR_PREFIX,
    BlobLayout,
    FileInfo,
    IoSignature,
    Manifest,
    layer_range,
    make_manifest,
    tensors_for_layers,
)
from flashpoint.registry.store import ModelStore

Profiler = Callable[[nn.Module, BlobLayout], Mapping[str, Mapping[str, float]]]
"""Per-layer profiles of a module whose blob has the given layout (see ``profile.py``)."""


def nonpersistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers a module registered with ``persistent=False``: not in its state dict, yet
    needed to run it (Hugging Face's ``position_ids``, say). They travel in the blob too:
    a module built on ``meta`` would otherwise have no values for them."""
    persistent = module.state_dict(keep_vars=True).keys()
    return {n: b for n, b in module.named_buffers() if n not in persistent and b is not None}


def module_layers(
    module: nn.Module,
    layer_order: Sequence[str] | None = None,
    layer_of: Callable[[str], str] | None = None,
    files: Mapping[str, bytes] | None = None,
) -> LayerTensors:
    """A module's state dict and non-persistent buffers grouped by layer, for
    :func:`build_blob`; ``files`` become ``U8`` tensors at the front of the first layer.

    Layers are ``layer_order`` (tensors mapped by ``layer_of``, default: longest module-path
    prefix), else ``module.layer_names()`` when it has one, else its top-level children.
    """
    if layer_order is not None:
        names = list(layer_order)
    elif hasattr(module, "layer_names"):
        names = list(module.layer_names())
    else:
        names = [n for n, _ in module.named_children()]
    tensors = {**module.state_dict(), **nonpersistent_buffers(module)}
    layers = from_state_dict(tensors, names, layer_of=layer_of)
    if files:
        first_name, first = layers[0]
        carried = [(file_tensor_name(p), torch.frombuffer(bytearray(b), dtype=torch.uint8)
                    if b else torch.empty(0, dtype=torch.uint8)) for p, b in files.items()]
        layers[0] = (first_name, [*carried, *first])
    return layers


def file_tensor_name(path: str) -> str:
    return FILE_TENSOR_PREFIX + path


def write_module_blob(
    module: nn.Module, path: str | Path, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
    layer_order: Sequence[str] | None = None, layer_of: Callable[[str], str] | None = None,
    files: Mapping[str, bytes] | None = None,
) -> BlobLayout:
    """Stream a module's weights (and carried files), in layer order, into a blob file."""
    _, layout = build_blob(module_layers(module, layer_order, layer_of, files),
                           chunk_size=chunk_size, path=path)
    return layout


def read_files(manifest: Manifest, buffer: Any, *, buffer_offset: int = 0) -> dict[str, bytes]:
    """The files a model version carries, read out of its blob bytes and checked against
    their sha256 (IntegrityError on a mismatch)."""
    out: dict[str, bytes] = {}
    views = tensor_views(manifest, buffer, buffer_offset=buffer_offset,
                         names=[f.tensor for f in manifest.files.values()])
    for path, info in manifest.files.items():
        data = views[info.tensor].numpy().tobytes()
        if hashlib.sha256(data).hexdigest() != info.sha256:
            raise IntegrityError(f"{manifest.name}:{manifest.version} file {path!r}: sha256 mismatch")
        out[path] = data
    return out


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
    profiler: Profiler | None = None,
    files: Mapping[str, bytes] | None = None,
    layer_plan: LayerPlan | None = None,
    task: str = "tensor",
    source_format: str = "zoo",
    trusted_code: bool = False,
    verify: Callable[[Manifest, Path], object] | None = None,
    on_put: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Build a module (in a thread), write its blob to a temp file and put it in ``store``.

    ``build`` is called off the event loop and its module dropped once the blob is written
    (and, with a ``profiler``, profiled: ``profiler(module, layout)`` runs in the same
    thread and its per-layer profiles go into the manifest before it is put; a key also
    given in ``profiles`` keeps the given value). ``files`` (path -> bytes) travel in the
    blob; ``layer_plan(module)`` gives its layers (default: ``module_layers``' rule);
    ``task``, ``source_format`` and ``trusted_code`` go into the manifest as given.
    ``verify(manifest, blob_path)`` runs in a thread before the put: what it raises stops
    the publish with nothing uploaded.
    """
    validate_name(name, "model name")
    validate_version(version)
    # Refused at push as it would be at load: only a built-in builder, or the bundle loader
    # with --trust-code, may ever be named by a manifest in the registry.
    check_entry_point(entry_point, trusted_code, f"{name}:{version}")

    def write(path: Path) -> tuple[BlobLayout, Mapping[str, Mapping[str, float]] | None,
                                   list[str]]:
        module = build()
        buffers = list(nonpersistent_buffers(module))
        order, layer_of = layer_plan(module) if layer_plan is not None else (None, None)
        layout = write_module_blob(module, path, chunk_size=chunk_size, layer_order=order,
                                   layer_of=layer_of, files=files)
        return layout, (profiler(module, layout) if profiler is not None else None), buffers

    staging = _staging_dir(store, tmp_dir)
    with tempfile.TemporaryDirectory(prefix="publish-", dir=staging) as td:
        path = Path(td) / "weights.safetensors"
        layout, measured, buffers = await asyncio.to_thread(write, path)
        if measured is not None:
            given = profiles or {}
            profiles = {n: {**measured.get(n, {}), **given.get(n, {})}
                        for n in {*measured, *given}}
        carried = {p: FileInfo(file_tensor_name(p), hashlib.sha256(b).hexdigest(), len(b))
                   for p, b in (files or {}).items()}
        manifest = make_manifest(
            name=name, version=version, layout=layout, entry_point=entry_point,
            config=config, io=io, profiles=profiles, files=carried, buffers=buffers,
            task=task, source_format=source_format, trusted_code=trusted_code,
        )
        if verify is not None:
            await asyncio.to_thread(verify, manifest, path)
        if on_put is not None:
            on_put(0, manifest.blob_size)
        await store.put(manifest, path)
        if on_put is not None:
            on_put(manifest.blob_size, manifest.blob_size)
    return manifest


BUILTIN_ENTRY_POINTS = frozenset({
    "flashpoint.models.bert:build_empty",
    "flashpoint.models.resnet:build_empty",
    "flashpoint.models.noop:build_empty",
    "flashpoint.models.hf:build_empty",
    "flashpoint.models.archive:build_empty",
    "flashpoint.models.handler:build_empty",
})
"""The only builders a worker calls: code that ships with Flashpoint. A manifest is data
from the registry; naming any importable callable in it (``os:system``) must not run it.
User code runs only from a bundle an admin trusted (its own loader is listed here).

Two flags a builder may carry (function attributes): ``takes_files`` -- it is called as
``builder(config, files)`` with the files its model version carries (a TorchScript or
exported program's code, a handler bundle's modules), so it builds only where the blob
is (whole, never as a stage skeleton); ``runs_user_code`` -- it imports code that came
with the model, and is refused unless the manifest says an admin trusted it
(``trusted_code``)."""


def resolve_entry_point(entry_point: str) -> Callable[[Mapping[str, Any]], nn.Module]:
    """Import ``"package.module:function"``, a built-in builder only; RegistryError when it
    is not one or cannot be found."""
    module_name, _, attr = entry_point.partition(":")
    if not module_name or not attr:
        raise BadRequest(f"entry point {entry_point!r} must look like 'module:function'")
    if entry_point not in BUILTIN_ENTRY_POINTS:
        raise RegistryError(f"entry point {entry_point!r} is not a built-in model builder; "
                            "refusing to run it")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RegistryError(f"entry point {entry_point!r} not importable: {e}") from e
    if not callable(fn):
        raise RegistryError(f"entry point {entry_point!r} is not callable")
    return fn


def check_entry_point(entry_point: str, trusted_code: bool, what: str = "") -> Callable[..., Any]:
    """The builder ``entry_point`` names, if a worker may call it: a built-in builder, or the
    bundle loader of a model an admin trusted (``trusted_code``); RegistryError otherwise.
    Push (:func:`publish_module`) and load (:func:`_empty_module`) both ask it."""
    build = resolve_entry_point(entry_point)
    if getattr(build, "runs_user_code", False) and not trusted_code:
        raise RegistryError(f"{what or entry_point} runs code that came with it "
                            "and no admin trusted it (trusted_code is false); refusing to "
                            "load it")
    return build


def builder_takes_files(manifest: Manifest) -> bool:
    """Whether the manifest's builder builds from the files its model carries."""
    return bool(getattr(resolve_entry_point(manifest.entry_point), "takes_files", False))


def _empty_module(manifest: Manifest, files: Mapping[str, bytes] | None = None) -> nn.Module:
    """The manifest's module, no weights yet; RegistryError for a builder it cannot call:
    not built in, user code no admin trusted, or one that needs files not given here."""
    build = check_entry_point(manifest.entry_point, manifest.trusted_code,
                              f"{manifest.name}:{manifest.version}")
    if getattr(build, "takes_files", False):
        if files is None:
            raise RegistryError(f"entry point {manifest.entry_point!r} builds from the files "
                                "its model carries: it loads whole, from its blob")
        module = build(manifest.config, files)
    else:
        module = build(manifest.config)
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


class _BulkCopy:
    """Copy a buffer into one fresh private allocation on a background thread.

    One anonymous mapping and one ``Tensor.copy_`` (torch splits it over its intra-op
    threads and releases the GIL), so the caller builds the module meanwhile; the tensors
    are then views over the copy, 64-byte aligned like the blob. What a private copy costs
    on CPU beyond a memcpy is the first touch of fresh memory (a fault and a zeroed page
    per 4 KiB). Huge pages are left to the system's THP policy: ``MADV_HUGEPAGE`` made the
    copy ~4x faster back to back on the 2-vCPU dev VM but ~4x slower once the memory had
    been idle for seconds (virtio-balloon free-page reporting hands free 2 MiB blocks back
    to the hypervisor, which must fault them in again) -- see bench/loader.py.
    """

    def __init__(self, buffer: Any) -> None:
        src = memoryview(buffer)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        self.size_bytes = len(src)
        self.memory = mmap.mmap(-1, max(self.size_bytes, 1),
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(src,), name="fp-bulk-copy",
                                         daemon=True)
        self._thread.start()

    def _run(self, src: memoryview) -> None:
        try:
            if self.size_bytes:
                with warnings.catch_warnings():  # a read-only source is only read
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    source = torch.frombuffer(src, dtype=torch.uint8)
                dest = torch.frombuffer(self.memory, dtype=torch.uint8)[:self.size_bytes]
                dest.copy_(source)
        except BaseException as e:  # re-raised by wait()
            self._error = e

    @property
    def view(self) -> memoryview:
        """The destination bytes: complete only once :meth:`wait` has returned."""
        return memoryview(self.memory)[:self.size_bytes]

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> None:
        """Wait for the copy; RegistryError if it failed."""
        self._thread.join()
        if self._error is not None:
            raise RegistryError(f"copying the weights failed: {self._error}") from self._error


def load_module(
    manifest: Manifest,
    buffer: Any,
    device: str | torch.device = "cpu",
    *,
    buffer_offset: int = 0,
    copy: bool = False,
) -> nn.Module:
    """The whole model over blob bytes in ``buffer`` (zero-copy on CPU), in eval mode.

    On CPU the module's weights *are* the buffer's memory: keep the buffer alive and
    unchanged while the module is used (the tensors hold a reference to it). With
    ``copy=True`` the module owns a private copy instead (one bulk copy, overlapped with
    building the module) and ``buffer`` may be released as soon as this returns;
    on a non-CPU device the move to the device copies anyway and ``copy`` changes nothing.
    """
    files = (read_files(manifest, buffer, buffer_offset=buffer_offset)
             if builder_takes_files(manifest) else None)
    bulk = _BulkCopy(buffer) if copy and torch.device(device).type == "cpu" else None
    try:  # with a bulk copy, the module is built and bound while the bytes are copied
        with _SkipMetaInit():  # its initial values are replaced by the blob's anyway
            module = _empty_module(manifest, files)
        views = tensor_views(manifest, bulk.view if bulk else buffer, buffer_offset=buffer_offset,
                             names=[*manifest.module_tensors(), *manifest.buffers])
        bind_tensors(module, views, manifest.buffers, manifest.entry_point)
    finally:
        if bulk is not None:
            bulk.join()  # never leave a copy running behind a raised error
    if bulk is not None:
        bulk.wait()
    return _finish(module, device)


# In-place initialisers that only write values: on a ``meta`` tensor (no storage) each is a
# no-op that returns its argument. ``nn.init`` names and the tensor methods they call.
_META_NOOP_INITS = frozenset({
    "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "random_",
    "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "erfinv_", "clamp_",
})


def empty_module(manifest: Manifest) -> nn.Module:
    """The model's module with no weights yet (initialisation skipped): for binding to
    tensors that exist elsewhere, e.g. another process's CUDA IPC weights
    (flashpoint/gpu/weight_share.py) with ``load_state_dict(assign=True)``."""
    with _SkipMetaInit():
        return _empty_module(manifest)


class _SkipMetaInit(TorchFunctionMode):
    """Skip parameter initialisation of ``meta`` tensors while an empty module is built.

    Building on ``meta`` still runs every ``reset_parameters``; ``Tensor.normal_``'s meta
    kernel is a Python reference guarded by ``torch._disable_dynamo``, whose first call
    imports ``torch._dynamo`` (~2 s of CPU on the 2-vCPU dev VM, more than the whole stage
    build). The values are discarded anyway (``load_state_dict(assign=True)`` replaces every
    tensor), so initialisers whose first argument is a meta tensor return it untouched.
    The mode stack is per thread: other threads' initialisers are unaffected.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _META_NOOP_INITS:
            # nn.init passes its tensor by keyword (handle_torch_function), methods as self
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def is_hf(manifest: Manifest) -> bool:
    """A Hugging Face model: its stages are :mod:`~flashpoint.models.hf_stages` modules."""
    from flashpoint.models.hf import ENTRY_POINT

    return manifest.entry_point == ENTRY_POINT


def stage_skeleton(manifest: Manifest, first: int | str, last: int | str) -> nn.Module:
    """Layers ``first..last`` (inclusive) as an ``nn.Sequential`` on ``meta``, no weights;
    for a Hugging Face model an :class:`~flashpoint.models.hf_stages.HFStage` (its stages
    pass hidden states and the attention mask on; BadRequest for a family with no adapter).

    Needs no blob bytes, so a stage can build it while its bytes are still arriving and hand
    it to :func:`load_stage` (``skeleton=``), which then only binds views. Built without
    initialising parameters (see :class:`_SkipMetaInit`). One skeleton serves one load.
    """
    i, j = layer_range(manifest, first, last)
    if is_hf(manifest):
        from flashpoint.models import hf_stages

        family = hf_stages.family_of(manifest.config)
        with _SkipMetaInit():
            wrapper = _empty_module(manifest)
        return hf_stages.HFStage(wrapper, family, [la.name for la in manifest.layers[i:j + 1]])
    with _SkipMetaInit():
        module = _empty_module(manifest)
    parts: list[nn.Module] = []
    for layer in manifest.layers[i:j + 1]:
        try:
            parts.append(module.get_submodule(layer.name))
        except AttributeError as e:
            raise RegistryError(f"layer {layer.name!r} is not a submodule: {e}") from e
    return nn.Sequential(*parts)


def load_stage(
    manifest: Manifest,
    buffer: Any,
    first: int | str,
    last: int | str,
    device: str | torch.device = "cpu",
    *,
    buffer_offset: int = 0,
    skeleton: nn.Module | None = None,
) -> nn.Module:
    """Layers ``first..last`` (inclusive) as an ``nn.Sequential``: a pipeline stage (for a
    Hugging Face model an :class:`~flashpoint.models.hf_stages.HFStage`).

    ``buffer`` may hold just the stage's byte range (pass ``buffer_offset`` = its start,
    from :func:`~flashpoint.registry.byte_range_for_layers`). Layer names must be module
    paths of the entry point's module (``layers.3``), as for the built-in models.
    ``skeleton``: the same layers from :func:`stage_skeleton`, built ahead of time (it is
    consumed: its tensors are replaced by views over ``buffer``).
    """
    i, j = layer_range(manifest, first, last)
    layers = manifest.layers[i:j + 1]
    stage = stage_skeleton(manifest, first, last) if skeleton is None else skeleton
    files = {f.tensor for f in manifest.files.values()}
    views = tensor_views(
        manifest, buffer, buffer_offset=buffer_offset,
        names=[n for n in tensors_for_layers(manifest, i, j) if n not in files],
    )
    if is_hf(manifest):
        from flashpoint.models import hf_stages

        if not isinstance(stage, hf_stages.HFStage) or stage.layer_names != [
                la.name for la in layers]:
            raise BadRequest(f"skeleton is not the stage {layers[0].name}..{layers[-1].name}")
        hf_stages.bind(stage, views, manifest.buffers)
        return _finish(stage, device)
    assert isinstance(stage, nn.Sequential)
    if len(stage) != len(layers):
        raise BadRequest(f"skeleton has {len(stage)} layers, the stage {len(layers)}")
    for layer, sub in zip(layers, stage, strict=True):
        prefix = layer.name + "."
        sub_state = {n[len(prefix):]: views[n] for n in layer.tensors if n not in files}
        sub_buffers = [n[len(prefix):] for n in manifest.buffers if n in layer.tensors]
        bind_tensors(sub, sub_state, sub_buffers, f"layer {layer.name!r}")
    _finish(stage, device)
    return stage
