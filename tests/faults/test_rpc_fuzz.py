"""Fuzzing the RPC layer: the msgpack frame decoder, the handshake, and a live server.

Checks:

* ``frames.decode`` raises nothing but ProtocolError / FrameTooLarge for fields of every wrong
  type (ids, methods, deadlines as huge ints, floats, NaN, strings, bytes, bools), any nesting
  depth (the limit is exact: MAX_DEPTH containers decode, one more does not), and container
  or string headers that claim far more elements than the frame holds; what it accepts obeys
  the documented field bounds and re-encodes to the same frame.
* Decoding allocates in proportion to the frame's own size, whatever its headers claim
  (regression: msgpack preallocates for each array header it meets, so nested claims the
  frame could never fill cost ~80 KB a level: a 4 KB handshake frame from an unauthenticated
  peer took ~35 ms and ~33 MB, a 5 KB frame ~90 ms and ~80 MB).
* A client handshake against a rogue server ends in AuthFailed or ConnectFailed, nothing else.
* A live RpcServer on 127.0.0.1 that gets random WebSocket messages, before or after a
  successful handshake, answers or drops that one connection (only well-formed frames come
  back, a connection is dropped exactly when it sent something invalid), logs no crashed
  reader or handler, and still serves a fresh client's valid call afterwards.
"""

from __future__ import annotations

import asyncio
import math
import tracemalloc
from typing import Any

import aiohttp
import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from flashpoint.errors import AuthFailed, ConnectFailed, FrameTooLarge, PeerLost, ProtocolError, from_wire
from flashpoint.rpc import MemoryChannel, WebSocketChannel, connect, frames, memory_pair
from flashpoint.rpc.auth import client_handshake

from .conftest import RPC_MAX_FRAME_BYTES, SECRET, LoopThread, RpcFuzzServer

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIVE = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPED = (ProtocolError, FrameTooLarge)

# -- strategies -------------------------------------------------------------------------------

_ints = st.integers(-(2**63), 2**64 - 1) | st.sampled_from(
    [0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
_leaf = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=8),
                  st.binary(max_size=8))
msgpack_values = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5) | st.binary(
        max_size=3), kids, max_size=4),
    max_leaves=20)
ids = _ints | st.booleans() | st.floats() | st.text(max_size=4) | st.binary(max_size=4) | st.none()
methods = (st.text(max_size=210) | st.sampled_from(["", "echo", "x" * 200, "x" * 201, "\ud800"])
           | st.binary(max_size=8) | _ints | st.none())
deadlines = (st.floats() | _ints | st.booleans() | st.text(max_size=3) | st.none()
             | st.sampled_from([0, -0.0, 5e-324, frames.MAX_TIMEOUT_S,
                                math.nextafter(frames.MAX_TIMEOUT_S, math.inf)]))
payloads = st.dictionaries(st.text(max_size=5), msgpack_values, max_size=4) | msgpack_values
blobs = st.binary(max_size=70) | st.sampled_from([b"n" * 16, b"n" * 64, b"n" * 65, b"m" * 32])
traces = st.none() | st.text(max_size=210)
_any_field = ids | methods | deadlines | payloads | blobs
# Each kind's fields in order; a field is drawn from its own (ill-typed) strategy or any.
_SLOTS = {
    frames.REQUEST: [ids, methods, payloads, deadlines, traces],
    frames.RESPONSE: [ids, payloads], frames.ERROR: [ids, payloads],
    frames.NOTIFY: [methods, payloads, traces], frames.CANCEL: [ids],
    frames.HELLO: [ids, blobs], frames.PROOF: [methods, blobs, blobs],
    frames.WELCOME: [methods, blobs],
}


