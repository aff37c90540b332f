"""Weights shared between replicas of one model on one GPU (FaST-GShare §3.5), with a ready
flag so no reader ever sees half-written weights.

The first replica of a model on a GPU (or MIG slice) becomes the *exporter*: it loads the
weights onto the device as usual, waits for the copies to finish (``synchronize``), then
publishes CUDA IPC handles of its tensors (torch's CUDA tensor sharing:
``torch.multiprocessing.reductions.reduce_tensor``) and only then raises the slot's ready
flag. Later replicas on the same GPU are *readers*: they wait for the flag (bounded), map
the exporter's tensors (``rebuild_cuda_tensor``: no copy, no new device memory for the
weights) and bind their module to them with ``load_state_dict(assign=True)``.

**The slot** is two files in a host-local directory, per (model version, GPU UUID):
``<key>.hdr`` (a 32-byte header: magic, version, state, owner pid, generation, payload length,
payload CRC32; changed only under ``flock`` on that file) and ``<key>.payload`` (written to
a temporary name and renamed before the header says READY). States: EMPTY → WRITING (an
exporter claimed it; its pid) → READY. A reader acts only on READY and checks the payload's
length and CRC against the header, so a torn or stale payload is never used. An exporter
that died while WRITING (its pid is gone) is replaced: the next claimant takes the slot over
with the next generation. An exporter that fails calls :meth:`WeightSlot.abandon` (back to
EMPTY). All waits are bounded.

**Lifetime.** CUDA IPC memory belongs to the exporter: it must outlive every reader (torch
counts the readers' references and keeps the blocks while they live, but not past the
exporter's exit). The host therefore stops the exporter of a slot last; a reader whose
exporter is gone must be restarted. The CPU variant used by the tests (``export_cpu`` /
``import_cpu``: shared-memory files) follows the same protocol.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from flashpoint.errors import DeadlineExceeded, IntegrityError
from flashpoint.procs import pid_alive

MAGIC = b"FPWS"
VERSION = 1
_HDR = struct.Struct("<4sHHIQII")  # magic, version, state, pid, generation, length, crc32
HEADER_SIZE = 32


class SlotState(IntEnum):
    EMPTY = 0
    WRITING = 1
    READY = 2


class Role(IntEnum):
    EXPORTER = 1
    READER = 2


@dataclass(frozen=True)
class Header:
    state: SlotState
    pid: int
    generation: int
    length: int
    crc: int


def slot_key(model_key: str, gpu_uuid: str) -> str:
    """A file-name-safe key for one model version on one GPU or slice."""
    return hashlib.sha256(f"{model_key}|{gpu_uuid}".encode()).hexdigest()[:32]


class WeightSlot:
    """The ready-flag protocol of one (model, GPU) slot (module docstring)."""

    def __init__(self, directory: str | Path, key: str, *, poll_s: float = 0.01,
                 pid: int | None = None, alive: Callable[[int], bool] = pid_alive) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hdr_path = self.dir / f"{key}.hdr"
        self.payload_path = self.dir / f"{key}.payload"
        self.poll_s = poll_s
        self.pid = pid or os.getpid()
        self._alive = alive
        self.generation = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        fd = os.open(self.hdr_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    @staticmethod
    def _read(fd: int) -> Header:
        raw = os.pread(fd, HEADER_SIZE, 0)
        if len(raw) < _HDR.size:
            return Header(SlotState.EMPTY, 0, 0, 0, 0)
        magic, version, state, pid, gen, length, crc = _HDR.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            return Header(SlotState.EMPTY, 0, 0, 0, 0)  # foreign or old: start over
        return Header(SlotState(state), pid, gen, length, crc)

    @staticmethod
    def _write(fd: int, h: Header) -> None:
        raw = _HDR.pack(MAGIC, VERSION, int(h.state), h.pid, h.generation, h.length, h.crc)
        os.pwrite(fd, raw.ljust(HEADER_SIZE, b"\0"), 0)
        os.fsync(fd)

    def header(self) -> Header:
        with self._locked() as fd:
            return self._read(fd)

    def claim_or_wait(self, timeout_s: float) -> Role:
        """EXPORTER if this process now owns the slot (empty, or its writer died), READER
        once the slot is READY; waits (polling, bounded) while another live writer works."""
        deadline = time.monotonic() + timeout_s
        for _ in range(int(timeout_s / self.poll_s) + 2):  # bounded, beside the deadline
            with self._locked() as fd:
                h = self._read(fd)
                if h.state is SlotState.READY:
                    self.generation = h.generation
                    return Role.READER
                if h.state is SlotState.EMPTY or (h.state is SlotState.WRITING
                                                  and not self._alive(h.pid)):
                    self.generation = h.generation + 1
                    self._write(fd, Header(SlotState.WRITING, self.pid, self.generation, 0, 0))
                    return Role.EXPORTER
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        raise DeadlineExceeded(f"weights slot {self.hdr_path.name}: no READY within "
                               f"{timeout_s} s", slot=str(self.hdr_path))

    def publish(self, payload: bytes) -> None:
        """Exporter: the weights are complete on the device; make them visible. The payload
        lands under its final name before the header says READY."""
        tmp = self.payload_path.with_suffix(f".tmp{self.pid}")
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        with self._locked() as fd:
            h = self._read(fd)
            if h.state is not SlotState.WRITING or h.pid != self.pid or \
                    h.generation != self.generation:
                tmp.unlink(missing_ok=True)
                raise IntegrityError(f"weights slot {self.hdr_path.name} was taken over "
                                     "while this process wrote it")
            os.replace(tmp, self.payload_path)
            self._write(fd, Header(SlotState.READY, self.pid, self.generation, len(payload),
                                   zlib.crc32(payload)))

    def read(self) -> bytes:
        """Reader: the payload of the READY generation, checked against the header."""
        with self._locked() as fd:
            h = self._read(fd)
            if h.state is not SlotState.READY:
                raise IntegrityError(f"weights slot {self.hdr_path.name} is not ready")
            data = self.payload_path.read_bytes()
        if len(data) != h.length or zlib.crc32(data) != h.crc:
            raise IntegrityError(f"weights slot {self.hdr_path.name}: payload does not match "
                                 "its header")
        self.generation = h.generation
        return data

    def abandon(self) -> None:
        """Exporter gave up (load failed): EMPTY again, so the next replica exports."""
        with self._locked() as fd:
            h = self._read(fd)
            if h.pid == self.pid and h.generation == self.generation:
                self._write(fd, Header(SlotState.EMPTY, 0, h.generation, 0, 0))


# ------------------------------------------------------------------ CUDA (torch) path ---

def export_cuda(state: dict[str, Any]) -> bytes:
    """IPC handles of CUDA tensors ``state`` (name -> tensor), after their copies finished.

    Runs on a GPU only (``@pytest.mark.gpu`` tests); the caller keeps ``state`` alive for as
    long as any reader maps it.
    """
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.synchronize()  # the flag must not rise before the bytes are on the device
    out = {}
    for name, t in state.items():
        if not t.is_cuda:
            raise ValueError(f"{name} is not a CUDA tensor")
        out[name] = reduce_tensor(t)
    return pickle.dumps(out)


def import_cuda(payload: bytes) -> dict[str, Any]:
    """Map an exporter's tensors into this process (no copy): name -> CUDA tensor."""
    return {name: fn(*args) for name, (fn, args) in pickle.loads(payload).items()}  # noqa: S301


