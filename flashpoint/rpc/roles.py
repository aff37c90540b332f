"""Roles on the control RPC: each peer proves its own key and may call only what its role needs.

A peer's handshake name (rpc/auth.py) is its *principal*; the server checks the proof with
that principal's key, so once a connection is live its ``peer_name`` is authenticated.

    principal          key                                   may call on the controller
    host/<host_id>     role_key(secret, "host/<host_id>")    register_host, heartbeat,
                                                             host_draining, replica_failed,
                                                             stage_ready — for that host id
    worker/<host_id>   worker_key(host key)                  replica_ready — for replicas on
                                                             that host; worker_hello on it;
                                                             gen_chunk — only on the
                                                             connection its request went to
    gateway            role_key(secret, "gateway")           gw_*
    anything else      the cluster secret itself             everything (admin: the
                                                             controller's own tools, tests)

Only the controller holds the cluster secret. An operator hands a host its host key and the
data-plane key (``flashpoint keys host <id>``), a gateway its gateway key; a host derives its
workers' key from its own, so it starts workers without the cluster secret, and a worker
cannot derive its host's key (HMAC is one-way). A process given the cluster secret and no
credential (``flashpoint up``, tests) derives its own credential from it.

The data plane (transfer/, pipeline/) keeps one shared key, ``data_key(secret)``, held by the
controller, hosts and workers: it moves bytes, it cannot register hosts or claim replicas.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from flashpoint.errors import BadRequest, Forbidden

CREDENTIAL_ENV = "FLASHPOINT_CREDENTIAL"  # "<principal>:<hex key>" (flashpoint keys)
_ROLE_LABEL = b"flashpoint-role-v1/"
_WORKER_LABEL = b"flashpoint-worker-v1"
_DATA_LABEL = b"flashpoint-data-v1"


class Role(StrEnum):
    HOST = "host"
    WORKER = "worker"
    GATEWAY = "gateway"
    ADMIN = "admin"


# What each role may call on the controller (an admin may call anything).
CONTROLLER_METHODS: dict[Role, frozenset[str]] = {
    Role.HOST: frozenset({"register_host", "heartbeat", "host_draining", "replica_failed",
                          "stage_ready"}),
    Role.WORKER: frozenset({"replica_ready", "gen_chunk"}),
    Role.GATEWAY: frozenset({"gw_invoke", "gw_stream", "gw_functions", "gw_register", "gw_delete",
                             "gw_kaas_invoke", "gw_kaas_status", "gw_object_put",
                             "gw_object_get"}),
}


@dataclass(frozen=True)
class Principal:
    """Who a connection authenticated as; ``host_id`` is set for hosts and workers."""

    role: Role
    host_id: str = ""

    @classmethod
    def parse(cls, name: str) -> Principal:
        """A handshake name: ``host/<id>``, ``worker/<id>``, ``gateway``; anything else is an
        admin (it proved the cluster secret itself)."""
        if name == Role.GATEWAY:
            return cls(Role.GATEWAY)
        role, sep, host_id = name.partition("/")
        if sep and host_id and role in (Role.HOST, Role.WORKER):
            return cls(Role(role), host_id)
        return cls(Role.ADMIN)

    def __str__(self) -> str:
        return f"{self.role}/{self.host_id}" if self.host_id else str(self.role)


def host_principal(host_id: str) -> str:
    return str(Principal(Role.HOST, host_id))


def worker_principal(host_id: str) -> str:
    return str(Principal(Role.WORKER, host_id))


def role_key(secret: bytes, principal: str) -> bytes:
    return hmac.new(secret, _ROLE_LABEL + principal.encode(), hashlib.sha256).digest()


def worker_key(host_key: bytes) -> bytes:
    """The key of a host's workers, derived from the host's own key."""
    return hmac.new(host_key, _WORKER_LABEL, hashlib.sha256).digest()


def data_key(secret: bytes) -> bytes:
    """The data plane's shared key (hex, as FLASHPOINT_SECRET carries it to hosts)."""
    return hmac.new(secret, _DATA_LABEL, hashlib.sha256).hexdigest().encode()


def key_for(secret: bytes, name: str) -> bytes:
    """The key a peer calling itself ``name`` must prove to the controller."""
    p = Principal.parse(name)
    if p.role is Role.ADMIN:
        return secret
    if p.role is Role.WORKER:
        return worker_key(role_key(secret, host_principal(p.host_id)))
    return role_key(secret, str(p))


def controller_keyring(secret: bytes) -> Callable[[str], bytes | None]:
    return lambda name: key_for(secret, name)


def host_keyring(host_id: str, host_key: bytes) -> Callable[[str], bytes | None]:
    """A host's worker-facing server accepts only its own workers."""
    mine, key = worker_principal(host_id), worker_key(host_key)
    return lambda name: key if name == mine else None


@dataclass(frozen=True)
class Credential:
    """What a peer proves: its principal (the handshake name) and that principal's key."""

    principal: str
    key: bytes

    @classmethod
    def derive(cls, secret: bytes, principal: str) -> Credential:
        return cls(principal, key_for(secret, principal))

    @classmethod
    def parse(cls, token: str) -> Credential:
        principal, sep, hexkey = token.strip().rpartition(":")
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            key = b""
        if not sep or not principal or len(key) != hashlib.sha256().digest_size:
            raise BadRequest(f"{CREDENTIAL_ENV} must be '<principal>:<64 hex digits>'")
        return cls(principal, key)

    def token(self) -> str:
        return f"{self.principal}:{self.key.hex()}"


def credential_from_env(principal: str, secret: bytes) -> tuple[Credential, bool]:
    """This process's credential: from CREDENTIAL_ENV (which must name ``principal``), else
    derived from the cluster secret. The flag says whether it came from the environment."""
    token = os.environ.get(CREDENTIAL_ENV)
    if not token:
        return Credential.derive(secret, principal), False
    cred = Credential.parse(token)
    if cred.principal != principal:
        raise BadRequest(f"{CREDENTIAL_ENV} is for {cred.principal!r}, this process is "
                         f"{principal!r}")
    return cred, True


def principal_of(conn: Any) -> Principal:
    return Principal.parse(str(conn.peer_name))


def guard(handlers: Mapping[str, Any],
          allowed: Mapping[Role, frozenset[str]] = CONTROLLER_METHODS) -> dict[str, Any]:
    """``handlers`` with each call checked against the caller's role: Forbidden otherwise."""
    def wrap(method: str, handler: Any) -> Any:
        async def guarded(conn: Any, payload: Any) -> Any:
            p = principal_of(conn)
            if p.role is not Role.ADMIN and method not in allowed.get(p.role, frozenset()):
                raise Forbidden(f"{p} may not call {method}")
            return await handler(conn, payload)
        return guarded
    return {method: wrap(method, h) for method, h in handlers.items()}


def check_host(conn: Any, host_id: str) -> None:
    """A host (or its workers) may speak only for its own host id."""
    p = principal_of(conn)
    if p.role is not Role.ADMIN and p.host_id != host_id:
        raise Forbidden(f"{p} may not act for host {host_id!r}")
