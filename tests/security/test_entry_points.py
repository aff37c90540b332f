"""Issue 19 item 2: entry points are built-in builders or trusted bundles only, refused at
push (``publish_module``, which every push adapter goes through) and again at load (the
worker's own load path)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flashpoint.errors import RegistryError
from flashpoint.models.publish import BUILTIN_ENTRY_POINTS, publish_module
from flashpoint.models.sources import FORMATS, PushOptions, publish, publish_source, register
from flashpoint.models.sources.base import Prepared
from flashpoint.registry.local import LocalStore
from flashpoint.registry.manifest import IoSignature, Manifest
from flashpoint.spec import FunctionSpec, TensorSpec

pytestmark = pytest.mark.timeout(60)

HOSTILE = ("subprocess:Popen", "os:system")


def _hostile_config(marker: Path) -> dict[str, Any]:
    # subprocess.Popen(config) would run ``touch <marker>`` (a dict iterates its keys).
    return {"/usr/bin/touch": 0, str(marker): 0}


@pytest.fixture
async def noop(tmp_path: Path) -> tuple[LocalStore, Manifest]:
    store = LocalStore(tmp_path / "registry")
    return store, await publish(store, "noop", "tiny", "1", model_name="noop")


@pytest.mark.parametrize("entry_point", HOSTILE)
@pytest.mark.parametrize("stage", [None, [0, 0]])
async def test_the_worker_refuses_to_load_a_manifest_naming_a_foreign_callable(
        tmp_path: Path, noop: tuple[LocalStore, Manifest], entry_point: str,
        stage: list[int] | None) -> None:
    from flashpoint.messages.host_worker import LoadReplica
    from flashpoint.worker import loading

    store, real = noop
    marker = tmp_path / "pwned"
    hostile = dataclasses.replace(real, entry_point=entry_point, config=_hostile_config(marker))
    spec = FunctionSpec(name="f", model="noop")
    msg = LoadReplica(replica_id="r1", manifest_json=hostile.to_json(), device="cpu",
                      cache_path=str(store.blob_path("noop", "1")), spec=spec.to_dict(),
                      controller_url="ws://127.0.0.1:1/rpc",
                      stage=tuple(stage) if stage is not None else None)
    with pytest.raises(RegistryError, match="not a built-in model builder"):
        loading.load(msg, spec, time.perf_counter())
    assert not marker.exists()


def test_only_builtin_builders_are_callable() -> None:
    assert not set(HOSTILE) & BUILTIN_ENTRY_POINTS
    assert all(ep.startswith("flashpoint.models.") for ep in BUILTIN_ENTRY_POINTS)


@pytest.mark.parametrize("entry_point", HOSTILE)
async def test_push_refuses_an_entry_point_that_is_not_built_in(
        tmp_path: Path, entry_point: str) -> None:
    store = LocalStore(tmp_path / "registry")
    built: list[bool] = []

    def build() -> torch.nn.Module:
        built.append(True)
        return torch.nn.Linear(2, 2)

    io = IoSignature((TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("y", "FP32", (-1, 2)),))
    with pytest.raises(RegistryError, match="not a built-in model builder"):
        await publish_module(store, build, name="evil", version="1", entry_point=entry_point,
                             config=_hostile_config(tmp_path / "pwned"), io=io)
    assert not built and not store.blob_path("evil", "1").exists()
    assert not (tmp_path / "pwned").exists()


async def test_push_refuses_the_bundle_loader_without_trust_code(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "registry")
    io = IoSignature((TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("y", "FP32", (-1, 2)),))
    with pytest.raises(RegistryError, match="no admin trusted it"):
        await publish_module(store, lambda: torch.nn.Linear(2, 2), name="bundle", version="1",
                             entry_point="flashpoint.models.handler:build_empty", config={},
                             io=io, trusted_code=False)
    assert not store.blob_path("bundle", "1").exists()


async def test_no_push_adapter_can_write_a_foreign_entry_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a (plug-in) adapter that asks for ``subprocess:Popen`` gets nothing published."""

    class Hostile:
        name = "hostile"

        def matches(self, source: Path) -> bool:
            return source.name == "hostile-model"

        def prepare(self, source: Path, options: PushOptions) -> Prepared:
            return Prepared(
                build=lambda: torch.nn.Linear(2, 2), entry_point="subprocess:Popen",
                config=_hostile_config(tmp_path / "pwned"),
                io=IoSignature((TensorSpec("x", "FP32", (-1, 2)),),
                               (TensorSpec("y", "FP32", (-1, 2)),)))

    monkeypatch.setattr("flashpoint.models.sources.FORMATS", dict(FORMATS))
    register(Hostile())
    source = tmp_path / "hostile-model"
    source.mkdir()
    store = LocalStore(tmp_path / "registry")
    with pytest.raises(RegistryError):
        await publish_source(store, "evil", source, version="1")
    assert not store.blob_path("evil", "1").exists()
    assert not (tmp_path / "pwned").exists()
