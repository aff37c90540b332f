"""Chained multicast vs point-to-point, star and registry, over capped links (root only).

One :class:`~flashpoint.testing.netns.NetLab`: host 0 is the sender, hosts 1..N the
receivers, the last host the registry; every host's uplink *and* downlink is capped at
``--rate-mbit`` (tbf on both ends of its veth), so a host serving several readers shares
one capped uplink. Each receiver runs ``python -m flashpoint.transfer.node serve`` with a
fresh directory per experiment (a tmpfs under ``--work-dir``). Experiments:

* ``p2p``: one ``node send`` to one receiver (a chain of length 1) — the reference.
* ``chain``: one ``node send --chain r1,...,rN`` — the TCP-chained multicast.
* ``star``: N concurrent ``node send`` processes on the sender, one receiver each (a sender
  unicasting to N peers over its one uplink): ≈ N × p2p expected.
* ``registry``: every receiver reads the whole blob concurrently from the registry host,
  behind the same capped uplink. Default ``--registry node``: ``node get`` from a node that
  holds the blob (``node-get``). ``--registry s3``: ``S3Store`` ranged GETs (4 in flight per
  receiver, chunks verified) against ``python -m moto.server`` in the registry namespace
  (``s3-moto``). Not the default because moto, not the link, is then the bottleneck: its
  ranged GET reads the *whole* object out of its spooled temp file and slices it
  (``moto/s3/responses.py`` ``_handle_range_header`` on ``FakeKey.value``), so every 4 MiB GET
  of a 512 MiB blob costs a 512 MiB read: measured 126 s for N=2 (8.8× ideal) where a 64 MiB
  blob gives 2.2× ideal. The output says which one ran.

Times are transfer times as the processes report them (process start-up excluded): a
group's time runs from the earliest transfer start to the last completion. Ratios: ÷ p2p
and ÷ ideal (blob size / link rate; TCP/IP/Ethernet headers alone make ~1.05 the floor).
Every receiver's file is checked byte for byte (sha256 of the whole file vs the source).
CPU per process and for the whole machine (user, system, softirq — where veth and tbf run)
is sampled from /proc for every experiment and printed for the chains.

The synthetic blob is deterministic (seeded random bytes in a real Flashpoint blob with a
manifest of real chunk hashes); it is written once into ``--cache-dir`` and reused.

    sudo .venv/bin/python bench/multicast.py [--size-mb 512 --rate-mbit 300 --receivers 2,4,8]

Only lab addresses (private namespaces made by this script) are ever contacted. The last
line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import mmap
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flashpoint.testing.netns import NetLab  # noqa: E402

NAME, VERSION = "bench-multicast", "1"
SECRET_ENV = "FP_BENCH_SECRET"
S3_PORT, BUCKET = 5000, "fp-bench"
MiB = 1 << 20
START_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------------------
# The blob
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Blob:
    path: Path
    manifest_path: Path
    size_bytes: int
    sha256: str
    num_chunks: int


def ensure_blob(cache_dir: Path, size_mb: int, chunk_mb: int) -> Blob:
    """A deterministic ``size_mb`` MiB Flashpoint blob + manifest, built once and reused."""
    d = cache_dir / f"multicast-{size_mb}m-{chunk_mb}m"
    meta_path = d / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        blob = Blob(Path(meta["path"]), Path(meta["manifest_path"]), meta["size_bytes"],
                    meta["sha256"], meta["num_chunks"])
        if blob.path.exists() and blob.path.stat().st_size == blob.size_bytes:
            return blob
    import numpy as np
    import torch

    from flashpoint.registry.format import build_blob
    from flashpoint.registry.manifest import IoSignature, make_manifest

    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(20240503)
    layer_bytes = 64 * MiB
    layers = []
    left = size_mb * MiB
    for i in range(-(-left // layer_bytes)):
        n = min(layer_bytes, left - i * layer_bytes)
        data = np.frombuffer(rng.bytes(n), dtype=np.uint8)
        layers.append((f"layer{i}", [(f"layer{i}.weight", torch.from_numpy(data.copy()))]))
    path = d / "blob"
    _, layout = build_blob(layers, chunk_size=chunk_mb * MiB, path=path)
    manifest = make_manifest(name=NAME, version=VERSION, layout=layout,
                             entry_point="flashpoint.models.noop:build_empty", config={},
                             io=IoSignature((), ()))
    manifest_path = d / "manifest.json"
    manifest_path.write_text(manifest.to_json())
    blob = Blob(path, manifest_path, manifest.blob_size, sha256_file(path), manifest.num_chunks)
    meta_path.write_text(json.dumps({
        "path": str(blob.path), "manifest_path": str(blob.manifest_path),
        "size_bytes": blob.size_bytes, "sha256": blob.sha256, "num_chunks": blob.num_chunks}))
    print(f"built blob {blob.size_bytes / MiB:.0f} MiB, {blob.num_chunks} chunks in "
          f"{time.perf_counter() - t0:.1f}s: {path}", flush=True)
    return blob


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            mv = memoryview(m)
            for off in range(0, size, 64 * MiB):
                h.update(mv[off:off + 64 * MiB])
            mv.release()
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Lab processes with timestamped output
# --------------------------------------------------------------------------------------


class LabProc:
    """A process in a lab host; stdout lines are stamped with time.monotonic() on arrival."""

    def __init__(self, lab: NetLab, host: int, argv: Sequence[str], role: str,
                 env: dict[str, str]) -> None:
        self.role = role
        self.t_start = time.monotonic()
        self.proc = lab.exec(host, list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self.stderr_tail: list[str] = []
        self.t_exit: float | None = None
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._read_out, name=f"{role}-out", daemon=True),
            threading.Thread(target=self._read_err, name=f"{role}-err", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        self.proc.wait()
        with self._cond:
            self.t_exit = time.monotonic()
            self._cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail = (self.stderr_tail + [line.rstrip("\n")])[-20:]

    def wait_json(self, pred: Callable[[dict], bool], timeout_s: float) -> tuple[float, dict]:
        """The first stdout JSON object satisfying ``pred`` and when it arrived."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for t, line in self.lines[seen:]:
                    obj = _json_or_none(line)
                    if obj is not None and pred(obj):
                        return t, obj
                seen = len(self.lines)
                if self.t_exit is not None:
                    raise RuntimeError(f"{self.role} exited {self.proc.returncode} without the "
                                       f"expected line; stderr: {self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.role}: no expected line in {timeout_s:.0f}s; "
                                       f"stderr: {self.tail()}")
                self._cond.wait(min(left, 1.0))

    def wait_exit(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.t_exit is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.role} still running after {timeout_s:.0f}s; "
                                       f"stderr: {self.tail()}")
                self._cond.wait(min(left, 1.0))
        return self.proc.returncode

    def last_json(self) -> tuple[float, dict] | None:
        with self._cond:
            for t, line in reversed(self.lines):
                obj = _json_or_none(line)
                if obj is not None:
                    return t, obj
        return None

    def tail(self) -> str:
        return " | ".join(self.stderr_tail[-5:])


