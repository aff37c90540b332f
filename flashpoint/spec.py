"""What a user registers: functions over models, and their tensor signatures.

These are plain frozen dataclasses shared by the gateway, the controller, the workers and
the persistence layer; ``to_dict``/``from_dict`` are their only wire and storage forms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from flashpoint.errors import BadRequest
from flashpoint.ids import ModelKey, validate_name, validate_version
from flashpoint.policy.klc import TenantClass

if TYPE_CHECKING:
    from flashpoint.policy.fastgshare import FunctionProfile

# KServe Open Inference Protocol datatypes (plus BF16, which the spec lists too).
DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
)


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output: OIP datatype and shape (-1 = any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Any) -> TensorSpec:
        if not isinstance(d, dict):
            raise BadRequest("tensor spec must be an object")
        name, dt, shape = d.get("name"), d.get("datatype"), d.get("shape")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise BadRequest("tensor spec needs a name of 1-128 characters")
        if dt not in DATATYPES:
            raise BadRequest(f"tensor {name!r}: unknown datatype {dt!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= -1 for s in shape):
            raise BadRequest(f"tensor {name!r}: shape must be a list of ints >= -1")
        return cls(name, dt, tuple(shape))


@dataclass(frozen=True)
class FastProfileSpec:
    """FaST-GShare's profile of a function (seed 001 §3.2): throughput and p99 latency
    measured over an (SM share × time quota) grid at one batch size. Each point is
    ``(sm_share, quota, throughput_rps, p99_latency_s)``. The grid is checked by
    :class:`flashpoint.policy.fastgshare.FunctionProfile` (full, no duplicates)."""

    batch: int
    points: tuple[tuple[float, float, float, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "points": [
            {"sm_share": s, "quota": q, "throughput_rps": t, "p99_latency_s": p}
            for s, q, t, p in self.points]}

    @classmethod
    def from_dict(cls, d: Any) -> FastProfileSpec:
        if not isinstance(d, dict) or set(d) - {"batch", "points"}:
            raise BadRequest("fast_profile must be an object with 'batch' and 'points'")
        batch, raw = d.get("batch", 1), d.get("points")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 1024:
            raise BadRequest("fast_profile.batch must be an integer in 1..1024")
        if not isinstance(raw, list) or not 1 <= len(raw) <= 400:
            raise BadRequest("fast_profile.points must be a list of 1..400 points")
        keys = ("sm_share", "quota", "throughput_rps", "p99_latency_s")
        points = []
        for pt in raw:
            if not isinstance(pt, dict) or set(pt) != set(keys) or not all(
                    isinstance(pt[k], (int, float)) and not isinstance(pt[k], bool) for k in keys):
                raise BadRequest(f"each fast_profile point needs the numbers {list(keys)}")
            points.append(tuple(float(pt[k]) for k in keys))
        return cls(batch, tuple(points))  # type: ignore[arg-type]

    def to_profile(self, function: str) -> FunctionProfile:
        """The policy's :class:`~flashpoint.policy.fastgshare.FunctionProfile` (BadRequest
        for a grid that is not full, or a point out of range)."""
        from flashpoint.policy.fastgshare import FunctionProfile, ProfilePoint

        for s, q, t, p in self.points:
            if not (0 < s <= 1 and 0 < q <= 1 and t >= 0 and p >= 0):
                raise BadRequest("fast_profile points need sm_share and quota in (0, 1], "
                                 "throughput_rps and p99_latency_s >= 0")
        return FunctionProfile(function, tuple(ProfilePoint(*pt) for pt in self.points),
                               self.batch)


def _number(d: dict[str, Any], key: str, what: str, lo: float = 0.0, hi: float = 1e12) -> float:
    """``d[key]`` as a float in ``[lo, hi]`` (BadRequest naming ``what.key`` otherwise)."""
    v = d.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"{what}.{key} must be a number in [{lo}, {hi}]")
    return float(v)


@dataclass(frozen=True)
class ProteanSliceSpec:
    """PROTEAN's profile of a function on one slice type (seed: ``policy/protean.py``
    ``SliceProfile``): ``solo_s`` one batch's time alone, ``fbr`` its fractional bandwidth
    requirement fitted from co-location runs (``policy/protean_fit.py``); ``fbr_bounded``:
    no co-located run saturated, so ``fbr`` is only the upper bound the runs allow."""

    slice: str
    solo_s: float
    fbr: float
    fbr_bounded: bool = False
    mem_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ProteanSliceSpec:
        keys = {"slice", "solo_s", "fbr", "fbr_bounded", "mem_bytes"}
        if not isinstance(d, dict) or set(d) - keys or not isinstance(d.get("slice"), str) \
                or not 1 <= len(d["slice"]) <= 32:
            raise BadRequest(f"each protean_profile slice is an object of {sorted(keys)} "
                             "with a slice name of 1-32 characters")
        mem = d.get("mem_bytes", 0)
        if not isinstance(mem, int) or isinstance(mem, bool) or mem < 0:
            raise BadRequest("protean_profile.mem_bytes must be an integer >= 0")
        return cls(d["slice"], _number(d, "solo_s", "protean_profile", 0.0, 3600.0),
                   _number(d, "fbr", "protean_profile", 0.0, 1000.0),
                   bool(d.get("fbr_bounded", False)), mem)


@dataclass(frozen=True)
class ProteanProfileSpec:
    """PROTEAN's per-slice profile of a function at batch size ``batch`` (``flashpoint
    profile --protean`` measures it: a Solo run and co-located runs, FBR fitted)."""

    batch: int
    slices: tuple[ProteanSliceSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "slices": [s.to_dict() for s in self.slices]}

    @classmethod
    def from_dict(cls, d: Any) -> ProteanProfileSpec:
        if not isinstance(d, dict) or set(d) - {"batch", "slices"}:
            raise BadRequest("protean_profile must be an object with 'batch' and 'slices'")
        batch, raw = d.get("batch", 1), d.get("slices")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 1024:
            raise BadRequest("protean_profile.batch must be an integer in 1..1024")
        if not isinstance(raw, list) or not 1 <= len(raw) <= 16:
            raise BadRequest("protean_profile.slices must be a list of 1..16 slices")
        slices = tuple(ProteanSliceSpec.from_dict(s) for s in raw)
        if len({s.slice for s in slices}) != len(slices):
            raise BadRequest("protean_profile.slices names a slice twice")
        return cls(batch, slices)


@dataclass(frozen=True)
class DiluProfileSpec:
    """Dilu's HGSS result for a function (``policy/dilu_profile.py``): SM ``request`` and
    ``limit`` as fractions of one GPU at inference batch size ``ibs``, the throughput there,
    and how many trials the search ran. Without an explicit ``sm_share`` the controller
    takes the share from it (``share_placement.resolve_share``)."""

    sm_request: float
    sm_limit: float
    ibs: int
    throughput_rps: float
    trials: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.sm_request <= self.sm_limit <= 1):
            raise BadRequest("dilu_profile needs 0 < sm_request <= sm_limit <= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> DiluProfileSpec:
        keys = {"sm_request", "sm_limit", "ibs", "throughput_rps", "trials"}
        if not isinstance(d, dict) or set(d) - keys:
            raise BadRequest(f"dilu_profile must be an object of {sorted(keys)}")
        ints = [d.get("ibs", 1), d.get("trials", 0)]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints) \
                or not 1 <= ints[0] <= 1024:
            raise BadRequest("dilu_profile.ibs must be an integer in 1..1024, trials >= 0")
        return cls(_number(d, "sm_request", "dilu_profile", 0.0, 1.0),
                   _number(d, "sm_limit", "dilu_profile", 0.0, 1.0), ints[0],
                   _number(d, "throughput_rps", "dilu_profile"), ints[1])


@dataclass(frozen=True)
class FunctionSpec:
    """A registered function: a model version plus serving and scaling parameters."""

    name: str
    model: str
    model_version: str = "1"
    max_batch_size: int = 8
    # 0 = batch only what is already queued (no added latency at low load); >0 waits for more.
    batch_wait_ms: float = 0.0
    min_replicas: int = 0
    max_replicas: int = 4
    keep_alive_s: float = 30.0
    # Requests a replica may hold at once (its credits); the autoscaler's per-replica target.
    replica_concurrency: int = 16
    timeout_s: float = 60.0
    # Most pipeline stages a cold start may split the model into (1 = never partition; the
    # model needs per-layer profiles for more, see flashpoint/policy/partitioning.py).
    max_stages: int = 1
    # Fraction of one device's compute a replica reserves (placement never over-commits it);
    # 0 = not reserved (a replica may share a device with others freely).
    compute: float = 0.0
    # Latency objective of a strict request, end to end in the controller (queueing and any
    # cold start included); 0 = none. Compliance is counted for strict requests only.
    slo_ms: float = 0.0
    # GPU sharing (hosts with [host] gpu_sharing = "mps" | "tokens"; placed by the policy of
    # [controller] share_policy, flashpoint/policy/share_placement.py). sm_share: fraction of
    # SMs a replica needs (Dilu: its request); 0 = no share, a device as before. sm_limit:
    # its cap (Dilu's limit; 0 = sm_share). time_quota: its fraction of GPU time (FaST's
    # quota; 0 = the whole window). gpu_memory_bytes: its device memory cap (0 = the model's
    # bytes plus the controller's replica overhead).
    sm_share: float = 0.0
    sm_limit: float = 0.0
    time_quota: float = 0.0
    gpu_memory_bytes: int = 0
    # FaST-GShare profile (FastProfileSpec): without an explicit sm_share, the controller
    # picks the replica's SM share and time quota from it and slo_ms (RPR's most efficient
    # configuration meeting the SLO: policy/share_placement.resolve_share, which asks
    # policy/fastgshare.share_from_profile).
    fast_profile: FastProfileSpec | None = None
    # PROTEAN's Solo time and FBR per slice type, and Dilu's HGSS <request, limit>: measured
    # by `flashpoint profile` (controller/profiler.py) like fast_profile, or given here.
    protean_profile: ProteanProfileSpec | None = None
    dilu_profile: DiluProfileSpec | None = None
    # Dilu's tenant class of a shared replica (policy/klc.py): "slo" (default) is never
    # throttled; "best_effort" gives way on a tokens host: while an SLO tenant of the same
    # GPU is active it is held to (KLC factor x) its request, its limit only once they idle.
    tenant_class: TenantClass = TenantClass.SLO
    # PROTEAN's per-batch device memory of this model (profiled; 0 = the replica's bytes):
    # the footprint the MIG reconfigurator turns best-effort demand into (policy/protean.py).
    batch_memory_bytes: int = 0
    # PROTEAN's fractional bandwidth requirement of one batch of this model (Eq. 1, fitted
    # from co-location runs by policy/protean_fit.py; 0 = not profiled): the interference
    # term of η when the dispatcher routes requests over MIG slices (policy/slice_dispatch.py).
    batch_fbr: float = 0.0
    # Version roll-outs (policy/rollout.py): the percentage of requests, and of replicas, sent
    # to model_version while replicas of the version registered before it serve the rest (a
    # canary); 100 = roll every replica to model_version, one at a time.
    canary_pct: float = 100.0
    inputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    outputs: tuple[TensorSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        validate_name(self.name, "function name")
        validate_name(self.model, "model name")
        validate_version(self.model_version)
        if not 1 <= self.max_batch_size <= 1024:
            raise BadRequest("max_batch_size must be in 1..1024")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise BadRequest("batch_wait_ms must be in 0..1000")
        if not 0 <= self.min_replicas <= self.max_replicas <= 1024 or self.max_replicas < 1:
            raise BadRequest("need 0 <= min_replicas <= max_replicas, max_replicas >= 1")
        if not 0 <= self.keep_alive_s <= 86400:
            raise BadRequest("keep_alive_s must be in 0..86400")
        if not 1 <= self.replica_concurrency <= 4096:
            raise BadRequest("replica_concurrency must be in 1..4096")
        if not 0 < self.timeout_s <= 3600:
            raise BadRequest("timeout_s must be in (0, 3600]")
        if not 1 <= self.max_stages <= 64:
            raise BadRequest("max_stages must be in 1..64")
        if not 0.0 <= self.compute <= 1.0:
            raise BadRequest("compute must be a fraction in [0, 1]")
        if not 0.0 <= self.slo_ms <= 3_600_000:
            raise BadRequest("slo_ms must be in [0, 3600000]")
        if not (0.0 <= self.sm_share <= 1.0 and 0.0 <= self.time_quota <= 1.0):
            raise BadRequest("sm_share and time_quota must be fractions in [0, 1]")
        if self.sm_limit and not self.sm_share <= self.sm_limit <= 1.0:
            raise BadRequest("sm_limit must be 0 or within [sm_share, 1]")
        if self.gpu_memory_bytes < 0:
            raise BadRequest("gpu_memory_bytes must be >= 0")
        if (self.sm_limit or self.time_quota or self.gpu_memory_bytes) and not (
                self.sm_share or self.fast_profile or self.dilu_profile):
            raise BadRequest("sm_limit, time_quota and gpu_memory_bytes need an sm_share "
                             "(or a fast_profile or dilu_profile to choose it from)")
        try:  # the API gives a string; stored as the enum
            object.__setattr__(self, "tenant_class", TenantClass(self.tenant_class))
        except ValueError:
            raise BadRequest(f"tenant_class {self.tenant_class!r}: one of "
                             f"{[c.value for c in TenantClass]}") from None
        if self.tenant_class is TenantClass.BEST_EFFORT and not (
                self.sm_share or self.fast_profile or self.dilu_profile):
            raise BadRequest("tenant_class 'best_effort' needs an sm_share (or a "
                             "fast_profile or dilu_profile): the class is enforced on a "
                             "shared GPU")
        if self.fast_profile is not None:
            self.fast_profile.to_profile(self.name)  # a broken grid is refused at registration
        if self.batch_memory_bytes < 0:
            raise BadRequest("batch_memory_bytes must be >= 0")
        if not 0.0 <= self.batch_fbr <= 100.0:
            raise BadRequest("batch_fbr must be in [0, 100]")
        if not 0.0 < self.canary_pct <= 100.0:
            raise BadRequest("canary_pct must be a percentage in (0, 100]")

    @property
    def model_key(self) -> ModelKey:
        """``model@version``: how caches, transfers and roll-outs name a model version."""
        return ModelKey.of(self.model, self.model_version)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = [t.to_dict() for t in self.inputs]
        d["outputs"] = [t.to_dict() for t in self.outputs]
        d["fast_profile"] = self.fast_profile.to_dict() if self.fast_profile else None
        d["protean_profile"] = self.protean_profile.to_dict() if self.protean_profile else None
        d["dilu_profile"] = self.dilu_profile.to_dict() if self.dilu_profile else None
        d["tenant_class"] = self.tenant_class.value
        return d

    @classmethod
    def from_dict(cls, d: Any) -> FunctionSpec:
        """Build from untrusted data; unknown keys and wrong types are a BadRequest."""
        if not isinstance(d, dict):
            raise BadRequest("function spec must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise BadRequest(f"unknown function fields: {sorted(unknown)}")
        kw: dict[str, Any] = dict(d)
        for key in ("inputs", "outputs"):
            raw = kw.get(key, [])
            if not isinstance(raw, list) or len(raw) > 64:
                raise BadRequest(f"{key} must be a list of at most 64 tensor specs")
            kw[key] = tuple(TensorSpec.from_dict(t) for t in raw)
        if kw.get("fast_profile") is not None:
            kw["fast_profile"] = FastProfileSpec.from_dict(kw["fast_profile"])
        if kw.get("protean_profile") is not None:
            kw["protean_profile"] = ProteanProfileSpec.from_dict(kw["protean_profile"])
        if kw.get("dilu_profile") is not None:
            kw["dilu_profile"] = DiluProfileSpec.from_dict(kw["dilu_profile"])
        for key in ("max_batch_size", "min_replicas", "max_replicas", "replica_concurrency",
                    "max_stages", "gpu_memory_bytes", "batch_memory_bytes"):
            if key in kw and (not isinstance(kw[key], int) or isinstance(kw[key], bool)):
                raise BadRequest(f"{key} must be an integer")
        for key in ("batch_wait_ms", "keep_alive_s", "timeout_s", "compute", "slo_ms",
                    "sm_share", "sm_limit", "time_quota", "canary_pct", "batch_fbr"):
            if key in kw and (not isinstance(kw[key], (int, float)) or isinstance(kw[key], bool)):
                raise BadRequest(f"{key} must be a number")
        for key in ("name", "model", "model_version", "tenant_class"):
            if key in kw and not isinstance(kw[key], str):
                raise BadRequest(f"{key} must be a string")
        if "name" not in kw or "model" not in kw:
            raise BadRequest("function spec needs 'name' and 'model'")
        return cls(**kw)
