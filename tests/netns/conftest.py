"""Fixtures for tests that build real network-namespace labs (root only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from flashpoint.testing.netns import NetLab


@pytest.fixture(scope="session")
def netns_available() -> None:
    """Skip (with the reason) where labs cannot be built: not root, no ``ip netns``."""
    ok, reason = NetLab.available()
    if not ok:
        pytest.skip(reason)
    NetLab.sweep_stale()


@pytest.fixture
def make_lab(netns_available: None) -> Iterator[Callable[..., NetLab]]:
    """``make_lab(num_hosts, **kw)``: a NetLab closed when the test ends, pass or fail."""
    labs: list[NetLab] = []

    def make(num_hosts: int, **kw: Any) -> NetLab:
        lab = NetLab(num_hosts, **kw)
        labs.append(lab)
        return lab

    yield make
    for lab in labs:
        lab.close()
