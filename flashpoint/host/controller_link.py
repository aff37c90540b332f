"""The host's link to its controller: one reconnecting connection that serves the
controller's calls (the handler table the host passes), registers again after every reconnect,
heartbeats, and carries the host's reports (typed messages, ``messages/controller_host.py``).
A report that fails is logged: the controller re-learns the truth from the next registration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from flashpoint.errors import FlashpointError
from flashpoint.log import get_logger
from flashpoint.messages import controller_host as ch
from flashpoint.messages.base import Message, to_payload

log = get_logger("flashpoint.host")


class ControllerLink:
    """The host's one connection to the controller (``rpc.ReconnectingClient``)."""

    def __init__(self, url: str, handlers: Mapping[str, Any], *, credential: Any,
                 registration: Callable[[], ch.RegisterHost],
                 heartbeat: Callable[[], ch.Heartbeat], heartbeat_interval_s: float) -> None:
        from flashpoint.rpc import ReconnectingClient

        self._registration = registration
        self._heartbeat = heartbeat
        self.heartbeat_interval_s = heartbeat_interval_s
        self.client = ReconnectingClient(url, dict(handlers), secret=credential.key,
                                         name=credential.principal, on_connected=self._register)

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    async def _register(self, conn: Any) -> None:
        await conn.call("register_host", to_payload(self._registration()), timeout_s=10.0)

    async def report(self, method: str, msg: Message) -> None:
        """Call the controller's ``method``; a failure is logged, never raised."""
        try:
            await self.client.call(method, to_payload(msg), timeout_s=10.0)
        except FlashpointError as exc:
            log.warning("report_failed", method=method, error=exc.code)

    async def heartbeat_loop(self) -> None:
        """Heartbeat every ``heartbeat_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self.client.notify("heartbeat", to_payload(self._heartbeat()))
            except FlashpointError as exc:
                log.debug("heartbeat_failed", error=exc.code)
