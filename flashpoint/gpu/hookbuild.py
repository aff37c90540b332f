"""Build the native CUDA hook (``flashpoint/gpu/hook/``) with the system C compiler.

The shared object is cached per user under ``$XDG_CACHE_HOME/flashpoint/hook`` (or
``~/.cache/...``), keyed by a hash of the sources and the compiler command, so a changed
source rebuilds and an unchanged one is reused.  The build writes to a private temporary
file and renames it into place: rename is atomic, so two processes building at once both
end with a complete library and neither ever loads a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from flashpoint.errors import HookBuildFailed

HOOK_DIR = Path(__file__).parent / "hook"
SOURCES = ("fp_hook.c", "fp_sync.c", "fp_mem.c", "fp_hook_internal.h", "fp_protocol.h", "hooked_symbols.h")
C_FILES = ("fp_hook.c", "fp_sync.c", "fp_mem.c")
CFLAGS = ("-O2", "-Wall", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Bsymbolic")
LIBS = ("-ldl", "-lpthread")
BUILD_TIMEOUT_S = 120.0


def find_compiler() -> str:
    """The C compiler to use: ``$CC``, else ``cc``/``gcc``/``clang`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise HookBuildFailed("no C compiler found (set CC or install gcc) to build the GPU hook")


def cache_dir() -> Path:
    """Per-user cache directory for built hooks."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashpoint" / "hook"


def source_hash(compiler: str) -> str:
    """Hash of every source byte and the exact compile command (changes force a rebuild)."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (HOOK_DIR / name).read_bytes() + b"\0")
    h.update(" ".join((compiler, *CFLAGS, *LIBS)).encode())
    return h.hexdigest()[:16]


def build_hook(out_dir: Path | None = None) -> Path:
    """Return the path of the built ``libfphook-<hash>.so``, compiling it if needed.

    Raises :class:`HookBuildFailed` without a compiler or when compilation fails.
    """
    compiler = find_compiler()
    target_dir = out_dir or cache_dir()
    target = target_dir / f"libfphook-{source_hash(compiler)}.so"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target_dir)
    os.close(fd)
    try:
        sources = [str(HOOK_DIR / c) for c in C_FILES]
        cmd = [compiler, *CFLAGS, "-I", str(HOOK_DIR), "-o", tmp, *sources, *LIBS]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise HookBuildFailed(f"running {compiler} failed: {e}") from e
        if proc.returncode != 0:
            raise HookBuildFailed(f"hook did not compile: {proc.stderr[-2000:]}", command=" ".join(cmd))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file may win
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
