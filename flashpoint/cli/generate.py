"""``flashpoint invoke FN --text PROMPT`` with generation options (``--max-tokens``,
``--temperature``, ``--seed``, ``--stream``): a completion from a text-generation function
through the OpenAI route (``/v1/completions``), printed as text rather than tensors.

``--stream`` prints the tokens as they arrive (server-sent events); the counts and the time
to the first token go to stderr, so stdout holds only the completion. An error before the
stream starts is the API's typed error (as any command's); one in the middle of a stream
(the API can no longer change its status) is raised the same way, after the text so far.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from flashpoint.cli.failures import api_error, reaching
from flashpoint.errors import BadRequest, from_wire

# a long generation may stream for minutes; each read is bounded instead (below)
READ_TIMEOUT_S = 120.0


def wants_generation(args: argparse.Namespace) -> bool:
    """Whether ``invoke`` was given any generation option."""
    return args.stream or any(getattr(args, k) is not None
                              for k in ("max_tokens", "temperature", "seed"))


def completion_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``invoke``'s prompt and options."""
    if not args.text or len(args.text) != 1:
        raise BadRequest("generation options (--max-tokens, --temperature, --seed, --stream) "
                         "take exactly one --text prompt")
    body: dict[str, Any] = {"model": args.function, "prompt": args.text[0],
                            "stream": bool(args.stream)}
    for key in ("max_tokens", "temperature", "seed"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def complete(args: argparse.Namespace) -> int:
    """Run the completion and print it (module docstring)."""
    import aiohttp

    url = args.url.rstrip("/")
    body = completion_body(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    started = time.monotonic()
    with reaching(url):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10.0, sock_read=READ_TIMEOUT_S)) as s, \
                s.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status >= 400:
                raise api_error(r.status, await r.text())
            if not args.stream:
                answer = await r.json()
                print(answer["choices"][0]["text"], flush=True)
                _summary(answer.get("usage") or {}, answer["choices"][0].get("finish_reason"),
                         None)
                return 0
            return await _print_stream(r, started)


async def _print_stream(r: Any, started: float) -> int:
    first_s: float | None = None
    usage: dict[str, int] = {}
    finish = None
    async for raw in r.content:  # one line at a time
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:  # too late for a status: the API says it in the stream
            sys.stdout.write("\n")
            err = event["error"]
            raise from_wire({"code": err.get("code", "internal"),
                             "message": err.get("message", "")})
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            if choice.get("text"):
                if first_s is None:
                    first_s = time.monotonic() - started
                sys.stdout.write(choice["text"])
                sys.stdout.flush()
            finish = choice.get("finish_reason") or finish
    sys.stdout.write("\n")
    sys.stdout.flush()
    _summary(usage, finish, first_s)
    return 0


def _summary(usage: dict[str, int], finish: str | None, first_s: float | None) -> None:
    parts = [f"{usage.get('completion_tokens', '?')} tokens",
             f"prompt {usage.get('prompt_tokens', '?')}", f"finish {finish or '?'}"]
    if first_s is not None:
        parts.append(f"first token after {first_s * 1e3:.0f} ms")
    sys.stderr.write(", ".join(parts) + "\n")

