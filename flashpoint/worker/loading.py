"""Building a worker's module from the host's cache: the blocking half of a cold start.

Every function here runs on a thread of the worker process (torch, mmap, file reads), never
on its event loop; ``worker/actor.py`` calls them and feeds the outcome to
:class:`~flashpoint.worker.state.WorkerState`.

The model's bytes are the host's cache file mapped MAP_PRIVATE: the module's tensors are
views over it (no copy), and a stage built over a cache file that is still filling sees the
bytes the host writes later (pages this process never wrote are the page cache's), which is
what lets :func:`build_whole` complete a stage into a whole replica over the same mapping.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashpoint.log import get_logger
from flashpoint.messages.host_worker import LoadReplica, WeightSlot
from flashpoint.spec import FunctionSpec

log = get_logger("flashpoint.worker")


@dataclass
class LoadedReplica:
    """A module this worker serves, and how requests become its inputs."""

    replica_id: str
    spec: FunctionSpec
    module: Any
    device: str
    input_names: list[str]
    output_names: list[str]
    mapping: mmap.mmap
    manifest: Any = None  # the model's Manifest (a stage builds the whole module from it)
    stage: Any = None  # [first, last] while this is a partition stage; None once whole
    # How requests become module inputs and outputs answers (models/serving); None for a stage.
    served: Any = None
    request_inputs: tuple[str, ...] = ()  # what a request must carry (the manifest's io)


@dataclass(frozen=True)
class Loaded:
    """What :func:`load` built: the replica, its phases and its weights role."""

    replica: LoadedReplica
    timings_s: dict[str, float]
    weights_role: str = ""  # "exporter" / "reader" when its weights are shared by IPC
    loaded_s: float = 0.0  # perf_counter when it was loaded and warmed


def load(msg: LoadReplica, spec: FunctionSpec, received_s: float) -> Loaded:
    """Map the cache file, build the module (whole, or the stage's layers) over it, move it
    to the device and, for a whole replica, run its first inference."""
    import torch

    from flashpoint.models.publish import builder_takes_files, load_module
    from flashpoint.registry.format import Manifest

    t0 = time.perf_counter()
    prepare = {"worker_prepare": t0 - received_s}
    manifest = Manifest.from_json(msg.manifest_json)
    # O_NOFOLLOW: the host's private cache directory holds files, never symlinks.
    fd = os.open(msg.cache_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # MAP_PRIVATE: zero-copy views; a stray write copies a page instead of corrupting
        # the bytes every other worker on this host shares.
        mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    stage = msg.stage
    module = None
    if stage is not None:
        # A partition stage (execute-while-load): only its own layers' bytes need to be
        # in the cache yet; the host has waited for exactly that range.
        from flashpoint.models.publish import load_stage
        from flashpoint.models.serving.stage import served_stage
        from flashpoint.registry.manifest import layer_range

        module = load_stage(manifest, memoryview(mapping), stage[0], stage[1], device="cpu")
        i, j = layer_range(manifest, stage[0], stage[1])
        module = served_stage(manifest, module, memoryview(mapping), first=i == 0,
                              last=j == len(manifest.layers) - 1)
    device = msg.device
    role = ""
    if (module is None and device.startswith("cuda") and msg.weight_slot is not None
            and not builder_takes_files(manifest)):  # an archive's module needs its files
        # FaST-style weight sharing: the first replica on this GPU exports its weights,
        # later ones map them (CUDA IPC) once the slot's ready flag is up.
        module, role = _shared_weights(manifest, mapping, device, msg.weight_slot)
        t1 = time.perf_counter()
    else:
        if module is None:
            module = load_module(manifest, memoryview(mapping), device="cpu")
        t1 = time.perf_counter()
        if device.startswith("cuda"):
            module = module.to(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    if stage is not None:
        # A stage's input is the previous stage's activation; there is no example of it
        # here, so it is warmed by its first real request instead.
        rep = LoadedReplica(msg.replica_id, spec, module, device, ["activation"],
                            ["activation"], mapping, manifest, list(stage))
        return Loaded(rep, {**prepare, "load": t1 - t0, "to_device": t2 - t1,
                            "first_inference": 0.0}, role, t2)
    rep = whole_replica(msg.replica_id, spec, module, device, mapping, manifest)
    warm_up(rep)
    t3 = time.perf_counter()
    if role:
        log.info("weights_shared", role=role)
    return Loaded(rep, {**prepare, "load": t1 - t0, "to_device": t2 - t1,
                        "first_inference": t3 - t2}, role, t3)


def build_whole(rep: LoadedReplica) -> tuple[LoadedReplica, dict[str, float]]:
    """Model completion: the whole module over the mapping the stage ``rep`` holds, warmed."""
    import torch

    from flashpoint.models.publish import load_module

    t0 = time.perf_counter()
    module = load_module(rep.manifest, memoryview(rep.mapping), device="cpu")
    t1 = time.perf_counter()
    if rep.device.startswith("cuda"):
        module = module.to(rep.device)
        torch.cuda.synchronize(rep.device)
    t2 = time.perf_counter()
    whole = whole_replica(rep.replica_id, rep.spec, module, rep.device, rep.mapping,
                          rep.manifest)
    warm_up(whole)
    return whole, {"complete_load": t1 - t0, "complete_to_device": t2 - t1,
                   "complete_first_inference": time.perf_counter() - t2}


def _shared_weights(manifest: Any, mapping: mmap.mmap, device: str,
                    slot: WeightSlot) -> tuple[Any, str]:
    """The module with weights exported to, or mapped from, the host's slot for this
    model on this GPU (gpu/weight_share.py); returns it and this worker's role."""
    from flashpoint.gpu.weight_share import WeightSlot as Slot
    from flashpoint.gpu.weight_share import share_module_weights
    from flashpoint.models.publish import empty_module, load_module

    module, role = share_module_weights(
        empty_module(manifest), Slot(slot.dir, slot.key), device, slot.timeout_s,
        lambda: load_module(manifest, memoryview(mapping), device=device))
    return module, role.name.lower()


def warm_up(rep: LoadedReplica) -> None:
    """The replica's first inference, on its serving task's own valid request."""
    served = rep.served
    if getattr(served, "generates", False):  # one forward pass, no sequence
        run_batch(served.warmup_module_inputs(), rep)
        return
    run_batch(served.prepare(served.warmup_request()), rep)


def run_batch(inputs: dict[str, np.ndarray], rep: LoadedReplica) -> dict[str, np.ndarray]:
    """One forward pass of ``rep``'s module over a batch of module inputs."""
    import torch

    args = []
    for name in rep.input_names:
        arr = inputs[name]
        if not arr.flags.writeable:  # frombuffer over wire bytes; torch wants writable
            arr = arr.copy()
        t = torch.from_numpy(np.ascontiguousarray(arr))
        args.append(t.to(rep.device) if rep.device != "cpu" else t)
    with torch.inference_mode():
        out = rep.module(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return {n: o.detach().cpu().numpy() for n, o in zip(rep.output_names, outs, strict=False)}


def whole_replica(replica_id: str, spec: FunctionSpec, module: Any, device: str,
                  mapping: mmap.mmap, manifest: Any) -> LoadedReplica:
    """A whole replica with its serving task, built from the files its model carries."""
    from flashpoint.models import serving
    from flashpoint.models.publish import read_files

    served = serving.for_manifest(manifest, read_files(manifest, memoryview(mapping)))
    required = getattr(served, "required_inputs", None)  # text generation: text or messages
    return LoadedReplica(replica_id, spec, module, device, list(served.module_inputs),
                         list(served.module_outputs), mapping, manifest, None, served,
                         tuple(t.name for t in manifest.io.inputs) if required is None
                         else tuple(required))


def preload_transformers() -> None:
    """Import what a Hugging Face model's cold start needs (tokenizers, image processors,
    the common model families), so that it is not paid by the first request; absent
    transformers, nothing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a worker never downloads
    try:
        import transformers
        from transformers import AutoImageProcessor, AutoTokenizer  # noqa: F401
    except ImportError:
        return
    for cls in ("BertForSequenceClassification", "GPT2LMHeadModel", "LlamaForCausalLM",
                "RobertaForSequenceClassification",
                "DistilBertForSequenceClassification", "ViTForImageClassification",
                "ResNetForImageClassification", "ViTImageProcessorPil",
                "ConvNextImageProcessorPil"):
        getattr(transformers, cls, None)  # lazy modules: attribute access imports them
