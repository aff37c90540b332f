"""The built-in models (``bert | resnet | noop``) as one source format among the others:
``flashpoint model push bert --preset small``. Synthetic weights from a seed."""

from __future__ import annotations

from pathlib import Path

from flashpoint.models import zoo
from flashpoint.models.sources.base import Prepared, PushOptions


class BuiltIn:
    """The ``zoo`` format: the source is a built-in model's name, not a path."""

    name = "zoo"

    def matches(self, source: Path) -> bool:
        return str(source) in zoo.MODELS and not source.exists()

    def prepare(self, source: Path, options: PushOptions) -> Prepared:
        model = zoo.get(str(source))
        config = model.resolve(dict(options.extra) if options.extra else options.preset)
        profiler = None
        if options.profile:
            from flashpoint.models.profile import profile_layers

            inputs = zoo.example_inputs(model.name, config, batch=options.profile_batch)

            def profiler(module, layout):  # type: ignore[no-untyped-def]
                return profile_layers(module, inputs, options.profile_device, layout=layout)

        return Prepared(
            build=lambda: model.build_from_config(config, seed=options.seed),
            entry_point=model.entry_point, config=config,
            io=zoo.io_signature(model.name, config), profiler=profiler,
        )
