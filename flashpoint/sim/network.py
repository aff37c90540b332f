"""Flow-level network: max-min fair sharing on a spine-leaf topology (seed 004 §6).

The thesis simulates 200 hosts x 8 GPUs, 20 hosts per leaf, 50 Gbit/s host<->leaf links,
100 Gbit/s leaf<->spine links and a ~2 Gbit/s link to the cloud registry, with Ether's
flow-level bandwidth sharing. We model the same at flow level: a transfer is a *flow* with a
size in bytes; flows crossing a link share it max-min fairly; rates change only when a flow
starts or finishes, so between changes every flow moves at a constant rate and its bytes
left fall by ``rate x elapsed``. Packet effects (slow start, RTT) are out of scope.

Links are directional (full duplex): a host's uplink and downlink are separate resources,
as are a leaf's uplink to the spine and downlink from it. The spine switch itself is
non-blocking; the leaf-spine capacity is the aggregate of one leaf's uplinks. The cloud
registry hangs off the spine behind its own egress (and ingress) link. Paths:

* same leaf:   host_up[src], host_down[dst]
* other leaf:  host_up[src], leaf_up[leaf(src)], leaf_down[leaf(dst)], host_down[dst]
* from cloud:  cloud_egress, leaf_down[leaf(dst)], host_down[dst]
* to cloud:    host_up[src], leaf_up[leaf(src)], cloud_ingress

Rates are in bit/s (``*_bps``), sizes in bytes, times in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from types import MappingProxyType
from typing import Final, NamedTuple, NewType, TypeVar

from flashpoint.sim.engine import Engine, EventHandle

__all__ = [
    "CLOUD", "Node", "LinkKind", "LinkId", "Topology", "chain_path", "max_min_rates",
    "FlowId", "Flow", "FlowNetwork",
]

#: The cloud registry as a flow endpoint; hosts are ``0 .. n_hosts - 1``.
CLOUD: Final = "cloud"
Node = int | str

FlowId = NewType("FlowId", int)
K = TypeVar("K", bound=Hashable)

#: Links whose fair share is within this relative distance of the minimum saturate in the
#: same water-filling round; without it, float noise makes equal shares look distinct and
#: costs one round each (results differ only by that noise).
SHARE_REL_TOL: Final = 1e-12
#: A flow whose bytes left are within max(abs, rel x size) of zero when another flow
#: completes finishes in the same event instead of in a separate one a femtosecond later.
FINISH_ABS_TOL_BYTES: Final = 1e-6
FINISH_REL_TOL: Final = 1e-12


class LinkKind(StrEnum):
    HOST_UP = "host_up"
    HOST_DOWN = "host_down"
    LEAF_UP = "leaf_up"
    LEAF_DOWN = "leaf_down"
    CLOUD_EGRESS = "cloud_egress"
    CLOUD_INGRESS = "cloud_ingress"


class LinkId(NamedTuple):
    """One directional link: ``(kind, index)``; index is a host, a leaf, or 0 for the cloud."""

    kind: LinkKind
    index: int


@dataclass(frozen=True, slots=True)
class Topology:
    """Spine-leaf cluster plus a cloud registry; defaults are the thesis's (seed 004 §6)."""

    n_hosts: int = 200
    gpus_per_host: int = 8
    hosts_per_leaf: int = 20
    host_link_bps: float = 50e9
    leaf_spine_bps: float = 100e9
    cloud_bps: float = 2e9  # measured S3 2,203 Mbit/s, rounded to 2,000 in the thesis
    _capacity: dict[LinkId, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("n_hosts", "gpus_per_host", "hosts_per_leaf"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_link_bps", "leaf_spine_bps", "cloud_bps"):
            v = getattr(self, name)
            # Zero capacity would starve flows forever: no completion could ever be scheduled.
            if not (0.0 < v < math.inf):
                raise ValueError(f"{name} must be positive and finite, got {v!r}")
        cap: dict[LinkId, float] = {}
        for h in range(self.n_hosts):
            cap[LinkId(LinkKind.HOST_UP, h)] = self.host_link_bps
            cap[LinkId(LinkKind.HOST_DOWN, h)] = self.host_link_bps
        for leaf in range(self.n_leaves):
            cap[LinkId(LinkKind.LEAF_UP, leaf)] = self.leaf_spine_bps
            cap[LinkId(LinkKind.LEAF_DOWN, leaf)] = self.leaf_spine_bps
        cap[LinkId(LinkKind.CLOUD_EGRESS, 0)] = self.cloud_bps
        cap[LinkId(LinkKind.CLOUD_INGRESS, 0)] = self.cloud_bps
        object.__setattr__(self, "_capacity", cap)  # frozen: computed once here

    @property
    def n_leaves(self) -> int:
        return -(-self.n_hosts // self.hosts_per_leaf)  # the last leaf may be partly filled

    @property
    def n_gpus(self) -> int:
        return self.n_hosts * self.gpus_per_host

    @property
    def capacity_bps(self) -> Mapping[LinkId, float]:
        """Capacity of every link, in a fixed order (hosts, leaves, cloud)."""
        return MappingProxyType(self._capacity)

    def leaf_of(self, host: int) -> int:
        self._check_host(host)
        return host // self.hosts_per_leaf

    def path(self, src: Node, dst: Node) -> tuple[LinkId, ...]:
        """The links a flow from ``src`` to ``dst`` crosses (see the module docstring)."""
        if src == dst:
            raise ValueError(f"flow from {src!r} to itself crosses no link")
        if src == CLOUD:
            d = self._check_host(dst)
            return (LinkId(LinkKind.CLOUD_EGRESS, 0), LinkId(LinkKind.LEAF_DOWN, self.leaf_of(d)),
                    LinkId(LinkKind.HOST_DOWN, d))
        s = self._check_host(src)
        if dst == CLOUD:
            return (LinkId(LinkKind.HOST_UP, s), LinkId(LinkKind.LEAF_UP, self.leaf_of(s)),
                    LinkId(LinkKind.CLOUD_INGRESS, 0))
        d = self._check_host(dst)
        src_leaf, dst_leaf = self.leaf_of(s), self.leaf_of(d)
        if src_leaf == dst_leaf:
            return (LinkId(LinkKind.HOST_UP, s), LinkId(LinkKind.HOST_DOWN, d))
        return (LinkId(LinkKind.HOST_UP, s), LinkId(LinkKind.LEAF_UP, src_leaf),
                LinkId(LinkKind.LEAF_DOWN, dst_leaf), LinkId(LinkKind.HOST_DOWN, d))

    def _check_host(self, node: Node) -> int:
        # bool is an int subclass; True as a host id is always a caller bug.
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.n_hosts:
            raise ValueError(f"unknown node {node!r}: hosts are 0..{self.n_hosts - 1} or {CLOUD!r}")
        return node


def chain_path(topology: Topology, nodes: Sequence[Node]) -> tuple[LinkId, ...]:
    """The links of a chain ``nodes[0] -> nodes[1] -> ...``: every hop's path, in order."""
    if len(nodes) < 2:
        raise ValueError("a chain needs a sender and at least one receiver")
    return tuple(link for a, b in zip(nodes[:-1], nodes[1:], strict=True) for link in topology.path(a, b))


def max_min_rates(paths: Mapping[K, Sequence[LinkId]],
                  capacity_bps: Mapping[LinkId, float]) -> dict[K, float]:
    """Max-min fair rate of every flow, by progressive filling (water-filling).

    All unfrozen flows rise together; when a link fills, the flows crossing it freeze at
    that level and the rest keep rising. Round by round: the level at which link ``l``
    fills is ``(capacity - frozen load) / unfrozen flows``; the lowest such level freezes
    the flows of every link that reaches it. Each round empties at least one link, so
    there are at most ``min(#flows, #links)`` rounds. Iteration follows insertion order
    only (never set order), so results are bit-identical across runs and hash seeds.
    """
    users: dict[LinkId, list[K]] = {}
    for flow, path in paths.items():
        if not path:
            raise ValueError(f"flow {flow!r} has an empty path")
        for link in path:
            users.setdefault(link, []).append(flow)
    # Per link still carrying unfrozen flows: [capacity left, unfrozen flows].
    active: dict[LinkId, list[float]] = {
        link: [float(capacity_bps[link]), float(len(fs))] for link, fs in users.items()
    }
    rates: dict[K, float] = {}
    for _ in range(min(len(paths), len(users)) + 1):
        if not active:
            break
        level = min(left / n for left, n in active.values())
        threshold = level + abs(level) * SHARE_REL_TOL
        full = [link for link, (left, n) in active.items() if left / n <= threshold]
        for link in full:
            for flow in users[link]:
                if flow in rates:
                    continue
                rates[flow] = level  # <= every link's fill level, so no link overfills
                for m in paths[flow]:
                    slot = active[m]
                    slot[0] = max(0.0, slot[0] - level)  # float noise must not go negative
                    slot[1] -= 1.0
                    if slot[1] == 0.0:
                        del active[m]
    if len(rates) != len(paths):  # unreachable: each round freezes >= 1 flow
        raise AssertionError(f"water-filling froze {len(rates)} of {len(paths)} flows")
    return rates


class Flow:
    """One transfer. Fields are read-only to callers; the network updates them."""

    __slots__ = ("flow_id", "src", "dst", "size_bytes", "path", "started_s", "on_done",
                 "remaining_bytes", "rate_bps", "finished_s")

    def __init__(self, flow_id: FlowId, src: Node, dst: Node, size_bytes: float,
                 path: tuple[LinkId, ...], started_s: float,
                 on_done: Callable[[Flow], None]) -> None:
        self.flow_id = flow_id
        self.src = src
        self.dst = dst
        self.size_bytes = size_bytes
        self.path = path
        self.started_s = started_s
        self.on_done = on_done
        self.remaining_bytes = float(size_bytes)
        self.rate_bps = 0.0
        self.finished_s: float | None = None

    def __repr__(self) -> str:
        return (f"Flow({self.flow_id}, {self.src!r}->{self.dst!r}, size={self.size_bytes}, "
                f"left={self.remaining_bytes:.6g}, rate_bps={self.rate_bps:.6g})")


class FlowNetwork:
    """Flows on a :class:`Topology`, driven by an :class:`Engine`.

    On every change (a flow starts, finishes or is cancelled) the network charges each
    active flow ``rate x elapsed`` since the previous change, recomputes max-min rates,
    cancels its one pending completion event and schedules the earliest next finish.
    ``on_rates_changed`` (optional) is called after every recompute, for metrics and tracing.

    The recompute is incremental: max-min rates of flows that share no link (directly or
    through other flows) are independent, so only the *connected component* of the links the
    changed flows crossed is re-filled (:meth:`_component`); every other flow keeps its rate.
    Within a component the water-filling is the same computation as over all flows, in the
    same (start) order, so rates equal a full recompute's; the one difference is float
    noise, when two components' fill levels are within ``SHARE_REL_TOL`` of each other and a
    full recompute would have frozen them in one round (tests/sim/test_network_properties.py
    compares the two on random flow sets).
    """

    def __init__(self, engine: Engine, topology: Topology,
                 on_rates_changed: Callable[[FlowNetwork], None] | None = None) -> None:
        self.engine = engine
        self.topology = topology
        self._on_rates_changed = on_rates_changed
        self._flows: dict[FlowId, Flow] = {}
        # Active flows per link, in start order (dicts as ordered sets): the component walk.
        self._link_flows: dict[LinkId, dict[FlowId, None]] = {}
        self._next_id = 0
        self._last_update_s = engine.now_s
        self._completion: EventHandle | None = None
        self._bytes_delivered = 0.0
        self._max_residual_bytes = 0.0
        self._flows_finished = 0
        self._peak_flows: dict[LinkId, int] = {}  # most flows a link carried at once

    # --- queries -------------------------------------------------------------------------

    @property
    def active_flows(self) -> Mapping[FlowId, Flow]:
        """Flows started and not yet finished or cancelled, in start order."""
        return MappingProxyType(self._flows)

    @property
    def bytes_delivered(self) -> float:
        """Integral of all flows' rates over time, in bytes (including cancelled flows' part)."""
        return self._bytes_delivered

    def peak_flows(self, link: LinkId) -> int:
        """The most flows ``link`` has carried at once (each shares it max-min fairly)."""
        return self._peak_flows.get(link, 0)

    @property
    def flows_finished(self) -> int:
        return self._flows_finished

    @property
    def max_residual_bytes(self) -> float:
        """Largest bytes-left snapped to zero at a completion: float noise, or a bug if large."""
        return self._max_residual_bytes

    def link_loads_bps(self) -> dict[LinkId, float]:
        """Sum of current rates per link, for links carrying at least one flow."""
        loads: dict[LinkId, float] = {}
        for f in self._flows.values():
            for link in f.path:
                loads[link] = loads.get(link, 0.0) + f.rate_bps
        return loads

    # --- changes -------------------------------------------------------------------------

    def start_flow(self, src: Node, dst: Node, size_bytes: float,
                   on_done: Callable[[Flow], None],
                   path: Sequence[LinkId] | None = None) -> Flow:
        """Start moving ``size_bytes`` from ``src`` to ``dst`` now; ``on_done(flow)`` at the end.

        A zero-byte flow completes at the current time (in an event, not synchronously).
        ``path`` overrides the topology's route: a cut-through TCP chain is one flow over the
        links of all its hops (:func:`chain_path`), so it moves at its bottleneck hop's rate
        and loads every hop's links with that rate. A link listed twice counts twice.
        """
        if not (0.0 <= size_bytes < math.inf):
            raise ValueError(f"size_bytes must be finite and >= 0, got {size_bytes!r}")
        if path is None:
            path = self.topology.path(src, dst)
        else:
            path = tuple(path)
            unknown = [link for link in path if link not in self.topology.capacity_bps]
            if not path or unknown:
                raise ValueError(f"path must be non-empty links of the topology, got {unknown}")
        self._advance()
        flow_id = FlowId(self._next_id)
        self._next_id += 1
        flow = Flow(flow_id, src, dst, size_bytes, path, self.engine.now_s, on_done)
        self._flows[flow_id] = flow
        self._attach(flow)
        self._rerate(path)
        return flow

    def cancel_flow(self, flow_id: FlowId) -> bool:
        """Abort a flow (e.g. its receiver died); ``on_done`` is not called. True if it was active."""
        if flow_id not in self._flows:
            return False
        self._advance()
        flow = self._flows.pop(flow_id)
        self._detach(flow)
        flow.rate_bps = 0.0
        self._rerate(flow.path)
        return True

    # --- internals -----------------------------------------------------------------------

    def _advance(self) -> None:
        """Charge every flow for the time since the last change (rates were constant)."""
        now = self.engine.now_s
        elapsed = now - self._last_update_s
        self._last_update_s = now
        if elapsed <= 0.0:
            return
        for f in self._flows.values():
            moved = min(f.remaining_bytes, f.rate_bps * elapsed / 8.0)
            f.remaining_bytes -= moved
            self._bytes_delivered += moved

    def _attach(self, flow: Flow) -> None:
        peak = self._peak_flows
        for link in flow.path:
            users = self._link_flows.setdefault(link, {})
            users[flow.flow_id] = None
            if len(users) > peak.get(link, 0):
                peak[link] = len(users)

    def _detach(self, flow: Flow) -> None:
        for link in flow.path:
            users = self._link_flows.get(link)
            if users is not None:
                users.pop(flow.flow_id, None)
                if not users:
                    del self._link_flows[link]

    def _component(self, links: Iterable[LinkId]) -> list[Flow]:
        """Active flows connected to ``links`` through shared links, in start order.

        Bounded: every link and every flow is visited at most once."""
        seen_links: set[LinkId] = set()
        seen: set[FlowId] = set()
        stack = list(links)
        while stack:
            link = stack.pop()
            if link in seen_links:
                continue
            seen_links.add(link)
            for fid in self._link_flows.get(link, ()):
                if fid not in seen:
                    seen.add(fid)
                    stack.extend(self._flows[fid].path)
        return [self._flows[fid] for fid in sorted(seen)]  # ids grow with start time

    def _rerate(self, touched: Iterable[LinkId]) -> None:
        """Recompute the rates of the flows connected to the ``touched`` links (every
        other flow's rate cannot change) and replace the pending completion event."""
        comp = self._component(touched)
        if comp:
            rates = max_min_rates({f.flow_id: f.path for f in comp}, self.topology.capacity_bps)
            for f in comp:
                f.rate_bps = rates[f.flow_id]
        if self._completion is not None:
            self.engine.cancel(self._completion)
            self._completion = None
        now = self.engine.now_s
        first: Flow | None = None
        first_s = math.inf
        for f in self._flows.values():  # strict < : ties go to the earlier-started flow
            at_s = now + f.remaining_bytes * 8.0 / f.rate_bps
            if at_s < first_s:
                first, first_s = f, at_s
        if first is not None:
            self._completion = self.engine.schedule(first_s, partial(self._complete, first.flow_id))
        if self._on_rates_changed is not None:
            self._on_rates_changed(self)

    def _complete(self, flow_id: FlowId) -> None:
        self._completion = None
        self._advance()
        done = []
        for f in self._flows.values():
            tol = max(FINISH_ABS_TOL_BYTES, FINISH_REL_TOL * f.size_bytes)
            if f.flow_id == flow_id or f.remaining_bytes <= tol:
                done.append(f)
        now = self.engine.now_s
        touched: dict[LinkId, None] = {}
        for f in done:
            del self._flows[f.flow_id]
            self._detach(f)
            touched.update(dict.fromkeys(f.path))
            # The residual is float noise (or the last instant's bytes): deliver it exactly.
            self._bytes_delivered += f.remaining_bytes
            self._max_residual_bytes = max(self._max_residual_bytes, f.remaining_bytes)
            f.remaining_bytes = 0.0
            f.rate_bps = 0.0
            f.finished_s = now
        self._flows_finished += len(done)
        # Rates first, callbacks second: a callback that starts a flow sees a settled network.
        self._rerate(touched)
        for f in done:
            f.on_done(f)
