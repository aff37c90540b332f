"""The measured part of the peer benchmark; runs inside the loopback-only namespace.

Order: the big model's single-request service time (which sets the burst's rate), the bare
aiohttp floor, Flashpoint (``flashpoint up`` as a process of its own, ``fp_up.py``), Ray
Serve, BentoML, the floor again. One platform runs at a time; the load always comes from a
separate process (``load.py``), never this event loop, and no platform runs in this process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: the floor server of bench/invoke.py

import artifacts  # noqa: E402
import load  # noqa: E402
import report  # noqa: E402
from fp_up import FlashpointUp  # noqa: E402
from platforms import BentoServer, PeerError, RayServe  # noqa: E402

TEXT = "a cold start fetches the model bytes from a peer and the cluster scales to zero"
CHECK_ROWS = 4
BURST_MODEL = "big"
# The burst's offered load in replicas' worth of work: rate x the big model's single-request
# service time (measured in this run). At 3.5, three replicas each serving one request at a
# time cannot keep up (117% busy) while four can (88%), whatever the machine: every platform
# needs its 4th replica, with margin. On a machine with fewer cores than four replicas need,
# the rate is also beyond what its CPUs can serve, and requests queue (RESULTS.md says so).
BURST_OFFERED_REPLICAS = 3.5
BURST_MAX_RATE_HZ = 400.0  # bounds the request count where the model is very fast
POOL_TIMEOUT_S = 120.0


class AnswerMismatch(AssertionError):
    """A platform's answer for the small model differs from the in-process torch reference."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much of each workload to run."""

    requests: int  # per warm point
    max_s: float  # per warm point
    cold_repeats: int
    burst_s: float  # the burst's rate comes from the service time (BURST_OFFERED_REPLICAS)

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(requests=300, max_s=8.0, cold_repeats=1, burst_s=5)
        # A burst, not a siege: where the machine cannot serve 3.5 replicas' worth (fewer
        # cores, or memory bandwidth, than that), the backlog, and so the wait, grows with
        # the burst's length; 5 s keeps the last answer within the requests' 60 s timeout.
        return cls(requests=2000, max_s=30.0, cold_repeats=3, burst_s=5)


