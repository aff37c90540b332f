"""A model whose cold start always fails in the worker: its entry point builds the no-op
model plus one buffer the published blob does not hold, so ``load_module`` refuses it with
RegistryError ("module tensor 'extra' has no weights in the blob"). Imported by worker
processes by its entry point ``tests.cluster.broken_model:build_empty``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from flashpoint.models import noop

ENTRY_POINT = "tests.cluster.broken_model:build_empty"


def build_empty(config: Mapping[str, Any]) -> nn.Module:
    module = noop.build_empty(config)
    with torch.device("meta"):
        module.register_buffer("extra", torch.zeros(4), persistent=False)
    return module
