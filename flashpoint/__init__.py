"""Flashpoint: serverless deep-learning inference on GPU clusters.

``from flashpoint import Client, AsyncClient`` gives the Python clients of the HTTP API
(:mod:`flashpoint.client`); they are imported on first use, so ``import flashpoint`` stays
cheap (no aiohttp, numpy or torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "__version__"]

if TYPE_CHECKING:
    from flashpoint.client import AsyncClient, Client


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client"):
        from flashpoint import client

        return getattr(client, name)
    raise AttributeError(f"module 'flashpoint' has no attribute {name!r}")
