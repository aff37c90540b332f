"""Every failure of the real command line is one line on stderr that says what to do, with a
non-zero exit and no traceback; --debug and FLASHPOINT_DEBUG=1 show the traceback."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from flashpoint.config import generate_secret

from .conftest import assert_one_line_error, refused_port, run_cli

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("toml,needles", [
    ('[controller]\nlisten_port = "eighty"\n',
     ["[controller] listen_port = 'eighty'", "expected an integer port in 0..65535"]),
    ("[controller]\nlisten_port = 70000\n", ["listen_port = 70000", "0..65535"]),
    ("[controller]\nheartbeat_timeout_s = 0\n",
     ["[controller] heartbeat_timeout_s = 0", "a duration in seconds > 0"]),
    ("[host]\ncpu_devices = -1\n", ["[host] cpu_devices = -1", "a count >= 0"]),
    ("[host]\ntorch_threads = -1\n", ["[host] torch_threads = -1", "a count >= 0"]),
    ("[host]\ncache_bytes = 1.5\n", ["[host] cache_bytes = 1.5", "an integer"]),
    ("[host]\npreload_transformers = 1\n", ["preload_transformers = 1", "true or false"]),
    ("[controller]\nlisten_prot = 9000\n",
     ["unknown key 'listen_prot' in [controller]", "did you mean 'listen_port'?"]),
    ("[controler]\nlisten_port = 9000\n",
     ["unknown key 'controler' in the top level", "did you mean 'controller'?"]),
    ('log_level = "LOUD"\n', ["log_level = 'LOUD'", "one of DEBUG, INFO"]),
    ('[registry]\nkind = "locl"\n', ["[registry] kind = 'locl'", "one of local, s3 (did you mean 'local'?)"]),
    ('[gateway.api_keys]\nkey-of-the-ops-team = "root"\n',
     ["api key role must be one of", "'invoke', 'admin'", "not 'root'"]),
    ("[host]\nfake_gpus = \"A100\"\n", ["[host] fake_gpus = 'A100'", "a list"]),
    ("[controller\nlisten_port = 1\n", ["not valid TOML", "line 1"]),
])
def test_a_bad_config_value_is_one_line_naming_file_key_and_expectation(
        tmp_path: Path, toml: str, needles: list[str]) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(toml)
    r = run_cli("--config", str(p), "model", "list", home=tmp_path)
    assert r.returncode == 1
    assert_one_line_error(r, f"error: {p}: ", *needles)


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    r = run_cli("--config", str(tmp_path / "nope.toml"), "model", "list", home=tmp_path)
    assert_one_line_error(r, "cannot read config file", "nope.toml", "No such file")


@pytest.mark.parametrize("argv,needles", [
    (["up", "--hosts", "-1"], ["argument --hosts: -1 is out of range: 1..64",
                               "`flashpoint up --help`"]),
    (["up", "--hosts", "two"], ["argument --hosts: 'two' is not an integer"]),
    (["deploy", "f", "--model", "m", "--max-replicas", "-3"], ["--max-replicas", "-3"]),
    (["deploy", "f", "--model", "m", "--keep-alive-s", "soon"], ["--keep-alive-s", "'soon'"]),
    (["deploy", "f"], ["the following arguments are required: --model"]),
    (["nosuchcommand"], ["invalid choice: 'nosuchcommand'"]),
])
def test_usage_mistakes_are_one_line_exit_2(tmp_path: Path, argv: list[str],
                                            needles: list[str]) -> None:
    r = run_cli(*argv, home=tmp_path)
    assert r.returncode == 2
    assert_one_line_error(r, "error: ", *needles)


def test_no_cluster_says_start_one_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    held, port = refused_port()
    try:
        url = f"http://127.0.0.1:{port}"
        for cmd in (["status"], ["functions"], ["invoke", "f", "--text", "hi"]):
            r = run_cli(*cmd, "--url", url, home=tmp_path)
            assert r.returncode == 1
            assert_one_line_error(r, f"error: no cluster at {url} (connection refused)",
                                  "start one with `flashpoint up`")
        # FLASHPOINT_URL is the default --url
        r = run_cli("status", home=tmp_path, env={"FLASHPOINT_URL": url})
        assert_one_line_error(r, f"no cluster at {url}")
        for how in ({"argv": ["--debug"]}, {"argv": ["status", "--debug"]},
                    {"env": {"FLASHPOINT_DEBUG": "1"}}):
            argv = how.get("argv", [])
            if "status" not in argv:
                argv = [*argv, "status"]
            r = run_cli(*argv, "--url", url, home=tmp_path, env=how.get("env"))
            assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr, how
            assert "ConnectFailed" in r.stderr, how
    finally:
        held.close()


def test_push_mistakes_are_one_line(tmp_path: Path) -> None:
    r = run_cli("model", "push", "m", str(tmp_path / "missing"), home=tmp_path)
    assert_one_line_error(r, "error: ", "missing", "no such file or directory")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("not a model")
    r = run_cli("model", "push", "m", str(tmp_path / "d"), "--format", "torchscript",
                home=tmp_path)
    assert_one_line_error(r, "error: ", "TorchScript")
    r = run_cli("model", "push", "m", str(tmp_path / "d"), "--format", "onnx", home=tmp_path)
    assert r.returncode == 2
    assert_one_line_error(r, "argument --format: invalid choice: 'onnx'")
    r = run_cli("model", "push", "m", "noop", "--input", "x:FP99:1", home=tmp_path)
    assert_one_line_error(r, "error: ", "unknown datatype 'FP99'")


def _port_config(tmp_path: Path, port: int) -> Path:
    p = tmp_path / "port.toml"
    p.write_text(f"[controller]\nlisten_port = {port}\n")
    return p


@pytest.mark.parametrize("cmd", ["controller", "up"])
def test_a_port_in_use_is_one_line(tmp_path: Path, cmd: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("--config", str(_port_config(tmp_path, port)), cmd, "--hosts", "1",
                    home=tmp_path, env={"FLASHPOINT_SECRET": generate_secret()}) \
            if cmd == "up" else \
            run_cli("--config", str(_port_config(tmp_path, port)), cmd, home=tmp_path,
                    env={"FLASHPOINT_SECRET": generate_secret()})
    assert r.returncode == 1
    # `up` logs its start at INFO before it fails: the error is the last line, and one line
    last = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr, r.stderr
    assert last.startswith(f"error: port {port} on 127.0.0.1 is already in use"), last
    assert "[controller] listen_port" in last


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    """`flashpoint ... | head` where head is gone before the answer: no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left: every write to the pipe is EPIPE
    try:
        r = run_cli("secret", "generate", home=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    assert r.returncode == 1 and r.stderr == "", r.stderr


def _s3_config(tmp_path: Path, endpoint: str, bucket: str) -> Path:
    p = tmp_path / "s3.toml"
    p.write_text(f'[registry]\nkind = "s3"\nbucket = "{bucket}"\nendpoint_url = "{endpoint}"\n'
                 'region = "us-east-1"\n')
    return p


# Fake credentials, and nothing that could send boto3 elsewhere or to real ones.
S3_ENV: dict[str, str | None] = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_PROFILE": None, "AWS_ENDPOINT_URL": None, "AWS_ENDPOINT_URL_S3": None}


def test_an_unreachable_s3_endpoint_is_one_line(tmp_path: Path) -> None:
    held, port = refused_port()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        r = run_cli("--config", str(_s3_config(tmp_path, endpoint, "models")), "model", "list",
                    home=tmp_path, env=S3_ENV)
    finally:
        held.close()
    assert_one_line_error(r, "error: S3 ", "s3://models/", "check [registry] endpoint_url")


@pytest.fixture(params=["open", "auth"])
def moto_server(request: pytest.FixtureRequest, tmp_path: Path):
    """A moto S3 server: ``open`` takes any credentials, ``auth`` checks them (none exist)."""
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in {**os.environ, **S3_ENV}.items() if v is not None}
    if request.param == "auth":
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # bounded by the deadline
            assert proc.poll() is None and time.monotonic() < deadline, "moto did not start"
            try:
                with urllib.request.urlopen(url, timeout=1.0):
                    break
            except urllib.error.HTTPError:
                break  # it answered
            except OSError:
                time.sleep(0.1)
        yield request.param, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_a_bad_aws_profile_is_one_line(tmp_path: Path) -> None:
    r = run_cli("--config", str(_s3_config(tmp_path, "http://127.0.0.1:9", "models")), "model",
                "list", home=tmp_path, env={**S3_ENV, "AWS_PROFILE": "no-such-profile"})
    assert_one_line_error(r, "error: S3 client: ", "no-such-profile",
                          "check the AWS configuration")