def service_time_s(path: Path, x: np.ndarray, runs: int = 15, warmup: int = 3) -> float:
    """Median wall time of one forward of the TorchScript model at ``path`` on ``x`` with one
    torch thread (as every platform's replicas run), in this process before any platform."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = torch.jit.load(str(path)).eval()
        inp = torch.from_numpy(x)
        times = []
        with torch.inference_mode():
            for i in range(warmup + runs):
                t = time.perf_counter()
                model(inp)
                if i >= warmup:
                    times.append(time.perf_counter() - t)
        del model
        return float(np.median(times))
    finally:
        torch.set_num_threads(threads)


def tensor_body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": {"x": {"data": x.reshape(-1).tolist(), "shape": list(x.shape),
                             "datatype": "FP32"}}}


def first_output(reply: Any) -> np.ndarray:
    """The first output of a JSON tensor reply (``{"outputs": {name: {data, shape}}}``), or a
    bare nested list (BentoML's batched endpoint)."""
    if isinstance(reply, list):
        return np.asarray(reply, dtype=np.float32)
    out = next(iter(reply["outputs"].values()))
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


class Bench:
    def __init__(self, plan: Plan, arts: artifacts.Artifacts, envs: dict[str, Any],
                 logs: Path) -> None:
        self.plan, self.arts, self.envs, self.logs = plan, arts, envs, logs
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
        self.warm: list[dict[str, Any]] = []
        self.cold: list[dict[str, Any]] = []
        self.burst: list[dict[str, Any]] = []
        self.floor: dict[int, dict[str, Any]] = {}
        self.floor_after: dict[int, dict[str, Any]] = {}
        self.checks: list[dict[str, Any]] = []
        self.settings: dict[str, Any] = {}
        self.notes: list[str] = []
        self.ref = artifacts.reference_mlp()
        self.check_x = np.random.default_rng(7).standard_normal(
            (CHECK_ROWS, artifacts.MLP_IN)).astype(np.float32)
        self.big_x = np.random.default_rng(8).standard_normal(
            (1, artifacts.BIG_WIDTH)).astype(np.float32)
        self.burst_service_s = 0.0
        self.burst_rate_hz = 0.0

    def set_burst_rate(self) -> None:
        """The burst's rate for every platform: ``BURST_OFFERED_REPLICAS`` / the big model's
        single-request service time, measured here once before any platform runs."""
        self.burst_service_s = service_time_s(self.arts.big, self.big_x)
        self.burst_rate_hz = min(BURST_MAX_RATE_HZ,
                                 BURST_OFFERED_REPLICAS / self.burst_service_s)
        print(f"burst: {BURST_MODEL} serves one request in {self.burst_service_s * 1e3:.1f} ms "
              f"(one torch thread); rate {self.burst_rate_hz:.1f}/s = "
              f"{BURST_OFFERED_REPLICAS} replicas' worth, for {self.plan.burst_s:.0f}s",
              flush=True)

    async def burst_run(self, platform: str, url: str) -> None:
        """The open-loop burst from zero replicas against ``url`` (up to 4 replicas)."""
        res = await self.load("open_loop", url, tensor_body(self.big_x), self.burst_rate_hz,
                              self.plan.burst_s)
        self.burst.append({"platform": platform, "model": BURST_MODEL,
                           "service_s": self.burst_service_s,
                           "offered_replicas": BURST_OFFERED_REPLICAS, **res})
        _print_burst(platform, res)

    async def load(self, kind: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Run ``load.<kind>`` in the load process."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(load.run, kind, *args,
                                                                       **kwargs))

    # -- warm invoke ---------------------------------------------------------------------

    async def closed(self, platform: str, setting: str, workload: str, url: str, body: Any,
                     into: list[dict[str, Any]] | None = None) -> None:
        for conc in report.CONCURRENCIES:
            res = await self.load("closed_loop", url, body, conc, self.plan.requests,
                                  self.plan.max_s)
            row = {"platform": platform, "setting": setting, "workload": workload, **res}
            (into if into is not None else self.warm).append(row)
            print(f"{platform:10s} {setting:8s} {workload:8s} c={conc:<3d} ok={res['ok']:<6d} "
                  f"err={res['errors']:<4d} rps={res['rps']:9.1f} "
                  f"p50={_ms(res['p50_ms'])} p99={_ms(res['p99_ms'])}", flush=True)

    async def check_mlp(self, platform: str, setting: str, url: str,
                        body_of: Callable[[np.ndarray], Any]) -> None:
        """Send each check row alone and compare with the reference; raises AnswerMismatch."""
        with torch.inference_mode():
            want = self.ref(torch.from_numpy(self.check_x)).numpy()
        worst = 0.0
        for i in range(CHECK_ROWS):
            got = first_output((await self.load("one", url, body_of(self.check_x[i:i + 1]),
                                                60.0))["reply"])
            if got.shape != (1, artifacts.MLP_OUT) or not np.allclose(got, want[i:i + 1],
                                                                      rtol=1e-4, atol=1e-5):
                raise AnswerMismatch(f"{platform}/{setting}: row {i}: got {got.tolist()}, "
                                     f"reference {want[i:i + 1].tolist()}")
            worst = max(worst, float(np.abs(got - want[i:i + 1]).max()))
        self.checks.append({"platform": platform, "setting": setting, "rows": CHECK_ROWS,
                            "max_abs_diff": worst, "allclose": True})
        print(f"{platform:10s} {setting:8s} small model answers match the torch reference "
              f"(max |diff| {worst:.2e})", flush=True)

    async def floor_run(self, into: dict[int, dict[str, Any]]) -> None:
        from invoke import _echo_server  # the floor of bench/invoke.py

        runner, url = await _echo_server()
        rows: list[dict[str, Any]] = []
        try:
            await self.closed("floor", "aiohttp", "echo", url, tensor_body(self.check_x[:1]),
                              into=rows)
        finally:
            await runner.cleanup()
        into.update({r["concurrency"]: r for r in rows})

    # -- Flashpoint ----------------------------------------------------------------------

    async def flashpoint(self) -> None:
        home = Path(tempfile.mkdtemp(prefix="fp-peers-"))
        try:
            await self._flashpoint(home)
        finally:  # the registry holds ~1 GB of blobs
            shutil.rmtree(home, ignore_errors=True)

    async def _flashpoint(self, home: Path) -> None:
        from flashpoint.models.sources import PushOptions, publish, publish_source
        from flashpoint.registry.local import LocalStore
        from flashpoint.spec import TensorSpec

        # The registry `flashpoint up --home HOME` reads (ClusterConfig.with_home).
        store = LocalStore(home / "registry")
        t0 = time.perf_counter()
        await publish(store, "noop", preset="tiny", version="1", model_name="noop")
        for name, path, width in (("mlp", self.arts.mlp, artifacts.MLP_IN),
                                  ("big", self.arts.big, artifacts.BIG_WIDTH)):
            await publish_source(store, name, path, fmt="torchscript", options=PushOptions(
                inputs=(TensorSpec("x", "FP32", (-1, width)),)))
        await publish_source(store, "bert", self.arts.bert_dir)
        print(f"flashpoint: published noop, mlp, big, bert in {time.perf_counter() - t0:.1f}s",
              flush=True)
        big = self.arts.big_bytes
        # torch_threads 1: every platform's replicas run one torch thread (the peers' are
        # set so too), whatever share of the cores Flashpoint's default would give them.
        config = {"log_level": "WARNING", "controller": {"listen_port": 0},
                  "host": {"cpu_devices": 4, "warm_pool_size": 4, "torch_threads": 1,
                           "device_memory_bytes": 2 * big, "cache_bytes": 10 * big,
                           "host_memory_bytes": 20 * big, "metrics_listen": "127.0.0.1:0"}}
        warm_opts = {"keep_alive_s": 600, "min_replicas": 1, "max_replicas": 1,
                     "replica_concurrency": 64, "max_batch_size": 16}  # as bench/invoke.py
        cold_opts = {"keep_alive_s": 0.5, "max_replicas": 1}
        burst_opts = {"keep_alive_s": 600, "max_replicas": 4, "replica_concurrency": 1,
                      "max_batch_size": 1}
        self.settings["flashpoint"] = {
            "process": "`flashpoint --config FILE --home HOME up --hosts 1` (uvloop), "
                       "driven over its HTTP API", "config": config, "warm": warm_opts,
            "cold": cold_opts, "burst": burst_opts}
        specs = [{"name": fn, "model": "big" if fn == "burst" else fn, **opts}
                 for fn, opts in (("noop", warm_opts), ("mlp", warm_opts), ("big", cold_opts),
                                  ("bert", cold_opts), ("burst", burst_opts))]
        server = FlashpointUp(config, home, self.logs / "flashpoint.log")
        try:
            await server.start()
            await self._flashpoint_workloads(server, specs)
        finally:
            await server.stop()

    async def _flashpoint_workloads(self, server: FlashpointUp,
                                    specs: list[dict[str, Any]]) -> None:
        for spec in specs:
            await server.register(spec)
        url = f"{server.url}/v1/functions"
        await self.check_mlp("flashpoint", "default", f"{url}/mlp/invoke", tensor_body)
        for name in ("noop", "mlp"):  # warm, and the host's warm pool refilled
            await self.load("one", f"{url}/{name}/invoke", tensor_body(self.check_x[:1]))
        await server.wait_pool_ready(POOL_TIMEOUT_S)
        for name in ("noop", "mlp"):
            await self.closed("flashpoint", "default", name, f"{url}/{name}/invoke",
                              tensor_body(self.check_x[:1]))
        for model, body in (("big", tensor_body(self.big_x)), ("bert", {"text": TEXT})):
            walls, sources = [], []
            for i in range(self.plan.cold_repeats + 1):  # the first brings it into RAM
                await server.wait_no_replicas(model, 120)
                await server.wait_pool_ready(POOL_TIMEOUT_S)
                res = await self.load("one", f"{url}/{model}/invoke", body)
                reply = res["reply"]
                if not reply.get("cold"):
                    raise RuntimeError(f"flashpoint {model}: expected a scale from zero")
                print(f"flashpoint cold {model} #{i}: {res['wall_s']:.3f}s from "
                      f"{reply.get('cold_start_source')}", flush=True)
                if i > 0:
                    walls.append(res["wall_s"])
                    sources.append(str(reply.get("cold_start_source")))
            self.cold.append({"platform": "flashpoint", "model": model, "walls_s": walls,
                              "wall_s": report.median_or_none(walls),
                              "source": f"host RAM cache ({', '.join(sorted(set(sources)))})"
                              f"; first run from the local registry not counted"})
        await server.wait_pool_ready(POOL_TIMEOUT_S)
        await self.burst_run("flashpoint", f"{url}/burst/invoke")

    # -- Ray Serve -----------------------------------------------------------------------

    async def ray(self) -> None:
        from ray_settings import SETTINGS

        env = self.envs["ray"]
        self.settings["ray"] = {"deployments": SETTINGS, "ray.init": {"num_cpus": 8},
                                "batch_for_tuned_model": {"max_batch_size": 16,
                                                          "batch_wait_timeout_s": 0.002}}
        peer = RayServe(Path(env["python"]), self.logs / "ray.log")
        try:
            await peer.start()
            for setting in ("default", "tuned"):
                for name in ("noop", "mlp"):
                    await peer.command(cmd="deploy", app=f"{name}_{setting}", model=name,
                                       setting=setting, path=str(self.arts.mlp))
                await self.check_mlp("ray", setting, peer.url(f"mlp_{setting}"), tensor_body)
                for name in ("noop", "mlp"):
                    await self.closed("ray", setting, name, peer.url(f"{name}_{setting}"),
                                      tensor_body(self.check_x[:1]))
                for name in ("noop", "mlp"):
                    await peer.command(cmd="delete", app=f"{name}_{setting}")
            for model, path, body in (("big", self.arts.big, tensor_body(self.big_x)),
                                      ("bert", self.arts.bert_dir,
                                       {"inputs": {"text": [TEXT]}})):
                artifacts.warm_page_cache(path)
                await peer.command(cmd="deploy", app=f"cold_{model}", model=model,
                                   setting="cold", path=str(path))
                walls = []
                for i in range(self.plan.cold_repeats):
                    await peer.wait_replicas(f"cold_{model}", 0, 180)
                    res = await self.load("one", peer.url(f"cold_{model}"), body)
                    walls.append(res["wall_s"])
                    print(f"ray        cold {model} #{i}: {res['wall_s']:.3f}s", flush=True)
                await peer.command(cmd="delete", app=f"cold_{model}")
                self.cold.append({"platform": "ray", "model": model, "walls_s": walls,
                                  "wall_s": report.median_or_none(walls),
                                  "source": "local disk, page cache warm; autoscaling "
                                            "min_replicas=0"})
            await peer.command(cmd="deploy", app="burst", model=BURST_MODEL, setting="burst",
                               path=str(self.arts.big))
            await self.burst_run("ray", peer.url("burst"))
        finally:
            self.settings["ray"]["version"] = peer.version
            await peer.stop()

    # -- BentoML -------------------------------------------------------------------------

    async def bentoml(self) -> None:
        env = self.envs["bentoml"]
        python = Path(env["python"])
        home = self.logs / "bentoml-home"
        tuned = {"workers": 2, "batch": True}
        self.settings["bentoml"] = {
            "default": "bentoml serve, service defaults (workers=1), sync endpoints",
            "tuned": {**tuned, "mlp_batched": {"batchable": True, "max_batch_size": 16}}}

        async def serve(models: tuple[str, ...], **kw: Any) -> BentoServer:
            server = BentoServer(python, self.logs / "bentoml.log", home, models,
                                 self.arts.mlp.parent, **kw)
            await server.start()
            return server

        for setting, kw in (("default", {}), ("tuned", tuned)):
            server = await serve(("mlp",), **kw)
            try:
                await self.load("first_success", server.url("noop"),
                                tensor_body(self.check_x[:1]), server.started_wall, 180.0,
                                pid=server.proc.pid)
                if setting == "tuned":
                    endpoint, body_of = "mlp_batched", lambda x: {"x": x.tolist()}
                else:
                    endpoint, body_of = "mlp", tensor_body
                await self.check_mlp("bentoml", setting, server.url(endpoint), body_of)
                await self.closed("bentoml", setting, "noop", server.url("noop"),
                                  tensor_body(self.check_x[:1]))
                await self.closed("bentoml", setting, "mlp", server.url(endpoint),
                                  body_of(self.check_x[:1]))
            finally:
                await server.stop()
        for model, path, body in (("big", self.arts.big, tensor_body(self.big_x)),
                                  ("bert", self.arts.bert_dir, {"inputs": {"text": [TEXT]}})):
            artifacts.warm_page_cache(path)
            walls = []
            for i in range(self.plan.cold_repeats):
                server = await serve((model,))
                try:
                    res = await self.load("first_success", server.url(model), body,
                                          server.started_wall, 300.0, pid=server.proc.pid)
                finally:
                    await server.stop()
                walls.append(res["wall_s"])
                print(f"bentoml    cold {model} #{i}: {res['wall_s']:.3f}s", flush=True)
            self.cold.append({"platform": "bentoml", "model": model, "walls_s": walls,
                              "wall_s": report.median_or_none(walls),
                              "source": "local disk, page cache warm; `bentoml serve` process "
                                        "start to first answer (no scale-to-zero in OSS)"})
        self.burst.append({"platform": "bentoml", "status": "not run",
                           "reason": "open-source BentoML has no autoscaler (scaling from zero "
                                     "is a BentoCloud feature); a fixed worker count only"})

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}ms"


