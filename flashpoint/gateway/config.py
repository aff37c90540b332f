"""Typed gateway configuration: one frozen dataclass, loadable from a TOML table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from flashpoint.config import is_placeholder
from flashpoint.errors import BadRequest

MIB = 1024 * 1024
ROLES = ("invoke", "admin")


@dataclass(frozen=True)
class GatewayConfig:
    """Limits, auth and timeouts of the HTTP gateway.

    ``api_keys`` maps a secret key to its role (``"invoke"`` or ``"admin"``); an empty mapping
    disables auth (the local embedded default: every caller is an admin).
    """

    api_keys: Mapping[str, str] = field(default_factory=dict)
    # Raw (possibly compressed) request body.
    max_body_bytes: int = 64 * MIB
    # A compressed body may inflate to at most this many bytes (zip bombs stop here).
    max_decompressed_bytes: int = 64 * MIB
    # Decoded input tensors of one request, summed (numpy bytes, BF16 counted as float32).
    max_tensor_bytes: int = 256 * MIB
    max_json_depth: int = 32
    max_inputs: int = 64
    max_dims: int = 8
    # Request deadline when neither the request nor the function spec names one.
    default_timeout_s: float = 60.0
    # Upper bound on any request deadline, whatever the request asks for.
    max_timeout_s: float = 3600.0
    # The gateway's own backstop fires this long after the deadline passed to the backend.
    deadline_grace_s: float = 1.0
    # Reading the whole request body (slow clients) must finish within this.
    body_read_timeout_s: float = 30.0
    # Invocations in flight at once across all callers; 0 = unlimited. Over it: 429.
    max_inflight_requests: int = 0
    # Token bucket per caller (API key, or peer address without auth); 0 = off. Over it: 429.
    rate_limit_rps: float = 0.0
    rate_limit_burst: int = 0
    # Responses at least this large are gzip-compressed when the client accepts gzip.
    response_compression_min_bytes: int = 1024
    # /metrics answers only callers with an API key (any role) when keys are configured.
    metrics_require_key: bool = False
    # Admin actions are logged as "audit" events, and appended here as JSON lines when set.
    audit_log_path: str = ""

    def __post_init__(self) -> None:
        keys = dict(self.api_keys)
        for key, role in keys.items():
            if not isinstance(key, str) or len(key) < 8:
                raise BadRequest("api keys must be strings of at least 8 characters")
            if is_placeholder(key):
                raise BadRequest(f"api key {key[:24]!r} is a placeholder; generate keys with "
                                 "`flashpoint secret generate`")
            if role not in ROLES:
                raise BadRequest(f"api key role must be one of {ROLES}, not {role!r}")
        object.__setattr__(self, "api_keys", MappingProxyType(keys))
        positive = ("max_body_bytes", "max_decompressed_bytes", "max_tensor_bytes",
                    "max_json_depth", "max_inputs", "max_dims", "default_timeout_s",
                    "max_timeout_s", "body_read_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise BadRequest(f"gateway config {name} must be > 0")
        nonneg = ("deadline_grace_s", "max_inflight_requests", "rate_limit_rps",
                  "rate_limit_burst", "response_compression_min_bytes")
        for name in nonneg:
            if getattr(self, name) < 0:
                raise BadRequest(f"gateway config {name} must be >= 0")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GatewayConfig:
        """Build from a TOML ``[gateway]`` table; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise BadRequest(f"unknown gateway config keys: {sorted(unknown)}")
        return cls(**dict(d))
