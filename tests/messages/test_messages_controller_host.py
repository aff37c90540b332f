"""Controller <-> host messages: today's wire maps decode into typed values (the source plan by
its ``kind``, the deploy's FunctionSpec once), survive the frame codec, and a bad one is the
typed error it always was."""

from __future__ import annotations

import pytest

from flashpoint.errors import BadRequest, ProtocolError
from flashpoint.gpu.host_sharing import GpuShare
from flashpoint.messages import controller_host as ch
from flashpoint.messages.base import from_payload, to_payload
from flashpoint.rpc import frames
from flashpoint.spec import FunctionSpec, TensorSpec


def _over_the_wire(payload: dict) -> dict:
    wire = frames.encode(frames.Request(id=1, method="m", payload=payload, timeout_s=5.0))
    return frames.decode(wire).payload


def test_a_deploy_dict_of_today_decodes_with_its_spec_and_plan_typed() -> None:
    spec = FunctionSpec(name="f", model="bert", model_version="2",
                        inputs=(TensorSpec("x", "FP32", (-1, 4)),))
    payload = {  # as HostHandle built it before messages were typed
        "replica_id": "r1", "device_id": "cpu:0", "spec": spec.to_dict(),
        "manifest_json": "{}", "manifest_digest": "abc",
        "source": {"kind": "chain_head", "transfer_id": "t1", "sender": "registry",
                   "chain": [["h2", "10.0.0.2", 7001]], "upstream": ["registry"],
                   "fallback": [["h3", "10.0.0.3", 7001], "registry"]},
        "stage": [0, 5], "pipeline": {"next_hop": None},
        "share": {"sm_share": 0.5, "time_request": 0.5, "time_limit": 0.5,
                  "memory_bytes": 0, "slo_sensitive": True}}
    msg = ch.decode_deploy(_over_the_wire(payload))
    assert isinstance(msg, ch.DeployReplica)
    assert msg.spec == spec  # one FunctionSpec, equal to the one sent
    assert isinstance(msg.source, ch.ChainHeadSource)
    assert msg.source.chain == (("h2", "10.0.0.2", 7001),)
    assert msg.source.fallback == (("h3", "10.0.0.3", 7001), "registry")
    assert msg.stage == (0, 5) and msg.pipeline == ch.PipelineOptions()
    assert msg.share == GpuShare(0.5, 0.5, 0.5, 0, True)
    # Encoded again, it is the same map (the tag comes back as "kind").
    again = to_payload(msg)
    assert again["source"] == {**payload["source"], "upstream": ["registry"]}
    assert again["spec"] == payload["spec"] and again["stage"] == [0, 5]


@pytest.mark.parametrize("kind,cls", [("local", ch.LocalSource), ("pull", ch.PullSource),
                                      ("chain", ch.ChainSource),
                                      ("chain_head", ch.ChainHeadSource)])
def test_each_source_kind_decodes_to_its_own_type(kind, cls) -> None:
    msg = from_payload(ch.DeployReplica, {"replica_id": "r", "spec": {"name": "f", "model": "m"},
                                          "source": {"kind": kind, "transfer_id": "t"}})
    assert type(msg.source) is cls and msg.source.transfer_id == "t"
    assert type(ch.source_plan(kind, transfer_id="t")) is cls


def test_a_kaas_deploy_is_told_apart_by_its_kind() -> None:
    msg = ch.decode_deploy({"replica_id": "k", "device_id": "cuda:0", "kind": "kaas",
                            "device_bytes": 10, "cache_bytes": 5})
    assert msg == ch.DeployKaas(replica_id="k", device_id="cuda:0", device_bytes=10,
                                cache_bytes=5)
    assert to_payload(msg)["kind"] == "kaas"
    with pytest.raises(BadRequest):
        ch.decode_deploy({"replica_id": "k", "kind": "kaas", "device_bytes": 0,
                          "cache_bytes": 5})


@pytest.mark.parametrize("payload,error", [
    ({"replica_id": "", "spec": {"name": "f", "model": "m"}}, BadRequest),
    ({"replica_id": "r", "spec": {"name": "f"}}, BadRequest),  # the spec's own check
    ({"replica_id": "r", "spec": {"name": "f", "model": "m"}, "stage": [True, 2]}, ProtocolError),
    ({"replica_id": "r", "spec": {"name": "f", "model": "m"}, "pipeline": {}}, BadRequest),
    ({"replica_id": "r", "spec": {"name": "f", "model": "m"}, "stage": [0, 1],
      "pipeline": {"port": 70000}}, BadRequest),
    ({"replica_id": "r", "spec": {"name": "f", "model": "m"}, "stage": [0, 1],
      "pipeline": {"next_hop": ["h", "a", 0]}}, BadRequest),
    ({"replica_id": "r", "spec": {"name": "f", "model": "m"},
      "source": {"kind": "teleport"}}, ProtocolError),
    ({"replica_id": "r", "spec": {"name": "f", "model": "m"}, "surprise": 1}, ProtocolError),
])
def test_a_bad_deploy_is_a_typed_error(payload, error) -> None:
    with pytest.raises(error):
        ch.decode_deploy(payload)


def test_registration_round_trips_with_its_four_tuples() -> None:
    reg = ch.RegisterHost(
        host_id="h1", devices=(ch.DeviceReport(device_id="cpu:0", kind="cpu",
                                               memory_bytes=1 << 30),),
        cached_models=("m@1",), replicas=(("r1", "f", "cpu:0", True),),
        models={"r1": "m@1"}, data_endpoint=("h1", "127.0.0.1", 7000),
        stages=(ch.StageReport(replica_id="s1", stage=(0, 3), warm=True),))
    wire = _over_the_wire(to_payload(reg))
    assert wire["replicas"] == [["r1", "f", "cpu:0", True]]  # the 4-tuples, unchanged
    assert from_payload(ch.RegisterHost, wire) == reg
    # What a test or an older host sends: only the id.
    assert from_payload(ch.RegisterHost, {"host_id": "h2", "devices": [], "ram_bytes": 0}
                        ).replicas == ()


def test_expect_transfer_needs_both_ids() -> None:
    with pytest.raises(BadRequest):
        from_payload(ch.ExpectTransfer, {"transfer_id": "t", "manifest_digest": ""})
    with pytest.raises(ProtocolError):
        from_payload(ch.ExpectTransfer, {"transfer_id": "t"})
