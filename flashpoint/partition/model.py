"""The thesis's analytical model of a partitioned, pipelined model (seed 004, §4.2.1).

A model is an ordered list of layers, each profiled (:class:`LayerProfile`) with its weight
bytes, its execution time and the size of its output tensor. A *plan* cuts the layers into
``p`` contiguous parts, one GPU each; ``cuts`` are the indices of the first layer of parts
2..p (so ``0 < cut < n``, strictly increasing). For ``x`` requests served by ``P`` GPUs, the
thesis's Table 4.1 quantities are, for one plan:

* ``C`` — the longest cold start of any part (the parts load in parallel). A part's cold
  start is ``bytes * 8 / bandwidth_bps + overhead_s`` (:class:`CostModel`).
* ``E`` — the longest execution time of any part; ``N`` — the longest intermediate transfer
  (a cut after layer ``k`` moves layer ``k``'s output: ``output_bytes * 8 / link_bps +
  link_latency_s``); ``IN`` — the sum of the transfers.
* ``I(1)`` — the sum of all execution times; ``I(p) = I(1) + IN(p)`` (Eq 4.2).
* ``W(p, y, P) = max(E, N) * (ceil(y / floor(P/p)) - 1)`` (Eq 4.5): ``floor(P/p)`` pipelines
  each finish one request per bottleneck period ``B = max(E, N)``.
* ``T(p, y, P) = C + W(p, y, P) + I(p)`` (Eq 4.7) and ``T̄(p, x, P) = (1/x) Σ_{y=1..x}
  T(p, y, P)`` (Eq 4.8), computed in O(1) by :func:`queue_rounds_sum`.

Where this differs from the thesis text, on purpose:

* Eq 4.6 ``C(p) = C(1)/p`` assumes equal parts and no fixed cost; we use the actual longest
  part, and the fixed load overhead is paid once per part (not divided by ``p``, and not
  summed per layer: a part is one process, whatever its layer count).
* Eqs 4.3-4.5 print ``max_{k=0..P}``; the max runs over this plan's ``p`` parts (``E``) and
  ``p - 1`` cuts (``N``).
* Eq 4.8 prints ``T(p, x, P)`` inside ``Σ_{y=1..x}``; it must be ``T(p, y, P)`` (as printed,
  ``T̄`` would just equal ``T(p, x, P)``).
* A transfer is its own pipeline stage, overlapped with the next execution, as in Eq 4.3
  and §4.1.2 ("the next request starts on the upstream GPU while the tensor is in flight").
* ``W`` needs ``p <= P`` (``floor(P/p) = 0`` pipelines is no pipeline): such plans are
  invalid and :func:`pipelines` rejects them.

Bandwidths are bits per second (``_bps``, as everywhere in Flashpoint); sizes are bytes.
Pure code: no I/O, no clocks, nothing from ``rpc``/``actors``/``asyncio``/torch/NVML.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LayerProfile:
    """One layer's profile: weight ``bytes``, ``exec_s`` per request, ``output_bytes``.

    Profiles are worst case (non-local sourcing, cross-host transfers), as the thesis solves
    plans for (§4.2.2): locality can only make the real system faster.
    """

    name: str
    bytes: int
    exec_s: float
    output_bytes: int

    def __post_init__(self) -> None:
        if self.bytes < 0 or self.exec_s < 0 or self.output_bytes < 0:
            raise ValueError(f"layer {self.name!r}: sizes and times must be >= 0")

    @classmethod
    def from_manifest(cls, name: str, profile: Mapping[str, float]) -> LayerProfile:
        """From a manifest layer's ``profile`` (keys ``bytes``, ``exec_time_s``, ``output_bytes``)."""
        return cls(name, int(profile["bytes"]), float(profile["exec_time_s"]),
                   int(profile["output_bytes"]))


