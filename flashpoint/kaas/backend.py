"""The KaaS surface without torch: the result type and the protocol the gateway calls.

Kept apart from the executor so the gateway (and a controller without torch) can import
it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from flashpoint.kaas.graph import GraphPlan
from flashpoint.kaas.spec import KaasRequest


@dataclass
class KaasResult:
    """What one request produced and where its time went."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # inline outputs
    stored: dict[str, str] = field(default_factory=dict)  # output name -> object key
    timings_s: dict[str, float] = field(default_factory=dict)  # resident, kernels, d2h, total
    cache: dict[str, int] = field(default_factory=dict)  # hits, misses, evictions, loaded_bytes
    executor_id: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"outputs": {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                                "bytes": v.tobytes()} for k, v in self.outputs.items()},
                "stored": self.stored, "timings_s": self.timings_s, "cache": self.cache,
                "executor_id": self.executor_id}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> KaasResult:
        outs = {k: np.frombuffer(v["bytes"], dtype=v["dtype"]).reshape(v["shape"])
                for k, v in d["outputs"].items()}
        return cls(outs, dict(d["stored"]), dict(d["timings_s"]), dict(d["cache"]),
                   d["executor_id"])


class KaasBackend(Protocol):
    """What the gateway needs for ``/v1/kaas`` and ``/v1/objects``.

    In the controller's process the store and the pool are local
    (:class:`~flashpoint.kaas.service.KaasService`, ``controller/kaas_pool.KaasPool``); a
    stand-alone gateway reaches them over RPC (``gateway/remote_kaas.RemoteKaas``), hence the
    object and status calls are coroutines.
    """

    max_buffer_bytes: int

    def plan(self, req: KaasRequest) -> GraphPlan:
        """Validate: typed 400s, ObjectNotFound (404), BufferCacheFull (413)."""
        ...

    async def invoke(self, plan: GraphPlan, *, client: str, request_id: str,
                     timeout_s: float | None = None) -> KaasResult:
        """Run on the pool; DeadlineExceeded, KernelFailed, ObjectExists (409)."""
        ...

    async def fetch_status(self) -> dict[str, Any]:
        """Pool policy, queue, executors with their cache counters, registered kernels."""
        ...

    async def put_object(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        """Store immutable bytes (expiring after ``ttl_s``, else the store's default);
        ObjectExists (409) for other bytes under ``key``, ObjectQuotaExceeded (413)."""
        ...

    async def delete_object(self, key: str) -> None:
        """Remove ``key`` (its name may then hold other bytes); ObjectNotFound (404)."""
        ...

    async def get_object(self, key: str) -> bytes:
        """The bytes under ``key``; ObjectNotFound (404)."""
        ...
