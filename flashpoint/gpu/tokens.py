"""The per-GPU token manager: a thin asyncio Unix-socket server around
:class:`flashpoint.policy.tokens.TokenState`.

Each hooked process (``hook/fp_hook.c``) holds one connection and speaks the fixed-size
protocol of ``hook/fp_protocol.h`` (``token_protocol.py``).  All decisions live in the pure
state class; this module only reads messages, feeds them in with the clock, writes the
grants out, and wakes up at the state's next deadline.  The host manager owns one instance
per GPU or slice and calls :meth:`TokenManager.set_quota` when the controller changes a
tenant's share.

A connection's tenant is the one the host bound to the connecting process (``SO_PEERCRED``
pid, or its nearest bound ancestor: :meth:`TokenManager.bind_pid`) when ``verify_peers`` is
on (hosts turn it on): a process cannot report usage for, or take tokens of, another tenant
by claiming its number in HELLO; a process bound to no tenant is refused.

Run standalone (tests, benchmarks)::

    python -m flashpoint.gpu.tokens --socket /tmp/fp.sock --quota 1=0.3:0.3 --quota 2=0.7:1.0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from flashpoint.errors import ProtocolError
from flashpoint.gpu import token_protocol as proto
from flashpoint.log import get_logger
from flashpoint.policy.tenant_memory import TenantMemory
from flashpoint.policy.tokens import ClientId, Grant, TenantId, TenantQuota, TokenConfig, TokenState

STOP_TIMEOUT_S = 2.0
SHARE_WINDOW_S = 1.0  # the per-tenant share gauge is over windows of about this length
METRICS_EVERY_NS = 250_000_000  # the tick runs every few ms; gauges need not
log = get_logger("flashpoint.gpu.tokens")

# One manager per GPU or slice: "unit" is its name (the host's device id, or the socket).
GRANTS = Counter("flashpoint_tokens_grants_total", "Time tokens granted", ["unit"])
WAIT = Histogram("flashpoint_tokens_wait_seconds", "REQUEST to GRANT wait of a hooked process",
                 ["unit"], buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                                    0.25, 0.5, 1.0))
# A counter (exposed as ..._total): rate() of it is a tenant's GPU seconds per second.
HELD = Counter("flashpoint_tokens_held_seconds", "GPU time charged to a tenant (lifetime)",
               ["unit", "tenant"])
SHARE = Gauge("flashpoint_tokens_share", "A tenant's fraction of the GPU time charged in the "
              "last window", ["unit", "tenant"])
MEMORY = Gauge("flashpoint_tokens_memory_bytes", "Device bytes a tenant's processes report",
               ["unit", "tenant"])
WAITING = Gauge("flashpoint_tokens_waiting", "Processes waiting for a token", ["unit"])
# Dilu's vertical scaling: the limit each tenant is held to now (a best-effort tenant's falls
# to factor x request while an SLO tenant of the unit is active), by the tenant's class.
LIMIT = Gauge("flashpoint_tokens_limit", "A tenant's time limit in force (fraction of the "
              "window) after Dilu's KLC, by tenant class (slo | best_effort)",
              ["unit", "tenant", "tenant_class"])
KLC_FACTOR = Gauge("flashpoint_tokens_klc_factor", "Dilu's KLC factor on the best-effort "
                   "tenants' requests (1: held to their request)", ["unit"])
THROTTLED = Gauge("flashpoint_tokens_best_effort_throttled", "1 while an active SLO-sensitive "
                  "tenant holds the unit's best-effort tenants to factor x request", ["unit"])
PEERS_REFUSED = Counter("flashpoint_tokens_peers_refused_total",
                        "Hooked processes refused (bound to no tenant) or whose HELLO claimed "
                        "another tenant than their own, by outcome", ["unit", "outcome"])
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_ANCESTORS = 16  # how far up the process tree a connecting process's tenant is looked for


class TokenManager:
    """Serve time tokens for one GPU (or slice) on a Unix socket."""

    def __init__(self, socket_path: str | Path, config: TokenConfig | None = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns, name: str = "", *,
                 verify_peers: bool = False) -> None:
        self.socket_path = str(socket_path)
        self.verify_peers = verify_peers
        self._pid_tenants: dict[int, TenantId] = {}
        self.name = name or self.socket_path  # the metrics' "unit" label
        self._clock = clock_ns
        self.state = TokenState(config, clock_ns())
        self.memory = TenantMemory()  # per-tenant device bytes and caps (MEM messages)
        self._requested_ns: dict[ClientId, int] = {}  # when a client's pending REQUEST came
        self._share_mark: tuple[int, dict[TenantId, int]] = (clock_ns(), {})
        self._metrics_at = 0  # ns of the last metrics update (at most every METRICS_EVERY_NS)
        self._held_ns: dict[TenantId, int] = {}  # per tenant: what HELD counts so far
        self._class_labels: dict[TenantId, str] = {}  # per tenant: its LIMIT series' class
        self._throttled = False  # best-effort tenants held by KLC (logged when it flips)
        self._writers: dict[ClientId, asyncio.StreamWriter] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self.pids: dict[ClientId, int] = {}

    async def start(self) -> None:
        """Listen on the socket (replacing a stale one) and start the clock task."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path)
        self._ticker = asyncio.create_task(self._tick_loop(), name="token-manager-tick")

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Close the socket and every connection (hooks then fail open and retry)."""
        if self._server is not None:
            self._server.close()
        if self._ticker is not None:
            self._ticker.cancel()
        # Closing the transports ends each handler's read normally; cancelling handlers
        # instead makes asyncio's stream callback log their CancelledError.
        for w in list(self._writers.values()):
            w.close()
        conns = list(self._conn_tasks)
        if conns:
            _done, pending = await asyncio.wait(conns, timeout=timeout_s)
            for t in pending:
                t.cancel()
        if self._ticker is not None:
            await asyncio.wait([self._ticker], timeout=timeout_s)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout_s)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def set_quota(self, tenant: TenantId, quota: TenantQuota) -> None:
        """Change a tenant's quotas live (called by the host manager)."""
        self._send(self.state.set_quota(tenant, quota, self._clock()))

    def set_memory_limit(self, tenant: TenantId, limit_bytes: int) -> None:
        """A tenant's device-memory limit across all its processes (0 = none); each of its
        processes gets its cap (limit minus what the others hold) at once."""
        self._write_caps(self.memory.set_limit(tenant, limit_bytes))

    def bind_pid(self, pid: int, tenant: TenantId) -> None:
        """Process ``pid`` (and its descendants) is ``tenant``'s (``verify_peers``)."""
        self._pid_tenants[pid] = tenant

    def unbind_pid(self, pid: int) -> None:
        self._pid_tenants.pop(pid, None)

    def _peer_tenant(self, writer: asyncio.StreamWriter, claimed: TenantId) -> TenantId | None:
        """The tenant of the process at the other end; None = refuse it."""
        if not self.verify_peers:
            return claimed
        sock = writer.get_extra_info("socket")
        try:
            pid, _uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except (OSError, AttributeError, struct.error):
            return None
        for _ in range(MAX_ANCESTORS):
            tenant = self._pid_tenants.get(pid)
            if tenant is not None:
                return tenant
            pid = _parent_pid(pid)
            if pid <= 1:
                return None
        return None

    def memory_by_tenant(self) -> dict[TenantId, int]:
        """Device bytes each tenant's connected processes last reported."""
        return self.memory.used_by_tenant()

    def usage_by_tenant(self) -> dict[TenantId, int]:
        """Lifetime GPU time charged per tenant, in ns (the manager's accounting)."""
        return dict(self.state.tenant_total_ns)

    # ---- I/O ----
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        client = next(self._ids)
        try:
            hello = proto.unpack(await reader.readexactly(proto.MSG_SIZE))
            if hello.type is not proto.MsgType.HELLO:
                raise ProtocolError(f"expected HELLO, got {hello.type.name}")
            tenant = self._peer_tenant(writer, hello.tenant)
            if tenant is None:
                PEERS_REFUSED.labels(self.name, "unbound").inc()
                raise ProtocolError(f"process {hello.pid} is bound to no tenant")
            if tenant != hello.tenant:
                PEERS_REFUSED.labels(self.name, "wrong_tenant").inc()
                log.warning("token_tenant_mismatch", client=client, pid=hello.pid,
                            claimed=hello.tenant, tenant=tenant)
            self.state.connect(client, tenant, self._clock())
            self._writers[client] = writer
            self.pids[client] = hello.pid
            self._write_caps(self.memory.connect(client, tenant))  # the hook waits for it
            while True:
                msg = proto.unpack(await reader.readexactly(proto.MSG_SIZE))
                now = self._clock()
                if msg.type is proto.MsgType.REQUEST:
                    self._requested_ns[client] = now
                    self._send(self.state.request(client, msg.seq, msg.used_ns, now))
                elif msg.type is proto.MsgType.RELEASE:
                    self._send(self.state.release(client, msg.used_ns, now))
                elif msg.type is proto.MsgType.MEM:
                    self._write_caps(self.memory.report(client, msg.mem_used_bytes))
                else:
                    raise ProtocolError(f"unexpected {msg.type.name} from a hook")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the hook went away; its grants and holds are dropped below
        except ProtocolError as e:
            log.warning("token_protocol_error", client=client, error=str(e))
        finally:
            self._writers.pop(client, None)
            self._requested_ns.pop(client, None)
            self._write_caps(self.memory.disconnect(client))
            self._send(self.state.disconnect(client, self._clock()))
            writer.close()
            if task is not None:
                self._conn_tasks.discard(task)

    def _write(self, grants: list[Grant]) -> None:
        now = self._clock() if grants else 0
        for g in grants:
            w = self._writers.get(g.client)
            if w is not None and not w.is_closing():
                w.write(proto.pack(proto.TokenMsg(proto.MsgType.GRANT, seq=g.seq, quota_ns=g.quota_ns)))
                GRANTS.labels(self.name).inc()
                asked = self._requested_ns.pop(g.client, None)
                if asked is not None:
                    WAIT.labels(self.name).observe(max(0, now - asked) / 1e9)

    def _write_caps(self, caps: list[tuple[ClientId, int]]) -> None:
        for client, cap in caps:
            w = self._writers.get(client)
            if w is not None and not w.is_closing():
                w.write(proto.pack(proto.TokenMsg(proto.MsgType.MEM, mem_limit_bytes=cap)))

    def _publish_metrics(self) -> None:
        """Per-tenant held time, share over the last window, memory; waiting processes."""
        now = self._clock()
        if now - self._metrics_at < METRICS_EVERY_NS:
            return
        self._metrics_at = now
        totals = dict(self.state.tenant_total_ns)
        for t, ns in totals.items():
            counted = self._held_ns.get(t, 0)
            if ns > counted:  # a counter only goes up: add what was charged since
                HELD.labels(self.name, str(t)).inc((ns - counted) / 1e9)
                self._held_ns[t] = ns
        for t, b in self.memory.used_by_tenant().items():
            MEMORY.labels(self.name, str(t)).set(b)
        WAITING.labels(self.name).set(len(self.state.waiting()))
        since, before = self._share_mark
        if now - since >= SHARE_WINDOW_S * 1e9:
            deltas = {t: max(0, ns - before.get(t, 0)) for t, ns in totals.items()}
            spent = sum(deltas.values())
            if spent:
                for t, d in deltas.items():
                    SHARE.labels(self.name, str(t)).set(d / spent)
            self._share_mark = (now, totals)
        self._publish_limits()

    def _publish_limits(self) -> None:
        """Each tenant's limit in force and class; the unit's KLC factor and throttling."""
        for t in self.state.quotas:
            cls = self.state.quota(t).tenant_class.value
            old = self._class_labels.get(t)
            if old is not None and old != cls:  # a live class change: drop the old series
                with contextlib.suppress(KeyError):
                    LIMIT.remove(self.name, str(t), old)
            self._class_labels[t] = cls
            LIMIT.labels(self.name, str(t), cls).set(self.state.effective_quota(t).limit)
        KLC_FACTOR.labels(self.name).set(self.state.klc.factor)
        THROTTLED.labels(self.name).set(1 if self._throttled else 0)

    def _note_throttle(self) -> None:
        """Log when KLC starts or stops holding the best-effort tenants (an SLO tenant's
        demand rose from idle, or it has been idle ``idle_slots``)."""
        throttled = self.state.best_effort_throttled()
        if throttled == self._throttled:
            return
        self._throttled = throttled
        best_effort = sorted(t for t, q in self.state.quotas.items() if not q.slo_sensitive)
        log.info("tokens_best_effort_throttled" if throttled else "tokens_best_effort_released",
                 unit=self.name, phase=self.state.klc.phase.value,
                 factor=round(self.state.klc.factor, 4), best_effort_tenants=best_effort)

    def _send(self, grants: list[Grant]) -> None:
        self._write(grants)
        self._wake.set()  # an event may have moved the next deadline

    async def _tick_loop(self) -> None:
        while True:
            delay_s = 0.005
            try:
                delay_s = max(0.0, (self.state.next_deadline_ns() - self._clock()) / 1e9)
            except Exception:  # noqa: BLE001 - the clock loop must not die (STYLE.md 4)
                log.exception("token_deadline_failed")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay_s)
            try:
                self._write(self.state.tick(self._clock()))
                self._note_throttle()
                self._publish_metrics()
            except Exception:  # noqa: BLE001 - logged; the next tick tries again
                log.exception("token_tick_failed")


