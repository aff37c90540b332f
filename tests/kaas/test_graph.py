"""Request parsing and graph validation: each malformed request gets its own typed code."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from flashpoint import errors
from flashpoint.kaas.graph import plan_graph
from flashpoint.kaas.library import default_library
from flashpoint.kaas.spec import KaasRequest

from .helpers import buf, chain_request, kern

LIB = default_library()


def plan(d: dict):
    return plan_graph(KaasRequest.from_dict(d), LIB)


def test_good_request_round_trips_and_orders_by_dependency():
    d = chain_request()
    d["kernels"] = d["kernels"][::-1]  # listed backwards: the plan still runs mm first
    p = plan(d)
    assert [p.request.kernels[i].name for i in p.order] == ["mm", "act", "sum"]
    again = KaasRequest.from_dict(p.request.to_dict())
    assert again == p.request


def test_inline_b64_and_size_only_intermediate():
    x = np.ones((2, 2), np.float32)
    d = {"kernels": [kern("copy", ["x"], ["y"])],
         "buffers": [buf("x", "input", [2, 2], b64=base64.b64encode(x.tobytes()).decode()),
                     {"name": "scratch", "kind": "intermediate", "size_bytes": 64},
                     buf("y", "output", [2, 2])]}
    p = plan(d)
    assert p.buffers["scratch"].shape == (64,) and p.buffers["scratch"].dtype == "uint8"
    assert p.buffers["x"].array().tolist() == [[1, 1], [1, 1]]


def _one_input(dtype: str, data: list) -> dict:
    return {"kernels": [kern("copy", ["x"], ["y"])],
            "buffers": [buf("x", "input", [len(data)], dtype=dtype, data=data),
                        buf("y", "output", [len(data)], dtype=dtype)]}


@pytest.mark.parametrize("dtype,data", [
    ("int32", [2**31]), ("int32", [-(2**31) - 1]), ("uint8", [256]), ("uint8", [-1]),
    ("int64", [2**63]), ("int32", [1.5]), ("uint8", [True, 2.0]),
])
def test_inline_data_that_does_not_fit_an_integer_buffer_is_refused(dtype, data):
    with pytest.raises(errors.BufferMismatch) as e:
        plan(_one_input(dtype, data))
    assert e.value.code == "buffer_mismatch" and "'x'" in e.value.message


def test_inline_data_casts_like_the_gateway():
    p = plan(_one_input("uint8", [0, 255]))
    assert p.buffers["x"].array().tolist() == [0, 255]
    p = plan(_one_input("int32", [-(2**31), 2**31 - 1]))
    assert p.buffers["x"].array().tolist() == [-(2**31), 2**31 - 1]
    with np.errstate(over="raise"):  # the overflow to inf is IEEE rounding, not a warning
        p = plan(_one_input("float32", [1e300, -1e300, 2]))
    assert p.buffers["x"].array().tolist() == [np.inf, -np.inf, 2.0]


def _mutate(**changes) -> dict:
    d = chain_request()
    for path, value in changes.items():
        target = d
        *parts, last = path.split("__")
        for part in parts:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value
    return d


@pytest.mark.parametrize("d,code", [
    (_mutate(kernels__0__kernel="nope"), "unknown_kernel"),
    (_mutate(kernels__0__library="cupy"), "unknown_kernel"),  # absent without a GPU
    (_mutate(kernels__1__inputs=["ghost"]), "undefined_buffer"),
    (_mutate(buffers__1__shape=[3, 4]), "buffer_mismatch"),  # matmul (4,4) x (3,4)
    (_mutate(buffers__4__dtype="float64"), "buffer_mismatch"),  # add writes float32
    (_mutate(buffers__2__size_bytes=10), "buffer_mismatch"),  # 4*4*4 != 10
    (_mutate(buffers__0__data=[1.0, 2.0]), "buffer_mismatch"),  # 2 values for 16
    (_mutate(buffers__0__dtype="complex64"), "buffer_mismatch"),
    (_mutate(kernels__0__outputs=["x"]), "invalid_kernel_graph"),  # writes an input
    (_mutate(kernels__1__outputs=["t"]), "invalid_kernel_graph"),  # two writers of t
    (_mutate(kernels__0__inputs=["x"]), "invalid_kernel_graph"),  # arity
    (_mutate(version=2), "invalid_kernel_graph"),
    (_mutate(n_iters=0), "invalid_kernel_graph"),
    (_mutate(extra=1), "invalid_kernel_graph"),
])
def test_bad_requests_have_specific_codes(d, code):
    with pytest.raises(errors.BadRequest) as info:
        plan(d)
    assert info.value.code == code, info.value
    assert info.value.http_status == 400


def test_cycle_is_reported_with_its_kernels():
    d = {"kernels": [kern("relu", ["b"], ["a"], name="k1"), kern("relu", ["a"], ["b"], name="k2"),
                     kern("copy", ["a"], ["y"], name="k3")],
         "buffers": [buf("a", "intermediate", [2]), buf("b", "intermediate", [2]),
                     buf("y", "output", [2])]}
    with pytest.raises(errors.KernelGraphCycle) as info:
        plan(d)
    assert info.value.details["kernels"] == ["k1", "k2", "k3"]  # k3 waits on the cycle


def test_intermediate_read_before_written():
    d = {"kernels": [kern("relu", ["t"], ["y"])],
         "buffers": [buf("t", "intermediate", [2]), buf("y", "output", [2])]}
    with pytest.raises(errors.ReadBeforeWrite):
        plan(d)


def test_in_place_update_needs_a_fill():
    a, b = np.eye(3), np.ones(3)
    d = {"n_iters": 5, "kernels": [kern("jacobi_step", ["A", "b", "x"], ["x"])],
         "buffers": [buf("A", "input", [3, 3], "float64", data=a.tolist()),
                     buf("b", "input", [3], "float64", data=b.tolist()),
                     buf("x", "output", [3], "float64")]}
    with pytest.raises(errors.ReadBeforeWrite):
        plan(d)
    d["buffers"][2]["fill"] = 0.0
    assert plan(d).order == (0,)


def test_output_never_written():
    d = chain_request()
    d["buffers"].append(buf("z", "output", [2]))
    with pytest.raises(errors.InvalidKernelGraph, match="never written"):
        plan(d)


def test_literal_types_checked():
    d = {"kernels": [kern("softmax", ["x"], ["y"], literals=[1.5])],
         "buffers": [buf("x", "input", [2, 2], data=[[1, 2], [3, 4]]), buf("y", "output", [2, 2])]}
    with pytest.raises(errors.InvalidKernelGraph, match="integer"):
        plan(d)
    d["kernels"][0]["literals"] = [5]
    with pytest.raises(errors.BufferMismatch, match="dim"):
        plan(d)
    d["kernels"][0]["literals"] = [{"dtype": "i32", "value": 2**31}]
    with pytest.raises(errors.InvalidKernelGraph, match="fit"):
        plan(d)
    d["kernels"][0]["literals"] = [{"dtype": "i32", "value": -1}]
    assert plan(d)


def test_launch_cap(monkeypatch):
    from flashpoint.kaas import spec

    monkeypatch.setattr(spec, "MAX_LAUNCHES", 30)
    with pytest.raises(errors.InvalidKernelGraph, match="launch"):
        plan(_mutate(n_iters=11))  # 3 kernels x 11
    assert plan(_mutate(n_iters=10))
