"""Replacement hosts: the controller asks a provider for one when a host is being evicted.

PROTEAN's procurement rule (seed 000 §4.5): ask for another **spot** host first and fall back to
**on-demand** when spot capacity is short. A provider raises :class:`NoCapacity` when it has
no host of that kind; :func:`replace_host` applies the rule. :class:`LocalProvider` starts a
new in-process :class:`~flashpoint.host.actor.HostManager` in a
:class:`~flashpoint.cluster.LocalCluster` (tests, the demo); a cloud provider implements the
same one-method protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from flashpoint.errors import NoCapacity
from flashpoint.log import get_logger

log = get_logger("flashpoint.spot")


class HostProvider(Protocol):
    async def acquire(self, kind: str, replacing: str) -> str:
        """Start a host of ``kind`` (``spot`` or ``ondemand``); its id. NoCapacity if none."""
        ...


async def replace_host(provider: HostProvider, replacing: str) -> tuple[str, str]:
    """Spot first, then on-demand; returns (host id, kind). NoCapacity when neither has one."""
    try:
        return await provider.acquire("spot", replacing), "spot"
    except NoCapacity as exc:
        log.warning("spot_unavailable", replacing=replacing, error=exc.message)
    return await provider.acquire("ondemand", replacing), "ondemand"


class LocalProvider:
    """New hosts in a LocalCluster; ``spot_available`` says whether spot capacity exists."""

    def __init__(self, cluster: Any, *, spot_available: bool = True,
                 host_config: Callable[[str, str], dict[str, Any]] | None = None) -> None:
        self.cluster = cluster
        self.spot_available = spot_available
        # (kind, the new host's id) -> [host] config overrides (e.g. its notice trigger)
        self.host_config = host_config
        self.started: list[tuple[str, str]] = []  # (host id, kind), in order

    async def acquire(self, kind: str, replacing: str) -> str:
        if kind == "spot" and not self.spot_available:
            raise NoCapacity("no spot capacity in this local cluster")
        extra = self.host_config(kind, self.cluster.next_host_id()) if self.host_config else {}
        host = await self.cluster.add_host(kind=kind, **extra)
        self.started.append((host.host_id, kind))
        log.info("host_acquired", host_id=host.host_id, kind=kind, replacing=replacing)
        return host.host_id
