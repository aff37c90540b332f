"""Per-tenant device-memory accounting for the token manager (pure; no I/O, no clock).

Every hooked process reports the device bytes it holds after each allocation or free
(``MEM`` messages, ``gpu/hook/fp_protocol.h``). A tenant (one replica) may run several
processes; with a tenant limit, each of its processes may hold at most
``limit - Σ bytes its other processes hold`` — its *cap*, which the manager sends to it
whenever it changes and right after it connects. A cap is never 0 on the wire (0 means "no
tenant limit"): a process with no room left gets 1 byte, so any allocation fails.

Consistency: a cap is as fresh as the reports behind it, so two processes of one tenant
allocating at the same instant may overshoot the limit briefly; the hook's own
per-process limit (``FP_HOOK_MEM_LIMIT_BYTES``) still holds strictly.
"""

from __future__ import annotations

ClientId = int
TenantId = int
Cap = tuple[ClientId, int]  # (client, its cap in bytes; 0 = none)


class TenantMemory:
    """Bytes in use per client and tenant, and each client's cap under its tenant's limit."""

    def __init__(self) -> None:
        self.limits: dict[TenantId, int] = {}  # bytes; absent or 0 = no tenant limit
        self.used: dict[ClientId, int] = {}
        self.tenant_of: dict[ClientId, TenantId] = {}
        self._sent: dict[ClientId, int] = {}

    def used_by_tenant(self) -> dict[TenantId, int]:
        out: dict[TenantId, int] = {}
        for c, t in self.tenant_of.items():
            out[t] = out.get(t, 0) + self.used.get(c, 0)
        return out

    def cap(self, client: ClientId) -> int:
        """The most ``client`` may hold now (0 = no tenant limit)."""
        t = self.tenant_of[client]
        limit = self.limits.get(t, 0)
        if not limit:
            return 0
        others = sum(self.used.get(c, 0) for c, tt in self.tenant_of.items()
                     if tt == t and c != client)
        return max(1, limit - others)

    def connect(self, client: ClientId, tenant: TenantId) -> list[Cap]:
        """A new process: its cap is always sent (the hook waits for it after HELLO)."""
        self.tenant_of[client] = tenant
        self.used[client] = 0
        cap = self.cap(client)
        self._sent[client] = cap
        return [(client, cap)]

    def report(self, client: ClientId, used_bytes: int) -> list[Cap]:
        """``client`` now holds ``used_bytes``: the caps of its tenant's other processes."""
        if client not in self.tenant_of:
            return []
        self.used[client] = max(0, int(used_bytes))
        return self._changed(self.tenant_of[client])

    def disconnect(self, client: ClientId) -> list[Cap]:
        """A process went away: its bytes are freed (the driver frees a dead context's)."""
        tenant = self.tenant_of.pop(client, None)
        self.used.pop(client, None)
        self._sent.pop(client, None)
        return self._changed(tenant) if tenant is not None else []

    def set_limit(self, tenant: TenantId, limit_bytes: int) -> list[Cap]:
        if limit_bytes < 0:
            raise ValueError("a memory limit must be >= 0")
        self.limits[tenant] = int(limit_bytes)
        return self._changed(tenant)

    def _changed(self, tenant: TenantId) -> list[Cap]:
        out: list[Cap] = []
        for c, t in sorted(self.tenant_of.items()):
            if t != tenant:
                continue
            cap = self.cap(c)
            if self._sent.get(c) != cap:
                self._sent[c] = cap
                out.append((c, cap))
        return out