def _json_or_none(line: str) -> dict | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


# --------------------------------------------------------------------------------------
# CPU sampling from /proc
# --------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def _threads_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """``{tid: (thread name, user s, system s)}`` of one process."""
    out = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            stat = (t / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(t.name)] = (comm, int(fields[11]) / _TICKS, int(fields[12]) / _TICKS)
    return out


def _all_procs_cpu() -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(p.name)] = (comm, (int(fields[11]) + int(fields[12])) / _TICKS)
    return out


def _cmdline(pid: int, comm: str) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    words = [Path(a.decode(errors="replace")).name if i == 0 else a.decode(errors="replace")
             for i, a in enumerate(args[:4]) if a]
    return " ".join(words)[:60] or comm


def _machine_cpu() -> dict[str, float]:
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return {"user": (user + nice) / _TICKS, "system": system / _TICKS,
            "softirq": (irq + softirq) / _TICKS, "idle": (idle + iowait) / _TICKS,
            "steal": steal / _TICKS}


@dataclass
class CpuSampler:
    """CPU seconds per tracked process (sampled, so exits are caught) and for the machine."""

    roles: dict[int, str]
    interval_s: float = 0.5
    _last: dict[int, float] = field(default_factory=dict)
    _first: dict[int, float] = field(default_factory=dict)
    _threads_first: dict[tuple[int, int], tuple[str, float, float]] = field(default_factory=dict)
    _threads_last: dict[tuple[int, int], tuple[str, float, float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._m0, self._t0 = _machine_cpu(), time.monotonic()
        self._all0 = _all_procs_cpu()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()

    def track(self, pid: int, role: str) -> None:
        self.roles[pid] = role
        self._sample()

    def _sample(self) -> None:
        for pid in list(self.roles):
            v = _proc_cpu_s(pid)
            if v is not None:
                self._first.setdefault(pid, v)
                self._last[pid] = v
            for tid, (comm, user_s, sys_s) in _threads_cpu(pid).items():
                self._threads_first.setdefault((pid, tid), (comm, user_s, sys_s))
                self._threads_last[(pid, tid)] = (comm, user_s, sys_s)

    def _thread_profile(self, elapsed: float) -> dict[str, dict[str, float]]:
        """Per role kind (node, send, ...): mean user/system % of a core per thread name."""
        acc: dict[str, dict[str, list[float]]] = {}
        kinds: dict[str, set[int]] = {}
        for (pid, _tid), (comm, u1, s1) in self._threads_last.items():
            _, u0, s0 = self._threads_first[(pid, _tid)]
            kind = self.roles[pid].split("-")[0]
            kinds.setdefault(kind, set()).add(pid)
            slot = acc.setdefault(kind, {}).setdefault(comm, [0.0, 0.0])
            slot[0] += u1 - u0
            slot[1] += s1 - s0
        out = {}
        for kind, comms in acc.items():
            n = len(kinds[kind])
            out[kind] = {f"{c} usr/sys": [round(100 * u / n / elapsed, 1), round(100 * s / n / elapsed, 1)]
                         for c, (u, s) in sorted(comms.items(), key=lambda kv: -sum(kv[1]))
                         if u + s > 0.005 * elapsed * n}
        return out

    def _loop(self) -> None:
        for _ in range(100_000):
            if self._stop.wait(self.interval_s):
                return
            self._sample()

    def stop(self) -> dict[str, Any]:
        self._sample()
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5.0)
        elapsed = max(time.monotonic() - self._t0, 1e-6)
        m1 = _machine_cpu()
        dm = {k: m1[k] - self._m0[k] for k in m1}
        total = sum(dm.values()) or 1e-6
        ncpu = os.cpu_count() or 1
        procs = {self.roles[p]: round(100 * (self._last[p] - self._first[p]) / elapsed, 1)
                 for p in self._last}
        # Everything else that burned CPU meanwhile (other users of this VM included).
        all1 = _all_procs_cpu()
        ours = set(self.roles)
        others = sorted(
            ((all1[p][1] - self._all0.get(p, (None, 0.0))[1], all1[p][0], p)
             for p in all1 if p not in ours and p != os.getpid()),
            reverse=True)[:4]
        return {
            "elapsed_s": round(elapsed, 2),
            "machine_busy_cores": round(ncpu * (1 - dm["idle"] / total), 2),
            "user_pct": round(100 * dm["user"] / total, 1),
            "system_pct": round(100 * dm["system"] / total, 1),
            "softirq_pct": round(100 * dm["softirq"] / total, 1),
            "steal_pct": round(100 * dm["steal"] / total, 1),
            "procs_pct_of_core": procs,
            "threads_pct_of_core_per_proc": self._thread_profile(elapsed),
            "bench_pct_of_core": round(100 * ((_proc_cpu_s(os.getpid()) or 0.0)
                                              - self._bench0) / elapsed, 1),
            "others_pct_of_core": {f"{_cmdline(pid, comm)}[{pid}]": round(100 * d / elapsed, 1)
                                   for d, comm, pid in others if d > 0.02 * elapsed},
        }

    def __post_init__(self) -> None:
        self._bench0 = _proc_cpu_s(os.getpid()) or 0.0


# --------------------------------------------------------------------------------------
# The experiments
# --------------------------------------------------------------------------------------


@dataclass
class Ctx:
    lab: NetLab
    blob: Blob
    work: Path
    env: dict[str, str]
    ideal_s: float
    registry_host: int
    registry_mode: str = "node-get"
    timeout_factor: float = 3.0
    registry_node: LabProc | None = None
    registry_port: int = 0

    def endpoint(self, i: int, port: int) -> str:
        return f"h{i}:{self.lab.host(i).addr}:{port}"


def node_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "flashpoint.transfer.node", *args]


