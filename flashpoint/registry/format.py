"""The Flashpoint model format: one safetensors blob in layer order plus a JSON manifest.

The weights blob *is* a valid safetensors file (8-byte little-endian header length, JSON
header, data section), with three extra guarantees:

* tensors are laid out in **layer order**, so the tensors of a contiguous group of layers
  (one partition stage) are one contiguous byte range of the blob;
* the data section starts at a 64-byte-aligned offset (the JSON header is padded with
  spaces, which the safetensors spec allows) and every tensor starts at a 64-byte-aligned
  offset, so a blob in page-aligned shared memory can be viewed in place (zero-copy);
* safetensors wants tensors to tile the data section with no gaps, so alignment gaps hold
  explicit ``U8`` padding tensors named ``__fp_pad_<n>``; they are not model tensors and
  never appear in the manifest or in a state dict.

Layer byte ranges tile ``[data_offset, blob_size)``: a layer starts at its first tensor
(64-aligned) and ends where the next layer starts, so the padding after a layer's last
tensor belongs to that layer and ``byte_range_for_layers`` of layers ``i..j`` is simply
``(layers[i].byte_start, layers[j].byte_end)``.

The :class:`~flashpoint.registry.manifest.Manifest` (torch-free, in its own module so
planning code can read it without torch) describes the blob: tensors (dtype, shape,
absolute byte range), layers, the sha256 of every ``chunk_size`` piece of the whole blob
(header included), a per-layer profile, the importable entry point that builds the module,
and its I/O signature. This module holds the torch half: writing blobs, zero-copy views,
and import from / export to safetensors files and state dicts.
"""

from __future__ import annotations

import io
import json
import os
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from flashpoint.errors import BadRequest
from flashpoint.registry.blob_header import parse_header
from flashpoint.registry.chunks import ChunkHasher
from flashpoint.registry.manifest import (
    ALIGN_BYTES,
    DEFAULT_CHUNK_SIZE,
    FORMAT_VERSION,
    LAYERS_METADATA_KEY,
    MAX_CHUNK_SIZE,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    PAD_PREFIX,
    BlobLayout,
    LayerInfo,
    Manifest,
    TensorInfo,
    align_up,
    tensor_nbytes,
)

# safetensors dtype code -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

_NOT_WRITABLE_WARNING = r"The given buffer is not writable"

# One (layer name, [(tensor name, tensor), ...]) per layer, in execution order.
LayerTensors = list[tuple[str, list[tuple[str, torch.Tensor]]]]


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code (``F32``...) of a torch dtype; BadRequest if unsupported."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise BadRequest(f"unsupported tensor dtype {dtype}") from None



# --------------------------------------------------------------------------------------
# Writing blobs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int


def _plan(
    layers: Sequence[tuple[str, Sequence[tuple[str, str, tuple[int, ...]]]]],
) -> tuple[list[_Entry], list[tuple[str, list[str], int]], int]:
    """Relative layout: header entries (pads included), (layer, tensors, start), data size."""
    entries: list[_Entry] = []
    layer_starts: list[tuple[str, list[str], int]] = []
    pos = 0
    pads = 0

    def pad_to_alignment() -> None:
        nonlocal pos, pads
        aligned = align_up(pos)
        if aligned != pos:
            entries.append(_Entry(f"{PAD_PREFIX}{pads}", "U8", (aligned - pos,), pos, aligned))
            pads += 1
            pos = aligned

    for layer_name, tensors in layers:
        pad_to_alignment()
        layer_starts.append((layer_name, [t[0] for t in tensors], pos))
        for name, dtype, shape in tensors:
            pad_to_alignment()
            n = tensor_nbytes(dtype, shape)
            entries.append(_Entry(name, dtype, shape, pos, pos + n))
            pos += n
    return entries, layer_starts, pos


