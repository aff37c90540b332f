"""The ``flashpoint`` command line: run a cluster, publish models, deploy, invoke, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from flashpoint.config import ClusterConfig, load_config
from flashpoint.registry import make_store


def _config(args: argparse.Namespace) -> ClusterConfig:
    from flashpoint.errors import BadRequest

    try:
        cfg = load_config(getattr(args, "config", None))
    except BadRequest as e:  # a placeholder secret or key, say: one line, exit 1
        raise SystemExit(f"error: {e.message}") from None
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
    from flashpoint.controller.actor import Controller

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


async def _push(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    """``model push NAME [SOURCE]``: SOURCE a directory or archive the user brings, or a
    built-in model; without SOURCE, NAME is a built-in model (``push bert --preset small``).
    Any error is one line and exit 1, before anything is uploaded."""
    from flashpoint.errors import FlashpointError
    from flashpoint.models.sources import PushOptions, publish_source
    from flashpoint.models.sources.base import parse_tensor_spec

    if args.source is None:
        name, source = args.name or args.model, args.model
    else:
        name, source = args.model, args.source
    bar = _PushProgress(sys.stderr)
    try:
        options = PushOptions(trust_code=args.trust_code, truncate=args.truncate,
                              top_k=args.top_k, preset=args.preset, profile=args.profile,
                              profile_device=args.profile_device,
                              inputs=tuple(parse_tensor_spec(t) for t in args.input or ()))
        manifest = await publish_source(make_store(cfg), name, source, version=args.version,
                                        fmt=args.format, options=options, progress=bar)
    except FlashpointError as e:
        bar.done()
        raise SystemExit(f"error: {e.message}") from None
    bar.done()
    out: dict[str, Any] = {"model": manifest.name, "version": manifest.version,
                           "format": manifest.source_format, "task": manifest.task,
                           "bytes": manifest.blob_size, "layers": len(manifest.layers),
                           "files": sorted(manifest.files)}
    if args.profile:
        out["profile"] = {layer.name: layer.profile for layer in manifest.layers}
    print(json.dumps(out))


def _invoke_body(args: argparse.Namespace) -> dict[str, Any]:
    """The native invoke body of ``--inputs`` JSON, ``--text`` or ``--image`` files."""
    import base64

    if args.text:
        return {"text": args.text if len(args.text) > 1 else args.text[0]}
    if args.image:
        try:
            images = [base64.b64encode(p.read_bytes()).decode() for p in args.image]
        except OSError as e:
            raise SystemExit(f"error: cannot read {e.filename}: {e.strerror}") from None
        return {"image": images if len(images) > 1 else images[0]}
    try:
        return {"inputs": json.loads(args.inputs)}
    except ValueError as e:
        raise SystemExit(f"--inputs is not JSON: {e}") from None


class _PushProgress:
    """One line on a terminal, redrawn per phase of a push (load, write, verify, upload)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.drawn = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        from flashpoint.progress import bar

        line = f"{phase:<7} {bar(done, total)}  {time.monotonic() - self.started:6.1f}s"
        if total > 1:
            line += f"  {total / 1e6:.1f} MB"
        if self.tty:
            self.stream.write("\r" + line)
            self.drawn = True
        elif done >= total:  # not a terminal: one line per finished phase
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