def start_nodes(ctx: Ctx, hosts: Sequence[int], exp_dir: Path, *, mkdir: bool = True
                ) -> dict[int, tuple[LabProc, int]]:
    nodes: dict[int, tuple[LabProc, int]] = {}
    procs = {}
    for i in hosts:
        d = exp_dir / f"h{i}"
        d.mkdir(parents=True, exist_ok=not mkdir)
        procs[i] = LabProc(ctx.lab, i, node_argv(
            "serve", "--listen", ctx.lab.host(i).addr, "--port", "0", "--dir", str(d),
            "--host-id", f"h{i}",
            "--secret-env", SECRET_ENV), f"node-h{i}", ctx.env)
    for i, p in procs.items():
        _, obj = p.wait_json(lambda o: o.get("event") == "listening", START_TIMEOUT_S)
        nodes[i] = (p, int(obj["port"]))
    return nodes


def stop_all(ctx: Ctx, procs: Sequence[LabProc]) -> None:
    for p in procs:
        ctx.lab.stop(p.proc)


def group_seconds(results: Sequence[tuple[float, dict, LabProc]]) -> float:
    """Earliest transfer start to last completion, from each process's own ``seconds``."""
    starts, ends = [], []
    for t_line, obj, proc in results:
        secs = obj.get("seconds")
        if isinstance(secs, (int, float)):
            starts.append(t_line - secs)
        else:  # no self-reported time: fall back on the process's wall time
            starts.append(proc.t_start)
        ends.append(t_line)
    return max(ends) - min(starts)


