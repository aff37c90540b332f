"""The peers' own virtual environments, outside the project's dependencies.

Each peer gets one venv under the cache directory (``~/.cache/flashpoint-peers`` unless
``FLASHPOINT_PEERS_CACHE`` says otherwise) with the peer, and the same torch and
transformers releases the project runs, so the small model's answers are computed by the
same kernels on every platform. A venv is reused while its recorded requirement list is
unchanged, so a rerun costs nothing; a failed install leaves no marker and is retried.

This needs the package index (PyPI); the benchmark runs it before it enters the
loopback-only network namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PEERS = ("ray", "bentoml")
PEER_PACKAGES = {"ray": ["ray[serve]"], "bentoml": ["bentoml"]}
INSTALL_TIMEOUT_S = 1800.0


def cache_dir() -> Path:
    """Where venvs and built model files live between runs."""
    env = os.environ.get("FLASHPOINT_PEERS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flashpoint-peers"


@dataclass(frozen=True)
class PeerEnv:
    """One peer's venv: its interpreter and the versions installed in it."""

    peer: str
    python: Path
    versions: dict[str, str]


def _shared_pins() -> list[str]:
    """torch and transformers at the project's releases (numpy follows them)."""
    import torch
    import transformers

    return [f"torch=={torch.__version__}", f"transformers=={transformers.__version__}"]


def _run_pip(python: Path, args: list[str], log: Path) -> int:
    with open(log, "ab") as fh:
        proc = subprocess.Popen([str(python), "-m", "pip", "install", "-q", *args],
                                stdout=fh, stderr=subprocess.STDOUT)
        try:
            return proc.wait(INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            return -9


def _versions(python: Path, peer: str) -> dict[str, str]:
    code = ("import json, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in "
            f"({peer!r}, 'torch', 'transformers', 'numpy')}}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure(peer: str, root: Path | None = None) -> PeerEnv:
    """The venv for ``peer``, created and filled on first use; raises RuntimeError naming
    the install log when pip fails."""
    root = root or cache_dir()
    venv = root / "venvs" / peer
    python = venv / "bin" / "python"
    marker = venv / "flashpoint-requirements.json"
    pins = _shared_pins()
    wanted = [*PEER_PACKAGES[peer], *pins, "numpy"]
    if marker.exists() and json.loads(marker.read_text()) == wanted and python.exists():
        return PeerEnv(peer, python, _versions(python, peer))
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"install-{peer}.log"
    log.write_text("")
    t0 = time.monotonic()
    print(f"[envs] creating {venv} ({' '.join(wanted)}); log: {log}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    rc = _run_pip(python, wanted, log)
    if rc != 0:
        # The project's exact torch build (e.g. a +cpu local version) may only exist where
        # the project was installed from; the same release from the index computes the same.
        loose = [*PEER_PACKAGES[peer], *(p.split("+")[0] for p in pins), "numpy"]
        print(f"[envs] {peer}: exact pins failed (rc={rc}); trying {' '.join(loose)}", flush=True)
        rc = _run_pip(python, loose, log)
    if rc != 0:
        raise RuntimeError(f"installing {peer} failed (rc={rc}); see {log}")
    marker.write_text(json.dumps(wanted))
    print(f"[envs] {peer} ready in {time.monotonic() - t0:.0f}s", flush=True)
    return PeerEnv(peer, python, _versions(python, peer))


if __name__ == "__main__":  # python bench/peers/envs.py [peer ...]: prepare venvs only
    for name in sys.argv[1:] or PEERS:
        print(ensure(name))
