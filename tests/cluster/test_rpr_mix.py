"""RPR's configuration mix end to end on fake GPUs: a controller with the ``rpr`` autoscaler
and FaST placement, a host with two fake A100s sharing by time tokens (the hook preloaded
into real warm-pool workers that compute on the CPU), and a function registered with a
FaST profile. Under a steady load the replicas started have the (SM share, quota) shapes
Algorithm 1 picks for that load, each host-side share is the one the controller chose, and
when the load drops the lowest-RPR replica goes first although it is not the newest.

The expected shapes are worked out by hand from the grid below (not from our policy code):
the load is held well inside each decision's band, so the smoothed rate's noise and a
loaded machine's pace change no decision."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from flashpoint.controller.state.records import ReplicaPhase
from flashpoint.testing.harness import ClusterFactory, wait_for

pytestmark = pytest.mark.timeout(240)

FN = "rpr-mix-fn"  # the controller's counters are process-wide: a name no other test uses
# (sm_share, quota, throughput_rps, p99_latency_s); RPR = T / (S*Q):
#   s50-q50   1.0 / 0.25 = 4   the least throughput
#   s50-q100  4.0 / 0.5  = 8   p_eff
#   s100-q50  1.5 / 0.5  = 3
#   s100-q100 6.0 / 1.0  = 6
# So the replica that covers a rest most tightly (Algorithm 1's p_ideal) is s50-q50 for a
# rest up to 1 rps, s100-q50 up to 1.5, s50-q100 up to 4.
GRID = [(0.5, 0.5, 1.0, 0.05), (0.5, 1.0, 4.0, 0.03), (1.0, 0.5, 1.5, 0.04),
        (1.0, 1.0, 6.0, 0.02)]
SMALL, EFF = (0.5, 0.5), (0.5, 1.0)
# The smoothed λ (time constant 5 s) climbs to each rate; a scale-up happens once wanted
# for 12 s, so λ is near its level when it does.
# Phase 1, λ → 4.5 over one s50-q100 (4): a rest under 1 -> s50-q50.
# Phase 2, λ → 8.7 over 5: the decision sees λ ≈ 8.4, a rest in (1.5, 4] -> s50-q100.
# Held there, 9 rps serve 8.7 and s50-q50 cannot go (8 < 8.7) nor is more needed.
# The drop: at λ ≤ 8 the s50-q50 replica (RPR 4 against 8) goes, 2 s later (λ ≈ 5.4,
# where both s50-q100s are still needed); it is not the newest replica.
PHASE1_RPS, PHASE2_RPS = 4.5, 8.7
PARAMS = {"scale_up_delay_s": 12.0, "scale_down_delay_s": 2.0}


class Load:
    """Requests at ``rate_rps`` (changeable while it runs), each in its own task; a late
    start is made up at once, so the average rate holds on a loaded machine. Bounded in
    count and time."""

    def __init__(self, client, rate_rps: float, max_s: float) -> None:
        self.client, self.rate_rps, self.max_s = client, rate_rps, max_s
        self.sent = self.failed = 0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        start = due = time.monotonic()
        x = {"x": np.ones((1, 2), np.float32)}
        while due - start < self.max_s:
            try:
                await asyncio.wait_for(self._stop.wait(), max(0.0, due - time.monotonic()))
                return  # stopped
            except TimeoutError:
                pass
            t = asyncio.create_task(self._one(x))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            due += 1.0 / self.rate_rps

    async def _one(self, x) -> None:
        self.sent += 1
        try:
            await self.client.invoke(FN, x, timeout_s=30)
        except Exception:  # counted: the test asserts none failed
            self.failed += 1

    async def stop(self, runner: asyncio.Task) -> None:
        self._stop.set()
        await asyncio.wait_for(runner, 10)
        if self._tasks:
            await asyncio.wait_for(asyncio.gather(*self._tasks), 60)


def shapes(state) -> dict[str, tuple[float, float]]:
    return {r.replica_id: (r.share.sm_share, r.share.time_request)
            for r in state.replicas_of(FN) if r.share is not None}


async def test_rpr_mix_shapes_replicas_and_drops_the_lowest_rpr_first(
        make_cluster: ClusterFactory, tmp_path):
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("the hook needs a C compiler")
    run_dir = Path(f"/tmp/fpr-{os.getpid()}-{time.monotonic_ns() % 10**8}")
    c = await make_cluster(
        host={"fake_gpus": ["A100-40GB", "A100-40GB"], "gpu_sharing": "tokens",
              "sharing_dir": str(run_dir), "warm_pool_size": 3},
        controller={"autoscaler": "rpr", "autoscaler_params": PARAMS,
                    "share_policy": "fastgshare"})
    st, host = c.controller.state, c.hosts[0]
    load: Load | None = None
    runner: asyncio.Task | None = None  # load.run()

    def seen() -> str:
        fn = st.functions.get(FN)
        reps = [(r.replica_id, str(r.phase), shapes(st).get(r.replica_id))
                for r in st.replicas_of(FN)]
        return (f"reason={fn.reason if fn else None} desired={fn.desired if fn else None} "
                f"replicas={reps}")

    def warm(n: int) -> bool:
        return sum(r.phase == ReplicaPhase.WARM for r in st.replicas_of(FN)) == n

    try:
        async with c.client() as client:
            await client.deploy(
                FN, "noop", min_replicas=1, max_replicas=6, slo_ms=100, keep_alive_s=600,
                gpu_memory_bytes=1 << 30, fast_profile={"batch": 1, "points": [
                    {"sm_share": s, "quota": q, "throughput_rps": t, "p99_latency_s": p}
                    for s, q, t, p in GRID]})
            await wait_for("min_replicas: one warm replica", lambda: warm(1), 90, seen)
            (first,) = shapes(st).values()
            assert first == EFF  # before any load: p_eff

            load = Load(client, PHASE1_RPS, 150)
            runner = asyncio.create_task(load.run())
            await wait_for("phase 1: two replicas", lambda: len(st.replicas_of(FN)) == 2,
                           90, seen)
            assert sorted(shapes(st).values()) == sorted([EFF, SMALL]), seen()
            small = next(r for r, s in shapes(st).items() if s == SMALL)
            await wait_for("phase 1: both warm", lambda: warm(2), 90, seen)

            load.rate_rps = PHASE2_RPS
            await wait_for("phase 2: three replicas", lambda: len(st.replicas_of(FN)) == 3,
                           90, seen)
            assert sorted(shapes(st).values()) == sorted([EFF, SMALL, EFF]), seen()
            await wait_for("phase 2: all warm", lambda: warm(3), 90, seen)

            # each host-side share is the one the controller chose: the token manager of
            # the replica's GPU holds its quota and SM share
            for rid, (sm, quota) in shapes(st).items():
                rep = st.replicas[rid]
                rt = host.replicas[rid]
                unit = host.gpu.sharing.units[rep.device_id]
                q = unit.manager.state.quota(int(rt.env["FP_HOOK_TENANT"]))
                assert (q.request, q.limit, q.sm_share) == (quota, quota, sm)
            # status shows each replica's shape
            status = await client.status()
            listed = {r["replica_id"]: (r["config"], r["share"]["sm_share"],
                                        r["share"]["time_request"])
                      for r in status["replicas"] if r["function"] == FN}
            assert sorted(listed.values()) == sorted([
                ("s50-q100", *EFF), ("s50-q50", *SMALL), ("s50-q100", *EFF)])

            # the drop: the lowest-RPR replica (not the newest) is the first to go
            await load.stop(runner)
            runner = None
            assert load.failed == 0, f"{load.failed} of {load.sent} requests failed"
            others = [r for r in shapes(st) if r != small]
            await wait_for("the drop: a replica retired", lambda: len(
                [r for r in st.replicas_of(FN) if r.phase == ReplicaPhase.WARM]) < 3, 60, seen)
            assert small not in st.replicas or st.replicas[small].phase != ReplicaPhase.WARM
            assert all(st.replicas[r].phase == ReplicaPhase.WARM for r in others), seen()
    finally:
        if load is not None and runner is not None:
            await load.stop(runner)
        await asyncio.wait_for(c.stop(), 60)
        shutil.rmtree(run_dir, ignore_errors=True)
