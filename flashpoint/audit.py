"""The audit log: who changed the cluster, what, and how it ended.

Admin actions (a function registered, updated or deleted, a version rolled out, a GPU's MIG
geometry changed) are recorded with the name of the API key behind them (its fingerprint,
``key:<12 hex>``; never the key) or ``anonymous`` on a keyless loopback cluster, or the
controller component that acted on its own (``controller:mig``). Each record is an ``audit``
log event on the ``flashpoint.audit`` logger and, with ``[gateway] audit_log_path``, one JSON
line appended to that file (created 0600), so it outlives the process's log stream.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from flashpoint.log import get_logger

log = get_logger("flashpoint.audit")


class AuditAction(StrEnum):
    REGISTER = "register"  # a new function
    UPDATE = "update"  # a registered function's spec changed, its model version did not
    ROLLOUT = "rollout"  # a registered function's model version (or canary split) changed
    DELETE = "delete"
    MIG_CHANGE = "mig_change"
    PROFILE = "profile"  # a profiler run stored profiles on a function (controller/profiler.py)


@dataclass(frozen=True)
class AuditRecord:
    action: AuditAction
    principal: str  # the API key's name, "anonymous", or "controller:<component>"
    target: str  # a function name, or "<host>/gpu<index>"
    outcome: str  # "ok", or the error's code
    at_s: float  # wall-clock time
    request_id: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["action"] = self.action.value
        return out


class AuditLog:
    """Records admin actions; ``path`` empty = the log stream only."""

    def __init__(self, path: str = "") -> None:
        self.path = path

    def record(self, action: AuditAction, principal: str, target: str, *, outcome: str = "ok",
               request_id: str = "", **details: Any) -> AuditRecord:
        rec = AuditRecord(action, principal, target, outcome, time.time(), request_id, details)
        log.info("audit", **rec.to_dict())
        if self.path:
            self._append(rec)
        return rec

    def _append(self, rec: AuditRecord) -> None:
        # One write of one line with O_APPEND: lines from several processes never interleave.
        line = (json.dumps(rec.to_dict(), sort_keys=True, default=str) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:  # the action happened: say the record is missing, loudly
            log.error("audit_write_failed", path=self.path, error=str(e), record=rec.to_dict())
