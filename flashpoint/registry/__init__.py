"""The model registry: the Flashpoint model format and the stores that hold models.

* :mod:`~flashpoint.registry.manifest` — the manifest and layer byte ranges;
  :mod:`~flashpoint.registry.chunks` — chunk ranges, hashing and verification;
  :mod:`~flashpoint.registry.blob_header` — a blob's safetensors header (all three pure
  Python: planning code may import them without torch);
* :mod:`~flashpoint.registry.format` — writing blobs, zero-copy tensor views, import and
  export (torch);
* :mod:`~flashpoint.registry.store` — the ``ModelStore`` contract;
  :mod:`~flashpoint.registry.local` — the local-directory backend;
  :mod:`~flashpoint.registry.s3` — the S3 backend; :func:`open_store` picks one from config.

Importing this package does not import torch or boto3: the torch half (``build_blob``,
``tensor_views``, ...) and ``S3Store`` are loaded on first use of one of their names.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashpoint.errors import BadRequest
from flashpoint.registry.blob_header import check_header, parse_header
from flashpoint.registry.chunks import ChunkHasher, chunk_ranges, verify_chunk
from flashpoint.registry.local import LocalStore
from flashpoint.registry.manifest import (
    ALIGN_BYTES,
    DEFAULT_CHUNK_SIZE,
    FORMAT_VERSION,
    PAD_PREFIX,
    BlobLayout,
    IoSignature,
    LayerInfo,
    Manifest,
    TensorInfo,
    byte_range_for_layers,
    layer_range,
    make_manifest,
    tensors_for_layers,
)
from flashpoint.registry.store import ModelStore, read_verified

if TYPE_CHECKING:
    from flashpoint.config import ClusterConfig, RegistryConfig
    from flashpoint.registry.format import (
        DTYPES,
        LayerTensors,
        build_blob,
        from_safetensors,
        from_state_dict,
        tensor_views,
        to_state_dict,
    )
    from flashpoint.registry.s3 import S3Store

_TORCH_NAMES = {
    "DTYPES", "LayerTensors", "build_blob", "from_safetensors", "from_state_dict",
    "tensor_views", "to_state_dict",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("flashpoint.registry.format"), name)
    if name == "S3Store":
        return importlib.import_module("flashpoint.registry.s3").S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(config: RegistryConfig) -> ModelStore:
    """The store a ``[registry]`` config section describes: ``LocalStore`` or ``S3Store``."""
    if config.kind == "local":
        return LocalStore(Path(config.root).expanduser())
    if config.kind == "s3":
        if not config.bucket:
            raise BadRequest("registry kind 's3' needs a bucket")
        from flashpoint.registry.s3 import S3Store

        return S3Store.from_config(config)
    raise BadRequest(f"unknown registry kind {config.kind!r}; use 'local' or 's3'")


def make_store(config: ClusterConfig) -> ModelStore:
    """The store a cluster config's ``[registry]`` section names (the CLI, ``LocalCluster``
    and the demo all open theirs here)."""
    return open_store(config.registry)


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
    "S3Store",
    "TensorInfo",
    "build_blob",
    "byte_range_for_layers",
    "check_header",
    "chunk_ranges",
    "from_safetensors",
    "from_state_dict",
    "layer_range",
    "make_manifest",
    "make_store",
    "open_store",
    "parse_header",
    "read_verified",
    "tensor_views",
    "tensors_for_layers",
    "to_state_dict",
    "verify_chunk",
]
