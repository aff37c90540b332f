"""Live-migration gap (issue 21 items 5 and 7): how long a stream waits when its sequence
moves to another replica, against the target gap <= the destination's prefill time + 2 TPOT.

A local cluster (controller and two host managers in this process, worker processes) serves
a random causal LM (``make_causal_lm``, ``--size small`` by default: 256 positions) from two
replicas, one per host; host1 is a spot host. ``--streams`` greedy streams start together
(split over both replicas by dispatch); once every stream has ``--after`` tokens, host1 gets
an eviction notice, its replica is retired and its sequences move to host0's replica. Per
moved stream:

- ``gap``: the result's ``migration_gap`` -- from the source's last chunk to the
  destination's first, as the controller relayed them;
- ``tpot``: the median time between the stream's chunks (as this process received them),
  over the whole stream;
- ``prefill``: the destination's own prefill of the moved sequence (prompt + tokens so far):
  with a multi-round move (the default, ``migration_park_wait_s`` > 0) the pass that parked
  it ahead, outside the gap (its reply's ``park_prefill``), else the prefill inside the gap
  (``resume_prefill``); beside the same forward pass timed in this process on one torch
  thread, warm, median of 5 (``prefill_here``);
- ``extend``: a parked sequence's pass on resume (the tokens the source generated after the
  park), inside the gap (``resume_prefill``; 0 when not parked);
- target: ``gap <= prefill + 2 * tpot``; ``met_here`` counts the stricter
  ``gap <= prefill_here + 2 * tpot``.

``--park-wait 0`` turns the multi-round move off (the single-round move: the destination
prefills inside the gap), to compare the two on one machine back to back;
``--park-min-tokens`` sets ``controller.migration_park_min_tokens`` (a sequence moving alone
is parked only from that many tokens on).

The eviction's other consequences are off unless ``--replace``: the controller's host
provider (which starts a replacement spot host in this process) and room for a third
replica on host0 (``device_memory_bytes`` fits one). In a real cluster the replacement host
and its replica's cold start run on other machines; here every process shares this VM's
cores, and a replacement's interpreter start and warm-up (~1-2 s of CPU) would run on the
destination's cores during the move and be measured as part of its gap.

Every stream's ids are checked against ``transformers``' greedy ``generate``. ``--trials``
clusters are started in turn (a drained host is gone). Prints a line per moved stream and a
JSON line at the end.

    python bench/migration.py [--streams 2 16] [--trials 2] [--size small] [--replace]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = ("the cluster scales", "a cold start fetches bytes from a peer", "gpus are shared",
           "a spot eviction drains")


@dataclasses.dataclass
class _Stream:
    prompt: str
    arrived_s: list[float] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    result: Any = None


def _prefill_s(model: Any, ids: list[int]) -> float:
    import torch

    x = torch.tensor([ids])
    times = []
    with torch.inference_mode():
        for _ in range(6):
            t = time.perf_counter()
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


async def _trial(model_dir: Path, streams_n: int, after: int, max_tokens: int,
                 refs: dict[str, list[int]], tok: Any, model: Any, park_wait_s: float,
                 park_min_tokens: int | None, replace: bool) -> list[dict[str, float]]:
    from flashpoint.cluster import LocalCluster
    from flashpoint.config import load_config
    from flashpoint.gateway.backend import StreamChunk
    from flashpoint.models.sources import publish_source
    from flashpoint.registry import make_store
    from flashpoint.spec import FunctionSpec

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        controller: dict[str, Any] = {
            "listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05,
            "drain_margin_s": 120.0, "migration_park_wait_s": park_wait_s}
        if park_min_tokens is not None:
            controller["migration_park_min_tokens"] = park_min_tokens
        host: dict[str, Any] = {"cpu_devices": 1, "warm_pool_size": 1,
                                "heartbeat_interval_s": 0.3, "cache_dir": str(tmp / "cache")}
        if not replace:  # one replica per device: the model (16 MB) + 64 MB overhead fits once
            host["device_memory_bytes"] = 120 << 20
        cfg = load_config(overrides={"log_level": "WARNING", "controller": controller,
                                     "host": host}).with_home(tmp)
        store = make_store(cfg)
        await publish_source(store, "lm", model_dir)
        c = LocalCluster(cfg, hosts=0, store=store)
        if not replace:
            c.controller.provider = None  # no replacement host (module docstring)
        await asyncio.wait_for(c.start(), 90)
        notice = tmp / "evict"
        try:
            await c.add_host(kind="ondemand")
            await c.add_host(kind="spot", spot_notice=f"file:{notice}", spot_poll_interval_s=0.05)
            ctl = c.controller
            await ctl.register_function(FunctionSpec(
                name="llm", model="lm", max_batch_size=16, replica_concurrency=16,
                keep_alive_s=300, min_replicas=2, max_replicas=2))
            deadline = time.monotonic() + 120
            while sum(r.phase == "warm" and r.replica_id in ctl.workers
                      for r in ctl.state.replicas.values()) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("two replicas did not warm")
                await asyncio.sleep(0.05)
            hosts = {r.host_id for r in ctl.state.replicas.values()}
            if hosts != {"host0", "host1"}:
                raise RuntimeError(f"replicas not one per host: {hosts}")
            streams = [_Stream(PROMPTS[i % len(PROMPTS)]) for i in range(streams_n)]

            async def run(i: int, s: _Stream) -> None:
                inputs = {"text": np.array([s.prompt.encode()], dtype=object),
                          "max_tokens": np.array([max_tokens], dtype=np.int64),
                          "temperature": np.array([0.0], dtype=np.float32)}
                async for item in ctl.invoke_stream("llm", inputs, request_id=f"b{i}",
                                                    timeout_s=120):
                    if isinstance(item, StreamChunk):
                        s.arrived_s.append(time.monotonic())
                        s.ids.append(item.token_id)
                    else:
                        s.result = item

            tasks = [asyncio.ensure_future(run(i, s)) for i, s in enumerate(streams)]
            deadline = time.monotonic() + 60
            while not all(len(s.ids) >= after for s in streams):
                if time.monotonic() > deadline or any(t.done() for t in tasks):
                    raise RuntimeError("streams did not get under way")
                await asyncio.sleep(0.005)
            notice.write_text(json.dumps({"action": "terminate", "seconds": 120}))
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        finally:
            await asyncio.wait_for(c.stop(), 60)
    rows = []
    for s in streams:
        if s.ids != refs[s.prompt]:
            raise AssertionError(f"stream of {s.prompt!r} differs from generate")
        t = s.result.timings_s
        if not t.get("migrations"):
            continue
        gap = t["migration_gap"]
        tpot = statistics.median(b - a for a, b in zip(s.arrived_s, s.arrived_s[1:], strict=False))
        moved_at = int(t["migrated_at"])
        prompt_ids = tok(s.prompt).input_ids
        # the destination's own prefill of this sequence (its reply's timings), and the
        # same forward pass timed here, warm, for comparison
        parked = "park_prefill" in t
        prefill = t["park_prefill"] if parked else t.get("resume_prefill", 0.0)
        extend = t.get("resume_prefill", 0.0) if parked else 0.0
        local = _prefill_s(model, prompt_ids + s.ids[:moved_at])
        rows.append({"streams": streams_n, "gap_ms": gap * 1e3, "tpot_ms": tpot * 1e3,
                     "prefill_ms": prefill * 1e3, "prefill_here_ms": local * 1e3,
                     "extend_ms": extend * 1e3, "parked": parked,
                     "tokens_at_move": moved_at,
                     "target_ms": (prefill + 2 * tpot) * 1e3,
                     "met": gap <= prefill + 2 * tpot, "met_here": gap <= local + 2 * tpot})
    return rows


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv`` (this script's options), run the trials (a line per moved stream)
    and return the summary (``bench/generate.py --migration`` calls this too)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[2, 16])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--size", default="small")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--after", type=int, default=8, help="tokens of every stream before the move")
    # long enough that a stream still runs once its move's park rounds are done (they can
    # take until token ~100 at a quiet machine's TPOT; the model has 256 positions)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--park-wait", type=float, default=2.0,
                    help="controller.migration_park_wait_s (0: single-round moves)")
    ap.add_argument("--park-min-tokens", type=int, default=None,
                    help="controller.migration_park_min_tokens (default: the config's)")
    ap.add_argument("--replace", action="store_true",
                    help="let the eviction start a replacement host and replica meanwhile")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashpoint.models.tiny_hf import make_causal_lm

    torch.set_num_threads(1)  # as a worker runs
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_causal_lm(Path(tmp) / "lm", family=args.family, size=args.size)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        refs = {}
        for p in PROMPTS:
            ids = tok(p).input_ids
            refs[p] = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens,
                                     do_sample=False, pad_token_id=tok.pad_token_id
                                     )[0, len(ids):].tolist()
        rows: list[dict[str, Any]] = []
        for n in args.streams:
            for trial in range(args.trials):
                got = asyncio.run(_trial(model_dir, n, args.after, args.max_tokens, refs, tok,
                                         model, args.park_wait, args.park_min_tokens,
                                         args.replace))
                for r in got:
                    print(f"streams={n} trial={trial} moved_at={r['tokens_at_move']} "
                          f"gap={r['gap_ms']:.1f}ms prefill={r['prefill_ms']:.1f}ms "
                          f"(here {r['prefill_here_ms']:.1f}ms) "
                          f"extend={r['extend_ms']:.1f}ms parked={r['parked']} "
                          f"tpot={r['tpot_ms']:.1f}ms target<={r['target_ms']:.1f}ms "
                          f"{'met' if r['met'] else 'MISSED'}", flush=True)
                rows += [dict(r, trial=trial) for r in got]
    summary: dict[str, Any] = {"bench": "migration", "size": args.size, "family": args.family,
                               "park_wait_s": args.park_wait,
                               "park_min_tokens": args.park_min_tokens,
                               "replace": args.replace}
    for n in args.streams:
        mine = [r for r in rows if r["streams"] == n]
        if mine:
            summary[f"streams_{n}"] = {
                "moved": len(mine),
                "gap_ms_p50": round(statistics.median(r["gap_ms"] for r in mine), 2),
                "gap_ms_max": round(max(r["gap_ms"] for r in mine), 2),
                "prefill_ms_p50": round(statistics.median(r["prefill_ms"] for r in mine), 2),
                "tpot_ms_p50": round(statistics.median(r["tpot_ms"] for r in mine), 2),
                "extend_ms_p50": round(statistics.median(r["extend_ms"] for r in mine), 2),
                "parked": sum(r["parked"] for r in mine),
                "met": sum(r["met"] for r in mine),
                "met_here": sum(r["met_here"] for r in mine)}
    return summary


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
