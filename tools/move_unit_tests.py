"""Move tests/unit/* into the tests/ folder of the package each file tests (issue 20, item 4).

    python tools/move_unit_tests.py [--dry-run]

Re-runnable: it moves (``git mv``, keeping history) only the files of :data:`MAPPING` that
still exist in tests/unit, creates a destination folder's ``__init__.py`` when it lacks one,
refuses to overwrite a file already at the destination, and then rewrites what pointed at the
old places:

* ``from .mod import`` in a file whose ``mod`` now lives in another folder becomes
  ``from <folder>.mod import`` (tests/ has no ``__init__.py``: pytest puts tests/ on sys.path,
  so each folder is a top-level package there);
* ``from unit.mod import`` anywhere under tests/ becomes ``from <folder>.mod import``;
* the text ``tests/unit/<file>`` in .py, .md and .toml files becomes the new path.

It prints every file left in tests/unit that the mapping does not name (add a line to
:data:`MAPPING` and run it again), and removes tests/unit once only ``__init__.py`` is left.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "tests" / "unit"

# file in tests/unit -> folder under tests/ (the package it tests; "core" holds the tests of
# flashpoint's top-level modules: config, errors, ids, spec, tensors, client, progress, heap,
# actor, and the import rule over the whole package).
MAPPING: dict[str, str] = {
    # flashpoint/*.py (top level) and the package-wide import rule
    "test_actor.py": "core",
    "test_client.py": "core",
    "test_config.py": "core",
    "test_errors.py": "core",
    "test_heap.py": "core",
    "test_ids.py": "core",
    "test_import_rule.py": "core",
    "test_progress.py": "core",
    "test_spec.py": "core",
    "test_tensors.py": "core",
    # flashpoint/controller/
    "test_cold_timings.py": "controller",
    "test_controller_groups.py": "controller",
    "test_controller_metrics.py": "controller",
    "test_controller_state.py": "controller",
    "test_dispatch.py": "controller",
    "test_dispatch_claim.py": "controller",
    "test_migration_plan.py": "controller",
    "test_migrator.py": "controller",
    "test_governor_state.py": "controller",
    "test_kaas_placement.py": "controller",
    "test_mig_reconfig.py": "controller",
    "test_rollout.py": "controller",
    "test_share_from_profile.py": "controller",
    "test_share_placement.py": "controller",
    "test_start_backoff.py": "controller",
    "test_token_load.py": "controller",
    "test_ui_journal.py": "controller",
    # flashpoint/host/
    "test_host_mig.py": "host",
    "test_host_state.py": "host",
    "test_stage_hold.py": "host",
    # flashpoint/worker/
    "test_batcher.py": "worker",
    "test_replica_stats.py": "worker",
    "test_worker_infer_many.py": "worker",
    "test_worker_state.py": "worker",
    # flashpoint/gpu/ (with its fakes and helper process)
    "fake_mps.py": "gpu",
    "fake_mps_control.py": "gpu",
    "test_gpu_bench_script.py": "gpu",
    "test_gpu_mig.py": "gpu",
    "test_gpu_mps.py": "gpu",
    "test_gpu_nvml.py": "gpu",
    "test_host_sharing.py": "gpu",
    "test_weight_share.py": "gpu",
    "weight_share_proc.py": "gpu",
    # flashpoint/policy/
    "test_autoscalers.py": "policy",
    "test_dilu.py": "policy",
    "test_dilu_profile.py": "policy",
    "test_fastgshare.py": "policy",
    "test_governor.py": "policy",
    "test_kaas_policy.py": "policy",
    "test_maxrects.py": "policy",
    "test_partitioning_policy.py": "policy",
    "test_placement.py": "policy",
    "test_policy.py": "policy",
    "test_protean.py": "policy",
    "test_protean_fit.py": "policy",
    "test_request_class.py": "policy",
    "test_sourcing.py": "policy",
    # flashpoint/partition/
    "test_partition.py": "partition",
    # flashpoint/messages/
    "test_messages_base.py": "messages",
    "test_messages_controller_host.py": "messages",
    "test_messages_worker.py": "messages",
    # flashpoint/spot/
    "test_spot.py": "spot",
    # bench/ scripts ("benchmarks": a tests/bench package would shadow the repo's bench/)
    "test_peers_bench.py": "benchmarks",
    # deploy/ (the systemd units)
    "test_systemd_units.py": "deploy",
}


def _git(*args: str, dry_run: bool) -> None:
    print("git", *args)
    if not dry_run:
        subprocess.run(["git", "-C", str(ROOT), *args], check=True)


def move(dry_run: bool = False) -> dict[str, str]:
    """Move the mapped files that exist; returns module name -> folder of what moved."""
    moved: dict[str, str] = {}
    for name, folder in sorted(MAPPING.items()):
        src = UNIT / name
        if not src.exists():
            continue
        dest_dir = ROOT / "tests" / folder
        dest = dest_dir / name
        if dest.exists():
            print(f"SKIPPED {src.relative_to(ROOT)}: {dest.relative_to(ROOT)} exists",
                  file=sys.stderr)
            continue
        if not dry_run:
            dest_dir.mkdir(parents=True, exist_ok=True)
        init = dest_dir / "__init__.py"
        if not init.exists():
            if not dry_run:
                init.touch()
            _git("add", str(init.relative_to(ROOT)), dry_run=dry_run)
        _git("mv", str(src.relative_to(ROOT)), str(dest.relative_to(ROOT)), dry_run=dry_run)
        moved[name.removesuffix(".py")] = folder
    return moved


def _folder_of(path: Path) -> str:
    return path.relative_to(ROOT / "tests").parts[0]


def placed() -> dict[str, str]:
    """Module name -> folder of every mapped file now in its folder (moved by this run or an
    earlier one: a branch merged since may still import it at its old place)."""
    return {name.removesuffix(".py"): folder for name, folder in MAPPING.items()
            if (ROOT / "tests" / folder / name).exists()}


def rewrite_imports(path: Path, text: str, moved: dict[str, str]) -> str:
    """``text`` of test file ``path`` with its imports of moved modules pointed at them."""
    here = _folder_of(path)

    def relative(m: re.Match[str]) -> str:
        folder = moved.get(m.group(2))
        if folder is None or folder == here or path.with_name(m.group(2) + ".py").exists():
            return m.group(0)  # a module of this folder (its own test_x.py) stays
        return f"{m.group(1)}from {folder}.{m.group(2)} import"

    def absolute(m: re.Match[str]) -> str:
        folder = moved.get(m.group(2))
        if folder is None:
            return m.group(0)
        if folder == here:
            return f"{m.group(1)}from .{m.group(2)} import"
        return f"{m.group(1)}from {folder}.{m.group(2)} import"

    text = re.sub(r"^(\s*)from \.(\w+) import", relative, text, flags=re.M)
    return re.sub(r"^(\s*)from unit\.(\w+) import", absolute, text, flags=re.M)


def rewrite(moved: dict[str, str], dry_run: bool = False) -> None:
    """Point imports and path mentions at the moved files."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        _save(path, text, rewrite_imports(path, text, moved), dry_run)
    for pattern in ("*.py", "*.md", "*.toml"):
        for path in sorted(ROOT.rglob(pattern)):
            if ".git" in path.parts or ".venv" in path.parts or path == Path(__file__).resolve():
                continue
            text = path.read_text(errors="replace")
            new = re.sub(r"tests/unit/(\w+)\.py",
                         lambda m: (f"tests/{moved[m.group(1)]}/{m.group(1)}.py"
                                    if m.group(1) in moved else m.group(0)), text)
            _save(path, text, new, dry_run)


