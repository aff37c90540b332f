"""FaST-GShare multi-token time scheduling (ICPP '23, §3.3.2) as a pure state class.

The token manager (``flashpoint/gpu/tokens.py``) only does I/O: it feeds connections,
requests, releases and clock ticks into :class:`TokenState` and sends the
:class:`Grant` s it returns.  Time is passed in (``now_ns``); nothing here sleeps or reads
a clock, so tests and the simulator drive it directly.

Per client (one hooked process, one connection) the state keeps ``used_ns`` in the
current window.  A tenant's quotas are fractions of the window: ``request`` is guaranteed,
``limit`` caps it.  Quotas apply per client: several processes started with the same
tenant id each get the tenant's quota (a replica is one process).

Approval (the paper's loop, with the digest's corrections):

* a waiting client whose ``used >= limit`` is blocked until the next window;
* the rest are ordered by unmet guarantee ``request - used`` (descending, the paper's
  Q_miss); once every guarantee is met, the excess goes by ``used / request`` ascending,
  i.e. in proportion to the requests.  (Gemini's code orders the excess by raw usage,
  which drifts every tenant toward an equal split; proportional keeps 30/70 at 30/70.)
* tokens go out while the SM shares of all holders sum to <= 100%.  The sum is updated
  **inside** the loop: FaST-Manager's code adds it after the loop and so can approve a set
  above 100% in one pass.  The first client that does not fit stops the pass (the paper's
  wording) so a wide tenant is not starved by narrow ones slipping past it.
* every holder is charged its **full wall-clock** token time.  FaST-Manager divides
  overlapping time by the number of concurrent holders (inherited from single-token
  Gemini), which under-charges everyone under multi-token sharing; each holder's time axis
  is its own.
* overuse (a token used past its quota, reported by the hook) is charged; whatever goes
  past the limit in a window is carried into the next one.
* a token returned early (the tenant synced or went idle) frees its SM share at once.

Best-effort tenants additionally follow Dilu's KLC controller (``policy/klc.py``) when
SLO-sensitive tenants share the GPU: while any SLO tenant of the GPU is active a best-effort
tenant is held to ``factor · request`` (never above its request: the authors' RECOVERY cap,
see ``policy/klc.py``), and it gets its limit back once they have all been idle 600 ms.
SLO-sensitive tenants are never throttled by KLC (in Dilu's code they get ``UPPER`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpoint.policy.klc import KlcConfig, KlcController, KlcPhase, TenantClass

ClientId = int
TenantId = int
_EPS = 1e-9


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's share of one GPU (or slice): fractions of the time window."""

    request: float = 0.0  # guaranteed fraction (Q_request)
    limit: float = 1.0  # cap (Q_limit)
    sm_share: float = 1.0  # SM fraction it occupies while holding a token (S, MPS cap)
    slo_sensitive: bool = False  # Dilu: SLO-sensitive (inference) vs best-effort

    def __post_init__(self) -> None:
        if not (0.0 <= self.request <= self.limit <= 1.0):
            raise ValueError(f"need 0 <= request <= limit <= 1, got {self.request}, {self.limit}")
        if not (0.0 < self.sm_share <= 1.0):
            raise ValueError(f"sm_share must be in (0, 1], got {self.sm_share}")

    @property
    def tenant_class(self) -> TenantClass:
        """Dilu's class of the tenant (metrics and logs name it)."""
        return TenantClass.SLO if self.slo_sensitive else TenantClass.BEST_EFFORT


DEFAULT_QUOTA = TenantQuota()


@dataclass(frozen=True)
class TokenConfig:
    """Scheduling constants.  FaST-Manager's code uses a 10 s window and 250 ms tokens (the
    paper gives neither); for inference-scale bursts we use 100 ms / 10 ms."""

    window_ns: int = 100_000_000
    token_ns: int = 10_000_000
    # A hook checks its token before each launch, so work launched just before expiry
    # runs past it; the hook reports that at its next request (usually within one kernel).
    # Reassigning the SMs only after this grace keeps that overrun from overlapping the
    # next holder; an idle holder costs the GPU at most this much.
    expiry_grace_ns: int = 2_000_000
    klc: KlcConfig = field(default_factory=KlcConfig)


@dataclass(frozen=True)
class Grant:
    """Send GRANT(seq, quota_ns) to ``client``."""

    client: ClientId
    seq: int
    quota_ns: int


