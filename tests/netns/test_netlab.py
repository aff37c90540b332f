"""NetLab: hosts in network namespaces talk TCP, rate caps hold, links cut and heal, and
nothing is left behind. Needs root (the fixture skips with the reason otherwise)."""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from ipaddress import ip_address
from pathlib import Path

import pytest

from flashpoint.testing.netns import NetLab, tbf_params

PEER = str(Path(__file__).with_name("peer.py"))
PORT = 5001
pytestmark = pytest.mark.timeout(60)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next stdout line of ``proc``; AssertionError naming what happened on timeout."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            raise AssertionError(f"no line from pid {proc.pid} in {timeout_s}s "
                                 f"(exit status {proc.poll()})")
        return proc.stdout.readline().strip()
    finally:
        sel.close()


def start_server(lab: NetLab, i: int, mode: str) -> subprocess.Popen:
    proc = lab.exec(i, [sys.executable, PEER, mode, lab.host(i).addr, str(PORT)],
                    stdout=subprocess.PIPE, text=True)
    assert read_line(proc, 10.0) == "ready"
    return proc


def connect(lab: NetLab, i: int, to: int, timeout_s: float, tries: int = 1) -> dict:
    cp = lab.run(i, [sys.executable, PEER, "connect", lab.host(to).addr, str(PORT),
                     str(timeout_s), str(tries)], timeout_s=tries * (timeout_s + 0.5) + 10)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout.strip().splitlines()[-1])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def lab_leftovers(tag: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    return [line for line in (netns.stdout + links.stdout).splitlines() if tag in line]


def test_two_hosts_talk_tcp_and_root_link_reaches_them(make_lab: Callable[..., NetLab]) -> None:
    lab = make_lab(3, root_link=True)
    assert len({h.addr for h in lab.hosts}) == 3
    assert all(ip_address(h.addr) in lab.subnet and h.ns.startswith(lab.tag) for h in lab.hosts)
    start_server(lab, 1, "echo")
    assert connect(lab, 0, to=1, timeout_s=3.0)["ok"]
    # The root namespace reaches a lab host through the root link (a lab address only).
    with socket.create_connection((lab.host(1).addr, PORT), timeout=3.0) as s:
        s.settimeout(3.0)
        s.sendall(b"root")
        s.shutdown(socket.SHUT_WR)
        assert s.recv(16) == b"root"


def test_rate_cap_limits_throughput(make_lab: Callable[..., NetLab]) -> None:
    rate_mbit = 100
    lab = make_lab(2, rate_mbit=rate_mbit)
    qdisc = lab.run(0, ["tc", "qdisc", "show", "dev", "eth0"], timeout_s=10).stdout
    assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
    assert tbf_params(rate_mbit)[0] >= 64 * 1024
    sink = start_server(lab, 1, "sink")
    nbytes = 4 * 1024 * 1024
    lab.run(0, [sys.executable, PEER, "send", lab.host(1).addr, str(PORT), str(nbytes)],
            timeout_s=20, check=True)
    result = json.loads(read_line(sink, 20.0))
    assert result["bytes"] == nbytes
    rate_bytes_per_s = nbytes / result["seconds"]
    cap = rate_mbit * 1e6 / 8
    assert rate_bytes_per_s <= 1.2 * cap, f"{rate_bytes_per_s / 1e6:.1f} MB/s through a 12.5 MB/s cap"
    assert rate_bytes_per_s >= 0.4 * cap, f"only {rate_bytes_per_s / 1e6:.1f} MB/s"


def test_set_link_cuts_and_restores(make_lab: Callable[..., NetLab]) -> None:
    lab = make_lab(2)
    start_server(lab, 1, "echo")
    assert connect(lab, 0, to=1, timeout_s=3.0)["ok"]
    lab.set_link(1, up=False)
    t0 = time.monotonic()
    down = connect(lab, 0, to=1, timeout_s=1.0)
    assert not down["ok"] and time.monotonic() - t0 < 10.0, down
    lab.set_link(1, up=True)
    up = connect(lab, 0, to=1, timeout_s=1.0, tries=10)
    assert up["ok"], up


def test_close_leaves_nothing_even_after_body_raised(netns_available: None) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with NetLab(2, rate_mbit=200, ingress_rate_mbit=200, root_link=True) as lab:
            tag = lab.tag
            assert lab_leftovers(tag)
            child = lab.exec(0, ["sleep", "60"])
            # A grandchild in its own session, no longer our child: found by `ip netns pids`.
            cp = lab.run(1, ["sh", "-c", "setsid sleep 60 >/dev/null 2>&1 & echo $!"],
                         timeout_s=10, check=True)
            orphan = int(cp.stdout.strip())
            assert alive(orphan)
            raise RuntimeError("boom")
    assert child.poll() is not None
    deadline = time.monotonic() + 5.0
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(orphan), f"pid {orphan} survived close()"
    assert lab_leftovers(tag) == []
    lab.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        lab.exec(0, ["true"])


def test_available_says_why() -> None:
    ok, reason = NetLab.available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok or reason
