"""Spot-eviction notices: where a host learns it is about to be taken away.

Three triggers, one result (:class:`EvictionNotice`):

* **IMDS** (:class:`ImdsWatcher`): AWS's instance metadata service, IMDSv2. A session token is
  obtained with ``PUT /latest/api/token`` (header ``X-aws-ec2-metadata-token-ttl-seconds``)
  and sent as ``X-aws-ec2-metadata-token`` on ``GET /latest/meta-data/spot/instance-action``:
  404 means no interruption is scheduled; 200 carries ``{"action": "terminate" | "stop" |
  "hibernate", "time": "<ISO 8601 UTC>"}``; 401 means the token expired (get a new one). The
  endpoint is configurable so tests run a local server speaking this API; the real one
  (``http://169.254.169.254``) is contacted only when a host is configured to watch it.
* **File** (:class:`FileWatcher`): a path whose appearance is the notice (an operator's
  ``touch``, or another agent's hook for a cloud without IMDS). Its content may be JSON with
  ``action`` and ``time`` or ``seconds`` (time left); empty means the default lead time.
* **Signal**: ``flashpoint host`` turns SIGUSR1 into a notice (see the CLI); not here, because
  only a process's main thread may own a signal.

AWS gives two minutes; the notice carries the deadline as this process's monotonic time so the
drain can plan against it. Every network wait is bounded; a metadata service that does not
answer is logged and polled again, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import Counter

from flashpoint.errors import BadRequest
from flashpoint.log import get_logger

log = get_logger("flashpoint.spot")

POLL_FAILURES = Counter("flashpoint_spot_notice_poll_failures_total",
                        "Eviction-notice polls that failed (a blocked metadata service means "
                        "no spot drain), by watcher", ["watcher"])
# A failing watcher warns when its failures start, then every this many in a row.
WARN_EVERY_FAILURES = 30

DEFAULT_LEAD_S = 120.0  # AWS's two-minute warning
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"


@dataclass(frozen=True)
class EvictionNotice:
    """The host goes away at ``deadline_s`` (monotonic clock of this process)."""

    action: str
    deadline_s: float
    source: str

    def remaining_s(self, now_s: float | None = None) -> float:
        return max(0.0, self.deadline_s - (time.monotonic() if now_s is None else now_s))


def notice_from(payload: Any, source: str, *, now_wall: datetime | None = None,
                now_mono: float | None = None) -> EvictionNotice:
    """A notice from an IMDS or file payload (``action``; ``time`` ISO 8601 or ``seconds``).

    A missing or unparsable time means the default lead (the safe reading: drain now)."""
    wall = now_wall or datetime.now(UTC)
    mono = time.monotonic() if now_mono is None else now_mono
    action, lead = "terminate", DEFAULT_LEAD_S
    if isinstance(payload, dict):
        action = str(payload.get("action") or action)
        if isinstance(payload.get("seconds"), int | float) and not isinstance(
                payload.get("seconds"), bool):
            lead = max(0.0, float(payload["seconds"]))
        elif isinstance(payload.get("time"), str):
            try:
                at = datetime.fromisoformat(payload["time"].replace("Z", "+00:00"))
                if at.tzinfo is None:
                    at = at.replace(tzinfo=UTC)
                lead = max(0.0, (at - wall).total_seconds())
            except ValueError:
                log.warning("eviction_time_unreadable", time=payload["time"], source=source)
    return EvictionNotice(action, mono + lead, source)


class ImdsWatcher:
    """Polls the instance-action document through IMDSv2 (see the module docstring)."""

    def __init__(self, endpoint: str = "http://169.254.169.254", *, timeout_s: float = 1.0,
                 token_ttl_s: int = 21600) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None

    async def _get_token(self, session: aiohttp.ClientSession) -> str:
        async with session.put(self.endpoint + TOKEN_PATH, timeout=self.timeout,
                               headers={TTL_HEADER: str(self.token_ttl_s)}) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                  message="token refused")
            return (await r.text()).strip()

    async def poll(self, session: aiohttp.ClientSession) -> EvictionNotice | None:
        """One look: a notice, or None when no interruption is scheduled."""
        for _ in range(2):  # a stale token is refreshed once
            if self._token is None:
                self._token = await self._get_token(session)
            async with session.get(self.endpoint + ACTION_PATH, timeout=self.timeout,
                                   headers={TOKEN_HEADER: self._token}) as r:
                if r.status == 404:
                    return None
                if r.status == 401:
                    self._token = None
                    continue
                if r.status != 200:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                      message="instance-action")
                return notice_from(json.loads(await r.text()), "imds")
        return None


class FileWatcher:
    """A notice when ``path`` exists (content: see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    async def poll(self, session: aiohttp.ClientSession | None = None) -> EvictionNotice | None:
        def read() -> str | None:
            try:
                return self.path.read_text()[:4096]
            except FileNotFoundError:
                return None

        text = await asyncio.to_thread(read)
        if text is None:
            return None
        try:
            payload = json.loads(text) if text.strip() else {}
        except ValueError:
            payload = {}
        return notice_from(payload, "file")


Watcher = ImdsWatcher | FileWatcher


async def watch(watchers: list[Watcher], on_notice: Callable[[EvictionNotice], Awaitable[None]],
                *, interval_s: float = 2.0) -> EvictionNotice:
    """Poll every watcher each ``interval_s`` until one gives a notice; hand it to
    ``on_notice`` once and return it. A failing poll is counted (``POLL_FAILURES``), warned
    about when a watcher starts failing and every ``WARN_EVERY_FAILURES`` in a row after,
    and retried next round: a blocked metadata service must not silently disable drains."""
    failing = [0] * len(watchers)  # consecutive failures per watcher
    async with aiohttp.ClientSession() as session:
        while True:
            for i, w in enumerate(watchers):
                kind = "imds" if isinstance(w, ImdsWatcher) else "file"
                try:
                    notice = await w.poll(session)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    POLL_FAILURES.labels(kind).inc()
                    failing[i] += 1
                    if (failing[i] - 1) % WARN_EVERY_FAILURES == 0:
                        log.warning("eviction_poll_failed", watcher=kind, error=repr(exc)[:300],
                                    consecutive_failures=failing[i])
                    continue
                if failing[i]:
                    log.info("eviction_poll_recovered", watcher=kind,
                             consecutive_failures=failing[i])
                    failing[i] = 0
                if notice is not None:
                    log.warning("eviction_notice", action=notice.action, source=notice.source,
                                remaining_s=round(notice.remaining_s(), 1))
                    await on_notice(notice)
                    return notice
            await asyncio.sleep(interval_s)


def watchers_from(spec: str, imds_endpoint: str) -> list[Watcher]:
    """Watchers from a host's ``spot_notice`` setting: comma-separated ``imds`` and
    ``file:<path>`` (``signal`` is handled by the CLI); empty = none."""
    out: list[Watcher] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "imds":
            out.append(ImdsWatcher(imds_endpoint))
        elif part.startswith("file:") and len(part) > 5:
            out.append(FileWatcher(part[5:]))
        elif part != "signal":
            raise BadRequest(f"unknown spot_notice trigger {part!r} (imds, file:<path>, signal)")
    return out