@dataclass
class ClientUsage:
    """Per-client accounting, readable by the manager for metrics and tests."""

    tenant: TenantId
    used_ns: int = 0  # in the current window (may start > 0: carried overuse)
    total_ns: int = 0  # lifetime charge
    grants: int = 0


@dataclass
class _Client:
    usage: ClientUsage
    waiting_seq: int | None = None
    waiting_since_ns: int = 0
    holding: bool = False
    granted_at_ns: int = 0
    quota_ns: int = 0
    charged_ns: int = 0  # part of the current/last token already charged
    unsettled: bool = False  # the hook has not yet reported this token's time
    last_active_ns: int = -(10**18)


class TokenState:
    """The token scheduler for one GPU or slice.  Every method returns the grants to send."""

    def __init__(self, config: TokenConfig | None = None, now_ns: int = 0) -> None:
        self.config = config or TokenConfig()
        self.quotas: dict[TenantId, TenantQuota] = {}
        self._clients: dict[ClientId, _Client] = {}
        self._window_start = now_ns
        self._slot_start = now_ns
        self.klc = KlcController(self.config.klc)
        self.tenant_total_ns: dict[TenantId, int] = {}  # lifetime charge, kept after disconnects
        self.tenant_grants: dict[TenantId, int] = {}  # lifetime grants, kept after disconnects

    # ---- configuration (the host / controller calls these live) ----
    def set_quota(self, tenant: TenantId, quota: TenantQuota, now_ns: int) -> list[Grant]:
        """Change a tenant's quotas; takes effect in the next approval (now)."""
        self.quotas[tenant] = quota
        return self._approve(now_ns)

    def quota(self, tenant: TenantId) -> TenantQuota:
        return self.quotas.get(tenant, DEFAULT_QUOTA)

    def effective_quota(self, tenant: TenantId) -> TenantQuota:
        """The quota after Dilu's elasticity: best-effort tenants sharing the GPU with an
        active SLO-sensitive tenant are held to ``factor * request`` (at least the floor);
        when every SLO tenant has been idle 600 ms they may use their full limit."""
        q = self.quota(tenant)
        if q.slo_sensitive or not self.best_effort_throttled():
            return q
        cap = max(self.config.klc.floor * q.limit, min(q.limit, self.klc.factor * q.request))
        return TenantQuota(min(q.request, cap), cap, q.sm_share, q.slo_sensitive)

    def best_effort_throttled(self) -> bool:
        """True while an SLO-sensitive tenant of this GPU is active (connected and not idle
        for ``idle_slots``): best-effort tenants are then held by KLC."""
        return self.klc.phase is not KlcPhase.NONE and not self.klc.slo_idle()

    # ---- stimuli from the wire ----
    def connect(self, client: ClientId, tenant: TenantId, now_ns: int) -> None:
        self._clients[client] = _Client(ClientUsage(tenant))

    def disconnect(self, client: ClientId, now_ns: int) -> list[Grant]:
        self._clients.pop(client, None)
        return self._approve(now_ns)

    def request(self, client: ClientId, seq: int, used_ns: int, now_ns: int) -> list[Grant]:
        """REQUEST: settle the previous token with the hook's ``used_ns``, then wait."""
        c = self._clients.get(client)
        if c is None:
            return []
        self._settle(c, used_ns, now_ns)
        c.waiting_seq = seq
        c.waiting_since_ns = now_ns
        c.last_active_ns = now_ns
        return self._approve(now_ns)

    def release(self, client: ClientId, used_ns: int, now_ns: int) -> list[Grant]:
        """RELEASE: early return of the token (the tenant synced)."""
        c = self._clients.get(client)
        if c is None:
            return []
        self._settle(c, used_ns, now_ns)
        return self._approve(now_ns)

    def tick(self, now_ns: int) -> list[Grant]:
        """Clock: window roll, token expiry, KLC slots.  Call at :meth:`next_deadline_ns`."""
        self._roll_window(now_ns)
        self._run_slots(now_ns)
        for c in self._clients.values():
            if c.holding and now_ns >= c.granted_at_ns + c.quota_ns + self.config.expiry_grace_ns:
                # Expired without a report: free its SMs and charge the quota for now;
                # the hook's later report corrects it (overuse included).
                c.holding = False
                self._charge(c, c.quota_ns - c.charged_ns)
        return self._approve(now_ns)

    def next_deadline_ns(self) -> int:
        """When :meth:`tick` must run next (window end, earliest expiry or next slot)."""
        t = self._window_start + self.config.window_ns
        if any(self.quota(c.usage.tenant).slo_sensitive for c in self._clients.values()):
            t = min(t, self._slot_start + self.config.klc.slot_ns)
        for c in self._clients.values():
            if c.holding:
                t = min(t, c.granted_at_ns + c.quota_ns + self.config.expiry_grace_ns)
        return t

    # ---- views ----
    def usage(self) -> dict[ClientId, ClientUsage]:
        return {k: c.usage for k, c in self._clients.items()}

    def holders(self) -> list[ClientId]:
        return [k for k, c in self._clients.items() if c.holding]

    def waiting(self) -> list[ClientId]:
        return [k for k, c in self._clients.items() if c.waiting_seq is not None]

    # ---- internals ----
    def _charge(self, c: _Client, delta_ns: int) -> None:
        c.charged_ns += delta_ns
        t = c.usage.tenant
        self.tenant_total_ns[t] = max(0, self.tenant_total_ns.get(t, 0) + delta_ns)
        c.usage.used_ns = max(0, c.usage.used_ns + delta_ns)
        c.usage.total_ns = max(0, c.usage.total_ns + delta_ns)

    def _settle(self, c: _Client, used_ns: int, now_ns: int) -> None:
        if c.unsettled:
            if used_ns > 0:
                actual = used_ns
            elif c.holding:
                actual = now_ns - c.granted_at_ns
            else:
                actual = c.charged_ns
            self._charge(c, actual - c.charged_ns)
        c.unsettled = False
        c.holding = False

    def _roll_window(self, now_ns: int) -> None:
        w = self.config.window_ns
        if now_ns < self._window_start + w:
            return
        boundary = self._window_start + w
        for c in self._clients.values():
            if c.holding:  # the part of a running token before the boundary belongs here
                self._charge(c, max(0, boundary - c.granted_at_ns - c.charged_ns))
        windows = (now_ns - self._window_start) // w
        for c in self._clients.values():
            limit_ns = int(self.effective_quota(c.usage.tenant).limit * w)
            # overuse past the limit is charged back to the following window(s)
            c.usage.used_ns = max(0, c.usage.used_ns - windows * limit_ns)
        self._window_start += windows * w

    def _run_slots(self, now_ns: int) -> None:
        slot = self.config.klc.slot_ns
        slo = {c.usage.tenant for c in self._clients.values() if self.quota(c.usage.tenant).slo_sensitive}
        n = (now_ns - self._slot_start) // slot
        if n <= 0:
            return
        for i in range(min(n, 2 * self.config.klc.idle_slots)):  # bounded catch-up
            start = self._slot_start + i * slot
            active = {c.usage.tenant for c in self._clients.values()
                      if c.holding or c.waiting_seq is not None or c.last_active_ns >= start}
            self.klc.observe_slot(active, slo)
        self._slot_start += n * slot

    def _approve(self, now_ns: int) -> list[Grant]:
        w = self.config.window_ns
        sm_used = sum(self.quota(c.usage.tenant).sm_share for c in self._clients.values() if c.holding)
        ready: list[tuple[tuple[int, float, int], ClientId, _Client, int]] = []
        for k, c in self._clients.items():
            if c.waiting_seq is None or c.holding:
                continue
            q = self.effective_quota(c.usage.tenant)
            remain = int(q.limit * w) - c.usage.used_ns
            if remain <= 0:
                continue  # blocked until the next window
            missing = q.request * w - c.usage.used_ns
            if missing > 0:
                key = (0, -missing, c.waiting_since_ns)
            else:
                key = (1, c.usage.used_ns / max(q.request, _EPS), c.waiting_since_ns)
            ready.append((key, k, c, remain))
        ready.sort(key=lambda r: r[0])
        grants = []
        for _key, k, c, remain in ready:
            sm = self.quota(c.usage.tenant).sm_share
            if sm_used + sm > 1.0 + _EPS:
                break
            sm_used += sm
            # never past the limit: what would overrun it is charged back as overuse anyway
            quota_ns = min(self.config.token_ns, remain)
            grants.append(Grant(k, c.waiting_seq or 0, quota_ns))
            c.waiting_seq = None
            c.holding = True
            c.unsettled = True
            c.granted_at_ns = now_ns
            c.quota_ns = quota_ns
            c.charged_ns = 0
            c.last_active_ns = now_ns
            c.usage.grants += 1
            self.tenant_grants[c.usage.tenant] = self.tenant_grants.get(c.usage.tenant, 0) + 1
        return grants
