"""A tiny TCP peer run inside lab namespaces by test_netlab.py (not collected by pytest).

    peer.py echo ADDR PORT         accept connections forever, echo each one back
    peer.py sink ADDR PORT         accept one connection, read to EOF, print bytes and seconds
    peer.py send ADDR PORT NBYTES  connect, send NBYTES, close
    peer.py connect ADDR PORT TIMEOUT_S [TRIES]  try to connect (and echo 'hi'), print the outcome

Servers print one line ``ready`` once listening. Every wait has a deadline.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def _listen(addr: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(16)
    s.settimeout(60.0)
    print("ready", flush=True)
    return s


def echo(addr: str, port: int) -> None:
    srv = _listen(addr, port)
    for _ in range(1000):
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10.0)
            while data := conn.recv(65536):
                conn.sendall(data)


def sink(addr: str, port: int) -> None:
    srv = _listen(addr, port)
    conn, _ = srv.accept()
    conn.settimeout(30.0)
    t0 = time.monotonic()
    n = 0
    while data := conn.recv(1 << 20):
        n += len(data)
    print(json.dumps({"bytes": n, "seconds": time.monotonic() - t0}), flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    with socket.create_connection((addr, port), timeout=10.0) as s:
        s.settimeout(30.0)
        block = b"\xa5" * (1 << 16)
        left = nbytes
        while left > 0:
            s.sendall(block[:left])
            left -= min(left, len(block))


def connect(addr: str, port: int, timeout_s: float, tries: int) -> None:
    t0 = time.monotonic()
    err = ""
    for attempt in range(1, tries + 1):
        try:
            with socket.create_connection((addr, port), timeout=timeout_s) as s:
                s.settimeout(timeout_s)
                s.sendall(b"hi")
                s.shutdown(socket.SHUT_WR)
                reply = s.recv(16)
            print(json.dumps({"ok": reply == b"hi", "attempts": attempt,
                              "seconds": time.monotonic() - t0}), flush=True)
            return
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
    print(json.dumps({"ok": False, "error": err, "attempts": tries,
                      "seconds": time.monotonic() - t0}), flush=True)


if __name__ == "__main__":
    mode, a, p, *rest = sys.argv[1:]
    if mode == "echo":
        echo(a, int(p))
    elif mode == "sink":
        sink(a, int(p))
    elif mode == "send":
        send(a, int(p), int(rest[0]))
    elif mode == "connect":
        connect(a, int(p), float(rest[0]), int(rest[1]) if len(rest) > 1 else 1)
    else:
        raise SystemExit(f"unknown mode {mode}")
