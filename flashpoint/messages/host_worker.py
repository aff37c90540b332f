"""Messages between a host manager and its worker processes (STYLE §6).

Host -> worker, on the connection the worker opened to its host's local endpoint:
``load_replica``, ``load_kaas``, ``complete_replica``, ``set_next_hop``, ``dissolve_stage``,
``replica_stats``, ``shutdown``. Worker -> host: ``worker_hello`` (once connected) and
``replica_served`` (after its replica's first answer). Field names are the wire names.
"""

from __future__ import annotations

from typing import Any

from flashpoint.messages.base import Message


class Ok(Message, kw_only=True):
    """The reply of a call that only acknowledges."""

    ok: bool = True


# worker -> host ----------------------------------------------------------------------------
class WorkerHello(Message, kw_only=True):
    """``worker_hello``: the worker process is up (torch imported) and listens on this link."""

    worker_id: str
    pid: int


class ReplicaServed(Message, kw_only=True):
    """``replica_served``: the worker's replica answered its first request (the warm pool
    holds its refill until then, so a new process does not compete for the CPU)."""

    worker_id: str


# host -> worker ----------------------------------------------------------------------------
class PipelineOptions(Message, kw_only=True):
    """How a stage replica serves its pipeline stage (pipeline/stage.py): where it listens
    (``port`` 0: any) and its next hop (an endpoint's wire form; None for the last stage or
    until ``set_next_hop``)."""

    listen_host: str = "127.0.0.1"
    port: int = 0
    next_hop: list[Any] | None = None


class WeightSlot(Message, kw_only=True):
    """Where replicas of one model on one GPU share weights by CUDA IPC (gpu/weight_share.py)."""

    dir: str
    key: str
    timeout_s: float = 60.0


class LoadReplica(Message, kw_only=True):
    """``load_replica``: map the cached model at ``cache_path`` and serve it, whole or as the
    layer range ``stage`` (inclusive); idempotent by ``replica_id``."""

    replica_id: str
    host_id: str = ""
    spec: dict[str, Any]  # FunctionSpec.to_dict()
    cache_path: str
    manifest_json: str
    controller_url: str
    device: str = "cpu"
    source: str = ""  # where the cold start got the model bytes (local, peer, registry...)
    stage: tuple[int, int] | None = None
    fetch_s: float = 0.0
    host_timings_s: dict[str, float] = {}  # the host's phases of this cold start
    pipeline: PipelineOptions | None = None
    weight_slot: WeightSlot | None = None
    env: dict[str, str] = {}  # applied before the worker initialises CUDA


class LoadReplicaReply(Message, kw_only=True):
    timings_s: dict[str, float]
    weights: str = ""  # "exporter" / "reader" when its weights are shared by IPC
    pipeline_endpoint: list[Any] | None = None  # a stage server's bound endpoint (wire form)


class LoadKaas(Message, kw_only=True):
    """``load_kaas``: become a KaaS executor replica with a device cache of ``cache_bytes``;
    idempotent by ``replica_id``."""

    replica_id: str
    host_id: str = ""
    controller_url: str
    cache_bytes: int
    device: str = "cpu"
    env: dict[str, str] = {}


class LoadKaasReply(Message, kw_only=True):
    timings_s: dict[str, float]


class CompleteReplica(Message, kw_only=True):
    """``complete_replica``: the host holds the whole model now; the stage becomes whole."""

    replica_id: str = ""


class CompleteReplicaReply(Message, kw_only=True):
    completed: bool
    timings_s: dict[str, float] = {}


class SetNextHop(Message, kw_only=True):
    """``set_next_hop``: where the stage forwards its activations (an endpoint's wire form)."""

    next_hop: list[Any] | None


class DissolveStage(Message, kw_only=True):
    """``dissolve_stage``: stop serving the pipeline stage (a completed replica stays)."""

    replica_id: str = ""


class DissolveStageReply(Message, kw_only=True):
    dissolved: bool


class ReplicaStats(Message, kw_only=True):
    """``replica_stats``: the host's ``/metrics`` scrape asks for the replica's counters."""


class ReplicaStatsReply(Message, kw_only=True):
    """``stats`` is a :meth:`~flashpoint.worker.replica_stats.ReplicaStats.snapshot`; empty
    while no whole replica is served (idle, loading, a stage, a KaaS executor)."""

    replica_id: str = ""
    function: str = ""
    stats: dict[str, Any] = {}


class Shutdown(Message, kw_only=True):
    """``shutdown``: exit once the reply has left."""
