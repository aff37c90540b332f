"""Where a scale-up's model bytes come from: own RAM, a peer's RAM, or the registry.

The thesis's sourcing hierarchy (seed 004, Ch. 5) as one pure decision. For one model and
the hosts that must hold it after this scale-up:

* a receiver that already holds the model complete in RAM uses it (``local``);
* every other receiver is put on a TCP chain. There is one chain per sender: every host that
  holds the model complete is a sender, and so is the registry (its chain is headed by the
  first receiver, which pulls from the registry and relays as it goes). Receivers are spread
  evenly over the senders (chain lengths differ by at most one) — with cut-through relaying a
  chain's time barely depends on its length, so more chains buy failure isolation and spread
  the senders' uplinks rather than speed;
* each receiver's fallback list (used when its chain breaks and nobody splices it back) names
  the peers that hold the model, then the registry: peer RAM before the registry, always.

The registry is a sender only while it is cheaper to use it than to lengthen a peer chain:
``registry_sends`` says whether it heads a chain when peers hold the model (default on, as
the thesis does; an operator whose registry is far slower than the cluster network turns it
off). With no holder at all the registry always heads the single chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REGISTRY = "registry"


@dataclass(frozen=True)
class ChainPlan:
    """One chain: ``sender`` (a holder's host id, or ``REGISTRY``) then ``receivers`` in order."""

    sender: str
    receivers: tuple[str, ...]


@dataclass(frozen=True)
class SourcingPlan:
    model_key: str
    local: tuple[str, ...]  # receivers that already hold the model
    chains: tuple[ChainPlan, ...]
    fallback: tuple[str, ...]  # holders, then REGISTRY: where a broken chain's receiver pulls from

    def chain_of(self, host_id: str) -> ChainPlan | None:
        for chain in self.chains:
            if host_id in chain.receivers:
                return chain
        return None


def plan_sourcing(model_key: str, receivers: Sequence[str], holders: Sequence[str], *,
                  registry_sends: bool = True) -> SourcingPlan:
    """The sourcing plan for ``receivers`` (host ids, duplicates ignored, order kept).

    ``holders`` are live hosts holding ``model_key`` complete in RAM (any order; sorted here
    so the plan is deterministic).
    """
    seen: set[str] = set()
    order = [h for h in receivers if not (h in seen or seen.add(h))]
    holding = set(holders)
    local = tuple(h for h in order if h in holding)
    need = [h for h in order if h not in holding]
    peers = sorted(holding)
    senders: list[str] = list(peers)
    if registry_sends or not senders:
        senders.append(REGISTRY)
    # Only as many chains as there are receivers: an empty chain is no chain.
    senders = senders[: max(len(need), 0)]
    buckets: dict[str, list[str]] = {s: [] for s in senders}
    for i, host in enumerate(need):
        buckets[senders[i % len(senders)]].append(host)
    chains = tuple(ChainPlan(s, tuple(buckets[s])) for s in senders if buckets[s])
    return SourcingPlan(model_key, local, chains, (*peers, REGISTRY))