async def _model_list(cfg: ClusterConfig, as_json: bool) -> None:
    store = make_store(cfg)
    rows = []
    for name, version in await store.list_models():
        m = await store.get_manifest(name, version)
        rows.append({"name": name, "version": version, "size_bytes": m.blob_size,
                     "layers": len(m.layers), "entry_point": m.entry_point})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = [("NAME", "VERSION", "SIZE", "LAYERS", "ENTRY POINT")] + [
        (r["name"], r["version"], _size(r["size_bytes"]), str(r["layers"]), r["entry_point"])
        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _size(size_bytes: int) -> str:
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


async def _model_delete(cfg: ClusterConfig, name: str, version: str | None) -> None:
    """Delete one version, or every version of ``name``; a missing one is a one-line error."""
    store = make_store(cfg)
    if version is None:
        versions = [v for n, v in await store.list_models() if n == name]
        if not versions:
            raise SystemExit(f"error: model {name} not found")
    else:
        versions = [version]
    for v in versions:
        await store.delete(name, v)
        print(json.dumps({"deleted": name, "version": v}))


async def _model_admin(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    """``model list`` and ``model delete``: registry errors exit 1 with their message."""
    from flashpoint.errors import FlashpointError

    try:
        if args.model_cmd == "list":
            await _model_list(cfg, args.json)
        else:
            await _model_delete(cfg, args.model, args.version)
    except FlashpointError as e:
        raise SystemExit(f"error: {e.message}") from None


def _add_model_admin_parsers(msub: Any) -> None:
    ls = msub.add_parser("list", help="the models in the registry (name, version, size)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rm = msub.add_parser("delete", help="delete a model's version (all versions without "
                                        "--version) from the registry")
    rm.add_argument("model", help="registry name")
    rm.add_argument("--version", help="the version to delete (default: every version)")


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


def _serve(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    """Run ``up``, ``controller``, ``gateway`` or ``host`` until a signal; a refusal to start
    (a weak secret, keyless HTTP beyond loopback) is one line and exit 1."""
    import uvloop

    from flashpoint.errors import BadRequest
    from flashpoint.tracing import setup_from_env

    setup_from_env(f"flashpoint-{args.cmd}")  # OpenTelemetry traces, when configured
    try:
        if args.cmd == "up":
            uvloop.run(_run_up(cfg, args.hosts))
        elif args.cmd == "controller":
            uvloop.run(_run_controller(cfg))
        elif args.cmd == "gateway":
            uvloop.run(_run_gateway(cfg, args.port))
        else:
            uvloop.run(_run_host(cfg, args.host_id))
    except BadRequest as e:
        raise SystemExit(f"error: {e.message}") from None


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
    p = argparse.ArgumentParser(prog="flashpoint", description=__doc__)
    p.add_argument("--config", help="TOML configuration (see configs/)")
    p.add_argument("--home", help="state directory for the embedded defaults")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run a controller and N host managers on this machine")
    up.add_argument("--hosts", type=int, default=2)
    controller = sub.add_parser("controller", help="run the controller")
    insecure_help = ("serve HTTP beyond loopback with no [gateway] api_keys (every caller an "
                     "admin); logged as a warning at every start")
    for sp in (up, controller):
        sp.add_argument("--insecure", action="store_true", help=insecure_help)
    gateway = sub.add_parser("gateway", help="run the HTTP API in its own process, in front "
                                            "of the controller (survives controller restarts)")
    gateway.add_argument("--port", type=int, help="listen port (default: [gateway] listen_port)")
    gateway.add_argument("--insecure", action="store_true", help=insecure_help)
    secret = sub.add_parser("secret", help="cluster secrets and API keys")
    secret_sub = secret.add_subparsers(dest="secret_cmd", required=True)
    secret_sub.add_parser("generate", help="print a new random secret (32 bytes, hex): the "
                                           "cluster secret or an API key")
    host = sub.add_parser("host", help="run one host manager")
    host.add_argument("--host-id")
    keys = sub.add_parser("keys", help="print the environment lines of a host's or a gateway's "
                          "own credential (run where the cluster secret is)")
    keys.add_argument("role", choices=["host", "gateway"])
    keys.add_argument("host_id", nargs="?", help="the host's id (its hostname by default)")
    model = sub.add_parser("model", help="model registry commands")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    push = msub.add_parser(
        "push", help="publish a model: a Hugging Face directory, a TorchScript / torch.export "
        "archive, a handler bundle, or a built-in model (bert | resnet | noop)")
    push.add_argument("model", help="registry name (or, with no SOURCE, a built-in model)")
    push.add_argument("source", nargs="?",
                      help="model directory or archive, or a built-in model name")
    push.add_argument("--format", choices=["hf", "torchscript", "export", "handler", "zoo"],
                      help="force the format instead of detecting it from the files")
    push.add_argument("--trust-code", action="store_true",
                      help="allow the model's own code (handler bundles); an admin's call")
    push.add_argument("--input", action="append", metavar="NAME:DTYPE:SHAPE",
                      help="an input of the model, e.g. x:FP32:-1,16 (TorchScript needs them; "
                      "repeat for each)")
    push.add_argument("--truncate", action="store_true",
                      help="text models: cut texts past the model's positions instead of a 400")
    push.add_argument("--top-k", type=int, default=0, help="labels per answer (default 5)")
    push.add_argument("--preset", default="tiny", help="built-in models: tiny|small|base|large")
    push.add_argument("--version", default="1")
    push.add_argument("--name", help="registry name of a built-in model pushed without SOURCE")
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
            given = sp.add_mutually_exclusive_group(required=True)
            given.add_argument("--inputs",
                               help='tensors as JSON: {"x": {"data", "shape", "datatype"}}')
            given.add_argument("--text", action="append",
                               help="a text for a text model (repeat for several)")
            given.add_argument("--image", action="append", type=Path,
                               help="an image file (JPEG/PNG) for an image model (repeatable)")
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
    _add_model_admin_parsers(msub)  # model list / model delete
    args = p.parse_args(argv)
    if args.cmd == "sim":  # pure and offline: no config, logging or event loop
        return sim_cli(args)
    if args.cmd == "secret":  # offline: reads no config
        from flashpoint.config import generate_secret

        print(generate_secret())
        return 0

    from flashpoint.log import configure

    cfg = _config(args)
    configure("WARNING" if args.cmd in ("demo", "deploy", "invoke", "functions", "delete", "status",
                                        "model") else cfg.log_level)
    import uvloop

    if args.cmd in ("controller", "host", "gateway"):
        _require_secret(cfg, args.cmd)
    if args.cmd in ("up", "controller", "gateway", "host"):
        _serve(cfg, args)
    elif args.cmd == "keys":
        print(keys_env(cfg, args.role, args.host_id))
    elif args.cmd == "model" and args.model_cmd in ("list", "delete"):
        uvloop.run(_model_admin(cfg, args))
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
        body = _invoke_body(args)
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
