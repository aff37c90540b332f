"""The ``flashpoint`` argument parser: every command and flag with its help text and type.

Usage mistakes are one line (``error: ... (see `flashpoint deploy --help`)``, exit 2).
``deploy`` has a flag for every field of :class:`~flashpoint.spec.FunctionSpec` a user sets
(:data:`SPEC_FLAGS`), so a new field without a flag is caught by tests/cli.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, NoReturn

from flashpoint.policy.klc import TenantClass
from flashpoint.spec import FunctionSpec

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV, KEY_ENV = "FLASHPOINT_URL", "FLASHPOINT_API_KEY"
MAX_LOCAL_HOSTS = 64  # host managers one machine runs in one process, at most

# FunctionSpec field -> (flag, help). `name` and `model` are the positional FUNCTION and
# --model; inputs/outputs/fast_profile take structured values (see _add_deploy).
SPEC_FLAGS: dict[str, tuple[str, str]] = {
    "model_version": ("--version", "model version (default 1); a new one on a live function "
                      "rolls its replicas over one by one (an old one rolls back)"),
    "max_batch_size": ("--max-batch-size", "most requests one batch runs (1..1024, default 8)"),
    "batch_wait_ms": ("--batch-wait-ms", "how long a batch waits for more requests, ms "
                      "(0..1000; default 0: only what is queued)"),
    "min_replicas": ("--min-replicas", "replicas kept warm even when idle (default 0: scale "
                     "to zero)"),
    "max_replicas": ("--max-replicas", "most replicas the autoscaler starts (default 4)"),
    "keep_alive_s": ("--keep-alive-s", "seconds an idle replica stays warm (default 30)"),
    "replica_concurrency": ("--replica-concurrency", "requests one replica holds at once; "
                            "the autoscaler's per-replica target (1..4096, default 16)"),
    "timeout_s": ("--timeout-s", "per-request timeout in seconds (default 60)"),
    "max_stages": ("--max-stages", "most pipeline stages a cold start may split the model "
                   "into (1 = never; more needs per-layer profiles: model push --profile)"),
    "compute": ("--compute", "fraction of one device's compute a replica reserves "
                "(0..1, default 0: not reserved)"),
    "slo_ms": ("--slo-ms", "latency objective of a strict request, end to end, ms "
               "(default 0: none)"),
    "sm_share": ("--sm-share", "GPU sharing: fraction of SMs a replica needs (0..1; "
                 "hosts with gpu_sharing)"),
    "sm_limit": ("--sm-limit", "GPU sharing: cap on the SM fraction (default: --sm-share)"),
    "time_quota": ("--time-quota", "GPU sharing: fraction of GPU time (default: all)"),
    "gpu_memory_bytes": ("--gpu-memory-bytes", "GPU sharing: device memory cap in bytes "
                         "(default: the model's bytes plus the replica overhead)"),
    "batch_memory_bytes": ("--batch-memory-bytes", "device memory of one batch, bytes "
                           "(MIG reconfiguration's demand; default: the replica's bytes)"),
    "batch_fbr": ("--batch-fbr", "PROTEAN's fractional bandwidth requirement of one batch "
                  "(0..100; routing over MIG slices; default 0: not profiled)"),
    "tenant_class": ("--tenant-class", "GPU sharing (tokens hosts): slo (default) or "
                     "best_effort, which gives way to SLO replicas of the same GPU (Dilu)"),
    "canary_pct": ("--canary", "send PCT%% of requests (and replicas) to --version, the rest "
                   "to the version before it, until a deploy without --canary"),
    "fast_profile": ("--fast-profile", "FaST-GShare profile as JSON, or @FILE holding it: "
                     '{"batch": N, "points": [{"sm_share", "quota", "throughput_rps", '
                     '"p99_latency_s"}, ...]}'),
    "protean_profile": ("--protean-profile", "PROTEAN profile as JSON or @FILE (what "
                        "`flashpoint profile --protean` stores): {\"batch\": N, \"slices\": "
                        '[{"slice", "solo_s", "fbr", "fbr_bounded", "mem_bytes"}, ...]}'),
    "dilu_profile": ("--dilu-profile", "Dilu HGSS result as JSON or @FILE (what `flashpoint "
                     'profile --dilu` stores): {"sm_request", "sm_limit", "ibs", '
                     '"throughput_rps", "trials"}'),
    "inputs": ("--input", "an input tensor NAME:DTYPE:SHAPE, e.g. x:FP32:-1,16 (repeat for "
               "each)"),
    "outputs": ("--output", "an output tensor NAME:DTYPE:SHAPE (repeat for each)"),
}
_JSON_FIELDS = ("fast_profile", "protean_profile", "dilu_profile")  # JSON text or @FILE
_STRUCTURED = (*_JSON_FIELDS, "inputs", "outputs")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def int_in(lo: int, hi: int | None = None) -> Any:
    """An argparse type: an integer in ``lo..hi``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: {lo}..{hi}" if hi is not None else f"{value} < {lo}")
        return value
    parse.__name__ = "integer"
    return parse


