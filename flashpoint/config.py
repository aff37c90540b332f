"""Typed configuration: frozen dataclasses with unit-suffixed fields, loaded from TOML.

Every field has an embedded default, so ``flashpoint up`` needs no file at all. A TOML file
(see ``configs/``) overrides sections by name; unknown sections or keys are an error rather
than silently ignored.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from flashpoint.config_check import check_section, check_value, refuse_unknown
from flashpoint.credentials import apply_credentials
from flashpoint.errors import BadRequest
from flashpoint.policy.autoscale import make_autoscaler

DEFAULT_HOME = Path(os.environ.get("FLASHPOINT_HOME", Path.home() / ".flashpoint"))
SECRET_ENV = "FLASHPOINT_SECRET"  # overrides the config file's secret when set
LOOPBACK = ("127.0.0.1", "::1", "localhost")
MIN_SECRET_BYTES = 32  # random bytes a cluster secret must carry (64 hex digits)
# This process's own random secret: the default of a config that names none. A local,
# loopback-only cluster runs on it (and hands it to the workers it spawns); nothing may
# listen beyond loopback with it. No fixed secret exists anywhere.
_RUN_SECRET = secrets.token_hex(MIN_SECRET_BYTES)
# Values copied from examples and docs: refused whatever their length.
_PLACEHOLDERS = ("change-me", "changeme", "change_me", "replace-with", "replace-me",
                 "replaceme", "placeholder", "example", "your-", "flashpoint-local-dev-secret",
                 "insecure", "password", "xxxxxxxx")


def generate_secret() -> str:
    """A fresh cluster secret (or API key): 32 random bytes as 64 hex digits."""
    return secrets.token_hex(MIN_SECRET_BYTES)


def run_secret() -> str:
    """This process's random secret (what a config with no ``secret`` gets)."""
    return _RUN_SECRET


def is_placeholder(value: str) -> bool:
    """A value copied from an example (``change-me``, ``replace-with-admin-key``...)."""
    low = value.strip().lower()
    return not low or any(p in low for p in _PLACEHOLDERS)


def _secret_bytes(secret: str) -> int:
    """How many random bytes ``secret`` can carry at most, from its alphabet: hex digits
    4 bits each, base64 6, anything else 8 (a passphrase is counted generously)."""
    chars = set(secret)
    if chars <= set(string.hexdigits):
        return len(secret) // 2
    if chars <= set(string.ascii_letters + string.digits + "+/-_="):
        return len(secret.rstrip("=")) * 6 // 8
    return len(secret.encode())


def validate_secret(secret: str, what: str = "the cluster secret") -> None:
    """Refuse known placeholders and secrets shorter than MIN_SECRET_BYTES random bytes."""
    hint = "generate one with `flashpoint secret generate`"
    if is_placeholder(secret):
        raise BadRequest(f"{what} is a placeholder or empty; {hint}")
    if _secret_bytes(secret) < MIN_SECRET_BYTES or len(set(secret)) < 12:
        raise BadRequest(f"{what} is too short or too regular (at least {MIN_SECRET_BYTES} "
                         f"random bytes: 64 hex digits); {hint}")


def secret_from_env(var: str = SECRET_ENV) -> bytes:
    """The cluster secret a stand-alone process (transfer node, stage server) reads from the
    environment variable ``var``: there is no fallback, and a weak one is refused. Raises
    SystemExit with a one-line message (these are command-line entry points)."""
    value = os.environ.get(var, "")
    if not value:
        raise SystemExit(f"error: no cluster secret: set {var} (`flashpoint secret generate`)")
    try:
        validate_secret(value, f"the secret in {var}")
    except BadRequest as e:
        raise SystemExit(f"error: {e.message}") from None
    return value.encode()


def is_loopback(listen_host: str) -> bool:
    if listen_host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        return False