def _print_burst(platform: str, res: dict[str, Any]) -> None:
    print(f"{platform:10s} burst {res['rate_hz']:.0f}/s x {res['duration_s']:.0f}s: "
          f"sent={res['sent']} failed={res['failed']} replicas={res['replicas_seen']} "
          f"4th serves at {res['time_to_nth_replica_s']} p50={_ms(res['p50_ms'])} "
          f"p99={_ms(res['p99_ms'])} failed by {res.get('failed_by')}", flush=True)


async def run(plan: Plan, arts: artifacts.Artifacts, envs: dict[str, Any], logs: Path,
              platforms: tuple[str, ...]) -> dict[str, Any]:
    """Every workload on every platform; returns the result object of the JSON line. A
    peer that fails is kept as a row saying why; a wrong answer fails the run."""
    bench = Bench(plan, arts, envs, logs)
    unavailable: dict[str, str] = {}
    try:
        bench.set_burst_rate()
        await bench.floor_run(bench.floor)
        for name in platforms:
            if name != "flashpoint" and "error" in envs.get(name, {}):
                unavailable[name] = envs[name]["error"]
                continue
            try:
                await getattr(bench, name)()
            except (AnswerMismatch, KeyboardInterrupt):
                raise
            except (PeerError, TimeoutError, RuntimeError, OSError) as e:
                if name == "flashpoint":
                    raise
                unavailable[name] = f"{type(e).__name__}: {e}"[:400]
                print(f"{name}: failed: {unavailable[name]}", flush=True)
        await bench.floor_run(bench.floor_after)
    finally:
        bench.close()
    warm = [report.with_floor(r, bench.floor) for r in bench.warm]
    for name, reason in unavailable.items():  # keep a row saying why wherever one is missing
        why = {"platform": name, "status": "not run", "reason": reason}
        if not any(r["platform"] == name for r in warm):
            warm.append(dict(why))
        for model in ("big", "bert"):
            if not any(r["platform"] == name and r["model"] == model for r in bench.cold):
                bench.cold.append({**why, "model": model})
        if not any(b["platform"] == name for b in bench.burst):
            bench.burst.append(dict(why))
    return {"bench": "peers", "plan": {**dataclasses.asdict(plan),
                                       "burst_offered_replicas": BURST_OFFERED_REPLICAS,
                                       "burst_service_s": bench.burst_service_s,
                                       "burst_rate_hz": bench.burst_rate_hz},
            "floor": list(bench.floor.values()), "floor_after": list(bench.floor_after.values()),
            "warm": warm, "cold": bench.cold, "burst": bench.burst, "checks": bench.checks,
            "settings": bench.settings, "unavailable": unavailable, "notes": bench.notes,
            "targets": report.targets(warm, bench.cold)}