def _check_layers(layers: LayerTensors) -> None:
    layer_names: set[str] = set()
    tensor_names: set[str] = set()
    for layer_name, tensors in layers:
        if not isinstance(layer_name, str) or not layer_name or layer_name in layer_names:
            raise BadRequest(f"layer names must be unique non-empty strings: {layer_name!r:.80}")
        layer_names.add(layer_name)
        for name, t in tensors:
            if (not isinstance(name, str) or not name or name in tensor_names
                    or name.startswith(PAD_PREFIX) or name == METADATA_KEY):
                raise BadRequest(f"invalid or repeated tensor name {name!r:.80}")
            tensor_names.add(name)
            if not isinstance(t, torch.Tensor):
                raise BadRequest(f"tensor {name!r} is not a torch.Tensor")
            if t.is_meta:
                raise BadRequest(f"tensor {name!r} is on the meta device (no data)")
            dtype_code(t.dtype)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, without a copy when it is a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def build_blob(
    layers: LayerTensors,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    path: str | Path | None = None,
) -> tuple[bytes | None, BlobLayout]:
    """Lay tensors out in layer order as an aligned safetensors blob.

    With ``path``, the blob is streamed to that file tensor by tensor (no second copy of
    the weights in memory; the file is fsynced) and ``None`` is returned for the bytes;
    without it, the blob is returned as bytes. Chunk hashes are computed while writing.
    """
    if not isinstance(chunk_size, int) or not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise BadRequest(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}")
    _check_layers(layers)
    spec = [
        (layer, [(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in tensors])
        for layer, tensors in layers
    ]
    entries, layer_starts, data_size = _plan(spec)

    header: dict[str, Any] = {METADATA_KEY: {
        "format": "pt",
        "flashpoint.format_version": str(FORMAT_VERSION),
        LAYERS_METADATA_KEY: json.dumps([[name, names] for name, names, _ in layer_starts]),
    }}
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
    header_json = json.dumps(header, separators=(",", ":")).encode()
    data_offset = align_up(8 + len(header_json))
    header_json += b" " * (data_offset - 8 - len(header_json))
    if len(header_json) > MAX_HEADER_BYTES:
        raise BadRequest("too many tensors: safetensors header over 100 MB")

    hasher = ChunkHasher(chunk_size)
    tensors_by_name = {n: t for _, tensors in layers for n, t in tensors}

    def write(f: BinaryIO) -> None:
        def put(b: bytes | memoryview) -> None:
            hasher.update(b)
            f.write(b)

        put(struct.pack("<Q", len(header_json)) + header_json)
        for e in entries:
            if e.name.startswith(PAD_PREFIX):
                put(bytes(e.end - e.start))
            else:
                data = _tensor_bytes(tensors_by_name[e.name])
                if len(data) != e.end - e.start:
                    raise BadRequest(f"tensor {e.name!r} changed while writing")
                put(data)

    blob: bytes | None
    if path is None:
        buf = io.BytesIO()
        write(buf)
        blob = buf.getvalue()
    else:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        blob = None

    blob_size = data_offset + data_size
    if hasher.size_bytes != blob_size:
        raise BadRequest("blob size does not match its layout")  # a bug, never expected
    tensors = {
        e.name: TensorInfo(e.dtype, e.shape, data_offset + e.start, data_offset + e.end)
        for e in entries if not e.name.startswith(PAD_PREFIX)
    }
    layer_infos = []
    for i, (name, names, start) in enumerate(layer_starts):
        end = layer_starts[i + 1][2] if i + 1 < len(layer_starts) else data_size
        layer_infos.append(LayerInfo(name, tuple(names), data_offset + start, data_offset + end))
    return blob, BlobLayout(
        blob_size=blob_size, data_offset=data_offset, chunk_size=chunk_size,
        chunk_sha256=tuple(hasher.finish()), tensors=tensors, layers=tuple(layer_infos),
    )


# --------------------------------------------------------------------------------------
# Reading: zero-copy views
# --------------------------------------------------------------------------------------


def _as_u8(buffer: Any) -> torch.Tensor:
    mv = memoryview(buffer)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if len(mv) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # Read-only buffers (bytes, a read-only mmap) are fine: we never write weights.
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE_WARNING, category=UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def tensor_views(
    manifest: Manifest,
    buffer: Any,
    *,
    buffer_offset: int = 0,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors over ``buffer`` without copying (they share its memory and keep it alive).

    ``buffer`` is any bytes-like object holding blob bytes from ``buffer_offset`` on (the
    whole blob by default; a stage's byte range with ``buffer_offset=range start``).
    ``names`` selects tensors (default: all); each must lie inside the buffer.
    """
    if isinstance(buffer_offset, bool) or not isinstance(buffer_offset, int) or (
        buffer_offset < 0 or buffer_offset % ALIGN_BYTES
    ):
        raise BadRequest("buffer_offset must be a non-negative multiple of 64")
    base = _as_u8(buffer)
    out: dict[str, torch.Tensor] = {}
    for name in manifest.tensors if names is None else names:
        info = manifest.tensors.get(name)
        if info is None:
            raise BadRequest(f"no tensor named {name!r:.80}")
        start, end = info.start - buffer_offset, info.end - buffer_offset
        if start < 0 or end > base.numel():
            raise BadRequest(f"tensor {name!r} is outside the buffer")
        raw = base[start:end]
        dtype = DTYPES[info.dtype]
        t = raw if dtype == torch.uint8 else raw.view(dtype)
        out[name] = t.view(info.shape)
    return out


# --------------------------------------------------------------------------------------
# Import / export
# --------------------------------------------------------------------------------------


def to_state_dict(manifest: Manifest, buffer: Any, *, copy: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict in layer order: zero-copy views, or clones with ``copy``."""
    views = tensor_views(manifest, buffer)
    order = [n for layer in manifest.layers for n in layer.tensors]
    return {n: views[n].clone() if copy else views[n] for n in order}


def prefix_layer_of(layer_order: Sequence[str]) -> Callable[[str], str]:
    """``layer_of`` for module-path layer names: the longest layer that prefixes a key."""
    ordered = sorted(layer_order, key=len, reverse=True)

    def layer_of(key: str) -> str:
        for prefix in ordered:
            if key == prefix or key.startswith(prefix + "."):
                return prefix
        raise BadRequest(f"tensor {key!r} belongs to no layer")

    return layer_of


def from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    layer_order: Sequence[str],
    *,
    layer_of: Callable[[str], str] | None = None,
) -> LayerTensors:
    """Group a state dict into layers for :func:`build_blob`.

    ``layer_order`` lists layer names in execution order; ``layer_of(key)`` names a key's
    layer (default: the longest layer name that is a module-path prefix of the key, so
    ``["layers.0", "layers.1"]`` groups ``layers.0.weight``...). Tensors keep state-dict
    order within a layer; layers without tensors are kept (they have empty byte ranges).
    """
    if len(set(layer_order)) != len(layer_order):
        raise BadRequest("layer_order has duplicates")
    find = layer_of or prefix_layer_of(layer_order)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in layer_order}
    for key, t in state_dict.items():
        layer = find(key)
        if layer not in groups:
            raise BadRequest(f"tensor {key!r} maps to unknown layer {layer!r}")
        groups[layer].append((key, t))
    return [(name, groups[name]) for name in layer_order]


def from_safetensors(
    path: str | Path,
    layer_of: Callable[[str], str] | None = None,
    *,
    layer_order: Sequence[str] | None = None,
) -> LayerTensors:
    """Read a safetensors file into layers for :func:`build_blob`.

    Without ``layer_of`` the file must be a Flashpoint blob (its metadata names the
    layers). Layers come in ``layer_order`` if given, else in order of first appearance
    in the file; tensors keep file order. Padding tensors are dropped.
    """
    from safetensors import safe_open

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise BadRequest("safetensors header too long")
        header, _ = parse_header(struct.pack("<Q", n) + f.read(n))
    names = sorted(
        (k for k in header if k != METADATA_KEY and not k.startswith(PAD_PREFIX)),
        key=lambda k: header[k]["data_offsets"][0],
    )
    if layer_of is None:
        meta = header.get(METADATA_KEY) or {}
        if LAYERS_METADATA_KEY not in meta:
            raise BadRequest("not a Flashpoint blob: pass layer_of to assign tensors to layers")
        try:
            groups = json.loads(meta[LAYERS_METADATA_KEY])
            owner = {t: layer for layer, ts in groups for t in ts}
        except (ValueError, TypeError) as e:
            raise BadRequest(f"bad layer metadata: {e}") from None
        order = list(layer_order) if layer_order is not None else [g[0] for g in groups]
        find: Callable[[str], str] = owner.__getitem__
    else:
        find = layer_of
        order = list(layer_order) if layer_order is not None else []
        if layer_order is None:
            for k in names:
                if (layer := find(k)) not in order:
                    order.append(layer)
    with safe_open(str(path), framework="pt") as sf:
        state = {k: sf.get_tensor(k) for k in names}
    return from_state_dict(state, order, layer_of=find)
