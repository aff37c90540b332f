"""ControllerState with partitioned replica groups (issue 4, item 7): plan on scale-up,
stages on different hosts pulling their own bytes, link, serve, dissolve; scale-down
retires groups first. Pure: events in, commands out."""

from __future__ import annotations

from flashpoint.controller.state.core import ControllerState
from flashpoint.controller.state.events import (
    BeginCompletion,
    DeployReplica,
    DissolveStages,
    ForgetReplica,
    FunctionLoad,
    FunctionUpserted,
    GroupAnswered,
    GroupLinked,
    HostHeartbeat,
    LinkGroup,
    ReplicaFailed,
    ReplicaWarmed,
    ServeGroup,
    StageReady,
    StopAccepting,
    StopReplica,
    Tick,
)
from flashpoint.controller.state.records import GroupPhase, ReplicaPhase
from flashpoint.partition.model import CostModel, LayerProfile
from flashpoint.partition.table import plan_table
from flashpoint.policy.sourcing import REGISTRY

from .test_controller_state import GIB, new_state, of, register, spec

MODEL_BYTES = 400 << 20
# Eight equal layers, transfer-dominated: a scale-up by several GPUs splits the model.
PROFILES = [LayerProfile(f"l{i}", MODEL_BYTES // 8, 0.001, 4096) for i in range(8)]
COST = CostModel(bandwidth_bps=1e9, link_bps=1e10, overhead_s=0.05)
TABLE = plan_table(PROFILES, COST, p_max=8, x_max=64)


def partitioned(hosts: int = 4, max_stages: int = 2, **kw) -> ControllerState:
    st = new_state()
    for i in range(hosts):
        register(st, f"h{i}", devices=1, mem=4 * GIB)
    st.handle(FunctionUpserted(spec(max_stages=max_stages, **kw), MODEL_BYTES, TABLE,
                               COST.cold_s(MODEL_BYTES)))
    return st


def burst(st: ControllerState, queued: int, now: float = 1.0, idle=frozenset()) -> list:
    return st.handle(Tick(now, {"fn": FunctionLoad(queued, 0, now, 5.0, 0.0)}, idle))


def test_scale_up_by_two_gpus_starts_one_two_stage_group_on_two_hosts():
    st = partitioned()
    cmds = burst(st, queued=8)  # concurrency 4: two replicas wanted
    deploys = of(cmds, DeployReplica)
    assert len(deploys) == 2 and len(st.groups) == 1
    (group,) = st.groups.values()
    assert [d.replica_id for d in deploys] == list(group.stages)
    assert {d.group_id for d in deploys} == {group.group_id}
    assert [d.stage for d in deploys] == [(0, 3), (4, 7)]  # equal layers: an even cut
    assert len({d.host_id for d in deploys}) == 2
    # Each stage pulls its own range first from the registry (no chain: a chain delivers
    # in file order, and the last stage would wait for every byte).
    assert all(d.source is not None and d.source.kind == "pull"
               and d.source.fallback == (REGISTRY,) for d in deploys)
    assert all(st.replicas[d.replica_id].phase == ReplicaPhase.STARTING for d in deploys)


def test_group_links_when_every_stage_serves_then_serves_as_one_target():
    st = partitioned()
    burst(st, queued=8)
    (group,) = st.groups.values()
    first, last = group.stages
    assert st.handle(StageReady(last, 2.0)) == []
    (link,) = of(st.handle(StageReady(first, 2.1)), LinkGroup)
    assert link.stages == ((first, st.replicas[first].host_id), (last, st.replicas[last].host_id))
    assert group.phase == GroupPhase.LINKING
    (serve,) = of(st.handle(GroupLinked(group.group_id, True, "", 2.2)), ServeGroup)
    assert (serve.group_id, serve.function, serve.credits) == (group.group_id, "fn", 4)
    assert group.phase == GroupPhase.SERVING


def _serving(st: ControllerState) -> tuple[str, tuple[str, ...]]:
    burst(st, queued=8)
    (group,) = st.groups.values()
    for rid in group.stages:
        st.handle(StageReady(rid, 2.0))
    st.handle(GroupLinked(group.group_id, True, "", 2.1))
    return group.group_id, group.stages


def test_the_first_answer_releases_completion_on_every_stage_host_once():
    st = partitioned()
    gid, stages = _serving(st)
    (begin,) = of(st.handle(GroupAnswered(gid)), BeginCompletion)
    assert begin == BeginCompletion(gid, tuple((r, st.replicas[r].host_id) for r in stages))
    assert st.handle(GroupAnswered(gid)) == []  # later answers: already released
    assert st.handle(GroupAnswered("no-such-group")) == []


def test_completed_stages_dissolve_the_group_into_whole_replicas():
    st = partitioned()
    gid, stages = _serving(st)
    assert st.handle(ReplicaWarmed(stages[0], {}, 3.0)) == []  # one stage complete: keep serving
    cmds = st.handle(ReplicaWarmed(stages[1], {}, 3.1))
    assert of(cmds, StopAccepting) == [StopAccepting(gid)]
    assert st.groups[gid].phase == GroupPhase.STOPPING
    # Not while a request is in the pipeline...
    assert not of(burst(st, queued=0, now=3.2), DissolveStages)
    # ...then the pipeline goes and both replicas stay, whole.
    cmds = burst(st, queued=0, now=3.3, idle=frozenset({gid}))
    assert ForgetReplica(gid) in cmds
    (dissolve,) = of(cmds, DissolveStages)
    assert [r for r, _ in dissolve.stages] == list(stages)
    assert gid not in st.groups and not of(cmds, StopReplica)
    assert all(st.replicas[r].phase == ReplicaPhase.WARM and st.replicas[r].group_id is None
               for r in stages)


def test_a_lost_stage_stops_the_group_and_the_other_stage_lives_on():
    st = partitioned()
    gid, (first, last) = _serving(st)
    cmds = st.handle(ReplicaFailed(last, "worker died", during_start=True))
    assert StopAccepting(gid) in cmds
    cmds = burst(st, queued=0, now=3.0, idle=frozenset({gid}))
    (dissolve,) = of(cmds, DissolveStages)
    assert [r for r, _ in dissolve.stages] == [first]
    assert first in st.replicas and first not in {c.replica_id for c in of(cmds, StopReplica)}


def test_a_failed_link_stops_the_group():
    st = partitioned()
    burst(st, queued=8)
    (group,) = st.groups.values()
    for rid in group.stages:
        st.handle(StageReady(rid, 2.0))
    assert st.handle(GroupLinked(group.group_id, False, "host gone", 2.1)) == []
    assert group.phase == GroupPhase.STOPPING and "host gone" in group.reason
    # A late successful link of a group already gone closes what the actor opened.
    burst(st, queued=8, now=2.2, idle=frozenset({group.group_id}))
    assert st.handle(GroupLinked(group.group_id, True, "", 2.3)) == [ForgetReplica(group.group_id)]


def test_scale_down_keeps_a_group_wider_than_the_excess():
    """Thesis §4.2.6: only groups that fit in the GPUs still to free are removed; a
    one-replica excess retires a whole replica, not the two-stage pipeline."""
    st = partitioned(max_stages=2, max_replicas=3, min_replicas=0)
    gid, _ = _serving(st)
    (whole,) = of(st.handle(Tick(3.0, {"fn": FunctionLoad(12, 0, 3.0)})), DeployReplica)
    st.handle(ReplicaWarmed(whole.replica_id, {}, 4.0))
    for h in st.hosts:
        st.handle(HostHeartbeat(h, frozenset(), 19.0))
    # Two replicas' worth of load (concurrency 4): one of the three to go.
    cmds = st.handle(Tick(20.0, {"fn": FunctionLoad(0, 8, 20.0 - 11)}))
    assert StopAccepting(gid) not in cmds and st.groups[gid].phase != GroupPhase.STOPPING
    assert StopAccepting(whole.replica_id) in cmds


def test_scale_down_retires_the_group_first_and_its_stages_with_it():
    st = partitioned(max_stages=2, max_replicas=3, min_replicas=0)
    gid, stages = _serving(st)
    # A third, whole replica.
    cmds = st.handle(Tick(3.0, {"fn": FunctionLoad(12, 0, 3.0)}))
    (whole,) = of(cmds, DeployReplica)
    assert whole.stage is None
    st.handle(ReplicaWarmed(whole.replica_id, {}, 4.0))
    for h in st.hosts:
        st.handle(HostHeartbeat(h, frozenset(), 19.0))
    # Load drops to one replica's worth after keep-alive: the group goes, the whole stays.
    cmds = st.handle(Tick(20.0, {"fn": FunctionLoad(0, 4, 20.0 - 11)}))
    assert StopAccepting(gid) in cmds and StopAccepting(whole.replica_id) not in cmds
    assert st.groups[gid].reason == "retired"
    # Stages of a retired group no longer count: the next tick retires nothing else.
    cmds = st.handle(Tick(20.1, {"fn": FunctionLoad(0, 4, 20.0 - 11)}))
    assert not of(cmds, StopAccepting)
    cmds = st.handle(Tick(20.2, {"fn": FunctionLoad(0, 4, 20.0 - 11)}, frozenset({gid})))
    stopped = {c.replica_id for c in of(cmds, StopReplica)}
    assert stopped == set(stages)  # still loading: stopped with the pipeline
    assert whole.replica_id in st.replicas


def test_holders_get_whole_replicas_and_the_rest_is_partitioned_pulling_from_them():
    st = new_state()
    register(st, "h0", cached={"m@1"}, mem=MODEL_BYTES + (1 << 20))  # room for one replica
    for i in (1, 2):
        register(st, f"h{i}")
    st.handle(FunctionUpserted(spec(max_stages=2), MODEL_BYTES, TABLE, 1.0))
    deploys = of(burst(st, queued=12), DeployReplica)  # concurrency 4: three replicas
    whole = [d for d in deploys if d.stage is None]
    stages = [d for d in deploys if d.stage is not None]
    assert [d.host_id for d in whole] == ["h0"] and whole[0].source.kind == "local"
    assert sorted(d.host_id for d in stages) == ["h1", "h2"] and len(st.groups) == 1
    assert all(d.source.kind == "pull" and d.source.fallback == ("h0", REGISTRY)
               for d in stages)


def test_no_partition_when_a_host_holds_the_model_or_hosts_are_too_few():
    held = new_state()
    register(held, "h0", cached={"m@1"})
    register(held, "h1")
    held.handle(FunctionUpserted(spec(max_stages=2), MODEL_BYTES, TABLE, 1.0))
    assert not of(burst(held, queued=8), DeployReplica)[0].stage and not held.groups

    one_host = new_state()
    register(one_host, "h0", devices=2)
    one_host.handle(FunctionUpserted(spec(max_stages=2), MODEL_BYTES, TABLE, 1.0))
    deploys = of(burst(one_host, queued=8), DeployReplica)
    assert len(deploys) == 2 and all(d.stage is None for d in deploys) and not one_host.groups


def test_max_stages_one_or_no_table_never_partitions():
    st = partitioned(max_stages=1)
    assert all(d.stage is None for d in of(burst(st, queued=8), DeployReplica))
    plain = new_state()
    for i in range(4):
        register(plain, f"h{i}")
    plain.handle(FunctionUpserted(spec(max_stages=4), MODEL_BYTES))
    assert all(d.stage is None for d in of(burst(plain, queued=16), DeployReplica))


def test_four_gpus_with_max_stages_four_make_one_four_stage_pipeline_or_two_of_two():
    st = partitioned(hosts=4, max_stages=4)
    deploys = of(burst(st, queued=16), DeployReplica)
    assert len(deploys) == 4
    sizes = sorted(len(g.stages) for g in st.groups.values())
    assert sizes in ([4], [2, 2])
    for g in st.groups.values():
        stages = [st.replicas[r].stage for r in g.stages]
        assert stages[0][0] == 0 and stages[-1][1] == 7
        assert all(a[1] + 1 == b[0] for a, b in zip(stages, stages[1:], strict=False))
        assert len({st.replicas[r].host_id for r in g.stages}) == len(g.stages)