def check_http_auth(api_keys: Any, listen_host: str, insecure: bool, what: str) -> None:
    """Refuse an HTTP API without API keys beyond loopback (every caller would be an
    anonymous admin) unless ``insecure``; with ``insecure``, log a warning at every start."""
    if insecure:
        from flashpoint.log import get_logger

        get_logger(__name__).warning(
            "insecure_http", what=what, listen_host=listen_host, api_keys=len(api_keys),
            note="--insecure: without api_keys every HTTP caller beyond loopback is an admin")
        return
    if not api_keys and not is_loopback(listen_host):
        raise BadRequest(f"{what} listens on {listen_host} without [gateway] api_keys (every "
                         "caller would be an admin); set api_keys (`flashpoint secret "
                         "generate` makes one) or pass --insecure")


def check_secret(secret: str, listen_host: str, what: str) -> None:
    """Refuse to listen beyond loopback on this process's generated secret (no secret was
    configured: peers elsewhere could never share it, and the operator meant to set one)."""
    if secret == _RUN_SECRET and not is_loopback(listen_host):
        raise BadRequest(f"{what} listens on {listen_host} with no cluster secret configured; "
                         f"set {SECRET_ENV} (`flashpoint secret generate`)")
    validate_secret(secret)


@dataclass(frozen=True)
class ControllerConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    state_path: str = str(DEFAULT_HOME / "state.sqlite")
    heartbeat_timeout_s: float = 5.0
    # Every worker is pinged on its RPC connection each worker_ping_interval_s; one that does
    # not answer within worker_ping_timeout_s (stopped, wedged, partitioned) is dropped and
    # its in-flight requests re-sent elsewhere: detection within interval + timeout.
    worker_ping_interval_s: float = 0.5
    worker_ping_timeout_s: float = 1.5
    loop_interval_s: float = 0.1
    cold_start_timeout_s: float = 120.0
    # A function whose replicas fail to start max_start_failures times in a row starts none
    # for start_backoff_s (doubled each further failure, at most start_backoff_max_s); what
    # waits for it meanwhile fails with model_load_failed (controller/state/core.py).
    max_start_failures: int = 3
    start_backoff_s: float = 10.0
    start_backoff_max_s: float = 300.0
    max_queued_per_function: int = 10_000
    deploy_timeout_s: float = 180.0
    # Device memory a replica needs beyond its model bytes (activations, workspace); the
    # controller places with it and hosts reserve with it, so both agree on what fits.
    replica_overhead_bytes: int = 64 << 20
    # The cost model partition plans are solved with (seed 004 §4.2.2; functions opt in with
    # max_stages > 1): the worst-case rate at which a stage's weights arrive (the thesis's
    # 2.2 Gbit/s from S3), the GPU-to-GPU rate for activations, and the fixed cost of starting
    # one stage (process, context, module build) and of one activation hop.
    # Stop replicas a host reports that this controller never placed (e.g. a stop that was
    # lost). Off only for tests that deploy to hosts directly.
    stop_unknown_replicas: bool = True
    # Prices for the cost meter: PROTEAN Table 3's 8xA100 $/hour of this cloud (aws, azure,
    # gcp), unless overridden per kind (> 0).
    cloud: str = "aws"
    spot_price_usd_per_hour: float = 0.0
    ondemand_price_usd_per_hour: float = 0.0
    # A draining host's replicas stop taking work at least this long before its deadline.
    drain_margin_s: float = 10.0
    # Live migration (controller/migration.py): how long a move to another replica waits for
    # the destination to prefill the sequence ahead ("park") before the source stops anyway
    # (0 = single-round moves: the destination prefills inside the gap), and how long a
    # worker keeps a park that nothing resumes.
    migration_park_wait_s: float = 2.0
    migration_park_ttl_s: float = 10.0
    # At most this many park rounds a move: each later one parks a new snapshot (the tokens
    # generated during the round before), so the resume has fewer to add in the gap.
    migration_park_rounds: int = 3
    # A sequence moving alone is parked only from this many tokens so far (0: every move to
    # a replica is parked). Parking a short lone sequence still shortens its gap (the
    # extension pass costs less than the prefill it replaces: bench/RESULTS.md); a model
    # whose forward pass is mostly fixed cost may set this to skip the extra round trips.
    migration_park_min_tokens: int = 0
    # TLS for the gateway and the RPC endpoint (both on one port): certificate and key files
    # (PEM). Empty = plain HTTP / ws:// (loopback clusters, or TLS terminated in front).
    tls_cert_path: str = ""
    tls_key_path: str = ""
    # Longest TCP chain the sourcing plan builds (0 = no cap); see flashpoint/policy/sourcing.py.
    max_chain_length: int = 8
    # The autoscaler plug-in (flashpoint/policy/autoscale.py: concurrency, atl, tsk, owk,
    # smstar, eq412, dilu, rpr, tokens) and its parameters, plus the wrapper's (scale_up_delay_s,
    # scale_down_delay_s, keep_alive_partial); checked when the config is built.
    autoscaler: str = "concurrency"
    autoscaler_params: dict[str, float] = field(default_factory=dict)
    partition_bandwidth_bps: float = 2.2e9
    partition_link_bps: float = 7.5e9
    partition_overhead_s: float = 0.5
    partition_link_latency_s: float = 0.0005
    # Kernel-as-a-Service (flashpoint/kaas/): how many KaaS executor replicas the controller
    # keeps placed on workers (0 = none: /v1/kaas/invoke answers 503 kaas_unavailable), each
    # with a device buffer cache of kaas_cache_bytes (placement reserves it plus
    # replica_overhead_bytes), scheduled by the named pool policy (policy/kaas.py), with
    # the object store (controller RAM) bounded by kaas_store_bytes in all and
    # kaas_store_key_bytes per API key (its namespace; 0 = unbounded), objects expiring
    # kaas_object_ttl_s after their put unless it names a shorter ttl_s (0 = never).
    kaas_workers: int = 0
    kaas_cache_bytes: int = 256 << 20
    kaas_policy: str = "affinity"
    kaas_store_bytes: int = 4 << 30
    kaas_store_key_bytes: int = 1 << 30
    kaas_object_ttl_s: float = 86400.0
    # How replicas of functions with an sm_share are placed on sharing hosts' GPUs
    # (flashpoint/policy/share_placement.py): "fastgshare" (MaxRects) or "dilu" (best fit).
    share_policy: str = "fastgshare"
    # MIG reconfiguration driven by PROTEAN's Alg. 2 (controller/state/mig_reconfig.py; opt-in): every
    # mig_interval_s the reconfigurator judges each MIG GPU (a change after mig_wait_limit
    # consecutive mismatches, EWMA weight mig_alpha, at most mig_fleet_fraction of the GPUs
    # at once); a GPU to change is drained (replacements elsewhere first; its replicas
    # retired at the latest after mig_drain_grace_s; the change abandoned after
    # mig_drain_timeout_s), then the host's apply_mig is called (mig_apply_timeout_s).
    mig_reconfigure: bool = False
    mig_interval_s: float = 5.0
    mig_wait_limit: int = 3
    mig_alpha: float = 0.5
    mig_fleet_fraction: float = 0.3
    mig_drain_grace_s: float = 30.0
    mig_drain_timeout_s: float = 120.0
    mig_apply_timeout_s: float = 120.0
    # PROTEAN's job distribution (Alg. 1, flashpoint/policy/slice_dispatch.py) in the
    # dispatcher: "protean" routes the requests of a function whose accepting replicas all
    # sit on MIG slices (strict ones to the slice of least slowdown η, best-effort ones
    # packed into the smallest slices); "least_loaded" routes them as anywhere else.
    # Functions with a replica off MIG are routed least-loaded either way.
    slice_dispatch: str = "protean"
    # PROTEAN's T_low and T_high, BE occupancies (0 <= t_low < t_high <= 1), for both
    # algorithms: Alg. 2 keeps (4g,2g,1g) only while the predicted BE occupancy of [1g,2g]
    # lies between them; Alg. 1 keeps strict requests off a slice tagged above t_high and
    # ignores a BE tag below t_low for strict work.
    protean_t_low: float = 0.05
    protean_t_high: float = 0.95

    def __post_init__(self) -> None:
        make_autoscaler(self.autoscaler, self.autoscaler_params)  # BadRequest names the fault
        if not (self.worker_ping_interval_s > 0 and self.worker_ping_timeout_s > 0):
            raise BadRequest("controller: worker_ping_interval_s and worker_ping_timeout_s "
                             "must be > 0")
        if not (self.max_start_failures >= 1
                and 0 < self.start_backoff_s <= self.start_backoff_max_s):
            raise BadRequest("controller: max_start_failures >= 1 and "
                             "0 < start_backoff_s <= start_backoff_max_s")
        if not (self.mig_interval_s > 0 and self.mig_wait_limit >= 0
                and 0 < self.mig_alpha <= 1 and 0 < self.mig_fleet_fraction <= 1
                and 0 <= self.mig_drain_grace_s <= self.mig_drain_timeout_s
                and self.mig_apply_timeout_s > 0):
            raise BadRequest("controller.mig_*: interval_s > 0, wait_limit >= 0, alpha and "
                             "fleet_fraction in (0, 1], 0 <= drain_grace_s <= "
                             "drain_timeout_s, apply_timeout_s > 0")
        if not 0.0 <= self.protean_t_low < self.protean_t_high <= 1.0:
            raise BadRequest("controller.protean_t_low and protean_t_high: need 0 <= t_low < "
                             f"t_high <= 1, got {self.protean_t_low} and {self.protean_t_high}")
        from flashpoint.policy.share_placement import POLICY_NAMES as SHARE_POLICIES

        if self.share_policy not in SHARE_POLICIES:
            raise BadRequest(f"controller.share_policy {self.share_policy!r}: one of "
                             f"{list(SHARE_POLICIES)}")
        from flashpoint.policy.kaas import POLICY_NAMES

        if self.kaas_policy not in POLICY_NAMES:
            raise BadRequest(f"controller.kaas_policy {self.kaas_policy!r}: one of "
                             f"{list(POLICY_NAMES)}")
        if (self.kaas_workers < 0 or self.kaas_cache_bytes <= 0 or self.kaas_store_bytes < 0
                or self.kaas_store_key_bytes < 0 or not self.kaas_object_ttl_s >= 0):
            raise BadRequest("controller.kaas_workers, kaas_store_bytes, kaas_store_key_bytes "
                             "and kaas_object_ttl_s must be >= 0, kaas_cache_bytes > 0")


