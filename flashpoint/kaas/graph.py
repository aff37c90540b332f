"""Validate a KaaS request against a kernel library and order its kernels.

Rules (each breach is a typed 400 with its own code):

* every kernel is in the library (``unknown_kernel``), with the library's arity and
  literal types (``invalid_kernel_graph``), naming only declared buffers
  (``undefined_buffer``);
* dtypes and shapes agree with the kernel's rule (``buffer_mismatch``);
* no kernel writes an input (inputs are immutable cached objects), and a buffer has at most
  one writing kernel, so "which value does a reader see" has one answer
  (``invalid_kernel_graph``);
* kernel j depends on kernel i when j reads a buffer i writes (i != j); these dependencies
  must form a DAG (``kernel_graph_cycle``). State carried between iterations goes through
  buffers a kernel updates in place (one writer, so no cycle), never through a ping-pong
  of two kernels;
* an output or intermediate that is read must have been written by an earlier kernel or
  declare a ``fill`` (``read_before_write``), and every output must be written or filled.

The execution order is a topological order that keeps the request's list order among
independent kernels (kernels run serially on one stream, as in the paper's prototype).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from flashpoint.errors import (
    BufferMismatch,
    InvalidKernelGraph,
    KernelGraphCycle,
    ReadBeforeWrite,
    UndefinedBuffer,
)
from flashpoint.kaas.library import KernelDef, KernelLibrary
from flashpoint.kaas.spec import BufferKind, BufferSpec, KaasRequest


@dataclass(frozen=True)
class GraphPlan:
    """A validated request: kernel definitions in execution order and buffers by name."""

    request: KaasRequest
    order: tuple[int, ...]  # indices into request.kernels
    defs: tuple[KernelDef, ...]  # defs[i] belongs to request.kernels[i]
    buffers: dict[str, BufferSpec]


def plan_graph(req: KaasRequest, library: KernelLibrary) -> GraphPlan:
    """Check ``req`` against ``library``; raise a typed error or return its plan."""
    buffers: dict[str, BufferSpec] = {}
    for b in req.buffers:
        if b.name in buffers:
            raise InvalidKernelGraph(f"buffer {b.name!r} declared twice", buffer=b.name)
        buffers[b.name] = b
    seen_kernels: set[str] = set()
    defs: list[KernelDef] = []
    writer: dict[str, int] = {}
    for i, k in enumerate(req.kernels):
        if k.name in seen_kernels:
            raise InvalidKernelGraph(f"kernel name {k.name!r} used twice", kernel=k.name)
        seen_kernels.add(k.name)
        kdef = library.get(k.library, k.kernel)
        defs.append(kdef)
        if len(k.inputs) != kdef.n_inputs or len(k.outputs) != kdef.n_outputs:
            raise InvalidKernelGraph(
                f"kernel {k.name!r}: {k.library}.{k.kernel} takes {kdef.n_inputs} inputs and "
                f"{kdef.n_outputs} outputs, got {len(k.inputs)} and {len(k.outputs)}",
                kernel=k.name)
        _check_literals(k.name, kdef, k.literals)
        if kdef.raw and (k.grid is None or k.block is None):
            raise InvalidKernelGraph(f"kernel {k.name!r} is a raw kernel: give grid and block",
                                     kernel=k.name)
        for name in (*k.inputs, *k.outputs):
            if name not in buffers:
                raise UndefinedBuffer(f"kernel {k.name!r} uses undeclared buffer {name!r}",
                                      kernel=k.name, buffer=name)
        if len(set(k.outputs)) != len(k.outputs):
            raise InvalidKernelGraph(f"kernel {k.name!r} names an output twice", kernel=k.name)
        for name in k.outputs:
            if buffers[name].kind is BufferKind.INPUT:
                raise InvalidKernelGraph(f"kernel {k.name!r} writes input {name!r}; inputs "
                                         "are immutable", kernel=k.name, buffer=name)
            other = writer.setdefault(name, i)
            if other != i:
                raise InvalidKernelGraph(
                    f"buffer {name!r} is written by kernels {req.kernels[other].name!r} and "
                    f"{k.name!r}; give each its own buffer", buffer=name)
        if kdef.infer is not None:
            metas = [(buffers[n].dtype, buffers[n].shape) for n in k.inputs]
            try:
                want = kdef.infer(metas, [lit.value for lit in k.literals])
            except BufferMismatch as e:
                raise BufferMismatch(f"kernel {k.name!r}: {e.message}", kernel=k.name) from None
            for name, (dtype, shape) in zip(k.outputs, want, strict=True):
                got = buffers[name]
                if (got.dtype, got.shape) != (dtype, shape):
                    raise BufferMismatch(
                        f"kernel {k.name!r}: output {name!r} is {got.dtype} "
                        f"{list(got.shape)}, the kernel produces {dtype} {list(shape)}",
                        kernel=k.name, buffer=name)
        if kdef.launch_check is not None and k.grid is not None and k.block is not None:
            try:
                kdef.launch_check([(buffers[n].dtype, buffers[n].shape) for n in k.inputs],
                                  [(buffers[n].dtype, buffers[n].shape) for n in k.outputs],
                                  [lit.value for lit in k.literals], k.grid, k.block)
            except (BufferMismatch, InvalidKernelGraph) as e:
                raise type(e)(f"kernel {k.name!r}: {e.message}", kernel=k.name) from None
    order = _toposort(req, writer)
    _check_reads(req, buffers, writer, order)
    return GraphPlan(req, order, tuple(defs), buffers)


def _check_literals(kernel: str, kdef: KernelDef, literals: tuple) -> None:
    if len(literals) != len(kdef.literal_types):
        raise InvalidKernelGraph(f"kernel {kernel!r} takes literals {list(kdef.literal_types)}"
                                 f", got {len(literals)}", kernel=kernel)
    for lit, want in zip(literals, kdef.literal_types, strict=True):
        # An integer may stand for a float literal; a float never for an integer.
        if want.startswith("i") and not lit.dtype.startswith("i"):
            raise InvalidKernelGraph(f"kernel {kernel!r}: literal {lit.value!r} must be an "
                                     f"integer ({want})", kernel=kernel)


def _toposort(req: KaasRequest, writer: dict[str, int]) -> tuple[int, ...]:
    n = len(req.kernels)
    succ: list[set[int]] = [set() for _ in range(n)]
    indegree = [0] * n
    for j, k in enumerate(req.kernels):
        for name in k.inputs:
            i = writer.get(name)
            if i is not None and i != j and j not in succ[i]:
                succ[i].add(j)
                indegree[j] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)  # list order among independent kernels
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != n:
        stuck = sorted(req.kernels[i].name for i in range(n) if indegree[i] > 0)
        raise KernelGraphCycle(f"kernels {stuck} depend on each other in a cycle",
                               kernels=stuck)
    return tuple(order)


def _check_reads(req: KaasRequest, buffers: dict[str, BufferSpec], writer: dict[str, int],
                 order: tuple[int, ...]) -> None:
    for b in buffers.values():
        if b.kind is BufferKind.OUTPUT and b.name not in writer and b.fill is None:
            raise InvalidKernelGraph(f"output {b.name!r} is never written", buffer=b.name)
    for i in order:
        k = req.kernels[i]
        for name in k.inputs:
            b = buffers[name]
            if b.kind is BufferKind.INPUT or b.fill is not None:
                continue
            w = writer.get(name)
            if w is None or w == i:  # nothing, or only this kernel itself, writes it
                raise ReadBeforeWrite(f"kernel {k.name!r} reads {b.kind.value} {name!r} "
                                      "before anything writes it (give it a fill to update "
                                      "it in place)", kernel=k.name, buffer=name)


def cache_key(buffer: BufferSpec, client: str) -> str | None:
    """The executor cache key of a buffer that can outlive its request, else None.

    Inputs from the object store are keyed by their object key: objects are immutable, so
    a cached copy never goes stale (digest §5.4) and clients share identical constants
    (the authors keyed per client and noted it as a problem for BERT). Intermediates are
    kept per client, name and layout only to save the allocation (their contents do not
    matter). Inline inputs and outputs belong to one request.
    """
    if buffer.kind is BufferKind.INPUT:
        return f"obj:{buffer.key}" if buffer.key is not None else None
    if buffer.kind is BufferKind.INTERMEDIATE:
        return f"tmp:{client}:{buffer.name}:{buffer.dtype}:{'x'.join(map(str, buffer.shape))}"
    return None