REWRITTEN: list[Path] = []


def _save(path: Path, old: str, new: str, dry_run: bool) -> None:
    if new != old:
        print(f"rewrote {path.relative_to(ROOT)}")
        REWRITTEN.append(path)
        if not dry_run:
            path.write_text(new)


def sort_imports(paths: list[Path]) -> None:
    """Re-sort the imports of rewritten Python files (a rewritten import may now sort
    elsewhere); skipped, with a note, where ruff is not installed."""
    files = [str(p) for p in paths if p.suffix == ".py"]
    if not files:
        return
    try:
        subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "I", "--fix", "-q",
                        *files], check=False)
    except OSError as exc:
        print(f"imports not re-sorted ({exc}): run ruff check --select I --fix", file=sys.stderr)


def main(argv: list[str]) -> int:
    dry_run = "--dry-run" in argv
    moved = move(dry_run)
    rewrite(moved if dry_run else placed(), dry_run)
    if not dry_run:
        sort_imports(REWRITTEN)
    left = sorted(p.name for p in UNIT.glob("*") if p.name not in ("__init__.py", "__pycache__"))
    for name in left:
        print(f"NOT MAPPED: tests/unit/{name}")
    if not left and UNIT.exists() and not dry_run:
        _git("rm", "-q", "--ignore-unmatch", "tests/unit/__init__.py", dry_run=dry_run)
        for cache in UNIT.glob("__pycache__"):
            subprocess.run(["rm", "-rf", str(cache)], check=True)
        if UNIT.exists() and not any(UNIT.iterdir()):
            UNIT.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
