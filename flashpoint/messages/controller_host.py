"""Typed messages between the controller and a host manager (both directions).

One Struct per request and reply; field names are today's wire names, so the bytes on the
wire are unchanged (``messages/base.py``). Domain values a message carries typed — the
deploy's :class:`~flashpoint.spec.FunctionSpec`, a :class:`~flashpoint.gpu.host_sharing.GpuShare`
— travel as their own wire form and are rebuilt, validated, once in ``__post_init__``; a bad
one is the BadRequest it always was. The source plan of a deploy is a tagged union
(:data:`SourcePlan`), dispatched by type instead of a ``kind`` string switch.

Controller → host: :class:`DeployReplica`, :class:`DeployKaas` (both ``deploy_replica``,
told apart by :func:`decode_deploy`), :class:`StopReplica`, :class:`StartChain`,
:class:`ExpectTransfer`, :class:`LinkStage`, :class:`BeginCompletion`,
:class:`DissolveStage`, :class:`HostStatusRequest`, :class:`SetReplicaShare`,
:class:`ApplyMig`. Host → controller: :class:`RegisterHost`, :class:`Heartbeat`,
:class:`HostDraining`, :class:`ReplicaFailed`, :class:`StageReady`, and :class:`Ack`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flashpoint.errors import BadRequest
from flashpoint.gpu.host_sharing import GpuShare
from flashpoint.messages.base import Message, from_payload
from flashpoint.spec import FunctionSpec
from flashpoint.transfer.plan import Endpoint

# An endpoint as it travels: [host_id, addr, port] (transfer/plan.Endpoint.to_wire).
EndpointWire = tuple[str, str, int]
# A pull source as it travels: an endpoint, or the name "registry".
SourceWire = EndpointWire | str


def _endpoint(wire: Any) -> Endpoint | None:
    return None if wire is None else Endpoint.from_wire(list(wire))


# Source plans (where a deploy's bytes come from; controller/state/events.SourceAssignment) --
class _Source(Message, frozen=True, tag_field="kind"):
    transfer_id: str = ""
    sender: str = ""
    chain: tuple[SourceWire, ...] = ()
    upstream: tuple[SourceWire, ...] = ()
    fallback: tuple[SourceWire, ...] = ()


class LocalSource(_Source, frozen=True, tag="local"):
    """The model is in this host's RAM (or is being filled already)."""


class PullSource(_Source, frozen=True, tag="pull"):
    """Pull the model from ``fallback`` (peers, then the registry)."""


class ChainSource(_Source, frozen=True, tag="chain"):
    """The bytes arrive on chain ``transfer_id`` from ``sender``; pull from ``fallback`` if
    the chain never comes."""


class ChainHeadSource(_Source, frozen=True, tag="chain_head"):
    """This host heads chain ``transfer_id``: it pulls from ``upstream`` and relays to
    ``chain`` (receivers' data-plane endpoints)."""


SourcePlan = LocalSource | PullSource | ChainSource | ChainHeadSource
SOURCE_KINDS: dict[str, type[_Source]] = {
    "local": LocalSource, "pull": PullSource, "chain": ChainSource, "chain_head": ChainHeadSource}


def source_plan(kind: str, **fields: Any) -> SourcePlan:
    """The plan of ``kind`` (a SourceAssignment's kind); BadRequest for an unknown kind."""
    cls = SOURCE_KINDS.get(kind)
    if cls is None:
        raise BadRequest(f"unknown source kind {kind!r}")
    return cls(**fields)  # type: ignore[return-value]


# Controller → host ------------------------------------------------------------------------
class PipelineOptions(Message, frozen=True):
    """A stage's pipeline server: where it listens (``listen_host`` empty: where the data
    plane does; ``port`` 0: any) and the next stage (None: the last, or not linked yet)."""

    listen_host: str = ""
    port: int = 0
    next_hop: EndpointWire | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise BadRequest("pipeline port must be an integer in [0, 65536)")
        _endpoint(self.next_hop)  # BadRequest now, not in the worker


