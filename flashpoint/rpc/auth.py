"""Cluster-secret handshake: mutual HMAC-SHA256 challenge before any handler runs.

    server -> client  HELLO(version, nonce_s)
    client -> server  PROOF(name, nonce_c, HMAC(secret, b"client" + nonce_s + nonce_c))
    server -> client  WELCOME(name, HMAC(secret, b"server" + nonce_c + nonce_s))
                      or ERROR(0, auth_failed) and close

Both sides check with :func:`hmac.compare_digest`. The whole exchange is bounded by
``timeout_s``. Each side returns the peer's name. A server given a keyring (a function of the
client's name, rpc/roles.py) checks the proof with that name's key, so the name it returns
is authenticated; with one shared secret it is self-reported (for logs only).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Callable

from flashpoint.errors import AuthFailed, ConnectFailed, FlashpointError, PeerLost, ProtocolError, from_wire
from flashpoint.rpc import frames
from flashpoint.rpc.channel import Channel

Keyring = Callable[[str], bytes | None]  # client name -> its key, None: unknown

HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32
# Handshake frames are tiny; never accept a big one before the peer is authenticated.
HANDSHAKE_MAX_FRAME_BYTES = 4096


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < 8:
        raise ValueError("cluster secret must be at least 8 bytes")
    return secret


async def server_handshake(
    channel: Channel, secret: bytes | Keyring, *, name: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S, on_verified: Callable[[], None] | None = None,
) -> str:
    """Run the server side; returns the peer's name. On failure tells the peer, closes the
    channel and raises AuthFailed; PeerLost when the peer closed the channel first (a
    client that gave up: its connect was cancelled or timed out on its side).
    ``on_verified`` runs once the proof checked out, before the peer hears so (and so
    before it can send anything else)."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    try:
        async with asyncio.timeout(timeout_s):
            await channel.send(frames.encode(frames.Hello(frames.PROTOCOL_VERSION, nonce_s)))
            frame = frames.decode(await channel.recv(), HANDSHAKE_MAX_FRAME_BYTES)
            if not isinstance(frame, frames.Proof):
                raise AuthFailed("expected a handshake proof")
            key = secret(frame.name) if callable(secret) else secret
            if key is None:
                raise AuthFailed(f"unknown principal {frame.name[:64]!r}")
            if not hmac.compare_digest(frame.mac, _mac(key, b"client", nonce_s, frame.nonce)):
                raise AuthFailed("peer does not know the cluster secret")
            reply = _mac(key, b"server", frame.nonce, nonce_s)
            if on_verified is not None:
                on_verified()
            await channel.send(frames.encode(frames.Welcome(name, reply)))
            return frame.name
    except TimeoutError:
        err: FlashpointError = AuthFailed(f"handshake timed out after {timeout_s}s")
    except AuthFailed as exc:
        err = exc
    except PeerLost as exc:
        await channel.close()
        raise PeerLost(f"peer left during the handshake: {exc.message}",
                       peer=channel.peer) from None
    except FlashpointError as exc:  # ProtocolError, FrameTooLarge
        err = AuthFailed(f"handshake failed: {exc.message}")
    await _refuse(channel, err)
    raise err


async def client_handshake(
    channel: Channel, secret: bytes, *, name: str, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> str:
    """Run the client side; returns the server's name. Raises AuthFailed when refused or when
    the server cannot prove it knows the secret, ConnectFailed when the channel fails."""
    try:
        async with asyncio.timeout(timeout_s):
            frame = frames.decode(await channel.recv(), HANDSHAKE_MAX_FRAME_BYTES)
            if isinstance(frame, frames.Error):
                raise from_wire(frame.error)
            if not isinstance(frame, frames.Hello):
                raise ProtocolError("expected a handshake hello")
            if frame.version != frames.PROTOCOL_VERSION:
                raise AuthFailed(f"peer speaks protocol {frame.version}, not {frames.PROTOCOL_VERSION}")
            nonce_c = secrets.token_bytes(NONCE_BYTES)
            proof = _mac(secret, b"client", frame.nonce, nonce_c)
            await channel.send(frames.encode(frames.Proof(name, nonce_c, proof)))
            nonce_s = frame.nonce
            frame = frames.decode(await channel.recv(), HANDSHAKE_MAX_FRAME_BYTES)
            if isinstance(frame, frames.Error):
                raise from_wire(frame.error)
            if not isinstance(frame, frames.Welcome):
                raise ProtocolError("expected a handshake welcome")
            if not hmac.compare_digest(frame.mac, _mac(secret, b"server", nonce_c, nonce_s)):
                raise AuthFailed("server does not know the cluster secret")
            return frame.name
    except TimeoutError:
        await channel.close()
        raise ConnectFailed(f"handshake with {channel.peer} timed out after {timeout_s}s") from None
    except AuthFailed:
        await channel.close()
        raise
    except FlashpointError as exc:
        await channel.close()
        raise ConnectFailed(f"handshake with {channel.peer} failed: {exc.message}", cause=exc.code) from None


async def _refuse(channel: Channel, err: FlashpointError) -> None:
    try:
        async with asyncio.timeout(1.0):
            await channel.send(frames.encode(frames.Error(0, err.to_wire())))
    except (TimeoutError, FlashpointError):
        pass
    await channel.close()
