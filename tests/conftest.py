"""Settings shared by the whole suite."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import settings

from flashpoint.testing.harness import ClusterFactory

# CI decides whether a submission lands, so there a property test runs the same examples on
# every run (derandomize): a rare input found by chance must not fail one run and pass the next.
# Elsewhere (a developer's `pytest`) examples stay random so new edge cases keep being found;
# a failure prints the blob that reproduces it.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Worker processes of the suite's clusters do not import transformers while idle (a host
# setting, flashpoint/host/workers.py _preload): most never serve a Hugging Face model, and
# two cores spend ~2 s of CPU per import. A test that measures a warm HF cold start sets it.
os.environ.setdefault("FLASHPOINT_PRELOAD_TRANSFORMERS", "0")


@pytest.fixture(autouse=True)
def info_logs() -> Iterator[None]:
    """structlog passes info events to every test, whatever level an earlier test configured
    (the CLI's commands configure WARNING, and that filter is process-wide): a test that
    captures an info event must not depend on which tests ran before it."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        yield
    finally:
        structlog.configure(wrapper_class=old)


@pytest.fixture
async def make_cluster(tmp_path: Path) -> AsyncIterator[ClusterFactory]:
    """``await make_cluster(hosts=1, models=("noop",), host={...}, controller={...},
    netns=False)``: a started cluster (flashpoint/testing/harness.py), stopped and
    leak-checked (processes, asyncio tasks, listening sockets) when the test ends, pass or
    fail. ``netns=True`` runs it as real processes in network namespaces (root only; the
    test is skipped, with the reason, where labs cannot be built)."""
    labs: list[Any] = []

    def make_lab(num_hosts: int, **kw: Any) -> Any:
        from flashpoint.testing.netns import NetLab

        ok, reason = NetLab.available()
        if not ok:
            pytest.skip(reason)
        if not labs:
            NetLab.sweep_stale()
        lab = NetLab(num_hosts, **kw)
        labs.append(lab)
        return lab

    factory = ClusterFactory(tmp_path, make_lab=make_lab)
    try:
        yield factory
    finally:
        try:
            await factory.aclose()
        finally:
            for lab in labs:
                lab.close()
