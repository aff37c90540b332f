"""Built-in models: presets and sizes, determinism, layers, configs, signatures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashpoint.errors import BadRequest
from flashpoint.models import (
    MODELS,
    PRESET_NAMES,
    build,
    build_empty,
    example_inputs,
    io_signature,
    param_bytes,
    resolve_config,
    run_example,
)
from flashpoint.models.zoo import state_dict_bytes

MB = 1_000_000
BOUNDS = {
    "tiny": (2 * MB, 5 * MB),
    "small": (30 * MB, 60 * MB),
    "base": (400 * MB, 700 * MB),
    "large": (2**30, 4 * 2**30),
}
OIP_TO_NUMPY = {"FP32": np.float32, "INT64": np.int64}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_presets_are_in_their_size_bounds(name, preset):
    size = param_bytes(name, preset)  # meta device: no memory, even for large
    if name == "noop" and preset == "tiny":
        assert size < 1024  # the overhead benchmark model: a single scalar weight
        return
    low, high = BOUNDS[preset]
    assert low <= size <= high, f"{name}/{preset}: {size / MB:.1f} MB"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_param_bytes_matches_the_built_model(name):
    module, config = build(name, "tiny")
    assert param_bytes(name, config) == state_dict_bytes(module)
    assert param_bytes(name, "tiny") == state_dict_bytes(module)


def test_param_bytes_small_noop_is_exact():
    module, _ = build("noop", {"preset": "small", "num_layers": 3})
    assert state_dict_bytes(module) == 32 * 2**20 + 3 * 4
    assert len(module.layers) == 3


@pytest.mark.parametrize("name", sorted(MODELS))
def test_builds_are_deterministic(name):
    a, cfg_a = build(name, "tiny")
    b, cfg_b = build(name, "tiny")
    c, _ = build(name, "tiny", seed=1)
    assert cfg_a == cfg_b
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    if name != "noop":  # noop's only weight is a fixed 1.0
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layers_run_in_sequence_equal_forward(name):
    module, config = build(name, "tiny")
    inputs = example_inputs(name, config, batch=3)
    (x,) = (torch.from_numpy(a) for a in inputs.values())
    with torch.inference_mode():
        expected = module(x)
        h = x
        for layer in module.layers:
            h = layer(h)
        assert torch.equal(h, expected)
        mid = len(module.layers) // 2
        staged = module.run_layers(module.run_layers(x, 0, mid - 1), mid)
        assert torch.equal(staged, expected)
    assert module.layer_names() == [f"layers.{i}" for i in range(len(module.layers))]
    keys = list(module.state_dict())
    assert all(any(k.startswith(p + ".") for p in module.layer_names()) for k in keys)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_io_signature_matches_outputs(name):
    module, config = build(name, "tiny")
    sig = io_signature(name, config)
    inputs = example_inputs(name, config, batch=2)
    assert [s.name for s in sig.inputs] == list(inputs)
    for spec in sig.inputs:
        arr = inputs[spec.name]
        assert arr.dtype == OIP_TO_NUMPY[spec.datatype]
        assert len(arr.shape) == len(spec.shape)
        assert all(d == -1 or d == n for d, n in zip(spec.shape, arr.shape, strict=True))
    out = run_example(module, inputs)
    (spec,) = sig.outputs
    assert out.dtype == torch.float32 and spec.datatype == "FP32"
    assert out.shape[0] == 2 and len(out.shape) == len(spec.shape)
    assert all(d == -1 or d == n for d, n in zip(spec.shape, out.shape, strict=True))
    assert torch.isfinite(out).all()


def test_bert_first_layer_takes_integers_later_layers_floats():
    module, config = build("bert", "tiny")
    ids = torch.from_numpy(example_inputs("bert", config, 2)["input_ids"])
    assert ids.dtype == torch.int64
    with torch.inference_mode():
        hidden = module.layers[0](ids)
    assert hidden.dtype == torch.float32
    assert hidden.shape == (2, config["seq_len"], config["hidden_size"])


def test_bert_pre_norm_and_resnet_image_sizes():
    module, config = build("bert", {"pre_norm": True, "num_layers": 1})
    assert config["pre_norm"] and len(module.layers) == 3
    out = run_example(module, example_inputs("bert", config, 1))
    assert out.shape == (1, config["num_labels"])
    module, config = build("resnet", {"image_size": 64})
    assert run_example(module, example_inputs("resnet", config, 1)).shape == (1, 10)


def test_example_inputs_are_deterministic():
    for name in MODELS:
        config = resolve_config(name, "tiny")
        a = example_inputs(name, config, 2)
        b = example_inputs(name, config, 2)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(BadRequest):
        example_inputs("bert", resolve_config("bert"), 0)


def test_config_overrides_and_validation():
    config = resolve_config("bert", {"preset": "small", "num_layers": 3})
    assert config["num_layers"] == 3 and config["hidden_size"] == 256
    assert resolve_config("resnet", {"widths": [8, 16], "blocks": [1, 2]})["widths"] == [8, 16]
    for name, bad in [
        ("bert", {"nope": 1}),
        ("bert", {"num_layers": "2"}),
        ("bert", {"num_layers": True}),
        ("bert", {"num_layers": 0}),
        ("bert", {"hidden_size": 130}),  # not a multiple of num_heads
        ("bert", {"preset": "huge"}),
        ("bert", "huge"),
        ("resnet", {"widths": [8], "blocks": [1, 1]}),
        ("noop", {"ballast_bytes": -1}),
        ("gpt", "tiny"),
    ]:
        with pytest.raises(BadRequest):
            resolve_config(name, bad)


def test_build_empty_allocates_nothing():
    config = resolve_config("bert", "large")
    module = build_empty("bert", config)
    assert all(p.is_meta for p in module.parameters())
    assert MODELS["bert"].entry_point == "flashpoint.models.bert:build_empty"
