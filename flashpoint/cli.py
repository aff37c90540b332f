"""The ``flashpoint`` command line: run a cluster, publish models, deploy, invoke, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

from flashpoint.config import ClusterConfig, load_config


def make_store(config: ClusterConfig) -> Any:
    from flashpoint.registry import open_store

    return open_store(config.registry)


def _config(args: argparse.Namespace) -> ClusterConfig:
    cfg = load_config(getattr(args, "config", None))
    home = getattr(args, "home", None)
    return cfg.with_home(Path(home)) if home else cfg


async def _wait_forever() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _run_up(cfg: ClusterConfig, hosts: int) -> None:
    from flashpoint.cluster import LocalCluster

    async with LocalCluster(cfg, hosts=hosts) as cluster:
        print(f"flashpoint: controller at {cluster.controller.url} with {hosts} host(s)", flush=True)
        await _wait_forever()


async def _run_controller(cfg: ClusterConfig) -> None:
    from flashpoint.actors.controller import Controller

    ctl = Controller(cfg, make_store(cfg))
    await ctl.start()
    print(f"flashpoint: controller at {ctl.url}", flush=True)
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
    from flashpoint.actors.host import HostManager

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


async def _push(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    from flashpoint.models.publish import publish

    manifest = await publish(make_store(cfg), args.model, preset=args.preset, version=args.version,
                             model_name=args.name or args.model, profile=args.profile,
                             profile_device=args.profile_device)
    out: dict[str, Any] = {"model": manifest.name, "version": manifest.version,
                           "bytes": manifest.blob_size, "layers": len(manifest.layers)}
    if args.profile:
        out["profile"] = {layer.name: layer.profile for layer in manifest.layers}
    print(json.dumps(out))


async def _http(method: str, url: str, body: Any = None, key: str | None = None) -> Any:
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.request(method, url, json=body, headers=headers) as r:
                text = await r.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise SystemExit(f"cannot reach {url}: {e or type(e).__name__}") from None
    try:
        data = json.loads(text)
    except ValueError:
        data = text  # not JSON (a proxy's error page, say): show it as it came
    if r.status >= 400:
        raise SystemExit(f"error {r.status}: {json.dumps(data)}")
    return data


async def _wait_deployed(args: argparse.Namespace) -> int:
    """Redraw transfer bars and replica phases until ``min_replicas`` are warm (or timeout)."""
    import time

    from flashpoint.progress import ready, render

    deadline = time.monotonic() + args.wait_timeout_s
    drawn = 0
    tty = sys.stderr.isatty()
    while True:
        status = await _http("GET", f"{args.url}/v1/status", None, args.api_key)
        lines = render(status, args.function)
        if tty and drawn:
            sys.stderr.write(f"\x1b[{drawn}F\x1b[J")  # redraw in place
        if tty or ready(status, args.function, args.min_replicas):
            sys.stderr.write("".join(line + "\n" for line in lines))
            drawn = len(lines)
        sys.stderr.flush()
        if ready(status, args.function, args.min_replicas):
            return 0
        if time.monotonic() > deadline:
            sys.stderr.write(f"timed out after {args.wait_timeout_s}s waiting for "
                             f"{args.min_replicas} warm replica(s)\n")
            return 1
        await asyncio.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpoint", description=__doc__)
    p.add_argument("--config", help="TOML configuration (see configs/)")
    p.add_argument("--home", help="state directory for the embedded defaults")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run a controller and N host managers on this machine")
    up.add_argument("--hosts", type=int, default=2)
    sub.add_parser("controller", help="run the controller")
    gateway = sub.add_parser("gateway", help="run the HTTP API in its own process, in front "
                                            "of the controller (survives controller restarts)")
    gateway.add_argument("--port", type=int, help="listen port (default: [gateway] listen_port)")
    host = sub.add_parser("host", help="run one host manager")
    host.add_argument("--host-id")
    model = sub.add_parser("model", help="model registry commands")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    push = msub.add_parser("push", help="publish a built-in model to the registry")
    push.add_argument("model", help="bert | resnet | noop")
    push.add_argument("--preset", default="tiny")
    push.add_argument("--version", default="1")
    push.add_argument("--name", help="registry name (default: the model kind)")
    push.add_argument("--profile", action="store_true",
                      help="measure each layer (bytes, exec time, output size) into the manifest")
    push.add_argument("--profile-device", default="cpu", help="device to profile on (cpu, cuda)")
    for name, helptext in (("deploy", "register a function"), ("invoke", "invoke a function"),
                           ("functions", "list the registered functions"),
                           ("delete", "delete a function (its replicas stop)"),
                           ("status", "cluster status")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("--url", default="http://127.0.0.1:8080")
        sp.add_argument("--api-key")
        if name == "deploy":
            sp.add_argument("function")
            sp.add_argument("--model", required=True)
            sp.add_argument("--version", default="1",
                            help="model version; a new one on a live function rolls its "
                                 "replicas over one by one (an old one rolls back)")
            sp.add_argument("--canary", type=float, metavar="PCT",
                            help="send PCT%% of requests (and replicas) to --version, the rest "
                                 "to the version before it, until a deploy without --canary")
            sp.add_argument("--max-batch-size", type=int, default=8)
            sp.add_argument("--min-replicas", type=int, default=0)
            sp.add_argument("--max-replicas", type=int, default=4)
            sp.add_argument("--keep-alive-s", type=float, default=30.0)
            sp.add_argument("--wait", action="store_true",
                            help="wait for min-replicas warm, drawing transfer progress bars")
            sp.add_argument("--wait-timeout-s", type=float, default=600.0)
        if name == "delete":
            sp.add_argument("function")
        if name == "invoke":
            sp.add_argument("function")
            sp.add_argument("--inputs", required=True,
                            help='JSON: {"x": {"data": [...], "shape": [...], "datatype": "FP32"}}')
    demo = sub.add_parser("demo", help="up, push, deploy, invoke, and print the timings")
    demo.add_argument("--hosts", type=int, default=2)
    demo.add_argument("--preset", default="small")
    demo.add_argument("--requests", type=int, default=64)
    demo.add_argument("--concurrency", type=int, default=8)
    sim = sub.add_parser("sim", help="the data-centre simulator")
    ssub = sim.add_subparsers(dest="sim_cmd", required=True)
    from flashpoint.sim.experiments import add_arguments as sim_arguments
    from flashpoint.sim.experiments import cli as sim_cli

    sim_arguments(ssub.add_parser("reproduce", help="the thesis's evaluation grid, as a report"))
    args = p.parse_args(argv)
    if args.cmd == "sim":  # pure and offline: no config, logging or event loop
        return sim_cli(args)

    from flashpoint.log import configure

    cfg = _config(args)
    configure("WARNING" if args.cmd in ("demo", "deploy", "invoke", "functions", "delete", "status",
                                        "model") else cfg.log_level)
    import uvloop

    if args.cmd == "up":
        uvloop.run(_run_up(cfg, args.hosts))
    elif args.cmd == "controller":
        uvloop.run(_run_controller(cfg))
    elif args.cmd == "gateway":
        uvloop.run(_run_gateway(cfg, args.port))
    elif args.cmd == "host":
        uvloop.run(_run_host(cfg, args.host_id))
    elif args.cmd == "model":
        uvloop.run(_push(cfg, args))
    elif args.cmd == "deploy":
        body = {"name": args.function, "model": args.model, "model_version": args.version,
                "max_batch_size": args.max_batch_size, "min_replicas": args.min_replicas,
                "max_replicas": args.max_replicas, "keep_alive_s": args.keep_alive_s}
        if args.canary is not None:
            body["canary_pct"] = args.canary
        print(json.dumps(uvloop.run(_http("POST", f"{args.url}/v1/functions", body, args.api_key)),
                         indent=2))
        if args.wait and args.min_replicas > 0:
            return uvloop.run(_wait_deployed(args))
    elif args.cmd == "invoke":
        try:
            body = {"inputs": json.loads(args.inputs)}
        except ValueError as e:
            raise SystemExit(f"--inputs is not JSON: {e}") from None
        print(json.dumps(uvloop.run(_http("POST", f"{args.url}/v1/functions/{args.function}/invoke",
                                          body, args.api_key)), indent=2))
    elif args.cmd == "functions":
        print(json.dumps(uvloop.run(_http("GET", f"{args.url}/v1/functions", None, args.api_key)),
                         indent=2))
    elif args.cmd == "delete":
        print(json.dumps(uvloop.run(_http("DELETE", f"{args.url}/v1/functions/{args.function}",
                                          None, args.api_key)), indent=2))
    elif args.cmd == "status":
        print(json.dumps(uvloop.run(_http("GET", f"{args.url}/v1/status", None, args.api_key)), indent=2))
    elif args.cmd == "demo":
        from flashpoint.demo import run_demo

        return uvloop.run(run_demo(cfg, hosts=args.hosts, preset=args.preset,
                                   requests=args.requests, concurrency=args.concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
