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

Chain length is capped (``max_chain_length``, 0 = no cap). A relay forwards each frame as
it arrives, so a hop costs little bandwidth, but the tail's first byte (what
execute-while-load waits for) and the blast radius of one failed relay both grow with the
length; ``bench/multicast.py`` measured 8-host chains at 1.05× one point-to-point transfer,
and nothing longer. When the receivers need more chains than there are senders, senders head
several chains each, round-robin (their uplink is then shared; the registry serves many
readers at once, a holder's NIC does not, so extra chains go to the registry first when it
sends).

The registry is a sender only while it is cheaper to use it than to lengthen a peer chain:
``registry_sends`` says whether it heads a chain when peers hold the model (default on, as
the thesis does; an operator whose registry is far slower than the cluster network turns it
off). With no holder at all the registry always heads the single chain.

``peer_sends`` (default on) says whether holders send at all. Off, a holder's copy serves
only its own host (``local``) and every other receiver is on a registry chain: the
GPU-enabled-FaaS locality baseline (thesis §8.2.2, [117]), which keeps model data in host
RAM and prefers those hosts but has no remote-host-RAM source.
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
                  registry_sends: bool = True, max_chain_length: int = 0,
                  peer_sends: bool = True) -> SourcingPlan:
    """The sourcing plan for ``receivers`` (host ids, duplicates ignored, order kept).

    ``holders`` are live hosts holding ``model_key`` complete in RAM (any order; sorted here
    so the plan is deterministic).
    """
    seen: set[str] = set()
    order = [h for h in receivers if not (h in seen or seen.add(h))]
    holding = set(holders)
    local = tuple(h for h in order if h in holding)
    need = [h for h in order if h not in holding]
    peers = sorted(holding) if peer_sends else []
    senders: list[str] = list(peers)
    if registry_sends or not senders:
        senders.append(REGISTRY)
    if max_chain_length < 0:
        raise ValueError("max_chain_length must be >= 0 (0 = no cap)")
    chains_needed = len(senders)
    if max_chain_length and len(need) > chains_needed * max_chain_length:
        chains_needed = -(-len(need) // max_chain_length)
    # Extra chains go to the registry first (it serves many readers at once), then to the
    # holders in turn.
    extra = [REGISTRY] if REGISTRY in senders else []
    extra += [s for s in senders if s != REGISTRY]
    heads = senders + [extra[i % len(extra)] for i in range(chains_needed - len(senders))]
    # Only as many chains as there are receivers: an empty chain is no chain.
    heads = heads[: max(len(need), 0)]
    buckets: list[list[str]] = [[] for _ in heads]
    for i, host in enumerate(need):
        buckets[i % len(heads)].append(host)
    chains = tuple(ChainPlan(s, tuple(b)) for s, b in zip(heads, buckets, strict=True) if b)
    return SourcingPlan(model_key, local, chains, (*peers, REGISTRY))
