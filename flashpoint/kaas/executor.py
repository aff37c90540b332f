"""The KaaS executor: runs validated kernel graphs on one device over a buffer cache.

A plain class with a synchronous :meth:`Executor.run`: the in-process pool calls it on a
thread, a worker process can call it from an RPC handler (:meth:`Executor.run_wire` takes
and returns plain data). One request runs at a time (one stream, serial kernels, §4.1.3).

Per request:

1. **resident** — every buffer is made resident before the first kernel (§3): cached
   buffers are pinned first (so making room cannot evict them), room for the misses is made
   in one batch (single-use LRU first, then multi-use LRU), then inputs are loaded object
   store -> host cache -> device cache (inputs are inclusive: kept in both), outputs and
   intermediates are allocated on the device only (exclusive). ``fill`` values are set.
2. **kernels** — the kernels in plan order, ``n_iters`` times, with argument lists packed
   once before the loop.
3. **d2h** — outputs are copied to the host and written to the object store under their
   key (then the device copy stays cached as that object: a later request reading the key
   hits it), or returned inline.

Outputs are written back at the end of the request rather than on eviction (the paper's
"dirty" buffers): the caller needs them in the data layer anyway, and it keeps eviction a
pure free. Every pin is released, and the request's private buffers (inline inputs, inline
outputs) dropped, whether the request succeeds or fails.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import torch

from flashpoint.errors import BufferMismatch, FlashpointError, KernelFailed
from flashpoint.kaas.backend import KaasResult
from flashpoint.kaas.cache import BufferCache
from flashpoint.kaas.graph import GraphPlan, cache_key, plan_graph
from flashpoint.kaas.library import KernelLibrary, default_library
from flashpoint.kaas.spec import BufferKind, BufferSpec, KaasRequest
from flashpoint.kaas.store import ObjectStore

GIB = 1 << 30
# Left to the CUDA context and the allocator's rounding (App. A: total - 300 MB).
CUDA_RESERVE_BYTES = 512 << 20


def default_capacity_bytes(device: str) -> int:
    """Below device memory: CUDA total minus a reserve; 1 GiB on the CPU."""
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        return max(GIB // 4, total - CUDA_RESERVE_BYTES)
    return GIB


class Executor:
    """Runs KaaS requests on ``device`` with a device buffer cache and a host input cache.

    ``link_bytes_per_s`` (CPU only, for benchmarks): loading a missed buffer also waits as
    long as a host-to-device link of that bandwidth would take, so the CPU stand-in prices
    cache misses like a GPU behind PCIe does. None = no emulation (always on a real GPU).
    """

    def __init__(self, executor_id: str, store: ObjectStore,
                 library: KernelLibrary | None = None, *, device: str = "cpu",
                 capacity_bytes: int | None = None, host_capacity_bytes: int | None = None,
                 link_bytes_per_s: float | None = None) -> None:
        self.executor_id = executor_id
        self.store = store
        self.library = library or default_library()
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        cap = capacity_bytes or default_capacity_bytes(device)
        self.cache = BufferCache(cap)
        self.host_cache = BufferCache(host_capacity_bytes or 2 * cap)
        self.link_bytes_per_s = None if self._cuda else link_bytes_per_s
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.requests = 0

    # ------------------------------------------------------------------------ public
    def cached_keys(self) -> frozenset[str]:
        return self.cache.keys()

    def held_objects(self) -> list[str]:
        """Object keys whose bytes this executor holds in either tier (device or host cache):
        a request reading one of them needs no copy of it from the data layer."""
        return sorted({k[4:] for k in (*self.cache.keys(), *self.host_cache.keys())
                       if k.startswith("obj:")})

    def forget(self, keys: list[str]) -> None:
        """Drop cached copies of objects ``keys`` from both tiers (unpinned only: requests
        are serial, so between requests nothing is pinned). A worker is told to when the data
        layer refused the bytes it cached for a key (another writer won the key)."""
        with self._lock:
            for key in keys:
                for cache in (self.cache, self.host_cache):
                    entry = cache.remove(f"obj:{key}")
                    if entry is not None:
                        del entry.value

    def reset(self) -> None:
        """Forget every cached buffer: what a restarted worker (an eTask's cold start) has."""
        with self._lock:
            self.cache.clear()
            self.host_cache.clear()
            if self._cuda:
                torch.cuda.empty_cache()

    def run(self, req: KaasRequest | GraphPlan, *, client: str = "") -> KaasResult:
        """Run one request (validated here unless a plan is given); typed errors only."""
        plan = req if isinstance(req, GraphPlan) else plan_graph(req, self.library)
        with self._lock:
            return self._run(plan, client)

    def run_wire(self, payload: dict[str, Any]) -> dict[str, Any]:
        """RPC form: ``{"request": KaasRequest dict, "client"}`` -> KaasResult wire dict."""
        req = KaasRequest.from_dict(payload["request"])
        return self.run(req, client=str(payload.get("client", ""))).to_wire()

    # ------------------------------------------------------------------------ internals
    def _run(self, plan: GraphPlan, client: str) -> KaasResult:
        start = time.perf_counter()
        seq = next(self._seq)
        self.requests += 1
        before = self.cache.stats.to_dict()
        tensors: dict[str, torch.Tensor] = {}
        pinned: list[str] = []
        private: list[str] = []  # this request's own entries, dropped at the end
        keys: dict[str, str] = {}  # buffer name -> cache key
        try:
            loaded = self._make_resident(plan, client, seq, tensors, pinned, private, keys)
            t_resident = time.perf_counter()
            self._run_kernels(plan, tensors)
            t_kernels = time.perf_counter()
            result = self._collect(plan, tensors, keys, private)
            t_end = time.perf_counter()
        finally:
            for key in pinned:
                if key in self.cache:
                    self.cache.unpin(key)
            for key in private:
                self.cache.remove(key)
        after = self.cache.stats.to_dict()
        result.cache = {k: after[k] - before[k] for k in ("hits", "misses", "evictions")}
        result.cache["loaded_bytes"] = loaded
        result.timings_s = {"resident": t_resident - start, "kernels": t_kernels - t_resident,
                            "d2h": t_end - t_kernels, "total": t_end - start}
        result.executor_id = self.executor_id
        return result

    def _make_resident(self, plan: GraphPlan, client: str, seq: int,
                       tensors: dict[str, torch.Tensor], pinned: list[str],
                       private: list[str], keys: dict[str, str]) -> int:
        misses: list[BufferSpec] = []
        seen: set[str] = set()
        for b in plan.request.buffers:
            key = cache_key(b, client)
            if key is not None:
                # One object under two buffer names in one request is one entry.
                if key in seen:
                    tensors[b.name] = self.cache.entry(key).value if key in self.cache else None
                    keys[b.name] = key
                    continue
                seen.add(key)
                value = self.cache.lookup(key)
                if value is not None:
                    self.cache.pin(key)
                    pinned.append(key)
                    tensors[b.name] = value
                    keys[b.name] = key
                    continue
            else:
                key = f"req{seq}:{b.name}"
            keys[b.name] = key
            misses.append(b)
        need = sum(b.size_bytes for b in misses)
        for entry in self.cache.make_room(need):  # one batch (less fragmentation)
            del entry.value
        loaded = 0
        for b in misses:
            key = keys[b.name]
            t = self._materialise(b)
            if b.kind is BufferKind.INPUT:
                loaded += b.size_bytes
            self.cache.insert(key, t, b.size_bytes, pinned=True)
            pinned.append(key)
            if cache_key(b, client) is None:
                private.append(key)
            tensors[b.name] = t
        for b in plan.request.buffers:  # aliases of a buffer loaded just now
            if tensors.get(b.name) is None:
                tensors[b.name] = self.cache.entry(keys[b.name]).value
            if b.fill is not None:
                tensors[b.name].fill_(b.fill)
        if loaded and self.link_bytes_per_s:
            time.sleep(loaded / self.link_bytes_per_s)
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return loaded

    def _materialise(self, b: BufferSpec) -> torch.Tensor:
        dtype = getattr(torch, b.dtype)
        if b.kind is not BufferKind.INPUT:
            return torch.empty(b.shape, dtype=dtype, device=self.device)
        if b.inline is not None:
            host = torch.frombuffer(bytearray(b.inline), dtype=dtype).reshape(b.shape)
        else:
            host = self._host_input(b, dtype)
        # The device copy (h2d); on the CPU a real copy too, so the device cache owns its
        # bytes exactly as on a GPU.
        if self._cuda:
            return host.to(self.device, non_blocking=True)
        return host.clone()

    def _host_input(self, b: BufferSpec, dtype: torch.dtype) -> torch.Tensor:
        """An object-store input through the host cache (data layer -> host RAM)."""
        key = f"obj:{b.key}"
        host = self.host_cache.lookup(key)
        if host is not None:
            return host
        data = self.store.get(b.key)  # ObjectNotFound propagates
        if len(data) != b.size_bytes:
            raise BufferMismatch(f"input {b.name!r}: object {b.key!r} has {len(data)} bytes, "
                                 f"the buffer declares {b.size_bytes}", buffer=b.name)
        host = torch.frombuffer(bytearray(data), dtype=dtype).reshape(b.shape)
        if self._cuda:
            host = host.pin_memory()
        if b.size_bytes <= self.host_cache.capacity_bytes:
            for entry in self.host_cache.make_room(b.size_bytes):
                del entry.value
            self.host_cache.insert(key, host, b.size_bytes, pinned=False)
        return host

    def _run_kernels(self, plan: GraphPlan, tensors: dict[str, torch.Tensor]) -> None:
        # Pack every launch's arguments once; the loop is then one call per launch.
        launches = []
        for i in plan.order:
            k = plan.request.kernels[i]
            launches.append((plan.defs[i].run, [tensors[n] for n in k.inputs],
                             [tensors[n] for n in k.outputs],
                             [lit.value for lit in k.literals], k))
        try:
            with torch.no_grad():
                for _ in range(plan.request.n_iters):
                    for run, ins, outs, lits, spec in launches:
                        run(ins, outs, lits, spec)
            if self._cuda:
                torch.cuda.synchronize(self.device)
        except FlashpointError:
            raise
        except Exception as e:  # a kernel raised: the request fails, the executor lives on
            raise KernelFailed(f"kernel failed: {type(e).__name__}: {str(e)[:200]}") from None

    def _collect(self, plan: GraphPlan, tensors: dict[str, torch.Tensor],
                 keys: dict[str, str], private: list[str]) -> KaasResult:
        result = KaasResult()
        for b in plan.request.buffers:
            if b.kind is not BufferKind.OUTPUT:
                continue
            host = tensors[b.name].detach().to("cpu", copy=True).numpy()
            if b.key is None:
                result.outputs[b.name] = host
                continue
            self.store.put(b.key, host.tobytes())  # ObjectExists propagates
            result.stored[b.name] = b.key
            # The device copy now *is* that immutable object: keep it cached as an input.
            obj = f"obj:{b.key}"
            if obj not in self.cache:
                self.cache.rekey(keys[b.name], obj)
                private.remove(keys[b.name])
                self.cache.unpin(obj)
        return result

