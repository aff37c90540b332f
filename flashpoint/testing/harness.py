"""One way for tests to start a Flashpoint cluster (STYLE.md §11): :class:`ClusterFactory`,
served to tests as the ``make_cluster`` fixture (tests/conftest.py).

``await make_cluster(hosts=2, models=("noop", "bert"), host={...}, controller={...})`` returns
a started cluster with one API whichever way it runs:

* in-process (the default): a :class:`~flashpoint.cluster.LocalCluster` — controller and host
  managers in the test's event loop, real worker processes — as :class:`InProcessCluster`;
* ``netns=True``: registry, controller and hosts as real processes in network namespaces
  (:class:`~flashpoint.testing.netcluster.NetCluster`, root only) as :class:`NetnsCluster`.

Both offer ``url``, ``api_key``, ``client()`` (a :class:`flashpoint.AsyncClient`), ``status``,
``deploy``, ``invoke``, ``invoke_body``, ``wait``, ``wait_warm`` and ``stop``. Every cluster a
factory made is stopped when the factory closes (bounded in time), whatever the test did,
and then checked for leaks (:mod:`flashpoint.testing.leaks`): processes it started, asyncio
tasks running Flashpoint code, listening sockets. A leak fails the test with what leaked.

Wait helpers (:func:`wait_for`, :meth:`ClusterHandle.wait`) say which state they did not
reach and what they saw instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from flashpoint.client import AsyncClient
from flashpoint.cluster import LocalCluster
from flashpoint.config import ClusterConfig, load_config
from flashpoint.controller.actor import Controller
from flashpoint.host.actor import HostManager
from flashpoint.models.sources import publish
from flashpoint.registry import LocalStore, make_store
from flashpoint.testing.cluster_api import ClusterApi
from flashpoint.testing.leaks import Baseline, find_leaks

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 30.0


def cluster_config(tmp_path: Path, *, controller: dict[str, Any] | None = None,
                   **host: object) -> ClusterConfig:
    """The suite's small, fast cluster config under ``tmp_path`` (quick heartbeats, one CPU
    device and one warm worker per host); ``host`` and ``controller`` override keys of those
    sections."""
    return load_config(overrides={
        "log_level": "WARNING",
        "controller": {"listen_port": 0, "heartbeat_timeout_s": 3.0, "loop_interval_s": 0.05,
                       **(controller or {})},
        # One torch thread per worker: the suite's clusters run beside the test process
        # and each other on a small machine, where more would oversubscribe its cores.
        "host": {"cpu_devices": 1, "warm_pool_size": 1, "heartbeat_interval_s": 0.3,
                 "torch_threads": 1, "cache_dir": str(tmp_path / "cache"), **host},
    }).with_home(tmp_path)


async def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 30.0,
                   state: Callable[[], Any] | None = None) -> None:
    """Wait for ``cond``; on timeout raise AssertionError saying which condition was not
    reached (and ``state()``, what was reached instead, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}"
                         + (f"; state: {state()}" if state is not None else ""))


class ClusterHandle(ClusterApi):
    """The API every harness cluster offers, over its HTTP endpoint."""

    url: str
    api_key: str | None = None

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self.stopped = False

    def client(self, **kw: Any) -> AsyncClient:
        """A :class:`flashpoint.AsyncClient` for this cluster (with its admin key, if any);
        the caller closes it (``async with``)."""
        return AsyncClient(self.url, api_key=kw.pop("api_key", self.api_key), **kw)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        return self._session

    def started_pids(self) -> set[int]:
        """PIDs this cluster started that the leak check must see exited."""
        return set()

    async def _stop(self) -> None:
        raise NotImplementedError

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the cluster (idempotent; bounded by ``timeout_s``)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if self._session is not None:
                await self._session.close()
        finally:
            await asyncio.wait_for(self._stop(), timeout_s)


class InProcessCluster(ClusterHandle):
    """A :class:`LocalCluster` in the test's loop; its actors stay reachable for tests that
    look at the controller's state or a host's workers."""

    def __init__(self, local: LocalCluster, api_key: str | None = None) -> None:
        super().__init__()
        self.local = local
        self.api_key = api_key
        self._pids: set[int] = set()

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.local.controller.url

    @property
    def config(self) -> ClusterConfig:
        return self.local.config

    @property
    def store(self) -> Any:
        return self.local.store

    @property
    def controller(self) -> Controller:
        return self.local.controller

    @property
    def hosts(self) -> list[HostManager]:
        return self.local.hosts

    async def add_host(self, kind: str = "ondemand", ready_timeout_s: float = 60.0,
                       **host: Any) -> HostManager:
        """:meth:`LocalCluster.add_host`."""
        return await self.local.add_host(kind, ready_timeout_s, **host)

    def worker_pids(self) -> set[int]:
        """PIDs of the worker processes the hosts hold now (noted for the leak check)."""
        pids = {w.proc.pid for h in self.local.hosts for w in h.workers.values()
                if w.proc is not None}
        self._pids |= pids
        return pids

    def started_pids(self) -> set[int]:
        self.worker_pids()
        return set(self._pids)

    async def _stop(self) -> None:
        self.worker_pids()
        await self.local.stop()


class NetnsCluster(ClusterHandle):
    """A :class:`~flashpoint.testing.netcluster.NetCluster` (real processes in network
    namespaces); ``net`` gives its lab-specific helpers (logs, kill/restart, cache files)."""

    def __init__(self, net: Any) -> None:
        super().__init__()
        self.net = net
        self.url = net.url

    def diagnostics(self) -> str:
        return self.net.diagnostics()

    def started_pids(self) -> set[int]:
        return set(self.net.seen_pids)

    async def _stop(self) -> None:
        await self.net.aclose()


