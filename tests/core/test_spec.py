"""FunctionSpec / TensorSpec validation from untrusted dicts."""

from __future__ import annotations

import pytest

from flashpoint.errors import BadRequest, InvalidName
from flashpoint.spec import FunctionSpec, TensorSpec


def good(**kw):
    d = {"name": "resnet-fn", "model": "resnet50"}
    d.update(kw)
    return d


def test_minimal_defaults():
    s = FunctionSpec.from_dict(good())
    assert s.name == "resnet-fn" and s.model == "resnet50" and s.model_version == "1"
    assert s.min_replicas == 0 and s.max_replicas >= 1
    assert s.inputs == () and s.outputs == ()


def test_round_trip_with_tensors():
    d = good(model_version="v2.1", max_batch_size=16, batch_wait_ms=1.5, min_replicas=1,
             max_replicas=3, keep_alive_s=5, replica_concurrency=2, timeout_s=10.0,
             inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
             outputs=[{"name": "y", "datatype": "BYTES", "shape": [-1]}])
    s = FunctionSpec.from_dict(d)
    assert s.inputs == (TensorSpec("x", "FP32", (-1, 3, 224, 224)),)
    assert FunctionSpec.from_dict(s.to_dict()) == s
    assert s.to_dict()["inputs"][0]["shape"] == [-1, 3, 224, 224]


def test_rejects_unknown_fields():
    with pytest.raises(BadRequest, match="unknown"):
        FunctionSpec.from_dict(good(gpus=2))


@pytest.mark.parametrize("bad", [None, [], "x", 3])
def test_rejects_non_object(bad):
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict(bad)


@pytest.mark.parametrize("missing", ["name", "model"])
def test_requires_name_and_model(missing):
    d = good()
    del d[missing]
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict(d)


@pytest.mark.parametrize("key,value", [
    ("max_batch_size", "8"), ("max_batch_size", 8.0), ("max_batch_size", True),
    ("min_replicas", None), ("max_replicas", [1]), ("replica_concurrency", False),
    ("batch_wait_ms", "2"), ("keep_alive_s", True), ("timeout_s", None),
    ("name", 5), ("model", ["m"]), ("model_version", 1),
    ("inputs", {"name": "x"}), ("outputs", "y"),
])
def test_rejects_wrong_types(key, value):
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict(good(**{key: value}))


@pytest.mark.parametrize("name", ["../x", "..", ".", "a/b", "A", "", "-x", "x" * 64, "a..b",
                                  "a b", "é", "/etc", "x\x00"])
def test_rejects_bad_names(name):
    with pytest.raises(InvalidName):
        FunctionSpec.from_dict(good(name=name))
    with pytest.raises(InvalidName):
        FunctionSpec.from_dict(good(model=name))


@pytest.mark.parametrize("version", ["../1", "", "a/b", "1..2", "-1"])
def test_rejects_bad_versions(version):
    with pytest.raises(InvalidName):
        FunctionSpec.from_dict(good(model_version=version))


@pytest.mark.parametrize("kw", [
    {"max_batch_size": 0}, {"max_batch_size": 1025}, {"batch_wait_ms": -1}, {"batch_wait_ms": 1001},
    {"min_replicas": -1}, {"max_replicas": 0}, {"min_replicas": 3, "max_replicas": 2},
    {"max_replicas": 1025}, {"keep_alive_s": -0.1}, {"keep_alive_s": 86401},
    {"replica_concurrency": 0}, {"replica_concurrency": 4097}, {"timeout_s": 0},
    {"timeout_s": 3601}, {"keep_alive_s": float("nan")}, {"timeout_s": float("inf")},
    {"batch_fbr": -0.1}, {"batch_fbr": 100.5}, {"batch_fbr": float("nan")}, {"batch_fbr": "1"},
])
def test_bounds(kw):
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict(good(**kw))


@pytest.mark.parametrize("kw", [
    {"max_batch_size": 1}, {"max_batch_size": 1024}, {"batch_wait_ms": 0}, {"batch_wait_ms": 1000},
    {"min_replicas": 4, "max_replicas": 4}, {"keep_alive_s": 0}, {"keep_alive_s": 86400},
    {"replica_concurrency": 4096}, {"timeout_s": 3600}, {"batch_fbr": 0}, {"batch_fbr": 100},
])
def test_bounds_inclusive(kw):
    FunctionSpec.from_dict(good(**kw))


@pytest.mark.parametrize("t", [
    "x", {"datatype": "FP32", "shape": []}, {"name": "", "datatype": "FP32", "shape": []},
    {"name": "x" * 129, "datatype": "FP32", "shape": []},
    {"name": "x", "datatype": "FLOAT", "shape": []}, {"name": "x", "datatype": "FP32", "shape": [-2]},
    {"name": "x", "datatype": "FP32", "shape": "1,2"}, {"name": "x", "datatype": "FP32", "shape": [1.5]},
])
def test_rejects_bad_tensor_specs(t):
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict(good(inputs=[t]))


def test_rejects_too_many_tensors():
    t = {"name": "x", "datatype": "FP32", "shape": [1]}
    FunctionSpec.from_dict(good(inputs=[t] * 64))
    with pytest.raises(BadRequest):
        FunctionSpec.from_dict(good(inputs=[t] * 65))


def test_from_dict_does_not_mutate_input():
    d = good(inputs=[{"name": "x", "datatype": "FP32", "shape": [1]}])
    snapshot = repr(d)
    FunctionSpec.from_dict(d)
    assert repr(d) == snapshot


def test_tenant_class_defaults_to_slo_and_round_trips_as_its_name():
    from flashpoint.policy.klc import TenantClass

    assert FunctionSpec.from_dict(good()).tenant_class is TenantClass.SLO
    s = FunctionSpec.from_dict(good(sm_share=0.3, tenant_class="best_effort"))
    assert s.tenant_class is TenantClass.BEST_EFFORT
    assert s.to_dict()["tenant_class"] == "best_effort"
    assert type(s.to_dict()["tenant_class"]) is str  # plain JSON / msgpack on every wire
    assert FunctionSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("kw,match", [
    ({"sm_share": 0.3, "tenant_class": "bulk"}, r"tenant_class 'bulk': one of \['slo', 'best_effort'\]"),
    ({"sm_share": 0.3, "tenant_class": "BEST_EFFORT"}, "one of"),
    ({"sm_share": 0.3, "tenant_class": 1}, "tenant_class must be a string"),
    ({"sm_share": 0.3, "tenant_class": None}, "tenant_class must be a string"),
    # best-effort is enforced on a shared GPU: without a share it would mean nothing
    ({"tenant_class": "best_effort"}, "needs an sm_share"),
])
def test_tenant_class_is_validated(kw, match):
    with pytest.raises(BadRequest, match=match):
        FunctionSpec.from_dict(good(**kw))
