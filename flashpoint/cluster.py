"""A local cluster in one process: a controller and N host managers over real RPC.

Used by ``flashpoint up``, the demo, cluster tests and benchmarks. Host managers still spawn
real worker processes; only the controller and host actors share this event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

from flashpoint.config import ClusterConfig
from flashpoint.controller.actor import Controller
from flashpoint.errors import Unavailable
from flashpoint.host.actor import HostManager
from flashpoint.host.metrics import host_listen
from flashpoint.log import configure
from flashpoint.registry import make_store
from flashpoint.spot.provider import LocalProvider


class LocalCluster:
    def __init__(self, config: ClusterConfig, hosts: int = 2, store: Any = None) -> None:
        self.config = config
        self.n_hosts = hosts
        if store is None:
            store = make_store(config)
        self.store = store
        self.controller = Controller(config, store)
        self.hosts: list[HostManager] = []
        # An evicted host is replaced by a new one in this process (spot first).
        self.provider = LocalProvider(self)
        self.controller.provider = self.provider

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        # The actors log through structlog; honour the configured level in this process
        # unless the CLI (or a test) configured logging already.
        configure(self.config.log_level, if_unset=True)
        await self.controller.start()
        try:
            for _ in range(self.n_hosts):
                await self._start_host(self.config.host.kind)
            await self.wait_hosts(self.n_hosts, ready_timeout_s)
            await asyncio.gather(*(h.wait_pool_ready(ready_timeout_s) for h in self.hosts))
        except BaseException:
            await self.stop()
            raise

    def next_host_id(self) -> str:
        """The id the next host started here will get."""
        return f"host{len(self.hosts)}"

    async def _start_host(self, kind: str, **host: Any) -> HostManager:
        # Hosts here share one machine: each gets its own metrics port (the configured
        # one plus its index), so a second host does not fail to bind the first one's.
        host = {"metrics_listen": host_listen(self.config.host.metrics_listen, len(self.hosts)),
                **self._cores_share(), **host}
        host_cfg = dataclasses.replace(self.config.host, controller_url=self.controller.rpc_url,
                                       kind=kind, **host)
        cfg = dataclasses.replace(self.config, host=host_cfg)
        manager = HostManager(cfg, self.store, host_id=self.next_host_id())
        self.hosts.append(manager)
        await manager.start()
        return manager

    def _cores_share(self) -> dict[str, int]:
        """The hosts here share one machine's cores: unless ``[host] cpu_cores`` says
        otherwise, each gets an even share, so that their workers' torch threads
        (policy/cpu_threads.py) do not add up to more than the machine has."""
        if self.config.host.cpu_cores > 0:
            return {}
        return {"cpu_cores": max(1, len(os.sched_getaffinity(0)) // max(1, self.n_hosts))}

    async def add_host(self, kind: str = "ondemand", ready_timeout_s: float = 60.0,
                       **host: Any) -> HostManager:
        """Start one more host (a replacement, or a scale-out of the cluster itself) with
        ``host`` overriding its config; returns once its warm pool is ready."""
        manager = await self._start_host(kind, **host)
        await manager.wait_pool_ready(ready_timeout_s)
        return manager

    async def wait_hosts(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = [h for h in self.controller.state.hosts.values() if h.alive]
            if len(alive) >= count:
                return
            await asyncio.sleep(0.05)
        raise Unavailable(f"only {len(self.controller.state.hosts)} of {count} hosts registered "
                          f"within {timeout_s}s")

    async def stop(self) -> None:
        # Controller first: otherwise it sees workers vanish as hosts stop and starts
        # replacements on hosts that are shutting down.
        await self.controller.stop()
        await asyncio.gather(*(h.stop() for h in self.hosts), return_exceptions=True)

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