ModelSpec = str | tuple[str, Any, str, str]  # "noop", or (zoo name, config, version, model_name)


def _model_args(m: ModelSpec) -> tuple[str, Any, str, str]:
    return (m, "tiny", "1", m) if isinstance(m, str) else m


class ClusterFactory:
    """Starts clusters for one test and stops and leak-checks them all in :meth:`aclose`.

    ``make_lab`` builds a :class:`~flashpoint.testing.netns.NetLab` for ``netns=True`` (the
    fixture passes one that skips the test where labs cannot be built)."""

    def __init__(self, tmp_path: Path, *, make_lab: Callable[..., Any] | None = None) -> None:
        self.tmp_path = tmp_path
        self.make_lab = make_lab
        self.clusters: list[ClusterHandle] = []
        self._baseline: Baseline | None = None
        self._env: dict[str, str | None] = {}

    async def __call__(self, hosts: int = 1, models: Sequence[ModelSpec] = ("noop",), *,
                       host: dict[str, Any] | None = None,
                       controller: dict[str, Any] | None = None,
                       config: ClusterConfig | None = None, store: Any = None,
                       api_keys: dict[str, str] | None = None, netns: bool = False,
                       start_timeout_s: float = START_TIMEOUT_S, **net: Any) -> ClusterHandle:
        """A started cluster of ``hosts`` hosts whose registry holds ``models`` (each zoo name
        published as ``<name>@1`` with the tiny preset, or a ``(zoo name, config, version,
        model_name)`` tuple). In-process: ``config`` replaces :func:`cluster_config` (then
        ``host``/``controller`` must be left out), ``store`` the config's registry,
        ``api_keys`` (key -> role) become ``[gateway] api_keys`` and the handle uses the first
        admin key. ``netns=True``: ``host``/``controller`` add keys to the processes' TOML, and
        ``net`` passes on to :meth:`NetCluster.start` (``rate_mbit``, ``host_env``, ...)."""
        if self._baseline is None:
            self._baseline = Baseline.take()
        if netns:
            assert config is None and store is None and api_keys is None, "in-process only"
            c: ClusterHandle = await self._start_netns(hosts, models, host, controller, net)
        else:
            assert not net, f"netns-only arguments: {sorted(net)}"
            c = await self._start_local(hosts, models, host, controller, config, store,
                                        api_keys, start_timeout_s)
        return c

    async def _start_local(self, hosts: int, models: Sequence[ModelSpec],
                           host: dict[str, Any] | None, controller: dict[str, Any] | None,
                           config: ClusterConfig | None, store: Any,
                           api_keys: dict[str, str] | None,
                           start_timeout_s: float) -> InProcessCluster:
        if config is None:
            config = cluster_config(self.tmp_path, controller=controller, **(host or {}))
        else:
            assert host is None and controller is None, "give overrides or a config, not both"
        admin = None
        if api_keys:
            config = dataclasses.replace(config, gateway=dataclasses.replace(
                config.gateway, api_keys=dict(api_keys)))
            admin = next((k for k, role in api_keys.items() if role == "admin"), None)
        if store is None:
            store = make_store(config)
        for m in models:
            name, cfg, version, model_name = _model_args(m)
            await publish(store, name, cfg, version, model_name=model_name)
        local = LocalCluster(config, hosts=hosts, store=store)
        c = InProcessCluster(local, api_key=admin)
        self.clusters.append(c)  # registered first: a failed start is still stopped and checked
        await asyncio.wait_for(local.start(), start_timeout_s)
        c.worker_pids()
        return c

    async def _start_netns(self, hosts: int, models: Sequence[ModelSpec],
                           host: dict[str, Any] | None, controller: dict[str, Any] | None,
                           net: dict[str, Any]) -> NetnsCluster:
        from flashpoint.testing.netcluster import FAKE_AWS_ENV, UNSET_ENV, NetCluster

        if self.make_lab is None:
            raise AssertionError("netns=True needs a make_lab (the make_cluster fixture's)")
        # This process's own S3 clients (publishing) must reach only the lab's registry.
        for key in (*FAKE_AWS_ENV, *UNSET_ENV):
            self._env.setdefault(key, os.environ.get(key))
            os.environ.pop(key, None)
        os.environ.update(FAKE_AWS_ENV)
        net.setdefault("rate_mbit", None)
        tmp = self.tmp_path / f"netns{len(self.clusters)}"
        tmp.mkdir(parents=True, exist_ok=True)
        nc = await NetCluster.start(self.make_lab, tmp, hosts, controller=controller, host=host,
                                    **net)
        c = NetnsCluster(nc)
        self.clusters.append(c)
        local = LocalStore(tmp / "models")
        for m in models:
            name, cfg, version, model_name = _model_args(m)
            manifest = await publish(local, name, cfg, version, model_name=model_name)
            await nc.publish(manifest, local.blob_path(model_name, version))
        return c

    async def aclose(self, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every cluster (each bounded by ``stop_timeout_s``), then check leaks; raises
        AssertionError listing every failure to stop and every leak."""
        problems: list[str] = []
        pids: set[int] = set()
        for c in reversed(self.clusters):
            pids |= c.started_pids()
            try:
                await c.stop(stop_timeout_s)
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - reported below
                problems.append(f"stopping {type(c).__name__} {c.url or '(not started)'}: "
                                f"{exc!r}")
            pids |= c.started_pids()
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._baseline is not None:
            problems += await find_leaks(self._baseline, pids)
        if problems:
            raise AssertionError("cluster teardown: " + "; ".join(problems))
