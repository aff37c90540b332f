"""The ``flashpoint`` command line: run a cluster, publish models, deploy, invoke, demo.

``main(argv) -> int`` is the entry point (``python -m flashpoint.cli`` and the ``flashpoint``
console script); every failure ends as one line on stderr (:mod:`flashpoint.cli.failures`).
"""

from __future__ import annotations

from flashpoint.cli.app import _config, keys_env, main
from flashpoint.registry import make_store  # benchmarks build their stores through the CLI's

__all__ = ["_config", "keys_env", "main", "make_store"]
