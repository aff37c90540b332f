"""The worker's messages (messages/host_worker.py, messages/controller_worker.py): wire names,
nesting through the real frame codec, the shallow encoding of the infer path checked against
msgspec's own deep conversion, and encoded tensors carried without a copy either way."""

from __future__ import annotations

import inspect

import msgspec
import numpy as np
import pytest

from flashpoint.errors import ProtocolError
from flashpoint.messages import controller_worker as cw
from flashpoint.messages import host_worker as hw
from flashpoint.messages.base import Message, from_payload, to_payload
from flashpoint.rpc import frames
from flashpoint.tensors import decode_tensors, encode_tensors

MESSAGES = [cls for mod in (cw, hw) for _, cls in inspect.getmembers(mod, inspect.isclass)
            if issubclass(cls, Message) and cls is not Message and cls.__module__ == mod.__name__]
DEEP = (bytes, bytearray, memoryview)


def _through_frames(method: str, payload: dict) -> dict:
    wire = frames.encode(frames.Request(id=1, method=method, payload=payload, timeout_s=5.0))
    return frames.decode(wire).payload


@pytest.mark.parametrize("cls", [c for c in MESSAGES if c.wire_values], ids=lambda c: c.__name__)
def test_shallow_messages_keep_their_field_names(cls):
    # The shallow path writes attribute names: it is only right where they are the wire names.
    assert cls.__struct_encode_fields__ == cls.__struct_fields__


