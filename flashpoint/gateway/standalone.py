"""``flashpoint gateway``: the HTTP API in its own process, in front of the controller.

See :mod:`flashpoint.gateway.remote` for what it keeps and what it retries, and
:mod:`flashpoint.gateway.remote_kaas` for KaaS and the object store through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import prometheus_client
from aiohttp import web

from flashpoint.config import ClusterConfig, check_http_auth, check_secret
from flashpoint.gateway.app import RUNNER_KWARGS, make_app
from flashpoint.gateway.remote import RemoteBackend
from flashpoint.gateway.remote_kaas import RemoteKaas
from flashpoint.log import get_logger
from flashpoint.rpc import roles
from flashpoint.rpc.tls import client_context, server_context

log = get_logger(__name__)

# The gateway process's event-loop lag is sampled this often (flashpoint/actor.py).
LOOP_LAG_INTERVAL_S = 0.5


def controller_rpc_url(config: ClusterConfig) -> str:
    if config.gateway.controller_url:
        return config.gateway.controller_url
    cc = config.controller
    return f"{'wss' if cc.tls_cert_path else 'ws'}://{cc.listen_host}:{cc.listen_port}/rpc"


@dataclass
class StandaloneGateway:
    """A running stand-alone gateway: its backend, its HTTP runner and its URL."""

    backend: RemoteBackend
    runner: web.AppRunner
    url: str

    @classmethod
    async def start(cls, config: ClusterConfig, *, port: int | None = None) -> StandaloneGateway:
        gw = config.gateway
        # Its own credential (rpc/roles.py): from the environment, or derived from the secret.
        cred, given = roles.credential_from_env(str(roles.Role.GATEWAY), config.secret.encode())
        if not given:
            check_secret(config.secret, gw.listen_host, "the gateway")
        tls = server_context(gw.tls_cert_path, gw.tls_key_path, setting="gateway")
        check_http_auth(gw.api_keys, gw.listen_host, config.insecure, "the gateway")
        backend = RemoteBackend(controller_rpc_url(config), secret=cred.key, name=cred.principal,
                                refresh_s=gw.refresh_s,
                                ssl_context=client_context(gw.tls_ca_path, setting="gateway"),
                                # inputs travel in one frame: room for the largest body
                                max_frame_bytes=max(gw.max_body_bytes * 2, 64 << 20),
                                loop_lag_interval_s=LOOP_LAG_INTERVAL_S)
        await backend.start()
        runner = web.AppRunner(make_app(backend, gw, kaas=RemoteKaas(backend),
                                        process_registry=prometheus_client.REGISTRY),
                               access_log=None, **RUNNER_KWARGS)
        try:
            await runner.setup()
            site = web.TCPSite(runner, gw.listen_host, gw.listen_port if port is None else port,
                               ssl_context=tls)
            await site.start()
        except BaseException:
            await runner.cleanup()
            await backend.stop()
            raise
        bound: Any = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        url = f"{'https' if tls else 'http'}://{gw.listen_host}:{bound[1]}"
        log.info("gateway_started", url=url, controller=controller_rpc_url(config))
        return cls(backend, runner, url)

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.backend.stop()
