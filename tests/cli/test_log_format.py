"""Log lines render for a person on a terminal and as JSON lines otherwise."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from flashpoint.log import wants_json

pytestmark = pytest.mark.timeout(120)

LOG_ONE = ("from flashpoint.log import configure, get_logger; configure('INFO'); "
           "get_logger('t').warning('disk_low', free_bytes=12)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FLASHPOINT_LOG_FORMAT"}
    return {**env, **extra}


def _on_a_terminal(env: dict[str, str]) -> str:
    """What a process logging one line writes to its stderr when that is a terminal."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", LOG_ONE], stderr=follower,
                              stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
                              timeout=60)
        assert proc.returncode == 0
        os.close(follower)
        follower = -1
        out = b""
        for _ in range(100):  # bounded: the child is gone, only its buffered bytes remain
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: nothing more
                break
            if not chunk:
                break
            out += chunk
        return out.decode()
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)


def test_json_lines_into_a_pipe_console_lines_on_a_terminal() -> None:
    piped = subprocess.run([sys.executable, "-c", LOG_ONE], capture_output=True, text=True,
                           env=_env(), timeout=60, stdin=subprocess.DEVNULL)
    event = json.loads(piped.stderr.strip())
    assert (event["event"], event["level"], event["free_bytes"]) == ("disk_low", "warning", 12)

    tty = _on_a_terminal(_env())
    assert "disk_low" in tty and "free_bytes" in tty
    with pytest.raises(ValueError):
        json.loads(tty.strip())
    assert "\x1b[" in tty  # coloured for the terminal

    forced = _on_a_terminal(_env(FLASHPOINT_LOG_FORMAT="json"))
    assert json.loads(forced.strip())["event"] == "disk_low"


def test_the_format_follows_the_stream_and_the_variable() -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    assert wants_json(object(), {}) is True
    assert wants_json(Tty(), {}) is False
    assert wants_json(Tty(), {"FLASHPOINT_LOG_FORMAT": "json"}) is True
    assert wants_json(object(), {"FLASHPOINT_LOG_FORMAT": "Console"}) is False
    assert wants_json(Tty(), {"FLASHPOINT_LOG_FORMAT": "bogus"}) is False