@dataclass(frozen=True)
class CostModel:
    """How profiles turn into times: explicit rates and fixed costs.

    * ``bandwidth_bps`` — rate at which one part's weights reach its GPU (bits/s), worst
      case (registry or a peer over the network, §4.2.2). Parts load in parallel over
      independent paths (§4.1.2), so each gets the whole rate.
    * ``overhead_s`` — fixed per-part cold-start cost (process, CUDA context, module build).
    * ``link_bps`` — GPU-to-GPU rate for intermediate tensors (bits/s).
    * ``link_latency_s`` — fixed cost of one intermediate transfer.
    """

    bandwidth_bps: float
    link_bps: float
    overhead_s: float = 0.0
    link_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and self.link_bps > 0):
            raise ValueError("bandwidth_bps and link_bps must be > 0")
        if self.overhead_s < 0 or self.link_latency_s < 0:
            raise ValueError("overhead_s and link_latency_s must be >= 0")

    def cold_s(self, size_bytes: int) -> float:
        """Cold start of a part holding ``size_bytes`` of weights."""
        return size_bytes * 8 / self.bandwidth_bps + self.overhead_s

    def transfer_s(self, size_bytes: int) -> float:
        """One intermediate transfer of ``size_bytes`` between consecutive parts."""
        return size_bytes * 8 / self.link_bps + self.link_latency_s

    def fingerprint(self) -> str:
        """Stable short hash of the fields (exact float bits), for cache keys and logs."""
        text = ";".join(f"{f.name}={float(getattr(self, f.name)).hex()}" for f in fields(self))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PartCost:
    """One part of a plan: layers ``first_layer..last_layer`` (inclusive).

    ``out_transfer_s`` is the transfer of its output to the next part (0 for the last part).
    """

    first_layer: int
    last_layer: int
    bytes: int
    cold_s: float
    exec_s: float
    out_transfer_s: float


@dataclass(frozen=True)
class PlanTerms:
    """Table 4.1 terms of one plan: ``C``, ``E``, ``N``, ``IN`` and ``I(1)``."""

    cold_s: float           # C
    exec_max_s: float       # E
    transfer_max_s: float   # N (0 with no cut)
    transfer_sum_s: float   # IN
    exec_sum_s: float       # I(1)

    @property
    def bottleneck_s(self) -> float:
        """``B = max(E, N)``: the pipeline period of Eqs 4.3/4.5."""
        return max(self.exec_max_s, self.transfer_max_s)

    @property
    def inference_s(self) -> float:
        """``I(p) = I(1) + IN(p)`` (Eq 4.2)."""
        return self.exec_sum_s + self.transfer_sum_s


@dataclass(frozen=True)
class Plan:
    """A partition plan with its mean latency ``tbar_s = T̄(p, x, P)`` (Eq 4.8).

    ``cuts`` are the first layers of parts 2..p; ``parts`` the per-part costs; ``terms``
    the Table 4.1 terms (``C``, ``E``, ``N``, ``IN``, ``I(1)``) they give.
    """

    cuts: tuple[int, ...]
    p: int
    x: int
    P: int
    tbar_s: float
    parts: tuple[PartCost, ...]
    terms: PlanTerms


def pipelines(p: int, P: int) -> int:
    """``floor(P/p)``: how many ``p``-part pipelines ``P`` GPUs hold (Eq 4.5); needs p <= P."""
    if p < 1 or P < p:
        raise ValueError(f"a {p}-part plan needs 1 <= p <= P GPUs (P={P})")
    return P // p


def queue_rounds_sum(x: int, g: int) -> int:
    """``Σ_{y=1..x} (ceil(y/g) - 1)`` in O(1): the waits of Eq 4.5 summed as Eq 4.8 needs.

    Requests come in rounds of ``g`` (one per pipeline); round ``k`` (1-based) waits ``k-1``
    periods. With ``q = floor(x/g)`` full rounds and ``r = x - q*g`` requests in the last,
    the sum is ``g*q*(q-1)/2 + r*q`` [derived; the thesis memoises the sums instead].
    It is convex in ``x`` with value 0 at 0, so ``queue_rounds_sum(x, g) / x`` never
    decreases with ``x``; and it never increases with ``g``.
    """
    if x < 0 or g < 1:
        raise ValueError(f"need x >= 0 and g >= 1 (x={x}, g={g})")
    q, r = divmod(x, g)
    return g * q * (q - 1) // 2 + r * q


def queue_factor(x: int, p: int, P: int) -> float:
    """``α = queue_rounds_sum(x, floor(P/p)) / x``: ``T̄ = C + I(p) + α·B`` (Eq 4.8)."""
    if x < 1:
        raise ValueError(f"T̄ needs x >= 1 requests (x={x})")
    return queue_rounds_sum(x, pipelines(p, P)) / x


