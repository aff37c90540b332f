"""Worker._infer_many: one frame of several requests, batched together, each answered alone."""

from __future__ import annotations

import asyncio
import types

import numpy as np

from flashpoint.messages.base import from_payload, to_payload
from flashpoint.messages.controller_worker import InferMany, InferRequest
from flashpoint.tensors import decode_tensors, encode_tensors
from flashpoint.worker.actor import Worker
from flashpoint.worker.batcher import Batcher

T = 5.0  # bound on every await


class _Identity:
    def prepare(self, inputs):
        return inputs

    def finish(self, outputs):
        return outputs


def _worker(run_batch) -> Worker:
    w = Worker("w-test", "ws://unused", b"", 1)
    # all _infer_many reads of it: what a request carries, and how it becomes module inputs
    w.replica = types.SimpleNamespace(request_inputs=("x",), served=_Identity())
    w.batcher = Batcher(run_batch, max_batch_size=16, max_wait_s=0.0)
    return w


def _req(x: np.ndarray, **extra) -> dict:
    return {"request_id": "r", "inputs": encode_tensors({"x": x}), **extra}


async def test_requests_share_one_batch_and_errors_stay_their_own():
    sizes: list[int] = []

    def run(inputs):
        sizes.append(inputs["x"].shape[0])
        return {"y": inputs["x"] * 2}

    w = _worker(run)
    w.batcher.start()
    try:
        xs = [np.full((1, 2), i, np.float32) for i in range(5)]
        reqs = [_req(xs[0]), {"inputs": encode_tensors({"z": xs[1]})}, "not a map",
                _req(xs[2], **{"class": "best_effort"}), _req(xs[3]),
                {"inputs": {"x": {"dtype": "float32", "shape": [1, 2], "data": b"short"}}},
                _req(xs[4])]
        reply = await asyncio.wait_for(w._infer_many(None, InferMany(requests=reqs)), T)
    finally:
        await asyncio.wait_for(w.batcher.stop(), T)
    replies = to_payload(reply)["replies"]  # as they travel
    assert len(replies) == len(reqs)
    for i, x in ((0, xs[0]), (3, xs[2]), (4, xs[3]), (6, xs[4])):
        np.testing.assert_array_equal(decode_tensors(replies[i]["outputs"])["y"], x * 2)
        assert replies[i]["timings_s"]["batch_rows"] == 4.0
    assert replies[1]["error"]["code"] == "bad_request"  # missing input x
    assert replies[2]["error"]["code"] == "bad_request"  # no inputs at all
    assert replies[5]["error"]["code"] == "bad_request"  # bytes do not match the shape
    assert sizes == [4]  # the four good requests ran as one batch


async def test_a_cancelled_frame_cancels_its_queued_requests():
    runs: list[int] = []

    def run(inputs):
        runs.append(inputs["x"].shape[0])
        return {"y": inputs["x"]}

    w = _worker(run)  # its batching loop is not started: everything stays queued
    task = asyncio.ensure_future(w._infer_many(None, InferMany(requests=[
        _req(np.zeros((1, 2), np.float32)) for _ in range(3)])))
    await asyncio.sleep(0.05)
    assert w.batcher.depth == 3 and not task.done()
    queued = [item.future for *_, item in list(w.batcher._queue._queue)]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert len(queued) == 3 and all(f.cancelled() for f in queued)  # nobody waits on them
    w.batcher.start()
    try:
        # The batcher still works through them (their results dropped) and answers the next.
        req = from_payload(InferRequest, _req(np.ones((1, 2), np.float32)))
        out = await asyncio.wait_for(w._infer(None, req), T)
    finally:
        await asyncio.wait_for(w.batcher.stop(), T)
    np.testing.assert_array_equal(decode_tensors(out.outputs)["y"], np.ones((1, 2)))
