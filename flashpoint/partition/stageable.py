"""Which model versions can be served in stages (``max_stages > 1``), and why not.

Pure (no torch): the controller asks this before it builds a plan table. A built-in
model's layers chain one tensor each; a Hugging Face model has stages only for the
families :mod:`flashpoint.models.hf_stages` adapts (their stages carry the attention mask
along with the hidden states); any other model serves whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HF_ENTRY_POINT = "flashpoint.models.hf:build_empty"
HF_STAGED_FAMILIES = ("bert", "distilbert", "gpt2", "roberta")
"""``model_type``s with a stage adapter (``*ForSequenceClassification``)."""
HF_STAGED_LM_FAMILIES = ("gpt2", "llama")
"""``model_type``s whose causal language model (``*LMHeadModel``) has a stage adapter:
its pipeline serves a generation's first tokens (recomputed, no KV cache) while the hosts
complete the model."""
LM_ARCHITECTURE_SUFFIXES = ("LMHeadModel", "ForCausalLM")


def hf_why_not_staged(config: Mapping[str, Any]) -> str | None:
    """None when a Hugging Face manifest config (``{"architecture", "hf_config"}``) has a
    stage adapter, else why the model serves whole."""
    architecture = str(config.get("architecture") or "this model")
    raw = config.get("hf_config")
    model_type = raw.get("model_type") if isinstance(raw, Mapping) else None
    if architecture.endswith(LM_ARCHITECTURE_SUFFIXES):  # text generation
        if model_type not in HF_STAGED_LM_FAMILIES:
            return (f"{architecture} (model_type {model_type!r}) has no causal-LM stage "
                    f"adapter, so it serves whole; causal LMs served in stages: "
                    f"{', '.join(HF_STAGED_LM_FAMILIES)}")
        assert isinstance(raw, Mapping)
        if raw.get("add_cross_attention"):
            return f"{architecture} has cross-attention, so it serves whole"
        return None
    if model_type not in HF_STAGED_FAMILIES:
        return (f"{architecture} (model_type {model_type!r}) has no stage adapter, so it "
                f"serves whole; families served in stages: {', '.join(HF_STAGED_FAMILIES)}")
    assert isinstance(raw, Mapping)
    if not architecture.endswith("ForSequenceClassification"):
        return (f"{architecture} has no stage adapter (only *ForSequenceClassification "
                "heads are split), so it serves whole")
    if model_type != "gpt2" and (raw.get("is_decoder") or raw.get("add_cross_attention")):
        return f"{architecture} is configured as a decoder (only encoders are split), so it serves whole"
    if raw.get("add_cross_attention"):
        return f"{architecture} has cross-attention, so it serves whole"
    return None


def why_not_staged(entry_point: str, config: Mapping[str, Any]) -> str | None:
    """None when a model version (its manifest's entry point and config) can run in
    stages, else the reason it serves whole. Profiles are checked separately."""
    if entry_point == HF_ENTRY_POINT:
        return hf_why_not_staged(config)
    return None
