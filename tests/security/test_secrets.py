"""Issue 19 item 3: no built-in cluster secret anywhere, weak and placeholder secrets and API
keys refused, and ``flashpoint secret generate``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashpoint.config as fc
from flashpoint.config import (
    ClusterConfig,
    GatewayConfig,
    check_secret,
    generate_secret,
    load_config,
    run_secret,
    validate_secret,
)
from flashpoint.errors import BadRequest

ROOT = Path(__file__).resolve().parents[2]
WEAK = ["change-me", "flashpoint-local-dev-secret", "netns-cluster-test-secret", "s3cret",
        "0123456789abcdef0123456789abcdef",  # 32 hex digits: 16 bytes
        "a" * 64, "CHANGE-ME-please-to-something-long-and-random-0123456789"]


@pytest.mark.parametrize("secret", WEAK)
def test_weak_and_placeholder_secrets_are_refused(monkeypatch, secret):
    monkeypatch.setenv(fc.SECRET_ENV, secret)
    with pytest.raises(BadRequest, match="flashpoint secret generate"):
        load_config()
    with pytest.raises(BadRequest):
        check_secret(secret, "127.0.0.1", "the controller")  # not even on loopback


def test_the_shipped_example_env_file_does_not_validate():
    env = (ROOT / "deploy/systemd/flashpoint.env.example").read_text()
    (line,) = [x for x in env.splitlines() if x.startswith(f"{fc.SECRET_ENV}=")]
    with pytest.raises(BadRequest):
        validate_secret(line.partition("=")[2])


def test_no_fixed_secret_a_random_one_per_process_kept_on_loopback():
    assert not hasattr(fc, "DEFAULT_SECRET")
    here = ClusterConfig().secret
    assert here == run_secret() and len(bytes.fromhex(here)) == 32
    other = subprocess.run([sys.executable, "-c", "from flashpoint.config import ClusterConfig;"
                            "print(ClusterConfig().secret)"], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL, check=True).stdout.strip()
    assert len(other) == 64 and other != here
    check_secret(here, "127.0.0.1", "x")
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(BadRequest, match="no cluster secret configured"):
            check_secret(here, host, "the controller")
    check_secret(generate_secret(), "0.0.0.0", "the controller")


def test_secret_generate_prints_a_fresh_valid_secret(capsys):
    from flashpoint.cli import main

    assert main(["secret", "generate"]) == 0
    assert main(["secret", "generate"]) == 0
    a, b = capsys.readouterr().out.split()
    assert a != b and len(bytes.fromhex(a)) == 32
    validate_secret(a)


def test_placeholder_api_keys_do_not_validate(monkeypatch, tmp_path):
    monkeypatch.setenv(fc.SECRET_ENV, generate_secret())
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    config = tmp_path / "keys.toml"
    config.write_text('[gateway]\napi_keys = { "replace-with-admin-key" = "admin" }\n')
    with pytest.raises(BadRequest, match="placeholder"):
        load_config(config)
    for key in ("replace-with-admin-key", "change-me-invoke-key"):
        with pytest.raises(BadRequest, match="placeholder"):
            GatewayConfig(api_keys={key: "admin"})
    keys = {generate_secret(): "admin"}
    assert load_config(config, overrides={"gateway": {"api_keys": keys}}).gateway.api_keys == keys


def test_shipped_multihost_config_takes_its_api_keys_from_the_credential(monkeypatch, tmp_path):
    """configs/multihost.toml holds no key; the units' api_keys credential brings them, and
    the shipped example credential's placeholders are refused until replaced."""
    monkeypatch.setenv(fc.SECRET_ENV, generate_secret())
    text = (ROOT / "configs/multihost.toml").read_text()
    assert "api_keys =" not in text.replace("# api_keys", "")  # not even commented in
    creds = tmp_path / "credentials"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    (creds / "api_keys").write_text((ROOT / "deploy/systemd/api_keys.example").read_text())
    with pytest.raises(BadRequest, match="placeholder"):
        load_config(ROOT / "configs/multihost.toml")
    admin, invoke = generate_secret(), generate_secret()
    (creds / "api_keys").write_text(f'"{admin}" = "admin"\n"{invoke}" = "invoke"\n')
    assert dict(load_config(ROOT / "configs/multihost.toml").gateway.api_keys) == {
        admin: "admin", invoke: "invoke"}


def _run(module: str, *argv: str, secret: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FP_SEC_TEST_SECRET"}
    if secret is not None:
        env["FP_SEC_TEST_SECRET"] = secret
    # subprocess.run kills the process at the timeout: none outlives the test
    return subprocess.run([sys.executable, "-m", module, *argv, "--secret-env",
                           "FP_SEC_TEST_SECRET"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env=env)


@pytest.mark.parametrize("secret", [None, "change-me"])
def test_transfer_node_and_stage_server_have_no_fallback_secret(tmp_path, secret):
    node = _run("flashpoint.transfer.node", "serve", "--listen", "0.0.0.0", "--port", "0",
                "--dir", str(tmp_path), secret=secret)
    runs = [node]
    if secret is None:  # the stage server imports torch (seconds): one case is enough
        runs.append(_run("flashpoint.pipeline.stage", "--manifest", str(tmp_path / "m.json"),
                         "--blob", str(tmp_path / "b"), "--first", "0", "--last", "0",
                         "--listen", "0.0.0.0", secret=secret))
    for r in runs:
        assert r.returncode == 1, r.stderr[-2000:]
        assert ("no cluster secret" if secret is None else "placeholder") in r.stderr
        assert "flashpoint secret generate" in r.stderr and "Traceback" not in r.stderr


def test_standalone_processes_need_a_configured_secret(monkeypatch, capsys):
    from flashpoint.cli import main

    monkeypatch.delenv(fc.SECRET_ENV, raising=False)
    for cmd in ("controller", "host", "gateway"):
        with pytest.raises(SystemExit, match="needs the cluster secret"):
            main([cmd])