def run_group(ctx: Ctx, make: Callable[[], list[LabProc]], parallel: int,
              sampler_roles: dict[int, str]) -> tuple[float, list, dict]:
    """Start the client processes, wait (bounded) for each one's result line and exit."""
    timeout_s = ctx.timeout_factor * ctx.ideal_s * parallel + 60
    sampler = CpuSampler(dict(sampler_roles))
    sampler.start()
    clients = make()
    for c in clients:
        sampler.track(c.pid, c.role)
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for c in clients:
            rc = c.wait_exit(max(1.0, deadline - time.monotonic()))
            last = c.last_json()
            if rc != 0 or last is None:
                raise RuntimeError(f"{c.role} exited {rc}; stdout: {c.lines[-3:]}; "
                                   f"stderr: {c.tail()}")
            results.append((last[0], last[1], c))
    finally:
        cpu = sampler.stop()
        stop_all(ctx, clients)
    return group_seconds(results), [r[1] for r in results], cpu


def experiment(ctx: Ctx, mode: str, n: int) -> dict[str, Any]:
    receivers = list(range(1, n + 1))
    exp_dir = ctx.work / f"{mode}-{n}"
    exp_dir.mkdir(parents=True)
    nodes: dict[int, tuple[LabProc, int]] = {}
    out_paths: dict[int, Path] = {}
    row: dict[str, Any] = {"mode": mode, "n": n}
    try:
        if mode in ("p2p", "chain", "star"):
            nodes = start_nodes(ctx, receivers, exp_dir)
            roles = {p.pid: p.role for p, _ in nodes.values()}
            groups = [receivers] if mode != "star" else [[r] for r in receivers]

            def make() -> list[LabProc]:
                return [LabProc(ctx.lab, 0, node_argv(
                    "send", "--blob", str(ctx.blob.path), "--manifest", str(ctx.blob.manifest_path),
                    "--chain", ",".join(ctx.endpoint(r, nodes[r][1]) for r in g),
                    "--secret-env", SECRET_ENV), f"send-{'-'.join(f'h{r}' for r in g)}", ctx.env)
                    for g in groups]

            seconds, outs, cpu = run_group(ctx, make, parallel=len(groups), sampler_roles=roles)
            completed = sorted({h for o in outs for h in o.get("completed", [])})
            failed = sorted({h for o in outs for h in o.get("failed", [])})
            row.update(node_completed=completed, node_failed=failed)
            out_paths = {r: exp_dir / f"h{r}" / f"{NAME}@{VERSION}" for r in receivers}
        else:
            for r in receivers:
                (exp_dir / f"h{r}").mkdir()
                out_paths[r] = exp_dir / f"h{r}" / "blob"
            reg = ctx.registry_host
            roles = {ctx.registry_node.pid: ctx.registry_node.role} if ctx.registry_node else {}

            def make() -> list[LabProc]:
                if ctx.registry_mode == "s3-moto":
                    url = f"http://{ctx.lab.host(reg).addr}:{S3_PORT}"
                    return [LabProc(ctx.lab, r, [sys.executable, __file__, "_s3pull", url,
                                                 str(out_paths[r])], f"s3pull-h{r}", ctx.env)
                            for r in receivers]
                assert ctx.registry_node is not None
                src = ctx.endpoint(reg, ctx.registry_port)
                return [LabProc(ctx.lab, r, node_argv(
                    "get", "--from", src, "--manifest", str(ctx.blob.manifest_path),
                    "--out", str(out_paths[r]), "--secret-env", SECRET_ENV), f"get-h{r}", ctx.env)
                    for r in receivers]

            seconds, outs, cpu = run_group(ctx, make, parallel=n, sampler_roles=roles)
        verified = verify(ctx, out_paths)
        row.update(seconds=round(seconds, 3), verified=verified,
                   verified_ok=all(v == "ok" for v in verified.values()), cpu=cpu)
    except Exception as e:  # one failed experiment must not stop the others
        row.update(error=f"{type(e).__name__}: {e}"[:2000])
    finally:
        stop_all(ctx, [p for p, _ in nodes.values()])
        shutil.rmtree(exp_dir, ignore_errors=True)
    return row


