"""MIG geometry placement and GPU-name lookup over the profile tables, pure, no NVML.

The tables themselves (``SPECS``, ``GpuModelSpec``, ``MigProfile``, the NVML profile enum
values) live in :mod:`flashpoint.policy.mig_table`, the floor PROTEAN reads them from; they
are exported here too for the GPU code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flashpoint.errors import InvalidGeometry
from flashpoint.policy.mig_table import (
    CI_PROFILE_BY_SLICES,
    COMPUTE_SLICES,
    GI_PROFILE_1_SLICE,
    GI_PROFILE_1_SLICE_REV1,
    GI_PROFILE_1_SLICE_REV2,
    GI_PROFILE_2_SLICE,
    GI_PROFILE_3_SLICE,
    GI_PROFILE_4_SLICE,
    GI_PROFILE_7_SLICE,
    MEMORY_SLICES,
    SPECS,
    GpuModelSpec,
    MigProfile,
)

__all__ = [
    "CI_PROFILE_BY_SLICES", "COMPUTE_SLICES", "GI_PROFILE_1_SLICE", "GI_PROFILE_1_SLICE_REV1",
    "GI_PROFILE_1_SLICE_REV2", "GI_PROFILE_2_SLICE", "GI_PROFILE_3_SLICE", "GI_PROFILE_4_SLICE",
    "GI_PROFILE_7_SLICE", "MEMORY_SLICES", "SPECS", "GpuModelSpec", "MigProfile", "Placement",
    "model_for", "place", "validate",
]


def model_for(name: str, memory_bytes: int) -> GpuModelSpec:
    """The table for a GPU as NVML names it (``"NVIDIA A100-SXM4-40GB"``, ``"NVIDIA H200"``).

    The memory size separates the 40 GB and 80 GB A100s when the name does not. H100 NVL
    (94 GB) and GH200 have other profiles and are refused rather than guessed.
    """
    gib = memory_bytes / 2**30
    upper = name.upper()
    if "A100" in upper:
        return SPECS["A100-80GB" if gib > 60 else "A100-40GB"]
    if "H100" in upper and "NVL" not in upper and 70 < gib < 90:
        return SPECS["H100-80GB"]
    if "H200" in upper and "GH200" not in upper and gib > 120:
        return SPECS["H200-141GB"]
    raise InvalidGeometry(f"no MIG profile table for {name!r} with {gib:.0f} GiB",
                          reason="unknown_gpu", gpu=name)


@dataclass(frozen=True)
class Placement:
    """Where one GI of a geometry goes: ``start`` and ``size`` in memory slices."""

    profile: MigProfile
    start: int

    @property
    def size(self) -> int:
        return self.profile.memory_slices

    @property
    def slots(self) -> range:
        return range(self.start, self.start + self.size)


def place(spec: GpuModelSpec, geometry: Sequence[str]) -> tuple[Placement, ...]:
    """Placements for every profile of ``geometry`` that do not overlap, or a typed refusal.

    Refuses (``InvalidGeometry`` with a ``reason``): an unknown profile, more than a profile's
    ``max_count``, more than 7 compute or 8 memory slices, and geometries whose sizes add up
    but cannot be laid out (``no_placement``; e.g. ``3g,3g,1g`` on an A100: both 3g take four
    memory slices each, leaving none for the 1g). The search is a bounded backtracking over
    at most 7 instances × 7 starts, largest first, so the result is deterministic; the
    returned order is the geometry's order.
    """
    if not geometry:
        raise InvalidGeometry("a geometry needs at least one profile", reason="empty")
    profiles = [spec.profile(n) for n in geometry]
    for p in set(profiles):
        n = sum(q == p for q in profiles)
        if n > p.max_count:
            raise InvalidGeometry(f"{n}× {p.name} on {spec.model}; at most {p.max_count}",
                                  reason="too_many_instances", profile=p.name)
    compute = sum(p.compute_slices for p in profiles)
    memory = sum(p.memory_slices for p in profiles)
    if compute > COMPUTE_SLICES or memory > MEMORY_SLICES:
        raise InvalidGeometry(
            f"{'+'.join(geometry)} needs {compute} compute and {memory} memory slices; "
            f"{spec.model} has {COMPUTE_SLICES} and {MEMORY_SLICES}",
            reason="too_many_slices", compute_slices=compute, memory_slices=memory)
    # Largest first, as NVIDIA advises: big profiles have the fewest legal starts.
    order = sorted(range(len(profiles)), key=lambda i: (-profiles[i].memory_slices,
                                                        -profiles[i].compute_slices, i))
    chosen: dict[int, int] = {}

    def search(k: int, used: frozenset[int]) -> bool:
        if k == len(order):
            return True
        i = order[k]
        p = profiles[i]
        for start in p.starts:
            slots = frozenset(range(start, start + p.memory_slices))
            if slots & used:
                continue
            chosen[i] = start
            if search(k + 1, used | slots):
                return True
        return False

    if not search(0, frozenset()):
        raise InvalidGeometry(f"{'+'.join(geometry)} fits by slice count but no placement of it "
                              f"exists on {spec.model} (allowed starts: "
                              + ", ".join(f"{p.name}@{list(p.starts)}" for p in set(profiles))
                              + ")", reason="no_placement")
    return tuple(Placement(profiles[i], chosen[i]) for i in range(len(profiles)))


def validate(spec: GpuModelSpec, geometry: Sequence[str]) -> None:
    """Raise :class:`InvalidGeometry` saying why ``geometry`` cannot exist on this GPU."""
    place(spec, geometry)
