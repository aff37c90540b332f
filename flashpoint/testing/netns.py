"""A lab of test hosts in Linux network namespaces, joined by one bridge (root only).

Topology of one :class:`NetLab` with run tag ``T`` (``fpl`` + 5 random hex digits)::

    namespace Th0: eth0 10.A.B.1 ─veth─ Tp0 ┐
    namespace Th1: eth0 10.A.B.2 ─veth─ Tp1 ├─ br0 in namespace Tsw (the "switch")
    ...                                     │
    root namespace (optional): Tr 10.A.B.254 ─veth─ Trp ┘

* **Addresses.** Each lab takes a private /24 ``10.A.B.0/24`` with ``A`` in 200..255 and ``B``
  random, checked against every address and route of the root namespace and against every
  other live lab (state files in :data:`STATE_DIR`), so two labs never collide. Host ``i`` is
  ``10.A.B.(i+1)``; the optional root-namespace link is ``.254``.
* **Nothing outside the lab is reachable.** Hosts get no default route and the switch does no
  IP forwarding, so a lab host can only reach lab addresses. The root-namespace link adds one
  connected route for the lab's /24 and nothing else: code in the root namespace that uses it
  only ever contacts lab addresses (the subnet is chosen so it shadows nothing routed there).
* **Rate caps.** ``rate_mbit`` caps a host's egress (tbf on its ``eth0``: its uplink);
  ``ingress_rate_mbit`` caps the switch port towards the host (its downlink). Capping the
  egress of one host that serves many readers models a *shared capped uplink*. See
  :func:`tbf_params` for the burst and queue sizes and why.
* **Cutting a cable.** :meth:`NetLab.set_link` downs the switch-side port: the host's
  interface loses carrier, frames in both directions are dropped, open TCP connections see
  silence (not resets) and new connects time out.
* **Cleanup.** :meth:`NetLab.close` (also on ``with`` exit) stops every process the lab started
  by PID (SIGTERM to its own process group, bounded wait, SIGKILL), then any PID still inside
  a lab namespace (``ip netns pids``), then deletes the root link and the namespaces (their
  veths and the bridge go with them). Live labs are also closed by an ``atexit`` hook and on
  SIGTERM/SIGHUP when those still have their default handler. A lab killed with SIGKILL
  leaves a state file behind; :meth:`NetLab.sweep_stale` removes such labs whose owner
  process is dead.

Use :meth:`NetLab.available` before anything else: it says whether this process is root and
``ip netns``, bridges, veths and tbf work here, with the reason when they do not.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashpoint.procs import pid_alive

TAG_PREFIX = "fpl"
STATE_DIR = Path("/run/flashpoint-netlab")
MAX_HOSTS = 250
ROOT_HOST_OCTET = 254
HOST_IFNAME = "eth0"
BRIDGE = "br0"
IP_TIMEOUT_S = 10.0
STOP_GRACE_S = 3.0

__all__ = ["NetLab", "LabHost", "NetLabError", "tbf_params", "TAG_PREFIX"]


class NetLabError(RuntimeError):
    """A lab could not be built or torn down (test tooling; not part of the serving tree)."""


@dataclass(frozen=True)
class LabHost:
    """One lab host: ``name`` is its host id (``h0``...), ``ns`` its network namespace."""

    index: int
    name: str
    ns: str
    addr: str
    ifname: str = HOST_IFNAME


def tbf_params(rate_mbit: float) -> tuple[int, int]:
    """``(burst_bytes, latency_ms)`` of the tbf that caps a link at ``rate_mbit``.

    * burst = max(128 KiB, 2 ms at the rate). veth hands tbf GSO packets of up to 64 KiB; a
      bucket smaller than one such packet makes tbf split every packet into MTU segments
      (CPU, and on a 2-core VM it distorts the result), and the bucket must also cover one
      timer tick of traffic or the link runs below its rate. 128 KiB is ~3.5 ms at 300 Mbit/s
      and 2 ms at 500 Mbit/s, so bursts above the rate stay under ~5% of a 2 MB measurement.
    * latency (queue) = 20 ms: about 0.75 MB of queue at 300 Mbit/s, enough to keep the link
      busy through TCP's sawtooth (RTTs inside a lab are ~0.1 ms) without the second-long
      bufferbloat that would blur a cut link or a stalled relay.
    """
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    return max(128 * 1024, int(rate_bytes_per_s * 0.002)), 20


def _run_ip(argv: Sequence[str], *, check: bool = True, timeout_s: float = IP_TIMEOUT_S
            ) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command with a deadline; NetLabError with its stderr on failure."""
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                            check=False)
    except subprocess.TimeoutExpired:
        raise NetLabError(f"{' '.join(argv)}: no answer in {timeout_s} s") from None
    except OSError as e:
        raise NetLabError(f"{' '.join(argv)}: {e}") from None
    if check and cp.returncode != 0:
        raise NetLabError(f"{' '.join(argv)}: rc {cp.returncode}: {cp.stderr.strip()}")
    return cp


