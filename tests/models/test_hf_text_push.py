"""Pushing Hugging Face text models: what is refused at push (one line naming the file,
nothing uploaded), what is carried, and the served answer against transformers."""

from __future__ import annotations

import asyncio
import json
import mmap
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpoint.errors import InputTooLong, InvalidInput, RegistryError, UnsupportedModel
from flashpoint.models import serving
from flashpoint.models.publish import load_module, read_files
from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_text_classifier
from flashpoint.registry.local import LocalStore


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text_classifier(tmp_path_factory.mktemp("hf") / "m", family="bert")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _push(store: LocalStore, source: Path, **kw: object):
    return asyncio.run(publish_source(store, "m", source, **kw))


@pytest.mark.parametrize("break_it, says", [
    (lambda d: (d / "config.json").write_text("{nope"), "config.json: not valid JSON"),
    (lambda d: _edit(d, architectures=None), "needs 'architectures'"),
    (lambda d: _edit(d, architectures=["BertModel"]), "is not served yet"),
    (lambda d: _edit(d, auto_map={"AutoModel": "x.Y"}), "custom code"),
    (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    (lambda d: [p.unlink() for p in d.glob("tokenizer*")], "no tokenizer"),
])
def test_push_refuses_what_cannot_serve_naming_the_file(model_dir: Path, tmp_path: Path,
                                                        break_it, says: str) -> None:
    d = _copy(model_dir, tmp_path / "src")
    break_it(d)
    store = LocalStore(tmp_path / "reg")
    with pytest.raises(UnsupportedModel) as err:
        _push(store, d)
    assert says in err.value.message and str(d) in err.value.message
    assert "\n" not in err.value.message
    assert asyncio.run(store.list_models()) == []  # nothing uploaded


def _edit(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_weights_of_another_architecture_are_refused(model_dir: Path, tmp_path: Path) -> None:
    """A BertModel checkpoint under a classifier's config: from_pretrained would fill the
    classifier with random values; push names the missing weights instead."""
    from transformers import BertModel

    d = _copy(model_dir, tmp_path / "src")
    base = BertModel.from_pretrained(str(d))
    (d / "model.safetensors").unlink()
    base.save_pretrained(str(d))
    _edit(d, architectures=["BertForSequenceClassification"])
    with pytest.raises(UnsupportedModel, match="the weights miss"):
        _push(LocalStore(tmp_path / "reg"), d)


def test_carried_files_buffers_and_served_answer(model_dir: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "reg")
    m = _push(store, model_dir)
    assert m.source_format == "hf" and m.task == "text-classification"
    assert set(m.files) == {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert "model.bert.embeddings.position_ids" in m.buffers  # non-persistent, carried
    assert [layer.name for layer in m.layers][0] == "embeddings"
    assert m.layers[-1].name == "head"
    with open(store.blob_path("m", "1"), "rb") as fh:
        blob = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    module = load_module(m, memoryview(blob), copy=True)
    served = serving.for_manifest(m, read_files(m, memoryview(blob)))
    texts = ["this movie was great", "a cold start fetches bytes from a peer", "terrible"]
    request = served.prepare({"text": np.array([t.encode() for t in texts], dtype=object)})
    with torch.inference_mode():
        logits = module(*(torch.from_numpy(request[n]) for n in served.module_inputs)).numpy()
    answer = served.finish({"logits": logits})

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ref = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        want = ref(**tok(texts, padding=True, return_tensors="pt")).logits.numpy()
    np.testing.assert_allclose(answer["logits"], want, atol=1e-5, rtol=1e-5)
    assert [row[0].decode() for row in answer["label"]] == [
        ["negative", "positive"][i] for i in want.argmax(axis=1)]

    with pytest.raises(InputTooLong):
        served.prepare({"text": np.array([" ".join(["great"] * 100).encode()], dtype=object)})
    with pytest.raises(InvalidInput):
        served.prepare({"text": np.array([b"\xff\xfe"], dtype=object)})
    with pytest.raises(InvalidInput):
        served.prepare({"text": np.array([[b"a", b"b"]], dtype=object)})


def test_truncate_cuts_long_texts_instead(model_dir: Path, tmp_path: Path) -> None:
    from flashpoint.models.sources import PushOptions

    store = LocalStore(tmp_path / "reg")
    m = _push(store, model_dir, options=PushOptions(truncate=True, top_k=1))
    blob = store.blob_path("m", "1").read_bytes()
    served = serving.for_manifest(m, read_files(m, blob))
    out = served.prepare({"text": np.array([" ".join(["great"] * 100).encode()], dtype=object)})
    assert out["input_ids"].shape == (1, 64)  # the tiny model's positions
    answer = served.finish({"logits": np.array([[0.1, 0.9]], np.float32)})
    assert answer["label"].shape == (1, 1) and answer["label"][0, 0] == b"positive"


def test_a_manifest_naming_other_code_is_refused_at_load(model_dir: Path, tmp_path: Path) -> None:
    import dataclasses

    store = LocalStore(tmp_path / "reg")
    m = _push(store, model_dir)
    blob = store.blob_path("m", "1").read_bytes()
    for entry in ("os:system", "subprocess:Popen"):
        with pytest.raises(RegistryError, match="not a built-in model builder"):
            load_module(dataclasses.replace(m, entry_point=entry), blob)