@dataclass(frozen=True)
class HostConfig:
    host_id: str = ""  # empty = hostname
    leaf: str = ""  # the leaf switch (rack) this host hangs off; placement prefers same-leaf
    kind: str = "ondemand"  # "spot" or "ondemand": what it costs (flashpoint/spot/cost.py)
    # Eviction-notice triggers, comma-separated: "imds", "file:<path>", "signal" (SIGUSR1 to
    # `flashpoint host`); empty = none. See flashpoint/spot/notice.py.
    spot_notice: str = ""
    imds_endpoint: str = "http://169.254.169.254"
    spot_poll_interval_s: float = 2.0
    # CA file (PEM) that signed the controller's certificate, for a wss:// controller_url with
    # a cluster-private CA (empty = the system trust store). Passed on to its workers.
    tls_ca_path: str = ""
    controller_url: str = "ws://127.0.0.1:8080/rpc"
    listen_host: str = "127.0.0.1"  # local RPC endpoint for this host's workers
    cpu_devices: int = 2  # placement units offered when no GPU is present
    device_memory_bytes: int = 4 << 30  # per CPU device
    host_memory_bytes: int = 16 << 30
    cache_dir: str = ""  # empty = /dev/shm/flashpoint-<uid>-<host_id>-<pid> (0700), else a temp dir
    cache_bytes: int = 8 << 30
    heartbeat_interval_s: float = 1.0
    warm_pool_size: int = 2  # pre-started worker processes with torch imported
    # Intra-op threads per worker; 0 = auto: a CPU-only host's cores (``cpu_cores``) divided
    # among its CPU devices, one on a GPU host (policy/cpu_threads.py).
    torch_threads: int = 0
    cpu_cores: int = 0  # cores this host's CPU devices share; 0 = those this process may use
    # Idle warm-pool workers import transformers too (~2 s of CPU each), so a Hugging Face
    # model's cold start pays for bytes, not imports. Off: its first cold start imports it.
    preload_transformers: bool = True
    worker_start_timeout_s: float = 60.0
    # After a cold start the warm pool refills once the new replica has answered its first
    # request (a Python+torch start would take the CPU that request runs on), or after this
    # long at most.
    refill_hold_s: float = 2.0
    # Data plane (model bytes between hosts): where this host's chain/peer server listens, and
    # the address peers should dial (empty = the listen address).
    data_listen_host: str = "127.0.0.1"
    data_port: int = 0  # 0 = any free port
    data_advertise_host: str = ""
    chain_wait_s: float = 30.0  # a chain receiver waits this long for its chain to begin
    chain_stall_timeout_s: float = 10.0  # a hop that moves no byte for this long is dead
    orphan_grace_s: float = 2.0  # after losing its upstream, wait this long for a splice
    worker_memory_bytes: int = 256 << 20  # host RAM reserved per worker process
    # Registry pulls read this many bytes per ranged GET (several chunks): object stores
    # favour few large requests; smaller spans let a stage start sooner (execute-while-load).
    registry_span_bytes: int = 32 << 20
    # A partition stage's completion fill and warm-pool refill wait for its group's first
    # answer (the controller's begin_completion), at most this long; 0 = start at once
    # (flashpoint/host/stage_hold.py says why).
    completion_hold_s: float = 5.0
    # GPU sharing (flashpoint/gpu/host_sharing.py): "none" (workers bound to their GPU or
    # MIG slice by UUID), "mps" (an MPS control daemon per GPU/slice; workers get their SM
    # share and memory limit), "tokens" (a time-token manager per GPU/slice; workers start
    # with the hook preloaded). Shares come with each deploy from the controller.
    gpu_sharing: str = "none"
    sharing_dir: str = ""  # MPS pipes/logs and token sockets; empty = a short /tmp dir
    mps_health_interval_s: float = 5.0
    # Fake NVML GPUs of these models (flashpoint/gpu/mig_profiles.py names, e.g.
    # "A100-40GB") instead of the real inventory: tests and demos of sharing and MIG on
    # machines without GPUs. Their workers compute on the CPU; the GPU environment (binding,
    # MPS, hook) is built exactly as for real GPUs. MIG on/off for all of them.
    fake_gpus: list[str] = field(default_factory=list)
    fake_gpu_mig: bool = False
    # Replicas of one model on one GPU share its weights through CUDA IPC (the first exports,
    # the others map; flashpoint/gpu/weight_share.py). Real GPUs only. The exporter must
    # outlive its readers: stopping it first is logged (its readers must be restarted).
    share_weights: bool = False
    # Prometheus endpoint of this host process ("host:port", port 0 = any free one; empty =
    # none): the model cache, transfers, RPC and token-manager metrics live here.
    metrics_listen: str = ""

    def __post_init__(self) -> None:
        from flashpoint.exposition import parse_listen
        from flashpoint.gpu.host_sharing import parse_mode

        if self.metrics_listen:
            parse_listen(self.metrics_listen)
        from flashpoint.policy.mig_table import SPECS

        parse_mode(self.gpu_sharing)  # BadRequest names the choices
        bad = [m for m in self.fake_gpus if m not in SPECS]
        if bad:
            raise BadRequest(f"host.fake_gpus {bad}: models are {sorted(SPECS)}")
        if self.completion_hold_s < 0:
            raise BadRequest("host.completion_hold_s must be >= 0")
        if self.refill_hold_s < 0:
            raise BadRequest("host.refill_hold_s must be >= 0")
        if self.mps_health_interval_s <= 0:
            raise BadRequest("host.mps_health_interval_s must be > 0")


