"""The layer profiler: per-layer bytes, execution time and output size, into the manifest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashpoint.errors import BadRequest
from flashpoint.models import build, example_inputs, load_module, load_stage, publish
from flashpoint.models.profile import (
    PROFILE_KEYS,
    TierBandwidths,
    cold_start_s,
    cold_starts,
    layer_modules,
    measure_tiers,
    profile_layers,
)
from flashpoint.partition.model import CostModel, LayerProfile
from flashpoint.registry import LocalStore

FAST = {"repeats": 3, "warmup": 1}


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "registry")


def single_input(name: str, config: dict, batch: int) -> torch.Tensor:
    (array,) = example_inputs(name, config, batch).values()
    return torch.from_numpy(array)


def hooked_output_bytes(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Each layer's output ``nbytes``, recorded by forward hooks while the whole model runs."""
    sizes: dict[str, int] = {}

    def hook(name: str):
        return lambda _module, _args, out: sizes.__setitem__(name, out.nbytes)

    handles = [layer.register_forward_hook(hook(name))
               for name, layer in zip(model.layer_names(), model.layers, strict=True)]
    try:
        with torch.inference_mode():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return sizes


@pytest.mark.parametrize("name", ["bert", "resnet"])
async def test_profile_per_layer(store, name):
    manifest = await publish(store, name, "tiny")  # for the byte ranges
    model, config = build(name, "tiny")
    x = single_input(name, config, batch=2)
    profiles = profile_layers(model, x, layout=manifest, **FAST)
    assert list(profiles) == [layer.name for layer in manifest.layers] == model.layer_names()
    expected_out = hooked_output_bytes(model, x)
    for layer in manifest.layers:
        p = profiles[layer.name]
        assert tuple(p) == PROFILE_KEYS
        assert p["exec_time_s"] > 0
        assert p["bytes"] == layer.byte_end - layer.byte_start
        assert p["output_bytes"] == expected_out[layer.name]
    assert sum(p["bytes"] for p in profiles.values()) == manifest.blob_size - manifest.data_offset
    if name == "bert":  # embeddings: [2, seq, hidden] FP32; head: [2, labels] FP32
        assert profiles["layers.0"]["output_bytes"] == 2 * config["seq_len"] * config["hidden_size"] * 4
        assert profiles[model.layer_names()[-1]]["output_bytes"] == 2 * config["num_labels"] * 4


@pytest.mark.parametrize("name", ["bert", "resnet"])
async def test_layers_in_sequence_equal_the_model(store, name):
    manifest = await publish(store, name, "tiny")
    blob = await store.read_range(manifest.name, "1", 0, manifest.blob_size)
    model, config = build(name, "tiny")
    x = single_input(name, config, batch=2)
    chained = nn.Sequential(*(m for _, m in layer_modules(model)))  # what the profiler runs
    stages = [load_stage(manifest, blob, i, i) for i in range(len(manifest.layers))]
    with torch.inference_mode():
        whole = model(x)
        assert torch.allclose(chained(x), whole)
        y = x
        for stage in stages:  # one load_stage per layer, as the profiler times them
            y = stage(y)
        assert torch.allclose(y, whole)
        assert torch.allclose(load_module(manifest, blob)(x), whole)


async def test_profiled_publish_round_trips(tmp_path, store):
    manifest = await publish(store, "bert", "tiny", profile=True)
    stored = await store.get_manifest("bert-tiny", "1")
    assert stored == manifest
    plain = await publish(LocalStore(tmp_path / "plain"), "bert", "tiny")
    assert all(layer.profile == {} for layer in plain.layers)  # the default is unchanged
    assert plain.chunk_sha256 == stored.chunk_sha256  # same blob, only the manifest differs
    _, config = build("bert", "tiny")
    for layer in stored.layers:
        assert tuple(layer.profile) == PROFILE_KEYS
        lp = LayerProfile.from_manifest(layer.name, layer.profile)
        assert lp.bytes == layer.size_bytes
        assert lp.exec_s == layer.profile["exec_time_s"] > 0
        assert lp.output_bytes == layer.profile["output_bytes"] > 0
    # profile_batch defaults to one request
    assert stored.layers[0].profile["output_bytes"] == config["seq_len"] * config["hidden_size"] * 4
    assert stored.layers[-1].profile["output_bytes"] == config["num_labels"] * 4


async def test_profiled_publish_keeps_given_profiles(store):
    m = await publish(store, "noop", {"num_layers": 2}, profile=True,
                      profiles={"layers.1": {"exec_time_s": 1.0, "gpu_mem_bytes": 8}})
    assert m.layers[1].profile["exec_time_s"] == 1.0 and m.layers[1].profile["gpu_mem_bytes"] == 8
    assert m.layers[1].profile["bytes"] == m.layers[1].size_bytes
    assert tuple(m.layers[0].profile) == PROFILE_KEYS
    assert m.layers[0].profile["output_bytes"] == 16 * 4  # x: [1, features=16] FP32


async def test_profile_arguments(store):
    model, config = build("noop", {"num_layers": 2})
    inputs = example_inputs("noop", config)
    no_layout = profile_layers(model, inputs, repeats=1, warmup=0)
    assert [p["bytes"] for p in no_layout.values()] == [4, 4]  # one FP32 weight, no padding
    for bad in ({"repeats": 0}, {"repeats": True}, {"warmup": -1}):
        with pytest.raises(BadRequest):
            profile_layers(model, inputs, **bad)
    x = inputs["x"]
    with pytest.raises(BadRequest):
        profile_layers(model, {"a": x, "b": x})
    with pytest.raises(BadRequest):
        profile_layers(model, [1.0, 2.0])
    other = await publish(store, "noop", {"num_layers": 3})
    with pytest.raises(BadRequest):
        profile_layers(model, inputs, layout=other)


def test_tiers_and_cold_starts():
    tiers = measure_tiers(size_bytes=8 << 20, repeats=2, peer_bps=8e9, registry_bps=2e9)
    assert tiers.local_bps > 0 and tiers.worst_bps == 2e9
    assert cold_start_s(10**9, 8e9, 0.5) == pytest.approx(1.5)
    cost = CostModel(bandwidth_bps=tiers.worst_bps, link_bps=1e10, overhead_s=0.25)
    assert cold_start_s(12_345, tiers.worst_bps, 0.25) == cost.cold_s(12_345)
    per_tier = cold_starts({"layers.0": {"bytes": 10**6}}, tiers, overhead_s=0.1)
    assert per_tier["layers.0"] == {
        "local": pytest.approx(8e6 / tiers.local_bps + 0.1),
        "peer": pytest.approx(8e6 / 8e9 + 0.1),
        "registry": pytest.approx(8e6 / 2e9 + 0.1),
    }
    for bad in ((0, 1, 1), (1, -1, 1), (1, 1, 0)):
        with pytest.raises(BadRequest):
            TierBandwidths(*bad)
    with pytest.raises(BadRequest):
        cold_start_s(1, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_profile_on_cuda(store):
    manifest = await publish(store, "resnet", "tiny", profile=True, profile_device="cuda")
    model, config = build("resnet", "tiny")
    expected_out = hooked_output_bytes(model, single_input("resnet", config, batch=1))
    for layer in manifest.layers:
        assert layer.profile["exec_time_s"] > 0
        assert layer.profile["output_bytes"] == expected_out[layer.name]
    assert measure_tiers("cuda", size_bytes=64 << 20).local_bps > 0
