"""``S3Store``: the registry backend on S3 (or any S3-compatible object store).

Layout::

    <prefix>/<name>/<version>/blob            the weights blob (safetensors, layer order)
    <prefix>/<name>/<version>/manifest.json   written last: a model exists once this does

A ``put`` checks the blob's size and safetensors header against the manifest, uploads it
(one ``PutObject`` up to the part size, else a multipart upload whose parts are whole
chunks, each verified against the manifest's hashes as it is read, uploaded in parallel;
any failure aborts the upload) and only then writes ``manifest.json`` with
``If-None-Match: *``, so a reader sees no model or a complete one, and of two concurrent
puts exactly one publishes. Versions are immutable: an identical manifest again is a no-op,
a different one is :class:`~flashpoint.errors.Conflict`. Known limit: two concurrent puts
of *different* content for one version share the blob key, so the loser's upload can
overwrite the winner's blob just before it is refused; the store re-checks for a manifest
before completing a multipart upload, and readers detect what remains
(:class:`~flashpoint.errors.IntegrityError` from ``read_chunk``).

boto3 blocks, so every S3 call runs in the store's own thread pool (``max_concurrency``
threads, shut down by :meth:`S3Store.close`), never on the event loop. botocore retries
each call (standard mode, ``max_attempts``); connection failures that survive that, and
failures while streaming a body, are retried once more here with jittered backoff
(``max_attempts=1`` turns every retry off). Errors are translated at this boundary: a
missing key is :class:`~flashpoint.errors.ModelNotFound`, anything else
:class:`~flashpoint.errors.RegistryError` naming the bucket, key and HTTP status.
Credentials come from boto3's standard chain (environment, profile, instance role).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from flashpoint.errors import BadRequest, Conflict, FlashpointError, ModelNotFound, RegistryError
from flashpoint.ids import validate_name, validate_version
from flashpoint.registry.blob_header import check_header, parse_header
from flashpoint.registry.chunks import verify_chunk
from flashpoint.registry.local import read_exact
from flashpoint.registry.manifest import Manifest
from flashpoint.rpc.backoff import Backoff, retry

if TYPE_CHECKING:
    from flashpoint.config import RegistryConfig

T = TypeVar("T")

BLOB_OBJECT = "blob"
MANIFEST_OBJECT = "manifest.json"
MIN_PART_BYTES = 5 << 20  # S3's minimum for every part but the last
MAX_PARTS = 10_000
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_EXISTS_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
_BACKOFF = Backoff(initial_s=0.1, max_s=2.0)
_RETRY_WAIT_S = 30.0  # bound on our own backoff waits per call


def _is_transient(exc: BaseException) -> bool:
    """Connection-level failures (refused, reset, timed out, body cut short)."""
    return isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError))


def _check_offsets(start: Any, end: Any, size: int) -> None:
    for v in (start, end):
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest("byte offsets must be integers")
    if not 0 <= start <= end <= size:
        raise BadRequest(f"byte range [{start}, {end}) outside the blob of {size}")


class _Stopped(Exception):
    """A queued part found its upload already failed; not an error of its own."""


class S3Store:
    """A :class:`~flashpoint.registry.store.ModelStore` over an S3 bucket."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_concurrency: int = 8,
        part_size_bytes: int = 64 << 20,
        max_attempts: int = 5,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(bucket, str) or not bucket:
            raise BadRequest("S3Store needs a bucket name")
        if max_concurrency < 1:
            raise BadRequest("max_concurrency must be >= 1")
        if part_size_bytes < MIN_PART_BYTES:
            raise BadRequest(f"part_size_bytes must be >= {MIN_PART_BYTES} (the S3 minimum)")
        if max_attempts < 1:
            raise BadRequest("max_attempts must be >= 1")
        if connect_timeout_s <= 0 or read_timeout_s <= 0:
            raise BadRequest("timeouts must be positive")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or None
        self.max_concurrency = max_concurrency
        self.part_size_bytes = part_size_bytes
        self._attempts = min(2, max_attempts)  # ours, on top of botocore's
        config = Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max_concurrency + 2,
            # S3-compatible endpoints (MinIO, Ceph, moto) want bucket-in-path addressing.
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        session = boto3.session.Session(region_name=region or None)
        self._client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency,
                                        thread_name_prefix=f"s3store-{bucket}")
        self._manifests: dict[tuple[str, str], Manifest] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_config(cls, config: RegistryConfig) -> S3Store:
        if not config.bucket:
            raise BadRequest("registry kind 's3' needs a bucket")
        return cls(config.bucket, config.prefix, endpoint_url=config.endpoint_url or None,
                   region=config.region or None)

    def __repr__(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}"
        return f"S3Store({where!r}, endpoint_url={self.endpoint_url!r})"

    async def __aenter__(self) -> S3Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Wait for running S3 calls, drop queued ones, and release the client."""
        if self._closed:
            return
        if self._cleanups:  # aborts of failed uploads still need the pool
            await asyncio.wait(self._cleanups)
        self._closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        self._client.close()

    # -- keys ---------------------------------------------------------------------------------

    def _key(self, name: str, version: str, obj: str) -> str:
        rel = f"{validate_name(name, 'model name')}/{validate_version(version)}/{obj}"
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def blob_key(self, name: str, version: str) -> str:
        """The object key of a model version's blob (validated names; it may not exist)."""
        return self._key(name, version, BLOB_OBJECT)

    def manifest_key(self, name: str, version: str) -> str:
        return self._key(name, version, MANIFEST_OBJECT)

    @property
    def _base(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    # -- ModelStore -----------------------------------------------------------------------------

    async def put(self, manifest: Manifest, blob_path: str | Path) -> None:
        if not isinstance(manifest, Manifest):
            raise BadRequest("put needs a Manifest")
        name, version = manifest.name, manifest.version
        blob_key = self.blob_key(name, version)  # validates before any I/O
        if await self._published_same(manifest):
            return
        path = Path(blob_path)
        await self._run(self._check_blob_sync, manifest, path)
        part_size = self._part_size(manifest)
        if manifest.blob_size <= part_size:
            await self._call("upload", blob_key, self._put_small_sync, blob_key, manifest, path)
        else:
            try:
                await self._put_multipart(manifest, path, blob_key, part_size)
            except _AlreadyPublished:
                return
        await self._publish_manifest(manifest)

    async def get_manifest(self, name: str, version: str) -> Manifest:
        key = self.manifest_key(name, version)
        cached = self._manifests.get((name, version))
        if cached is not None:
            return cached
        manifest = await self._fetch_manifest(name, version, key)
        self._manifests[(name, version)] = manifest
        return manifest

    async def read_range(self, name: str, version: str, start: int, end: int) -> bytes:
        return (await self.read_ranges(name, version, [(start, end)]))[0]

    async def read_ranges(
        self, name: str, version: str, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        """Blob bytes of every ``[start, end)`` in ``ranges`` (unverified), fetched with
        parallel ranged GETs bounded by ``max_concurrency``."""
        key = self.blob_key(name, version)
        manifest = await self.get_manifest(name, version)
        for start, end in ranges:
            _check_offsets(start, end, manifest.blob_size)
        return list(await asyncio.gather(*(
            self._call("ranged GET", key, self._get_range_sync, key, start, end,
                       name=name, version=version)
            for start, end in ranges
        )))

    async def read_chunk(self, name: str, version: str, index: int) -> bytes:
        key = self.blob_key(name, version)
        manifest = await self.get_manifest(name, version)
        manifest.chunk_range(index)  # BadRequest before any request
        return await self._call("ranged GET", key, self._get_chunk_sync, key, manifest, index,
                                name=name, version=version)

    async def read_verified(self, name: str, version: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` read as whole verified chunks, fetched in parallel."""
        key = self.blob_key(name, version)
        manifest = await self.get_manifest(name, version)
        indices = manifest.chunks_for_range(start, end)
        if not indices:
            return b""
        chunks = await asyncio.gather(*(
            self._call("ranged GET", key, self._get_chunk_sync, key, manifest, i,
                       name=name, version=version)
            for i in indices
        ))
        first = manifest.chunk_range(indices[0])[0]
        return b"".join(chunks)[start - first:end - first]

    async def list_models(self) -> list[tuple[str, str]]:
        return await self._call("list", self._base, self._list_sync)

    async def delete(self, name: str, version: str) -> None:
        manifest_key = self.manifest_key(name, version)
        blob_key = self.blob_key(name, version)
        if not await self.exists(name, version):
            raise ModelNotFound(f"model {name}:{version} not found", name=name, version=version)
        # The manifest goes first: the model disappears at once, the blob follows.
        await self._call("delete", manifest_key, self._delete_sync, manifest_key)
        self._manifests.pop((name, version), None)
        await self._call("delete", blob_key, self._delete_sync, blob_key)

    async def exists(self, name: str, version: str) -> bool:
        key = self.manifest_key(name, version)
        return await self._call("HEAD", key, self._exists_sync, key)

    async def cleanup_temp(self, older_than_s: float = 3600.0) -> int:
        """Abort multipart uploads and delete manifest-less blobs (leftovers of crashed
        puts) older than ``older_than_s``; returns how many were removed."""
        cutoff = time.time() - older_than_s
        return await self._call("cleanup", self._base, self._cleanup_sync, cutoff)

    # -- async plumbing ---------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RegistryError(f"{self!r} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def _call(
        self, what: str, key: str, fn: Callable[..., T], *args: Any,
        name: str | None = None, version: str | None = None,
    ) -> T:
        """Run ``fn(*args)`` in the pool, retrying connection failures, translating errors."""
        try:
            return await retry(
                lambda: self._run(fn, *args), attempts=self._attempts,
                total_timeout_s=_RETRY_WAIT_S, backoff=_BACKOFF, retry_on=_is_transient,
                what=f"s3 {what} {key}",
            )
        except (BotoCoreError, ClientError) as e:
            raise self._translate(e, what, key, name, version) from e

    def _translate(
        self, exc: Exception, what: str, key: str, name: str | None, version: str | None
    ) -> FlashpointError:
        where = f"s3://{self.bucket}/{key}"
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _NOT_FOUND_CODES and name is not None:
                return ModelNotFound(f"model {name}:{version} not found", name=name,
                                     version=version)
            message = err.get("Message") or ""
            return RegistryError(
                f"S3 {what} {where} failed: {code or 'error'} (HTTP {status}) {message}".rstrip(),
                bucket=self.bucket, key=key, status=status, s3_code=code,
            )
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return RegistryError(f"S3 {what} {where}: no usable AWS credentials ({exc}); set "
                                 "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role",
                                 bucket=self.bucket, key=key, status=None)
        return RegistryError(f"S3 {what} {where} failed: {exc}", bucket=self.bucket, key=key,
                             status=None)

    async def _fetch_manifest(self, name: str, version: str, key: str) -> Manifest:
        text = await self._call("GET", key, self._get_object_sync, key, name=name,
                                version=version)
        try:
            manifest = Manifest.from_json(text)
        except BadRequest as e:
            raise RegistryError(f"stored manifest of {name}:{version} is invalid: {e}") from e
        if (manifest.name, manifest.version) != (name, version):
            raise RegistryError(f"stored manifest at {name}:{version} names "
                                f"{manifest.name}:{manifest.version}")
        return manifest

    async def _published_same(self, manifest: Manifest) -> bool:
        """True when this exact manifest is published; Conflict when another one is."""
        name, version = manifest.name, manifest.version
        try:
            existing = await self._fetch_manifest(name, version, self.manifest_key(name, version))
        except ModelNotFound:
            return False
        if existing != manifest:
            raise Conflict(f"model {name}:{version} exists with different content; "
                           "versions are immutable", name=name, version=version)
        self._manifests[(name, version)] = existing
        return True

    async def _publish_manifest(self, manifest: Manifest) -> None:
        key = self.manifest_key(manifest.name, manifest.version)
        body = manifest.to_json().encode()
        published = await self._call("PUT", key, self._put_manifest_sync, key, body)
        if not published and not await self._published_same(manifest):
            raise RegistryError(f"manifest of {manifest.name}:{manifest.version} refused as "
                                "existing but cannot be read", bucket=self.bucket, key=key)
        self._manifests[(manifest.name, manifest.version)] = manifest

    def _part_size(self, manifest: Manifest) -> int:
        """Parts hold whole chunks (each verified on its own), at least the configured
        size, and at most ``MAX_PARTS`` of them."""
        chunk = manifest.chunk_size
        want = max(self.part_size_bytes, -(-manifest.blob_size // MAX_PARTS))
        return -(-want // chunk) * chunk

    async def _put_multipart(
        self, manifest: Manifest, path: Path, key: str, part_size: int
    ) -> None:
        upload_id = await self._call("create multipart upload", key, self._create_upload_sync, key)
        stop = threading.Event()
        bounds = [(s, min(s + part_size, manifest.blob_size))
                  for s in range(0, manifest.blob_size, part_size)]

        async def upload(number: int, start: int, end: int) -> dict[str, Any]:
            try:
                return await self._call("upload part", key, self._upload_part_sync, key,
                                        upload_id, number, manifest, path, start, end, stop)
            except BaseException:
                stop.set()  # parts still queued need not bother
                raise

        parts = asyncio.gather(*(upload(n, s, e) for n, (s, e) in enumerate(bounds, 1)),
                               return_exceptions=True)
        try:
            # Shielded: a cancelled put still waits for its running parts before aborting.
            results = await asyncio.shield(parts)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                real = [e for e in errors if not isinstance(e, _Stopped)]
                raise (real or errors)[0]
            # Narrow the window in which a concurrent put of other content loses its blob.
            await self._published_same_or_absent(manifest)
            await self._call("complete multipart upload", key, self._complete_upload_sync,
                             key, upload_id, results)
        except BaseException:
            stop.set()
            cleanup = asyncio.ensure_future(self._abort_after(parts, key, upload_id))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            await asyncio.shield(cleanup)
            raise

    async def _published_same_or_absent(self, manifest: Manifest) -> None:
        if await self._published_same(manifest):
            raise _AlreadyPublished

    async def _abort_after(self, parts: asyncio.Future[Any], key: str, upload_id: str) -> None:
        await parts  # running parts finish (queued ones stop at once), then nothing is left
        try:
            await self._call("abort multipart upload", key, self._abort_upload_sync, key,
                             upload_id)
        except RegistryError:
            pass  # the bucket's lifecycle rule or cleanup_temp() reclaims it

    # -- blocking halves (run in the pool) ----------------------------------------------------------

    def _check_blob_sync(self, manifest: Manifest, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != manifest.blob_size:
                    raise BadRequest(f"blob is {size} bytes, manifest says {manifest.blob_size}")
                header, data_offset = parse_header(read_exact(f, 0, manifest.data_offset))
                check_header(manifest, header, data_offset)
        except FileNotFoundError:
            raise BadRequest(f"blob file {str(path)!r} does not exist") from None
        except OSError as e:
            raise RegistryError(f"reading blob file {str(path)!r}: {e}") from e

    def _read_verified_part(self, manifest: Manifest, path: Path, start: int, end: int) -> bytes:
        """File bytes ``[start, end)`` (whole chunks), each chunk checked against its hash."""
        try:
            with open(path, "rb") as f:
                data = read_exact(f, start, end - start)
        except OSError as e:
            raise RegistryError(f"reading blob file {str(path)!r}: {e}") from e
        view = memoryview(data)
        for index in range(start // manifest.chunk_size, -(-end // manifest.chunk_size)):
            c_start, c_end = manifest.chunk_range(index)
            verify_chunk(manifest, index, view[c_start - start:c_end - start])
        return data

    def _put_small_sync(self, key: str, manifest: Manifest, path: Path) -> None:
        data = self._read_verified_part(manifest, path, 0, manifest.blob_size)
        self._client.put_object(Bucket=self.bucket, Key=key, Body=data,
                                ContentType="application/octet-stream")

    def _create_upload_sync(self, key: str) -> str:
        resp = self._client.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                    ContentType="application/octet-stream")
        return resp["UploadId"]

    def _upload_part_sync(
        self, key: str, upload_id: str, number: int, manifest: Manifest, path: Path,
        start: int, end: int, stop: threading.Event,
    ) -> dict[str, Any]:
        if stop.is_set():
            raise _Stopped
        data = self._read_verified_part(manifest, path, start, end)
        if stop.is_set():
            raise _Stopped
        resp = self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                        PartNumber=number, Body=data)
        part = {"PartNumber": number, "ETag": resp["ETag"]}
        part.update({k: v for k, v in resp.items()
                     if k.startswith("Checksum") and k != "ChecksumType"})
        return part

    def _complete_upload_sync(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
        self._client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                               MultipartUpload={"Parts": parts})

    def _abort_upload_sync(self, key: str, upload_id: str) -> None:
        self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    def _put_manifest_sync(self, key: str, body: bytes) -> bool:
        """Write the manifest unless one exists; False when one already did."""
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body,
                                    ContentType="application/json", IfNoneMatch="*")
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in _EXISTS_CODES:
                return False
            raise
        return True

    def _get_object_sync(self, key: str) -> bytes:
        body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def _get_range_sync(self, key: str, start: int, end: int) -> bytes:
        if start == end:
            return b""
        resp = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        body = resp["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        if len(data) != end - start:
            raise RegistryError(f"s3://{self.bucket}/{key}: ranged GET [{start}, {end}) returned "
                                f"{len(data)} bytes", bucket=self.bucket, key=key, status=None)
        return data

    def _get_chunk_sync(self, key: str, manifest: Manifest, index: int) -> bytes:
        data = self._get_range_sync(key, *manifest.chunk_range(index))
        verify_chunk(manifest, index, data)  # hashing stays off the event loop
        return data

    def _exists_sync(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in _NOT_FOUND_CODES:
                return False
            raise
        return True

    def _delete_sync(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=key)

    def _objects(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._base
        ):
            out.extend(page.get("Contents", ()))
        return out

    def _split(self, key: str) -> tuple[str, str, str] | None:
        """``(name, version, object)`` of one of our keys, else None."""
        parts = key[len(self._base):].split("/")
        if len(parts) != 3 or parts[2] not in (BLOB_OBJECT, MANIFEST_OBJECT):
            return None
        try:
            validate_name(parts[0])
            validate_version(parts[1])
        except BadRequest:
            return None
        return parts[0], parts[1], parts[2]

    def _list_sync(self) -> list[tuple[str, str]]:
        out = []
        for obj in self._objects():
            split = self._split(obj["Key"])
            if split is not None and split[2] == MANIFEST_OBJECT:
                out.append((split[0], split[1]))
        return sorted(out)

    def _cleanup_sync(self, cutoff: float) -> int:
        removed = 0
        for page in self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self._base
        ):
            for upload in page.get("Uploads", ()):
                if upload["Initiated"].timestamp() <= cutoff and self._split(upload["Key"]):
                    self._abort_upload_sync(upload["Key"], upload["UploadId"])
                    removed += 1
        objects = self._objects()
        published = {s[:2] for o in objects if (s := self._split(o["Key"])) and s[2] == MANIFEST_OBJECT}
        for obj in objects:
            split = self._split(obj["Key"])
            if (split is not None and split[2] == BLOB_OBJECT and split[:2] not in published
                    and obj["LastModified"].timestamp() <= cutoff):
                self._delete_sync(obj["Key"])
                removed += 1
        return removed


class _AlreadyPublished(Exception):
    """An identical put published while this one uploaded: abort ours, nothing to do."""
