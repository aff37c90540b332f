"""Hugging Face encoders in pipeline stages: pushed with per-layer profiles, split into
stages over the blob, chained, and compared with ``transformers`` computing the logits."""

from __future__ import annotations

import pytest
import torch

from flashpoint.errors import BadRequest, InputTooLong, UnsupportedModel
from flashpoint.models import load_module, load_stage
from flashpoint.models.hf import ENTRY_POINT
from flashpoint.models.hf_stages import HFStage
from flashpoint.models.publish import stage_skeleton
from flashpoint.models.sources import PushOptions, publish_source
from flashpoint.models.tiny_hf import make_text_classifier
from flashpoint.partition.stageable import HF_ENTRY_POINT, why_not_staged
from flashpoint.registry import byte_range_for_layers
from flashpoint.registry.local import LocalStore

pytest.importorskip("transformers")

FAMILIES = ("bert", "roberta", "distilbert", "gpt2")
TEXTS = ["a short one", "this sentence is quite a bit longer than the first one, padded",
         "mid length text here"]


def cuts(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges over ``n`` layers."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


@pytest.fixture(scope="module", params=FAMILIES)
def pushed(request, tmp_path_factory):
    import asyncio

    family = request.param
    root = tmp_path_factory.mktemp(f"hf-{family}")
    source = make_text_classifier(root / "src", family=family, size="tiny")
    store = LocalStore(root / "registry")
    manifest = asyncio.run(publish_source(store, f"tiny-{family}", source,
                                          options=PushOptions(profile=True)))
    blob = asyncio.run(store.read_range(manifest.name, "1", 0, manifest.blob_size))
    return family, source, store, manifest, blob


def reference(source, texts):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(source),
                                                               local_files_only=True).eval()
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    return enc["input_ids"], enc["attention_mask"], logits


def run_chain(stages, input_ids, attention_mask):
    args = (input_ids, attention_mask)
    with torch.inference_mode():
        for stage in stages:
            out = stage(*args)
            args = out if isinstance(out, tuple) else (out,)
    (logits,) = args
    return logits


def test_profiles_cover_every_layer(pushed):
    family, _, _, manifest, _ = pushed
    assert manifest.entry_point == ENTRY_POINT == HF_ENTRY_POINT
    names = [layer.name for layer in manifest.layers]
    assert names[0] == "embeddings" and names[-1] == "head" and len(names) >= 4
    for layer in manifest.layers:
        assert {"bytes", "exec_time_s", "output_bytes"} <= set(layer.profile), layer.name
        assert layer.profile["bytes"] == layer.size_bytes
        assert layer.profile["exec_time_s"] > 0
    # a cut sends hidden states and the mask; after the head only the logits
    assert manifest.layers[0].profile["output_bytes"] > manifest.layers[-1].profile["output_bytes"]


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("texts", [TEXTS, TEXTS[:1], TEXTS[::-1] * 2])
async def test_stages_equal_the_whole_model(pushed, parts, texts):
    family, source, store, manifest, blob = pushed
    input_ids, attention_mask, expected = reference(source, texts)
    stages = []
    for first, last in cuts(len(manifest.layers), parts):
        start, end = byte_range_for_layers(manifest, first, last)
        part = await store.read_verified(manifest.name, "1", start, end)
        skeleton = stage_skeleton(manifest, first, last)
        stages.append(load_stage(manifest, part, first, last, buffer_offset=start,
                                 skeleton=skeleton))
    assert all(isinstance(s, HFStage) for s in stages)
    middle = stages[0](input_ids, attention_mask)
    # hidden states and the mask travel (and GPT-2's last non-padding positions)
    assert isinstance(middle, tuple) and len(middle) == (3 if family == "gpt2" else 2)
    got = run_chain(stages, input_ids, attention_mask)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    whole = load_module(manifest, blob)
    with torch.inference_mode():
        torch.testing.assert_close(whole(input_ids, attention_mask), expected,
                                   atol=1e-4, rtol=1e-4)
    one = load_stage(manifest, blob, 0, len(manifest.layers) - 1)
    torch.testing.assert_close(run_chain([one], input_ids, attention_mask), expected,
                               atol=1e-4, rtol=1e-4)