def _netns_names() -> set[str]:
    cp = _run_ip(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in cp.stdout.splitlines() if line.strip()}


def _pid_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (tells a reused PID apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _kill_netns_pids(ns: str, grace_s: float) -> list[int]:
    """Stop every process still inside namespace ``ns`` (all started by the lab); their PIDs."""
    cp = _run_ip(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in cp.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    left = pids
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(pid_alive(p) for p in left):
            time.sleep(0.05)
        left = [p for p in left if pid_alive(p)]
        if not left:
            break
    return pids


def _stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (to the process group when the process leads its own), bounded wait, SIGKILL."""
    if proc.poll() is not None:
        return
    own_group = False
    with contextlib.suppress(OSError):
        own_group = os.getpgid(proc.pid) == proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if own_group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


# --------------------------------------------------------------------------------------
# Process-wide registry of live labs: atexit and signal cleanup
# --------------------------------------------------------------------------------------

_LIVE: dict[str, NetLab] = {}
_LIVE_LOCK = threading.RLock()
_HOOKS_INSTALLED = False


def _close_all_live() -> None:
    with _LIVE_LOCK:
        labs = list(_LIVE.values())
    for lab in labs:
        try:
            lab.close()
        except Exception as e:  # best effort at exit: say what was left behind
            print(f"netlab {lab.tag}: cleanup failed: {e}", file=sys.stderr)


def _on_signal(signum: int, frame: Any) -> None:
    _close_all_live()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    with _LIVE_LOCK:
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
    atexit.register(_close_all_live)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            # Only where nobody else handles the signal: an application's own handler wins
            # (its shutdown path ends in close() or in atexit).
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_signal)


# --------------------------------------------------------------------------------------
# The lab
# --------------------------------------------------------------------------------------


def _per_host(value: float | None | Sequence[float | None], n: int, what: str) -> list[float | None]:
    if value is None or isinstance(value, (int, float)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what}: {len(values)} values for {n} hosts")
    return values


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    cp = _run_ip(["ip", "-4", "-o", "addr", "show"], check=False)
    for line in cp.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    cp = _run_ip(["ip", "-4", "route", "show", "table", "all"], check=False)
    for line in cp.stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            first = line.split()[1]
        if first == "default":
            continue  # the default route covers everything; lab /24s are more specific
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(first, strict=False))
    if STATE_DIR.is_dir():
        for f in STATE_DIR.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                nets.append(ipaddress.ip_network(json.loads(f.read_text())["subnet"]))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    rng = random.Random(secrets.randbits(64) ^ os.getpid())
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randint(200, 255)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetLabError("no free 10.200-255.x.0/24 subnet after 200 tries")


class NetLab:
    """``num_hosts`` hosts in network namespaces on one bridge; see the module docstring.

    ``rate_mbit`` / ``ingress_rate_mbit``: one value for every host, or one per host (None:
    uncapped). ``root_link``: also join the root namespace to the switch (``root_addr``).
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        num_hosts: int,
        *,
        rate_mbit: float | None | Sequence[float | None] = None,
        ingress_rate_mbit: float | None | Sequence[float | None] = None,
        root_link: bool = False,
    ) -> None:
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in 1..{MAX_HOSTS}")
        self._rates = _per_host(rate_mbit, num_hosts, "rate_mbit")
        self._ingress_rates = _per_host(ingress_rate_mbit, num_hosts, "ingress_rate_mbit")
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.RLock()
        existing = _netns_names()
        for _ in range(100):
            tag = TAG_PREFIX + secrets.token_hex(3)[:5]
            if not any(n.startswith(tag) for n in existing):
                break
        else:
            raise NetLabError("could not pick an unused run tag")
        self.tag = tag
        self.switch_ns = f"{tag}sw"
        self.subnet = _pick_subnet()
        base = self.subnet.network_address
        self.hosts = [
            LabHost(i, f"h{i}", f"{tag}h{i}", str(base + i + 1)) for i in range(num_hosts)
        ]
        self.root_ifname = f"{tag}r" if root_link else None
        self.root_addr = str(base + ROOT_HOST_OCTET) if root_link else None
        _install_hooks()
        with _LIVE_LOCK:
            _LIVE[tag] = self
        try:
            self._write_state()
            self._build()
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise

    # -- public API -----------------------------------------------------------------------

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """``(True, "")`` when this process can build labs, else ``(False, reason)``."""
        if not sys.platform.startswith("linux"):
            return False, f"network namespaces need Linux (this is {sys.platform})"
        if os.geteuid() != 0:
            return False, f"network namespaces need root (euid {os.geteuid()})"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"`{tool}` (iproute2) is not installed"
        probe = f"{TAG_PREFIX}pr{secrets.token_hex(3)}"
        steps = [
            ["ip", "netns", "add", probe],
            ["ip", "-n", probe, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
            ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "100mbit",
             "burst", "131072", "latency", "20ms"],
        ]
        try:
            for argv in steps:
                _run_ip(argv)
        except NetLabError as e:
            return False, f"network namespace probe failed: {e}"
        finally:
            _run_ip(["ip", "netns", "del", probe], check=False)
        return True, ""

    @classmethod
    def sweep_stale(cls) -> list[str]:
        """Remove labs whose owner process is gone (killed with SIGKILL); their tags."""
        swept: list[str] = []
        if not STATE_DIR.is_dir():
            return swept
        for f in sorted(STATE_DIR.glob(f"{TAG_PREFIX}*.json")):
            try:
                state = json.loads(f.read_text())
                pid, start = int(state["pid"]), state.get("start_ticks")
                namespaces, links = list(state["namespaces"]), list(state["root_links"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if pid_alive(pid) and _pid_start_ticks(pid) == start:
                continue
            _teardown(namespaces, links, STOP_GRACE_S)
            f.unlink(missing_ok=True)
            swept.append(f.stem)
        return swept

    def host(self, i: int) -> LabHost:
        return self.hosts[i]

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts] + [self.switch_ns]

    def exec(self, i: int, argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``'s namespace; the lab stops it on close().

        The process leads its own session (``start_new_session``) so close() can stop its
        children with it, unless the caller passes ``start_new_session=False``.
        """
        with self._lock:
            if self._closed:
                raise NetLabError(f"netlab {self.tag} is closed")
            popen_kw.setdefault("start_new_session", True)
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[i].ns, *argv], **popen_kw)
            self._procs.append(proc)
            return proc

    def run(self, i: int, argv: Sequence[str], timeout_s: float, *, check: bool = False,
            **popen_kw: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in host ``i`` to completion (text output captured); killed at timeout_s."""
        popen_kw.setdefault("stdout", subprocess.PIPE)
        popen_kw.setdefault("stderr", subprocess.PIPE)
        popen_kw.setdefault("text", True)
        proc = self.exec(i, argv, **popen_kw)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_process(proc, STOP_GRACE_S)
            proc.communicate()
            raise
        cp = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    def stop(self, proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int | None:
        """Stop one process this lab started (bounded); its exit status."""
        _stop_process(proc, grace_s)
        return proc.poll()

    def set_link(self, i: int, up: bool) -> None:
        """Cut host ``i`` off the switch (``up=False``) or plug it back in."""
        _run_ip(["ip", "-n", self.switch_ns, "link", "set", self._port(i), "up" if up else "down"])

    def close(self) -> None:
        """Stop every process, delete every namespace and link of the lab. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for proc in list(self._procs):
                try:
                    _stop_process(proc, STOP_GRACE_S)
                except Exception as e:  # keep tearing down; reported by _teardown's check
                    print(f"netlab {self.tag}: stopping pid {proc.pid}: {e}", file=sys.stderr)
            links = [self.root_ifname] if self.root_ifname else []
            problems = _teardown(self.namespaces, links, STOP_GRACE_S)
            self._closed = True
            with _LIVE_LOCK:
                _LIVE.pop(self.tag, None)
            self._state_path.unlink(missing_ok=True)
            if problems:
                raise NetLabError(f"netlab {self.tag}: left behind: {'; '.join(problems)}")

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetLab({self.tag}, {len(self.hosts)} hosts, {self.subnet})"

    # -- building -------------------------------------------------------------------------

    def _port(self, i: int) -> str:
        return f"{self.tag}p{i}"

    @property
    def _state_path(self) -> Path:
        return STATE_DIR / f"{self.tag}.json"

    def _write_state(self) -> None:
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        state = {
            "pid": os.getpid(), "start_ticks": _pid_start_ticks(os.getpid()),
            "subnet": str(self.subnet), "namespaces": self.namespaces,
            "root_links": [self.root_ifname] if self.root_ifname else [],
        }
        self._state_path.write_text(json.dumps(state))

    def _build(self) -> None:
        sw = self.switch_ns
        prefix = self.subnet.prefixlen
        _run_ip(["ip", "netns", "add", sw])
        _run_ip(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0"])
        _run_ip(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for h in self.hosts:
            _run_ip(["ip", "netns", "add", h.ns])
            # Both ends are created directly in their namespaces: nothing lands in the root one.
            _run_ip(["ip", "link", "add", h.ifname, "netns", h.ns, "type", "veth",
                     "peer", "name", self._port(h.index), "netns", sw])
            _run_ip(["ip", "-n", sw, "link", "set", self._port(h.index), "master", BRIDGE])
            _run_ip(["ip", "-n", sw, "link", "set", self._port(h.index), "up"])
            _run_ip(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/{prefix}", "dev", h.ifname])
            _run_ip(["ip", "-n", h.ns, "link", "set", "lo", "up"])
            _run_ip(["ip", "-n", h.ns, "link", "set", h.ifname, "up"])
            if (rate := self._rates[h.index]) is not None:
                self._cap(h.ns, h.ifname, rate)
            if (rate := self._ingress_rates[h.index]) is not None:
                self._cap(sw, self._port(h.index), rate)
        if self.root_ifname:
            _run_ip(["ip", "link", "add", self.root_ifname, "type", "veth",
                     "peer", "name", f"{self.root_ifname}p", "netns", sw])
            _run_ip(["ip", "-n", sw, "link", "set", f"{self.root_ifname}p", "master", BRIDGE])
            _run_ip(["ip", "-n", sw, "link", "set", f"{self.root_ifname}p", "up"])
            _run_ip(["ip", "addr", "add", f"{self.root_addr}/{prefix}", "dev", self.root_ifname])
            _run_ip(["ip", "link", "set", self.root_ifname, "up"])

    @staticmethod
    def _cap(ns: str, dev: str, rate_mbit: float) -> None:
        burst, latency_ms = tbf_params(rate_mbit)
        _run_ip(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{latency_ms}ms"])


def _teardown(namespaces: Sequence[str], root_links: Sequence[str], grace_s: float) -> list[str]:
    """Kill what runs in the namespaces, delete links and namespaces; what could not go."""
    problems: list[str] = []
    present = _netns_names()
    for ns in namespaces:
        if ns in present:
            _kill_netns_pids(ns, grace_s)
    for link in root_links:
        _run_ip(["ip", "link", "del", link], check=False)
    for ns in namespaces:
        if ns in present:
            _run_ip(["ip", "netns", "del", ns], check=False)
    left = _netns_names() & set(namespaces)
    if left:
        problems.append(f"namespaces {sorted(left)}")
    for link in root_links:
        if _run_ip(["ip", "link", "show", link], check=False).returncode == 0:
            problems.append(f"link {link}")
    return problems
