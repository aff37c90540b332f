"""Batcher: dynamic batching with a plain numpy run_batch."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from flashpoint.errors import FlashpointError, ModelFailed, Unavailable
from flashpoint.worker.batcher import Batcher

T = 2.0  # bound on every await


class Recorder:
    """run_batch: y = 2 * x + row-sum, recording each batch's row count."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.sizes: list[int] = []
        self.gate = gate
        self.started = threading.Event()

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(5.0)
        x = inputs["x"]
        self.sizes.append(x.shape[0])
        return {"y": x * 2, "s": x.reshape(x.shape[0], -1).sum(axis=1)}


async def _started(b: Batcher) -> Batcher:
    b.start()
    return b


async def _stop(b: Batcher) -> None:
    await asyncio.wait_for(b.stop(), T)


async def test_concurrent_submits_merged_and_split_back():
    rec = Recorder()
    b = await _started(Batcher(rec, max_batch_size=8, max_wait_s=0.05))
    try:
        xs = [np.full((2, 3), i, dtype=np.float32) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*(b.submit({"x": x}) for x in xs)), T)
        assert rec.sizes == [8]
        assert b.batches_run == 1
        for x, (out, timings) in zip(xs, results, strict=True):
            np.testing.assert_array_equal(out["y"], x * 2)
            np.testing.assert_array_equal(out["s"], x.sum(axis=1))
            assert timings["batch_rows"] == 8.0
            assert timings["batch_wait"] >= 0 and timings["inference"] >= 0
    finally:
        await _stop(b)


async def test_batches_capped_at_max_batch_size():
    rec = Recorder()
    b = await _started(Batcher(rec, max_batch_size=4, max_wait_s=0.05))
    try:
        xs = [np.arange(3 * i, 3 * i + 3, dtype=np.int64).reshape(1, 3) + 0 * i for i in range(10)]
        xs[3] = np.arange(9, dtype=np.int64).reshape(3, 3)  # a 3-row request
        results = await asyncio.wait_for(asyncio.gather(*(b.submit({"x": x}) for x in xs)), T)
        assert all(s <= 4 for s in rec.sizes)
        assert sum(rec.sizes) == sum(x.shape[0] for x in xs)
        assert len(rec.sizes) >= 3
        for x, (out, _) in zip(xs, results, strict=True):
            np.testing.assert_array_equal(out["y"], x * 2)
            np.testing.assert_array_equal(out["s"], x.sum(axis=1))
    finally:
        await _stop(b)


async def test_oversized_request_runs_alone():
    rec = Recorder()
    b = await _started(Batcher(rec, max_batch_size=2, max_wait_s=0.02))
    try:
        x = np.ones((5, 2), dtype=np.float32)
        out, _ = await asyncio.wait_for(b.submit({"x": x}), T)
        np.testing.assert_array_equal(out["y"], x * 2)
        assert rec.sizes == [5]
    finally:
        await _stop(b)


async def test_incompatible_shapes_not_merged_but_all_complete():
    rec = Recorder()
    b = await _started(Batcher(rec, max_batch_size=16, max_wait_s=0.05))
    try:
        xs = [np.ones((1, 3), np.float32), np.ones((1, 4), np.float32), np.ones((1, 3), np.float32),
              np.ones((2, 4), np.float64), np.ones((1, 3), np.float32)]
        results = await asyncio.wait_for(asyncio.gather(*(b.submit({"x": x}) for x in xs)), T)
        for x, (out, _) in zip(xs, results, strict=True):
            assert out["y"].shape == x.shape and out["y"].dtype == x.dtype
            np.testing.assert_array_equal(out["y"], x * 2)
        assert sum(rec.sizes) == 6
        assert len(rec.sizes) >= 3  # at least one batch per signature
    finally:
        await _stop(b)


async def test_run_batch_raising_fails_every_request_of_the_batch():
    calls = []

    def boom(inputs):
        calls.append(inputs["x"].shape[0])
        raise ValueError("kaput")

    b = await _started(Batcher(boom, max_batch_size=8, max_wait_s=0.05))
    try:
        tasks = [asyncio.ensure_future(b.submit({"x": np.zeros((1, 2))})) for _ in range(3)]
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), T)
        assert calls == [3]
        for r in done:
            assert isinstance(r, ModelFailed)
            assert "ValueError" in r.message and "kaput" in r.message
        # the batcher keeps serving after a failure
        calls.clear()
        r2 = await asyncio.wait_for(asyncio.gather(b.submit({"x": np.zeros((1, 2))}),
                                                   return_exceptions=True), T)
        assert isinstance(r2[0], ModelFailed)
    finally:
        await _stop(b)


