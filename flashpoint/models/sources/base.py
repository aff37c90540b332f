"""What every model source format gives the publishing pipeline: a :class:`Prepared`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from flashpoint.errors import UnsupportedModel
from flashpoint.models.publish import LayerPlan
from flashpoint.registry.manifest import IoSignature

MAX_FILE_BYTES = 64 * 1024 * 1024
"""Most bytes of files (tokenizer, configs, code) one model version carries."""


@dataclass(frozen=True)
class PushOptions:
    """What ``flashpoint model push`` was asked beyond the source."""

    trust_code: bool = False
    truncate: bool = False
    top_k: int = 0  # 0 = the task's default
    preset: str = "tiny"  # the built-in models only
    seed: int = 0
    profile: bool = False
    profile_device: str = "cpu"
    profile_batch: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)  # built-in config overrides
    profiles: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # given, by layer


@dataclass
class Prepared:
    """A source checked and described, ready to load once and write.

    ``build`` loads the module with its weights (called once, off the event loop);
    everything else is known without loading it.
    """

    build: Callable[[], nn.Module]
    entry_point: str
    config: dict[str, Any]
    io: IoSignature
    task: str = "tensor"
    files: dict[str, bytes] = field(default_factory=dict)
    layer_plan: LayerPlan | None = None
    trusted_code: bool = False
    profiler: Callable[[nn.Module, Any], Mapping[str, Mapping[str, float]]] | None = None


class SourceFormat(Protocol):
    """One adapter of the publishing pipeline (``flashpoint/models/sources/``)."""

    name: str

    def matches(self, source: Path) -> bool:
        """Whether ``source`` looks like this format (detection, cheap)."""
        ...

    def prepare(self, source: Path, options: PushOptions) -> Prepared:
        """Check the source and describe it; UnsupportedModel naming the file otherwise."""
        ...


def read_file(path: Path, what: str) -> bytes:
    """A file's bytes; UnsupportedModel naming it when it is missing or unreadable."""
    if not path.is_file():
        raise UnsupportedModel(f"{path}: missing ({what})")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UnsupportedModel(f"{path}: cannot be read: {e.strerror}") from None


def carried_files(directory: Path, *, skip: Callable[[Path], bool]) -> dict[str, bytes]:
    """The regular files directly in ``directory`` that ``skip`` does not exclude, by name:
    what a model version carries besides its weights (bounded by MAX_FILE_BYTES)."""
    out: dict[str, bytes] = {}
    total = 0
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name.startswith(".") or skip(path):
            continue
        size = path.stat().st_size
        total += size
        if total > MAX_FILE_BYTES:
            raise UnsupportedModel(f"{directory}: files besides the weights exceed "
                                   f"{MAX_FILE_BYTES >> 20} MiB (at {path.name})")
        out[path.name] = read_file(path, "model file")
    return out