def number_in(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Any:
    """An argparse type: a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < lo or (lo_open and value == lo) or (hi is not None and value > hi) \
                or value != value:
            span = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range {span}")
        return value
    parse.__name__ = "number"
    return parse


def build() -> Parser:
    """The whole ``flashpoint`` parser."""
    p = Parser(prog="flashpoint", description="Flashpoint: serverless deep-learning "
               "inference. Run a cluster, publish models, deploy and invoke functions.")
    p.add_argument("--config", help="TOML configuration file (see configs/)")
    p.add_argument("--home", help="state directory for the embedded defaults "
                   "(registry, state.sqlite; default ~/.flashpoint)")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error (also FLASHPOINT_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_servers(sub)
    _add_keys(sub)
    _add_model(sub)
    _add_api(sub)
    demo = _sub(sub, "demo", "up, push, deploy, invoke, and print the timings")
    demo.add_argument("--hosts", type=int_in(1, MAX_LOCAL_HOSTS), default=2,
                      help="host managers to start (default 2)")
    demo.add_argument("--preset", default="small", help="BERT size: tiny|small|base|large")
    demo.add_argument("--requests", type=int_in(1), default=64,
                      help="requests to send (default 64)")
    demo.add_argument("--concurrency", type=int_in(1), default=8,
                      help="requests in flight at once (default 8)")
    sim = _sub(sub, "sim", "the data-centre simulator")
    ssub = sim.add_subparsers(dest="sim_cmd", required=True, metavar="SUBCOMMAND")
    from flashpoint.sim.reproduce import add_arguments as sim_arguments

    sim_arguments(ssub.add_parser("reproduce", help="the thesis's evaluation grid, as a report"))
    return p


def _sub(sub: Any, name: str, helptext: str) -> Parser:
    """A subcommand; ``--debug`` is accepted after it too (never overriding the global)."""
    sp: Parser = sub.add_parser(name, help=helptext, description=helptext)
    sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                    help="show the traceback of an error (also FLASHPOINT_DEBUG=1)")
    return sp


def _add_servers(sub: Any) -> None:
    insecure_help = ("serve HTTP beyond loopback with no [gateway] api_keys (every caller an "
                     "admin); logged as a warning at every start")
    up = _sub(sub, "up", "run a controller and N host managers on this machine")
    up.add_argument("--hosts", type=int_in(1, MAX_LOCAL_HOSTS), default=2,
                    help=f"host managers to start (1..{MAX_LOCAL_HOSTS}, default 2)")
    controller = _sub(sub, "controller", "run the controller")
    gateway = _sub(sub, "gateway", "run the HTTP API in its own process, in front of the "
                   "controller (survives controller restarts)")
    gateway.add_argument("--port", type=int_in(0, 65535),
                         help="listen port (default: [gateway] listen_port; 0 = any free one)")
    for sp in (up, controller, gateway):
        sp.add_argument("--insecure", action="store_true", help=insecure_help)
    host = _sub(sub, "host", "run one host manager")
    host.add_argument("--host-id", help="this host's id (default: [host] host_id, else the "
                      "hostname)")
    secret = _sub(sub, "secret", "cluster secrets and API keys")
    secret_sub = secret.add_subparsers(dest="secret_cmd", required=True, metavar="SUBCOMMAND")
    secret_sub.add_parser("generate", help="print a new random secret (32 bytes, hex): the "
                                           "cluster secret or an API key")


def _add_keys(sub: Any) -> None:
    keys = _sub(sub, "keys", "print the environment lines of a host's or a gateway's own "
                "credential (run where the cluster secret is)")
    keys.add_argument("role", choices=["host", "gateway"], help="whose credential")
    keys.add_argument("host_id", nargs="?", help="the host's id (its hostname by default)")


def _add_model(sub: Any) -> None:
    model = _sub(sub, "model", "model registry commands: push, list, delete")
    msub = model.add_subparsers(dest="model_cmd", required=True, metavar="SUBCOMMAND")
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
    push.add_argument("--top-k", type=int_in(0), default=0,
                      help="labels per answer (default 0: the model's default, 5)")
    push.add_argument("--preset", default="tiny", help="built-in models: tiny|small|base|large")
    push.add_argument("--version", default="1", help="the version to publish (default 1)")
    push.add_argument("--name", help="registry name of a built-in model pushed without SOURCE")
    push.add_argument("--profile", action="store_true",
                      help="measure each layer (bytes, exec time, output size) into the manifest")
    push.add_argument("--profile-device", default="cpu", help="device to profile on (cpu, cuda)")
    ls = msub.add_parser("list", help="the models in the registry (name, version, size)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rm = msub.add_parser("delete", help="delete a model's version (all versions without "
                                        "--version) from the registry")
    rm.add_argument("model", help="registry name")
    rm.add_argument("--version", help="the version to delete (default: every version)")


def _add_api(sub: Any) -> None:
    """The commands that talk to a running cluster's HTTP API."""
    for name, helptext in (("deploy", "register (or update) a function"),
                           ("invoke", "invoke a function"),
                           ("functions", "list the registered functions"),
                           ("delete", "delete a function (its replicas stop)"),
                           ("status", "cluster status: hosts, replicas, functions"),
                           ("profile", "measure a function's FaST (SM share x quota grid), "
                            "PROTEAN (Solo, FBR) and Dilu (HGSS) profiles with trials on a "
                            "GPU-sharing host, and store them on it")):
        sp = _sub(sub, name, helptext)
        sp.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL),
                        help=f"the cluster's API (default ${URL_ENV}, else {DEFAULT_URL})")
        sp.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                        help=f"API key for a cluster with [gateway] api_keys (default ${KEY_ENV})")
        if name in ("functions", "status", "profile"):
            sp.add_argument("--json", action="store_true",
                            help="print the API's JSON instead of tables")
        if name == "deploy":
            _add_deploy(sp)
        if name == "delete":
            sp.add_argument("function", help="the function's name")
        if name == "profile":
            _add_profile(sp)
        if name == "invoke":
            sp.add_argument("function", help="the function's name")
            given = sp.add_mutually_exclusive_group(required=True)
            given.add_argument("--inputs",
                               help='tensors as JSON: {"x": {"data", "shape", "datatype"}}')
            given.add_argument("--text", action="append",
                               help="a text for a text model (repeat for several)")
            given.add_argument("--image", action="append", type=Path,
                               help="an image file (JPEG/PNG) for an image model (repeatable)")
            gen = sp.add_argument_group(
                "text generation", "for a language model: any of these prints the completion "
                "as text (through /v1/completions) instead of the tensors")
            gen.add_argument("--max-tokens", type=int_in(1), default=None,
                             help="the most tokens to generate")
            gen.add_argument("--temperature", type=number_in(0.0), default=None,
                             help="0 = greedy (default 1)")
            gen.add_argument("--seed", type=int, default=None,
                             help="a seed for reproducible sampling")
            gen.add_argument("--stream", action="store_true",
                             help="print the tokens as they are generated")