class DeployReplica(Message, frozen=True):
    """``deploy_replica`` of a model replica (idempotent by ``replica_id``). ``spec`` is a
    FunctionSpec once decoded; ``manifest_json`` the manifest the controller pinned (with
    its ``manifest_digest``); ``stage`` a partition stage's (first, last) layer."""

    replica_id: str
    device_id: str = ""
    spec: Any = None
    manifest_json: str | None = None
    manifest_digest: str | None = None
    source: SourcePlan | None = None
    stage: tuple[int | str, int | str] | None = None
    pipeline: PipelineOptions | None = None
    share: Any = None

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise BadRequest("deploy needs a replica_id")
        if not isinstance(self.spec, FunctionSpec):
            msgspec.structs.force_setattr(self, "spec", FunctionSpec.from_dict(self.spec))
        if self.share is not None and not isinstance(self.share, GpuShare):
            msgspec.structs.force_setattr(self, "share", GpuShare.from_wire(self.share))
        if self.pipeline is not None and self.stage is None:
            raise BadRequest("pipeline options need a stage")


class DeployKaas(Message, frozen=True, tag="kaas", tag_field="kind"):
    """``deploy_replica`` of a KaaS executor: no model, ``device_bytes`` reserved on its
    device and an executor device cache of ``cache_bytes``."""

    replica_id: str
    device_id: str = ""
    device_bytes: int = 0
    cache_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise BadRequest("deploy needs a replica_id")
        if self.device_bytes <= 0 or self.cache_bytes <= 0:
            raise BadRequest("a KaaS deploy needs positive integer device_bytes and cache_bytes")


def decode_deploy(payload: Any) -> DeployReplica | DeployKaas:
    """A ``deploy_replica`` payload: a KaaS executor (``kind: kaas``) or a model replica
    (no ``kind``, the wire form from before KaaS)."""
    kaas = isinstance(payload, dict) and payload.get("kind") == "kaas"
    return from_payload(DeployKaas if kaas else DeployReplica, payload,
                        method="deploy_replica")


class Accepted(Message, frozen=True):
    """A deploy's or chain start's acknowledgement (the work goes on in the background)."""

    accepted: bool = True
    duplicate: bool = False


class StopReplica(Message, frozen=True):
    replica_id: str = ""


class Stopped(Message, frozen=True):
    stopped: bool


class StartChain(Message, frozen=True):
    """Stream ``model@version`` (a copy with ``manifest_digest``) down ``chain``."""

    transfer_id: str
    model: str
    version: str
    chain: tuple[EndpointWire, ...] = ()
    fallback: tuple[SourceWire, ...] = ()
    manifest_digest: str | None = None


class ExpectTransfer(Message, frozen=True):
    """Chain ``transfer_id`` will bring the model whose manifest has ``manifest_digest``."""

    transfer_id: str
    manifest_digest: str

    def __post_init__(self) -> None:
        if not (self.transfer_id and self.manifest_digest):
            raise BadRequest("expect_transfer needs a transfer_id and a manifest_digest")


class Expected(Message, frozen=True):
    expected: bool = True


class LinkStage(Message, frozen=True):
    replica_id: str
    next_hop: EndpointWire

    def __post_init__(self) -> None:
        _endpoint(self.next_hop)


class Linked(Message, frozen=True):
    linked: bool = True


class BeginCompletion(Message, frozen=True):
    replica_id: str = ""


class Released(Message, frozen=True):
    released: bool


class DissolveStage(Message, frozen=True):
    replica_id: str = ""


class Dissolved(Message, frozen=True):
    dissolved: bool


class HostStatusRequest(Message, frozen=True):
    """``host_status``: no fields."""


