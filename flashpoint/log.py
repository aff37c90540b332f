"""Structured logging (structlog, JSON lines) with causality ids bound per context.

Bind ``request_id`` / ``transfer_id`` with :func:`bind_ids`; every log line in that asyncio
context carries them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure(level: str = "INFO", json: bool = True, stream: Any = None, *,
              if_unset: bool = False) -> None:
    """Configure structlog once per process; later calls only change the level
    (``if_unset``: not even that — for libraries that must not override the CLI)."""
    global _configured
    if if_unset and _configured:
        return
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, stream=stream or sys.stderr, format="%(message)s")
    logging.getLogger().setLevel(lvl)
    if _configured:
        return
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str, **bound: Any) -> Any:
    """A structlog logger named for its module, with optional bound fields."""
    # Without bound fields, return structlog's lazy proxy: binding at import time would
    # freeze structlog's defaults (stdout, every level) before configure() runs.
    logger = structlog.get_logger(name)
    return logger.bind(**bound) if bound else logger


def bind_ids(**ids: Any) -> None:
    """Bind causality ids (request_id, transfer_id, replica_id) to the current context."""
    structlog.contextvars.bind_contextvars(**ids)


def clear_ids(*names: str) -> None:
    structlog.contextvars.unbind_contextvars(*names)
