"""Receiver selection for a scale-up: the thesis's Pareto-optimal greedy placement (§5.2.3).

Scale-ups arrive in bursts. Packing every new replica onto a few hosts makes most of them wait
for a host-to-host download; spreading one per host wastes GPUs whose host already holds the
model in RAM (an 18× warm-start cold start instead of 232× from a remote host, §8.2.1). The
thesis takes the middle path, in two stages:

1. **Holders.** Every eligible GPU on a host that already holds the model in RAM.
2. **Priming.** For the replicas left, one GPU per new host: that GPU is the first to load the
   model there, and the host then holds it for the next burst.

The printed Listing 5.1 is wrong and is *not* what this module implements: an unconditional
``break`` after the inner ``if`` examines only the first GPU of every host (so holders are
never filled), hosts are never ordered into the two stages, ``leftover_scale`` is never
initialised and ``reserve(gpu, fd)`` names an undefined ``fd``. This follows the prose, with
the choices the thesis leaves open documented here:

* **Eligibility** (§5.2.1): device memory free ≥ ``device_bytes`` and device compute free ≥
  ``compute``; host RAM for the worker process (``process_bytes``) on a holder, and for the
  download plus the process (``host_bytes + process_bytes``) on a new host. Dead and draining
  hosts are never used. Everything is reserved as GPUs are chosen, so one decision never
  over-commits a device or a host; a second replica on a host shares its one download.
* **Order in stage 1** (not specified): holder hosts with fewer replicas first, then by id;
  within a host, the device with the most free memory, then fewest replicas, then id.
* **Order in stage 2** (not specified; hosts are "list_of_hosts" order in the thesis): hosts
  under the same leaf switch as a sender (an alive, non-draining holder: the registry has no
  leaf) first, because their download crosses no spine link; then fewest hops to the
  registry; then fewer replicas on the host; then host id, so the decision is deterministic.
  The host's first eligible GPU is its best one in the stage-1 device order.
* **Stage 3, when new hosts run out** (the thesis is silent). A user who asked for ``count``
  replicas expects ``count`` replicas whenever the cluster has room, so the rest still go
  somewhere, cheapest first: (a) the unused GPUs of hosts primed in stage 2, in stage-2 order
  — they share the download already under way, so they cost no extra transfer; (b) only then
  a second replica on a GPU chosen in this decision, holders before primed hosts, most free
  memory first. A second process on one GPU shares its compute, and the thesis scales out on
  new physical GPUs (§5.2.1), so stacking is the last resort and only where the memory and
  compute reservations allow it. Stage 2 has already visited every usable host that could
  take the download, so there is no "any other host" left to try.
* Whatever cannot be placed is counted in :attr:`PlacementDecision.unplaced`, with the
  binding constraint in :attr:`PlacementDecision.reason`.

Cost: O(D + H log H + (n + D) log D) for D devices, H hosts and n replicas: each stage walks
pre-sorted candidates once and stacking uses a heap, never a scan of every device per replica.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from flashpoint.policy.snapshot import ClusterSnapshot, DeviceSnapshot, HostSnapshot

# Compute is a float fraction reserved by repeated subtraction: ten replicas of 0.1 must fit
# an idle device although 1.0 - 9 * 0.1 < 0.1 in binary floating point.
COMPUTE_EPSILON = 1e-9

_T = TypeVar("_T")


@dataclass(frozen=True)
class PlacementRequest:
    function: str
    model_key: str  # "name@version"
    count: int  # replicas wanted; 0 or less places nothing
    device_bytes: int  # memory one replica needs on its device
    host_bytes: int  # host RAM the model's download needs on a host that does not hold it
    compute: float = 0.0  # fraction of one device's compute a replica needs (profiled mean)
    process_bytes: int = 0  # host RAM of one replica's worker process

    def __post_init__(self) -> None:
        if min(self.device_bytes, self.host_bytes, self.process_bytes) < 0:
            raise ValueError("placement byte sizes must be >= 0")
        if not (math.isfinite(self.compute) and self.compute >= 0.0):
            raise ValueError(f"compute must be a finite fraction >= 0, got {self.compute}")


@dataclass(frozen=True)
class Placement:
    host_id: str
    device_id: str


@dataclass(frozen=True)
class PlacementDecision:
    """Where a scale-up's replicas go.

    ``placements`` are in choice order (holders, primed hosts, packing, stacking);
    ``unplaced`` replicas found no room and ``reason`` says why ("" when all were placed);
    ``downloads`` are the hosts that must fetch the model (receivers for a sender), in the
    order they were chosen.
    """

    placements: tuple[Placement, ...]
    unplaced: int
    reason: str
    downloads: tuple[str, ...] = ()


class _Device:
    """One device's resources as this decision reserves them."""

    __slots__ = ("snap", "free_bytes", "compute_free", "replicas", "used")

    def __init__(self, snap: DeviceSnapshot) -> None:
        self.snap = snap
        self.free_bytes = snap.memory_free_bytes
        self.compute_free = snap.compute_free
        self.replicas = snap.replicas
        self.used = False  # got a replica in this decision


