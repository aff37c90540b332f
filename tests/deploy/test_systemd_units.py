"""The systemd units in deploy/systemd pass ``systemd-analyze verify`` (where it exists),
with no warning: an unknown or misspelt key is only a warning to systemd, so warnings fail
here too. ExecStart is pointed at this checkout, since the install path (/opt/flashpoint)
does not exist on a test machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
NAMES = ("flashpoint-controller.service", "flashpoint-host.service", "flashpoint-gateway.service")


def _localised(tmp_path: Path) -> list[Path]:
    flashpoint = Path(sys.executable).with_name("flashpoint")
    assert flashpoint.exists(), "the flashpoint console script is not installed in this venv"
    out = []
    for name in NAMES:
        text = (UNITS / name).read_text()
        assert "ExecStart=/opt/flashpoint/venv/bin/flashpoint " in text
        assert "Restart=on-failure" in text and "User=flashpoint" in text
        assert "LoadCredential=secret:/etc/flashpoint/credentials/secret" in text
        text = text.replace("/opt/flashpoint/venv/bin/flashpoint", str(flashpoint))
        path = tmp_path / name
        path.write_text(text)
        out.append(path)
    return out


def _verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", *map(str, paths)], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def _problems(res: subprocess.CompletedProcess[str]) -> list[str]:
    # Lines about this sandbox (no container PID 1 access) are not about our units.
    return [line for line in (res.stdout + res.stderr).splitlines()
            if "flashpoint" in line or "Unknown" in line or "Invalid" in line]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
def test_units_verify_cleanly(tmp_path: Path) -> None:
    res = _verify(_localised(tmp_path))
    assert res.returncode == 0 and not _problems(res), res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
def test_a_misspelt_key_would_be_caught(tmp_path: Path) -> None:
    """The check above can fail: the same run over a unit with a typo reports it."""
    paths = _localised(tmp_path)
    paths[1].write_text(paths[1].read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    res = _verify(paths)
    assert _problems(res), res.stdout + res.stderr