async def test_batcher_recovers_after_failure():
    state = {"fail": True}

    def flaky(inputs):
        if state.pop("fail", False):
            raise RuntimeError("once")
        return {"y": inputs["x"] + 1}

    b = await _started(Batcher(flaky, max_batch_size=4, max_wait_s=0.0))
    try:
        with pytest.raises(ModelFailed):
            await asyncio.wait_for(b.submit({"x": np.zeros((1,))}), T)
        out, _ = await asyncio.wait_for(b.submit({"x": np.zeros((1,))}), T)
        np.testing.assert_array_equal(out["y"], [1.0])
    finally:
        await _stop(b)


async def test_submit_rejects_mismatched_batch_dims():
    b = Batcher(Recorder(), max_batch_size=4, max_wait_s=0.0)
    with pytest.raises(FlashpointError):
        await asyncio.wait_for(b.submit({"x": np.zeros((2, 1)), "z": np.zeros((3, 1))}), T)
    with pytest.raises(FlashpointError):
        await asyncio.wait_for(b.submit({"x": np.float32(1.0).reshape(())}), T)
    await _stop(b)


async def test_stop_fails_queued_requests_with_unavailable():
    gate = threading.Event()
    rec = Recorder(gate)
    b = await _started(Batcher(rec, max_batch_size=1, max_wait_s=0.0))
    first = asyncio.ensure_future(b.submit({"x": np.zeros((1, 2))}))
    try:
        # wait until the first batch occupies the model thread
        for _ in range(200):
            if rec.started.is_set():
                break
            await asyncio.sleep(0.005)
        assert rec.started.is_set()
        queued = [asyncio.ensure_future(b.submit({"x": np.zeros((1, 2))})) for _ in range(3)]
        await asyncio.sleep(0.01)
        await _stop(b)
        results = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), T)
        assert all(isinstance(r, Unavailable) for r in results), results
        assert all(r.retryable for r in results)
    finally:
        gate.set()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_stop_before_start_fails_queued():
    b = Batcher(Recorder(), max_batch_size=4, max_wait_s=0.0)
    t = asyncio.ensure_future(b.submit({"x": np.zeros((1, 2))}))
    await asyncio.sleep(0)
    assert b.depth == 1
    await _stop(b)
    with pytest.raises(Unavailable):
        await asyncio.wait_for(t, T)


async def test_stop_resolves_requests_already_gathered_into_a_batch():
    """BUG: requests taken off the queue into a batch being gathered are never resolved by stop().

    With a long max_wait_s the loop holds dequeued items in its local ``batch`` list; stop()
    cancels the loop and only drains ``_queue``, so these submitters wait forever.
    """
    b = await _started(Batcher(Recorder(), max_batch_size=100, max_wait_s=30.0))
    tasks = [asyncio.ensure_future(b.submit({"x": np.zeros((1, 2))})) for _ in range(3)]
    await asyncio.sleep(0.05)  # the loop dequeues them and waits for more
    await _stop(b)
    try:
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 0.5)
    except TimeoutError:
        pytest.fail("stop() left requests of the batch being gathered unresolved (hang)")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, Unavailable) for r in results), results


async def test_stop_resolves_held_request():
    """BUG: the request parked in ``_held`` (did not fit the previous batch) is lost by stop()."""
    gate = threading.Event()
    rec = Recorder(gate)
    b = await _started(Batcher(rec, max_batch_size=4, max_wait_s=0.05))
    a = asyncio.ensure_future(b.submit({"x": np.zeros((1, 2))}))
    held = asyncio.ensure_future(b.submit({"x": np.zeros((1, 3))}))  # other signature: held
    try:
        for _ in range(200):
            if rec.started.is_set():
                break
            await asyncio.sleep(0.005)
        assert rec.started.is_set()
        assert b.depth == 1  # the held one
        await _stop(b)
        try:
            res = await asyncio.wait_for(asyncio.gather(held, return_exceptions=True), 0.5)
        except TimeoutError:
            pytest.fail("stop() never resolved the held request (hang)")
        assert isinstance(res[0], Unavailable)
    finally:
        gate.set()
        for t in (a, held):
            t.cancel()
        await asyncio.gather(a, held, return_exceptions=True)