@st.composite
def frame_lists(draw: st.DrawFn) -> list[Any]:
    """``[kind, ...fields]`` with the right arity more often than not, and any field types."""
    kind = draw(st.integers(-1, 9) | _leaf)
    slots = _SLOTS.get(kind, [])
    n = len(slots) if slots and draw(st.integers(0, 3)) else draw(st.integers(0, 7))
    return [kind, *(draw(slots[i] if i < len(slots) and draw(st.booleans()) else _any_field)
                    for i in range(n))]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _check_accepted(frame: frames.Frame) -> None:
    """What the decoder lets through obeys the bounds the rest of the code relies on."""
    def short_str(v: Any, empty_ok: bool) -> bool:
        return isinstance(v, str) and (empty_ok or v != "") and len(v) <= frames.MAX_METHOD_CHARS

    def frame_id(v: Any) -> bool:
        return type(v) is int and 1 <= v < 2**63

    match frame:
        case frames.Request():
            assert frame_id(frame.id) and short_str(frame.method, False)
            assert isinstance(frame.payload, dict) and type(frame.timeout_s) is float
            assert 0 < frame.timeout_s <= frames.MAX_TIMEOUT_S
            assert frame.trace is None or short_str(frame.trace, True)
        case frames.Response():
            assert frame_id(frame.id) and isinstance(frame.payload, dict)
        case frames.Error():
            assert type(frame.id) is int and frame.id >= 0 and isinstance(frame.error, dict)
        case frames.Notify():
            assert short_str(frame.method, False) and isinstance(frame.payload, dict)
            assert frame.trace is None or short_str(frame.trace, True)
        case frames.Cancel():
            assert frame_id(frame.id)
        case frames.Hello():
            assert type(frame.version) is int and isinstance(frame.nonce, bytes)
            assert 16 <= len(frame.nonce) <= 64
        case frames.Proof():
            assert short_str(frame.name, True) and isinstance(frame.nonce, bytes)
            assert 16 <= len(frame.nonce) <= 64 and isinstance(frame.mac, bytes)
            assert len(frame.mac) == 32
        case frames.Welcome():
            assert short_str(frame.name, True) and isinstance(frame.mac, bytes)
            assert len(frame.mac) == 32
    # Compared as bytes: a NaN in a payload is not equal to itself.
    encoded = frames.encode(frame)
    assert frames.encode(frames.decode(encoded)) == encoded


# -- the decoder ------------------------------------------------------------------------------


@FUZZ
@given(obj=frame_lists())
def test_decode_fields_of_every_type(obj: list[Any]) -> None:
    try:
        data = _pack(obj)
    except (OverflowError, ValueError):  # e.g. a surrogate in a str: not a frame anyone sends
        return
    try:
        frame = frames.decode(data)
    except TYPED:
        return
    _check_accepted(frame)


