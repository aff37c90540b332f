"""The commands that call a running cluster's HTTP API: ``deploy``, ``invoke``,
``functions``, ``delete``, ``status`` and ``profile``.

An error answer becomes the typed error it stands for (``client.error_from_body``) with
its HTTP status in ``details["http_status"]``; nothing listening at the URL becomes
``ConnectFailed`` saying to start a cluster (flashpoint/cli/failures.py prints both).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from typing import Any

from flashpoint.cli.failures import api_error, reaching
from flashpoint.cli.generate import complete, wants_generation
from flashpoint.cli.parser import profile_body, spec_fields
from flashpoint.cli.tables import function_lines, profile_lines, status_lines
from flashpoint.errors import BadRequest
from flashpoint.progress import rolling

HTTP_TIMEOUT_S = 120.0


async def http(method: str, url: str, body: Any = None, key: str | None = None,
               base: str = "", timeout_s: float = HTTP_TIMEOUT_S) -> Any:
    """``method url`` with a JSON body; the JSON answer (or its text when not JSON).
    ``base`` is the cluster URL the error names when nothing answers."""
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with reaching(url, base):
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.request(method, url, json=body, headers=headers) as r:
                text = await r.text()
    if r.status >= 400:
        raise api_error(r.status, text)
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON (a proxy's page, say): show it as it came


def invoke_body(args: argparse.Namespace) -> dict[str, Any]:
    """The native invoke body of ``--inputs`` JSON, ``--text`` or ``--image`` files."""
    if args.text:
        return {"text": args.text if len(args.text) > 1 else args.text[0]}
    if args.image:
        images = [base64.b64encode(p.read_bytes()).decode() for p in args.image]
        return {"image": images if len(images) > 1 else images[0]}
    try:
        return {"inputs": json.loads(args.inputs)}
    except ValueError as e:
        raise BadRequest(f"--inputs is not JSON: {e}") from None


async def wait_deployed(args: argparse.Namespace, rollout: bool = False) -> int:
    """Show transfer bars and replica phases (and, for a ``rollout``, the old and new
    versions' warm replicas) until ``min_replicas`` are warm and the roll-out settled, or
    ``--wait-timeout-s`` passed. On a terminal the lines are redrawn in place; elsewhere (a
    pipe, a CI log) each line is written when it changes, no control characters."""
    from flashpoint.progress import ready, render, rollout_done, rollout_failed, rollout_line

    url, fn = args.url.rstrip("/"), args.function
    deadline = time.monotonic() + args.wait_timeout_s
    drawn = 0
    previous: set[str] = set()  # the last poll's lines (what a log already shows)
    previous_version: str | None = None  # a settled view no longer names the old version
    tty = sys.stderr.isatty()
    while True:
        status = await http("GET", f"{url}/v1/status", None, args.api_key, url)
        lines = render(status, fn)
        done = ready(status, fn, args.min_replicas or 0)
        view: dict[str, Any] = {}
        if rollout:
            info = await http("GET", f"{url}/v1/functions/{fn}", None, args.api_key, url)
            view = (info.get("rollout") if isinstance(info, dict) else None) or {}
            previous_version = view.get("previous_version") or previous_version
            lines.insert(0, rollout_line(fn, view, previous_version))
            done = done and rollout_done(view)
        if tty:
            if drawn:
                sys.stderr.write(f"\x1b[{drawn}F\x1b[J")  # redraw in place
            sys.stderr.write("".join(line + "\n" for line in lines))
            drawn = len(lines)
        else:  # one line per change: a log reads as a history
            sys.stderr.write("".join(line + "\n" for line in lines if line not in previous))
            previous = set(lines)
        sys.stderr.flush()
        if rollout and rollout_failed(view):
            sys.stderr.write(f"error: the roll-out to version {view.get('version')} failed: "
                             f"{view.get('reason') or 'its replicas kept failing to start'} "
                             f"— version {view.get('previous_version')} still serves\n")
            return 1
        if done:
            return 0
        if time.monotonic() > deadline:
            what = (f"the roll-out to version {view.get('version')}" if rollout else
                    f"{args.min_replicas} warm replica(s)")
            sys.stderr.write(f"error: timed out after {args.wait_timeout_s}s waiting for "
                             f"{what} — `flashpoint status` shows where they are\n")
            return 1
        await asyncio.sleep(0.25)


async def run(args: argparse.Namespace) -> int:
    """One API command; prints its answer (JSON, or tables for status and functions)."""
    url, key = args.url.rstrip("/"), args.api_key
    if args.cmd == "deploy":
        body = spec_fields(args)
        answer = await http("POST", f"{url}/v1/functions", body, key, url)
        print(json.dumps(answer, indent=2), flush=True)
        # A new version of a live function: wait for its roll-out too (progress.rolling).
        roll = isinstance(answer, dict) and rolling(answer.get("rollout") or {})
        if args.wait and ((args.min_replicas or 0) > 0 or roll):
            return await wait_deployed(args, rollout=roll)
    elif args.cmd == "invoke" and wants_generation(args):
        return await complete(args)
    elif args.cmd == "invoke":
        answer = await http("POST", f"{url}/v1/functions/{args.function}/invoke",
                            invoke_body(args), key, url)
        print(json.dumps(answer, indent=2))
    elif args.cmd == "functions":
        functions = await http("GET", f"{url}/v1/functions", None, key, url)
        print(json.dumps(functions, indent=2) if args.json else "\n".join(function_lines(functions)))
    elif args.cmd == "profile":
        body = profile_body(args)
        # the run's own limit (default 600 s) plus slack for the answer
        answer = await http("POST", f"{url}/v1/functions/{args.function}/profile", body, key,
                            url, timeout_s=float(body.get("timeout_s", 600.0)) + 30.0)
        print(json.dumps(answer, indent=2) if args.json else "\n".join(profile_lines(answer)))
    elif args.cmd == "delete":
        answer = await http("DELETE", f"{url}/v1/functions/{args.function}", None, key, url)
        print(json.dumps(answer, indent=2))
    else:
        status = await http("GET", f"{url}/v1/status", None, key, url)
        print(json.dumps(status, indent=2) if args.json else "\n".join(status_lines(status)))
    return 0
