"""What every model source format gives the publishing pipeline: a :class:`Prepared`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from flashpoint.errors import UnsupportedModel
from flashpoint.models.module_tensors import LayerPlan
from flashpoint.registry.manifest import IoSignature
from flashpoint.spec import DATATYPES, TensorSpec

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
    inputs: tuple[TensorSpec, ...] = ()  # --input NAME:DTYPE:SHAPE (TorchScript needs them)


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


def parse_tensor_spec(text: str) -> TensorSpec:
    """``NAME:DTYPE:SHAPE`` (``x:FP32:-1,16``; -1 = any size, the first axis is the batch)
    as a TensorSpec; UnsupportedModel saying what is wrong."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0]:
        raise UnsupportedModel(f"tensor {text!r}: expected NAME:DTYPE:SHAPE, e.g. x:FP32:-1,16")
    name, dtype, dims = parts[0], parts[1].upper(), parts[2]
    if dtype not in DATATYPES:
        raise UnsupportedModel(f"tensor {text!r}: unknown datatype {dtype!r} (one of "
                               f"{', '.join(DATATYPES)})")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
    except ValueError:
        raise UnsupportedModel(f"tensor {text!r}: shape must be integers, e.g. -1,16") from None
    if not shape or any(d < -1 or d == 0 for d in shape):
        raise UnsupportedModel(f"tensor {text!r}: shape needs a batch axis and sizes >= 1 "
                               "(or -1)")
    return TensorSpec(name, dtype, (-1, *shape[1:]))


TORCH_DATATYPES = {
    "torch.bool": "BOOL", "torch.uint8": "UINT8", "torch.int8": "INT8", "torch.int16": "INT16",
    "torch.int32": "INT32", "torch.int64": "INT64", "torch.float16": "FP16",
    "torch.float32": "FP32", "torch.float64": "FP64", "torch.bfloat16": "BF16",
}
"""OIP datatypes of torch dtypes (by ``str(dtype)``)."""


def datatype_of(dtype: Any, what: str) -> str:
    """The OIP datatype of a torch or numpy dtype; UnsupportedModel naming ``what``."""
    import numpy as np

    if isinstance(dtype, np.dtype):
        from flashpoint.tensors import DECODED_DTYPE

        for dt, decoded in DECODED_DTYPE.items():
            if decoded == dtype and dt not in ("BF16",):
                return dt
        raise UnsupportedModel(f"{what}: numpy dtype {dtype} has no tensor datatype")
    out = TORCH_DATATYPES.get(str(dtype))
    if out is None:
        raise UnsupportedModel(f"{what}: dtype {dtype} has no tensor datatype")
    return out


def discover_outputs(outputs: Any, variable: bool, what: str,
                     names: tuple[str, ...] | None = None) -> tuple[TensorSpec, ...]:
    """Output specs from one warm-up run's outputs: a tensor, a tuple/list of them
    (``output0..``) or a dict (its keys). The batch axis is -1; so is every axis when
    ``variable`` (an input had a variable axis past the batch one)."""
    if isinstance(outputs, Mapping):
        items = list(outputs.items())
    else:
        seq = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        items = [(f"output{i}", o) for i, o in enumerate(seq)]
    specs = []
    for name, value in items:
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise UnsupportedModel(f"{what}: output {name!r} is a {type(value).__name__}, "
                                   "not a tensor")
        shape = tuple(value.shape)
        if not shape:
            raise UnsupportedModel(f"{what}: output {name!r} is a scalar; outputs need a "
                                   "batch axis")
        dims = (-1,) * len(shape) if variable else (-1, *shape[1:])
        specs.append(TensorSpec(str(name), datatype_of(value.dtype, f"{what}: output {name!r}"),
                                dims))
    return tuple(specs)


def warmup_inputs(specs: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """One request (batch 1, variable axes 8 long) of zeros for ``specs``."""
    from flashpoint.models.serving.tensor import TensorServing

    serving = TensorServing(tuple(s.name for s in specs), (),
                            {s.name: s.datatype for s in specs},
                            {s.name: tuple(s.shape) for s in specs})
    return serving.warmup_request()


WHOLE_MODEL_LAYER = "model"


def one_layer(module: nn.Module) -> tuple[list[str], Callable[[str], str]]:
    """A layer plan for models served whole: every tensor in one layer."""
    return [WHOLE_MODEL_LAYER], lambda name: WHOLE_MODEL_LAYER
