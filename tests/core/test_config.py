"""Typed configuration loading."""

from __future__ import annotations

import pytest

from flashpoint.config import (
    ClusterConfig,
    ControllerConfig,
    HostConfig,
    RegistryConfig,
    load_config,
    run_secret,
)
from flashpoint.errors import BadRequest


def test_defaults_need_no_file():
    cfg = load_config()
    assert cfg == ClusterConfig()
    assert cfg.secret == run_secret()  # this process's random one: no fixed default
    assert cfg.controller == ControllerConfig()
    assert cfg.controller.heartbeat_timeout_s == 5.0
    assert cfg.host.cpu_devices == 2
    assert cfg.gateway.api_keys == {}


def test_unknown_section_rejected():
    with pytest.raises(BadRequest):
        load_config(overrides={"nope": {"a": 1}})
    with pytest.raises(BadRequest):
        load_config(overrides={"nope": 1})


def test_unknown_key_rejected():
    with pytest.raises(BadRequest, match="controller"):
        load_config(overrides={"controller": {"heartbeat_timeout": 1}})


def test_section_must_be_table():
    with pytest.raises(BadRequest):
        load_config(overrides={"host": 3})


S3, S4 = "3" * 32 + "0123456789abcdef" * 2, "ab" * 16 + "fedcba9876543210" * 2


def test_toml_file_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        f'secret = "{S3}"\nlog_level = "DEBUG"\n'
        '[controller]\nlisten_port = 9999\nheartbeat_timeout_s = 2.5\n'
        '[host]\ncpu_devices = 4\n'
        '[gateway]\nmax_tensor_bytes = 1024\nlisten_port = 9090\n'
        '[gateway.api_keys]\nkey-one-admin = "admin"\n'
    )
    cfg = load_config(p)
    assert cfg.secret == S3 and cfg.log_level == "DEBUG"
    assert cfg.controller.listen_port == 9999
    assert cfg.controller.heartbeat_timeout_s == 2.5
    assert cfg.controller.loop_interval_s == ControllerConfig().loop_interval_s  # untouched
    assert cfg.host.cpu_devices == 4
    assert cfg.host.heartbeat_interval_s == HostConfig().heartbeat_interval_s
    assert cfg.gateway.api_keys == {"key-one-admin": "admin"}
    # one gateway type: the HTTP limits and the stand-alone process's settings, one table
    assert cfg.gateway.max_tensor_bytes == 1024 and cfg.gateway.listen_port == 9090
    # overrides apply on top of the file, per key
    cfg2 = load_config(str(p), overrides={"controller": {"listen_port": 1}, "secret": S4})
    assert cfg2.controller.listen_port == 1
    assert cfg2.controller.heartbeat_timeout_s == 2.5
    assert cfg2.secret == S4


def test_toml_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[registry]\nkind = \"local\"\nbucket_name = \"x\"\n")
    with pytest.raises(BadRequest):
        load_config(p)


def test_registry_s3_fields(tmp_path):
    assert load_config().registry == RegistryConfig()
    assert (RegistryConfig().kind, RegistryConfig().bucket, RegistryConfig().prefix,
            RegistryConfig().endpoint_url, RegistryConfig().region) == ("local", "", "", "", "")
    p = tmp_path / "c.toml"
    p.write_text('[registry]\nkind = "s3"\nbucket = "models"\nprefix = "fp/reg"\n'
                 'endpoint_url = "http://minio:9000"\nregion = "eu-west-1"\n')
    reg = load_config(p).registry
    assert reg == RegistryConfig(kind="s3", root=RegistryConfig().root, bucket="models",
                                 prefix="fp/reg", endpoint_url="http://minio:9000",
                                 region="eu-west-1")
    cfg = load_config(p).with_home(tmp_path)  # moving the home keeps the s3 fields
    assert (cfg.registry.kind, cfg.registry.bucket) == ("s3", "models")


def test_overrides_not_mutated():
    ov = {"controller": {"listen_port": 1}}
    load_config(overrides=ov)
    load_config(overrides=ov)
    assert ov == {"controller": {"listen_port": 1}}


def test_with_home(tmp_path):
    cfg = load_config().with_home(tmp_path)
    assert cfg.controller.state_path == str(tmp_path / "state.sqlite")
    assert cfg.registry.root == str(tmp_path / "registry")


