"""Handler bundles: the example bundle pushed with trust, loaded back the worker's way and
compared with torch computing the same; trust enforced at push and at load."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flashpoint.errors import RegistryError, UnsupportedModel
from flashpoint.models import serving
from flashpoint.models.publish import load_module, read_files
from flashpoint.models.sources import detect, publish_source
from flashpoint.registry.local import LocalStore

BUNDLE = Path(__file__).resolve().parents[2] / "examples" / "handler"
MEAN = np.array([5.8, 3.0, 3.8, 1.2], dtype=np.float32)
STD = np.array([0.8, 0.4, 1.8, 0.8], dtype=np.float32)


async def _blob(store: LocalStore, manifest) -> bytearray:
    return bytearray(b"".join([await store.read_chunk(manifest.name, manifest.version, i)
                               for i in range(manifest.num_chunks)]))


def _serve(manifest, blob, requests):
    """What a worker does: module and serving task, requests batched, sliced, finished."""
    module = load_module(manifest, blob)
    served = serving.for_manifest(manifest, read_files(manifest, blob))
    prepared = [served.prepare(r) for r in requests]
    batch = {n: np.concatenate([p[n] for p in prepared]) for n in served.module_inputs}
    with torch.inference_mode():
        out = module(*(torch.from_numpy(batch[n]) for n in served.module_inputs))
    outs = {n: o.numpy() for n, o in zip(served.module_outputs, out, strict=True)}
    answers, start = [], 0
    for p in prepared:
        size = len(p[served.module_inputs[0]])
        answers.append(served.finish({n: v[start:start + size] for n, v in outs.items()}))
        start += size
    return answers


async def test_example_bundle_serves_like_torch(tmp_path):
    assert detect(BUNDLE).name == "handler"
    store = LocalStore(tmp_path / "registry")
    manifest = await publish_source(store, "lin", BUNDLE, trust_code=True)
    assert manifest.trusted_code and manifest.task == "handler"
    assert manifest.source_format == "handler"
    assert {"flashpoint.toml", "linear.py"} <= set(manifest.files)
    assert set(manifest.module_tensors()) == {"weights.fc.weight", "weights.fc.bias"}
    assert [o.name for o in manifest.io.outputs] == ["label", "logits"]

    weights = load_file(str(BUNDLE / "weights.safetensors"))
    rng = np.random.default_rng(0)
    requests = [{"x": rng.normal(4, 2, size=(n, 4)).astype(np.float32)} for n in (1, 3)]
    answers = _serve(manifest, await _blob(store, manifest), requests)
    for request, answer in zip(requests, answers, strict=True):
        x = torch.from_numpy((request["x"] - MEAN) / STD)
        logits = x @ weights["fc.weight"].T + weights["fc.bias"]
        np.testing.assert_allclose(answer["logits"], logits.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(answer["label"], logits.argmax(-1).numpy())
    assert not any(name.endswith("_linear") or name == "linear" for name in sys.modules)


async def test_bad_request_values_are_a_bad_request(tmp_path):
    from flashpoint.errors import InvalidInput

    store = LocalStore(tmp_path / "registry")
    manifest = await publish_source(store, "lin", BUNDLE, trust_code=True)
    served = serving.for_manifest(manifest, read_files(manifest, await _blob(store, manifest)))
    with pytest.raises(InvalidInput, match="x must be"):
        served.prepare({"x": np.zeros((2, 5), np.float32)})


async def test_push_without_trust_is_refused(tmp_path):
    store = LocalStore(tmp_path / "registry")
    with pytest.raises(UnsupportedModel, match="an admin must push it with --trust-code"):
        await publish_source(store, "lin", BUNDLE)
    assert await store.list_models() == []


async def test_untrusted_manifest_is_refused_at_load(tmp_path):
    store = LocalStore(tmp_path / "registry")
    manifest = await publish_source(store, "lin", BUNDLE, trust_code=True)
    blob = await _blob(store, manifest)
    edited = dataclasses.replace(manifest, trusted_code=False)
    with pytest.raises(RegistryError, match="no admin trusted it"):
        load_module(edited, blob)
    with pytest.raises(RegistryError, match="no admin trusted it"):
        serving.for_manifest(edited, read_files(edited, blob))


async def test_entry_points_other_than_builders_are_refused(tmp_path):
    store = LocalStore(tmp_path / "registry")
    manifest = await publish_source(store, "lin", BUNDLE, trust_code=True)
    blob = await _blob(store, manifest)
    with pytest.raises(RegistryError, match="not a built-in model builder"):
        load_module(dataclasses.replace(manifest, entry_point="os:system"), blob)


async def test_broken_bundles_are_refused_naming_what(tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(BUNDLE, bundle)
    store = LocalStore(tmp_path / "registry")
    (bundle / "linear.py").write_text("raise ImportError('nope')\n")
    with pytest.raises(UnsupportedModel, match="importing linear.py failed"):
        await publish_source(store, "b", bundle, trust_code=True)
    shutil.copy(BUNDLE / "linear.py", bundle / "linear.py")
    (bundle / "flashpoint.toml").write_text('handler = "linear:Nope"\ninputs = ["x:FP32:-1,4"]\n')
    with pytest.raises(UnsupportedModel, match="no class 'Nope'"):
        await publish_source(store, "b", bundle, trust_code=True)
    (bundle / "flashpoint.toml").write_text('handler = "linear:LinearClassifier"\n')
    with pytest.raises(UnsupportedModel, match="needs inputs"):
        await publish_source(store, "b", bundle, trust_code=True)
