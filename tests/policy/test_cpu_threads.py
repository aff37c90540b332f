"""policy/cpu_threads: how many intra-op threads a worker's torch gets."""

from __future__ import annotations

import pytest

from flashpoint.policy.cpu_threads import intra_op_threads, usable_cores


@pytest.mark.parametrize("configured,cores,devices,gpus,want", [
    (3, 16, 2, 0, 3),  # an operator's setting wins
    (3, 16, 2, 1, 3),
    (0, 16, 2, 0, 8),  # the cores divided among the CPU devices
    (0, 2, 1, 0, 2),  # one device on this VM: both vCPUs
    (0, 2, 4, 0, 1),  # more devices than cores: one each, never zero
    (0, 7, 2, 0, 3),  # rounds down: never more threads than the share
    (0, 2, 0, 0, 2),  # no CPU device counted: the host's cores
    (0, 64, 0, 8, 1),  # a GPU host: one (many workers share each GPU)
])
def test_intra_op_threads(configured: int, cores: int, devices: int, gpus: int,
                          want: int) -> None:
    assert intra_op_threads(configured, cores, devices, gpus) == want


def test_usable_cores() -> None:
    assert usable_cores(0, 12) == 12
    assert usable_cores(4, 12) == 4  # [host] cpu_cores set
    assert usable_cores(0, 0) == 1
