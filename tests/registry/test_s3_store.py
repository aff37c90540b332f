"""S3Store against moto's S3 server over real HTTP: atomic publish, multipart uploads,
ranged and verified reads, error translation, and the contract it shares with LocalStore."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from flashpoint.config import RegistryConfig, load_config
from flashpoint.errors import (
    BadRequest,
    Conflict,
    IntegrityError,
    InvalidName,
    ModelNotFound,
    RegistryError,
)
from flashpoint.models import build, example_inputs, load_module, publish, run_example
from flashpoint.registry import (
    IoSignature,
    LocalStore,
    ModelStore,
    S3Store,
    build_blob,
    make_manifest,
    open_store,
    read_verified,
)
from flashpoint.registry import s3 as s3_mod
from flashpoint.spec import TensorSpec

IO = IoSignature(inputs=(TensorSpec("x", "FP32", (-1,)),), outputs=(TensorSpec("y", "FP32", (-1,)),))
MIB = 1 << 20
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Anything that could send boto3 elsewhere than the fake server, or to real credentials.
UNSET_ENV = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SECURITY_TOKEN")


# -- the fake S3 server ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError as e:
            last = e
            time.sleep(0.1)
    raise RuntimeError(f"moto server at {url} did not answer within {timeout_s} s: {last!r}")


@pytest.fixture(scope="module")
def s3_endpoint():
    """``http://127.0.0.1:<port>`` of a moto S3 server running for this module."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in FAKE_ENV.items():
            mp.setenv(key, value)
        for key in UNSET_ENV:
            mp.delenv(key, raising=False)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ),
        )
        try:
            _wait_until_up(proc, url)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture
