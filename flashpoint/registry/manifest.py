"""The Flashpoint manifest: the JSON description of a model's weights blob (no torch).

This half of the model format is pure Python so that planning code (partition solvers,
transfer planning, the controller) can read layer byte ranges, chunk hashes and profiles
without importing torch. The blob layout itself is described in
:mod:`flashpoint.registry.format`, which builds blobs and views them as tensors; a blob's
chunks are hashed and verified in :mod:`flashpoint.registry.chunks`, its safetensors header
read and checked in :mod:`flashpoint.registry.blob_header`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flashpoint.errors import BadRequest
from flashpoint.ids import ModelKey, validate_name, validate_version
from flashpoint.spec import TensorSpec

FORMAT_VERSION = 1
ALIGN_BYTES = 64
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MAX_CHUNK_SIZE = 1 << 30
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors limit
PAD_PREFIX = "__fp_pad_"
METADATA_KEY = "__metadata__"
LAYERS_METADATA_KEY = "flashpoint.layers"

# safetensors dtype codes and their element sizes.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1,
}
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_POINT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_]\w*$")


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align



def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = DTYPE_SIZES[dtype]
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One model tensor: safetensors dtype code, shape, absolute byte range in the blob."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def size_bytes(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "start": self.start,
                "end": self.end}


@dataclass(frozen=True)
class LayerInfo:
    """One top-level sequential block: its tensors (in blob order) and its byte range.

    ``profile`` is carried, not interpreted: ``bytes``, ``exec_time_s``, ``output_bytes``...
    """

    name: str
    tensors: tuple[str, ...]
    byte_start: int
    byte_end: int
    profile: dict[str, float] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        return self.byte_end - self.byte_start

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tensors": list(self.tensors), "byte_start": self.byte_start,
                "byte_end": self.byte_end, "profile": dict(self.profile)}


@dataclass(frozen=True)
class IoSignature:
    """A model's inputs and outputs (KServe OIP datatypes, -1 for a variable dimension)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [s.to_dict() for s in self.inputs],
                "outputs": [s.to_dict() for s in self.outputs]}

    @classmethod
    def from_dict(cls, d: Any) -> IoSignature:
        d = _obj(d, "io", {"inputs", "outputs"})
        out: dict[str, tuple[TensorSpec, ...]] = {}
        for key in ("inputs", "outputs"):
            items = d[key]
            if not isinstance(items, list):
                raise BadRequest(f"io.{key} must be a list")
            specs = tuple(TensorSpec.from_dict(x) for x in items)
            if len({s.name for s in specs}) != len(specs):
                raise BadRequest(f"io.{key} has duplicate names")
            out[key] = specs
        return cls(out["inputs"], out["outputs"])


@dataclass(frozen=True)
class BlobLayout:
    """What :func:`build_blob` produced: everything the manifest needs about the blob."""

    blob_size: int
    data_offset: int
    chunk_size: int
    chunk_sha256: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    layers: tuple[LayerInfo, ...]


@dataclass(frozen=True)
class FileInfo:
    """A file of the model version (tokenizer, config, handler code...) carried in the blob
    as one ``U8`` tensor, so it travels and is verified with the weights; ``sha256`` and
    ``size`` are the file's own, checked again when a worker reads it out."""

    tensor: str
    sha256: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "sha256": self.sha256, "size": self.size}


FILE_TENSOR_PREFIX = "__fp_file__/"
"""Tensor name prefix of a carried file: ``__fp_file__/tokenizer.json``."""

_MANIFEST_KEYS = {
    "format_version", "name", "version", "blob_size", "data_offset", "chunk_size",
    "chunk_sha256", "tensors", "layers", "entry_point", "config", "io",
    "files", "buffers", "task", "source_format", "trusted_code",
}
# Added after the first manifests were written: absent means the default.
_OPTIONAL_KEYS = frozenset({"files", "buffers", "task", "source_format", "trusted_code"})
_FILE_PATH_RE = re.compile(r"^(?!/)(?!.*(^|/)\.\.?(/|$))[A-Za-z0-9_.\-/]{1,200}$")