@pytest.mark.parametrize("name", ["local.toml", "multihost.toml"])
def test_shipped_configs_load(name):
    from pathlib import Path

    p = Path(__file__).resolve().parents[2] / "configs" / name
    if not p.exists():
        pytest.skip(f"{p} not present")
    assert isinstance(load_config(p), ClusterConfig)
    if name == "multihost.toml":  # secrets never sit in it: its API keys come as a credential
        from flashpoint.config import generate_secret

        assert not load_config(p).gateway.api_keys
        keys = {generate_secret(): "admin", generate_secret(): "invoke"}
        assert load_config(p, overrides={"gateway": {"api_keys": keys}}).gateway.api_keys == keys


def test_local_config_spells_out_sharing_defaults():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "local.toml")
    assert (cfg.host.gpu_sharing, cfg.controller.share_policy) == ("none", "fastgshare")


def test_autoscaler_is_chosen_by_name_and_checked_when_the_config_loads():
    cfg = load_config(overrides={"controller": {"autoscaler": "atl",
                                                "autoscaler_params": {"window_s": 30}}})
    assert cfg.controller.autoscaler == "atl"
    with pytest.raises(BadRequest, match="unknown autoscaler 'nope'"):
        load_config(overrides={"controller": {"autoscaler": "nope"}})
    with pytest.raises(BadRequest, match="unknown parameters"):
        load_config(overrides={"controller": {"autoscaler": "atl",
                                              "autoscaler_params": {"bogus": 1}}})


def test_secret_comes_from_the_environment_and_the_run_secret_stays_on_loopback(monkeypatch):
    from flashpoint.config import check_secret, generate_secret

    strong = generate_secret()
    monkeypatch.setenv("FLASHPOINT_SECRET", strong)
    assert load_config().secret == strong
    check_secret(run_secret(), "127.0.0.1", "x")  # local clusters run on the generated one
    check_secret(strong, "10.0.0.5", "x")
    with pytest.raises(BadRequest, match="no cluster secret configured"):
        check_secret(run_secret(), "0.0.0.0", "the controller")


@pytest.mark.parametrize("table", [{"api_keys": {"short": "admin"}},
                                   {"api_keys": {"long-enough-key": "root"}},
                                   {"max_body_bytes": 0}, {"nope": 1}])
def test_the_gateway_table_is_checked_when_it_loads(table):
    with pytest.raises(BadRequest):
        load_config(overrides={"gateway": table})


def test_protean_thresholds_are_fractions_in_order_and_reach_both_algorithms(tmp_path):
    cfg = load_config(overrides={"controller": {"protean_t_low": 0.1, "protean_t_high": 0.8,
                                                "slice_dispatch": "least_loaded"}})
    assert (cfg.controller.protean_t_low, cfg.controller.protean_t_high) == (0.1, 0.8)
    assert (ControllerConfig().protean_t_low, ControllerConfig().protean_t_high) == (0.05, 0.95)
    from flashpoint.controller.mig_driver import MigDriver
    from flashpoint.controller.state.core import ControllerState

    driver = MigDriver(cfg.controller, ControllerState(), {}, lambda cmds: None,
                       lambda coro, name: None, lambda: 0.0)
    assert (driver.mig.params.t_low, driver.mig.params.t_high) == (0.1, 0.8)  # Alg. 2
    p = tmp_path / "c.toml"
    p.write_text("[controller]\nprotean_t_high = 1.5\n")
    with pytest.raises(BadRequest, match=r"c\.toml: \[controller\] protean_t_high = 1\.5: "
                                         r"expected a fraction in \[0, 1\]"):
        load_config(p)
    with pytest.raises(BadRequest, match="protean_t_low and protean_t_high: need 0 <= t_low < "
                                         "t_high <= 1, got 0.6 and 0.4"):
        load_config(overrides={"controller": {"protean_t_low": 0.6, "protean_t_high": 0.4}})
    with pytest.raises(BadRequest, match="slice_dispatch = 'protein': expected one of "
                                         "protean, least_loaded"):
        load_config(overrides={"controller": {"slice_dispatch": "protein"}})
