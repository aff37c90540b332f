"""LocalStore: atomic publish, verified reads, name validation, crash leftovers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flashpoint.errors import BadRequest, Conflict, IntegrityError, InvalidName, ModelNotFound, RegistryError
from flashpoint.registry import (
    IoSignature,
    LocalStore,
    ModelStore,
    build_blob,
    make_manifest,
    read_verified,
)
from flashpoint.registry import local as local_mod
from flashpoint.spec import TensorSpec

IO = IoSignature(inputs=(TensorSpec("x", "FP32", (-1,)),), outputs=(TensorSpec("y", "FP32", (-1,)),))
BAD_NAMES = ["../x", "a/b", "..", ".", "", "Upper", "a..b", "/abs", "x" * 64, None, 3]


def make_model(tmp_path, name="m", version="1", seed=0, chunk_size=256):
    g = torch.Generator().manual_seed(seed)
    layers = [
        ("layers.0", [("layers.0.w", torch.randn(40, 7, generator=g))]),
        ("layers.1", [("layers.1.b", torch.randn(33, generator=g).half()),
                      ("layers.1.i", torch.arange(5))]),
    ]
    path = tmp_path / f"{name}-{version}-{seed}.safetensors"
    _, layout = build_blob(layers, chunk_size=chunk_size, path=path)
    manifest = make_manifest(name=name, version=version, layout=layout,
                             entry_point="pkg.mod:build", config={"seed": seed}, io=IO)
    return manifest, path


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "registry")


async def test_put_get_read_list_delete(store, tmp_path):
    assert isinstance(store, ModelStore)
    manifest, path = make_model(tmp_path)
    blob = path.read_bytes()
    assert await store.list_models() == []
    assert not await store.exists("m", "1")
    await store.put(manifest, path)
    assert await store.exists("m", "1")
    assert await store.get_manifest("m", "1") == manifest
    assert await store.list_models() == [("m", "1")]
    root = store.root / "m" / "1"
    assert sorted(p.name for p in root.iterdir()) == ["manifest.json", "weights.safetensors"]
    assert await store.read_range("m", "1", 0, manifest.blob_size) == blob
    assert await store.read_range("m", "1", 10, 20) == blob[10:20]
    assert await store.read_range("m", "1", 5, 5) == b""
    chunks = [await store.read_chunk("m", "1", i) for i in range(manifest.num_chunks)]
    assert b"".join(chunks) == blob
    assert await store.read_verified("m", "1", 100, 700) == blob[100:700]
    assert await read_verified(store, "m", "1", 0, manifest.blob_size) == blob
    assert await read_verified(store, "m", "1", 3, 3) == b""
    await store.delete("m", "1")
    assert not await store.exists("m", "1")
    assert await store.list_models() == []
    assert not (store.root / "m").exists()
    with pytest.raises(ModelNotFound):
        await store.get_manifest("m", "1")


async def test_versions_and_names_listed_sorted(store, tmp_path):
    for name, version in [("b", "2"), ("a", "1"), ("b", "1")]:
        m, p = make_model(tmp_path, name, version)
        await store.put(m, p)
    assert await store.list_models() == [("a", "1"), ("b", "1"), ("b", "2")]
    await store.delete("b", "1")
    assert await store.list_models() == [("a", "1"), ("b", "2")]


async def test_put_is_idempotent_and_versions_are_immutable(store, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    await store.put(m, p)  # same content: no-op
    other, other_path = make_model(tmp_path, seed=1)
    with pytest.raises(Conflict):
        await store.put(other, other_path)
    assert await store.get_manifest("m", "1") == m


async def test_corrupted_weights_fail_read_chunk(store, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    weights = store.blob_path("m", "1")
    data = bytearray(weights.read_bytes())
    target = m.tensors["layers.1.b"].start + 3
    data[target] ^= 0xFF
    weights.write_bytes(bytes(data))
    bad_chunk = target // m.chunk_size
    with pytest.raises(IntegrityError):
        await store.read_chunk("m", "1", bad_chunk)
    await store.read_chunk("m", "1", 0 if bad_chunk else 1)  # other chunks still fine
    with pytest.raises(IntegrityError):
        await store.read_verified("m", "1", 0, m.blob_size)
    assert len(await store.read_range("m", "1", 0, m.blob_size)) == m.blob_size  # unverified


async def test_put_verifies_the_blob(store, tmp_path):
    m, p = make_model(tmp_path)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        await store.put(m, p)
    p.write_bytes(bytes(data[:-1]))
    with pytest.raises(BadRequest):
        await store.put(m, p)
    with pytest.raises(BadRequest):
        await store.put(m, tmp_path / "missing.safetensors")
    assert await store.list_models() == []
    assert list((store.root / ".tmp").iterdir()) == []


@pytest.mark.parametrize("bad", BAD_NAMES)
async def test_bad_names_are_rejected(store, tmp_path, bad):
    with pytest.raises(InvalidName):
        await store.get_manifest(bad, "1")
    with pytest.raises(InvalidName):
        await store.read_range(bad, "1", 0, 1)
    with pytest.raises(InvalidName):
        await store.read_chunk(bad, "1", 0)
    with pytest.raises(InvalidName):
        await store.exists(bad, "1")
    with pytest.raises(InvalidName):
        await store.delete(bad, "1")
    if bad != "Upper":  # versions may use upper case
        with pytest.raises(InvalidName):
            await store.get_manifest("m", bad)
    m, p = make_model(tmp_path)
    with pytest.raises(InvalidName):
        await store.put(dataclasses.replace(m, name=bad), p)
    assert not (tmp_path / "x").exists()
    assert await store.list_models() == []


async def test_missing_model(store, tmp_path):
    with pytest.raises(ModelNotFound):
        await store.get_manifest("nope", "1")
    with pytest.raises(ModelNotFound):
        await store.read_range("nope", "1", 0, 1)
    with pytest.raises(ModelNotFound):
        await store.read_chunk("nope", "1", 0)
    with pytest.raises(ModelNotFound):
        await store.delete("nope", "1")
    m, p = make_model(tmp_path)
    await store.put(m, p)
    with pytest.raises(ModelNotFound):
        await store.get_manifest("m", "2")
    with pytest.raises(BadRequest):
        await store.read_range("m", "1", 0, m.blob_size + 1)
    with pytest.raises(BadRequest):
        await store.read_range("m", "1", 5, 4)
    with pytest.raises(BadRequest):
        await store.read_chunk("m", "1", m.num_chunks)


async def test_interrupted_put_leaves_no_visible_model(store, tmp_path, monkeypatch):
    m, p = make_model(tmp_path)
    real_write = local_mod._write_file_synced

    def crash(path, data):  # the manifest write fails after the weights are on disk
        real_write(path, data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(local_mod, "_write_file_synced", crash)
    with pytest.raises(RegistryError):
        await store.put(m, p)
    assert not await store.exists("m", "1")
    assert await store.list_models() == []
    with pytest.raises(ModelNotFound):
        await store.get_manifest("m", "1")
    assert list((store.root / ".tmp").iterdir()) == []
    monkeypatch.setattr(local_mod, "_write_file_synced", real_write)
    await store.put(m, p)  # a retry succeeds
    assert await store.get_manifest("m", "1") == m


async def test_interrupted_copy_leaves_no_visible_model(store, tmp_path, monkeypatch):
    m, p = make_model(tmp_path)
    calls = {"n": 0}
    real_verify = local_mod.verify_chunk

    def flaky(manifest, index, data):
        calls["n"] += 1
        if index == 2:
            raise RuntimeError("process dying mid-copy")
        return real_verify(manifest, index, data)

    monkeypatch.setattr(local_mod, "verify_chunk", flaky)
    with pytest.raises(RuntimeError):
        await store.put(m, p)
    assert await store.list_models() == []
    assert not (store.root / "m" / "1").exists()
    assert list((store.root / ".tmp").iterdir()) == []


async def test_crash_leftovers_are_invisible_and_cleaned(store, tmp_path):
    m, p = make_model(tmp_path)
    # A process that died between writing and renaming leaves a full temp dir behind.
    leftover = store.root / ".tmp" / "put-dead"
    leftover.mkdir(parents=True)
    (leftover / "weights.safetensors").write_bytes(p.read_bytes())
    (leftover / "manifest.json").write_text(m.to_json())
    assert await store.list_models() == []
    assert not await store.exists("m", "1")
    assert await store.cleanup_temp(older_than_s=3600) == 0
    assert await store.cleanup_temp(older_than_s=-1) == 1
    assert not leftover.exists()


async def test_invalid_stored_manifest_is_a_registry_error(store, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    path = store.model_dir("m", "1") / "manifest.json"
    d = json.loads(path.read_text())
    d["name"] = "other"
    path.write_text(json.dumps(d))
    with pytest.raises(RegistryError):
        await store.get_manifest("m", "1")
    path.write_text("{not json")
    with pytest.raises(RegistryError):
        await store.get_manifest("m", "1")


def test_manifest_and_store_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, flashpoint.registry, flashpoint.registry.manifest, flashpoint.registry.local;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
