"""Where a replica's model bytes come from: each tick's deploys get one sourcing plan per
model (local copy, a peer chain, the registry; policy/sourcing.py), and the controller
tracks which hosts are receiving which model so a later deploy joins the transfer under way
instead of starting another. A draining host's only copies are pushed to a peer."""

from __future__ import annotations

import dataclasses

from flashpoint.controller.state.cluster import ClusterRecords
from flashpoint.controller.state.events import (
    Command,
    DeployReplica,
    SourceAssignment,
    StartChain,
)
from flashpoint.controller.state.records import HostRecord, cold_source
from flashpoint.ids import ModelKey
from flashpoint.policy.sourcing import REGISTRY, plan_sourcing


class Sourcing(ClusterRecords):
    """Sourcing plans for deploys, model pushes off draining hosts, transfers in flight."""

    def _push_models(self, host: HostRecord, now_s: float) -> list[Command]:
        """Stream each model only ``host`` holds (of a registered function) to the live peer
        with the most free RAM for it (none when hosts never send to peers)."""
        if not self.peer_sends:
            return []
        sizes = {f.model_key: f.model_bytes for f in self.functions.values()}
        snap = self.snapshot(now_s)
        cmds: list[Command] = []
        for key in sorted(host.cached_models & set(sizes)):
            held = any(h.alive and not h.draining and key in h.cached_models
                       for h in self.hosts.values() if h.host_id != host.host_id)
            if held or any(k == key for _, k in self.receiving):
                continue
            peers = [h for h in snap.hosts if h.alive and not h.draining
                     and h.host_id != host.host_id and h.ram_free_bytes >= sizes[key]]
            if not peers:
                continue
            target = min(peers, key=lambda h: (-h.ram_free_bytes, h.host_id))
            tid = f"t-{self.epoch}{next(self._transfer_seq)}"
            self.receiving[(target.host_id, key)] = now_s
            self.inbound[(target.host_id, key)] = (tid, host.host_id)
            mk = ModelKey.parse(key)
            cmds.append(StartChain(tid, host.host_id, mk.name, mk.version, (target.host_id,),
                                   (REGISTRY,)))
        return cmds

    def _can_send(self, host: HostRecord, now_s: float) -> bool:
        """A draining host still sends the models it holds until its deadline nears (its RAM
        is the fastest copy; receivers fall back to the registry if it goes mid-stream)."""
        return not host.draining or (host.drain_deadline_s is not None
                                     and now_s < host.drain_deadline_s - self.drain_margin_s)

    def _settle_receiving(self, host: HostRecord) -> None:
        for key in [k for k in self.receiving if k[0] == host.host_id and k[1] in host.cached_models]:
            del self.receiving[key]
            self.inbound.pop(key, None)

    def _source(self, cmds: list[Command], now_s: float) -> list[Command]:
        """Attach a sourcing plan to this tick's deploys, one plan per model."""
        by_model: dict[str, list[DeployReplica]] = {}
        assigned: dict[str, SourceAssignment] = {}  # replica_id -> source
        for c in cmds:
            if not isinstance(c, DeployReplica):
                continue
            key = c.spec.model_key
            if c.stage is None:
                by_model.setdefault(key, []).append(c)
                continue
            # A stage pulls its own byte range first, then the rest (for completion): a
            # chain would deliver the bytes in file order, and the last stage would wait for
            # all of them.
            holders = tuple(h.host_id for h in self.hosts.values()
                            if h.alive and not h.draining and key in h.cached_models
                            and self.peer_sends)
            assigned[c.replica_id] = SourceAssignment("pull", fallback=(*holders, REGISTRY))
            self.receiving[(c.host_id, key)] = now_s
        extra: list[Command] = []
        for key, deploys in by_model.items():
            holders = [h.host_id for h in self.hosts.values()
                       if h.alive and key in h.cached_models and self._can_send(h, now_s)]
            receivers = [d.host_id for d in deploys if (d.host_id, key) not in self.receiving]
            plan = plan_sourcing(key, receivers, holders, registry_sends=self.registry_sends,
                                 max_chain_length=self.max_chain_length,
                                 peer_sends=self.peer_sends)
            per_host: dict[str, SourceAssignment] = {h: SourceAssignment("local") for h in plan.local}
            for d in deploys:
                if (d.host_id, key) in self.inbound:  # a peer chain is already on its way there
                    tid, sender = self.inbound[(d.host_id, key)]
                    per_host[d.host_id] = SourceAssignment(
                        "chain", tid, sender, fallback=(*plan.fallback,))
            for chain in plan.chains:
                tid = f"t-{self.epoch}{next(self._transfer_seq)}"
                fallback = tuple(h for h in plan.fallback if h not in chain.receivers)
                for i, host in enumerate(chain.receivers):
                    self.receiving[(host, key)] = now_s
                    if chain.sender == REGISTRY and i == 0:
                        per_host[host] = SourceAssignment("chain_head", tid, REGISTRY,
                                                          chain.receivers[1:], (REGISTRY,), fallback)
                    else:
                        per_host[host] = SourceAssignment("chain", tid, chain.sender,
                                                          fallback=fallback)
                if chain.sender != REGISTRY:
                    for host in chain.receivers:
                        self.inbound[(host, key)] = (tid, chain.sender)
                    mk = ModelKey.parse(key)
                    extra.append(StartChain(tid, chain.sender, mk.name, mk.version, chain.receivers,
                                            fallback))
            for d in deploys:
                if d.host_id in per_host:
                    assigned[d.replica_id] = per_host[d.host_id]
        out: list[Command] = []
        for c in cmds:
            if isinstance(c, DeployReplica) and c.replica_id in assigned:
                c = dataclasses.replace(c, source=assigned[c.replica_id])
                if (rec := self.replicas.get(c.replica_id)) is not None and c.stage is None:
                    rec.source = cold_source(c.source.kind, c.source.sender)
            out.append(c)
        # Receivers learn their chain (deploys) before the sender starts streaming to them.
        return out + extra
