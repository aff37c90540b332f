"""The CUDA paths: torch operators on a GPU executor and a CuPy raw kernel. Skipped cleanly
without CUDA (and, for the raw kernel, without CuPy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashpoint.kaas.executor import Executor
from flashpoint.kaas.library import default_library
from flashpoint.kaas.raw import cupy_available
from flashpoint.kaas.spec import KaasRequest
from flashpoint.kaas.store import MemoryObjectStore

from .helpers import buf, chain_request, kern

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_chain_on_cuda_matches_cpu():
    store = MemoryObjectStore()
    store.put("w", np.eye(4, dtype=np.float32).tobytes())
    lib = default_library()
    gpu = Executor("g", store, lib, device="cuda:0", capacity_bytes=1 << 26)
    cpu = Executor("c", store, lib, capacity_bytes=1 << 20)
    req = KaasRequest.from_dict(chain_request())
    assert np.allclose(gpu.run(req).outputs["y"], cpu.run(req).outputs["y"])
    assert gpu.run(req).cache["hits"] == 3


@pytest.mark.skipif(not cupy_available(), reason="needs CuPy")
def test_cupy_saxpy():
    n = 1000
    x, y = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
    d = {"kernels": [kern("saxpy", ["x", "y"], ["out"], library="cupy",
                          literals=[{"dtype": "f32", "value": 2.0}, {"dtype": "i32", "value": n}],
                          grid=[(n + 255) // 256], block=[256])],
         "buffers": [buf("x", "input", [n], data=x.tolist()), buf("y", "input", [n], data=y.tolist()),
                     buf("out", "output", [n])]}
    ex = Executor("g", MemoryObjectStore(), device="cuda:0", capacity_bytes=1 << 26)
    out = ex.run(KaasRequest.from_dict(d)).outputs["out"]
    assert np.allclose(out, 2 * x + y)