def grid(text: str) -> tuple[list[float], list[float]]:
    """An argparse type: ``SHARES x QUOTAS``, each a comma list of fractions in (0, 1],
    e.g. ``0.25,0.5,1x0.5,1``."""
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: want SM shares x quotas, e.g. 0.5,1x0.5,1")
    frac = number_in(0.0, 1.0, lo_open=True)
    try:
        shares, quotas = ([frac(v) for v in p.split(",") if v.strip()] for p in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not shares or not quotas:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one SM share and one quota")
    return shares, quotas


def _add_profile(sp: Parser) -> None:
    sp.add_argument("function", help="the function's name")
    sp.add_argument("--grid", type=grid, metavar="SHARESxQUOTAS",
                    help="FaST's grid: SM shares x time quotas, comma lists of fractions "
                         "(default 0.5,1x0.5,1; the paper's is 7 x 5)")
    sp.add_argument("--no-fast", dest="fast", action="store_false",
                    help="skip the FaST grid (then ask for --protean or --dilu)")
    sp.add_argument("--protean", action="store_true",
                    help="also measure PROTEAN's Solo run and a co-located run, and fit FBR")
    sp.add_argument("--colocate", type=int_in(2, 8), metavar="N",
                    help="replicas in PROTEAN's co-located run (default 2)")
    sp.add_argument("--dilu", action="store_true",
                    help="also run Dilu's HGSS search (needs --slo-ms or the function's)")
    sp.add_argument("--max-ibs", dest="dilu_max_ibs", type=int_in(1, 1024), metavar="N",
                    help="largest inference batch HGSS tries (default 8)")
    sp.add_argument("--slo-ms", type=number_in(0, lo_open=True), metavar="MS",
                    help="latency objective for HGSS (default: the function's slo_ms)")
    sp.add_argument("--batch", type=int_in(1, 1024), metavar="N",
                    help="batch size of the FaST and PROTEAN trials (default 1)")
    sp.add_argument("--requests", type=int_in(1, 10_000), metavar="N",
                    help="measured requests per trial (default 20)")
    sp.add_argument("--inputs", help='one request\'s tensors as JSON, {"x": {"data", "shape", '
                    '"datatype"}} (default: zeros of the declared inputs)')
    sp.add_argument("--timeout-s", type=number_in(0, 3600, lo_open=True), metavar="SECONDS",
                    help="give up after this many seconds (default 600)")


def profile_body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of ``POST /v1/functions/{name}/profile`` from the flags given."""
    import json

    from flashpoint.errors import BadRequest

    body: dict[str, Any] = {}
    if args.grid is not None:
        body["sm_shares"], body["quotas"] = args.grid
    if not args.fast:
        body["fast"] = False
    for key in ("protean", "dilu"):
        if getattr(args, key):
            body[key] = True
    for key in ("colocate", "dilu_max_ibs", "slo_ms", "batch", "requests", "timeout_s"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.inputs is not None:
        try:
            body["inputs"] = json.loads(args.inputs)
        except ValueError as e:
            raise BadRequest(f"--inputs is not JSON: {e}") from None
    return body


def _add_deploy(sp: Parser) -> None:
    sp.add_argument("function", help="the function's name")
    sp.add_argument("--model", required=True, help="the registry model it serves")
    hints = typing.get_type_hints(FunctionSpec)
    for f in dataclasses.fields(FunctionSpec):
        if f.name in ("name", "model"):
            continue
        flag, helptext = SPEC_FLAGS[f.name]
        if f.name in ("inputs", "outputs"):
            sp.add_argument(flag, dest=f.name, action="append", metavar="NAME:DTYPE:SHAPE",
                            help=helptext)
        elif f.name in _JSON_FIELDS:
            sp.add_argument(flag, dest=f.name, metavar="JSON|@FILE", help=helptext)
        elif f.name == "tenant_class":
            sp.add_argument(flag, dest=f.name, choices=[c.value for c in TenantClass],
                            help=helptext)
        elif f.name == "canary_pct":
            # no range here: the controller's check (FunctionSpec) answers a typed 400
            sp.add_argument(flag, dest=f.name, metavar="PCT", type=float, help=helptext)
        elif hints[f.name] is int:
            sp.add_argument(flag, dest=f.name, type=int_in(0), help=helptext,
                            metavar="BYTES" if f.name.endswith("_bytes") else "N")
        elif hints[f.name] is float:
            sp.add_argument(flag, dest=f.name, type=number_in(0), help=helptext,
                            metavar=_number_metavar(f.name))
        else:
            sp.add_argument(flag, dest=f.name, help=helptext, metavar=f.name.split("_")[-1].upper())
    sp.add_argument("--wait", action="store_true",
                    help="wait for --min-replicas warm (and a new version's roll-out to "
                         "settle), drawing transfer and roll-out progress")
    sp.add_argument("--wait-timeout-s", type=number_in(0, lo_open=True), default=600.0,
                    help="give up waiting after this many seconds (default 600)")


def _number_metavar(name: str) -> str:
    for suffix, metavar in (("_ms", "MS"), ("_s", "SECONDS")):
        if name.endswith(suffix):
            return metavar
    return "FRACTION"


def spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The FunctionSpec fields given on the command line (structured ones parsed), as the
    JSON body of ``POST /v1/functions``; fields not given take the server's defaults."""
    import json

    from flashpoint.errors import BadRequest
    from flashpoint.models.sources.base import parse_tensor_spec

    body: dict[str, Any] = {"name": args.function, "model": args.model}
    for f in dataclasses.fields(FunctionSpec):
        value = getattr(args, f.name, None) if f.name not in ("name", "model") else None
        if value is None:
            continue
        if f.name in ("inputs", "outputs"):
            value = [parse_tensor_spec(t).to_dict() for t in value]
        elif f.name in _JSON_FIELDS:
            text = Path(value[1:]).read_text() if value.startswith("@") else value
            try:
                value = json.loads(text)
            except ValueError as e:
                raise BadRequest(f"{SPEC_FLAGS[f.name][0]} is not JSON: {e}") from None
        body[f.name] = value
    return body