@dataclass(frozen=True)
class RegistryConfig:
    kind: str = "local"  # "local" | "s3"
    root: str = str(DEFAULT_HOME / "registry")  # kind "local"
    bucket: str = ""  # kind "s3" (required); credentials come from boto3's standard chain
    prefix: str = ""  # kind "s3": key prefix inside the bucket
    endpoint_url: str = ""  # kind "s3": empty = AWS; else an S3-compatible endpoint
    region: str = ""  # kind "s3": empty = boto3's default


MIB = 1024 * 1024
GATEWAY_ROLES = ("invoke", "admin")


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway's one configuration: the ``[gateway]`` table of the cluster's TOML.

    It serves the gateway the controller embeds and the stand-alone one (``flashpoint
    gateway``), whose process-level settings (where it listens, the controller it forwards to,
    TLS, how often it re-reads the function table) the embedded one ignores.
    ``api_keys`` maps a secret key to its role (``"invoke"`` or ``"admin"``); an empty mapping
    disables auth (the local embedded default: every caller is an admin).
    """

    api_keys: Mapping[str, str] = field(default_factory=dict)
    # Raw (possibly compressed) request body.
    max_body_bytes: int = 64 * MIB
    # A compressed body may inflate to at most this many bytes (zip bombs stop here).
    max_decompressed_bytes: int = 64 * MIB
    # Decoded input tensors of one request, summed (numpy bytes, BF16 counted as float32).
    max_tensor_bytes: int = 256 * MIB
    max_json_depth: int = 32
    max_inputs: int = 64
    max_dims: int = 8
    # Request deadline when neither the request nor the function spec names one.
    default_timeout_s: float = 60.0
    # Upper bound on any request deadline, whatever the request asks for.
    max_timeout_s: float = 3600.0
    # The gateway's own backstop fires this long after the deadline passed to the backend.
    deadline_grace_s: float = 1.0
    # Reading the whole request body (slow clients) must finish within this.
    body_read_timeout_s: float = 30.0
    # Invocations in flight at once across all callers; 0 = unlimited. Over it: 429.
    max_inflight_requests: int = 0
    # Token bucket per caller (API key, or peer address without auth); 0 = off. Over it: 429.
    rate_limit_rps: float = 0.0
    rate_limit_burst: int = 0
    # Responses at least this large are gzip-compressed when the client accepts gzip.
    response_compression_min_bytes: int = 1024
    # /metrics answers only callers with an API key (any role) when keys are configured.
    metrics_require_key: bool = False
    # Admin actions (register, delete, roll-out, MIG change) are logged as "audit" events;
    # with a path they are also appended there as JSON lines (flashpoint/audit.py).
    audit_log_path: str = ""
    # A stand-alone gateway process (``flashpoint gateway``): where it listens, and the
    # controller's RPC URL (empty: ws://<controller.listen_host>:<controller.listen_port>/rpc).
    listen_host: str = "127.0.0.1"
    listen_port: int = 8081
    controller_url: str = ""
    refresh_s: float = 0.5  # how often it re-reads the function table
    # TLS: serve HTTPS with this certificate chain and key (PEM; empty = plain HTTP), and
    # trust this CA (PEM) for a wss:// controller_url (empty = the system trust store).
    tls_cert_path: str = ""
    tls_key_path: str = ""
    tls_ca_path: str = ""

    def __post_init__(self) -> None:
        keys = dict(self.api_keys)
        # Placeholders first: their message says what to do about the shipped example config.
        bad = [key[:24] for key in keys if isinstance(key, str) and is_placeholder(key)]
        if bad:
            raise BadRequest(f"gateway.api_keys {bad}: placeholders; generate keys with "
                             "`flashpoint secret generate`")
        for key, role in keys.items():
            if not isinstance(key, str) or len(key) < 8:
                raise BadRequest("api keys must be strings of at least 8 characters")
            if role not in GATEWAY_ROLES:
                raise BadRequest(f"api key role must be one of {GATEWAY_ROLES}, not {role!r}")
        object.__setattr__(self, "api_keys", MappingProxyType(keys))
        positive = ("max_body_bytes", "max_decompressed_bytes", "max_tensor_bytes",
                    "max_json_depth", "max_inputs", "max_dims", "default_timeout_s",
                    "max_timeout_s", "body_read_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise BadRequest(f"gateway config {name} must be > 0")
        nonneg = ("deadline_grace_s", "max_inflight_requests", "rate_limit_rps",
                  "rate_limit_burst", "response_compression_min_bytes")
        for name in nonneg:
            if getattr(self, name) < 0:
                raise BadRequest(f"gateway config {name} must be >= 0")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GatewayConfig:
        """Build from a TOML ``[gateway]`` table; unknown keys are an error."""
        return _build(cls, dict(d), "gateway")  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ClusterConfig:
    secret: str = field(default_factory=run_secret)  # no fixed default: see _RUN_SECRET
    log_level: str = "INFO"
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    host: HostConfig = field(default_factory=HostConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    # HTTP without API keys beyond loopback (every caller an admin): only the CLI's
    # --insecure sets it (no config file can), and every start logs a warning.
    insecure: bool = False

    def __post_init__(self) -> None:
        validate_secret(self.secret)

    def with_home(self, home: Path) -> ClusterConfig:
        """The same configuration with every default path moved under ``home``."""
        return dataclasses.replace(
            self,
            controller=dataclasses.replace(self.controller, state_path=str(home / "state.sqlite")),
            registry=dataclasses.replace(self.registry, root=str(home / "registry")),
        )


def _build(cls: type, data: Any, where: str) -> Any:
    """``cls`` from the table ``data`` of ``[where]``, every value checked for type and range
    (flashpoint/config_check.py) before the class's own checks of how fields relate."""
    return cls(**check_section(cls, data, where))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Load a ClusterConfig from TOML (or defaults), then apply nested ``overrides``.

    Any fault (a missing or unparsable file, an unknown key, a value of the wrong type or
    out of range) is one BadRequest line that names the file, the key and what is expected.
    """
    origin = str(path) if path is not None else "config overrides"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise BadRequest(f"cannot read config file {origin}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise BadRequest(f"{origin}: not valid TOML: {e}") from None
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    # Secrets stay out of config files: systemd units pass them as credentials.
    if secret := os.environ.get(SECRET_ENV):
        data["secret"] = secret
    apply_credentials(data)  # systemd's LoadCredential= (the units) wins over both
    sections = {"controller": ControllerConfig, "host": HostConfig,
                "registry": RegistryConfig, "gateway": GatewayConfig}
    try:
        refuse_unknown(data, [*sections, "secret", "log_level"], "the top level")
        kw: dict[str, Any] = {}
        for key, value in data.items():
            if key in sections:
                kw[key] = _build(sections[key], value, key)
            else:
                kw[key] = check_value(key, str, value)
        return ClusterConfig(**kw)
    except BadRequest as e:
        if path is None:
            raise
        raise type(e)(f"{origin}: {e.message}", **e.details) from None