def test_s3_missing_bucket_and_bad_credentials_are_one_line(tmp_path: Path, moto_server) -> None:
    kind, endpoint = moto_server
    r = run_cli("--config", str(_s3_config(tmp_path, endpoint, "no-such-bucket")), "model",
                "list", home=tmp_path, env=S3_ENV)
    if kind == "open":
        assert_one_line_error(r, "error: S3 ", "NoSuchBucket",
                              "create the bucket, or fix [registry] bucket")
    else:
        assert_one_line_error(r, "error: S3 ", "InvalidAccessKeyId",
                              "check the AWS credentials")


def test_autoscaler_parameters_are_checked_by_their_autoscaler(tmp_path: Path) -> None:
    p = tmp_path / "a.toml"
    p.write_text('[controller]\nautoscaler = "tsk"\n[controller.autoscaler_params]\n'
                 "keep_alive_partial = true\n")
    r = run_cli("--config", str(p), "model", "list", home=tmp_path)
    assert r.returncode == 0, r.stderr
    p.write_text('[controller]\nautoscaler = "atl"\n[controller.autoscaler_params]\n'
                 "window_s = 0\n")
    r = run_cli("--config", str(p), "model", "list", home=tmp_path)
    assert_one_line_error(r, f"error: {p}: ", "window_s must be > 0")


def test_a_secret_of_the_wrong_type_is_not_echoed(tmp_path: Path) -> None:
    p = tmp_path / "s.toml"
    p.write_text("secret = 123456789012345\n")
    r = run_cli("--config", str(p), "model", "list", home=tmp_path,
                env={"FLASHPOINT_SECRET": None})
    line = assert_one_line_error(r, f"error: {p}: secret: expected a string")
    assert "123456789012345" not in line
