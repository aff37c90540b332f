"""``main``: parse the command line, load the configuration, run one command; every failure
is one line on stderr (flashpoint/cli/failures.py)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from flashpoint.cli import failures, parser
from flashpoint.config import ClusterConfig, load_config

# Commands whose own output is the point: library logs below WARNING would drown it.
QUIET = ("demo", "deploy", "invoke", "functions", "delete", "status", "model", "keys",
         "profile")
SERVERS = ("up", "controller", "gateway", "host")


def _config(args: argparse.Namespace) -> ClusterConfig:
    """The configuration of ``--config`` (or the defaults), ``--insecure`` and ``--home``
    applied; a bad file or value raises BadRequest naming the file and the key."""
    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "insecure", False):
        cfg = dataclasses.replace(cfg, insecure=True)
    home = getattr(args, "home", None)
    return cfg.with_home(Path(home)) if home else cfg


def _require_secret(cfg: ClusterConfig, cmd: str) -> None:
    """A controller, host or gateway of its own process shares the secret with peers in
    other processes: this process's generated one cannot be it."""
    from flashpoint.config import SECRET_ENV, run_secret

    if cfg.secret == run_secret():
        raise SystemExit(f"error: `flashpoint {cmd}` needs the cluster secret: set {SECRET_ENV} "
                         "(or `secret` in --config); `flashpoint secret generate` makes one")


def keys_env(cfg: ClusterConfig, role: str, host_id: str | None) -> str:
    """The environment-file lines that let a host (or a gateway) join without the cluster
    secret: its own credential and, for a host, the data plane's key (rpc/roles.py)."""
    import socket

    from flashpoint.rpc import roles

    _require_secret(cfg, f"keys {role}")  # keys from this process's random secret join nothing
    secret = cfg.secret.encode()
    if role == "gateway":
        return f"{roles.CREDENTIAL_ENV}={roles.Credential.derive(secret, 'gateway').token()}"
    principal = roles.host_principal(host_id or cfg.host.host_id or socket.gethostname())
    return (f"FLASHPOINT_SECRET={roles.data_key(secret).decode()}\n"
            f"{roles.CREDENTIAL_ENV}={roles.Credential.derive(secret, principal).token()}")


def main(argv: list[str] | None = None) -> int:
    """Run ``flashpoint ARGV``; the exit code. A failure raises SystemExit with one
    ``error: ...`` line (``--debug`` / FLASHPOINT_DEBUG=1: the exception itself)."""
    args = parser.build().parse_args(argv)
    debug = failures.debug_wanted(getattr(args, "debug", False))
    return failures.guarded(lambda: _run(args), cmd=args.cmd, debug=debug)


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "sim":  # pure and offline: no config, logging or event loop
        from flashpoint.sim.reproduce import cli as sim_cli

        return sim_cli(args)
    if args.cmd == "secret":  # offline: reads no config
        from flashpoint.config import generate_secret

        print(generate_secret())
        return 0

    from flashpoint.log import configure

    cfg = _config(args)
    configure("WARNING" if args.cmd in QUIET else cfg.log_level)
    import uvloop

    if args.cmd in ("controller", "host", "gateway"):
        _require_secret(cfg, args.cmd)
    if args.cmd in SERVERS:
        from flashpoint.cli.serve import serve

        serve(cfg, args)
        return 0
    if args.cmd == "keys":
        print(keys_env(cfg, args.role, args.host_id))
        return 0
    if args.cmd == "model":
        from flashpoint.cli import models

        uvloop.run(models.model_admin(cfg, args) if args.model_cmd in ("list", "delete")
                   else models.push(cfg, args))
        return 0
    if args.cmd == "demo":
        from flashpoint.demo import run_demo

        return uvloop.run(run_demo(cfg, hosts=args.hosts, preset=args.preset,
                                   requests=args.requests, concurrency=args.concurrency))
    from flashpoint.cli import api

    return uvloop.run(api.run(args))

