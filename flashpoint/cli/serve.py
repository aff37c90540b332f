"""The long-running commands: ``up``, ``controller``, ``gateway`` and ``host`` run until a
signal. ``up`` says in one block where the API, the dashboard and the metrics are."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import Any

from flashpoint.config import ClusterConfig
from flashpoint.registry import make_store


async def _wait_forever() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def up_banner(cfg: ClusterConfig, api_url: str, hosts: list[tuple[str, str]],
              config_path: str | None) -> str:
    """What ``flashpoint up`` prints once the cluster runs: the API, the dashboard, the
    metrics of the controller and of each host (``hosts``: id and metrics URL, empty when
    it serves none), which API key to use, where the state lives."""
    gw = cfg.gateway
    if gw.api_keys:
        where = f"[gateway] api_keys of {config_path}" if config_path else "[gateway] api_keys"
        key = (f"an admin key of {where}: pass --api-key KEY or set FLASHPOINT_API_KEY "
               "(the dashboard asks for it)")
    elif cfg.insecure:
        key = "none: --insecure and no [gateway] api_keys, so every caller is an admin"
    else:
        key = "none needed: no [gateway] api_keys (the API listens on loopback only)"
    from flashpoint.cli.parser import DEFAULT_URL, URL_ENV

    uses = ("`flashpoint status`, `deploy`, `invoke` use it" if api_url == DEFAULT_URL else
            f"pass --url {api_url} to `flashpoint status`, `deploy`, `invoke`, or set {URL_ENV}")
    metrics = f"{api_url}/metrics" + (" (needs an API key)" if gw.metrics_require_key else "")
    registry = (cfg.registry.root if cfg.registry.kind == "local"
                else f"s3://{cfg.registry.bucket}/{cfg.registry.prefix}")
    host_metrics = [f"{hid} {url}/metrics" for hid, url in hosts if url]
    lines = [
        f"flashpoint is up: a controller and {len(hosts)} host(s) on this machine",
        f"  API        {api_url}   ({uses})",
        f"  dashboard  {api_url}/ui",
        f"  metrics    {metrics}",
    ]
    if host_metrics:
        lines.append(f"             hosts: {', '.join(host_metrics)}")
    lines += [
        f"  API key    {key}",
        f"  registry   {registry}",
        "  Stop with Ctrl-C.",
    ]
    return "\n".join(lines)


async def _run_up(cfg: ClusterConfig, hosts: int, config_path: str | None) -> None:
    from flashpoint.cluster import LocalCluster

    async with LocalCluster(cfg, hosts=hosts) as cluster:
        host_urls = [(h.host_id, h.metrics.url if h.metrics else "") for h in cluster.hosts]
        print(up_banner(cfg, cluster.controller.url, host_urls, config_path), flush=True)
        await _wait_forever()


async def _run_controller(cfg: ClusterConfig) -> None:
    from flashpoint.controller.actor import Controller

    ctl = Controller(cfg, make_store(cfg))
    await ctl.start()
    print(f"flashpoint: controller at {ctl.url} (dashboard {ctl.url}/ui, metrics "
          f"{ctl.url}/metrics)", flush=True)
    try:
        await _wait_forever()
    finally:
        await ctl.stop()


async def _run_gateway(cfg: ClusterConfig, port: int | None) -> None:
    from flashpoint.gateway.standalone import StandaloneGateway

    gw = await StandaloneGateway.start(cfg, port=port)
    print(f"flashpoint: gateway at {gw.url}", flush=True)
    try:
        await _wait_forever()
    finally:
        await gw.stop()


async def _run_host(cfg: ClusterConfig, host_id: str | None) -> None:
    from flashpoint.host.actor import HostManager

    host = HostManager(cfg, make_store(cfg), host_id=host_id)
    await host.start()
    if "signal" in (p.strip() for p in cfg.host.spot_notice.split(",")):
        from flashpoint.spot.notice import notice_from

        # SIGUSR1 is an eviction notice with the default lead time (an operator's or a
        # cloud agent's way to say "this VM goes in two minutes").
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: loop.create_task(
            host.on_eviction_notice(notice_from({}, "signal"))))
    waits = [asyncio.ensure_future(_wait_forever()), asyncio.ensure_future(host.evicted.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await host.stop()


def serve(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    """Run ``up``, ``controller``, ``gateway`` or ``host`` until a signal. A refusal to start
    (a weak secret, keyless HTTP beyond loopback, a port in use) propagates to the caller,
    which prints it as one line (flashpoint/cli/failures.py)."""
    import uvloop

    from flashpoint.tracing import setup_from_env

    setup_from_env(f"flashpoint-{args.cmd}")  # OpenTelemetry traces, when configured
    run: Any
    if args.cmd == "up":
        run = _run_up(cfg, args.hosts, args.config)
    elif args.cmd == "controller":
        run = _run_controller(cfg)
    elif args.cmd == "gateway":
        run = _run_gateway(cfg, args.port)
    else:
        run = _run_host(cfg, args.host_id)
    uvloop.run(run)