def share_module_weights(module: Any, slot: WeightSlot, device: str, timeout_s: float,
                         load: Callable[[], Any]) -> tuple[Any, Role]:
    """Get ``module``'s weights onto ``device`` through ``slot``: the exporter calls
    ``load()`` (which returns the module with its weights on the device) and publishes;
    a reader binds ``module`` (built empty) to the exporter's tensors. Returns the module
    and this process's role."""
    role = slot.claim_or_wait(timeout_s)
    if role is Role.EXPORTER:
        try:
            loaded = load()
            slot.publish(export_cuda(dict(loaded.state_dict())))
        except BaseException:
            slot.abandon()
            raise
        return loaded, role
    tensors = import_cuda(slot.read())
    module.load_state_dict(tensors, strict=True, assign=True)
    module.requires_grad_(False)
    module.eval()
    return module.to(device), role


# ------------------------------------------------------- CPU variant (tests, no GPU) ---

def export_cpu(state: dict[str, Any], directory: str | Path) -> bytes:
    """Write tensors into shared-memory files (the CPU stand-in for IPC handles)."""
    import numpy as np

    out = {}
    for name, t in state.items():
        arr = t.detach().cpu().numpy()
        path = Path(directory) / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.bin"
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=arr.dtype, shape=arr.shape)
        mm[...] = arr
        mm.flush()
        out[name] = str(path)
    return pickle.dumps(out)


def import_cpu(payload: bytes) -> dict[str, Any]:
    """Map the exporter's shared-memory tensors (no copy)."""
    import numpy as np
    import torch

    # copy-on-write mappings: reads share the exporter's pages, a stray write stays private
    return {name: torch.from_numpy(np.load(path, mmap_mode="c"))
            for name, path in pickle.loads(payload).items()}  # noqa: S301 - our own files
