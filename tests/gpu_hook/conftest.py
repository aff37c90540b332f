"""Builds the hook, a fake libcuda.so.1 and a launcher program once per session."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashpoint.gpu.hookbuild import build_hook

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class HookKit:
    hook: Path
    libdir: Path  # holds the fake libcuda.so.1
    launcher: Path
    linked: Path  # linked against libcuda.so.1, calls it directly, forks

    def env(self, **extra: str) -> dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(self.hook), "LD_LIBRARY_PATH": str(self.libdir),
               "FP_HOOK_LIBCUDA": str(self.libdir / "libcuda.so.1"),
               "FP_HOOK_LIBNVML": str(self.libdir / "libnvidia-ml.so.1")}
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def kit(tmp_path_factory: pytest.TempPathFactory) -> HookKit:
    if not shutil.which("gcc"):
        pytest.skip("gcc is needed to build the hook tests")
    d = tmp_path_factory.mktemp("hookkit")
    hook = build_hook(d / "cache")
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1", "-o",
                    str(d / "libcuda.so.1"), str(CSRC / "fake_cuda.c")], check=True, timeout=60)
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wl,-soname,libnvidia-ml.so.1", "-o",
                    str(d / "libnvidia-ml.so.1"), str(CSRC / "fake_nvml.c")], check=True, timeout=60)
    subprocess.run(["gcc", "-O2", "-o", str(d / "launcher"), str(CSRC / "launcher.c"), "-ldl"],
                   check=True, timeout=60)
    subprocess.run(["gcc", "-O2", "-o", str(d / "linked"), str(CSRC / "linked.c"), f"-L{d}",
                    "-l:libcuda.so.1"], check=True, timeout=60)
    return HookKit(hook, d, d / "launcher", d / "linked")
