"""The profiler's trial driver: FaST, PROTEAN and Dilu profiles measured through the live
system and stored on the function (``flashpoint profile FUNCTION``,
``POST /v1/functions/{name}/profile``).

Each trial (a :class:`~flashpoint.policy.profile_trials.TrialPoint`) registers a *shadow*
function, ``<name>.prof-<n>``: the same model version, inputs and timeout, but exactly the
trial's replica count, batch size and GPU share, not persisted. The controller places and
deploys its replicas as any others (so they land on a GPU of a host with ``gpu_sharing`` =
``mps`` or ``tokens``, and the host enforces the share: MPS thread percentage, or the token
manager's quota through the hook); the driver waits until they are warm, sends one warm-up
request per replica, then ``requests`` requests through the controller's
:class:`~flashpoint.controller.requests.RequestPath` from ``batch × replicas`` closed-loop
clients, and deletes the shadow function. What a trial measured is summarised by
``profile_trials.summarise``; how trials become profiles is pure (``policy/profile_trials.py``).
Dilu's HGSS (``policy/dilu_profile.hgss``) asks for its trials through a synchronous
callback, so it runs in a thread and each trial it asks for runs on the event loop.

On machines without GPUs (fake GPUs, workers computing on the CPU) the host still places,
attaches and accounts the share, but neither MPS nor the hook throttles CPU compute: the
numbers then measure the platform, not the share.

The profiles replace the function's profile fields (``FunctionCatalog.store_profiles``,
persisted); registration resolves its share from them (``share_placement.resolve_share``),
so placement uses them from the next replica on, without re-registering by hand.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashpoint.controller.functions import FunctionCatalog
from flashpoint.controller.handles import HostHandle
from flashpoint.controller.requests import RequestPath
from flashpoint.controller.state import events as cs
from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.records import ReplicaPhase, ReplicaRecord
from flashpoint.errors import (
    BadRequest,
    Conflict,
    DeadlineExceeded,
    FlashpointError,
    FunctionNotFound,
    Unavailable,
)
from flashpoint.log import get_logger
from flashpoint.policy import profile_trials as pt
from flashpoint.policy.dilu_profile import hgss
from flashpoint.policy.protean import FULL_SLICE
from flashpoint.policy.share_placement import SHARING_MODES
from flashpoint.spec import (
    DiluProfileSpec,
    FastProfileSpec,
    FunctionSpec,
    ProteanProfileSpec,
    ProteanSliceSpec,
)
from flashpoint.tensors import DECODED_DTYPE

log = get_logger("flashpoint.controller.profiler")

SHADOW_MARK = ".prof-"  # a shadow function's name: "<function>.prof-<n>"
WARM_TIMEOUT_S = 120.0  # a trial's replicas must be warm by then (and within the run's limit)
WARM_POLL_S = 0.05  # the state has no "warm" notification to wait on: polled, bounded


def sharing_hosts(state: ControllerState) -> list[str]:
    """Live, non-draining hosts that enforce GPU shares (``mps`` or ``tokens``)."""
    return sorted(h.host_id for h in state.hosts.values()
                  if h.alive and not h.draining and h.gpu_sharing in SHARING_MODES)


def sample_inputs(spec: FunctionSpec) -> dict[str, np.ndarray]:
    """One request's inputs from the function's declared tensors: every open dimension 1,
    zeros (``b"profile"`` for BYTES). BadRequest if it declares none."""
    if not spec.inputs:
        raise BadRequest(f"function {spec.name!r} declares no inputs: pass the inputs of one "
                         "request to profile it with (--inputs)")
    out: dict[str, np.ndarray] = {}
    for t in spec.inputs:
        shape = tuple(1 if d < 0 else d for d in t.shape)
        if t.datatype == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr.fill(b"profile")
            out[t.name] = arr
        else:
            out[t.name] = np.zeros(shape, dtype=DECODED_DTYPE[t.datatype])
    return out


@dataclass
class _Shadow:
    """A deployed shadow function: its spec, the point its replicas run at now, their ids."""

    spec: FunctionSpec
    point: pt.TrialPoint
    replica_ids: list[str]


class Profiler:
    """Runs profiles (one at a time per function) for the controller that owns it."""

    def __init__(self, functions: FunctionCatalog, state: ControllerState,
                 requests: RequestPath, hosts: dict[str, HostHandle],
                 apply: Callable[[cs.Event], None], wake: Callable[[], None]) -> None:
        self.functions = functions
        self.state = state
        self.requests = requests
        self.hosts = hosts  # the controller's handles, by host id
        self._apply = apply  # feeds an event to the controller's state (and runs its commands)
        self._wake = wake
        self._running: set[str] = set()
        self._seq = itertools.count()

    async def profile(self, name: str, req: pt.ProfileRequest,
                      inputs: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Profile function ``name`` as ``req`` asks, store the profiles on it, and answer
        the report with what was stored and the share the function now resolves to.

        FunctionNotFound for an unknown function; Conflict when no host shares GPUs or the
        function is being profiled already; DeadlineExceeded past ``req.timeout_s``."""
        spec = self.functions.registered_spec(name)
        if SHADOW_MARK in name:
            raise BadRequest(f"{name!r} is a profiler trial, not a function to profile")
        if name in self._running:
            raise Conflict(f"function {name!r} is being profiled already")
        if not sharing_hosts(self.state):
            raise Conflict("no live host shares its GPUs ([host] gpu_sharing = \"mps\" or "
                           "\"tokens\"): profiling runs trials at GPU shares, so it needs one")
        arrays = inputs if inputs is not None else sample_inputs(spec)
        self._running.add(name)
        log.info("profile_started", function=name, request=req.to_dict())
        try:
            async with asyncio.timeout(req.timeout_s):
                report = await _Run(self, spec, req, arrays).run()
        except TimeoutError:
            raise DeadlineExceeded(f"profiling {name!r} took longer than timeout_s="
                                   f"{req.timeout_s:g}") from None
        finally:
            self._running.discard(name)
        fields = _profile_fields(report, req, spec.max_batch_size)
        stored = await self.functions.store_profiles(name, **fields)
        rec = self.state.functions[name]
        answer = report.to_dict()
        answer["stored"] = sorted(fields)
        answer["share"] = {"sm_share": rec.spec.sm_share, "sm_limit": rec.spec.sm_limit,
                           "time_quota": rec.spec.time_quota,
                           "reason": rec.share_reason or ("explicit sm_share kept"
                                                          if stored.sm_share else "")}
        log.info("profile_stored", function=name, trials=len(report.trials),
                 stored=answer["stored"], share_reason=rec.share_reason)
        return answer

    # trials ------------------------------------------------------------------------------
    async def deploy(self, spec: FunctionSpec, point: pt.TrialPoint) -> _Shadow:
        """A shadow function of ``spec`` at ``point``, its replicas warm and placed with a
        share (the caller removes it: :meth:`remove`)."""
        shadow = dataclasses.replace(
            spec, name=f"{spec.name[:48]}{SHADOW_MARK}{next(self._seq) % 10_000}",
            max_batch_size=point.batch, min_replicas=point.replicas,
            max_replicas=point.replicas, replica_concurrency=point.batch, max_stages=1,
            sm_share=point.sm_share, sm_limit=point.sm_limit, time_quota=point.time_quota,
            fast_profile=None, protean_profile=None, dilu_profile=None, canary_pct=100.0)
        if shadow.name in self.state.functions:
            raise Conflict(f"function {shadow.name!r} exists: the profiler's trial name is taken")
        await self.functions.apply_function(shadow, persist=False)
        self._wake()
        try:
            reps = await self._warm(shadow.name, point.replicas)
        except BaseException:
            await self.remove(shadow.name)
            raise
        return _Shadow(shadow, point, [r.replica_id for r in reps])

    async def remove(self, name: str) -> None:
        """Delete a shadow function (its replicas stop)."""
        try:
            await self.functions.delete(name)
        except FunctionNotFound:
            pass

    async def reshare(self, sh: _Shadow, point: pt.TrialPoint) -> bool:
        """Give ``sh``'s one replica ``point``'s share live, if its host can (tokens: the
        token manager's quota changes; MPS fixes a share at the worker's start) and it is
        alone on its device (a bigger share must not over-commit another replica's GPU).
        False when it cannot: the caller deploys anew."""
        if sh.point.replicas != 1 or point.replicas != 1 or sh.point.batch != point.batch:
            return False
        rep = self.state.replicas.get(sh.replica_ids[0])
        host = self.state.hosts.get(rep.host_id) if rep is not None else None
        handle = self.hosts.get(rep.host_id) if rep is not None else None
        if rep is None or rep.share is None or host is None or handle is None \
                or host.gpu_sharing != "tokens" or rep.phase != ReplicaPhase.WARM:
            return False
        if any(r.replica_id != rep.replica_id and r.host_id == rep.host_id
               and r.device_id == rep.device_id for r in self.state.replicas.values()):
            return False
        share = pt.trial_share(self.state.share_policy, point, rep.share)
        await handle.set_replica_share(rep.replica_id, share.to_wire())
        self._apply(cs.ReplicaShareChanged(rep.replica_id, share))
        sh.point = point
        return True

    async def _warm(self, name: str, count: int) -> list[ReplicaRecord]:
        """The ``count`` warm replicas of shadow ``name``, each placed with a share."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WARM_TIMEOUT_S
        for _ in range(int(WARM_TIMEOUT_S / WARM_POLL_S) + 1):  # bounded by the deadline too
            reps = [r for r in self.state.replicas_of(name) if r.phase == ReplicaPhase.WARM]
            if len(reps) >= count:
                unshared = [r.replica_id for r in reps if r.share is None]
                if unshared:
                    raise Conflict(f"trial replicas {unshared} were placed without a GPU share "
                                   "(no sharing host had room for them)")
                return reps
            failure = self.state.not_ready(name)
            if failure is not None and failure.failed_starts:
                raise Unavailable(f"trial replicas of {name!r} failed to start: "
                                  f"{failure.message}")
            if loop.time() > deadline:
                break
            await asyncio.sleep(WARM_POLL_S)
        rec = self.state.functions.get(name)
        why = rec.unplaced if rec is not None and rec.unplaced else "still starting"
        raise Unavailable(f"trial replicas of {name!r} not warm after {WARM_TIMEOUT_S:g} s "
                          f"({why})")

    async def drive(self, sh: _Shadow, arrays: dict[str, np.ndarray],
                    requests: int) -> pt.TrialResult:
        """One trial on ``sh`` as it is now: a warm-up request per replica (not measured),
        then ``requests`` requests from ``batch × replicas`` closed-loop clients."""
        name, point = sh.spec.name, sh.point
        reps = [r for r in (self.state.replicas.get(i) for i in sh.replica_ids) if r is not None]
        if len(reps) != len(sh.replica_ids):
            raise Unavailable(f"a trial replica of {name!r} went away")
        await asyncio.gather(*(self.requests.invoke(name, arrays, request_id=f"{name}-w{i}")
                               for i in range(point.replicas)))  # warm-up: not measured
        latencies: list[float] = []
        errors: list[FlashpointError] = []
        issued = iter(range(requests))

        async def client() -> None:
            for i in issued:  # shared iterator: ``requests`` in all, over every client
                t0 = time.perf_counter()
                try:
                    await self.requests.invoke(name, arrays, request_id=f"{name}-{i}")
                except FlashpointError as e:
                    errors.append(e)
                    continue
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(requests, point.batch * point.replicas))))
        wall_s = time.perf_counter() - t0
        if not latencies:
            raise errors[-1]  # the trial served nothing: its last error says why
        devices = sorted({f"{r.host_id}/{r.device_id}" for r in reps})
        result = pt.summarise(point, latencies, len(errors), wall_s, ",".join(devices),
                              self._slice(reps[0]), sh.spec.name)
        log.info("profile_trial", function=name, point=point.to_dict(), ok=result.ok,
                 failed=result.failed, throughput_rps=round(result.throughput_rps, 3),
                 p99_ms=round(result.p99_latency_s * 1000, 3), device=result.device)
        return result

    def _slice(self, rep: ReplicaRecord) -> str:
        """PROTEAN's slice type of the replica's device: "3g" of "3g.40gb", a whole GPU 7g."""
        host = self.state.hosts.get(rep.host_id)
        dev = host.devices.get(rep.device_id) if host is not None else None
        mig = dev.mig_profile if dev is not None else ""
        return mig.split(".")[0] if mig else FULL_SLICE


class _Run:
    """One profiler run: its trials (each point measured once), then the profiles."""

    def __init__(self, profiler: Profiler, spec: FunctionSpec, req: pt.ProfileRequest,
                 arrays: dict[str, np.ndarray]) -> None:
        self.p, self.spec, self.req, self.arrays = profiler, spec, req, arrays
        self.done: dict[pt.TrialPoint, pt.TrialResult] = {}
        self.notes: list[str] = []
        self.shadow: _Shadow | None = None  # the trial replicas deployed now
        self.deploys = 0

    async def measure(self, point: pt.TrialPoint) -> pt.TrialResult:
        """``point``'s trial (each point once): on the shadow deployed now, its share
        changed live where the host allows, else on a new one."""
        if point in self.done:
            return self.done[point]
        if self.shadow is None or not await self.p.reshare(self.shadow, point):
            if self.shadow is not None:
                old, self.shadow = self.shadow, None
                await self.p.remove(old.spec.name)
            self.shadow = await self.p.deploy(self.spec, point)
            self.deploys += 1
        self.done[point] = await self.p.drive(self.shadow, self.arrays, self.req.requests)
        return self.done[point]

    async def run(self) -> pt.ProfileReport:
        try:
            return await self._run()
        finally:
            if self.shadow is not None:
                await self.p.remove(self.shadow.spec.name)

    async def _run(self) -> pt.ProfileReport:
        req, name = self.req, self.spec.name
        fast = protean = dilu = None
        if req.fast:
            if self.p.state.share_policy == "dilu" and len(req.quotas) > 1:
                self.notes.append("fast: under share_policy \"dilu\" a replica's time share "
                                  "is its SM share (its request), so the grid's quotas were "
                                  "not applied")
            results = [await self.measure(p) for p in req.fast_grid()]
            fast = pt.fast_profile(name, results, req.batch)
        if req.protean:
            solo = await self.measure(req.solo_point())
        if req.dilu:  # before the co-located run: its one-replica trials reuse the shadow
            dilu = await self._hgss()
        if req.protean:
            co = await self.measure(req.colocated_point())
            try:
                protean = pt.protean_fit(name, solo, [co])
            except BadRequest as e:
                self.notes.append(f"protean: {e.message}")
        return pt.ProfileReport(name, req, tuple(self.done.values()), fast, protean, dilu,
                                tuple(self.notes), self.deploys)

    async def _hgss(self) -> Any:
        slo_ms = self.req.slo_ms or self.spec.slo_ms
        if not slo_ms:
            self.notes.append("dilu: no SLO (pass slo_ms, or register the function with "
                              "one): HGSS needs a latency budget")
            return None
        loop = asyncio.get_running_loop()
        pending: list[concurrent.futures.Future[pt.TrialResult]] = []

        def measure(ibs: int, smr_pct: int) -> Any:  # in HGSS's thread
            fut = asyncio.run_coroutine_threadsafe(self.measure(pt.dilu_point(ibs, smr_pct)),
                                                   loop)
            pending.append(fut)
            return pt.dilu_trial(fut.result(timeout=self.req.timeout_s))

        try:
            result = await asyncio.to_thread(hgss, measure, slo_ms / 1000.0,
                                             self.req.hgss_params())
        finally:
            for fut in pending:  # cancelled from outside: the thread's wait ends with it
                fut.cancel()
        if result is None:
            self.notes.append(f"dilu: even 100% SMR at IBS 1 misses the budget "
                              f"slo_ms / 2 = {slo_ms / 2:g} ms")
        return result


def _profile_fields(report: pt.ProfileReport, req: pt.ProfileRequest,
                    max_batch_size: int) -> dict[str, Any]:
    """The spec fields the report fills (each only when it was measured). PROTEAN's FBR is
    also the function's ``batch_fbr`` (the slice dispatcher's), scaled from the trials'
    batch to ``max_batch_size`` (a batch's bandwidth taken as proportional to its size)."""
    out: dict[str, Any] = {}
    if report.fast is not None:
        out["fast_profile"] = FastProfileSpec(report.fast.batch, tuple(
            (p.sm_share, p.quota, p.throughput_rps, p.p99_latency_s) for p in report.fast.points))
    if report.protean is not None:
        p = report.protean
        out["protean_profile"] = ProteanProfileSpec(req.batch, (ProteanSliceSpec(
            p.slice, p.solo_s, p.fbr, p.fbr_bounded),))
        out["batch_fbr"] = min(100.0, p.fbr * max_batch_size / req.batch)
    if report.dilu is not None:
        d = report.dilu
        out["dilu_profile"] = DiluProfileSpec(d.sm_request, d.sm_limit, d.ibs,
                                              d.throughput_rps, d.trials)
    return out
