"""A KaaS kernel's definition and the library that names kernels: the types both the torch
operators (:mod:`flashpoint.kaas.library`) and the raw CuPy/Triton kernels
(:mod:`flashpoint.kaas.raw`) register against, so neither imports the other's module to
get them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flashpoint.errors import UnknownKernel

Meta = tuple[str, tuple[int, ...]]  # (dtype, shape)
InferFn = Callable[[Sequence[Meta], Sequence[int | float]], list[Meta]]
RunFn = Callable[[Sequence[Any], Sequence[Any], Sequence[int | float], Any], None]
# (input metas, output metas, literal values, grid, block) -> None, or a typed 400: a raw
# kernel's proof that its launch stays inside the buffers it touches.
LaunchCheckFn = Callable[[Sequence[Meta], Sequence[Meta], Sequence[int | float],
                          tuple[int, ...], tuple[int, ...]], None]


@dataclass(frozen=True)
class KernelDef:
    """A registered kernel. ``infer`` None = shapes unchecked (raw kernels see only bytes).

    ``run(inputs, outputs, literals, launch)``: ``launch`` is the request's KernelSpec
    (grid, block, shared memory) for raw kernels, ignored by operators.
    """

    library: str
    name: str
    n_inputs: int
    n_outputs: int
    literal_types: tuple[str, ...]
    run: RunFn
    infer: InferFn | None = None
    raw: bool = False  # needs grid and block
    launch_check: LaunchCheckFn | None = None  # checked at validation, before any buffer


class KernelLibrary:
    """Kernels by ``(library, name)``."""

    def __init__(self) -> None:
        self._defs: dict[tuple[str, str], KernelDef] = {}

    def register(self, kdef: KernelDef) -> None:
        self._defs[(kdef.library, kdef.name)] = kdef

    def get(self, library: str, name: str) -> KernelDef:
        kdef = self._defs.get((library, name))
        if kdef is None:
            raise UnknownKernel(f"no kernel {name!r} in library {library!r}",
                                library=library, kernel=name)
        return kdef

    def names(self) -> list[str]:
        return sorted(f"{lib}.{name}" for lib, name in self._defs)

    def libraries(self) -> set[str]:
        return {lib for lib, _ in self._defs}
