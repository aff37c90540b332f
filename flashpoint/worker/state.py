"""WorkerState: what a worker process holds and what it must do next, with no I/O (STYLE §1).

A worker serves at most one replica in its life: a whole model replica, a partition stage
(which the host may later *complete* into a whole replica: the stage's module is swapped for
the whole model's, built over the same mapping, while the stage server keeps serving until
it is dissolved), or a KaaS executor. :meth:`WorkerState.handle` takes one event (past tense)
and returns the commands (imperative) the actor (``worker/actor.py``) executes; the actor
feeds the outcome of each command back as another event. Nothing here reads a clock: events
carry ``now_s`` (``time.perf_counter`` in the actor).

Phases::

    IDLE --LoadRequested--> LOADING --ReplicaLoaded--> WARM        (whole replica)
                                   \\-ReplicaLoaded--> STAGE --CompletionStarted--> COMPLETING
                                                                   --ReplicaCompleted--> WARM
    IDLE --LoadRequested(kaas)--> LOADING --ReplicaLoaded(kaas)--> KAAS
    LOADING --LoadFailed--> IDLE

What the controller is told (``replica_ready``) is the :class:`Announce` command's message:
the replica with its cold start's timings, sent on every (re)connection once the replica
serves (:class:`ControllerConnected`) and again when a stage becomes whole.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flashpoint.errors import BadRequest, Unavailable
from flashpoint.messages.controller_worker import ReplicaReady


class WorkerPhase(enum.StrEnum):
    IDLE = "idle"  # in the warm pool: torch imported, no replica
    LOADING = "loading"
    STAGE = "stage"  # serves a partition stage's module
    COMPLETING = "completing"  # a stage whose whole module is being built
    WARM = "warm"  # serves a whole replica (requests through its batcher)
    KAAS = "kaas"  # a KaaS executor replica


class ReplicaKind(enum.StrEnum):
    MODEL = "model"
    KAAS = "kaas"


# events --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadRequested:
    """The host asked for replica ``replica_id`` (``load_replica`` or ``load_kaas``)."""

    replica_id: str
    kind: ReplicaKind = ReplicaKind.MODEL
    pipeline: bool = False  # a stage served through its own pipeline server


@dataclass(frozen=True)
class LoadFailed:
    """Loading the replica raised; the host stops this worker after a failed start."""


@dataclass(frozen=True)
class ReplicaLoaded:
    """The module (or KaaS executor) is built and warmed at ``now_s``."""

    replica_id: str
    host_id: str
    function: str
    credits: int
    timings_s: dict[str, float]
    source: str
    now_s: float
    kind: ReplicaKind = ReplicaKind.MODEL
    stage: tuple[int, int] | None = None


@dataclass(frozen=True)
class CompletionRequested:
    """The host holds the whole model now (``complete_replica``)."""


@dataclass(frozen=True)
class ReplicaCompleted:
    """The stage's whole module is built and warmed (the version swap is done)."""

    timings_s: dict[str, float]
    now_s: float


@dataclass(frozen=True)
class CompletionFailed:
    """Building the whole module failed: it stays a working stage; the host may retry."""


@dataclass(frozen=True)
class StageDissolved:
    """The stage's pipeline server stopped (``dissolve_stage``)."""


@dataclass(frozen=True)
class ControllerConnected:
    """A connection to the controller is open and the replica serves (the actor waits for
    ``announceable`` before it says so): it must hear of the replica."""

    now_s: float


@dataclass(frozen=True)
class RequestAnswered:
    """A request (or a frame of them) got its answer."""


Event = (LoadRequested | LoadFailed | ReplicaLoaded
         | CompletionRequested | ReplicaCompleted | CompletionFailed | StageDissolved
         | ControllerConnected | RequestAnswered)


# commands ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplyLoaded:
    """Answer a repeated load at once (idempotent by replica id) with these timings."""

    timings_s: dict[str, float]


@dataclass(frozen=True)
class ConnectController:
    """Open the controller connection now (for a model replica: while the module loads, so
    the handshake overlaps the load; it announces once the replica serves)."""


@dataclass(frozen=True)
class DropController:
    """Close the controller connection opened for a replica that never came to serve."""


@dataclass(frozen=True)
class LoadModule:
    """Load the replica (in a thread: torch, mmap)."""


@dataclass(frozen=True)
class StartStageServer:
    """Serve the stage module as one stage of a pipeline."""


@dataclass(frozen=True)
class StartServing:
    """Start the batcher (or generation loop) over the whole module."""


@dataclass(frozen=True)
class Announce:
    """Send ``message`` (``replica_ready``) to the controller."""

    message: ReplicaReady


@dataclass(frozen=True)
class BuildWhole:
    """Build the whole module over the stage's mapping (in a thread)."""


@dataclass(frozen=True)
class AwaitCompletion:
    """A completion is already under way: wait for its outcome."""


@dataclass(frozen=True)
class ReplyCompleted:
    """Answer ``complete_replica`` (at once, for a replica that is whole already)."""

    timings_s: dict[str, float]


@dataclass(frozen=True)
class ReportServed:
    """Tell the host its replica answered its first request (its warm pool refills)."""


