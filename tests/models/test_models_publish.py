"""Publish built-in models into a LocalStore and load them back, zero-copy."""

from __future__ import annotations

import dataclasses
import mmap
import warnings

import pytest
import torch
from safetensors.torch import load_file

from flashpoint.errors import RegistryError
from flashpoint.models import MODELS, build, example_inputs, load_module, load_stage, publish, run_example
from flashpoint.registry import (
    ALIGN_BYTES,
    LocalStore,
    byte_range_for_layers,
    tensor_views,
    to_state_dict,
)


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "registry")


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_round_trip(store, name):
    manifest = await publish(store, name, "tiny", chunk_size=256 * 1024)
    assert manifest.name == f"{name}-tiny" and manifest.version == "1"
    assert await store.get_manifest(manifest.name, "1") == manifest
    blob = b"".join(
        [await store.read_chunk(manifest.name, "1", i) for i in range(manifest.num_chunks)]
    )
    assert len(blob) == manifest.blob_size
    original, config = build(name, "tiny")
    assert manifest.config == config
    assert manifest.entry_point == MODELS[name].entry_point
    # Layout: aligned tensors, layers tiling the data in order.
    assert all(t.start % ALIGN_BYTES == 0 for t in manifest.tensors.values())
    assert [layer.name for layer in manifest.layers] == original.layer_names()
    pos = manifest.data_offset
    for layer in manifest.layers:
        assert layer.byte_start == pos and layer.byte_end >= layer.byte_start
        pos = layer.byte_end
    assert pos == manifest.blob_size
    # The blob is plain safetensors and equals the state dict.
    state = original.state_dict()
    loaded = load_file(store.blob_path(manifest.name, "1"))
    for key, t in state.items():
        assert torch.equal(loaded[key], t), key
    views = to_state_dict(manifest, blob)
    assert list(views) == list(state)
    # Load zero-copy and compare outputs.
    buf = bytearray(blob)  # stands in for a shared-memory segment
    module = load_module(manifest, buf)
    inputs = example_inputs(name, config, batch=2)
    assert torch.allclose(run_example(module, inputs), run_example(original, inputs))
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    for key, t in module.state_dict().items():
        assert t.data_ptr() == base + manifest.tensors[key].start, key  # a view, not a copy
        assert not t.requires_grad
    assert not module.training


async def test_load_from_read_only_mmap_without_warnings(store):
    manifest = await publish(store, "bert", "tiny")
    with open(store.blob_path(manifest.name, "1"), "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    original, config = build("bert", "tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = load_module(manifest, mapped)
    inputs = example_inputs("bert", config, 2)
    assert torch.equal(run_example(module, inputs), run_example(original, inputs))


async def test_stages_chain_to_the_full_model(store):
    manifest = await publish(store, "resnet", "tiny")
    blob = await store.read_range(manifest.name, "1", 0, manifest.blob_size)
    original, config = build("resnet", "tiny")
    x = torch.from_numpy(example_inputs("resnet", config, 2)["image"])
    cut = len(manifest.layers) // 2
    stages = []
    for first, last in [(0, cut - 1), (cut, len(manifest.layers) - 1)]:
        start, end = byte_range_for_layers(manifest, first, last)
        part = await store.read_verified(manifest.name, "1", start, end)
        stages.append(load_stage(manifest, part, first, last, buffer_offset=start))
    with torch.inference_mode():
        assert torch.equal(stages[1](stages[0](x)), original(x))
        whole = load_stage(manifest, blob, 0, len(manifest.layers) - 1)
        assert torch.equal(whole(x), original(x))


async def test_publish_is_deterministic_and_configurable(tmp_path):
    a = await publish(LocalStore(tmp_path / "a"), "bert", "tiny", chunk_size=100_000)
    b = await publish(LocalStore(tmp_path / "b"), "bert", "tiny", chunk_size=100_000)
    assert a == b and a.chunk_sha256 == b.chunk_sha256
    assert (tmp_path / "a" / "bert-tiny" / "1" / "weights.safetensors").read_bytes() == (
        tmp_path / "b" / "bert-tiny" / "1" / "weights.safetensors"
    ).read_bytes()
    store = LocalStore(tmp_path / "c")
    m = await publish(store, "noop", {"num_layers": 2, "ballast_bytes": 1000}, version="v2",
                      model_name="bench-noop",
                      profiles={"layers.0": {"exec_time_s": 1e-6, "output_bytes": 64}})
    assert (m.name, m.version) == ("bench-noop", "v2")
    assert m.layers[0].profile == {"exec_time_s": 1e-6, "output_bytes": 64}
    assert await store.list_models() == [("bench-noop", "v2")]
    assert list((tmp_path / "c" / ".tmp").iterdir()) == []  # the staging file is gone


async def test_load_module_failures(store):
    manifest = await publish(store, "noop", "tiny")
    blob = await store.read_range(manifest.name, "1", 0, manifest.blob_size)
    for entry_point in ["flashpoint.models.nope:build_empty", "flashpoint.models.noop:nope"]:
        with pytest.raises(RegistryError):
            load_module(dataclasses.replace(manifest, entry_point=entry_point), blob)
    wrong = dataclasses.replace(manifest, entry_point="flashpoint.models.bert:build_empty",
                                config=build("bert", "tiny")[1])
    with pytest.raises(RegistryError):
        load_module(wrong, blob)
    views = tensor_views(manifest, blob)
    assert list(views) == ["layers.0.weight"]
