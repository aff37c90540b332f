"""`flashpoint up` says in one block where the API, the dashboard and the metrics are, and
which key to use; every URL it prints answers."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from flashpoint.cli.serve import up_banner
from flashpoint.config import generate_secret, load_config
from flashpoint.testing.up_process import UpProcess

pytestmark = pytest.mark.timeout(240)


def test_up_prints_where_everything_is(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('log_level = "WARNING"\n[controller]\nlisten_port = 0\n'
                   f'[host]\nwarm_pool_size = 0\ncpu_devices = 1\ncache_dir = "{tmp_path}/cache"\n'
                   'metrics_listen = "127.0.0.1:0"\n')
    env = {k: v for k, v in os.environ.items() if k != "FLASHPOINT_SECRET"}
    up = UpProcess(cfg, tmp_path, env=env)
    try:
        lines = up.banner(120)
        block = lines[lines.index(next(x for x in lines if x.startswith("flashpoint is up"))):]
        # "  LABEL      VALUE ...": labels in a column of 11 characters
        fields = {x[2:13].strip(): x[13:].split()[0] for x in block[1:]
                  if x.startswith("  ") and x[2:13].strip()}
        api = fields["API"]
        assert api.startswith("http://127.0.0.1:") and fields["dashboard"] == f"{api}/ui"
        assert fields["metrics"] == f"{api}/metrics"
        with urllib.request.urlopen(f"{api}/healthz", timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(fields["metrics"], timeout=10) as r:
            assert r.status == 200 and b"# TYPE" in r.read()
        (hosts_line,) = [x for x in block if x.strip().startswith("hosts:")]
        host_metrics = hosts_line.split()[-1]
        assert hosts_line.split()[1] == "host0" and host_metrics.endswith("/metrics")
        with urllib.request.urlopen(host_metrics, timeout=10) as r:
            assert r.status == 200
        assert fields["API key"] == "none" and f"--url {api}" in block[1]
        assert fields["registry"] == str(tmp_path / "registry")
    finally:
        up.stop()
    assert up.proc.returncode == 0, up.proc.stderr.read() if up.proc.stderr else ""


def test_the_banner_names_the_key_to_use(tmp_path: Path) -> None:
    key = generate_secret()
    cfg = load_config(overrides={"gateway": {"api_keys": {key: "admin"},
                                             "metrics_require_key": True}})
    text = up_banner(cfg, "http://10.0.0.5:8080", [("host0", ""), ("host1", "")], "prod.toml")
    assert key not in text  # the banner says where the key is, never the key
    assert "an admin key of [gateway] api_keys of prod.toml" in text
    assert "--api-key KEY or set FLASHPOINT_API_KEY" in text
    assert "http://10.0.0.5:8080/metrics (needs an API key)" in text
    assert "a controller and 2 host(s)" in text and "hosts:" not in text
