"""load_module(copy=True): one bulk copy into private memory, same module as zero-copy."""

from __future__ import annotations

import dataclasses
import mmap
import threading
import warnings

import pytest
import torch

from flashpoint.errors import RegistryError
from flashpoint.models import build, example_inputs, load_module, publish, run_example
from flashpoint.registry import LocalStore


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "registry")


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fp-bulk-copy"]


@pytest.mark.parametrize("name", ["bert", "resnet"])
async def test_copy_owns_its_weights_and_matches_zero_copy(store, name):
    manifest = await publish(store, name, "tiny")
    blob = bytearray(await store.read_range(manifest.name, "1", 0, manifest.blob_size))
    original, config = build(name, "tiny")
    inputs = example_inputs(name, config, batch=2)
    expected = run_example(original, inputs)

    module = load_module(manifest, blob, copy=True)
    assert not module.training
    state = module.state_dict()
    assert list(state) == list(original.state_dict())
    lo = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    for key, t in state.items():
        assert not lo <= t.data_ptr() < lo + len(blob), key  # not a view of the buffer
        assert not t.requires_grad and t.data_ptr() % 64 == 0, key
        assert torch.equal(t, original.state_dict()[key]), key
    blob[manifest.data_offset:] = bytes(len(blob) - manifest.data_offset)  # the cache goes away
    assert torch.equal(run_example(module, inputs), expected)
    assert not _copy_threads()


async def test_copy_from_read_only_mmap_and_offset_buffer(store):
    manifest = await publish(store, "bert", "tiny")
    original, config = build("bert", "tiny")
    inputs = example_inputs("bert", config, 2)
    with open(store.blob_path(manifest.name, "1"), "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = load_module(manifest, mapped, copy=True)
    mapped.close()  # the module holds no export of the mapping
    assert torch.equal(run_example(module, inputs), run_example(original, inputs))
    # A buffer holding the blob from data_offset on, as load_module's buffer_offset allows.
    with open(store.blob_path(manifest.name, "1"), "rb") as f:
        tail = f.read()[manifest.data_offset:]
    module = load_module(manifest, tail, copy=True, buffer_offset=manifest.data_offset)
    assert torch.equal(run_example(module, inputs), run_example(original, inputs))


async def test_copy_failure_leaves_no_thread(store):
    manifest = await publish(store, "noop", "tiny")
    blob = await store.read_range(manifest.name, "1", 0, manifest.blob_size)
    wrong = dataclasses.replace(manifest, entry_point="flashpoint.models.bert:build_empty",
                                config=build("bert", "tiny")[1])
    with pytest.raises(RegistryError):
        load_module(wrong, blob, copy=True)
    assert not _copy_threads()
