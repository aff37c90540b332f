"""Retiring replicas, and partitioned replica groups from their stages' start to their
dissolution (thesis §4.2.5): a group serves as one pipeline once every stage serves and is
linked, and dissolves once its stages have completed into whole replicas or it stops."""

from __future__ import annotations

from flashpoint.controller.state.cluster import ClusterRecords
from flashpoint.controller.state.events import (
    BeginCompletion,
    Command,
    DissolveStages,
    ForgetReplica,
    GroupAnswered,
    GroupLinked,
    LinkGroup,
    ServeGroup,
    StageReady,
    StopAccepting,
    StopReplica,
)
from flashpoint.controller.state.records import GroupPhase, GroupRecord, ReplicaPhase


class GroupLifecycle(ClusterRecords):
    """Retirement (no new work, stopped once idle) and the partitioned groups' phases."""

    def _retire(self, reps: object) -> list[Command]:
        cmds: list[Command] = []
        for rep in list(reps):  # type: ignore[call-overload]
            group = self.groups.get(rep.group_id) if rep.group_id else None
            if group is not None:
                # A stage may carry pipeline requests: the group stops taking work first
                # and its stages stop when it dissolves (see _dissolve).
                cmds += self._stop_group(group, "retired")
                continue
            if rep.phase == ReplicaPhase.STARTING:
                # Nothing dispatched to it yet: stop at once.
                del self.replicas[rep.replica_id]
                cmds += [ForgetReplica(rep.replica_id), StopReplica(rep.replica_id, rep.host_id)]
            elif rep.phase == ReplicaPhase.WARM:
                rep.phase = ReplicaPhase.STOPPING
                cmds.append(StopAccepting(rep.replica_id))
        return cmds

    def _stage_ready(self, ev: StageReady) -> list[Command]:
        rep = self.replicas.get(ev.replica_id)
        group = self.groups.get(rep.group_id) if rep is not None and rep.group_id else None
        if group is None or group.phase != GroupPhase.STARTING:
            return []
        group.ready.add(ev.replica_id)
        if not group.ready >= set(group.stages):
            return []
        group.phase = GroupPhase.LINKING
        return [LinkGroup(group.group_id, group.function,
                          tuple((r, self.replicas[r].host_id) for r in group.stages))]

    def _group_linked(self, ev: GroupLinked) -> list[Command]:
        group = self.groups.get(ev.group_id)
        if group is None or group.phase != GroupPhase.LINKING:
            # Dissolved or stopping meanwhile: close what the actor opened.
            return [ForgetReplica(ev.group_id)] if ev.ok else []
        if not ev.ok:
            return self._stop_group(group, f"link failed: {ev.reason}")
        group.phase, group.serving_s = GroupPhase.SERVING, ev.now_s
        fn = self.functions.get(group.function)
        return [ServeGroup(group.group_id, group.function,
                           fn.spec.replica_concurrency if fn is not None else 1)]

    def _group_answered(self, ev: GroupAnswered) -> list[Command]:
        """Its first answer releases the stages' held background work, once per group."""
        group = self.groups.get(ev.group_id)
        if group is None or group.answered:
            return []
        group.answered = True
        return [BeginCompletion(group.group_id, tuple(
            (r, self.replicas[r].host_id) for r in group.stages if r in self.replicas))]

    def _stop_group(self, group: GroupRecord, reason: str) -> list[Command]:
        """No new work for the group; it dissolves at the first tick with none in flight."""
        if group.phase == GroupPhase.STOPPING:
            return []
        serving = group.phase == GroupPhase.SERVING
        group.phase, group.reason = GroupPhase.STOPPING, reason
        return [StopAccepting(group.group_id)] if serving else []

    def _dissolve(self, group: GroupRecord) -> list[Command]:
        """The pipeline is gone; its stages live on as the replicas they complete into,
        unless the group was retired (then they stop too)."""
        del self.groups[group.group_id]
        members = [self.replicas[r] for r in group.stages if r in self.replicas]
        for rep in members:
            rep.group_id = None
        cmds: list[Command] = [ForgetReplica(group.group_id), DissolveStages(
            group.group_id, tuple((r.replica_id, r.host_id) for r in members))]
        if group.reason == "retired":
            cmds += self._retire(members)
        return cmds

    def _settle_groups(self) -> list[Command]:
        """After every event: a group missing a stage cannot serve; a group whose stages all
        completed into whole replicas is no longer needed (thesis §4.2.5: it dissolves)."""
        cmds: list[Command] = []
        for group in list(self.groups.values()):
            if group.phase == GroupPhase.STOPPING:
                continue
            if any(r not in self.replicas for r in group.stages):
                cmds += self._stop_group(group, "stage lost")
            elif all(self.replicas[r].phase == ReplicaPhase.WARM for r in group.stages):
                cmds += self._stop_group(group, "completed")
        return cmds