class _Host:
    """One live, non-draining host; its devices are built on first use (a small scale-up
    touches a few hosts, and the bench's 1,000 small decisions should not pay for all)."""

    __slots__ = ("snap", "ram_bytes", "holder", "primed", "_replicas", "_devices")

    def __init__(self, snap: HostSnapshot, model_key: str) -> None:
        self.snap = snap
        self.ram_bytes = snap.ram_free_bytes
        self.holder = model_key in snap.cached_models
        self.primed = False  # chosen to download the model in this decision
        self._replicas: int | None = None
        self._devices: list[_Device] | None = None

    @property
    def replicas(self) -> int:
        """Replicas on the host, this decision's included (summed on first use: it was half
        the cost of a small decision when summed for every host)."""
        if self._replicas is None:
            self._replicas = sum(d.replicas for d in self.snap.devices)
        return self._replicas

    def add_replica(self) -> None:
        self._replicas = self.replicas + 1

    @property
    def devices(self) -> list[_Device]:
        """Devices, best first: most free memory, then fewest replicas, then id."""
        if self._devices is None:
            self._devices = [_Device(d) for d in sorted(
                self.snap.devices, key=lambda d: (-d.memory_free_bytes, d.replicas, d.device_id))]
        return self._devices


class _Ledger:
    """Reservations of one decision: the checks and the bookkeeping every stage shares."""

    def __init__(self, snapshot: ClusterSnapshot, req: PlacementRequest) -> None:
        self.req = req
        self.hosts = [_Host(h, req.model_key) for h in snapshot.hosts
                      if h.alive and not h.draining]
        self.placements: list[Placement] = []
        self.primed: list[_Host] = []  # hosts that download the model, in choice order

    def device_fits(self, d: _Device) -> bool:
        return (d.free_bytes >= self.req.device_bytes
                and d.compute_free + COMPUTE_EPSILON >= self.req.compute)

    def ram_needed(self, h: _Host) -> int:
        """A host holding the model (or downloading it already) needs RAM for the process
        only; any other host also for the download."""
        shared = h.holder or h.primed
        return self.req.process_bytes + (0 if shared else self.req.host_bytes)

    def fits(self, h: _Host, d: _Device) -> bool:
        return self.device_fits(d) and h.ram_bytes >= self.ram_needed(h)

    def take(self, h: _Host, d: _Device) -> None:
        h.ram_bytes -= self.ram_needed(h)
        if not h.holder and not h.primed:
            h.primed = True
            self.primed.append(h)
        h.add_replica()
        d.free_bytes -= self.req.device_bytes
        d.compute_free -= self.req.compute
        d.replicas += 1
        d.used = True
        self.placements.append(Placement(h.snap.host_id, d.snap.device_id))


def select_receivers(snapshot: ClusterSnapshot, req: PlacementRequest) -> PlacementDecision:
    """Choose GPUs for ``req.count`` new replicas: holders first, then one GPU per new host.

    The thesis's §5.2.3 placement as its prose describes it (Listing 5.1 as printed only ever
    examines each host's first GPU and never orders hosts); see the module docstring for the
    order within each stage and for stage 3, which the thesis does not cover. Pure: reads the
    snapshot, reserves in a private ledger, returns the decision.
    """
    want = max(0, req.count)
    ledger = _Ledger(snapshot, req)
    if want:
        _fill_holders(ledger, want)
    if len(ledger.placements) < want:
        _prime_new_hosts(ledger, want)
    if len(ledger.placements) < want:
        _pack_primed_hosts(ledger, want)
    if len(ledger.placements) < want:
        _stack(ledger, want)
    unplaced = want - len(ledger.placements)
    reason = _reason(ledger, snapshot, want) if unplaced else ""
    return PlacementDecision(tuple(ledger.placements), unplaced, reason,
                             tuple(h.snap.host_id for h in ledger.primed))


def place(snapshot: ClusterSnapshot, req: PlacementRequest) -> list[Placement]:
    """Up to ``req.count`` placements; fewer when the cluster has no room.

    Kept for existing callers; :func:`select_receivers` also says why some were not placed.
    """
    return list(select_receivers(snapshot, req).placements)


