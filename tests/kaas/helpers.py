"""Request builders shared by the KaaS tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def buf(name: str, kind: str, shape: list[int], dtype: str = "float32", **kw: Any) -> dict:
    return {"name": name, "kind": kind, "dtype": dtype, "shape": shape, **kw}


def kern(kernel: str, inputs: list[str], outputs: list[str], **kw: Any) -> dict:
    return {"kernel": kernel, "inputs": inputs, "outputs": outputs, **kw}


def chain_request(n: int = 4, *, x: np.ndarray | None = None, w_key: str = "w",
                  out_key: str | None = None) -> dict:
    """y = relu(x @ w) + x @ w, w from the store, x inline."""
    x = np.arange(n * n, dtype=np.float32).reshape(n, n) / 10 if x is None else x
    y = buf("y", "output", [n, n])
    if out_key is not None:
        y["key"] = out_key
    return {
        "version": 1,
        "kernels": [kern("matmul", ["x", "w"], ["t"], name="mm"),
                    kern("relu", ["t"], ["r"], name="act"),
                    kern("add", ["r", "t"], ["y"], name="sum")],
        "buffers": [buf("x", "input", [n, n], data=x.tolist()),
                    buf("w", "input", [n, n], key=w_key),
                    buf("t", "intermediate", [n, n]), buf("r", "intermediate", [n, n]), y],
    }


def diag_dominant(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.random((n, n)) + np.eye(n) * n
    return a, rng.random(n)