async def test_idle_fast_model_runs_inline_without_the_batching_loop():
    rec = Recorder()
    b = Batcher(rec, max_batch_size=8, max_wait_s=0.0)  # never started: only inline can answer
    b._ewma_run_s = 0.0  # measured fast
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    out, timings = await asyncio.wait_for(b.submit({"x": x}), T)
    np.testing.assert_array_equal(out["y"], x * 2)
    assert timings["batch_rows"] == 2.0 and timings["batch_wait"] == 0.0
    assert b.batches_run == 1 and rec.sizes == [2]
    await _stop(b)


async def test_requests_of_one_frame_are_batched_not_run_inline():
    rec = Recorder()
    b = await _started(Batcher(rec, max_batch_size=8, max_wait_s=0.0))
    b._ewma_run_s = 0.0
    xs = [np.full((1, 2), i, dtype=np.float32) for i in range(4)]
    outs = await asyncio.wait_for(
        asyncio.gather(*(b.submit({"x": x}, alone=False) for x in xs)), T)
    assert rec.sizes == [4]  # one model call for the frame
    for x, (out, _) in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(out["y"], x * 2)
    await _stop(b)


async def test_inline_model_error_is_a_model_failure():
    def boom(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ValueError("bad weights")

    b = Batcher(boom, max_batch_size=8, max_wait_s=0.0)
    b._ewma_run_s = 0.0
    with pytest.raises(ModelFailed, match="ValueError: bad weights"):
        await asyncio.wait_for(b.submit({"x": np.zeros((1, 2), np.float32)}), T)
    await _stop(b)


async def test_strict_requests_are_batched_before_best_effort_ones():
    gate = threading.Event()
    rec = Recorder(gate)
    b = await _started(Batcher(rec, max_batch_size=2, max_wait_s=0.0))
    try:
        first = asyncio.ensure_future(b.submit({"x": np.zeros((2, 1), np.float32)}))
        await asyncio.wait_for(asyncio.to_thread(rec.started.wait, 2.0), T)  # model busy
        order: list[str] = []

        async def one(tag: str, value: float, best_effort: bool) -> None:
            await b.submit({"x": np.full((1, 1), value, np.float32)}, best_effort=best_effort)
            order.append(tag)

        tasks = [asyncio.ensure_future(one("be1", 1, True)),
                 asyncio.ensure_future(one("be2", 2, True)),
                 asyncio.ensure_future(one("s1", 3, False)),
                 asyncio.ensure_future(one("s2", 4, False))]
        await asyncio.sleep(0.05)  # all four queued behind the running batch
        assert b.depth == 4
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *tasks), T)
        assert order[:2] == ["s1", "s2"] and sorted(order[2:]) == ["be1", "be2"]
        assert rec.sizes == [2, 2, 2]
    finally:
        gate.set()
        await _stop(b)


async def test_padded_inputs_of_different_lengths_share_a_batch():
    """Token ids of different lengths batch together, padded on the right with their pad
    value (the mask with 0); each request gets its own rows back."""
    seen: list[dict[str, np.ndarray]] = []

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(inputs)
        return {"n": inputs["mask"].sum(axis=1, keepdims=True)}

    b = await _started(Batcher(run, max_batch_size=8, max_wait_s=0.2,
                               pad_values={"ids": 7, "mask": 0}))
    try:
        reqs = [{"ids": np.full((1, n), 1, np.int64), "mask": np.ones((1, n), np.int64)}
                for n in (3, 5, 2)]
        outs = await asyncio.wait_for(asyncio.gather(*(b.submit(r, alone=False) for r in reqs)), T)
    finally:
        await _stop(b)
    assert len(seen) == 1 and seen[0]["ids"].shape == (3, 5)
    np.testing.assert_array_equal(seen[0]["ids"][2], [1, 1, 7, 7, 7])
    np.testing.assert_array_equal(seen[0]["mask"][0], [1, 1, 1, 0, 0])
    assert [int(o["n"][0, 0]) for o, _ in outs] == [3, 5, 2]


async def test_unpadded_inputs_of_different_lengths_do_not_share_a_batch():
    sizes: list[tuple[int, ...]] = []

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sizes.append(inputs["x"].shape)
        return {"y": inputs["x"]}

    b = await _started(Batcher(run, max_batch_size=8, max_wait_s=0.05))
    try:
        reqs = [{"x": np.zeros((1, n), np.float32)} for n in (3, 5)]
        await asyncio.wait_for(asyncio.gather(*(b.submit(r, alone=False) for r in reqs)), T)
    finally:
        await _stop(b)
    assert sorted(sizes) == [(1, 3), (1, 5)]
