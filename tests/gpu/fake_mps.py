"""Put the fake MPS control daemon (``fake_mps_control.py``) on a PATH, as the real binary."""

from __future__ import annotations

import sys
from pathlib import Path

FAKE = Path(__file__).with_name("fake_mps_control.py")


def install_fake_mps(tmp_path: Path) -> str:
    """``tmp_path/bin`` holding an executable ``nvidia-cuda-mps-control``; returns the dir."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(f"#!{sys.executable}\n" + FAKE.read_text())
    exe.chmod(0o755)
    return str(bin_dir)
