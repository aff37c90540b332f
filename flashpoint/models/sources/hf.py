"""A Hugging Face model directory: ``config.json``, weights (``*.safetensors`` or
``pytorch_model.bin``), and the tokenizer or image-processor files.

Loaded with ``transformers`` from local files only, never the hub. The weights must cover
the model: ``from_pretrained`` would fill missing ones with random values and serve
nonsense, so a missing weight is refused here, naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from flashpoint.errors import BadRequest, UnsupportedModel
from flashpoint.models import hf
from flashpoint.models.sources.base import Prepared, PushOptions, carried_files, read_file
from flashpoint.registry.manifest import IoSignature
from flashpoint.spec import TensorSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ckpt")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class HuggingFaceDirectory:
    """The ``hf`` format (see the module docstring)."""

    name = "hf"

    def matches(self, source: Path) -> bool:
        return source.is_dir() and (source / "config.json").is_file()

    def prepare(self, source: Path, options: PushOptions) -> Prepared:
        config_path = source / "config.json"
        try:
            raw = json.loads(read_file(config_path, "the model's config"))
        except ValueError as e:
            raise UnsupportedModel(f"{config_path}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise UnsupportedModel(f"{config_path}: must hold a JSON object")
        if "auto_map" in raw:
            why = ("an admin must push it with --trust-code" if not options.trust_code else
                   "custom modelling code in a Hugging Face directory is not loaded; wrap it "
                   "in a handler bundle (--format handler --trust-code)")
            raise UnsupportedModel(f"{config_path}: names custom code (auto_map): {why}")
        archs = raw.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise UnsupportedModel(f"{config_path}: needs 'architectures' naming the model class "
                                   "(e.g. BertForSequenceClassification)")
        architecture = archs[0]
        try:
            task = hf.task_of(architecture)
            hf.model_class(architecture)
            cfg = hf.hf_config(raw)
        except BadRequest as e:
            raise UnsupportedModel(f"{config_path}: {e.message}") from None
        if not any((source / f).is_file() for f in WEIGHT_FILES) and not list(
                source.glob("*.safetensors")):
            raise UnsupportedModel(f"{source}: no weights (expected model.safetensors or "
                                   "pytorch_model.bin)")
        files = carried_files(source, skip=lambda p: p.name.endswith(WEIGHT_SUFFIXES)
                              or p.name.endswith(".index.json"))
        num_labels = int(cfg.num_labels)
        config: dict[str, Any] = {"architecture": architecture, "hf_config": raw,
                                  "num_labels": num_labels}
        if task == "text-generation":
            tokenizer = hf.check_tokenizer(source)
            from flashpoint.models.serving.text import max_length

            config.update(max_length=max_length(raw, tokenizer))
            # Its request tensors are optional or alternatives (text or messages, sampling
            # settings; serving/generation.py): no fixed input signature to enforce.
            io = IoSignature((), (
                TensorSpec("text", "BYTES", (1,)),
                TensorSpec("token_ids", "INT64", (-1,)),
                TensorSpec("finish_reason", "BYTES", (1,)),
                TensorSpec("prompt_tokens", "INT64", (1,)),
                TensorSpec("completion_tokens", "INT64", (1,)),
            ))
            return Prepared(
                build=lambda: _load(source, architecture), entry_point=hf.ENTRY_POINT,
                config=config, io=io, task=task, files=files, layer_plan=hf.layer_plan,
                profiler=_profiler(source, config, options) if options.profile else None,
            )
        if task == "text-classification":
            tokenizer = hf.check_tokenizer(source)
            from flashpoint.models.serving.text import DEFAULT_TOP_K, max_length

            config.update(truncate=options.truncate, max_length=max_length(raw, tokenizer),
                          top_k=options.top_k or DEFAULT_TOP_K)
            inputs = (TensorSpec("text", "BYTES", (-1,)),)
        else:
            from flashpoint.models.serving.image import check_image_processor

            config.update(check_image_processor(source, files),
                          top_k=options.top_k or 5)
            inputs = (TensorSpec("image", "BYTES", (-1,)),)
        io = IoSignature(inputs, (
            TensorSpec("label", "BYTES", (-1, -1)),
            TensorSpec("score", "FP32", (-1, -1)),
            TensorSpec("logits", "FP32", (-1, num_labels)),
        ))
        return Prepared(
            build=lambda: _load(source, architecture), entry_point=hf.ENTRY_POINT,
            config=config, io=io, task=task, files=files, layer_plan=hf.layer_plan,
            profiler=_profiler(source, config, options) if options.profile else None,
        )


def _profiler(source: Path, config: dict[str, Any], options: PushOptions) -> Any:
    """Per-layer profiles of a family with a stage adapter, measured on its own stages
    (:mod:`flashpoint.models.hf_stages`); UnsupportedModel for any other (it serves whole,
    so a profile would only invite ``max_stages > 1``)."""
    from flashpoint.models import hf_stages

    why = hf_stages.why_not_staged(config)
    if why is not None:
        raise UnsupportedModel(f"{source}: cannot be profiled for partitioning: {why}")
    inputs = hf_stages.example_inputs(source, config, batch=options.profile_batch)

    def profiler(module: nn.Module, layout: Any) -> Any:
        return hf_stages.profile_stages(module, config, layout, inputs, options.profile_device)

    return profiler


def _load(source: Path, architecture: str) -> nn.Module:
    """The model with its weights, wrapped; UnsupportedModel for missing weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # flashpoint model push draws its own
    cls = hf.model_class(architecture)
    try:
        model, info = cls.from_pretrained(str(source), local_files_only=True,
                                          output_loading_info=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModel(f"{source}: the weights do not load: {first}"[:400]) from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise UnsupportedModel(f"{source}: the weights miss {shown} (a checkpoint of another "
                               f"architecture than {architecture}?)")
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        raise UnsupportedModel(f"{source}: weights of the wrong shape for {architecture}: "
                               f"{mismatched[0]}")
    model.eval()
    task = hf.task_of(architecture)
    return hf._WRAPPERS[task](model)