@dataclass(frozen=True)
class Manifest:
    """The JSON description of one model version; see the module docstring."""

    name: str
    version: str
    blob_size: int
    data_offset: int
    chunk_size: int
    chunk_sha256: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    layers: tuple[LayerInfo, ...]
    entry_point: str
    config: dict[str, Any]
    io: IoSignature
    format_version: int = FORMAT_VERSION
    # Files carried in the blob (path relative to the model directory -> where).
    files: dict[str, FileInfo] = field(default_factory=dict)
    # Non-persistent module buffers carried in the blob (not in the module's state dict).
    buffers: tuple[str, ...] = ()
    # How a worker serves it: "tensor" (tensors in, tensors out), "text-classification",
    # "image-classification", "handler" (flashpoint/models/serving/).
    task: str = "tensor"
    # What it was published from: "zoo", "hf", "torchscript", "export", "handler".
    source_format: str = "zoo"
    # An admin pushed it with --trust-code: its entry point may be code of its own bundle.
    trusted_code: bool = False

    # -- derived ------------------------------------------------------------------------

    @property
    def key(self) -> ModelKey:
        """``name@version``: this version's name in caches, transfers and logs."""
        return ModelKey.of(self.name, self.version)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sha256)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``index`` in the blob."""
        if not isinstance(index, int) or not 0 <= index < self.num_chunks:
            raise BadRequest(f"chunk index {index!r} out of range 0..{self.num_chunks - 1}")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.blob_size)

    def chunks_for_range(self, start: int, end: int) -> range:
        """Indices of the chunks that cover blob bytes ``[start, end)``."""
        _check_range(start, end, self.blob_size)
        if start == end:
            return range(0)
        return range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def layer_index(self, layer: int | str) -> int:
        if isinstance(layer, str):
            for i, info in enumerate(self.layers):
                if info.name == layer:
                    return i
            raise BadRequest(f"no layer named {layer!r}")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise BadRequest(f"layer must be an index or a name, got {layer!r}")
        if not 0 <= layer < len(self.layers):
            raise BadRequest(f"layer index {layer} out of range 0..{len(self.layers) - 1}")
        return layer

    def with_profiles(self, profiles: Mapping[str, Mapping[str, float]]) -> Manifest:
        """A copy whose layers carry ``profiles[layer name]`` (others keep theirs)."""
        names = {layer.name for layer in self.layers}
        unknown = set(profiles) - names
        if unknown:
            raise BadRequest(f"profiles for unknown layers: {sorted(unknown)}")
        layers = tuple(
            replace(layer, profile=_profile(profiles[layer.name], layer.name))
            if layer.name in profiles else layer
            for layer in self.layers
        )
        return replace(self, layers=layers)

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "name": self.name,
            "version": self.version,
            "blob_size": self.blob_size,
            "data_offset": self.data_offset,
            "chunk_size": self.chunk_size,
            "chunk_sha256": list(self.chunk_sha256),
            "tensors": {n: t.to_dict() for n, t in self.tensors.items()},
            "layers": [layer.to_dict() for layer in self.layers],
            "entry_point": self.entry_point,
            "config": self.config,
            "io": self.io.to_dict(),
            "files": {p: f.to_dict() for p, f in self.files.items()},
            "buffers": list(self.buffers),
            "task": self.task,
            "source_format": self.source_format,
            "trusted_code": self.trusted_code,
        }

    def to_json(self) -> str:
        """The manifest's JSON text, made once per manifest (it is immutable): a deploy sends
        the same text to every host and worker without serialising it again."""
        text = self.__dict__.get("_json")
        if text is None:
            text = json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)
            object.__setattr__(self, "_json", text)
        return text

    @property
    def digest(self) -> str:
        """sha256 (hex) of the manifest's canonical JSON (keys sorted): what the controller
        pins in every deploy and transfer it orders, and what a host's cache keys a model
        version by. Any change to any field (a chunk hash, the entry point, the config)
        changes it; a parse of the JSON text gives the same digest back."""
        digest = self.__dict__.get("_digest")
        if digest is None:
            canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                                   allow_nan=False)
            digest = hashlib.sha256(canonical.encode()).hexdigest()
            object.__setattr__(self, "_digest", digest)
        return digest

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and strictly validate; any malformed or inconsistent input is BadRequest."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"manifest is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        d = _obj(data, "manifest", _MANIFEST_KEYS, _OPTIONAL_KEYS)
        fv = _int(d["format_version"], "format_version")
        if fv != FORMAT_VERSION:
            raise BadRequest(f"unsupported manifest format_version {fv}")
        name = validate_name(d["name"], "model name")
        version = validate_version(d["version"])
        blob_size = _int(d["blob_size"], "blob_size", minimum=1)
        data_offset = _int(d["data_offset"], "data_offset", minimum=8)
        chunk_size = _int(d["chunk_size"], "chunk_size", minimum=1)
        if chunk_size > MAX_CHUNK_SIZE:
            raise BadRequest(f"chunk_size {chunk_size} over the limit {MAX_CHUNK_SIZE}")
        if data_offset > blob_size or data_offset % ALIGN_BYTES:
            raise BadRequest("data_offset must be 64-byte aligned and inside the blob")
        hashes = d["chunk_sha256"]
        if not isinstance(hashes, list) or not all(
            isinstance(h, str) and _SHA256_RE.match(h) for h in hashes
        ):
            raise BadRequest("chunk_sha256 must be a list of lower-case hex sha256 digests")
        if len(hashes) != -(-blob_size // chunk_size):
            raise BadRequest("chunk_sha256 count does not match blob_size / chunk_size")

        tensors = _parse_tensors(d["tensors"], data_offset, blob_size)
        layers = _parse_layers(d["layers"], tensors, data_offset, blob_size)

        entry_point = d["entry_point"]
        if not isinstance(entry_point, str) or not _ENTRY_POINT_RE.match(entry_point):
            raise BadRequest("entry_point must look like 'package.module:function'")
        config = d["config"]
        if not isinstance(config, dict):
            raise BadRequest("config must be an object")
        files = _parse_files(d.get("files", {}), tensors)
        buffers = d.get("buffers", [])
        if not isinstance(buffers, list) or len(set(buffers)) != len(buffers) or not all(
                isinstance(b, str) and b in tensors for b in buffers):
            raise BadRequest("buffers must be a list of distinct tensor names")
        task, source_format = d.get("task", "tensor"), d.get("source_format", "zoo")
        for key, value in (("task", task), ("source_format", source_format)):
            if not isinstance(value, str) or not re.fullmatch(r"[a-z][a-z0-9\-]{0,40}", value):
                raise BadRequest(f"{key} must be a short lower-case name")
        trusted = d.get("trusted_code", False)
        if not isinstance(trusted, bool):
            raise BadRequest("trusted_code must be a boolean")
        return cls(
            name=name, version=version, blob_size=blob_size, data_offset=data_offset,
            chunk_size=chunk_size, chunk_sha256=tuple(hashes), tensors=tensors,
            layers=layers, entry_point=entry_point, config=config,
            io=IoSignature.from_dict(d["io"]), format_version=fv, files=files,
            buffers=tuple(buffers), task=task, source_format=source_format,
            trusted_code=trusted,
        )

    def module_tensors(self) -> list[str]:
        """The tensors of the module's state dict: all but carried files and buffers."""
        skip = {*self.buffers, *(f.tensor for f in self.files.values())}
        return [n for n in self.tensors if n not in skip]


