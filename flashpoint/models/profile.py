"""The layer profiler: what the partition solver needs to know about each layer (seed 004, §4.2).

For every layer of a layered model, :func:`profile_layers` measures

* ``bytes`` — the layer's weight bytes: its byte range in the blob (``byte_end -
  byte_start`` of the manifest layer, alignment padding included, so the bytes of a stage
  are exactly what a host fetches for it);
* ``exec_time_s`` — the median time of one forward of the layer on the example batch, on
  the device it will run on (CUDA is synchronised around every timed call);
* ``output_bytes`` — the size of the layer's output tensor(s) for the example batch: what a
  cut after this layer sends to the next part.

These are the keys :meth:`flashpoint.partition.model.LayerProfile.from_manifest` reads, and
:func:`flashpoint.models.publish.publish` (``profile=True``) writes them into the manifest's
``LayerInfo.profile`` before the manifest is published (manifests are immutable per
version). Layers run exactly as :func:`~flashpoint.models.publish.load_stage` chains them:
the submodules named by ``module.layer_names()`` in order, each taking the previous one's
output, the first taking the model's single input tensor.

Cold start is not measured per layer: it is derived from the bytes and the bandwidth of the
tier the bytes come from (:func:`cold_start_s`, the same formula as
:meth:`~flashpoint.partition.model.CostModel.cold_s`). :func:`measure_tiers` measures the
host's own-RAM tier and takes the network tiers (peer, registry) as arguments: they belong
to the cluster, not the model, so they are not written into the manifest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from flashpoint.errors import BadRequest
from flashpoint.registry.manifest import BlobLayout, LayerInfo, Manifest

PROFILE_KEYS = ("bytes", "exec_time_s", "output_bytes")

# The thesis's measured network rates (seed 004 §8, testbed T3), used when the caller has
# no measurement of its own: host to host 7,506.89 Mbps, S3 in the same region 2,203 Mbps.
THESIS_PEER_BPS = 7_506.89e6
THESIS_REGISTRY_BPS = 2_203e6
DEFAULT_TIER_PROBE_BYTES = 256 * 1024 * 1024


# --------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------


def layer_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers in execution order, as ``(name, submodule)``; ``nn.Sequential`` of the
    submodules is what :func:`~flashpoint.models.publish.load_stage` builds.

    Names are ``module.layer_names()`` when it has one (the built-ins: ``layers.0``, ...),
    else its top-level children (as :func:`~flashpoint.models.publish.module_layers`).
    """
    if hasattr(module, "layer_names"):
        names = list(module.layer_names())
    else:
        names = [n for n, _ in module.named_children()]
    if not names:
        raise BadRequest("the module has no layers to profile")
    return [(n, module.get_submodule(n)) for n in names]


def output_nbytes(output: Any) -> int:
    """Bytes of the tensors in a layer's output (a tensor, or tuples, lists, dicts of them)."""
    if isinstance(output, torch.Tensor):
        return output.nelement() * output.element_size()
    if isinstance(output, (tuple, list)):
        return sum(output_nbytes(o) for o in output)
    if isinstance(output, Mapping):
        return sum(output_nbytes(o) for o in output.values())
    return 0


def as_input_tensor(example_inputs: Any, device: torch.device) -> torch.Tensor:
    """The first layer's input: a tensor, an array, or a one-entry mapping of either
    (what :func:`flashpoint.models.zoo.example_inputs` returns)."""
    x = example_inputs
    if isinstance(x, Mapping):
        if len(x) != 1:
            raise BadRequest(f"a layered model takes one input tensor, got {sorted(x)}")
        (x,) = x.values()
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise BadRequest(f"example inputs must be a tensor or an array, got {type(x).__name__}")
    return x.to(device)


def _layer_bytes(
    names: Sequence[str], layers: Sequence[nn.Module], layout: Manifest | BlobLayout | None
) -> list[int]:
    if layout is None:  # no blob yet: the tensors' own bytes, without alignment padding
        return [sum(t.nelement() * t.element_size() for t in layer.state_dict().values())
                for layer in layers]
    infos: Sequence[LayerInfo] = layout.layers
    if [info.name for info in infos] != list(names):
        raise BadRequest(f"layout layers {[i.name for i in infos]} differ from the module's "
                         f"{list(names)}")
    return [info.size_bytes for info in infos]


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def profile_layers(
    module: nn.Module,
    example_inputs: Any,
    device: str | torch.device = "cpu",
    *,
    repeats: int = 5,
    warmup: int = 2,
    layout: Manifest | BlobLayout | None = None,
) -> dict[str, dict[str, float]]:
    """Per layer: ``{"bytes", "exec_time_s", "output_bytes"}``, keyed by layer name.

    The module is moved to ``device`` (in place, as ``nn.Module.to``) and run in inference
    mode, layer by layer: each layer runs ``warmup`` untimed then ``repeats`` timed times on
    the previous layer's output, and ``exec_time_s`` is the median of the timed runs.
    ``example_inputs`` is the batch the times and output sizes are for. ``bytes`` come
    from ``layout`` (the manifest or the blob layout of this module) when given, else from
    the layer's tensors without alignment padding. CPU times use torch's current intra-op
    thread count.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BadRequest("repeats must be a positive integer")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise BadRequest("warmup must be a non-negative integer")
    dev = torch.device(device)
    named = layer_modules(module)
    names = [n for n, _ in named]
    sizes = _layer_bytes(names, [m for _, m in named], layout)
    module.to(dev)
    module.eval()
    with torch.inference_mode():
        x = as_input_tensor(example_inputs, dev)
    return profile_callables(named, sizes, (x,), dev, repeats=repeats, warmup=warmup)


def profile_callables(
    layers: Sequence[tuple[str, Callable[..., Any]]],
    sizes: Sequence[int],
    inputs: Sequence[Any],
    device: str | torch.device = "cpu",
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> dict[str, dict[str, float]]:
    """:func:`profile_layers`' measurement over layers that are any callables (already on
    ``device``): the first is called with ``*inputs``, each next one with the previous
    one's outputs (a tuple is spread into arguments, as a pipeline stage's tensors are).
    ``sizes`` are the layers' ``bytes``."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BadRequest("repeats must be a positive integer")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise BadRequest("warmup must be a non-negative integer")
    dev = torch.device(device)
    sync = _synchronizer(dev)
    clock = time.perf_counter
    profiles: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        args: tuple[Any, ...] = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a
                                      for a in inputs)
        for (name, layer), size in zip(layers, sizes, strict=True):
            for _ in range(warmup):
                layer(*args)
            sync()
            times = []
            for _ in range(repeats):
                start = clock()
                y = layer(*args)
                sync()
                times.append(clock() - start)
            profiles[name] = {"bytes": int(size), "exec_time_s": statistics.median(times),
                              "output_bytes": output_nbytes(y)}
            args = tuple(y) if isinstance(y, (tuple, list)) else (y,)
    return profiles


