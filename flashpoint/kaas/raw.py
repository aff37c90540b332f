"""Raw GPU kernels: CuPy (CUDA C source or PTX) and Triton, registered only where usable.

Nothing here is imported eagerly: on a machine without CuPy, Triton or a CUDA device,
:func:`register_builtin` registers nothing and :func:`register_cupy_kernel` /
:func:`register_triton_kernel` raise :class:`~flashpoint.errors.Unavailable`. The CPU
test suite therefore sees these libraries as absent (``unknown_kernel``).

Argument convention (the authors' ``kernelSpec``, digest §5.11): a raw kernel receives the
device pointers of its input buffers, then its output buffers, in the request's order,
then its literals by value; grid, block and shared memory come from the request.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any

from flashpoint.errors import BufferMismatch, InvalidKernelGraph, KernelFailed, Unavailable
from flashpoint.kaas.kernel_def import KernelDef, KernelLibrary, LaunchCheckFn, Meta

_NUMPY_LITERAL = {"i32": "int32", "i64": "int64", "f32": "float32", "f64": "float64"}


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def cupy_available() -> bool:
    return importlib.util.find_spec("cupy") is not None and _cuda_available()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and _cuda_available()


def register_cupy_kernel(lib: KernelLibrary, name: str, *, entry: str, n_inputs: int,
                         n_outputs: int, literal_types: Sequence[str] = (),
                         source: str | None = None, ptx_path: str | None = None,
                         launch_check: LaunchCheckFn | None = None) -> None:
    """Register a CUDA kernel compiled by CuPy from ``source`` or loaded from ``ptx_path``.

    The module is built once here (the paper's kernel cache: link once, launch many).
    ``launch_check``: how a request's buffers, literals, grid and block are proven safe for
    this kernel before it is queued (a raw kernel sees bare pointers: without one, what it
    touches is the registrant's responsibility).
    """
    if not cupy_available():
        raise Unavailable("CuPy raw kernels need cupy and a CUDA device")
    import cupy
    import numpy as np
    import torch

    if (source is None) == (ptx_path is None):
        raise ValueError("give exactly one of source and ptx_path")
    if source is not None:
        func = cupy.RawKernel(source, entry)
    else:
        func = cupy.RawModule(path=ptx_path).get_function(entry)
    lit_np = tuple(np.dtype(_NUMPY_LITERAL[t]).type for t in literal_types)

    def run(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], spec: Any) -> None:
        ptrs = [cupy.uint64(t.data_ptr()) for t in (*ins, *outs)]
        vals = [conv(v) for conv, v in zip(lit_np, lits, strict=True)]
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        try:
            with stream:
                func(tuple(spec.grid), tuple(spec.block), (*ptrs, *vals),
                     shared_mem=spec.shared_bytes)
        except Exception as e:  # CUDA launch errors, bad arguments
            raise KernelFailed(f"cupy kernel {name!r} failed: {str(e)[:200]}") from None

    lib.register(KernelDef("cupy", name, n_inputs, n_outputs, tuple(literal_types), run,
                           infer=None, raw=True, launch_check=launch_check))


def register_triton_kernel(lib: KernelLibrary, name: str, fn: Any, *, n_inputs: int,
                           n_outputs: int, literal_types: Sequence[str] = ()) -> None:
    """Register a ``@triton.jit`` function launched as ``fn[grid](*ins, *outs, *literals)``.

    Triton kernels take tensors (it reads their pointers) and use the grid only.
    """
    if not triton_available():
        raise Unavailable("Triton kernels need triton and a CUDA device")

    def run(ins: Sequence[Any], outs: Sequence[Any], lits: Sequence[Any], spec: Any) -> None:
        try:
            fn[tuple(spec.grid)](*ins, *outs, *lits)
        except Exception as e:
            raise KernelFailed(f"triton kernel {name!r} failed: {str(e)[:200]}") from None

    lib.register(KernelDef("triton", name, n_inputs, n_outputs, tuple(literal_types), run,
                           infer=None, raw=True))


# A built-in raw kernel so a GPU deployment can check the CuPy path end to end:
# out[i] = a * x[i] + y[i] over n float32 elements.
SAXPY_SOURCE = r"""
extern "C" __global__ void saxpy(const float* x, const float* y, float* out, float a, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + y[i];
}
"""


MAX_THREADS_PER_BLOCK = 1024  # every CUDA device since compute capability 2.0


def check_1d_launch(n: int, grid: tuple[int, ...], block: tuple[int, ...]) -> None:
    """A 1-D launch of ``grid x block`` threads that covers ``n`` elements: y and z of
    both 1, at most 1024 threads a block (InvalidKernelGraph otherwise)."""
    if any(d != 1 for d in (*grid[1:], *block[1:])):
        raise InvalidKernelGraph(f"a 1-D kernel: grid {list(grid)} and block {list(block)} "
                                 "must have y and z of 1")
    if block[0] > MAX_THREADS_PER_BLOCK:
        raise InvalidKernelGraph(f"block of {block[0]} threads is over "
                                 f"{MAX_THREADS_PER_BLOCK}")
    if grid[0] * block[0] < n:
        raise InvalidKernelGraph(f"grid {grid[0]} x block {block[0]} threads do not cover "
                                 f"n = {n} elements")


def check_saxpy_launch(ins: Sequence[Meta], outs: Sequence[Meta], lits: Sequence[Any],
                       grid: tuple[int, ...], block: tuple[int, ...]) -> None:
    """saxpy touches ``x[0:n]``, ``y[0:n]`` and ``out[0:n]`` as float32: each buffer must be
    float32 with at least ``n`` elements, ``n >= 0``, and the launch 1-D covering ``n``."""
    n = int(lits[1])
    if n < 0:
        raise BufferMismatch(f"saxpy: n = {n} is negative")
    for role, (dtype, shape) in zip(("x", "y", "out"), (*ins, *outs), strict=True):
        count = math.prod(shape)
        if dtype != "float32":
            raise BufferMismatch(f"saxpy: {role} must be float32, not {dtype}")
        if count < n:
            raise BufferMismatch(f"saxpy: n = {n} is past {role}'s {count} elements")
    check_1d_launch(n, grid, block)


def register_builtin(lib: KernelLibrary) -> None:
    """Register the built-in raw kernels where CuPy and a GPU exist; else nothing."""
    if cupy_available():
        register_cupy_kernel(lib, "saxpy", entry="saxpy", n_inputs=2, n_outputs=1,
                             literal_types=("f32", "i32"), source=SAXPY_SOURCE,
                             launch_check=check_saxpy_launch)