def _fill_holders(ledger: _Ledger, want: int) -> None:
    """Stage 1: every eligible GPU on hosts holding the model, one replica each."""
    holders = sorted((h for h in ledger.hosts if h.holder),
                     key=lambda h: (h.replicas, h.snap.host_id))
    for h in holders:
        for d in h.devices:
            if len(ledger.placements) >= want:
                return
            if h.ram_bytes < ledger.ram_needed(h):
                break  # no RAM for another process here; RAM only shrinks in a decision
            if ledger.device_fits(d):
                ledger.take(h, d)


def _prime_new_hosts(ledger: _Ledger, want: int) -> None:
    """Stage 2: one GPU on each host that does not hold the model, best hosts first."""
    sender_leaves = {h.snap.leaf for h in ledger.hosts if h.holder and h.snap.leaf}

    def near(h: _Host) -> tuple[int, int]:
        return 0 if h.snap.leaf in sender_leaves else 1, h.snap.hops

    others = _lazy_sorted((h for h in ledger.hosts if not h.holder), near,
                          lambda h: (h.replicas, h.snap.host_id))
    for h in others:
        if len(ledger.placements) >= want:
            return
        if h.ram_bytes < ledger.ram_needed(h):
            continue  # cannot hold the download and the process
        for d in h.devices:
            if ledger.device_fits(d):
                ledger.take(h, d)
                break  # one GPU per new host: the rest wait for stage 3


def _pack_primed_hosts(ledger: _Ledger, want: int) -> None:
    """Stage 3a: the other GPUs of hosts primed in stage 2; they share its download."""
    for h in list(ledger.primed):  # stage 2 order; packing primes no new host
        for d in h.devices:
            if len(ledger.placements) >= want:
                return
            if h.ram_bytes < ledger.ram_needed(h):
                break
            if not d.used and ledger.device_fits(d):
                ledger.take(h, d)


def _stack(ledger: _Ledger, want: int) -> None:
    """Stage 3b: more replicas on GPUs of hosts that hold the model or are fetching it,
    holders first, then the device with the most free memory; last resort (shares compute).

    A heap of candidates: each pop either places a replica (at most ``want``) or drops a
    device for good, since a decision only ever shrinks free memory, compute and RAM.
    """
    heap: list[tuple[int, int, int, str, str, int, _Host, _Device]] = []
    seq = 0
    for h in ledger.hosts:
        if not (h.holder or h.primed):
            continue
        for d in h.devices:
            if ledger.fits(h, d):
                heap.append((0 if h.holder else 1, -d.free_bytes, d.replicas, h.snap.host_id,
                             d.snap.device_id, seq, h, d))
                seq += 1
    heapq.heapify(heap)
    while heap and len(ledger.placements) < want:
        tier, _, _, host_id, device_id, _, h, d = heapq.heappop(heap)
        if not ledger.fits(h, d):
            continue  # another device on this host used up its RAM
        ledger.take(h, d)
        if ledger.fits(h, d):
            heapq.heappush(heap, (tier, -d.free_bytes, d.replicas, host_id, device_id, seq, h, d))
            seq += 1


def _lazy_sorted(items: Iterable[_T], coarse: Callable[[_T], tuple[int, int]],
                 fine: Callable[[_T], tuple[int, str]]) -> Iterator[_T]:
    """``items`` sorted by ``(coarse, fine)``, computing ``fine`` only for the groups of equal
    ``coarse`` key that the caller reaches: a scale-up of 10 reads a leaf's worth of hosts, not
    every host's replica count."""
    for _, group in itertools.groupby(sorted(items, key=coarse), key=coarse):
        yield from sorted(group, key=fine)


def _reason(ledger: _Ledger, snapshot: ClusterSnapshot, want: int) -> str:
    """The binding constraint once no device can take another replica."""
    req = ledger.req
    placed = len(ledger.placements)
    prefix = f"placed {placed} of {want}: " if placed else ""
    if not snapshot.hosts:
        return prefix + "the cluster has no hosts"
    if not ledger.hosts:
        return prefix + "no host is alive and not draining"
    memory = [(h, d) for h in ledger.hosts for d in h.devices if d.free_bytes >= req.device_bytes]
    if not memory:
        return prefix + (f"no live non-draining host has a device with {req.device_bytes} "
                         f"free bytes")
    compute = [(h, d) for h, d in memory if ledger.device_fits(d)]
    if not compute:
        return prefix + (f"no device with {req.device_bytes} free bytes has {req.compute:g} "
                         f"of its compute free")
    return prefix + (f"hosts with a fitting device lack RAM to download the model and start "
                     f"its process ({req.host_bytes + req.process_bytes} bytes), or to start "
                     f"the process where the model is in RAM ({req.process_bytes} bytes)")
