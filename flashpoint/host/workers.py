"""The host's worker processes: spawn one (it says hello over RPC), take one for a replica,
keep the warm pool full, watch for exits, stop one by PID.

The pool's decisions (which idle worker a replica takes, whether to refill) are
:class:`~flashpoint.host.state.HostState`'s; this module is their I/O. The
:class:`~flashpoint.host.actor.HostManager` owns one :class:`WorkerPool`, whose tasks (a watch
per worker, the refills) it owns through its actor base.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from flashpoint.config import HostConfig
from flashpoint.errors import BadRequest, FlashpointError
from flashpoint.gpu.inventory import Device
from flashpoint.host import state as hs
from flashpoint.host.stage_hold import StageHolds
from flashpoint.ids import new_id
from flashpoint.log import get_logger
from flashpoint.messages import host_worker as hw
from flashpoint.messages.base import to_payload
from flashpoint.policy.cpu_threads import intra_op_threads, usable_cores
from flashpoint.rpc import roles

log = get_logger("flashpoint.host")


@dataclass
class WorkerProcess:
    """One worker process of this host: its PID handle, its RPC connection once it said
    hello, and the replica it holds (None while it waits in the warm pool)."""

    worker_id: str
    proc: asyncio.subprocess.Process
    hello: asyncio.Future
    conn: Any = None
    replica_id: str | None = None
    device_id: str | None = None
    function: str | None = None
    model_key: str | None = None
    warm: bool = False
    stopping: bool = False
    # Set when its replica has answered its first request (the worker's replica_served).
    served: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerPool:
    """The worker processes of one host. ``spawn`` starts a task the host manager owns;
    ``spawn_env`` gives the GPU side's environment for a new worker (host/gpu.py);
    ``on_exit(worker, rc)`` runs when a worker that held a replica exited unasked."""

    def __init__(self, hc: HostConfig, host_id: str, state: hs.HostState, *,
                 credential: roles.Credential, secret: bytes, holds: StageHolds,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
                 spawn_env: Callable[[], dict[str, str]],
                 on_exit: Callable[[WorkerProcess, int], Awaitable[None]]) -> None:
        self.hc = hc
        self.host_id = host_id
        self.state = state
        self.credential = credential
        self.secret = secret
        self.stage_holds = holds
        self._spawn = spawn
        self._spawn_env = spawn_env
        self._on_exit = on_exit
        self.workers: dict[str, WorkerProcess] = {}
        self.local_url = ""  # the host's worker-facing RPC server, once it listens
        # Intra-op threads each new worker's torch gets (policy/cpu_threads.py; the host
        # sets it once it knows its devices).
        self.torch_threads = max(1, hc.torch_threads)
        self._refill_lock = asyncio.Lock()

    def size_threads(self, devices: list[Device], gpus: int) -> None:
        """Set the intra-op threads of the workers spawned from now on, once the host knows
        its devices (``policy/cpu_threads.py``)."""
        self.torch_threads = intra_op_threads(
            self.hc.torch_threads, usable_cores(self.hc.cpu_cores, len(os.sched_getaffinity(0))),
            cpu_devices=sum(d.kind == "cpu" for d in devices), gpus=gpus)

    @property
    def idle(self) -> list[WorkerProcess]:
        """The warm pool's workers, in the order the next cold starts take them."""
        return [self.workers[w] for w in self.state.idle if w in self.workers]

    async def hello(self, conn: Any, msg: hw.WorkerHello) -> hw.Ok:
        w = self.workers.get(msg.worker_id)
        if w is None:
            raise BadRequest("unknown worker")
        w.conn = conn
        if not w.hello.done():
            w.hello.set_result(True)
        return hw.Ok()

    async def served(self, conn: Any, msg: hw.ReplicaServed) -> hw.Ok:
        """A worker's replica answered its first request: the warm pool may refill now."""
        w = self.workers.get(msg.worker_id)
        if w is None or w.conn is not conn:
            raise BadRequest("unknown worker")
        w.served.set()
        return hw.Ok()

    async def spawn_worker(self) -> WorkerProcess:
        worker_id = new_id(f"w-{self.host_id}")
        env = dict(os.environ)
        # Workers get the data plane's key and their own credential, never the host's.
        env["FLASHPOINT_SECRET"] = self.secret.decode()
        env[roles.CREDENTIAL_ENV] = roles.Credential(
            roles.worker_principal(self.host_id), roles.worker_key(self.credential.key)).token()
        env.update(self._spawn_env())  # LD_PRELOAD of the hook on a tokens host
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flashpoint.worker.actor", "--host-url", self.local_url,
            "--worker-id", worker_id, "--torch-threads", str(self.torch_threads),
            *(["--preload-transformers"] if _preload(self.hc) else []),
            env=env, stdin=asyncio.subprocess.DEVNULL,
        )
        w = WorkerProcess(worker_id, proc, asyncio.get_running_loop().create_future())
        self.workers[worker_id] = w
        self._spawn(self._watch(w), f"watch:{worker_id}")
        try:
            await asyncio.wait_for(asyncio.shield(w.hello), self.hc.worker_start_timeout_s)
        except BaseException:
            await self.stop_worker(w, 1.0)
            raise
        return w

    async def take(self) -> WorkerProcess:
        """The oldest idle worker of the pool (HostState decides), else a new one."""
        for _ in range(len(self.state.idle) + 1):  # each round takes one id out of the pool
            cmd = self.state.handle(hs.WorkerWanted(""))[0]
            if isinstance(cmd, hs.SpawnWorker):
                break
            assert isinstance(cmd, hs.UseWorker)
            if (w := self.workers.get(cmd.worker_id)) is not None:
                return w
        return await self.spawn_worker()

    async def refill(self, after: str | None = None,
                      served: WorkerProcess | None = None) -> None:
        if after is not None:
            await self.stage_holds.wait(after)
        if served is not None and served.warm:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(served.served.wait(), self.hc.refill_hold_s)
        async with self._refill_lock:
            while self.state.handle(hs.PoolRefillDue()):  # one spawn at a time, until full
                try:
                    w = await self.spawn_worker()
                except Exception as exc:  # keep serving; the next deploy spawns on demand
                    self.state.handle(hs.PoolSpawnEnded())
                    log.warning("warm_pool_spawn_failed", error=repr(exc))
                    return
                self.state.handle(hs.PoolSpawnEnded(w.worker_id))

    async def _watch(self, w: WorkerProcess) -> None:
        rc = await w.proc.wait()
        self.workers.pop(w.worker_id, None)
        self.state.handle(hs.WorkerExited(w.worker_id))
        if not w.hello.done():
            w.hello.set_exception(FlashpointError(f"worker exited with {rc} before hello"))
            w.hello.exception()
        if w.replica_id is not None and not w.stopping:
            await self._on_exit(w, rc)

    async def stop_worker(self, w: WorkerProcess, timeout_s: float) -> None:
        """Stop ``w``: asked to shut down over its connection; one with no connection (still
        starting up, or its connection gone) has nothing to finish and nobody to ask, so it
        is sent SIGTERM at once instead of being waited for. Killed if still running after
        ``timeout_s``."""
        w.stopping = True
        if w.proc.returncode is None and w.conn is not None and not w.conn.closed:
            with contextlib.suppress(Exception):
                await w.conn.call("shutdown", to_payload(hw.Shutdown()),
                                  timeout_s=min(1.0, timeout_s))
        elif w.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.terminate()  # by PID, through the process handle we started
        try:
            await asyncio.wait_for(w.proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()  # by PID, through the process handle we started
            await w.proc.wait()



def _preload(hc: HostConfig) -> bool:
    """Whether idle workers import transformers: the config, unless the environment says
    ``FLASHPOINT_PRELOAD_TRANSFORMERS=0`` (the test suite does: its clusters start hundreds
    of workers, few of which serve a Hugging Face model)."""
    return hc.preload_transformers and os.environ.get("FLASHPOINT_PRELOAD_TRANSFORMERS") != "0"