def make_manifest(
    *,
    name: str,
    version: str,
    layout: BlobLayout,
    entry_point: str,
    config: Mapping[str, Any],
    io: IoSignature,
    profiles: Mapping[str, Mapping[str, float]] | None = None,
    files: Mapping[str, FileInfo] | None = None,
    buffers: Sequence[str] = (),
    task: str = "tensor",
    source_format: str = "zoo",
    trusted_code: bool = False,
) -> Manifest:
    """Assemble a manifest from a blob layout; validated by a JSON round trip."""
    manifest = Manifest(
        name=name, version=version, blob_size=layout.blob_size,
        data_offset=layout.data_offset, chunk_size=layout.chunk_size,
        chunk_sha256=layout.chunk_sha256, tensors=dict(layout.tensors),
        layers=layout.layers, entry_point=entry_point, config=dict(config), io=io,
        files=dict(files or {}), buffers=tuple(buffers), task=task,
        source_format=source_format, trusted_code=trusted_code,
    )
    if profiles:
        manifest = manifest.with_profiles(profiles)
    # One validation path for everything: what we write is what a reader accepts.
    return Manifest.from_json(manifest.to_json())


def _obj(d: Any, what: str, keys: set[str], optional: frozenset[str] = frozenset()) -> dict:
    if not isinstance(d, dict):
        raise BadRequest(f"{what} must be an object")
    missing = keys - optional - d.keys()
    if missing:
        raise BadRequest(f"{what} is missing {sorted(missing)}")
    extra = d.keys() - keys
    if extra:
        raise BadRequest(f"{what} has unknown keys {sorted(extra)}")
    return d