def _parent_pid(pid: int) -> int:
    """``pid``'s parent from ``/proc`` (0 when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read(4096)
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _parse_quota(text: str) -> tuple[int, TenantQuota]:
    """``TENANT=REQUEST:LIMIT[:SM[:slo]]``, e.g. ``1=0.3:0.5`` or ``2=0.5:1.0:0.5:slo``."""
    tenant, _, rest = text.partition("=")
    parts = rest.split(":")
    return int(tenant), TenantQuota(float(parts[0]), float(parts[1]),
                                    float(parts[2]) if len(parts) > 2 else 1.0,
                                    len(parts) > 3 and parts[3] == "slo")


async def _main(args: argparse.Namespace) -> None:
    mgr = TokenManager(args.socket, TokenConfig(window_ns=int(args.window_ms * 1e6),
                                                token_ns=int(args.token_ms * 1e6)))
    for q in args.quota:
        tenant, quota = _parse_quota(q)
        mgr.state.set_quota(tenant, quota, time.monotonic_ns())
    await mgr.start()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    print(json.dumps({"listening": args.socket}), flush=True)
    await done.wait()
    print(json.dumps({"usage_ns": {str(k): v for k, v in mgr.usage_by_tenant().items()}}), flush=True)
    await mgr.stop()


def main(argv: list[str] | None = None) -> None:
    """Standalone token manager (tests and benchmarks; the host manager embeds the class)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--quota", action="append", default=[], help="TENANT=REQUEST:LIMIT[:SM[:slo]]")
    p.add_argument("--window-ms", type=float, default=100.0)
    p.add_argument("--token-ms", type=float, default=10.0)
    asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