def wait_s(terms: PlanTerms, p: int, y: int, P: int) -> float:
    """``W(p, y, P)`` (Eq 4.5): the ``y``-th request's wait, cold start excluded."""
    if y < 1:
        raise ValueError(f"request index y must be >= 1 (y={y})")
    g = pipelines(p, P)
    return terms.bottleneck_s * (-(-y // g) - 1)


def latency_s(terms: PlanTerms, p: int, y: int, P: int) -> float:
    """``T(p, y, P) = C + W(p, y, P) + I(p)`` (Eq 4.7, with ``C`` the actual longest part)."""
    return terms.cold_s + wait_s(terms, p, y, P) + terms.inference_s


def tbar_s(terms: PlanTerms, p: int, x: int, P: int) -> float:
    """``T̄(p, x, P)`` (Eq 4.8) in closed form: ``C + I(p) + B · Σ(ceil(y/g)-1) / x``.

    The solver evaluates exactly this expression (same operations, same order), so its
    optimum and :func:`evaluate` agree to the last bit.
    """
    return combine(terms.cold_s, terms.exec_sum_s, terms.transfer_sum_s, terms.bottleneck_s,
                   queue_factor(x, p, P))


def combine(cold_s: float, exec_sum_s: float, transfer_sum_s: float, bottleneck_s: float,
            alpha: float) -> float:
    """The one arithmetic form of ``T̄``: ``(C + (I(1) + IN)) + B·α``."""
    return (cold_s + (exec_sum_s + transfer_sum_s)) + bottleneck_s * alpha


def check_cuts(n: int, cuts: Sequence[int]) -> tuple[int, ...]:
    """Validate cut indices for ``n`` layers: strictly increasing, each in ``1..n-1``."""
    if n < 1:
        raise ValueError("a model needs at least one layer")
    out = tuple(int(c) for c in cuts)
    prev = 0
    for c in out:
        if not prev < c < n:
            raise ValueError(f"cuts must be strictly increasing in 1..{n - 1}: {out}")
        prev = c
    return out


def part_costs(profiles: Sequence[LayerProfile], cost: CostModel,
               cuts: Sequence[int]) -> tuple[PartCost, ...]:
    """Per-part bytes, cold start, execution time and outgoing transfer for ``cuts``."""
    n = len(profiles)
    bounds = (0, *check_cuts(n, cuts), n)
    parts = []
    for i, j in zip(bounds, bounds[1:], strict=False):
        size = 0
        ex = 0.0
        for layer in profiles[i:j]:
            size += layer.bytes
            ex += layer.exec_s
        out = cost.transfer_s(profiles[j - 1].output_bytes) if j < n else 0.0
        parts.append(PartCost(i, j - 1, size, cost.cold_s(size), ex, out))
    return tuple(parts)


def terms_of(parts: Sequence[PartCost], exec_sum_s: float) -> PlanTerms:
    """Table 4.1 terms from per-part costs; ``I(1)`` comes from the profiles, not the parts,
    so it is the same float for every plan (:func:`exec_sum_s`)."""
    transfers = [pc.out_transfer_s for pc in parts[:-1]]
    in_s = 0.0
    for t in transfers:  # left to right, as the solver accumulates it
        in_s += t
    return PlanTerms(cold_s=max(pc.cold_s for pc in parts),
                     exec_max_s=max(pc.exec_s for pc in parts),
                     transfer_max_s=max(transfers, default=0.0),
                     transfer_sum_s=in_s,
                     exec_sum_s=exec_sum_s)


def exec_sum_s(profiles: Sequence[LayerProfile]) -> float:
    """``I(1)``: the whole model's execution time, summed layer by layer from the left."""
    total = 0.0
    for layer in profiles:
        total += layer.exec_s
    return total


def evaluate(profiles: Sequence[LayerProfile], cost: CostModel, cuts: Sequence[int],
             x: int, P: int) -> Plan:
    """The plan for ``cuts`` with its ``T̄(p, x, P)`` (Eq 4.8)."""
    parts = part_costs(profiles, cost, cuts)
    terms = terms_of(parts, exec_sum_s(profiles))
    p = len(parts)
    return Plan(cuts=check_cuts(len(profiles), cuts), p=p, x=x, P=P,
                tbar_s=tbar_s(terms, p, x, P), parts=parts, terms=terms)
