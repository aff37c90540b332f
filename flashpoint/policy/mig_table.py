"""MIG profile tables: pure data, no NVML — the facts PROTEAN's geometries are made of.

A GPU with MIG has 7 compute slices and 8 memory slices. A GPU-instance (GI) profile takes a
fixed number of each, and may only start at some memory slices (``nvidia-smi mig -lgipp``
prints them as ``{0,4}:4`` = starts 0 or 4, size 4). Two GIs conflict when their memory-slice
ranges overlap; NVML then refuses the second with ``NVML_ERROR_INSUFFICIENT_RESOURCES``.

The tables follow NVIDIA's MIG user guide ("Supported MIG Profiles") for A100-40GB, A100-80GB,
H100-80GB and H200-141GB. Memory sizes are the nominal ones in the profile names (the live
inventory reads the exact ``memorySizeMB`` from NVML); SM counts are the guide's.

The table sits on the policy floor because :mod:`flashpoint.policy.protean` reads it;
:mod:`flashpoint.gpu.mig_profiles` (geometry placement, GPU names) builds on it and exports
these names too.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpoint.errors import InvalidGeometry

MEMORY_SLICES = 8
COMPUTE_SLICES = 7

# NVML enum values (pynvml NVML_GPU_INSTANCE_PROFILE_* / NVML_COMPUTE_INSTANCE_PROFILE_*),
# copied so this module does not import pynvml; tests/gpu/test_gpu_mig.py checks they match.
GI_PROFILE_1_SLICE = 0x0
GI_PROFILE_2_SLICE = 0x1
GI_PROFILE_3_SLICE = 0x2
GI_PROFILE_4_SLICE = 0x3
GI_PROFILE_7_SLICE = 0x4
GI_PROFILE_1_SLICE_REV1 = 0x7  # 1g.*+me (one media-engine slice)
GI_PROFILE_1_SLICE_REV2 = 0x9  # 1g with two memory slices (1g.10gb on A100-40GB)
CI_PROFILE_BY_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4}


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model, e.g. ``3g.20gb`` on A100-40GB."""

    name: str  # "3g.20gb"
    gi_profile: int  # NVML_GPU_INSTANCE_PROFILE_* (argument of GetGpuInstanceProfileInfo)
    profile_id: int  # the id NVML returns in the profile info (placements, creation)
    compute_slices: int
    memory_slices: int  # the placement size
    memory_gb: int
    sm_count: int
    max_count: int
    starts: tuple[int, ...]  # allowed placement starts, in memory slices

    @property
    def short(self) -> str:
        """The compute part of the name (``"3g"``), the unit PROTEAN talks in."""
        return self.name.split(".")[0]

    @property
    def sm_fraction(self) -> float:
        """Share of the GPU's compute slices (3g = 3/7)."""
        return self.compute_slices / COMPUTE_SLICES

    @property
    def ci_profile(self) -> int:
        """NVML_COMPUTE_INSTANCE_PROFILE_* of a compute instance spanning the whole GI."""
        return CI_PROFILE_BY_SLICES[self.compute_slices]


@dataclass(frozen=True)
class GpuModelSpec:
    """The MIG profile table of one GPU model."""

    model: str  # "A100-40GB"
    memory_gb: int
    sm_count: int  # SMs of the full GPU without MIG
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile:
        """A profile by full name (``"1g.10gb"``) or short name (``"1g"``).

        A short name means the plain profile with the fewest memory slices (``1g`` is
        ``1g.5gb`` on A100-40GB, not ``1g.10gb`` or ``1g.5gb+me``), which is what PROTEAN's
        Table 2 means by "1g". Raises :class:`InvalidGeometry` for a name this GPU lacks.
        """
        for p in self.profiles:
            if p.name == name:
                return p
        plain = [p for p in self.profiles if p.short == name and "+" not in p.name]
        if plain:
            return min(plain, key=lambda p: p.memory_slices)
        raise InvalidGeometry(f"profile {name!r} does not exist on {self.model}; "
                              f"choose one of {[p.name for p in self.profiles]}",
                              reason="unknown_profile", model=self.model, profile=name)


def _table(model: str, memory_gb: int, sm_count: int, sms: dict[int, int],
           mem: dict[str, int]) -> GpuModelSpec:
    """The profile list every one of the four models shares, with its own sizes.

    A100 and H100/H200 share ids and placements; only memory sizes and SM counts differ.
    """
    g1, g1x2, g2, g3, g4, g7 = (mem[k] for k in ("1g", "1g2", "2g", "3g", "4g", "7g"))
    return GpuModelSpec(model, memory_gb, sm_count, (
        MigProfile(f"1g.{g1}gb", GI_PROFILE_1_SLICE, 19, 1, 1, g1, sms[1], 7, tuple(range(7))),
        MigProfile(f"1g.{g1}gb+me", GI_PROFILE_1_SLICE_REV1, 20, 1, 1, g1, sms[1], 1,
                   tuple(range(7))),
        MigProfile(f"1g.{g1x2}gb", GI_PROFILE_1_SLICE_REV2, 15, 1, 2, g1x2, sms[1], 4,
                   (0, 2, 4, 6)),
        MigProfile(f"2g.{g2}gb", GI_PROFILE_2_SLICE, 14, 2, 2, g2, sms[2], 3, (0, 2, 4)),
        MigProfile(f"3g.{g3}gb", GI_PROFILE_3_SLICE, 9, 3, 4, g3, sms[3], 2, (0, 4)),
        MigProfile(f"4g.{g4}gb", GI_PROFILE_4_SLICE, 5, 4, 4, g4, sms[4], 1, (0,)),
        MigProfile(f"7g.{g7}gb", GI_PROFILE_7_SLICE, 0, 7, 8, g7, sms[7], 1, (0,)),
    ))


_A100_SMS = {1: 14, 2: 28, 3: 42, 4: 56, 7: 98}
_H100_SMS = {1: 16, 2: 32, 3: 60, 4: 64, 7: 132}
SPECS: dict[str, GpuModelSpec] = {
    "A100-40GB": _table("A100-40GB", 40, 108, _A100_SMS,
                        {"1g": 5, "1g2": 10, "2g": 10, "3g": 20, "4g": 20, "7g": 40}),
    "A100-80GB": _table("A100-80GB", 80, 108, _A100_SMS,
                        {"1g": 10, "1g2": 20, "2g": 20, "3g": 40, "4g": 40, "7g": 80}),
    "H100-80GB": _table("H100-80GB", 80, 132, _H100_SMS,
                        {"1g": 10, "1g2": 20, "2g": 20, "3g": 40, "4g": 40, "7g": 80}),
    "H200-141GB": _table("H200-141GB", 141, 132, _H100_SMS,
                         {"1g": 18, "1g2": 35, "2g": 35, "3g": 71, "4g": 71, "7g": 141}),
}
