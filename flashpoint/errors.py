"""The one exception tree of Flashpoint.

Every error carries a stable ``code`` (a short snake_case string), an HTTP status for the
gateway, and whether retrying the same operation may succeed. Errors cross the RPC boundary
as ``{"code", "message", "details"}`` and are rebuilt as the same class on the other side
(``from_wire``); an unknown code becomes :class:`RemoteError`.

    FlashpointError                     internal, 500
    ├── BadRequest                      bad_request, 400
    │   ├── InvalidName                 invalid_name, 400
    │   ├── PayloadTooLarge             too_large, 413
    │   │   └── ObjectQuotaExceeded     object_quota_exceeded, 413 (a KaaS store quota is full)
    │   ├── InvalidGeometry             invalid_geometry, 400 (a MIG geometry that cannot exist)
    │   ├── InvalidInput                invalid_input, 400 (a value the model cannot take: a token
    │   │                               id past the vocabulary, undecodable text or image)
    │   ├── InputTooLong                input_too_long, 400 (past the model's positions)
    │   ├── UnsupportedModel            unsupported_model, 400 (a push that cannot be served)
    │   ├── InvalidKernelGraph          invalid_kernel_graph, 400 (a KaaS request that cannot run)
    │   │   ├── UnknownKernel           unknown_kernel, 400 (not in the kernel library)
    │   │   ├── UndefinedBuffer         undefined_buffer, 400 (a kernel names an undeclared buffer)
    │   │   ├── BufferMismatch          buffer_mismatch, 400 (size / dtype / shape disagree)
    │   │   ├── ReadBeforeWrite         read_before_write, 400 (an intermediate read unwritten)
    │   │   └── KernelGraphCycle        kernel_graph_cycle, 400
    │   └── BufferCacheFull             buffer_cache_full, 413 (a KaaS request's buffers cannot
    │                                   all be resident at once on an executor)
    ├── Unauthorized                    unauthorized, 401
    ├── Forbidden                       forbidden, 403
    ├── NotFound                        not_found, 404
    │   ├── FunctionNotFound            function_not_found, 404
    │   ├── ModelNotFound               model_not_found, 404
    │   └── ObjectNotFound              object_not_found, 404 (no such key in the object store)
    ├── Conflict                        conflict, 409
    │   ├── MigUnavailable              mig_unavailable, 409 (MIG off or unsupported on the GPU)
    │   ├── GpuBusy                     gpu_busy, 409 (replicas still run on a GPU to reconfigure)
    │   └── ObjectExists                object_exists, 409 (an immutable key holds other bytes)
    ├── RetryableError (retryable)
    │   ├── Overloaded                  overloaded, 429 (Retry-After)
    │   ├── Unavailable                 unavailable, 503 (Retry-After)
    │   │   ├── NoCapacity              no_capacity, 503
    │   │   ├── ModelLoadFailed         model_load_failed, 503 (its replicas keep failing to
    │   │   │                           start; the controller backs off, Retry-After = its end)
    │   │   └── KaasUnavailable         kaas_unavailable, 503 (no KaaS executor pool configured)
    │   ├── PeerLost                    peer_lost, 503   (connection to a peer died)
    │   ├── ConnectFailed               connect_failed, 503
    │   └── TransferFailed              transfer_failed, 503 (no source could deliver the bytes)
    ├── DeadlineExceeded                deadline_exceeded, 504 (a per-call deadline passed)
    ├── AuthFailed                      auth_failed, 401 (RPC handshake refused)
    ├── FrameTooLarge                   frame_too_large, 413 (RPC frame over the limit)
    ├── ProtocolError                   protocol_error, 400 (malformed frame / unknown method)
    ├── IntegrityError                  integrity_error, 502 (bytes failed their sha256)
    ├── UnsafePath                      unsafe_path, 500 (a local path another user could control)
    ├── RegistryError                   registry_error, 502
    ├── ModelFailed                     model_failed, 500 (the model raised while running)
    ├── KernelFailed                    kernel_failed, 500 (a KaaS kernel raised while running)
    ├── MigFailed                       mig_failed, 500 (NVML refused a MIG change midway)
    ├── MpsUnavailable                  mps_unavailable, 503 (no MPS binaries, or the daemon died)
    ├── HookBuildFailed                 hook_build_failed, 500 (no C compiler / the hook did not compile)
    └── RemoteError                     remote_error, 500 (a code this side does not know)

Retryable and fatal errors are different classes: callers decide with ``err.retryable``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class FlashpointError(Exception):
    """Base of every Flashpoint error."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.details: dict[str, Any] = details

    def to_wire(self) -> dict[str, Any]:
        """Plain-data form for RPC frames and JSON bodies."""
        return {"code": self.code, "message": self.message, "details": _plain(self.details)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class BadRequest(FlashpointError):
    code = "bad_request"
    http_status = 400


class InvalidName(BadRequest):
    code = "invalid_name"


class PayloadTooLarge(BadRequest):
    code = "too_large"
    http_status = 413


class ObjectQuotaExceeded(PayloadTooLarge):
    """The KaaS object store's total or per-API-key quota has no room for an object."""

    code = "object_quota_exceeded"


class InvalidGeometry(BadRequest):
    """A MIG geometry that cannot exist on a GPU; ``details["reason"]`` says why."""

    code = "invalid_geometry"


class InvalidInput(BadRequest):
    """An input the model cannot take (its value, not its shape): a token id past the
    vocabulary, text that is not UTF-8, bytes that are no image."""

    code = "invalid_input"


class InputTooLong(BadRequest):
    """A sequence longer than the model's positions, with no truncation asked."""

    code = "input_too_long"


class UnsupportedModel(BadRequest):
    """A model source that cannot be published: a missing or inconsistent file, an
    architecture not served, code nobody trusted; the message names the file."""

    code = "unsupported_model"


class Unauthorized(FlashpointError):
    code = "unauthorized"
    http_status = 401


class Forbidden(FlashpointError):
    code = "forbidden"
    http_status = 403


class NotFound(FlashpointError):
    code = "not_found"
    http_status = 404


class FunctionNotFound(NotFound):
    code = "function_not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(FlashpointError):
    code = "conflict"
    http_status = 409


class MigUnavailable(Conflict):
    """MIG is off (or unsupported) on the GPU, so no geometry can be applied."""

    code = "mig_unavailable"


class GpuBusy(Conflict):
    """A GPU cannot be reconfigured while replicas run on it (``details["replicas"]``):
    the controller drains it first, then asks again."""

    code = "gpu_busy"


class RetryableError(FlashpointError):
    """Base of errors where the same call may succeed later."""

    code = "retryable"
    http_status = 503
    retryable = True

    @property
    def retry_after_s(self) -> float:
        return float(self.details.get("retry_after_s", 1.0))


class Overloaded(RetryableError):
    code = "overloaded"
    http_status = 429


class Unavailable(RetryableError):
    code = "unavailable"
    http_status = 503


class NoCapacity(Unavailable):
    code = "no_capacity"


class KvCacheFull(Overloaded):
    """A generation replica's KV-cache memory and waiting queue are both full (retry)."""

    code = "kv_cache_full"


class KvCacheTooSmall(BadRequest):
    """A sequence (prompt plus ``max_tokens``) needs more KV-cache memory than the replica
    reserves in all: it could never run there."""

    code = "kv_cache_too_small"


class ModelLoadFailed(Unavailable):
    """A function's replicas failed to start ``details["failed_starts"]`` times in a row and
    none is warm: the controller starts none for ``retry_after_s`` (its back-off). The message
    carries the last start failure's; ``details["error_code"]`` is that failure's own code
    (``registry_error`` for a blob that does not fit its entry point, ``worker_exited``, ...)."""

    code = "model_load_failed"


class KaasUnavailable(Unavailable):
    """The cluster runs no KaaS executors (``[controller] kaas_workers = 0``), or none is
    placed yet: a kernel graph has nowhere to run."""

    code = "kaas_unavailable"


class PeerLost(RetryableError):
    code = "peer_lost"


class ConnectFailed(RetryableError):
    code = "connect_failed"


class TransferFailed(RetryableError):
    """A data-plane transfer could not get some bytes from any source (all down or lacking)."""

    code = "transfer_failed"


class DeadlineExceeded(FlashpointError):
    code = "deadline_exceeded"
    http_status = 504


class AuthFailed(FlashpointError):
    code = "auth_failed"
    http_status = 401


class FrameTooLarge(FlashpointError):
    code = "frame_too_large"
    http_status = 413


class ProtocolError(FlashpointError):
    code = "protocol_error"
    http_status = 400


class IntegrityError(FlashpointError):
    code = "integrity_error"
    http_status = 502


class UnsafePath(FlashpointError):
    """A local path another user could control (owner, mode or a symlink), refused."""

    code = "unsafe_path"


class RegistryError(FlashpointError):
    code = "registry_error"
    http_status = 502


class ModelFailed(FlashpointError):
    code = "model_failed"
    http_status = 500


class MigFailed(FlashpointError):
    """NVML refused a step of a MIG reconfiguration; ``details["nvml_error"]`` is its code."""

    code = "mig_failed"
    http_status = 500


class MpsUnavailable(FlashpointError):
    """MPS cannot be used: binaries absent, or the control daemon failed or did not answer.

    Not retryable as such: the caller runs without MPS and says so.
    """

    code = "mps_unavailable"
    http_status = 503


class HookBuildFailed(FlashpointError):
    """The native GPU hook could not be built: no C compiler, or compilation failed."""

    code = "hook_build_failed"
    http_status = 500


class InvalidKernelGraph(BadRequest):
    """A KaaS request that cannot run as written; ``details`` name the kernel or buffer."""

    code = "invalid_kernel_graph"


class UnknownKernel(InvalidKernelGraph):
    code = "unknown_kernel"


class UndefinedBuffer(InvalidKernelGraph):
    code = "undefined_buffer"


class BufferMismatch(InvalidKernelGraph):
    """A buffer's declared size, dtype or shape disagrees with its data or its kernel."""

    code = "buffer_mismatch"


class ReadBeforeWrite(InvalidKernelGraph):
    code = "read_before_write"


class KernelGraphCycle(InvalidKernelGraph):
    code = "kernel_graph_cycle"


class BufferCacheFull(PayloadTooLarge):
    """A KaaS request needs more device memory than an executor's cache can give it."""

    code = "buffer_cache_full"


class ObjectNotFound(NotFound):
    code = "object_not_found"


class ObjectExists(Conflict):
    """Objects are immutable: a key already holds different bytes."""

    code = "object_exists"


class KernelFailed(FlashpointError):
    code = "kernel_failed"
    http_status = 500


class RemoteError(FlashpointError):
    code = "remote_error"
    http_status = 500


def _all_subclasses(cls: type[FlashpointError]) -> list[type[FlashpointError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def _registry() -> dict[str, type[FlashpointError]]:
    return {c.code: c for c in _all_subclasses(FlashpointError)}


def from_wire(data: Any) -> FlashpointError:
    """Rebuild a typed error from its wire form; never raises."""
    if not isinstance(data, dict):
        return RemoteError(f"malformed remote error: {data!r:.200}")
    code = str(data.get("code", "remote_error"))
    message = str(data.get("message", ""))
    details = data.get("details") or {}
    if not isinstance(details, dict):
        details = {"details": details}
    # Keys that would clash with the constructor's own arguments are renamed, not fatal.
    safe = {(f"detail_{k}" if k in ("self", "message", "remote_code") else str(k)): v
            for k, v in details.items()}
    cls = _registry().get(code)
    if cls is None:
        return RemoteError(message, remote_code=code, **safe)
    return cls(message, **safe)


def _plain(value: Any) -> Any:
    """Keep details serialisable by msgpack and JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
