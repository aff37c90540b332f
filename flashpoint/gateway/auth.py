"""Bearer API keys with two roles: ``invoke`` (call and read) and ``admin`` (everything).

Keys are compared as SHA-256 digests with :func:`hmac.compare_digest` against every
configured key (no early exit), so neither a key's content nor its length leaks through
timing. With no keys configured auth is off and every caller acts as an admin.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from flashpoint.errors import Forbidden, Unauthorized


class Role(StrEnum):
    INVOKE = "invoke"
    ADMIN = "admin"


_RANK = {Role.INVOKE: 1, Role.ADMIN: 2}


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key fingerprint (never the key) and its role."""

    name: str
    role: Role


ANONYMOUS_ADMIN = Principal("anonymous", Role.ADMIN)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeyAuth:
    def __init__(self, api_keys: Mapping[str, str]) -> None:
        self._keys = [(_digest(k), Role(role), f"key:{_digest(k).hex()[:12]}")
                      for k, role in api_keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an ``Authorization`` header; raises Unauthorized."""
        if not self.enabled:
            return ANONYMOUS_ADMIN
        if not authorization:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        digest = _digest(token)
        found: Principal | None = None
        for key_digest, role, name in self._keys:
            if hmac.compare_digest(key_digest, digest):
                found = Principal(name, role)
        if found is None:
            raise Unauthorized("invalid API key")
        return found

    def require(self, authorization: str | None, role: Role) -> Principal:
        """Authenticate and check the caller holds ``role`` (admin holds every role)."""
        principal = self.authenticate(authorization)
        if _RANK[principal.role] < _RANK[role]:
            raise Forbidden(f"this operation needs the {role.value!r} role")
        return principal
