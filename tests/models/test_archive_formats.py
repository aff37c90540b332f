"""TorchScript and torch.export archives: detected, published, loaded back the worker's way
(load_module over the blob bytes, the serving task from the carried files)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch
from torch import nn

from flashpoint.errors import RegistryError, UnsupportedModel
from flashpoint.models import archive, serving
from flashpoint.models.publish import empty_module, load_module, read_files
from flashpoint.models.sources import PushOptions, detect, publish_source
from flashpoint.models.sources.base import parse_tensor_spec
from flashpoint.registry.local import LocalStore


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.bn(self.conv(x)))
        pooled = h.mean(dim=(2, 3))
        return self.head(pooled), pooled


def _model(kind: str) -> tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(0)
    if kind == "mlp":
        return Mlp().eval(), torch.randn(3, 16), "x:FP32:-1,16"
    net = ConvNet()
    with torch.no_grad():  # running statistics that are not the identity
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net.eval(), torch.randn(2, 3, 8, 8), "x:FP32:-1,3,8,8"


def _save(kind: str, fmt: str, path) -> tuple[nn.Module, torch.Tensor, str]:
    module, example, spec = _model(kind)
    if fmt == "torchscript":
        torch.jit.save(torch.jit.script(module), str(path))
    else:
        batch = torch.export.Dim("batch")
        torch.export.save(torch.export.export(module, (example,),
                                              dynamic_shapes=({0: batch},)), str(path))
    return module, example, spec


async def _blob(store: LocalStore, manifest) -> bytearray:
    return bytearray(b"".join([await store.read_chunk(manifest.name, manifest.version, i)
                               for i in range(manifest.num_chunks)]))


@pytest.mark.parametrize("fmt", ["torchscript", "export"])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
async def test_published_program_serves_like_the_original(tmp_path, fmt, kind):
    path = tmp_path / ("model.pt" if fmt == "torchscript" else "model.pt2")
    original, example, spec = _save(kind, fmt, path)
    assert detect(path).name == fmt
    store = LocalStore(tmp_path / "registry")
    options = PushOptions(inputs=(parse_tensor_spec(spec),) if fmt == "torchscript" else ())
    manifest = await publish_source(store, f"{kind}-{fmt}", path, options=options)

    assert manifest.source_format == fmt and manifest.task == "tensor"
    assert [layer.name for layer in manifest.layers] == ["model"]
    assert manifest.io.inputs[0].shape == (-1, *example.shape[1:])
    n_out = 1 if kind == "mlp" else 2
    assert [o.name for o in manifest.io.outputs] == [f"output{i}" for i in range(n_out)]
    # the weights are blob tensors, the archive carried is code only
    assert set(manifest.module_tensors()) >= {f"model.{k}" for k in original.state_dict()}
    blob = await _blob(store, manifest)
    (code,) = read_files(manifest, blob).values()
    assert all(t.is_meta for t in archive.load_program(fmt, code).state_dict().values())

    module = load_module(manifest, blob)
    served = serving.for_manifest(manifest, read_files(manifest, blob))
    weight = dict(module.named_parameters())[next(n for n in manifest.module_tensors()
                                                  if n.endswith("weight"))]
    base = np.frombuffer(blob, np.uint8).ctypes.data  # zero-copy: a view of the blob
    assert base <= weight.data_ptr() < base + len(blob)
    with torch.inference_mode():
        for batch in (example, torch.cat([example, example * 2])):
            request = served.prepare({served.module_inputs[0]: batch.numpy()})
            got = module(*(torch.from_numpy(request[n]) for n in served.module_inputs))
            want = original(batch)
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            assert len(got) == n_out
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


async def test_torchscript_needs_its_inputs(tmp_path):
    path = tmp_path / "model.pt"
    _save("mlp", "torchscript", path)
    with pytest.raises(UnsupportedModel, match=r"model.pt: .*--input NAME:DTYPE:SHAPE"):
        await publish_source(LocalStore(tmp_path / "registry"), "m", path)
    assert not (tmp_path / "registry" / "models").exists() or not list(
        (tmp_path / "registry" / "models").iterdir())


async def test_inputs_the_program_cannot_take_are_refused_at_push(tmp_path):
    path = tmp_path / "model.pt"
    _save("mlp", "torchscript", path)
    with pytest.raises(UnsupportedModel, match="does not run on the given inputs"):
        await publish_source(LocalStore(tmp_path / "registry"), "m", path,
                             options=PushOptions(inputs=(parse_tensor_spec("x:FP32:-1,7"),)))


@pytest.mark.parametrize("name", ["model.pt", "model.pt2"])
async def test_corrupt_archive_is_refused_naming_the_file(tmp_path, name):
    fmt = "torchscript" if name == "model.pt" else "export"
    good = tmp_path / f"good-{name}"
    _save("mlp", fmt, good)
    bad = tmp_path / name
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # truncated
    assert detect(bad).name == fmt
    options = PushOptions(inputs=(parse_tensor_spec("x:FP32:-1,16"),))
    with pytest.raises(UnsupportedModel, match=name):
        await publish_source(LocalStore(tmp_path / "registry"), "m", bad, options=options)
    # a zip that is a plain checkpoint, not a program
    ckpt = tmp_path / "ckpt.pt"
    torch.save(_model("mlp")[0].state_dict(), str(ckpt))
    with pytest.raises(UnsupportedModel, match=r"ckpt.pt: not a TorchScript archive"):
        await publish_source(LocalStore(tmp_path / "registry"), "m", ckpt, fmt="torchscript",
                             options=options)


def test_detection_reads_the_archive_layout(tmp_path):
    ts, ex = tmp_path / "a.bin", tmp_path / "b.bin"  # suffixes say nothing
    _save("mlp", "torchscript", ts)
    _save("mlp", "export", ex)
    assert detect(ts).name == "torchscript" and detect(ex).name == "export"
    with zipfile.ZipFile(ts) as zf:
        assert any("/code/" in n for n in zf.namelist())
    other = tmp_path / "c.bin"
    other.write_bytes(b"not a model")
    with pytest.raises(UnsupportedModel, match="c.bin: not a model source"):
        detect(other)


async def test_program_builders_need_the_blob(tmp_path):
    path = tmp_path / "model.pt2"
    _save("mlp", "export", path)
    manifest = await publish_source(LocalStore(tmp_path / "registry"), "m", path)
    with pytest.raises(RegistryError, match="builds from the files its model carries"):
        empty_module(manifest)


async def test_client_push_takes_inputs(tmp_path):
    from flashpoint.client import AsyncClient

    path = tmp_path / "model.pt"
    _save("mlp", "torchscript", path)
    store = LocalStore(tmp_path / "registry")
    client = AsyncClient()
    try:
        manifest = await client.push("m", str(path), inputs=["x:FP32:-1,16"], store=store)
    finally:
        await client.close()
    assert manifest.io.inputs[0].name == "x" and manifest.source_format == "torchscript"