def test_infer_request_travels_under_its_wire_names_and_keeps_the_tensor_bytes():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    enc = encode_tensors({"x": x})
    # What the controller's request path builds for one request (traced: with its span's
    # W3C traceparent, flashpoint/tracing.py).
    sent = {"request_id": "req-1", "inputs": enc, "class": "best_effort", "stream": True,
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    msg = from_payload(cw.InferRequest, sent, method="infer")
    assert msg.inputs["x"]["data"] is enc["x"]["data"]  # validated, not copied
    assert (msg.request_id, msg.request_class, msg.stream) == ("req-1", "best_effort", True)
    out = to_payload(msg)
    assert out == sent and "request_class" not in out
    back = from_payload(cw.InferRequest, _through_frames("infer", out), method="infer")
    np.testing.assert_array_equal(decode_tensors(back.inputs)["x"], x)


def test_infer_replies_encode_shallowly_as_msgspec_would_deeply():
    enc = encode_tensors({"y": np.ones((1, 4), np.float32)})
    error = {"code": "bad_request", "message": "missing inputs: ['x']"}
    items = [cw.InferReply(outputs=enc, timings_s={"queue": 0.001, "batch_rows": 2.0}),
             cw.InferFailed(error=error),
             cw.InferStreamReply(outputs=enc, chunks=3, timings_s={"inference": 0.5})]
    for msg in items:
        shallow = to_payload(msg)
        assert shallow == msgspec.to_builtins(msg, builtin_types=DEEP)
    reply = cw.InferManyReply(replies=[to_payload(m) for m in items[:2]])
    payload = to_payload(reply)
    assert payload["replies"][0]["outputs"]["y"]["data"] is enc["y"]["data"]  # no copy
    back = from_payload(cw.InferManyReply, _through_frames("infer_many", payload))
    assert back.replies[1] == {"error": error}
    np.testing.assert_array_equal(decode_tensors(back.replies[0]["outputs"])["y"], np.ones((1, 4)))


def test_infer_many_keeps_a_malformed_request_for_the_worker_to_fail_alone():
    payload = to_payload(cw.InferMany(requests=[{"request_id": "a"}, "not a map"]))
    assert from_payload(cw.InferMany, payload).requests == [{"request_id": "a"}, "not a map"]
    with pytest.raises(ProtocolError, match="InferRequest"):
        from_payload(cw.InferRequest, {"request_id": 5}, method="infer_many")


def test_load_replica_nests_its_options_through_the_frame_codec():
    msg = hw.LoadReplica(
        replica_id="r1", host_id="h1", spec={"name": "f", "model": "noop"},
        cache_path="/cache/noop@1", manifest_json="{}", controller_url="ws://c/rpc",
        stage=(0, 2), fetch_s=0.25, host_timings_s={"obtain": 0.1},
        pipeline=hw.PipelineOptions(listen_host="10.0.0.2", port=0, next_hop=None),
        weight_slot=hw.WeightSlot(dir="/run/w", key="k"), env={"CUDA_VISIBLE_DEVICES": "0"})
    payload = _through_frames("load_replica", to_payload(msg))
    assert payload["pipeline"] == {"listen_host": "10.0.0.2", "port": 0, "next_hop": None}
    assert payload["stage"] == [0, 2]
    assert from_payload(hw.LoadReplica, payload, method="load_replica") == msg


@pytest.mark.parametrize("payload,field", [
    ({"replica_id": "r1"}, "spec"),
    ({"replica_id": "r1", "cache_path": "p", "manifest_json": "{}", "controller_url": "u",
      "spec": {}, "pipeline": {"port": "any"}}, "port"),
    ({"replica_id": "r1", "cache_path": "p", "manifest_json": "{}", "controller_url": "u",
      "spec": {}, "stage": [0]}, "stage"),
])
def test_a_load_that_does_not_fit_names_its_field(payload, field):
    with pytest.raises(ProtocolError) as info:
        from_payload(hw.LoadReplica, payload, method="load_replica")
    assert field in info.value.message


def test_kaas_run_carries_its_objects_as_bytes():
    blob = bytes(range(16))
    msg = cw.KaasRun(request={"kernels": []}, objects={"w": blob}, forget=["old"])
    back = from_payload(cw.KaasRun, _through_frames("kaas_run", to_payload(msg)))
    assert back == msg and back.version == 1


def test_an_empty_request_or_reply_is_an_empty_map():
    for cls in (hw.Shutdown, hw.ReplicaStats, cw.Ping, cw.Pong, cw.KaasReset, cw.ReplicaStatus):
        assert to_payload(cls()) == {}
    with pytest.raises(ProtocolError, match="surprise"):
        from_payload(cw.Ping, {"surprise": 1}, method="ping")


def test_a_resumed_infer_request_carries_its_hand_off():
    """Live migration: ``resume`` travels only when set (messages/migration.py)."""
    import msgspec

    from flashpoint.messages.migration import SequenceHandOff

    sent = {"request_id": "r", "inputs": {}, "stream": True,
            "resume": {"prompt_ids": [1, 2], "generated_ids": [3], "emitted_text": "x",
                       "rng_state": b"\x01\x02", "chunks": 1}}
    msg = from_payload(cw.InferRequest, _through_frames("infer", sent), method="infer")
    assert msg.resume == SequenceHandOff(prompt_ids=(1, 2), generated_ids=(3,),
                                         emitted_text="x", rng_state=b"\x01\x02", chunks=1)
    assert to_payload(msg)["resume"]["rng_state"] == b"\x01\x02"
    plain = from_payload(cw.InferRequest, {"request_id": "r"}, method="infer")
    assert plain.resume is msgspec.UNSET and "resume" not in to_payload(plain)


def test_park_messages_through_the_frame_codec():
    """Multi-round live migration (messages/migration.py): snapshots nest in a park through
    the real frames; results default to no code; an unknown field is refused by name."""
    from flashpoint.messages.migration import (
        ParkResult,
        ParkSequences,
        SequenceSnapshot,
        SequenceSnapshots,
        SequencesParked,
        UnparkSequences,
    )

    snap = SequenceSnapshot(request_id="r", prompt_ids=(1, 2), generated_ids=(3, 4),
                            max_tokens=9)
    got = from_payload(SequenceSnapshots, _through_frames(
        "snapshot_sequences", to_payload(SequenceSnapshots(sequences=(snap,)))))
    assert got.sequences == (snap,)
    park = from_payload(ParkSequences, _through_frames(
        "park_sequences", to_payload(ParkSequences(sequences=(snap,), ttl_s=3.0))))
    assert park.sequences == (snap,) and park.ttl_s == 3.0
    reply = from_payload(SequencesParked, _through_frames("park_sequences", {
        "results": [{"request_id": "r", "parked": False, "code": "kv_cache_full"},
                    {"request_id": "s", "parked": True, "prefill_s": 0.01}]}))
    assert reply.results == (ParkResult(request_id="r", parked=False, code="kv_cache_full"),
                             ParkResult(request_id="s", parked=True, prefill_s=0.01))
    with pytest.raises(ProtocolError, match="surprise"):
        from_payload(UnparkSequences, {"request_ids": ["r"], "surprise": 1},
                     method="unpark_sequences")