# --------------------------------------------------------------------------------------
# Source tiers and cold starts
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierBandwidths:
    """Bandwidth (bits/s) of each place a host can get a model's bytes from.

    * ``local_bps`` — its own RAM cache (measured: :func:`measure_tiers`);
    * ``peer_bps`` — another host's RAM over the network (a chain or a peer pull);
    * ``registry_bps`` — the model registry.

    :attr:`worst_bps` is the non-local worst case the solver plans with (§4.2.2): pass it
    as :class:`~flashpoint.partition.model.CostModel`'s ``bandwidth_bps``.
    """

    local_bps: float
    peer_bps: float
    registry_bps: float

    def __post_init__(self) -> None:
        if not (self.local_bps > 0 and self.peer_bps > 0 and self.registry_bps > 0):
            raise BadRequest("tier bandwidths must be > 0")

    @property
    def worst_bps(self) -> float:
        return min(self.peer_bps, self.registry_bps)

    def as_dict(self) -> dict[str, float]:
        """By source name, as cold starts report them (``local``, ``peer``, ``registry``)."""
        return {"local": self.local_bps, "peer": self.peer_bps, "registry": self.registry_bps}


def measure_copy_bps(
    device: str | torch.device = "cpu", *, size_bytes: int = DEFAULT_TIER_PROBE_BYTES,
    repeats: int = 3,
) -> float:
    """Median bandwidth (bits/s) of copying ``size_bytes`` out of host RAM toward ``device``.

    On CPU, a memcpy between two buffers touched beforehand (page faults excluded); on
    CUDA, a copy from pageable host memory to the device, as ``module.to(device)`` does.
    """
    if size_bytes < 1 or repeats < 1:
        raise BadRequest("size_bytes and repeats must be positive")
    dev = torch.device(device)
    src = torch.ones(size_bytes, dtype=torch.uint8)
    dest = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    dest.fill_(0)  # first touch, outside the timing
    sync = _synchronizer(dev)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dest.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return size_bytes * 8 / max(statistics.median(times), 1e-9)


def measure_tiers(
    device: str | torch.device = "cpu",
    *,
    peer_bps: float = THESIS_PEER_BPS,
    registry_bps: float = THESIS_REGISTRY_BPS,
    size_bytes: int = DEFAULT_TIER_PROBE_BYTES,
    repeats: int = 3,
) -> TierBandwidths:
    """The source tiers' bandwidths: own RAM measured here (:func:`measure_copy_bps`).

    Peer and registry rates are network properties of the cluster, not of this process:
    pass what was measured between the hosts and to the registry (e.g. by the transfer
    benchmarks); the defaults are the thesis's figures (seed 004 §8: 7.5 Gbps host to
    host, 2.2 Gbps from S3), not measurements of this cluster.
    """
    local = measure_copy_bps(device, size_bytes=size_bytes, repeats=repeats)
    return TierBandwidths(local_bps=local, peer_bps=float(peer_bps),
                          registry_bps=float(registry_bps))


def cold_start_s(layer_bytes: int, tier_bps: float, overhead_s: float = 0.0) -> float:
    """``bytes * 8 / tier_bps + overhead_s``: one layer's (or part's) cold start from a tier,
    as :meth:`~flashpoint.partition.model.CostModel.cold_s` computes it."""
    if layer_bytes < 0 or not tier_bps > 0 or overhead_s < 0:
        raise BadRequest("need layer_bytes >= 0, tier_bps > 0 and overhead_s >= 0")
    return layer_bytes * 8 / tier_bps + overhead_s


def cold_starts(
    profiles: Mapping[str, Mapping[str, float]], tiers: TierBandwidths, overhead_s: float = 0.0
) -> dict[str, dict[str, float]]:
    """Per layer and per source tier, the cold start in seconds of the layer's ``bytes``."""
    return {
        name: {tier: cold_start_s(int(p["bytes"]), bps, overhead_s)
               for tier, bps in tiers.as_dict().items()}
        for name, p in profiles.items()
    }
