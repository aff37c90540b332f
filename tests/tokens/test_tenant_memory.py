"""TenantMemory: per-tenant device bytes and each process's cap under its tenant's limit."""

import pytest

from flashpoint.policy.tenant_memory import TenantMemory

MIB = 1 << 20


def test_caps_follow_the_other_processes_of_the_tenant():
    m = TenantMemory()
    assert m.connect(1, tenant=7) == [(1, 0)]  # no limit yet: 0 = none, always sent
    assert m.set_limit(7, 10 * MIB) == [(1, 10 * MIB)]
    assert m.connect(2, tenant=7) == [(2, 10 * MIB)]
    assert m.connect(3, tenant=8) == [(3, 0)]  # another tenant: unaffected
    assert m.report(1, 6 * MIB) == [(2, 4 * MIB)]  # only the others' caps change
    assert m.report(3, 50 * MIB) == []
    assert m.report(2, 4 * MIB) == [(1, 6 * MIB)]
    assert m.used_by_tenant() == {7: 10 * MIB, 8: 50 * MIB}
    assert m.report(2, 4 * MIB) == []  # nothing changed, nothing sent
    assert m.disconnect(1) == [(2, 10 * MIB)]  # its bytes are freed with its context
    assert m.report(1, MIB) == []  # a late report of a gone client is ignored


def test_no_room_is_one_byte_never_zero():
    m = TenantMemory()
    m.set_limit(1, 4 * MIB)
    m.connect(1, 1)
    m.connect(2, 1)
    assert m.report(1, 5 * MIB) == [(2, 1)]  # over the limit already: 2 may take nothing
    assert m.set_limit(1, 0) == [(1, 0), (2, 0)]  # limit lifted
    with pytest.raises(ValueError):
        m.set_limit(1, -1)
