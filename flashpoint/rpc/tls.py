"""TLS contexts for the HTTP API and ``wss://`` RPC, built from configured PEM files.

The controller (gateway and RPC on one port) and the stand-alone gateway serve with
:func:`server_context`; clients of a ``wss://`` url trust a cluster CA with
:func:`client_context` (or the system store). A missing or unreadable file, or a key that
does not match its certificate, is a BadRequest naming the setting, raised at start-up
rather than at the first connection.
"""

from __future__ import annotations

import ssl

from flashpoint.errors import BadRequest


def server_context(cert_path: str, key_path: str, *, setting: str) -> ssl.SSLContext | None:
    """A server context for ``cert_path`` (chain, PEM) and ``key_path`` (PEM; empty: the key
    is in the certificate file), or None when ``cert_path`` is empty (plain HTTP).
    ``setting`` names the config table for errors (``"controller"``, ``"gateway"``)."""
    if not cert_path:
        if key_path:
            raise BadRequest(f"[{setting}] tls_key_path is set without tls_cert_path")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_path, key_path or None)
    except (OSError, ssl.SSLError) as exc:
        raise BadRequest(f"[{setting}] tls_cert_path {cert_path!r} / tls_key_path "
                         f"{key_path!r}: {exc}") from None
    return ctx


def client_context(ca_path: str, *, setting: str) -> ssl.SSLContext | None:
    """A client context trusting only ``ca_path`` (PEM), or None (the system trust store)."""
    if not ca_path:
        return None
    try:
        return ssl.create_default_context(cafile=ca_path)
    except (OSError, ssl.SSLError) as exc:
        raise BadRequest(f"[{setting}] tls_ca_path {ca_path!r}: {exc}") from None