def s3(s3_endpoint):
    """A raw boto3 client on the fake server (for the test's own inspection)."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    yield client
    client.close()


@pytest.fixture
def bucket(s3):
    name = f"fp-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
async def store(s3_endpoint, bucket):
    async with S3Store(bucket, "models", endpoint_url=s3_endpoint, part_size_bytes=5 * MIB,
                       max_concurrency=4, max_attempts=2) as st:
        yield st


def make_model(tmp_path, name="m", version="1", seed=0, chunk_size=256, big=False):
    """A small two-layer blob (or one of ~11 MiB with 1 MiB chunks when ``big``)."""
    g = torch.Generator().manual_seed(seed)
    n = (11 * MIB) // 4 + 123 if big else 40 * 7
    layers = [
        ("layers.0", [("layers.0.w", torch.randn(n, generator=g))]),
        ("layers.1", [("layers.1.b", torch.randn(33, generator=g).half()),
                      ("layers.1.i", torch.arange(5))]),
    ]
    path = tmp_path / f"{name}-{version}-{seed}-{big}.safetensors"
    _, layout = build_blob(layers, chunk_size=MIB if big else chunk_size, path=path)
    manifest = make_manifest(name=name, version=version, layout=layout,
                             entry_point="pkg.mod:build", config={"seed": seed}, io=IO)
    return manifest, path


def keys(s3, bucket) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def uploads(s3, bucket) -> list[dict]:
    return s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


# -- round trips --------------------------------------------------------------------------


async def test_zoo_model_round_trip(store, tmp_path):
    assert isinstance(store, ModelStore)
    local = LocalStore(tmp_path / "registry")
    manifest = await publish(local, "bert", "tiny", chunk_size=64 * 1024)
    name = manifest.name
    await store.put(manifest, local.blob_path(name, "1"))
    assert await store.get_manifest(name, "1") == manifest
    blob = local.blob_path(name, "1").read_bytes()
    assert await store.read_range(name, "1", 0, manifest.blob_size) == blob
    chunks = [await store.read_chunk(name, "1", i) for i in range(manifest.num_chunks)]
    assert b"".join(chunks) == blob
    # The bytes from S3 load into a working model, equal to the original.
    fetched = await store.read_verified(name, "1", 0, manifest.blob_size)
    module = load_module(manifest, bytearray(fetched))
    original, config = build("bert", "tiny")
    inputs = example_inputs("bert", config, batch=2)
    assert torch.allclose(run_example(module, inputs), run_example(original, inputs))
    # publish() itself works against S3 (it stages the blob in a temp dir).
    again = await publish(store, "resnet", "tiny", chunk_size=64 * 1024)
    assert await store.list_models() == [(name, "1"), (again.name, "1")]


async def test_layout_list_exists_delete(store, s3, bucket, tmp_path):
    manifest, path = make_model(tmp_path)
    assert await store.list_models() == []
    assert not await store.exists("m", "1")
    await store.put(manifest, path)
    assert keys(s3, bucket) == ["models/m/1/blob", "models/m/1/manifest.json"]
    assert store.blob_key("m", "1") == "models/m/1/blob"
    assert store.manifest_key("m", "1") == "models/m/1/manifest.json"
    stored = s3.get_object(Bucket=bucket, Key="models/m/1/manifest.json")["Body"].read()
    assert json.loads(stored) == manifest.to_dict()
    assert await store.exists("m", "1")
    for name, version in [("b", "2"), ("a", "1"), ("b", "1")]:
        m, p = make_model(tmp_path, name, version)
        await store.put(m, p)
    s3.put_object(Bucket=bucket, Key="models/stray.txt", Body=b"x")  # ignored by list
    s3.put_object(Bucket=bucket, Key="other/m/9/manifest.json", Body=b"{}")  # outside prefix
    assert await store.list_models() == [("a", "1"), ("b", "1"), ("b", "2"), ("m", "1")]
    await store.delete("b", "1")
    assert not await store.exists("b", "1")
    assert await store.list_models() == [("a", "1"), ("b", "2"), ("m", "1")]
    assert "models/b/1/blob" not in keys(s3, bucket)
    with pytest.raises(ModelNotFound):
        await store.get_manifest("b", "1")  # the cached manifest went with it
    with pytest.raises(ModelNotFound):
        await store.delete("b", "1")


async def test_no_prefix(s3_endpoint, s3, bucket, tmp_path):
    manifest, path = make_model(tmp_path)
    async with S3Store(bucket, endpoint_url=s3_endpoint) as store:
        await store.put(manifest, path)
        assert keys(s3, bucket) == ["m/1/blob", "m/1/manifest.json"]
        assert await store.list_models() == [("m", "1")]


async def test_multipart_upload(store, s3, bucket, tmp_path):
    manifest, path = make_model(tmp_path, big=True)
    assert manifest.blob_size > 10 * MIB and manifest.chunk_size == MIB
    await store.put(manifest, path)
    assert uploads(s3, bucket) == []
    etag = s3.head_object(Bucket=bucket, Key="models/m/1/blob")["ETag"]
    assert etag.strip('"').endswith("-3")  # three parts of 5 MiB, 5 MiB and the rest
    blob = path.read_bytes()
    assert await store.read_range("m", "1", 0, manifest.blob_size) == blob
    assert await store.read_verified("m", "1", 3 * MIB - 7, 8 * MIB + 5) == blob[3 * MIB - 7:8 * MIB + 5]
    await store.put(manifest, path)  # idempotent here too


async def test_failed_multipart_upload_is_aborted_and_invisible(store, s3, bucket, tmp_path):
    manifest, path = make_model(tmp_path, big=True)
    data = bytearray(path.read_bytes())
    data[10 * MIB + 17] ^= 0xFF  # in the third part
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        await store.put(manifest, path)
    assert uploads(s3, bucket) == []
    assert keys(s3, bucket) == []
    assert not await store.exists("m", "1")
    with pytest.raises(ModelNotFound):
        await store.get_manifest("m", "1")


async def test_put_verifies_the_blob(store, s3, bucket, tmp_path):
    m, p = make_model(tmp_path)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        await store.put(m, p)
    p.write_bytes(bytes(data[:-1]))
    with pytest.raises(BadRequest):
        await store.put(m, p)
    with pytest.raises(BadRequest):
        await store.put(m, tmp_path / "missing.safetensors")
    with pytest.raises(BadRequest):
        await store.put("not a manifest", p)
    assert keys(s3, bucket) == []
    assert await store.list_models() == []


async def test_reader_sees_nothing_until_the_manifest_is_written(
    store, s3, bucket, tmp_path, monkeypatch
):
    manifest, path = make_model(tmp_path)
    blob_uploaded, go = threading.Event(), threading.Event()
    real = s3_mod.S3Store._put_manifest_sync

    def paused(self, key, body):
        blob_uploaded.set()
        assert go.wait(10), "test never released the manifest write"
        return real(self, key, body)

    monkeypatch.setattr(s3_mod.S3Store, "_put_manifest_sync", paused)
    put = asyncio.create_task(store.put(manifest, path))
    try:
        assert await asyncio.to_thread(blob_uploaded.wait, 10)
        assert keys(s3, bucket) == ["models/m/1/blob"]  # the blob is there ...
        assert not await store.exists("m", "1")  # ... but no reader sees a model
        assert await store.list_models() == []
        with pytest.raises(ModelNotFound):
            await store.get_manifest("m", "1")
        with pytest.raises(ModelNotFound):
            await store.read_range("m", "1", 0, 1)
    finally:
        go.set()
        await asyncio.wait_for(put, 10)
    assert await store.get_manifest("m", "1") == manifest


async def test_failed_manifest_write_leaves_nothing_visible(store, s3, bucket, tmp_path, monkeypatch):
    manifest, path = make_model(tmp_path)

    def broken(self, key, body):
        raise s3_mod.ClientError(
            {"Error": {"Code": "InternalError", "Message": "boom"},
             "ResponseMetadata": {"HTTPStatusCode": 500}}, "PutObject")

    with monkeypatch.context() as mp:
        mp.setattr(s3_mod.S3Store, "_put_manifest_sync", broken)
        with pytest.raises(RegistryError, match=r"InternalError \(HTTP 500\)") as info:
            await store.put(manifest, path)
    assert info.value.details["bucket"] == bucket
    assert info.value.details["key"] == "models/m/1/manifest.json"
    assert not await store.exists("m", "1")
    assert await store.list_models() == []
    # The orphaned blob is reclaimed by cleanup_temp, but only once it is old enough.
    assert await store.cleanup_temp(older_than_s=3600) == 0
    assert await store.cleanup_temp(older_than_s=-5) == 1
    assert "models/m/1/blob" not in keys(s3, bucket)
    await store.put(manifest, path)  # a retry succeeds
    assert await store.get_manifest("m", "1") == manifest
    assert await store.cleanup_temp(older_than_s=-5) == 0  # published blobs are kept


async def test_cleanup_aborts_stale_multipart_uploads(store, s3, bucket):
    s3.create_multipart_upload(Bucket=bucket, Key="models/m/1/blob")
    s3.create_multipart_upload(Bucket=bucket, Key="elsewhere/x")  # not ours
    assert await store.cleanup_temp(older_than_s=-5) == 1
    assert [u["Key"] for u in uploads(s3, bucket)] == ["elsewhere/x"]


async def test_put_is_idempotent_and_versions_are_immutable(store, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    await store.put(m, p)  # same content: no-op
    other, other_path = make_model(tmp_path, seed=1)
    with pytest.raises(Conflict):
        await store.put(other, other_path)
    assert await store.get_manifest("m", "1") == m
    assert await store.read_range("m", "1", 0, m.blob_size) == p.read_bytes()


async def test_concurrent_identical_puts_both_succeed(s3_endpoint, bucket, tmp_path):
    m, p = make_model(tmp_path)
    async with (S3Store(bucket, endpoint_url=s3_endpoint) as a,
                S3Store(bucket, endpoint_url=s3_endpoint) as b):
        await asyncio.gather(a.put(m, p), b.put(m, p), a.put(m, p))
        assert await b.get_manifest("m", "1") == m


async def test_manifest_written_by_someone_else_meanwhile(store, tmp_path, monkeypatch):
    """The conditional manifest write refuses to overwrite; the outcome is then compared."""
    m, p = make_model(tmp_path)
    other, _ = make_model(tmp_path, seed=1)
    real = s3_mod.S3Store._put_manifest_sync

    def racing(self, key, body):
        real(self, key, other.to_json().encode())  # another writer wins the race
        return real(self, key, body)

    monkeypatch.setattr(s3_mod.S3Store, "_put_manifest_sync", racing)
    with pytest.raises(Conflict):
        await store.put(m, p)


# -- reads ----------------------------------------------------------------------------------


async def test_read_range_and_read_ranges_are_byte_exact(store, tmp_path):
    m, p = make_model(tmp_path, chunk_size=100)
    blob = p.read_bytes()
    await store.put(m, p)
    assert await store.read_range("m", "1", 0, m.blob_size) == blob
    assert await store.read_range("m", "1", 10, 20) == blob[10:20]
    assert await store.read_range("m", "1", 5, 5) == b""
    assert await store.read_range("m", "1", m.blob_size - 1, m.blob_size) == blob[-1:]
    ranges = [(0, 1), (7, 300), (5, 5), (m.blob_size - 64, m.blob_size)] + [
        (i, i + 37) for i in range(0, m.blob_size - 37, 97)
    ]
    got = await store.read_ranges("m", "1", ranges)
    assert got == [blob[a:b] for a, b in ranges]
    assert await store.read_ranges("m", "1", []) == []
    assert await store.read_verified("m", "1", 100, 700) == blob[100:700]
    assert await store.read_verified("m", "1", 3, 3) == b""
    assert await read_verified(store, "m", "1", 0, m.blob_size) == blob
    for bad in [(0, m.blob_size + 1), (5, 4), (-1, 2), (0.5, 2)]:
        with pytest.raises(BadRequest):
            await store.read_range("m", "1", *bad)
        with pytest.raises(BadRequest):
            await store.read_ranges("m", "1", [(0, 1), bad])
    with pytest.raises(BadRequest):
        await store.read_chunk("m", "1", m.num_chunks)


async def test_corrupted_blob_fails_read_chunk(store, s3, bucket, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    data = bytearray(p.read_bytes())
    target = m.tensors["layers.1.b"].start + 3
    data[target] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=store.blob_key("m", "1"), Body=bytes(data))
    bad_chunk = target // m.chunk_size
    with pytest.raises(IntegrityError):
        await store.read_chunk("m", "1", bad_chunk)
    await store.read_chunk("m", "1", 0 if bad_chunk else 1)  # other chunks still fine
    with pytest.raises(IntegrityError):
        await store.read_verified("m", "1", 0, m.blob_size)
    assert await store.read_range("m", "1", 0, m.blob_size) == bytes(data)  # unverified


async def test_truncated_blob_is_a_registry_error(store, s3, bucket, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    s3.put_object(Bucket=bucket, Key=store.blob_key("m", "1"), Body=p.read_bytes()[:100])
    with pytest.raises(RegistryError, match="returned 10 bytes"):
        await store.read_range("m", "1", 90, 200)


async def test_missing_model(store, tmp_path):
    with pytest.raises(ModelNotFound):
        await store.get_manifest("nope", "1")
    with pytest.raises(ModelNotFound):
        await store.read_range("nope", "1", 0, 1)
    with pytest.raises(ModelNotFound):
        await store.read_ranges("nope", "1", [(0, 1)])
    with pytest.raises(ModelNotFound):
        await store.read_chunk("nope", "1", 0)
    with pytest.raises(ModelNotFound):
        await store.delete("nope", "1")
    assert not await store.exists("nope", "1")
    m, p = make_model(tmp_path)
    await store.put(m, p)
    with pytest.raises(ModelNotFound):
        await store.get_manifest("m", "2")


async def test_blob_gone_under_a_cached_manifest(store, s3, bucket, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    await store.get_manifest("m", "1")
    s3.delete_object(Bucket=bucket, Key=store.blob_key("m", "1"))
    with pytest.raises(ModelNotFound):
        await store.read_chunk("m", "1", 0)


async def test_invalid_stored_manifest_is_a_registry_error(store, s3, bucket, tmp_path):
    m, p = make_model(tmp_path)
    await store.put(m, p)
    key = store.manifest_key("m", "1")
    d = m.to_dict()
    d["name"] = "other"
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(d).encode())
    async with S3Store(bucket, "models", endpoint_url=store.endpoint_url) as fresh:
        with pytest.raises(RegistryError):
            await fresh.get_manifest("m", "1")
        s3.put_object(Bucket=bucket, Key=key, Body=b"{not json")
        with pytest.raises(RegistryError):
            await fresh.get_manifest("m", "1")


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "", "Upper", "x" * 64, None, 3])
async def test_bad_names_are_rejected(store, tmp_path, bad):
    with pytest.raises(InvalidName):
        await store.get_manifest(bad, "1")
    with pytest.raises(InvalidName):
        await store.read_range(bad, "1", 0, 1)
    with pytest.raises(InvalidName):
        await store.read_ranges(bad, "1", [(0, 1)])
    with pytest.raises(InvalidName):
        await store.read_chunk(bad, "1", 0)
    with pytest.raises(InvalidName):
        await store.exists(bad, "1")
    with pytest.raises(InvalidName):
        await store.delete(bad, "1")
    m, p = make_model(tmp_path)
    with pytest.raises(InvalidName):
        await store.put(dataclasses.replace(m, name=bad), p)
    assert await store.list_models() == []


# -- failures of the service itself -------------------------------------------------------------


async def test_unreachable_endpoint_is_a_registry_error_in_bounded_time(s3_endpoint):
    port = _free_port()  # nothing listens there
    async with S3Store("b", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2,
                       connect_timeout_s=0.5, read_timeout_s=0.5) as store:
        start = time.monotonic()
        with pytest.raises(RegistryError, match="s3://b/m/1/manifest.json") as info:
            await store.get_manifest("m", "1")
        with pytest.raises(RegistryError):
            await store.list_models()
        assert time.monotonic() - start < 20
        assert info.value.details["bucket"] == "b"


async def test_missing_bucket_is_a_registry_error(s3_endpoint, tmp_path):
    m, p = make_model(tmp_path)
    async with S3Store(f"nope-{uuid.uuid4().hex[:8]}", endpoint_url=s3_endpoint) as store:
        with pytest.raises(RegistryError, match=r"NoSuchBucket \(HTTP 404\)"):
            await store.list_models()
        with pytest.raises(RegistryError, match="NoSuchBucket"):
            await store.put(m, p)


async def test_closed_store_refuses_calls(s3_endpoint, bucket):
    store = S3Store(bucket, endpoint_url=s3_endpoint)
    assert await store.list_models() == []
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(RegistryError, match="closed"):
        await store.list_models()


def test_constructor_checks_its_arguments():
    with pytest.raises(BadRequest):
        S3Store("")
    with pytest.raises(BadRequest):
        S3Store("b", part_size_bytes=MIB)
    with pytest.raises(BadRequest):
        S3Store("b", max_concurrency=0)
    with pytest.raises(BadRequest):
        S3Store("b", max_attempts=0)


# -- configuration ------------------------------------------------------------------------------


@pytest.fixture
def aws_env(monkeypatch):
    """Fake credentials, so building a client never looks further (profiles, IMDS)."""
    for key, value in FAKE_ENV.items():
        monkeypatch.setenv(key, value)
    for key in UNSET_ENV:
        monkeypatch.delenv(key, raising=False)


def test_open_store(tmp_path, aws_env):
    local = open_store(RegistryConfig(kind="local", root=str(tmp_path / "r")))
    assert isinstance(local, LocalStore) and local.root == tmp_path / "r"
    s3store = open_store(RegistryConfig(kind="s3", bucket="bkt", prefix="/p/",
                                        endpoint_url="http://127.0.0.1:1", region="eu-west-1"))
    assert isinstance(s3store, S3Store) and isinstance(s3store, ModelStore)
    assert (s3store.bucket, s3store.prefix, s3store.endpoint_url) == ("bkt", "p", "http://127.0.0.1:1")
    with pytest.raises(BadRequest, match="bucket"):
        open_store(RegistryConfig(kind="s3"))
    with pytest.raises(BadRequest, match="unknown registry kind"):
        open_store(RegistryConfig(kind="gcs"))


def test_s3_config_from_toml(tmp_path, aws_env):
    p = tmp_path / "c.toml"
    p.write_text('[registry]\nkind = "s3"\nbucket = "bkt"\nprefix = "reg"\n')
    store = open_store(load_config(p).registry)
    assert isinstance(store, S3Store) and (store.bucket, store.prefix) == ("bkt", "reg")
    assert store.endpoint_url is None


def test_registry_imports_neither_boto3_nor_torch():
    code = (
        "import sys, flashpoint.registry as r;"
        "assert 'boto3' not in sys.modules and 'torch' not in sys.modules;"
        "r.S3Store; assert 'boto3' in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_moto_stays_out_of_the_package():
    root = Path(s3_mod.__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(import|from)\s+moto\b", re.M)
    assert [p for p in root.rglob("*.py") if pattern.search(p.read_text())] == []


# -- the contract both backends keep ----------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
async def any_store(request, tmp_path, s3_endpoint, bucket):
    if request.param == "local":
        yield LocalStore(tmp_path / "registry")
        return
    async with S3Store(bucket, "c", endpoint_url=s3_endpoint) as st:
        yield st


async def test_store_contract(any_store, tmp_path):
    store = any_store
    m, p = make_model(tmp_path, chunk_size=128)
    blob = p.read_bytes()
    assert not await store.exists("m", "1")
    with pytest.raises(ModelNotFound):
        await store.get_manifest("m", "1")
    await store.put(m, p)
    await store.put(m, p)
    other, other_path = make_model(tmp_path, seed=3, chunk_size=128)
    with pytest.raises(Conflict):
        await store.put(other, other_path)
    assert await store.exists("m", "1")
    assert await store.get_manifest("m", "1") == m
    assert await store.list_models() == [("m", "1")]
    assert await store.read_range("m", "1", 17, 301) == blob[17:301]
    chunks = [await store.read_chunk("m", "1", i) for i in range(m.num_chunks)]
    assert b"".join(chunks) == blob
    assert await store.read_verified("m", "1", 1, m.blob_size - 1) == blob[1:-1]
    with pytest.raises(BadRequest):
        await store.read_range("m", "1", 0, m.blob_size + 1)
    await store.delete("m", "1")
    assert not await store.exists("m", "1")
    assert await store.list_models() == []
    with pytest.raises(ModelNotFound):
        await store.delete("m", "1")


async def test_parallel_calls_are_bounded_by_max_concurrency(s3_endpoint, bucket, tmp_path, monkeypatch):
    peak = {"now": 0, "max": 0}
    lock = threading.Lock()

    def counting(real):
        def wrapper(self, *args):
            with lock:
                peak["now"] += 1
                peak["max"] = max(peak["max"], peak["now"])
            try:
                time.sleep(0.05)  # long enough for the others to pile up
                return real(self, *args)
            finally:
                with lock:
                    peak["now"] -= 1
        return wrapper

    monkeypatch.setattr(s3_mod.S3Store, "_upload_part_sync", counting(s3_mod.S3Store._upload_part_sync))
    monkeypatch.setattr(s3_mod.S3Store, "_get_range_sync", counting(s3_mod.S3Store._get_range_sync))
    m, p = make_model(tmp_path, big=True)
    async with S3Store(bucket, endpoint_url=s3_endpoint, part_size_bytes=5 * MIB,
                       max_concurrency=2) as store:
        await store.put(m, p)  # three parts, two at a time
        assert peak["max"] == 2
        peak["max"] = 0
        ranges = [(i * 1000, i * 1000 + 500) for i in range(12)]
        got = await store.read_ranges("m", "1", ranges)
        assert got == [p.read_bytes()[a:b] for a, b in ranges]
        assert peak["max"] == 2
