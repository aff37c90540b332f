"""`flashpoint model list` and `flashpoint model delete`, each a process of its own over one
registry: a table or JSON of what is published, deletion of one version or all, and a
missing model that exits 1 with one line and no traceback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashpoint.config import load_config
from flashpoint.models.sources import publish
from flashpoint.registry import make_store

pytestmark = pytest.mark.timeout(120)


async def _cli(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "flashpoint.cli", "--home", str(home), *argv],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


async def test_model_list_and_delete(tmp_path: Path) -> None:
    store = make_store(load_config().with_home(tmp_path))  # the registry `--home` names
    r = await _cli(tmp_path, "model", "list", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    noop = await publish(store, "noop", "tiny", "1", model_name="noop")
    await publish(store, "noop", "tiny", "2", model_name="noop")
    await publish(store, "noop", "tiny", "1", model_name="other")

    r = await _cli(tmp_path, "model", "list")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["NAME", "VERSION", "SIZE", "LAYERS", "ENTRY", "POINT"]
    assert [row.split()[:2] for row in rows] == [["noop", "1"], ["noop", "2"], ["other", "1"]]
    assert rows[0].split()[-2:] == [str(len(noop.layers)), noop.entry_point]
    r = await _cli(tmp_path, "model", "list", "--json")
    listed = json.loads(r.stdout)
    assert listed[0] == {"name": "noop", "version": "1", "size_bytes": noop.blob_size,
                         "layers": len(noop.layers), "entry_point": noop.entry_point}

    r = await _cli(tmp_path, "model", "delete", "noop", "--version", "2")
    assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": "noop", "version": "2"}
    assert await store.list_models() == [("noop", "1"), ("other", "1")]

    for argv in (("noop", "--version", "9"), ("missing",)):
        r = await _cli(tmp_path, "model", "delete", *argv)
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "not found" in r.stderr
        assert "Traceback" not in r.stderr
    r = await _cli(tmp_path, "model", "delete", "noop", "--version", "bad/version")
    assert r.returncode == 1 and "Traceback" not in r.stderr

    r = await _cli(tmp_path, "model", "delete", "other")  # every version of it
    assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": "other", "version": "1"}
    assert await store.list_models() == [("noop", "1")]