def verify(ctx: Ctx, paths: dict[int, Path]) -> dict[str, str]:
    out = {}
    for r, p in paths.items():
        if not p.exists():
            out[f"h{r}"] = "missing"
        elif p.stat().st_size != ctx.blob.size_bytes:
            out[f"h{r}"] = f"size {p.stat().st_size}"
        else:
            out[f"h{r}"] = "ok" if sha256_file(p) == ctx.blob.sha256 else "sha256 mismatch"
    return out


# --------------------------------------------------------------------------------------
# Registry host: moto S3 or a node
# --------------------------------------------------------------------------------------


def s3_available() -> tuple[bool, str]:
    if not (REPO / "flashpoint" / "registry" / "s3.py").exists():
        return False, "flashpoint/registry/s3.py missing"
    try:
        import moto.server  # noqa: F401

        from flashpoint.registry.s3 import S3Store  # noqa: F401
    except Exception as e:
        return False, f"import failed: {e}"
    return True, ""


def setup_registry(ctx: Ctx, kind: str) -> str:
    """Start the registry service on the registry host with the blob in it; what it is."""
    reg = ctx.registry_host
    addr = ctx.lab.host(reg).addr
    if kind == "s3":
        ok, why = s3_available()
        if not ok:
            raise SystemExit(f"--registry s3: {why}")
        moto = LabProc(ctx.lab, reg, [sys.executable, "-m", "moto.server", "-H", addr,
                                      "-p", str(S3_PORT)], "moto", ctx.env)
        ctx.registry_node, ctx.registry_mode = moto, "s3-moto"
        cp = ctx.lab.run(reg, [sys.executable, __file__, "_s3put", f"http://{addr}:{S3_PORT}",
                               str(ctx.blob.manifest_path), str(ctx.blob.path)],
                         timeout_s=300, env=ctx.env)
        if cp.returncode != 0:
            raise RuntimeError(f"upload to moto failed: {cp.stderr.strip()[-500:]}")
        return f"s3-moto: S3Store ranged GETs from moto.server ({cp.stdout.strip()})"
    # A node that holds the blob as a complete segment (load_existing picks it up).
    d = ctx.work / "registry" / f"h{reg}"
    d.mkdir(parents=True)
    shutil.copyfile(ctx.blob.path, d / f"{NAME}@{VERSION}")
    shutil.copyfile(ctx.blob.manifest_path, d / f"{NAME}@{VERSION}.json")
    node, port = start_nodes(ctx, [reg], ctx.work / "registry", mkdir=False)[reg]
    ctx.registry_node, ctx.registry_port, ctx.registry_mode = node, port, "node-get"
    return "node-get: `node get` (4 concurrent chunk reads) from a node holding the blob"


