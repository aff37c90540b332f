"""The kernel library: what a KaaS request may name, with shape rules and launchers.

Torch operators are always registered (library ``"torch"``); they run on whichever device
the executor's buffers live on, so the CPU path is the same code as the GPU path. Raw CUDA
kernels (CuPy ``RawKernel`` from source or PTX, library ``"cupy"``) and Triton kernels
(library ``"triton"``) are registered by :mod:`flashpoint.kaas.raw` only where those packages
and a GPU exist; elsewhere those libraries are simply absent and naming them is
``unknown_kernel``.

A :class:`KernelDef` carries an ``infer`` rule (input dtypes/shapes and literals -> the
outputs' dtypes/shapes) used to validate a request before any buffer is touched, and a
``run`` callable taking pre-packed argument lists (input tensors, output tensors, literal
values) so the per-launch cost in Python stays one call (digest §5.7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flashpoint.errors import BufferMismatch
from flashpoint.kaas.kernel_def import KernelDef, KernelLibrary, Meta, RunFn


# ---------------------------------------------------------------------------------- rules
def _float(meta: Meta, what: str) -> None:
    if not meta[0].startswith("float"):
        raise BufferMismatch(f"{what} needs a floating-point buffer, got {meta[0]}")


def _same(metas: Sequence[Meta], lits: Sequence[int | float]) -> list[Meta]:
    """Elementwise: every input has the first one's dtype and shape; so has the output."""
    for m in metas[1:]:
        if m != metas[0]:
            raise BufferMismatch(f"elementwise inputs differ: {metas[0]} vs {m}")
    return [metas[0]]


def _floats_same(metas: Sequence[Meta], lits: Sequence[int | float]) -> list[Meta]:
    _float(metas[0], "this kernel")
    return _same(metas, lits)


def _matmul(metas: Sequence[Meta], lits: Sequence[int | float]) -> list[Meta]:
    (da, sa), (db, sb) = metas
    _float(metas[0], "matmul")
    if da != db or len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
        raise BufferMismatch(f"matmul needs (m,k) x (k,n) of one dtype, got {da} {list(sa)} "
                             f"x {db} {list(sb)}")
    return [(da, (sa[0], sb[1]))]


def _softmax(metas: Sequence[Meta], lits: Sequence[int | float]) -> list[Meta]:
    _float(metas[0], "softmax")
    dim = int(lits[0])
    if not -len(metas[0][1]) <= dim < len(metas[0][1]):
        raise BufferMismatch(f"softmax dim {dim} out of range for shape {list(metas[0][1])}")
    return [metas[0]]


def _jacobi(metas: Sequence[Meta], lits: Sequence[int | float]) -> list[Meta]:
    (da, sa), (db, sb), (dx, sx) = metas
    _float(metas[0], "jacobi_step")
    if len(sa) != 2 or sa[0] != sa[1] or sb != (sa[0],) or sx != sb or not da == db == dx:
        raise BufferMismatch("jacobi_step needs A (n,n), b (n,), x (n,) of one dtype, got "
                             f"{[list(s) for _, s in metas]}")
    return [(dx, sx)]


# ---------------------------------------------------------------------------------- torch
def _torch_kernels() -> list[KernelDef]:
    import torch

    def aliased(outs: Sequence[Any], ins: Sequence[Any]) -> bool:
        return any(o is i for o in outs for i in ins)

    def binary(op: Callable[..., Any]) -> RunFn:
        def run(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], _: Any) -> None:
            if aliased(outs, ins):  # in place: compute first, then write
                outs[0].copy_(op(*ins))
            else:
                op(*ins, out=outs[0])
        return run

    def relu(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], _: Any) -> None:
        torch.clamp_min(ins[0], 0, out=outs[0])

    def softmax(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], _: Any) -> None:
        outs[0].copy_(torch.softmax(ins[0], int(lits[0])))

    def scale(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], _: Any) -> None:
        torch.mul(ins[0], float(lits[0]), out=outs[0])

    def copy(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], _: Any) -> None:
        outs[0].copy_(ins[0])

    def jacobi_step(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any],
                    _: Any) -> None:
        # x' = x + (b - A x) / diag(A): one Jacobi sweep (the paper's jacobiCudaGraphs
        # workload, §5.3). x is usually updated in place, run n_iters times.
        a, b, x = ins
        residual = torch.addmv(b, a, x, alpha=-1)
        outs[0].copy_(torch.addcdiv(x, residual, torch.diagonal(a)))

    t = "torch"
    return [
        KernelDef(t, "matmul", 2, 1, (), binary(torch.mm), _matmul),
        KernelDef(t, "add", 2, 1, (), binary(torch.add), _floats_same),
        KernelDef(t, "sub", 2, 1, (), binary(torch.sub), _floats_same),
        KernelDef(t, "mul", 2, 1, (), binary(torch.mul), _floats_same),
        KernelDef(t, "relu", 1, 1, (), relu, _floats_same),
        KernelDef(t, "softmax", 1, 1, ("i64",), softmax, _softmax),
        KernelDef(t, "scale", 1, 1, ("f64",), scale, _floats_same),
        KernelDef(t, "copy", 1, 1, (), copy, _same),
        KernelDef(t, "jacobi_step", 3, 1, (), jacobi_step, _jacobi),
    ]


def default_library(*, raw: bool = True) -> KernelLibrary:
    """Torch operators, plus CuPy/Triton support where installed and a GPU is present."""
    lib = KernelLibrary()
    for kdef in _torch_kernels():
        lib.register(kdef)
    if raw:
        from flashpoint.kaas import raw as raw_kernels

        raw_kernels.register_builtin(lib)
    return lib