Command = (ReplyLoaded | ConnectController | DropController | LoadModule | StartStageServer
           | StartServing | Announce | BuildWhole | AwaitCompletion | ReplyCompleted
           | ReportServed)


@dataclass
class WorkerState:
    """The replica this worker holds and its announcement; see the module docstring."""

    phase: WorkerPhase = WorkerPhase.IDLE
    replica_id: str = ""
    kind: ReplicaKind = ReplicaKind.MODEL
    host_id: str = ""
    function: str = ""
    credits: int = 0
    source: str = ""
    stage: tuple[int, int] | None = None  # the layer range while a stage; None once whole
    pipeline: bool = False  # serves a pipeline stage server (until dissolved)
    timings_s: dict[str, float] = field(default_factory=dict)  # cold start (+ completion)
    loaded_s: float = 0.0  # when the replica was loaded and warmed
    controller: bool = False  # a controller connection is open (or opening)
    announceable: bool = False  # the replica serves: a connection may announce it
    served: bool = False  # its first answer was reported to the host

    def handle(self, event: Event) -> list[Command]:
        """Apply one event; return what the actor must do, in order. Raises the typed
        error the caller should get when the event is refused."""
        match event:
            case LoadRequested():
                return self._load_requested(event)
            case LoadFailed():
                self.phase, self.replica_id = WorkerPhase.IDLE, ""
                if self.controller and not self.announceable:
                    self.controller = False  # nothing to announce: that connection goes
                    return [DropController()]
                return []
            case ReplicaLoaded():
                return self._replica_loaded(event)
            case CompletionRequested():
                return self._completion_requested()
            case ReplicaCompleted():
                self.timings_s = {**self.timings_s, **event.timings_s}
                self.phase, self.stage = WorkerPhase.WARM, None
                if not self.controller:  # a pipeline stage: its first announcement
                    self.controller = self.announceable = True
                    return [StartServing(), ConnectController()]
                # A stage deployed without pipeline options announced itself already: the
                # controller learns it is whole from a second announcement.
                return [Announce(self._announcement(event.now_s))]
            case CompletionFailed():
                self.phase = WorkerPhase.STAGE
                return []
            case StageDissolved():
                self.pipeline = False
                return []
            case ControllerConnected():
                if not self.announceable:
                    raise Unavailable("nothing to announce yet", retry_after_s=0.1)
                return [Announce(self._announcement(event.now_s))]
            case RequestAnswered():
                if self.served:
                    return []
                self.served = True
                return [ReportServed()]
        raise TypeError(f"not a worker event: {event!r}")

    def _load_requested(self, event: LoadRequested) -> list[Command]:
        if self.phase is not WorkerPhase.IDLE:
            if event.replica_id != self.replica_id or event.kind is not self.kind:
                raise BadRequest("worker already serves another replica")
            if self.phase is WorkerPhase.LOADING:  # a retried call while the first loads
                raise Unavailable("replica still loading", retry_after_s=0.1)
            return [ReplyLoaded(dict(self.timings_s))]
        self.phase, self.replica_id, self.kind = WorkerPhase.LOADING, event.replica_id, event.kind
        self.pipeline = event.pipeline
        if event.kind is ReplicaKind.MODEL and not event.pipeline and not self.controller:
            # The connection's handshake (tens of ms) overlaps the module's load.
            self.controller = True
            return [ConnectController(), LoadModule()]
        return [LoadModule()]

    def _replica_loaded(self, event: ReplicaLoaded) -> list[Command]:
        self.host_id, self.function, self.credits = event.host_id, event.function, event.credits
        self.timings_s, self.source = dict(event.timings_s), event.source
        self.loaded_s, self.kind, self.stage = event.now_s, event.kind, event.stage
        if event.kind is ReplicaKind.KAAS:
            self.phase, self.announceable = WorkerPhase.KAAS, True
            self.controller = True
            return [ConnectController()]
        if self.pipeline:
            self.phase = WorkerPhase.STAGE
            return [StartStageServer()]
        # A whole replica, or a stage with no pipeline options (it serves requests too).
        self.phase = WorkerPhase.STAGE if event.stage is not None else WorkerPhase.WARM
        self.announceable = True
        commands: list[Command] = [StartServing()]
        if not self.controller:
            self.controller = True
            commands.append(ConnectController())
        return commands

    def _completion_requested(self) -> list[Command]:
        if self.phase in (WorkerPhase.IDLE, WorkerPhase.LOADING, WorkerPhase.KAAS):
            raise Unavailable("no replica loaded", retry_after_s=0.1)
        if self.phase is WorkerPhase.WARM:
            return [ReplyCompleted({})]
        if self.phase is WorkerPhase.COMPLETING:
            return [AwaitCompletion()]
        self.phase = WorkerPhase.COMPLETING
        return [BuildWhole()]

    def _announcement(self, now_s: float) -> ReplicaReady:
        """The ``replica_ready`` message; the first one records how long the replica took
        from warm to announced (``announce``, a cold start phase)."""
        if "announce" not in self.timings_s and self.loaded_s:
            self.timings_s["announce"] = now_s - self.loaded_s
        return ReplicaReady(replica_id=self.replica_id, host_id=self.host_id,
                            function=self.function, credits=self.credits,
                            timings_s=dict(self.timings_s), source=self.source,
                            kind=self.kind.value)
