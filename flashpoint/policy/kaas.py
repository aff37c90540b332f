"""Pure scheduling policies for a pool of KaaS executors (KaaS §4.1.4, digest §1.4, §5.5-5.6).

The pool is pull-based: whenever a request arrives or an executor finishes, the pool builds
a :class:`KaasPoolSnapshot` (executors, idle or not, with the cache keys they hold; pending
requests in arrival order with their buffers' cache keys and sizes) and asks a policy for
assignments of pending requests to idle executors. Memory the policy keeps (per-client
executor time, owners) is a frozen value passed in and returned.

* ``exclusive`` — the baseline (eTasks, a FaaS function owning a GPU): each client owns a
  pool of executors and only ever runs there. A client without an idle executor of its own
  takes one from the largest pool (ties: the pool least recently taken from) when
  ``|own| == 0 or |own| + 1 < |largest|`` (the authors' hysteresis; the paper's
  ``|own| < |largest|`` ping-pongs between pools whose sizes differ by one), else waits.
  A reassigned executor is restarted (``restart=True``: its caches are lost, a cold start).
* ``round_robin`` — idle executors taken in cyclic order, blind to caches.
* ``affinity`` — CFS-Affinity with byte-weighted affinity. For client c with head request r
  on idle executor w::

      score(c, w) = v[c] + K · L[c] · (1 − cached(r, w) / bytes(r))

  v[c] is c's accumulated executor time (charged with the expected L[c] when dispatched,
  corrected to the measured time when it finishes), L[c] its mean service time (EWMA), K the
  penalty factor (10, the paper's 10× average latency), cached(r, w) the bytes of r's
  buffers already in w's cache. The lowest score over all (client, idle executor) pairs is
  dispatched first, repeatedly (ties: more cached bytes, then the executor with the most free
  cache, then arrival order). The paper's penalty is all-or-nothing on an "affinitized"
  GPU it never defines; weighting by the fraction of bytes that would miss sends a client to
  the executor holding most of its data and makes a half-warm executor a half penalty.
  Fair share: c is preferred over a waiting client d only while
  v[c] ≤ v[d] + K·L[d], so a hot client (everything cached everywhere) runs ahead of any
  other by at most K·L[d] of executor time — no starvation. A client that becomes active
  again starts at the smallest v of the clients already active (CFS's min_vruntime), so
  idling does not bank credit to monopolise the pool later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

POLICY_NAMES = ("exclusive", "round_robin", "affinity")


@dataclass(frozen=True)
class KaasWorkerSnapshot:
    worker_id: str
    idle: bool
    cached_keys: frozenset[str] = frozenset()
    client: str | None = None  # the client it is serving now (None when idle)
    free_bytes: int = 0  # cache room left (ties go to the emptiest: new clients spread out)


@dataclass(frozen=True)
class KaasPendingSnapshot:
    request_id: str
    client: str
    arrival_s: float
    # (cache key or None for request-private buffers, size in bytes), one per buffer.
    buffers: tuple[tuple[str | None, int], ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.buffers)

    def cached_bytes(self, keys: frozenset[str]) -> int:
        return sum(size for key, size in self.buffers if key is not None and key in keys)


@dataclass(frozen=True)
class KaasPoolSnapshot:
    now_s: float
    workers: tuple[KaasWorkerSnapshot, ...]
    pending: tuple[KaasPendingSnapshot, ...]  # arrival order


@dataclass(frozen=True)
class ClientUsage:
    vtime_s: float = 0.0  # v[c]: executor time charged so far
    avg_service_s: float = 0.0  # L[c]: EWMA of measured service time; 0 = none yet


@dataclass(frozen=True)
class KaasPolicyMemory:
    usage: Mapping[str, ClientUsage] = field(default_factory=dict)
    active: frozenset[str] = frozenset()  # clients pending or running at the last decision
    owners: Mapping[str, str] = field(default_factory=dict)  # exclusive: worker -> client
    taken_at_s: Mapping[str, float] = field(default_factory=dict)  # exclusive: last loss
    rr_next: int = 0


@dataclass(frozen=True)
class KaasAssignment:
    request_id: str
    worker_id: str
    restart: bool = False  # exclusive: the worker changes owner and starts cold
    charge_s: float = 0.0  # executor time charged at dispatch (corrected on completion)


@dataclass(frozen=True)
class KaasDecision:
    assignments: tuple[KaasAssignment, ...] = ()


@dataclass(frozen=True)
class KaasPolicyParams:
    penalty_factor: float = 10.0  # K in the affinity score
    ewma_alpha: float = 0.2  # weight of the newest service time in L[c]


Policy = Callable[[KaasPoolSnapshot, KaasPolicyMemory, KaasPolicyParams],
                  tuple[KaasDecision, KaasPolicyMemory]]


def exclusive(snap: KaasPoolSnapshot, mem: KaasPolicyMemory,
              params: KaasPolicyParams) -> tuple[KaasDecision, KaasPolicyMemory]:
    owners = dict(mem.owners)
    taken = dict(mem.taken_at_s)
    idle = [w.worker_id for w in snap.workers if w.idle]
    out: list[KaasAssignment] = []
    for p in snap.pending:
        if not idle:
            break
        own = [w for w in idle if owners.get(w) == p.client]
        if own:
            out.append(KaasAssignment(p.request_id, own[0]))
            idle.remove(own[0])
            continue
        free = [w for w in idle if w not in owners]
        if free:
            owners[free[0]] = p.client
            out.append(KaasAssignment(p.request_id, free[0], restart=True))
            idle.remove(free[0])
            continue
        sizes: dict[str, int] = {}
        for c in owners.values():
            sizes[c] = sizes.get(c, 0) + 1
        mine = sizes.get(p.client, 0)
        others = [c for c in sizes if c != p.client]
        if not others:
            continue
        victim = min(others, key=lambda c: (-sizes[c], taken.get(c, float("-inf")), c))
        if not (mine == 0 or mine + 1 < sizes[victim]):
            continue  # already among the largest pools: wait for one of its own
        cand = [w for w in idle if owners.get(w) == victim]
        if not cand:
            continue  # the victim's executors are busy: one is taken when it frees up
        owners[cand[0]] = p.client
        taken[victim] = snap.now_s
        out.append(KaasAssignment(p.request_id, cand[0], restart=True))
        idle.remove(cand[0])
    return KaasDecision(tuple(out)), replace(mem, owners=owners, taken_at_s=taken)


def round_robin(snap: KaasPoolSnapshot, mem: KaasPolicyMemory,
                params: KaasPolicyParams) -> tuple[KaasDecision, KaasPolicyMemory]:
    n = len(snap.workers)
    idle = {w.worker_id for w in snap.workers if w.idle}
    nxt = mem.rr_next % n if n else 0
    out: list[KaasAssignment] = []
    for p in snap.pending:
        if not idle:
            break
        for step in range(n):
            w = snap.workers[(nxt + step) % n].worker_id
            if w in idle:
                out.append(KaasAssignment(p.request_id, w))
                idle.remove(w)
                nxt = (nxt + step + 1) % n
                break
    return KaasDecision(tuple(out)), replace(mem, rr_next=nxt)


def affinity(snap: KaasPoolSnapshot, mem: KaasPolicyMemory,
             params: KaasPolicyParams) -> tuple[KaasDecision, KaasPolicyMemory]:
    usage = dict(mem.usage)
    running = {w.client for w in snap.workers if not w.idle and w.client is not None}
    queues: dict[str, list[KaasPendingSnapshot]] = {}
    for p in snap.pending:
        queues.setdefault(p.client, []).append(p)
    active = frozenset(queues) | frozenset(running)
    # CFS min_vruntime: a client waking up starts level with the least-served active one.
    staying = [usage.get(c, ClientUsage()).vtime_s for c in active & mem.active]
    if staying:
        floor = min(staying)
        for c in active - mem.active:
            u = usage.get(c, ClientUsage())
            if u.vtime_s < floor:
                usage[c] = replace(u, vtime_s=floor)
    idle = [w for w in snap.workers if w.idle]
    order = {p.request_id: i for i, p in enumerate(snap.pending)}
    out: list[KaasAssignment] = []
    while idle and queues:
        best: tuple | None = None
        for c, q in queues.items():
            head = q[0]
            u = usage.get(c, ClientUsage())
            total = head.total_bytes or 1
            for wi, w in enumerate(idle):
                cached = head.cached_bytes(w.cached_keys)
                score = u.vtime_s + params.penalty_factor * u.avg_service_s * (
                    1.0 - cached / total)
                rank = (score, -cached, -w.free_bytes, order[head.request_id], wi)
                if best is None or rank < best[0]:
                    best = (rank, c, wi)
        assert best is not None
        _, c, wi = best
        head = queues[c].pop(0)
        if not queues[c]:
            del queues[c]
        w = idle.pop(wi)
        u = usage.get(c, ClientUsage())
        usage[c] = replace(u, vtime_s=u.vtime_s + u.avg_service_s)
        out.append(KaasAssignment(head.request_id, w.worker_id, charge_s=u.avg_service_s))
    return KaasDecision(tuple(out)), replace(mem, usage=usage, active=active)


POLICIES: dict[str, Policy] = {"exclusive": exclusive, "round_robin": round_robin,
                               "affinity": affinity}


def decide(name: str, snap: KaasPoolSnapshot, mem: KaasPolicyMemory,
           params: KaasPolicyParams | None = None) -> tuple[KaasDecision, KaasPolicyMemory]:
    """Run the policy registered as ``name``; every assignment pairs a pending request
    with an idle worker, each at most once."""
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown KaaS pool policy {name!r}; known: {POLICY_NAMES}") from None
    return policy(snap, mem, params or KaasPolicyParams())


def record_completion(mem: KaasPolicyMemory, client: str, service_s: float, charged_s: float,
                      params: KaasPolicyParams | None = None) -> KaasPolicyMemory:
    """Charge ``client`` its measured executor time (minus what dispatch already charged)
    and fold it into its mean service time L."""
    params = params or KaasPolicyParams()
    usage = dict(mem.usage)
    u = usage.get(client, ClientUsage())
    avg = service_s if u.avg_service_s == 0 else (
        params.ewma_alpha * service_s + (1 - params.ewma_alpha) * u.avg_service_s)
    usage[client] = ClientUsage(vtime_s=u.vtime_s + service_s - charged_s, avg_service_s=avg)
    return replace(mem, usage=usage)