def _int(v: Any, what: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise BadRequest(f"{what} must be an integer >= {minimum}, got {v!r:.80}")
    return v


def _parse_files(raw: Any, tensors: Mapping[str, TensorInfo]) -> dict[str, FileInfo]:
    if not isinstance(raw, dict):
        raise BadRequest("files must be an object")
    out: dict[str, FileInfo] = {}
    for path, f in raw.items():
        if not isinstance(path, str) or not _FILE_PATH_RE.match(path):
            raise BadRequest(f"invalid file path {path!r:.80} (relative, no '..')")
        f = _obj(f, f"file {path!r}", {"tensor", "sha256", "size"})
        tensor, digest, size = f["tensor"], f["sha256"], _int(f["size"], f"file {path!r} size")
        info = tensors.get(tensor) if isinstance(tensor, str) else None
        if (info is None or not tensor.startswith(FILE_TENSOR_PREFIX) or info.dtype != "U8"
                or info.shape != (size,)):
            raise BadRequest(f"file {path!r}: tensor {tensor!r:.80} is not a U8 file tensor "
                             f"of {size} bytes")
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            raise BadRequest(f"file {path!r}: sha256 must be a lower-case hex digest")
        out[path] = FileInfo(tensor, digest, size)
    return out


def _profile(p: Any, layer: str) -> dict[str, float]:
    if not isinstance(p, Mapping):
        raise BadRequest(f"layer {layer!r}: profile must be an object")
    for k, v in p.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequest(f"layer {layer!r}: profile values must be numbers")
    return dict(p)


def _parse_tensors(raw: Any, data_offset: int, blob_size: int) -> dict[str, TensorInfo]:
    if not isinstance(raw, dict):
        raise BadRequest("tensors must be an object")
    out: dict[str, TensorInfo] = {}
    for name, t in raw.items():
        if not name or name.startswith(PAD_PREFIX) or name == METADATA_KEY:
            raise BadRequest(f"invalid tensor name {name!r:.80}")
        t = _obj(t, f"tensor {name!r}", {"dtype", "shape", "start", "end"})
        dtype = t["dtype"]
        if dtype not in DTYPE_SIZES:
            raise BadRequest(f"tensor {name!r}: unsupported dtype {dtype!r}")
        shape = t["shape"]
        if not isinstance(shape, list):
            raise BadRequest(f"tensor {name!r}: shape must be a list")
        shape = tuple(_int(s, f"tensor {name!r} shape") for s in shape)
        start = _int(t["start"], f"tensor {name!r} start")
        end = _int(t["end"], f"tensor {name!r} end")
        if start % ALIGN_BYTES or not data_offset <= start <= end <= blob_size:
            raise BadRequest(f"tensor {name!r}: byte range must be aligned and in the data")
        if end - start != tensor_nbytes(dtype, shape):
            raise BadRequest(f"tensor {name!r}: byte range does not match dtype and shape")
        out[name] = TensorInfo(dtype, shape, start, end)
    return out


def _parse_layers(
    raw: Any, tensors: dict[str, TensorInfo], data_offset: int, blob_size: int
) -> tuple[LayerInfo, ...]:
    if not isinstance(raw, list):
        raise BadRequest("layers must be a list")
    layers: list[LayerInfo] = []
    seen_layers: set[str] = set()
    seen_tensors: set[str] = set()
    pos = data_offset
    for item in raw:
        d = _obj(item, "layer", {"name", "tensors", "byte_start", "byte_end", "profile"})
        name = d["name"]
        if not isinstance(name, str) or not name or name in seen_layers:
            raise BadRequest(f"layer names must be unique non-empty strings: {name!r:.80}")
        seen_layers.add(name)
        start = _int(d["byte_start"], f"layer {name!r} byte_start")
        end = _int(d["byte_end"], f"layer {name!r} byte_end")
        if start != pos or end < start or start % ALIGN_BYTES:
            raise BadRequest(f"layer {name!r}: byte ranges must tile the data in order")
        names = d["tensors"]
        if not isinstance(names, list):
            raise BadRequest(f"layer {name!r}: tensors must be a list")
        tpos = start
        for tn in names:
            info = tensors.get(tn) if isinstance(tn, str) else None
            if info is None or tn in seen_tensors:
                raise BadRequest(f"layer {name!r}: unknown or repeated tensor {tn!r:.80}")
            seen_tensors.add(tn)
            if info.start < tpos or info.end > end:
                raise BadRequest(f"layer {name!r}: tensor {tn!r} outside the layer or unordered")
            tpos = info.end
        layers.append(LayerInfo(name, tuple(names), start, end, _profile(d["profile"], name)))
        pos = end
    if pos != blob_size:
        raise BadRequest("layer byte ranges must end at blob_size")
    if seen_tensors != tensors.keys():
        raise BadRequest("every tensor must belong to exactly one layer")
    return tuple(layers)


def _check_range(start: int, end: int, size: int) -> None:
    for v in (start, end):
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest(f"byte offsets must be integers, got {v!r:.40}")
    if not 0 <= start <= end <= size:
        raise BadRequest(f"byte range [{start}, {end}) outside the blob of {size} bytes")


# --------------------------------------------------------------------------------------
# Layer ranges
# --------------------------------------------------------------------------------------


def layer_range(manifest: Manifest, first: int | str, last: int | str) -> tuple[int, int]:
    """Indices ``(i, j)`` of an inclusive layer range given by index or name."""
    i, j = manifest.layer_index(first), manifest.layer_index(last)
    if i > j:
        raise BadRequest(f"first layer {first!r} comes after last layer {last!r}")
    return i, j


def byte_range_for_layers(manifest: Manifest, first: int | str, last: int | str) -> tuple[int, int]:
    """Blob bytes ``[start, end)`` holding layers ``first..last`` (inclusive)."""
    i, j = layer_range(manifest, first, last)
    return manifest.layers[i].byte_start, manifest.layers[j].byte_end


def stage_byte_ranges(manifest: Manifest, first: int | str, last: int | str,
                      ) -> tuple[tuple[int, int], ...]:
    """Blob byte ranges ``[start, end)`` a stage of layers ``first..last`` needs before it
    serves: its layers' bytes; for a text-generation model's stage that does not hold the
    first layer, also the carried files' (the tokenizer, at the front of the first layer:
    the last stage decodes tokens, ``models/serving/stage_generation.py``)."""
    own = byte_range_for_layers(manifest, first, last)
    i, _ = layer_range(manifest, first, last)
    if manifest.task != "text-generation" or i == 0 or not manifest.files:
        return (own,)
    infos = [manifest.tensors[f.tensor] for f in manifest.files.values()]
    return ((min(t.start for t in infos), max(t.end for t in infos)), own)


def tensors_for_layers(manifest: Manifest, first: int | str, last: int | str) -> list[str]:
    """Names of the tensors of layers ``first..last`` (inclusive), in blob order."""
    i, j = layer_range(manifest, first, last)
    return [n for layer in manifest.layers[i:j + 1] for n in layer.tensors]


