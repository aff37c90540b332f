"""A blocking Python client of the token manager, speaking the hook's protocol as the hook does.

It exists for benchmarks, profilers and tests that want GRANT round trips without a hooked
process.  It mirrors ``tk_acquire`` in ``hook/fp_hook.c`` in the two ways a naive client
gets wrong on one persistent connection:

* The manager answers HELLO with a MEM message (this process's device-memory cap; the hook
  waits for it).  A client that reads "the next message" after its first REQUEST gets that
  MEM, not the GRANT (``bench/tokens.py`` failed with "the reply's seq is not the
  request's" for this reason).  Here MEM messages are applied wherever they arrive.
* A reply is matched to its request by ``seq``; a GRANT with another ``seq`` is stale and
  skipped.  A request that times out closes the connection (STYLE.md 7: a cancelled read
  closes its connection), so its late GRANT can never be taken for the next request's.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from flashpoint.errors import ConnectFailed, DeadlineExceeded, ProtocolError
from flashpoint.gpu import token_protocol as proto

DEFAULT_TIMEOUT_S = 2.0


class TokenClient:
    """One connection to a token manager as one tenant's process (blocking, not thread-safe)."""

    def __init__(self, socket_path: str | Path, tenant: int, *, pid: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = str(socket_path)
        self.tenant = tenant
        self.pid = os.getpid() if pid is None else pid
        self.timeout_s = timeout_s
        self.mem_cap_bytes = 0  # the last cap the manager sent (0 = none)
        self.stale_grants = 0  # GRANTs of older requests skipped
        self._seq = 0
        self._sock: socket.socket | None = None

    @property
    def connected(self) -> bool:
        """Whether the connection is open (a timeout or error closes it)."""
        return self._sock is not None

    def connect(self) -> None:
        """Connect and say HELLO; waits for the manager's cap reply (as the hook does)."""
        self.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.socket_path)
        except OSError as e:
            s.close()
            raise ConnectFailed(f"token manager {self.socket_path}: {e}") from e
        self._sock = s
        self._send(proto.TokenMsg(proto.MsgType.HELLO, tenant=self.tenant, pid=self.pid))
        msg = self._read(time.monotonic() + self.timeout_s)
        if msg.type is not proto.MsgType.MEM:
            self.close()
            raise ProtocolError(f"expected MEM after HELLO, got {msg.type.name}")
        self.mem_cap_bytes = msg.mem_limit_bytes

    def request(self, used_ns: int = 0) -> proto.TokenMsg:
        """REQUEST a token (settling ``used_ns`` of the previous one); return its GRANT.

        :class:`DeadlineExceeded` after ``timeout_s`` (the connection is then closed)."""
        if self._sock is None:
            raise ConnectFailed("token client is not connected")
        self._seq += 1
        seq = self._seq
        self._send(proto.TokenMsg(proto.MsgType.REQUEST, tenant=self.tenant, pid=self.pid, seq=seq,
                                  used_ns=used_ns))
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._read(deadline)
            if msg.type is proto.MsgType.GRANT and msg.seq == seq:
                return msg
            if msg.type is proto.MsgType.MEM:
                self.mem_cap_bytes = msg.mem_limit_bytes
            elif msg.type is proto.MsgType.GRANT and msg.seq < seq:
                self.stale_grants += 1
            else:
                self.close()
                raise ProtocolError(f"unexpected {msg.type.name} (seq {msg.seq}) waiting for "
                                    f"GRANT {seq}")

    def release(self, used_ns: int) -> None:
        """RELEASE the held token early, charging ``used_ns``."""
        self._send(proto.TokenMsg(proto.MsgType.RELEASE, tenant=self.tenant, pid=self.pid,
                                  seq=self._seq, used_ns=used_ns))

    def close(self) -> None:
        """Close the connection (the manager drops this client's holds)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> TokenClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg: proto.TokenMsg) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(proto.pack(msg))
        except OSError as e:
            self.close()
            raise ConnectFailed(f"token manager {self.socket_path}: {e}") from e

    def _read(self, deadline: float) -> proto.TokenMsg:
        """One whole message before ``deadline``; on timeout or EOF the connection is closed."""
        assert self._sock is not None
        buf = b""
        while len(buf) < proto.MSG_SIZE:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise DeadlineExceeded(f"no reply from token manager {self.socket_path}")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(proto.MSG_SIZE - len(buf))
            except TimeoutError:
                continue  # the deadline check above closes and raises
            except OSError as e:
                self.close()
                raise ConnectFailed(f"token manager {self.socket_path}: {e}") from e
            if not chunk:
                self.close()
                raise ConnectFailed(f"token manager {self.socket_path} closed the connection")
            buf += chunk
        return proto.unpack(buf)
