"""The weights prefault: it maps a cache file's pages (the kernel's own accounting in
/proc/self/smaps says so), stops when asked, never raises, and leaves no thread behind a
load."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flashpoint.worker import prefault
from flashpoint.worker.prefault import Prefault, populate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="MADV_POPULATE_READ and /proc/self/smaps are Linux's")

SIZE = 6 * (1 << 20) + 3 * mmap.PAGESIZE + 100  # not a multiple of the chunk or the page


def _mapped(path: Path, size: int) -> mmap.mmap:
    path.write_bytes(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:  # as the worker maps the host's cache file
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _rss_bytes(m: mmap.mmap) -> int:
    """The kernel's count of ``m``'s resident (page-table-mapped) bytes in this process."""
    anchor = ctypes.c_char.from_buffer(m)
    start = ctypes.addressof(anchor)
    del anchor
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        lo = line.split("-", 1)[0]
        if " " not in lo and int(lo, 16) == start:
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError("mapping not found in /proc/self/smaps")


def _supported(tmp_path: Path) -> bool:
    m = _mapped(tmp_path / "probe", mmap.PAGESIZE)
    try:
        return populate(m) == mmap.PAGESIZE
    finally:
        m.close()


@pytest.fixture
def mapping(tmp_path: Path):
    if not _supported(tmp_path):
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    m = _mapped(tmp_path / "blob", SIZE)
    yield m
    m.close()


def _pages(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def test_populate_maps_every_page_without_copying(mapping: mmap.mmap) -> None:
    assert _rss_bytes(mapping) == 0  # nothing touched yet
    assert populate(mapping, chunk_bytes=1 << 20) == SIZE
    assert _rss_bytes(mapping) == _pages(SIZE)
    # Read-only mappings of the file's pages: the bytes are the file's.
    assert bytes(mapping[:64]) == np.random.default_rng(0).integers(
        0, 255, SIZE, dtype=np.uint8).tobytes()[:64]


def test_populate_goes_from_the_end_and_stops_when_asked(mapping: mmap.mmap) -> None:
    stop = threading.Event()
    stop.set()
    assert populate(mapping, stop) == 0
    assert _rss_bytes(mapping) == 0

    calls = 0
    real = prefault._libc_madvise()

    def once(addr: int, length: int, advice: int) -> int:  # stop after the first chunk
        nonlocal calls
        calls += 1
        stop.set()
        return real(addr, length, advice)

    stop.clear()
    prefault._madvise = once
    try:
        done = populate(mapping, stop, chunk_bytes=1 << 20)
    finally:
        prefault._madvise = real
    assert calls == 1
    assert done == SIZE - (SIZE // (1 << 20)) * (1 << 20)  # the tail, up to a chunk boundary
    assert _rss_bytes(mapping) == _pages(done)  # only the last pages: the end came first


def test_populate_gives_up_quietly_when_the_kernel_refuses(tmp_path: Path,
                                                         mapping: mmap.mmap) -> None:
    (tmp_path / "blob").write_bytes(b"")  # the file shrank under the mapping: EFAULT
    assert populate(mapping) == 0
    with pytest.raises(ValueError):
        populate(mapping, chunk_bytes=1000)


def test_prefault_thread_stops_promptly(mapping: mmap.mmap) -> None:
    p = Prefault(mapping, chunk_bytes=1 << 20).start()
    t = time.monotonic()
    p.stop(timeout_s=10.0)
    assert time.monotonic() - t < 10.0
    assert not any(th.name == "fp-prefault" for th in threading.enumerate())
    assert p.populated_bytes <= SIZE


async def test_a_load_answers_as_torch_and_leaves_no_prefault_thread(tmp_path: Path) -> None:
    from flashpoint.messages.host_worker import LoadReplica
    from flashpoint.models import zoo
    from flashpoint.models.sources import publish
    from flashpoint.registry.local import LocalStore
    from flashpoint.spec import FunctionSpec
    from flashpoint.worker import loading

    store = LocalStore(tmp_path / "registry")
    manifest = await publish(store, "bert", "tiny", "1", model_name="b")
    spec = FunctionSpec(name="f", model="b")
    msg = LoadReplica(replica_id="r1", manifest_json=manifest.to_json(), device="cpu",
                      cache_path=str(store.blob_path("b", "1")), spec=spec.to_dict(),
                      controller_url="ws://127.0.0.1:1/rpc")
    loaded = loading.load(msg, spec, time.perf_counter(), prefault=True)
    assert not any(th.name == "fp-prefault" for th in threading.enumerate())
    assert _rss_bytes(loaded.replica.mapping) >= manifest.blob_size // 2  # mapped, not copied
    ids = np.arange(1, 17, dtype=np.int64).reshape(2, 8) % 50
    reference, _ = zoo.build("bert", "tiny")
    with torch.inference_mode():
        expected = reference.eval()(torch.from_numpy(ids)).numpy()
    got = loading.run_batch({"input_ids": ids}, loaded.replica)["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