@FUZZ
@given(obj=msgpack_values, raw=st.binary(max_size=64), limit=st.integers(1, 4096))
def test_decode_random_values_and_bytes(obj: Any, raw: bytes, limit: int) -> None:
    try:
        data = _pack(obj)
    except (OverflowError, ValueError):
        data = b""
    for candidate in (data, raw, data + raw, data[: len(data) // 2]):
        for max_bytes in (limit, frames.DEFAULT_MAX_FRAME_BYTES):
            try:
                frame = frames.decode(candidate, max_bytes)
            except TYPED:
                continue
            _check_accepted(frame)


# A container level of the nesting fuzz: a one-element array, or a one-entry map.
_LEVELS = {"array": b"\x91", "map": b"\x81\xa1k"}


@FUZZ
@given(levels=st.lists(st.sampled_from(sorted(_LEVELS)), max_size=1500),
       leaf=st.sampled_from([b"\xc0", b"\x01", b"\xa1x", b"\x90", b"\x80"]))
def test_nesting_limit_is_exact(levels: list[str], leaf: bytes) -> None:
    """RESPONSE [1, 7, {"p": <levels...> leaf}]: the frame array and the payload map count."""
    data = b"\x93\x01\x07\x81\xa1p" + b"".join(_LEVELS[k] for k in levels) + leaf
    depth = 2 + len(levels) + (1 if leaf in (b"\x90", b"\x80") else 0)
    if depth <= frames.MAX_DEPTH:
        frame = frames.decode(data)
        assert isinstance(frame, frames.Response) and frame.id == 7
    else:
        with pytest.raises(ProtocolError):
            frames.decode(data)


# Headers that claim a length: arrays and maps (a decoder may allocate for those up front)
# nest; str/bin/ext ones end the chain. Values are (tag, width of the length field).
_CONTAINERS = [(b"\xdc", 2), (b"\xdd", 4), (b"\xde", 2), (b"\xdf", 4)]
_BLOBS = [(b"\xd9", 1), (b"\xda", 2), (b"\xdb", 4), (b"\xc4", 1), (b"\xc5", 2), (b"\xc6", 4),
          (b"\xc7", 1), (b"\xc8", 2), (b"\xc9", 4)]


def _claim(draw: st.DrawFn, tag: bytes, width: int) -> bytes:
    # Up to the decoder's own limit (16 Mi) mostly, any u32 sometimes.
    n = draw(st.integers(0, min(2 ** (8 * width) - 1, 1 << 24)) | st.integers(0, 2 ** (8 * width) - 1))
    return tag + n.to_bytes(width, "big") + (b"\x05" if tag in (b"\xc7", b"\xc8", b"\xc9") else b"")


@st.composite
def lying_frames(draw: st.DrawFn) -> bytes:
    """RESPONSE [7, ...] then nested headers claiming far more items than the frame holds."""
    parts = [b"\x93\x02\x07"]
    for _ in range(draw(st.integers(1, 300))):
        parts.append(_claim(draw, *draw(st.sampled_from(_CONTAINERS))))
    if draw(st.booleans()):
        parts.append(_claim(draw, *draw(st.sampled_from(_BLOBS))))
    parts.append(draw(st.binary(max_size=16)))
    return b"".join(parts)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=lying_frames())
def test_claimed_lengths_do_not_allocate(data: bytes) -> None:
    """Peak traced memory while decoding stays within what real content of that size could
    need (nested one-item lists cost ~90 bytes per byte), not what the headers claim."""
    tracemalloc.start()
    try:
        try:
            frames.decode(data)
        except TYPED:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * 1024 + 128 * len(data), (peak, len(data))


def test_nested_claims_do_not_allocate() -> None:
    """300 nested arrays each claiming 2**24-1 slots (1.5 KB) made msgpack allocate ~24 MB
    (and take ~20 ms) before it found the input incomplete."""
    data = b"\x93\x02\x07" + b"\xdd\x00\xff\xff\xff" * 300
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            frames.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, peak


# -- the handshake against a rogue server ------------------------------------------------------

_codes = st.sampled_from(["auth_failed", "protocol_error", "not_found", "unavailable", "internal",
                          "no_such_code", "overloaded"]) | st.text(max_size=8) | _leaf
_detail_keys = st.sampled_from(["message", "remote_code", "code", "retry_after_s", "details",
                                "self", "", "x"]) | st.text(max_size=6)
_wire_errors = st.fixed_dictionaries(
    {}, optional={"code": _codes, "message": _leaf,
                  "details": st.dictionaries(_detail_keys, _leaf, max_size=3) | _leaf})


@st.composite
def rogue_messages(draw: st.DrawFn) -> bytes:
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return draw(st.binary(max_size=40))
    if choice == 1:
        try:
            return _pack(draw(frame_lists()))
        except (OverflowError, ValueError):
            return b"\x90"
    if choice == 2:
        return frames.encode(frames.Hello(draw(st.integers(-3, 3) | st.just(frames.PROTOCOL_VERSION)),
                                          draw(st.binary(min_size=16, max_size=64))))
    if choice == 3:
        return frames.encode(frames.Welcome(draw(st.text(max_size=10)),
                                            draw(st.binary(min_size=32, max_size=32))))
    return frames.encode(frames.Error(draw(st.integers(0, 3)), draw(_wire_errors)))


@FUZZ
@given(script=st.lists(rogue_messages(), max_size=4))
def test_client_handshake_against_a_rogue_server(loop_thread: LoopThread,
                                                 script: list[bytes]) -> None:
    async def hang_up_after_proof(rogue_end: MemoryChannel) -> None:
        # Hang up once the client sent its proof or gave up, so a client still waiting for
        # a frame gets EOF (it must fail then, not hang) after the scripted ones.
        try:
            await rogue_end.recv()
        except PeerLost:
            pass
        await rogue_end.close()

    async def run() -> BaseException | None:
        client_end, rogue_end = memory_pair("client", "rogue")
        for message in script:
            await rogue_end.send(message)
        rogue = asyncio.create_task(hang_up_after_proof(rogue_end))
        try:
            await client_handshake(client_end, SECRET, name="client", timeout_s=2.0)
        except (AuthFailed, ConnectFailed):
            return None
        except BaseException as exc:  # noqa: BLE001 - reported below with its type
            return exc
        finally:
            await client_end.close()
            await rogue
        return AssertionError("handshake succeeded against a server without the secret")

    outcome = loop_thread.run(run())
    assert outcome is None, repr(outcome)


def test_from_wire_with_a_self_detail_key() -> None:
    """``from_wire`` is documented never to raise; a peer's error with a ``self`` detail
    made it raise TypeError (in client_handshake, RpcConnection._dispatch, pipeline): the key
    is renamed like the constructor's other argument names."""
    err = from_wire({"code": "auth_failed", "message": "no", "details": {"self": 1}})
    assert isinstance(err, AuthFailed) and err.details == {"detail_self": 1}


# -- a live server ----------------------------------------------------------------------------

PROBE_ID = 2**63 - 7
_CRASH_EVENTS = {"rpc reader crashed", "rpc handler failed", "rpc close callback failed"}
_AFTER_HANDSHAKE = (frames.Request, frames.Response, frames.Error, frames.Notify, frames.Cancel)


@st.composite
def valid_frames(draw: st.DrawFn) -> tuple[str, Any]:
    """A well-formed post-handshake frame (the server must keep the connection)."""
    rid = draw(st.integers(1, 2**63 - 1) | st.sampled_from([1, 2, 3]))
    payload = draw(st.dictionaries(st.text(max_size=5), msgpack_values, max_size=3))
    kind = draw(st.sampled_from(["request", "response", "cancel", "notify", "error"]))
    if kind == "request":
        method = draw(st.sampled_from(["echo", "nope", "x" * 200]))
        timeout_s = draw(st.floats(min_value=1e-9, max_value=frames.MAX_TIMEOUT_S))
        frame: frames.Frame = frames.Request(rid, method, payload, timeout_s, None)
    elif kind == "response":
        frame = frames.Response(rid, payload)
    elif kind == "cancel":
        frame = frames.Cancel(rid)
    elif kind == "notify":
        frame = frames.Notify(draw(st.sampled_from(["echo", "nope"])), payload)
    else:
        frame = frames.Error(draw(st.integers(0, 3) | st.just(rid)), draw(_wire_errors))
    return "bytes", frames.encode(frame)


@st.composite
def junk_messages(draw: st.DrawFn) -> tuple[str, Any]:
    """Bytes that are not a frame, malformed or lying frames, text, or an oversized message."""
    kind = draw(st.sampled_from(["bytes", "fields", "lying", "text", "oversize"]))
    if kind == "bytes":
        return "bytes", draw(st.binary(max_size=48))
    if kind == "fields":
        try:
            return "bytes", _pack(draw(frame_lists()))
        except (OverflowError, ValueError):
            return "bytes", b"\xc1"
    if kind == "lying":
        return "bytes", draw(lying_frames())
    if kind == "text":
        return "text", draw(st.text(max_size=16))
    return "bytes", b"\x00" * (RPC_MAX_FRAME_BYTES + 1)


# Valid frames three times in four: a session is then often all valid (and must be served).
ws_messages = st.one_of(valid_frames(), valid_frames(), valid_frames(), junk_messages())


def _expect_served(messages: list[tuple[str, Any]], authenticated: bool) -> bool | None:
    """True when every message is a valid post-handshake frame (the connection must stay),
    False when one is not (it must be dropped), None when either is legitimate."""
    if not authenticated:
        return False
    request_ids: list[int] = []
    for kind, data in messages:
        if kind == "text":
            return False
        try:
            frame = frames.decode(data, RPC_MAX_FRAME_BYTES)
        except TYPED:
            return False
        if not isinstance(frame, _AFTER_HANDSHAKE):
            return False
        if isinstance(frame, frames.Request):
            request_ids.append(frame.id)
    if PROBE_ID in request_ids or len(set(request_ids)) != len(request_ids):
        return None  # a duplicate id in flight is a violation only if it is still serving
    return True


async def _fuzz_session(url: str, messages: list[tuple[str, Any]], authenticate: bool,
                        token: int) -> str:
    """Send ``messages`` on one WebSocket, then a probe call; 'served' or 'dropped'."""
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(url, max_msg_size=4 * RPC_MAX_FRAME_BYTES, heartbeat=None)
    channel = WebSocketChannel(ws, peer="fuzz-server", session=session)
    try:
        if authenticate:
            await client_handshake(channel, SECRET, name="fuzzer", timeout_s=2.0)
        try:
            for kind, data in messages:
                if kind == "text":
                    await ws.send_str(data)
                else:
                    await channel.send(data)
            await channel.send(frames.encode(
                frames.Request(PROBE_ID, "echo", {"probe": token}, 2.0, None)))
        except (PeerLost, ConnectionError, aiohttp.ClientError, RuntimeError):
            pass  # the server already hung up; what it sent before is still read below
        async with asyncio.timeout(5.0):
            while True:
                try:
                    data = await channel.recv()
                except PeerLost:
                    return "dropped"
                frame = frames.decode(data)  # the server only ever sends well-formed frames
                if isinstance(frame, frames.Error) and frame.id == 0:
                    code = frame.error.get("code")
                    assert code in ("protocol_error", "frame_too_large", "auth_failed"), frame
                elif isinstance(frame, frames.Response) and frame.id == PROBE_ID:
                    assert frame.payload == {"probe": token}, frame
                    return "served"
    finally:
        await channel.close()


@LIVE
@given(messages=st.lists(ws_messages, min_size=1, max_size=4), authenticate=st.booleans(),
       token=st.integers(0, 2**31))
def test_live_server_survives_random_frames(rpc_server: RpcFuzzServer,
                                            messages: list[tuple[str, Any]], authenticate: bool,
                                            token: int) -> None:
    async def run() -> str:
        outcome = await _fuzz_session(rpc_server.url, messages, authenticate, token)
        conn = await connect(rpc_server.url, secret=SECRET, name="fuzz-check", heartbeat_s=None,
                             connect_timeout_s=3.0)
        try:
            assert await conn.call("echo", {"n": token}, timeout_s=3.0) == {"n": token}
        finally:
            await conn.close()
        return outcome

    with capture_logs() as logs:
        outcome = rpc_server.loop.run(run(), timeout_s=15.0)
    crashes = [e for e in logs if e.get("event") in _CRASH_EVENTS]
    assert not crashes, crashes
    expected = _expect_served(messages, authenticate)
    event(f"connection {outcome}, expected {expected}")  # coverage: --hypothesis-show-statistics
    if expected is not None:
        assert outcome == ("served" if expected else "dropped"), (outcome, messages)
