"""TorchScript (``.pt`` from ``torch.jit.save``) and exported programs (``.pt2`` from
``torch.export.save``): formats ``torchscript`` and ``export``.

Both archives are zips. TorchScript's has ``<top>/code/`` and ``<top>/constants.pkl``; an
exported program's has ``<top>/archive_format`` (and ``models/``, ``data/weights/``).
An exported program knows its inputs (the graph's placeholders: dtype and rank; the batch
axis and every symbolic axis become -1) and outputs; a TorchScript archive does not, so
its push names them (``--input x:FP32:-1,16``) and the outputs (``output0..``) are read off
one warm-up run. How the weights and code travel: :mod:`flashpoint.models.archive`.
Served whole (one layer).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from flashpoint.errors import UnsupportedModel
from flashpoint.models import archive
from flashpoint.models.sources.base import (
    MAX_FILE_BYTES,
    Prepared,
    PushOptions,
    datatype_of,
    discover_outputs,
    one_layer,
    warmup_inputs,
)
from flashpoint.registry.manifest import IoSignature
from flashpoint.spec import TensorSpec

ENTRY_POINT = "flashpoint.models.archive:build_empty"


def _names(path: Path) -> list[str] | None:
    """The archive's member names, None when it is no readable zip."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.namelist()
    except (OSError, zipfile.BadZipFile):
        return None


def is_torchscript(names: list[str]) -> bool:
    return any("/code/" in n for n in names) and any(n.endswith("/constants.pkl") for n in names)


def is_export(names: list[str]) -> bool:
    return any(n.endswith("/archive_format") for n in names)


class _Program:
    name: str
    suffixes: tuple[str, ...]
    label: str

    def _looks(self, names: list[str]) -> bool:
        raise NotImplementedError

    def matches(self, source: Path) -> bool:
        if not source.is_file():
            return False
        names = _names(source)
        if names is None:  # a corrupt archive still goes to its adapter, which names it
            return source.suffix in self.suffixes
        return self._looks(names)

    def _check(self, source: Path) -> None:
        if not source.is_file():
            raise UnsupportedModel(f"{source}: missing ({self.label})")
        names = _names(source)
        if names is None:
            raise UnsupportedModel(f"{source}: not a readable {self.label} (not a zip archive: "
                                   "truncated or corrupt?)")
        if not self._looks(names):
            raise UnsupportedModel(f"{source}: not a {self.label} (a torch.save checkpoint? "
                                   "save the model with torch.jit.save or torch.export.save)")

    def _load(self, source: Path) -> Any:
        try:
            if self.name == "torchscript":
                return torch.jit.load(str(source), map_location="cpu")
            return torch.export.load(str(source))
        except Exception as e:  # torch's loaders raise RuntimeError, KeyError, pickle errors...
            raise UnsupportedModel(f"{source}: not a readable {self.label}: "
                                   f"{type(e).__name__}: {e}"[:500]) from None

    def _prepared(self, source: Path, program: Any, module: torch.nn.Module,
                  inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...] | None
                  ) -> Prepared:
        code = archive.without_weights(self.name, program)
        if len(code) > MAX_FILE_BYTES:
            raise UnsupportedModel(f"{source}: its code and constants exceed "
                                   f"{MAX_FILE_BYTES >> 20} MiB")
        wrapped = archive.ProgramModule(self.name, module).eval()
        if outputs is None:  # run once on a warm-up request to learn them
            request = warmup_inputs(inputs)
            try:
                with torch.inference_mode():
                    out = wrapped(*(torch.from_numpy(request[s.name]) for s in inputs))
            except Exception as e:  # the program's own code on the given inputs
                raise UnsupportedModel(f"{source}: does not run on the given inputs "
                                       f"({', '.join(_spec_text(s) for s in inputs)}): "
                                       f"{type(e).__name__}: {e}"[:500]) from None
            variable = any(d < 0 for s in inputs for d in s.shape[1:])
            outputs = discover_outputs(out, variable, str(source))
        return Prepared(
            build=lambda: wrapped, entry_point=ENTRY_POINT, config={"kind": self.name},
            io=IoSignature(tuple(inputs), tuple(outputs)),
            files={archive.ARCHIVE_FILE[self.name]: code}, layer_plan=one_layer,
        )


def _spec_text(spec: TensorSpec) -> str:
    return f"{spec.name}:{spec.datatype}:{','.join(str(d) for d in spec.shape)}"


class TorchScriptArchive(_Program):
    """The ``torchscript`` format (see the module docstring)."""

    name = "torchscript"
    suffixes = (".pt", ".pth", ".ts", ".torchscript")
    label = "TorchScript archive"

    def _looks(self, names: list[str]) -> bool:
        return is_torchscript(names)

    def prepare(self, source: Path, options: PushOptions) -> Prepared:
        self._check(source)
        if not options.inputs:
            raise UnsupportedModel(f"{source}: a TorchScript archive does not say its inputs; "
                                   "name them with --input NAME:DTYPE:SHAPE (e.g. x:FP32:-1,16)")
        program = self._load(source)
        program.eval()
        return self._prepared(source, program, program, tuple(options.inputs), None)


class ExportedArchive(_Program):
    """The ``export`` format (see the module docstring)."""

    name = "export"
    suffixes = (".pt2",)
    label = "torch.export archive"

    def _looks(self, names: list[str]) -> bool:
        return is_export(names)

    def prepare(self, source: Path, options: PushOptions) -> Prepared:
        self._check(source)
        program = self._load(source)
        inputs, outputs = signature(program, str(source))
        if options.inputs:  # names (and stricter shapes) the pusher gave, in graph order
            if len(options.inputs) != len(inputs):
                raise UnsupportedModel(f"{source}: the program takes {len(inputs)} inputs, "
                                       f"--input named {len(options.inputs)}")
            inputs = tuple(options.inputs)
        return self._prepared(source, program, program.module(), inputs, outputs)


def signature(program: Any, what: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """An exported program's user inputs and outputs from its graph: dtype and rank, -1
    for the batch axis and every symbolic one. UnsupportedModel for a static batch axis
    (requests could not be batched) or a non-tensor input."""
    user_inputs = set(program.graph_signature.user_inputs)
    user_outputs = list(program.graph_signature.user_outputs)
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in user_inputs:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise UnsupportedModel(f"{what}: input {node.name!r} is not a tensor")
            if not val.shape or not isinstance(val.shape[0], torch.SymInt):
                raise UnsupportedModel(
                    f"{what}: input {node.name!r} has a fixed batch axis "
                    f"({tuple(val.shape)}); export with dynamic_shapes marking axis 0 "
                    "(torch.export.Dim) so requests can be batched")
            inputs.append(TensorSpec(node.name, datatype_of(val.dtype, f"{what}: input "
                                                            f"{node.name!r}"), _dims(val)))
        elif node.op == "output":
            values = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for i, arg in enumerate(values[len(values) - len(user_outputs):]):
                val = getattr(arg, "meta", {}).get("val")
                if not isinstance(val, torch.Tensor) or not val.shape:
                    raise UnsupportedModel(f"{what}: output {i} is not a tensor with a batch "
                                           "axis")
                outputs.append(TensorSpec(f"output{i}", datatype_of(val.dtype, f"{what}: "
                                                                    f"output {i}"), _dims(val)))
    return tuple(inputs), tuple(outputs)


def _dims(val: torch.Tensor) -> tuple[int, ...]:
    return (-1, *(-1 if isinstance(d, torch.SymInt) else int(d) for d in val.shape[1:]))