async def test_every_single_layer_stage_chains(pushed):
    _, source, _, manifest, blob = pushed
    input_ids, attention_mask, expected = reference(source, TEXTS)
    stages = [load_stage(manifest, blob, i, i) for i in range(len(manifest.layers))]
    torch.testing.assert_close(run_chain(stages, input_ids, attention_mask), expected,
                               atol=1e-4, rtol=1e-4)


def test_models_without_an_adapter_serve_whole():
    bert = {"architecture": "BertForSequenceClassification",
            "hf_config": {"model_type": "bert"}}
    assert why_not_staged(HF_ENTRY_POINT, bert) is None
    assert why_not_staged("flashpoint.models.bert:build_empty", {}) is None
    electra = {"architecture": "ElectraForSequenceClassification",
               "hf_config": {"model_type": "electra"}}
    why = why_not_staged(HF_ENTRY_POINT, electra)
    assert why is not None and "serves whole" in why and "electra" in why
    vit = {"architecture": "ViTForImageClassification", "hf_config": {"model_type": "vit"}}
    assert "serves whole" in why_not_staged(HF_ENTRY_POINT, vit)
    decoder = {"architecture": "BertForSequenceClassification",
               "hf_config": {"model_type": "bert", "is_decoder": True}}
    assert "decoder" in why_not_staged(HF_ENTRY_POINT, decoder)


async def test_profiling_a_family_without_an_adapter_is_refused(tmp_path):
    import json

    source = make_text_classifier(tmp_path / "src", family="bert")
    config = json.loads((source / "config.json").read_text())
    config["model_type"], config["architectures"] = "electra", ["ElectraForSequenceClassification"]
    config.setdefault("embedding_size", config["hidden_size"])
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="serves whole"):
        await publish_source(LocalStore(tmp_path / "r"), "e", source,
                             options=PushOptions(profile=True))


def test_skeleton_of_an_unadapted_model_is_a_bad_request(pushed):
    import dataclasses

    _, _, _, manifest, _ = pushed
    other = dataclasses.replace(manifest, config={**manifest.config, "hf_config": {
        **manifest.config["hf_config"], "model_type": "electra"}})
    with pytest.raises(BadRequest, match="serves whole"):
        stage_skeleton(other, 0, 1)


async def test_a_pipeline_of_served_stages_answers_like_a_whole_replica(pushed):
    """Stage servers over the HF stages as a worker builds them (the first tokenizes, the
    last finishes): text in, label / score / logits out, equal to the whole model."""
    import numpy as np

    from flashpoint.models import serving
    from flashpoint.models.publish import read_files
    from flashpoint.models.serving.stage import served_stage
    from flashpoint.pipeline.client import PipelineClient
    from flashpoint.pipeline.stage import StageServer

    family, source, store, manifest, blob = pushed
    n = len(manifest.layers)
    secret = b"s" * 32
    servers: list[StageServer] = []
    try:
        next_hop = None
        for first, last in reversed(cuts(n, 3)):
            start, end = byte_range_for_layers(manifest, first, last)
            stage = load_stage(manifest, blob, first, last)
            module = served_stage(manifest, stage, blob, first=first == 0, last=last == n - 1)
            server = StageServer(module, host="127.0.0.1", port=0, secret=secret,
                                 next_hop=next_hop, stage_id=f"s{first}")
            await server.start()
            servers.append(server)
            next_hop = server.endpoint
        texts = np.array([t.encode() for t in TEXTS], dtype=object)
        async with PipelineClient(next_hop, secret, input_names=["text"]) as client:
            label, score, logits = await client.infer_outputs({"text": texts}, timeout_s=30)
            # the first stage's checks are the whole replica's: typed 400s come back
            too_long = np.array([b"word " * 500], dtype=object)
            with pytest.raises(InputTooLong):
                await client.infer_outputs({"text": too_long}, timeout_s=30)
    finally:
        for server in servers:
            await server.stop()
    whole = load_module(manifest, blob)
    served = serving.for_manifest(manifest, read_files(manifest, blob))
    request = served.prepare({"text": texts})
    with torch.inference_mode():
        out = whole(*(torch.from_numpy(request[k]) for k in served.module_inputs))
    answer = served.finish({"logits": out.numpy()})
    np.testing.assert_allclose(logits, answer["logits"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(score, answer["score"], atol=1e-4, rtol=1e-4)
    assert label.tolist() == answer["label"].tolist()
    assert [o.name for o in manifest.io.outputs] == ["label", "score", "logits"]
