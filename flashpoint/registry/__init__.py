"""The model registry: the Flashpoint model format and the stores that hold models.

* :mod:`~flashpoint.registry.manifest` — the manifest, chunk hashing, layer byte ranges
  (pure Python: planning code may import it without torch);
* :mod:`~flashpoint.registry.format` — writing blobs, zero-copy tensor views, import and
  export (torch);
* :mod:`~flashpoint.registry.store` — the ``ModelStore`` contract;
  :mod:`~flashpoint.registry.local` — the local-directory backend.

Importing this package does not import torch: the torch half (``build_blob``,
``tensor_views``, ...) is loaded on first use of one of its names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flashpoint.registry.local import LocalStore
from flashpoint.registry.manifest import (
    ALIGN_BYTES,
    DEFAULT_CHUNK_SIZE,
    FORMAT_VERSION,
    PAD_PREFIX,
    BlobLayout,
    ChunkHasher,
    IoSignature,
    LayerInfo,
    Manifest,
    TensorInfo,
    byte_range_for_layers,
    check_header,
    chunk_ranges,
    layer_range,
    make_manifest,
    parse_header,
    tensors_for_layers,
    verify_chunk,
)
from flashpoint.registry.store import ModelStore, read_verified

if TYPE_CHECKING:
    from flashpoint.registry.format import (
        DTYPES,
        LayerTensors,
        build_blob,
        from_safetensors,
        from_state_dict,
        tensor_views,
        to_state_dict,
    )

_TORCH_NAMES = {
    "DTYPES", "LayerTensors", "build_blob", "from_safetensors", "from_state_dict",
    "tensor_views", "to_state_dict",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("flashpoint.registry.format"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "DTYPES",
    "FORMAT_VERSION",
    "PAD_PREFIX",
    "BlobLayout",
    "ChunkHasher",
    "IoSignature",
    "LayerInfo",
    "LayerTensors",
    "LocalStore",
    "Manifest",
    "ModelStore",
    "TensorInfo",
    "build_blob",
    "byte_range_for_layers",
    "check_header",
    "chunk_ranges",
    "from_safetensors",
    "from_state_dict",
    "layer_range",
    "make_manifest",
    "parse_header",
    "read_verified",
    "tensor_views",
    "tensors_for_layers",
    "to_state_dict",
    "verify_chunk",
]
