"""Grant round trips on one persistent connection (issue 22 item 8).

The manager answers HELLO with a MEM cap; a client that took "the next message" as the
GRANT of its first REQUEST read that MEM (seq 0) and ``bench/tokens.py`` crashed.  The
raw-socket test below pins the manager's behaviour that caused it; the others check that
:class:`TokenClient` matches replies by seq, applies caps, and never takes a late GRANT for
the next request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from pathlib import Path

import pytest

from flashpoint.errors import DeadlineExceeded
from flashpoint.gpu import token_protocol as proto
from flashpoint.gpu.token_client import TokenClient
from flashpoint.gpu.tokens import TokenManager
from flashpoint.policy.tokens import TenantQuota

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sock() -> Path:
    path = Path(f"/tmp/fp-tc-{os.getpid()}-{time.monotonic_ns()}.sock")
    yield path
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@contextlib.asynccontextmanager
async def running(sock: Path):
    mgr = TokenManager(sock)
    mgr.set_quota(9, TenantQuota(1.0, 1.0))
    await mgr.start()
    try:
        yield mgr
    finally:
        await mgr.stop()


def _recv_msg(s: socket.socket) -> proto.TokenMsg:
    buf = b""
    while len(buf) < proto.MSG_SIZE:
        chunk = s.recv(proto.MSG_SIZE - len(buf))
        assert chunk, "manager closed"
        buf += chunk
    return proto.unpack(buf)


async def test_first_message_after_hello_is_the_mem_cap_not_a_grant(sock):
    # The old bench's reading: HELLO, REQUEST seq 1, take the next message as its GRANT.
    def naive() -> list[proto.TokenMsg]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(sock))
            s.sendall(proto.pack(proto.TokenMsg(proto.MsgType.HELLO, tenant=9, pid=os.getpid())))
            s.sendall(proto.pack(proto.TokenMsg(proto.MsgType.REQUEST, tenant=9, seq=1)))
            return [_recv_msg(s), _recv_msg(s)]

    async with running(sock):
        first, second = await asyncio.to_thread(naive)
    assert (first.type, first.seq) == (proto.MsgType.MEM, 0)  # what the bench asserted on
    assert (second.type, second.seq) == (proto.MsgType.GRANT, 1)


async def test_client_round_trips_match_their_requests(sock):
    def rounds() -> tuple[list[int], int]:
        with TokenClient(sock, tenant=9) as c:
            seqs = [c.request(used_ns=1000).seq for _ in range(200)]
            return seqs, c.stale_grants

    async with running(sock) as mgr:
        seqs, stale = await asyncio.to_thread(rounds)
        # every request settled its predecessor's 1000 ns in the manager's accounting
        assert mgr.usage_by_tenant()[9] >= 199 * 1000
    assert seqs == list(range(1, 201)) and stale == 0


async def test_mem_cap_arriving_between_request_and_grant_is_applied(sock):
    async with running(sock) as mgr:
        c = TokenClient(sock, tenant=9)
        try:
            await asyncio.to_thread(c.connect)
            mgr.set_memory_limit(9, 123 << 20)  # a MEM is now queued before any GRANT
            g = await asyncio.to_thread(c.request)
        finally:
            c.close()
    assert g.type is proto.MsgType.GRANT and g.seq == 1
    assert c.mem_cap_bytes == 123 << 20


async def test_timed_out_request_closes_so_its_late_grant_is_never_the_next_reply(sock):
    # A manager that answers each REQUEST late (after the client's deadline) and with seq.
    served: list[int] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readexactly(proto.MSG_SIZE)  # HELLO
            writer.write(proto.pack(proto.TokenMsg(proto.MsgType.MEM)))
            req = proto.unpack(await reader.readexactly(proto.MSG_SIZE))
            served.append(req.seq)
            await asyncio.sleep(0.3)  # the simulated slow manager, not a synchronisation
            writer.write(proto.pack(proto.TokenMsg(proto.MsgType.GRANT, seq=req.seq)))
            await writer.drain()
            await reader.read(proto.MSG_SIZE)  # EOF: the client closed on its timeout
        writer.close()

    server = await asyncio.start_unix_server(slow, path=str(sock))
    try:
        c = TokenClient(sock, tenant=9, timeout_s=0.1)
        await asyncio.to_thread(c.connect)
        with pytest.raises(DeadlineExceeded):
            await asyncio.to_thread(c.request)
        # the connection is gone: the next request cannot read request 1's late GRANT
        assert not c.connected
        with pytest.raises(Exception, match="not connected"):
            c.request()
    finally:
        server.close()
        await server.wait_closed()
    assert served == [1]
