"""Executor: results equal torch computed directly; caching, pinning and store outputs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flashpoint import errors
from flashpoint.kaas.executor import Executor, KaasResult
from flashpoint.kaas.spec import KaasRequest
from flashpoint.kaas.store import MemoryObjectStore

from .helpers import buf, chain_request, diag_dominant, kern


@pytest.fixture
def store() -> MemoryObjectStore:
    s = MemoryObjectStore()
    s.put("w", (np.arange(16, dtype=np.float32).reshape(4, 4) - 7).tobytes())
    return s


def run(ex: Executor, d: dict, client: str = "c") -> KaasResult:
    return ex.run(KaasRequest.from_dict(d), client=client)


def test_chain_equals_torch(store):
    ex = Executor("e0", store, capacity_bytes=1 << 20)
    d = chain_request()
    out = run(ex, d).outputs["y"]
    x = torch.tensor(d["buffers"][0]["data"], dtype=torch.float32)
    w = torch.frombuffer(bytearray(store.get("w")), dtype=torch.float32).reshape(4, 4)
    t = x @ w
    assert np.allclose(out, (torch.relu(t) + t).numpy())


def test_jacobi_iterations_solve_the_system():
    a, b = diag_dominant(16)
    d = {"n_iters": 60, "kernels": [kern("jacobi_step", ["A", "b", "x"], ["x"])],
         "buffers": [buf("A", "input", [16, 16], "float64", data=a.tolist()),
                     buf("b", "input", [16], "float64", data=b.tolist()),
                     buf("x", "output", [16], "float64", fill=0.0)]}
    ex = Executor("e0", MemoryObjectStore(), capacity_bytes=1 << 20)
    x = run(ex, d).outputs["x"]
    assert np.allclose(x, np.linalg.solve(a, b), atol=1e-8)
    # fill resets x on every request: the same answer, not 120 iterations' worth
    assert np.array_equal(run(ex, d).outputs["x"], x)


def test_softmax_scale_literals():
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]], np.float32)
    d = {"kernels": [kern("scale", ["x"], ["t"], literals=[2]),
                     kern("softmax", ["t"], ["y"], literals=[-1])],
         "buffers": [buf("x", "input", [2, 3], data=x.tolist()), buf("t", "intermediate", [2, 3]),
                     buf("y", "output", [2, 3])]}
    out = run(Executor("e0", MemoryObjectStore(), capacity_bytes=4096), d).outputs["y"]
    assert np.allclose(out, torch.softmax(torch.from_numpy(x) * 2, -1).numpy())


def test_store_inputs_cached_and_counted(store):
    ex = Executor("e0", store, capacity_bytes=1 << 20)
    first = run(ex, chain_request())
    # w and the two intermediates miss; the inline input is request-private (not counted)
    assert first.cache == {"hits": 0, "misses": 3, "evictions": 0, "loaded_bytes": 128}
    second = run(ex, chain_request())
    assert second.cache == {"hits": 3, "misses": 0, "evictions": 0, "loaded_bytes": 64}
    assert "obj:w" in ex.cached_keys() and "obj:w" in ex.host_cache
    assert set(second.timings_s) == {"resident", "kernels", "d2h", "total"}
    # Inline inputs and outputs are dropped after the request; nothing stays pinned.
    assert not any(k.startswith("req") for k in ex.cached_keys())
    assert ex.cache.pinned_bytes == 0


def test_outputs_to_store_become_cached_objects(store):
    ex = Executor("e0", store, capacity_bytes=1 << 20)
    res = run(ex, chain_request(out_key="y1"))
    assert res.stored == {"y": "y1"} and res.outputs == {}
    direct = run(ex, chain_request()).outputs["y"]
    assert store.get("y1") == direct.tobytes()
    assert "obj:y1" in ex.cached_keys()  # a later request reading y1 hits the device copy
    # Immutable: the same key with other bytes is a conflict, and the executor cleans up.
    other = chain_request(x=np.ones((4, 4), np.float32), out_key="y1")
    with pytest.raises(errors.ObjectExists):
        run(ex, other)
    assert ex.cache.pinned_bytes == 0 and store.get("y1") == direct.tobytes()


def test_eviction_under_capacity_keeps_reused_constants():
    store = MemoryObjectStore()
    for k in ("w1", "w2", "w3"):
        store.put(k, np.ones((4, 4), np.float32).tobytes())
    ex = Executor("e0", store, capacity_bytes=64 * 9)  # nine 4x4 float32 buffers
    run(ex, chain_request(w_key="w1"), "hot")
    run(ex, chain_request(w_key="w1"), "hot")  # w1 and hot's intermediates: multi-use
    run(ex, chain_request(w_key="w2"), "once")  # w2 and once's intermediates: single-use
    res = run(ex, chain_request(w_key="w3"), "new")  # needs 2 buffers' room
    assert res.cache["evictions"] == 2
    keys = ex.cached_keys()
    # single-use LRU went first (w2, then once's t); every multi-use buffer survived
    assert "obj:w2" not in keys and "tmp:once:t:float32:4x4" not in keys
    assert {"obj:w1", "tmp:hot:t:float32:4x4", "tmp:hot:r:float32:4x4"} <= keys
    assert ex.cache.used_bytes <= ex.cache.capacity_bytes


def test_too_large_and_missing_object(store):
    ex = Executor("e0", store, capacity_bytes=100)
    with pytest.raises(errors.BufferCacheFull):
        run(ex, chain_request())
    assert len(ex.cache) == 0 and ex.cache.pinned_bytes == 0
    ex = Executor("e1", store, capacity_bytes=1 << 20)
    with pytest.raises(errors.ObjectNotFound):
        run(ex, chain_request(w_key="absent"))
    store.put("short", b"1234")
    with pytest.raises(errors.BufferMismatch):
        run(ex, chain_request(w_key="short"))
    assert ex.cache.pinned_bytes == 0


def test_kernel_failure_is_typed(store):
    ex = Executor("e0", store, capacity_bytes=1 << 20)
    kdef = ex.library.get("torch", "relu")

    def boom(*args):
        raise RuntimeError("device exploded")

    ex.library.register(type(kdef)(**{**kdef.__dict__, "run": boom}))
    with pytest.raises(errors.KernelFailed, match="device exploded"):
        run(ex, chain_request())
    assert ex.cache.pinned_bytes == 0


def test_wire_round_trip(store):
    ex = Executor("e0", store, capacity_bytes=1 << 20)
    wire = ex.run_wire({"request": chain_request(), "client": "c"})
    res = KaasResult.from_wire(wire)
    assert np.array_equal(res.outputs["y"], run(ex, chain_request()).outputs["y"])


def test_reset_forgets_everything(store):
    ex = Executor("e0", store, capacity_bytes=1 << 20)
    run(ex, chain_request())
    ex.reset()
    assert not ex.cached_keys() and len(ex.host_cache) == 0
    assert run(ex, chain_request()).cache["hits"] == 0


def test_a_request_never_evicts_its_own_buffers(store):
    """Its cache hits are pinned before room is made for its misses: when only they could
    make room, the request is refused rather than evicting what it is about to use."""
    ex = Executor("e0", store, capacity_bytes=64 * 4)
    copy_w = {"kernels": [kern("copy", ["w"], ["y"])],
              "buffers": [buf("w", "input", [4, 4], key="w"), buf("y", "output", [4, 4])]}
    run(ex, copy_w)
    assert ex.cached_keys() == {"obj:w"}
    big = copy.deepcopy(copy_w)
    big["buffers"].append({"name": "scratch", "kind": "intermediate", "size_bytes": 64 * 3})
    with pytest.raises(errors.BufferCacheFull):
        run(ex, big)  # w (hit) + y + scratch = 320 bytes > 256
    assert ex.cached_keys() == {"obj:w"} and ex.cache.pinned_bytes == 0
