"""Small modules (STYLE §12, issue 20 item 5): no module under flashpoint/ is over 600 lines,
so a module stays one concept that a reader can hold."""

from __future__ import annotations

from pathlib import Path

import flashpoint

MAX_LINES = 600
PACKAGE_DIR = Path(flashpoint.__file__).parent


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def oversized(package_dir: Path, max_lines: int = MAX_LINES) -> dict[str, int]:
    """``{"flashpoint/...py": lines}`` of every module under ``package_dir`` over the limit."""
    root = package_dir.parent
    return {p.relative_to(root).as_posix(): n for p in sorted(package_dir.rglob("*.py"))
            if (n := _line_count(p)) > max_lines}


def test_no_module_over_the_limit():
    offenders = oversized(PACKAGE_DIR)
    report = "\n".join(f"  {p}: {n} lines" for p, n in sorted(offenders.items()))
    if report:
        print(f"modules over {MAX_LINES} lines:\n{report}")
    assert not offenders, f"modules over {MAX_LINES} lines (split them by concept):\n{report}"


def test_the_checker_finds_a_long_module(tmp_path):
    pkg = tmp_path / "flashpoint"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "short.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (pkg / "notes.txt").write_text("x\n" * (MAX_LINES + 1))
    assert oversized(pkg) == {"flashpoint/sub/long.py": MAX_LINES + 1}
