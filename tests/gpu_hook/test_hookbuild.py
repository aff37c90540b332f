"""build_hook: cached by source hash, atomic under concurrent builds, typed error without cc."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashpoint.errors import HookBuildFailed
from flashpoint.gpu import hookbuild


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_concurrent_builds_agree_and_leave_no_temp_files(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: hookbuild.build_hook(tmp_path), range(3)))
    assert len(set(paths)) == 1 and paths[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no .build-* left behind
    mtime = paths[0].stat().st_mtime_ns
    assert hookbuild.build_hook(tmp_path) == paths[0] and paths[0].stat().st_mtime_ns == mtime  # cached
    syms = subprocess.run(["nm", "-D", "--defined-only", str(paths[0])], capture_output=True, text=True,
                          timeout=30).stdout
    for name in ("cuLaunchKernel", "cuGetProcAddress_v2", "dlsym", "cuMemAlloc_v2",
                 "nvmlDeviceGetMemoryInfo", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2_ptds", "cuMemCreate"):
        assert f" T {name}\n" in syms
    assert " T fp_" not in syms  # internals stay hidden


def test_no_compiler_is_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(HookBuildFailed) as e:
        hookbuild.build_hook(tmp_path)
    assert e.value.code == "hook_build_failed"


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_compile_error_is_a_typed_error(tmp_path, monkeypatch):
    bad = tmp_path / "src"
    bad.mkdir()
    for name in hookbuild.SOURCES:
        (bad / name).write_text("#error broken\n")
    monkeypatch.setattr(hookbuild, "HOOK_DIR", bad)
    with pytest.raises(HookBuildFailed, match="did not compile"):
        hookbuild.build_hook(tmp_path / "out")
    assert not any((tmp_path / "out").glob("*.so"))
