"""Controller <-> KaaS executor worker messages (``kaas_run``, ``kaas_reset``), version 1.

The controller's :class:`~flashpoint.kaas.remote.WorkerExecutorHandle` sends them; a worker's
:class:`~flashpoint.kaas.remote.WorkerKaasRuntime` answers. Objects are shipped on a miss (see
``kaas/remote.py``): a request carries the bytes of the store inputs the worker lacks, a reply
the bytes of the outputs stored under a key and what the worker's executor now holds.
"""

from __future__ import annotations

from typing import Any

from flashpoint.messages.base import Message

KAAS_WIRE_VERSION = 1


class KaasRunRequest(Message, kw_only=True):
    """``kaas_run``: run ``request`` (a ``KaasRequest.to_dict``) for ``client``, with the
    shipped ``objects`` staged and the ``forget`` keys dropped from the caches first."""

    version: int = KAAS_WIRE_VERSION
    request_id: str = ""
    client: str = ""
    request: dict[str, Any]
    objects: dict[str, bytes] = {}
    forget: list[str] = []


class KaasWorkerState(Message, kw_only=True):
    """What the controller's handle routes and ships by (the ``kaas_reset`` reply):
    the object keys the executor holds, its device cache keys and its cache's room."""

    held: list[str]
    cached: list[str]
    free_bytes: int
    capacity_bytes: int


class KaasRunReply(KaasWorkerState, kw_only=True):
    """The ``kaas_run`` reply: the result (``KaasResult`` wire form), the bytes of the
    outputs stored under a key, and the executor's state after the run."""

    version: int = KAAS_WIRE_VERSION
    result: dict[str, Any]
    objects: dict[str, bytes] = {}


class KaasResetRequest(Message):
    """``kaas_reset``: drop every cached buffer (an exclusive reassignment's cold start)."""
