"""Partitioned cold start for generation (issue 21 item 6) in a real local cluster: a GPT-2
(and a Llama) causal LM pushed with ``--profile`` scales from zero as a pipeline of k = 2 stages on two
hosts; a streamed greedy generation gets its first tokens from the pipeline while the hosts
are kept from completing the model (the registry's reads wait at a gate); once the gate
opens the stages complete into whole replicas, the sequence moves to one of them (item 5's
hand-off) and goes on there. Its token ids and text equal ``transformers``' own greedy
``generate`` in this process, no chunk is lost or repeated, and a new sequence goes to a
whole replica once the pipeline has dissolved."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashpoint.controller.state.records import GroupPhase, ReplicaPhase
from flashpoint.gateway.backend import InvokeResult, StreamChunk
from flashpoint.models.sources import PushOptions, publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.registry.local import LocalStore
from flashpoint.spec import FunctionSpec
from flashpoint.testing.harness import ClusterFactory, cluster_config, wait_for

from .conftest import greedy_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

CHUNK = 256 * 1024
PROMPT = "a spot eviction drains the host"
MAX_TOKENS = 200
FUNCTION = "genpart-llm"  # a name no other test uses (the controller's counters are global)


class GatedStore(LocalStore):
    """Ranged reads wait while ``gate`` is clear: the test holds the hosts' completion of
    the model (the rest of its bytes) until the pipeline has served tokens."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = 0  # reads that waited at the gate

    async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
        if not self.gate.is_set():
            self.held += 1
            await self.gate.wait()
        return await super().read_range(name, version, start, end)


def _inputs() -> dict[str, np.ndarray]:
    return {"text": np.array([PROMPT.encode()], dtype=object),
            "max_tokens": np.array([MAX_TOKENS], dtype=np.int64),
            "temperature": np.array([0.0], dtype=np.float32)}


@dataclasses.dataclass
class _Stream:
    chunks: list[StreamChunk] = dataclasses.field(default_factory=list)
    result: InvokeResult | None = None


async def _stream(ctl: Any, request_id: str, s: _Stream) -> None:
    async for item in ctl.invoke_stream(FUNCTION, _inputs(), request_id=request_id,
                                        timeout_s=150):
        if isinstance(item, StreamChunk):
            s.chunks.append(item)
        else:
            s.result = item


@pytest.mark.parametrize("family", ["gpt2", "llama"])
async def test_a_cold_generation_starts_in_a_pipeline_and_moves_to_a_whole_replica(
        make_cluster: ClusterFactory, tmp_path: Path, family: str) -> None:
    cfg = cluster_config(tmp_path, registry_span_bytes=CHUNK, completion_hold_s=300.0)
    # A slow modelled link: the solver prefers two stages to one whole cold start.
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, partition_bandwidth_bps=2e6, partition_overhead_s=0.0))
    source = make_causal_lm(tmp_path / "src", family=family, size="small", seed=2)
    want_ids, want_text = greedy_reference(source, PROMPT, MAX_TOKENS)
    assert len(want_ids) == MAX_TOKENS  # no EOS: the stream lasts
    store = GatedStore(cfg.registry.root)
    await publish_source(store, "lm", source, chunk_size=CHUNK,
                         options=PushOptions(profile=True))
    c = await make_cluster(hosts=2, models=(), config=cfg, store=store, start_timeout_s=90)
    ctl = c.controller
    await ctl.register_function(FunctionSpec(
        name=FUNCTION, model="lm", max_stages=2, min_replicas=2, max_replicas=2,
        replica_concurrency=4, keep_alive_s=300))
    await wait_for("a group is planned", lambda: bool(ctl.state.groups), 30)
    (group,) = ctl.state.groups.values()
    gid, stages = group.group_id, list(group.stages)
    assert len(stages) == 2
    await wait_for("the pipeline serves", lambda: group.phase == GroupPhase.SERVING, 90,
                   state=ctl.cluster_status)
    # Both stages hold their byte ranges (the last one the tokenizer too); the rest of the
    # model waits for the first answer (stage_hold.py), then at the gate.
    store.gate.clear()
    first = _Stream()
    task = asyncio.ensure_future(_stream(ctl, f"genpart-{family}-1", first))
    try:
        await wait_for("tokens from the pipeline", lambda: len(first.chunks) >= 3, 60)
        assert ctl.dispatcher.inflight_of(gid) == 1  # the group runs the sequence
        assert all(ctl.state.replicas[r].phase == ReplicaPhase.STARTING for r in stages)
        assert first.result is None
        store.gate.set()
        async with asyncio.timeout(150):
            await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert store.held > 0  # completion did wait for the gate

    result = first.result
    assert result is not None
    assert [ch.index for ch in first.chunks] == list(range(MAX_TOKENS))  # none lost or repeated
    assert [ch.token_id for ch in first.chunks] == want_ids
    assert "".join(ch.text for ch in first.chunks) == want_text
    assert result.outputs["token_ids"].tolist() == want_ids
    assert result.outputs["text"].reshape(-1)[0].decode() == want_text
    assert int(result.outputs["completion_tokens"].reshape(-1)[0]) == MAX_TOKENS
    # it moved once, from the pipeline to a whole replica (a completed stage), mid-stream
    t = result.timings_s
    assert t.get("migrations") == 1, t
    assert 3 <= t["migrated_at"] < MAX_TOKENS, t
    assert result.replica_id in stages, result.replica_id

    await wait_for("the pipeline dissolved", lambda: gid not in ctl.state.groups, 30)
    second = _Stream()
    await asyncio.wait_for(_stream(ctl, f"genpart-{family}-2", second), 120)
    assert second.result is not None and second.result.replica_id in stages
    assert not second.result.timings_s.get("migrations")
    assert [ch.token_id for ch in second.chunks] == want_ids
