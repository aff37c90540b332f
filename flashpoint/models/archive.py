"""TorchScript (``torch.jit.save``) and ``torch.export`` (``torch.export.save``) programs.

A program's archive holds its code and its weights. Publishing splits them: the weights
(the program's state dict) go into the blob like any model's, in one layer, so they travel
in chunks, are verified by chunk hash and bound zero-copy on CPU; the archive is saved
again with every state-dict tensor on ``meta`` (code, constants and graph only, a few KiB)
and carried in the blob as a file. The worker's builder (``build_empty``, listed in
``BUILTIN_ENTRY_POINTS``: it runs no user Python, only TorchScript or an exported graph)
loads that archive from the carried bytes, and ``load_module`` binds the blob's views.
Tensors a program keeps outside its state dict (TorchScript constants, an exported
program's lifted constants) stay in the archive.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from flashpoint.errors import RegistryError

KINDS = ("torchscript", "export")
ARCHIVE_FILE = {"torchscript": "model.pt", "export": "model.pt2"}
"""The carried file holding the program without its weights, by kind."""


class ProgramModule(nn.Module):
    """A loaded program as an ordinary module: its state dict is ``model.*``, and
    ``eval()`` / ``requires_grad_`` work (a ScriptModule refuses ``requires_grad_``, an
    exported program's module ``eval()``; its train/eval behaviour was fixed at export)."""

    def __init__(self, kind: str, program: nn.Module) -> None:
        super().__init__()
        self.kind = kind
        self.model = program

    def train(self, mode: bool = True) -> ProgramModule:
        self.training = mode
        if self.kind == "torchscript":
            self.model.train(mode)
        return self

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.model(*inputs)


def load_program(kind: str, data: bytes | io.BytesIO | str) -> nn.Module:
    """The program in an archive (bytes or a path), on CPU."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    if kind == "torchscript":
        return torch.jit.load(source, map_location="cpu")
    if kind == "export":
        return torch.export.load(source).module()
    raise RegistryError(f"unknown program kind {kind!r} (known: {list(KINDS)})")


def without_weights(kind: str, program: Any) -> bytes:
    """The archive of ``program`` (a ScriptModule, or an ExportedProgram) with every
    state-dict tensor on ``meta``: its code only. ``program`` is left unchanged."""
    buf = io.BytesIO()
    if kind == "torchscript":
        real = {k: v.detach() for k, v in program.state_dict().items()}
        program.load_state_dict({k: torch.empty_like(v, device="meta") for k, v in real.items()},
                                assign=True)
        try:
            torch.jit.save(program, buf)
        finally:
            program.load_state_dict(real, assign=True)
        return buf.getvalue()
    state = program.state_dict  # the program's own dict, swapped in place and restored
    real = dict(state)
    for k, v in real.items():
        empty = torch.empty_like(v, device="meta")
        state[k] = nn.Parameter(empty, requires_grad=False) if isinstance(v, nn.Parameter) else empty
    try:
        torch.export.save(program, buf)
    finally:
        state.update(real)
    return buf.getvalue()


def build_empty(config: Mapping[str, Any], files: Mapping[str, bytes]) -> nn.Module:
    """The program of a published archive, weights on ``meta`` until the blob's are bound."""
    kind = str(config.get("kind"))
    path = ARCHIVE_FILE.get(kind)
    if path is None:
        raise RegistryError(f"unknown program kind {kind!r} (known: {list(KINDS)})")
    if path not in files:
        raise RegistryError(f"the model carries no {path}")
    try:
        program = load_program(kind, files[path])
    except Exception as e:  # a foreign error from torch's loaders
        raise RegistryError(f"{path}: cannot be loaded: {type(e).__name__}: {e}"[:400]) from e
    return ProgramModule(kind, program)


build_empty.takes_files = True  # type: ignore[attr-defined]
