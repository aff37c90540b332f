"""The safetensors header at the front of a model's weights blob: reading it, and checking
that it describes exactly the manifest's tensors (pure Python, no torch).

A blob is a safetensors file (:mod:`flashpoint.registry.format` writes it). Stores read
the header with :func:`parse_header` and refuse, with :func:`check_header`, a blob whose
header disagrees with its manifest (:mod:`flashpoint.registry.manifest`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from flashpoint.errors import BadRequest
from flashpoint.registry.manifest import MAX_HEADER_BYTES, METADATA_KEY, PAD_PREFIX, Manifest


def parse_header(prefix: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header of a blob and its data offset.

    ``prefix`` must hold at least the header (``8 + length`` bytes); BadRequest otherwise.
    """
    mv = memoryview(prefix).cast("B")
    if len(mv) < 8:
        raise BadRequest("blob shorter than the safetensors header length")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > MAX_HEADER_BYTES or len(mv) < 8 + n:
        raise BadRequest("safetensors header too long or truncated")
    try:
        header = json.loads(bytes(mv[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise BadRequest("safetensors header must be an object")
    return header, 8 + n


def check_header(manifest: Manifest, header: Mapping[str, Any], data_offset: int) -> None:
    """BadRequest unless a blob's safetensors header describes the manifest's tensors."""
    if data_offset != manifest.data_offset:
        raise BadRequest("blob data offset differs from the manifest")
    names = {k for k in header if k != METADATA_KEY and not k.startswith(PAD_PREFIX)}
    if names != manifest.tensors.keys():
        raise BadRequest("blob tensors differ from the manifest")
    for name, info in manifest.tensors.items():
        h = header[name]
        offsets = [info.start - data_offset, info.end - data_offset]
        if (not isinstance(h, dict) or h.get("dtype") != info.dtype
                or h.get("shape") != list(info.shape) or h.get("data_offsets") != offsets):
            raise BadRequest(f"blob tensor {name!r} differs from the manifest")
