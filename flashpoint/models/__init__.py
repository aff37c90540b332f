"""Built-in models (BERT-like, ResNet-like, no-op) and publishing/loading them.

Every model is a :class:`~flashpoint.models.base.LayeredModel`: ``forward`` runs
``model.layers`` in order, so contiguous layers form pipeline stages.
"""

from flashpoint.models.base import LayeredModel
from flashpoint.models.publish import (
    load_module,
    load_stage,
    module_layers,
    publish_module,
    resolve_entry_point,
    write_module_blob,
)
from flashpoint.models.sources import publish  # after .publish: the name is the function
from flashpoint.models.zoo import (
    MODELS,
    PRESET_NAMES,
    ModelDef,
    build,
    build_empty,
    example_inputs,
    io_signature,
    param_bytes,
    resolve_config,
    run_example,
)

__all__ = [
    "MODELS",
    "PRESET_NAMES",
    "LayeredModel",
    "ModelDef",
    "build",
    "build_empty",
    "example_inputs",
    "io_signature",
    "load_module",
    "load_stage",
    "module_layers",
    "param_bytes",
    "publish",
    "publish_module",
    "resolve_config",
    "resolve_entry_point",
    "run_example",
    "write_module_blob",
]