class StageReport(Message, frozen=True):
    """A partition stage on a host: its layers, whether it has completed into a whole
    replica, whether it is warm, and its pipeline server (None once dissolved)."""

    replica_id: str
    stage: tuple[int | str, int | str]
    whole: bool = False
    warm: bool = False
    pipeline_endpoint: EndpointWire | None = None


# (replica_id, function, device_id, warm): the registration 4-tuple.
ReplicaReport = tuple[str, str, str, bool]


class HostStatus(Message, frozen=True):
    host_id: str
    replicas: tuple[ReplicaReport, ...] = ()
    stages: tuple[StageReport, ...] = ()
    cache: tuple[str, ...] = ()
    cache_stats: dict[str, Any] = {}
    idle_workers: int = 0
    gpu: dict[str, Any] = {}
    worker_pids: tuple[int, ...] = ()


class SetReplicaShare(Message, frozen=True):
    """Change a running replica's GPU share (a tokens host)."""

    replica_id: str
    share: Any

    def __post_init__(self) -> None:
        if not isinstance(self.share, GpuShare):
            msgspec.structs.force_setattr(self, "share", GpuShare.from_wire(self.share))


class ApplyMig(Message, frozen=True):
    """Apply MIG ``geometry`` (profile names, e.g. ``["4g", "3g"]``) to GPU ``gpu_index``."""

    gpu_index: int
    geometry: tuple[str, ...]


# Host → controller ------------------------------------------------------------------------
class DeviceReport(Message, frozen=True):
    """One placement unit (gpu/inventory.Device.to_dict)."""

    device_id: str
    kind: str
    memory_bytes: int
    name: str = ""
    uuid: str = ""
    gpu_index: int = -1
    mig_profile: str = ""


class RegisterHost(Message, frozen=True):
    """``register_host``, again after every reconnect: devices, cached models and the
    replicas it runs (with their shares, model versions and stages) so a restarted
    controller adopts them. ``shares`` stays loose: a malformed one is dropped, not fatal."""

    host_id: str
    gpu_sharing: str = "none"
    devices: tuple[DeviceReport, ...] = ()
    gpus: tuple[dict[str, Any], ...] = ()
    ram_bytes: int = 0
    leaf: str = ""
    kind: str = "ondemand"
    cached_models: tuple[str, ...] = ()
    replicas: tuple[ReplicaReport, ...] = ()
    shares: dict[str, Any] = {}
    models: dict[str, str] = {}
    stages: tuple[StageReport, ...] = ()
    data_endpoint: EndpointWire | None = None


class Ack(Message, frozen=True):
    """The controller's plain acknowledgement."""

    ok: bool = True


class Heartbeat(Message, frozen=True):
    """A notification: cached models, transfers in progress (model -> [verified, total]
    bytes), replica ids (None: not reported) and, while draining, the seconds left."""

    host_id: str
    cached_models: tuple[str, ...] = ()
    transfers: dict[str, Any] = {}
    replicas: tuple[str, ...] | None = None
    draining_s: float | None = None
    data_endpoint: EndpointWire | None = None


class HostDraining(Message, frozen=True):
    host_id: str = ""
    remaining_s: float = 0.0
    action: str = ""


class ReplicaFailed(Message, frozen=True):
    replica_id: str
    reason: str = ""
    during_start: bool = False
    code: str = "start_failed"
    host_id: str = ""


class StageReady(Message, frozen=True):
    """A stage's pipeline server listens at ``pipeline_endpoint``."""

    replica_id: str
    pipeline_endpoint: EndpointWire
    host_id: str = ""
    source: str = ""
    timings_s: dict[str, float] = {}


class ShareSet(Message, frozen=True):
    """``set_replica_share``'s reply: the replica's tenant and the share now in force."""

    tenant: int  # the token manager's tenant number (gpu/host_sharing.py)
    share: dict[str, Any]


class MigApplied(Message, frozen=True):
    """``apply_mig``'s reply: the GPU's new slices (uuid, profile, start, size, device_id)."""

    gpu_index: int
    slices: tuple[dict[str, Any], ...] = ()
