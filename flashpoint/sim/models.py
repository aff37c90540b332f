"""Model profiles for the simulator: the thesis's six NLP models, and measured manifests.

A :class:`ModelProfile` holds what a cold start and a request cost: the blob size (what
crosses the network), the time to deserialise it in host RAM (``load``), the time to copy
it to the GPU (``to_device``), the execution time of one request, and the per-layer profile
(:class:`flashpoint.partition.model.LayerProfile`, the partition solver's input) that
partitioned stages are cut from.

Where the numbers come from (seed 004 digest; everything not listed here is *assumed*):

* **Stated**: the six models and their sizes (Table 3.1: CodeBERT 499 MB ... T5-3B
  11,408 MB); T5-3B has 55 layers at module depth 4 (§4.1); T5-3B on an A10: load 14,138 ms,
  send to GPU 1,206 ms (§7.1); step costs as multiples of one warm inference: download
  581.2×, load 214.0×, send 18.0× (Fig 3.6).
* **Derived**: load rate 11,408 MB / 14.138 s ≈ 0.807 GB/s and host-to-device rate
  11,408 MB / 1.206 s ≈ 9.46 GB/s, applied to every model (the thesis gives the other
  models' load times only in figures); the execution time of one request is load / 214.0
  (Fig 3.6's ratio, a mean across models, applied per model): T5-3B ≈ 66 ms, which also
  matches 1.206 s / 18.0 ≈ 67 ms.
* **Assumed**: layer counts other than T5's (embeddings + blocks + head of the public
  configurations); bytes and execution time split evenly over layers; the activation a cut
  sends is ``hidden × 128 tokens × 4 bytes`` (fp32, sequence length 128, hidden size from
  the public configurations); a fixed per-request network overhead (``request_overhead_s``,
  the thesis's "network request overheads", not quantified there).

:func:`profile_from_manifest` turns one of our registry manifests whose layers carry the
profile ``flashpoint/models/profile.py`` measured (``bytes``, ``exec_time_s``,
``output_bytes``) into the same type, so a simulation can run a model we actually profiled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from flashpoint.partition.model import LayerProfile

__all__ = [
    "ModelProfile", "THESIS_MODELS", "thesis_model", "profile_from_manifest",
    "LOAD_BYTES_PER_S", "TO_DEVICE_BYTES_PER_S", "WARM_RATIO_LOAD", "MB",
]

MB: Final = 1_000_000  # the thesis's "MB" (decimal)
# Derived from T5-3B on an A10 (seed 004 §7.1): 11,408 MB loads in 14.138 s and reaches the
# GPU in 1.206 s.
LOAD_BYTES_PER_S: Final = 11_408 * MB / 14.138
TO_DEVICE_BYTES_PER_S: Final = 11_408 * MB / 1.206
#: Fig 3.6: load is 214.0 warm inferences.
WARM_RATIO_LOAD: Final = 214.0
#: Assumed per-request network overhead (gateway → worker → client), seconds.
DEFAULT_REQUEST_OVERHEAD_S: Final = 0.002
#: Assumed activation shape of a cut: 128 tokens of fp32 hidden state.
SEQ_TOKENS: Final = 128


@dataclass(frozen=True)
class ModelProfile:
    """What one model costs to start and to serve (times in seconds, sizes in bytes)."""

    name: str
    size_bytes: int
    load_s: float  # deserialise the blob in host RAM
    to_device_s: float  # host RAM → GPU
    exec_s: float  # one request on a warm GPU (batch 1)
    layers: tuple[LayerProfile, ...]
    request_overhead_s: float = DEFAULT_REQUEST_OVERHEAD_S
    source: str = "assumed"  # where the numbers came from, for reports

    def __post_init__(self) -> None:
        if self.size_bytes <= 0 or min(self.load_s, self.to_device_s, self.exec_s) < 0:
            raise ValueError(f"model {self.name!r}: sizes must be > 0 and times >= 0")
        if not self.layers:
            raise ValueError(f"model {self.name!r}: needs at least one layer")

    @property
    def key(self) -> str:
        """The registry key ``name@version`` the controller uses (version "1")."""
        return f"{self.name}@1"

    @property
    def service_s(self) -> float:
        """End-to-end time of one request on a warm replica, without queueing."""
        return self.exec_s + self.request_overhead_s

    def startup_s(self, size_bytes: int | None = None) -> float:
        """Load + send to GPU for ``size_bytes`` of the model (a stage's range), pro rata."""
        frac = 1.0 if size_bytes is None else size_bytes / self.size_bytes
        return (self.load_s + self.to_device_s) * frac

    def stage_bytes(self, first: int, last: int) -> int:
        """Weight bytes of layers ``first..last`` (inclusive): a stage's byte range."""
        return sum(layer.bytes for layer in self.layers[first:last + 1])


def _uniform_layers(name: str, size_bytes: int, exec_s: float, n: int,
                    output_bytes: int) -> tuple[LayerProfile, ...]:
    """``n`` layers splitting bytes and time evenly (the last layer takes the remainder)."""
    per = size_bytes // n
    layers = []
    for i in range(n):
        b = per if i < n - 1 else size_bytes - per * (n - 1)
        layers.append(LayerProfile(f"{name}.{i}", b, exec_s / n, output_bytes))
    return tuple(layers)


def _thesis(name: str, size_mb: int, n_layers: int, hidden: int) -> ModelProfile:
    size = size_mb * MB
    load_s = size / LOAD_BYTES_PER_S
    exec_s = load_s / WARM_RATIO_LOAD
    return ModelProfile(
        name, size, load_s, size / TO_DEVICE_BYTES_PER_S, exec_s,
        _uniform_layers(name, size, exec_s, n_layers, hidden * SEQ_TOKENS * 4),
        source="thesis Table 3.1 size; load/send/exec derived from T5-3B; layers assumed"
        if name != "t5" else "thesis Table 3.1 size, 55 layers; T5-3B anchors; split assumed",
    )


#: The six models of Table 3.1, smallest first. (name, MB, layers, hidden size)
THESIS_MODELS: Mapping[str, ModelProfile] = MappingProxyType({
    m.name: m for m in (
        _thesis("codebert", 499, 14, 768),  # embeddings + 12 blocks + pooler (assumed)
        _thesis("albert", 890, 14, 4096),  # ALBERT-xxlarge-v2: 12 (shared) blocks (assumed)
        _thesis("bart", 1_626, 26, 1024),  # 12 + 12 blocks, embeddings, head (assumed)
        _thesis("dialogpt", 3_135, 38, 1280),  # 36 blocks, embeddings, head (assumed)
        _thesis("gpt2", 6_282, 50, 1600),  # GPT-2 XL: 48 blocks, embeddings, head (assumed)
        _thesis("t5", 11_408, 55, 1024),  # T5-3B: 55 layers at module depth 4 (stated)
    )
})


def thesis_model(name: str) -> ModelProfile:
    """One of :data:`THESIS_MODELS` by name (``codebert`` ... ``t5``)."""
    try:
        return THESIS_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {list(THESIS_MODELS)}") from None


def profile_from_manifest(manifest: Any, *, load_bytes_per_s: float = LOAD_BYTES_PER_S,
                          to_device_bytes_per_s: float = TO_DEVICE_BYTES_PER_S,
                          request_overhead_s: float = DEFAULT_REQUEST_OVERHEAD_S) -> ModelProfile:
    """A profile from a registry manifest whose layers carry a measured profile.

    ``manifest`` is a :class:`flashpoint.registry.manifest.Manifest`, its JSON text, or a
    path to a ``manifest.json``. The per-layer figures are the measured ones; the execution
    time of one request is their sum; load and host-to-device times are not per layer in
    the manifest (they depend on the host), so they come from the given rates.
    """
    if isinstance(manifest, (str, Path)):
        from flashpoint.registry.manifest import Manifest  # pure: json + hashlib only

        text = Path(manifest).read_text() if Path(str(manifest)).exists() else str(manifest)
        manifest = Manifest.from_json(text)
    layers = _layers_of(manifest.layers, manifest.key)
    size = int(manifest.blob_size)
    return ModelProfile(
        manifest.name, size, size / load_bytes_per_s, size / to_device_bytes_per_s,
        sum(layer.exec_s for layer in layers), layers, request_overhead_s,
        source=f"manifest {manifest.key} (measured per-layer profile)",
    )


def _layers_of(layers: Sequence[Any], what: str) -> tuple[LayerProfile, ...]:
    keys = ("bytes", "exec_time_s", "output_bytes")
    missing = [layer.name for layer in layers if not all(k in layer.profile for k in keys)]
    if not layers or missing:
        raise ValueError(f"{what} has no per-layer profile for {missing or 'any layer'}; "
                         "publish it with profiling (flashpoint model push --profile)")
    return tuple(LayerProfile.from_manifest(layer.name, layer.profile) for layer in layers)
