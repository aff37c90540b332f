"""A worker applies its replica's GPU environment before it initialises CUDA.

CUDA reads ``CUDA_VISIBLE_DEVICES`` and the ``CUDA_MPS_*`` variables at ``cuInit``; the
hook reads ``FP_HOOK_*`` at the first driver call it intercepts. A warm-pool worker has
imported torch but not touched CUDA, so it takes these from the deploy message and writes
them into its own environment (``os.environ`` assignment calls ``putenv``, so the C side's
``getenv`` sees them) before it moves its module to the device. A worker that had already
initialised CUDA would silently run unbound and unshared: it refuses instead.
See ``flashpoint/gpu/host_sharing.py`` for who builds the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from flashpoint.errors import BadRequest, Conflict

ALLOWED_PREFIXES = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_", "FP_HOOK_")


def torch_cuda_initialized() -> bool:
    """True once torch has created a CUDA context in this process."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_initialized())


def apply_env(env: Mapping[str, str], *,
              cuda_initialized: Callable[[], bool] = torch_cuda_initialized) -> dict[str, str]:
    """Put ``env`` into this process's environment; returns what changed.

    Only CUDA binding, MPS and hook variables are accepted (a deploy must not rewrite
    ``PATH`` or ``LD_PRELOAD``). Raises ``Conflict`` if a value would change after CUDA was
    initialised here, since CUDA would never see it.
    """
    if not isinstance(env, Mapping):
        raise BadRequest("env must be a map of strings")
    changed: dict[str, str] = {}
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise BadRequest("env must be a map of strings")
        if not k.startswith(ALLOWED_PREFIXES):
            raise BadRequest(f"env variable {k!r} is not a GPU binding or sharing variable")
        if os.environ.get(k) != v:
            changed[k] = v
    if changed and cuda_initialized():
        raise Conflict("CUDA is already initialised in this worker; its GPU environment "
                       f"({sorted(changed)}) would be ignored", variables=sorted(changed))
    os.environ.update(changed)
    return changed