def _s3_env() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def s3put_main(url: str, manifest_path: str, blob_path: str) -> None:
    """(inside the registry namespace) create the bucket and publish the blob."""
    _s3_env()
    import boto3

    from flashpoint.registry.manifest import Manifest
    from flashpoint.registry.s3 import S3Store

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
    manifest = Manifest.from_json(Path(manifest_path).read_text())

    async def put() -> None:
        async with S3Store(BUCKET, endpoint_url=url) as store:
            await store.put(manifest, blob_path)

    t0 = time.monotonic()
    asyncio.run(put())
    print(f"uploaded in {time.monotonic() - t0:.1f}s")


def s3pull_main(url: str, out: str, concurrency: int = 4) -> None:
    """(inside a receiver namespace) read the whole blob with verified ranged GETs."""
    _s3_env()
    from flashpoint.registry.s3 import S3Store

    async def pull() -> dict[str, Any]:
        async with S3Store(BUCKET, endpoint_url=url, max_concurrency=concurrency) as store:
            t0 = time.monotonic()
            manifest = await store.get_manifest(NAME, VERSION)
            with open(out, "w+b") as f:
                f.truncate(manifest.blob_size)
                with mmap.mmap(f.fileno(), manifest.blob_size) as m:
                    sem = asyncio.Semaphore(concurrency)

                    async def one(i: int) -> None:
                        async with sem:
                            data = await store.read_chunk(NAME, VERSION, i)  # verified
                        start, end = manifest.chunk_range(i)
                        m[start:end] = data

                    await asyncio.gather(*(one(i) for i in range(manifest.num_chunks)))
            return {"seconds": time.monotonic() - t0, "bytes": manifest.blob_size}

    print(json.dumps(asyncio.run(pull())), flush=True)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def wait_for_node_cli(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (REPO / "flashpoint" / "transfer" / "node.py").exists():
        if time.monotonic() > deadline:
            raise SystemExit("flashpoint/transfer/node.py does not exist")
        time.sleep(min(30.0, max(0.0, deadline - time.monotonic())))


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'mode':<9} {'N':>2} {'seconds':>8} {'÷p2p':>6} {'÷ideal':>7} {'÷p2p/N':>7} "
            f"{'verified':>9} {'busy cores':>10} {'softirq%':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<9} {r['n']:>2} ERROR {r['error'][:150]}")
            continue
        ok = sum(v == "ok" for v in r["verified"].values())
        ver = f"{ok}/{len(r['verified'])}"
        rp = r.get("ratio_p2p")
        rp_s, rpn_s = (f"{rp:>6.2f}", f"{rp / r['n']:>7.2f}") if rp else (f"{'-':>6}", f"{'-':>7}")
        lines.append(
            f"{r['mode']:<9} {r['n']:>2} {r['seconds']:>8.2f} {rp_s} "
            f"{r['ratio_ideal']:>7.2f} {rpn_s} "
            f"{ver:>9} {r['cpu']['machine_busy_cores']:>10.2f} "
            f"{r['cpu']['softirq_pct']:>8.1f}")
    return "\n".join(lines)


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_s3put":
        return s3put_main(*sys.argv[2:5])
    if len(sys.argv) > 1 and sys.argv[1] == "_s3pull":
        return s3pull_main(*sys.argv[2:4])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512, help="blob size in MiB")
    ap.add_argument("--rate-mbit", type=float, default=300.0, help="every host link's cap")
    ap.add_argument("--receivers", default="2,4,8", help="receiver counts N")
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--modes", default="p2p,chain,star,registry",
                    help="p2p runs once (N=1); the others for every N")
    ap.add_argument("--registry", choices=["node", "s3"], default="node",
                    help="node: `node get` from a node on the registry host; s3: S3Store "
                         "ranged GETs from moto.server (CPU-bound at 512 MiB, see the docstring)")
    ap.add_argument("--cache-dir", default="/dev/shm/flashpoint-bench",
                    help="where the synthetic blob is built once and kept")
    ap.add_argument("--work-dir", default="/dev/shm", help="tmpfs for the receivers' copies")
    ap.add_argument("--timeout-factor", type=float, default=3.0,
                    help="per-transfer timeout = factor × expected + 60 s")
    ap.add_argument("--wait-node-s", type=float, default=0.0,
                    help="wait this long for flashpoint/transfer/node.py to appear")
    args = ap.parse_args()
    ns = sorted({int(x) for x in args.receivers.split(",") if x.strip()})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ok, why = NetLab.available()
    if not ok:
        raise SystemExit(f"multicast bench needs network namespaces: {why}")
    signal.signal(signal.SIGTERM, _sigterm)  # unwind through every finally: lab, work dir
    if set(modes) - {"registry"} or args.registry == "node":
        wait_for_node_cli(args.wait_node_s)
    NetLab.sweep_stale()
    blob = ensure_blob(Path(args.cache_dir), args.size_mb, args.chunk_mb)
    ideal_s = blob.size_bytes / (args.rate_mbit * 1e6 / 8)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO),
               **{SECRET_ENV: secrets.token_hex(32)})
    n_max = max(ns)
    rows: list[dict[str, Any]] = []
    with NetLab(n_max + 2, rate_mbit=args.rate_mbit, ingress_rate_mbit=args.rate_mbit) as lab:
        work = Path(args.work_dir) / f"fp-multicast-{lab.tag}"
        ctx = Ctx(lab=lab, blob=blob, work=work, env=env, ideal_s=ideal_s,
                  registry_host=n_max + 1, timeout_factor=args.timeout_factor)
        try:
            work.mkdir(parents=True)
            print(f"lab {lab.tag} {lab.subnet}: sender h0, receivers h1..h{n_max}, registry "
                  f"h{n_max + 1}; every link {args.rate_mbit:g} Mbit/s each way; blob "
                  f"{blob.size_bytes / MiB:.1f} MiB; ideal {ideal_s:.2f}s", flush=True)
            registry_desc = None
            if "registry" in modes:
                registry_desc = setup_registry(ctx, args.registry)
                print(f"registry: {registry_desc}", flush=True)
            plan = [("p2p", 1)] if "p2p" in modes else []
            plan += [(m, n) for n in ns for m in modes if m != "p2p"]
            for mode, n in plan:
                row = experiment(ctx, mode, n)
                if mode == "registry":
                    row["registry_mode"] = ctx.registry_mode
                rows.append(row)
                print(f"  {mode} N={n}: " + (f"{row['seconds']:.2f}s verified "
                      f"{sum(v == 'ok' for v in row['verified'].values())}/{n}"
                      if "error" not in row else row["error"][:300]), flush=True)
        finally:
            if ctx.registry_node is not None:
                lab.stop(ctx.registry_node.proc)
            shutil.rmtree(work, ignore_errors=True)
    p2p = next((r["seconds"] for r in rows if r["mode"] == "p2p" and "seconds" in r), None)
    for r in rows:
        if "seconds" in r:
            r["ratio_p2p"] = round(r["seconds"] / p2p, 3) if p2p else None
            r["ratio_ideal"] = round(r["seconds"] / ideal_s, 3)
    print()
    print(table(rows))
    print()
    for r in rows:
        if r["mode"] in ("chain", "p2p") and "cpu" in r:
            print(f"cpu {r['mode']} N={r['n']}: {json.dumps(r['cpu'])}")
    chain_max = next((r for r in rows if r["mode"] == "chain" and r["n"] == n_max
                      and "ratio_p2p" in r), None)
    summary = {
        "bench": "multicast",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "kernel": platform.release()},
        "size_bytes": blob.size_bytes, "chunk_bytes": args.chunk_mb * MiB,
        "rate_mbit": args.rate_mbit, "ideal_s": round(ideal_s, 3),
        "registry_mode": ctx.registry_mode if "registry" in modes else None,
        "p2p_s": p2p,
        "targets": {
            f"chain_n{n_max}_le_1.10x_p2p": (chain_max["ratio_p2p"] <= 1.10)
            if chain_max and chain_max["ratio_p2p"] else None,
            "star_ratio_over_n": {r["n"]: round(r["ratio_p2p"] / r["n"], 3)
                                  for r in rows if r["mode"] == "star" and r.get("ratio_p2p")},
        },
        "results": rows,
    }
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()
