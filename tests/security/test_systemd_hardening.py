"""Issue 19, item 12: the systemd units are sandboxed (``systemd-analyze security`` rates each
<= 2.5) and take their secrets as credentials (``LoadCredential=``), never from the
environment or a TOML file; the host unit keeps what GPUs, MPS and MIG need.

``systemd-analyze`` comes from Debian's ``systemd`` package, which ``.ci/run`` installs: these
tests skip nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from flashpoint.config import generate_secret, load_config
from flashpoint.credentials import CREDENTIALS_ENV, parse_api_keys
from flashpoint.errors import BadRequest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
NAMES = ("flashpoint-controller.service", "flashpoint-gateway.service",
         "flashpoint-host.service")
MAX_EXPOSURE = 2.5
# The sandboxing the issue names, in every unit (ProtectProc hides other users' processes).
REQUIRED = ("ProtectClock=yes", "ProtectHostname=yes", "ProtectKernelLogs=yes",
            "RestrictRealtime=yes", "UMask=0077", "ProtectProc=invisible",
            "RestrictNamespaces=yes", "SystemCallFilter=@system-service",
            "SystemCallArchitectures=native", "NoNewPrivileges=yes")


def _directives(name: str) -> list[tuple[str, str]]:
    out = []
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key, value))
    return out


def _exposure(name: str) -> float:
    res = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNITS / name)],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", res.stdout + res.stderr)
    assert found, res.stdout + res.stderr
    return float(found.group(1))


@pytest.mark.parametrize("name", NAMES)
def test_each_unit_is_rated_at_most_2_5(name: str) -> None:
    exposure = _exposure(name)
    assert exposure <= MAX_EXPOSURE, f"{name}: systemd-analyze security rates it {exposure}"


def test_the_rating_can_fail(tmp_path: Path) -> None:
    """The check above measures something: the unit without its sandbox rates far worse."""
    text = (UNITS / "flashpoint-gateway.service").read_text()
    bare = "\n".join(line for line in text.splitlines()
                     if not line.startswith(("Protect", "Private", "Restrict", "SystemCall")))
    (tmp_path / "bare.service").write_text(bare + "\n")
    res = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager",
         str(tmp_path / "bare.service")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", res.stdout + res.stderr)
    assert found and float(found.group(1)) > MAX_EXPOSURE, res.stdout + res.stderr


@pytest.mark.parametrize("name", NAMES)
def test_each_unit_has_the_named_sandboxing(name: str) -> None:
    lines = {f"{k}={v}" for k, v in _directives(name)}
    assert not [d for d in REQUIRED if d not in lines], name
    assert "CapabilityBoundingSet=" in lines and "AmbientCapabilities=" in lines


@pytest.mark.parametrize("name", NAMES)
def test_secrets_are_credentials_not_environment(name: str) -> None:
    directives = _directives(name)
    keys = {k for k, _ in directives}
    assert "EnvironmentFile" not in keys and "PassEnvironment" not in keys
    env = " ".join(v for k, v in directives if k == "Environment")
    assert not re.search(r"SECRET|API_KEY|ACCESS_KEY|TOKEN|PASSWORD", env, re.I), env
    creds = dict(v.split(":", 1) for k, v in directives if k == "LoadCredential")
    assert creds["secret"] == "/etc/flashpoint/credentials/secret"
    if name != "flashpoint-host.service":  # the API's keys live where the API is served
        assert creds["api_keys"] == "/etc/flashpoint/credentials/api_keys"


def test_the_host_keeps_what_gpus_mps_and_mig_need() -> None:
    directives = _directives("flashpoint-host.service")
    keys = {k for k, _ in directives}
    allowed = {v for k, v in directives if k == "DeviceAllow"}
    assert {"/dev/nvidiactl rw", "/dev/nvidia-uvm rw", "char-nvidia-frontend rw",
            "char-nvidia-caps r"} <= allowed  # GPUs; MIG's config/access capabilities
    assert ("DevicePolicy", "closed") in directives
    assert "PrivateDevices" not in keys  # it would hide /dev/nvidia*
    assert "ProcSubset" not in keys  # NVML reads /proc/driver/nvidia
    assert "MemoryDenyWriteExecute" not in keys  # oneDNN and CUDA JIT code
    assert ("ReadWritePaths", "/dev/shm") in directives  # model cache, MPS shared memory
    assert ("LimitMEMLOCK", "infinity") in directives  # pinned host memory
    assert ("CapabilityBoundingSet", "") in directives  # and no capability for any of it


# -- the credentials the units pass ------------------------------------------------------

def _credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **files: str) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir(parents=True)
    for name, text in files.items():
        (creds / name).write_text(text)
    monkeypatch.setenv(CREDENTIALS_ENV, str(creds))


def test_the_secret_and_api_keys_come_from_the_credentials_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_secret, cred_secret, toml_secret = (generate_secret() for _ in range(3))
    k_old, k_admin, k_ops = (generate_secret() for _ in range(3))
    monkeypatch.setenv("FLASHPOINT_SECRET", env_secret)
    _credentials(tmp_path, monkeypatch, secret=cred_secret + "\n",
                 api_keys=f'"{k_admin}" = "admin"\n"{k_ops}" = "invoke"\n')
    toml = tmp_path / "c.toml"
    toml.write_text(f'secret = "{toml_secret}"\n[gateway]\napi_keys = {{ "{k_old}" = "invoke" }}\n')
    config = load_config(toml)
    assert config.secret == cred_secret
    assert config.gateway.api_keys == {k_old: "invoke", k_admin: "admin", k_ops: "invoke"}


def test_without_credentials_nothing_changes(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _credentials(tmp_path, monkeypatch)  # a directory without our credentials
    secret = generate_secret()
    monkeypatch.setenv("FLASHPOINT_SECRET", secret)
    assert load_config().secret == secret
    assert load_config().gateway.api_keys == {}


def test_a_bad_api_keys_credential_is_refused_without_quoting_a_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BadRequest) as err:
        parse_api_keys('"sk-live-123" = "admin"\n"sk-live-456" admin\n')
    assert "sk-live" not in str(err.value) and "line 2" in str(err.value)
    _credentials(tmp_path, monkeypatch, api_keys='"sk-live-789" = 3\n')
    with pytest.raises(BadRequest, match="role string") as err:
        load_config()
    assert "sk-live-789" not in str(err.value)
    _credentials(tmp_path / "x", monkeypatch, secret="\n")
    with pytest.raises(BadRequest, match="empty"):
        load_config()
