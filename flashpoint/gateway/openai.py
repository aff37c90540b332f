"""OpenAI-compatible routes for text-generation functions (a function's name is the model):

    POST /v1/completions        invoke  {model, prompt, max_tokens?, temperature?, top_p?,
                                         stop?, seed?}  -> text_completion
    POST /v1/chat/completions   invoke  {model, messages, ...} -> chat.completion (the
                                         model's own chat template renders the messages)
    GET  /v1/models             invoke  the text-generation functions as models

``stream: true`` answers with server-sent events as the tokens come (a backend with
``invoke_stream``: the controller); a client that disconnects cancels its sequence.

Same API keys, admission and limits as the native routes. A request becomes the
generation task's tensors (:mod:`flashpoint.models.serving.generation`) and goes through
``InvokeBackend.invoke`` like any other; the answer's ``text``, ``finish_reason`` and token
counts become the OpenAI body with its ``usage``. Only ``n == 1`` is served.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import numpy as np
from aiohttp import web

from flashpoint.errors import BadRequest, FlashpointError
from flashpoint.gateway.admission import effective_timeout_s
from flashpoint.gateway.auth import Role
from flashpoint.gateway.backend import StreamChunk
from flashpoint.gateway.body import read_body
from flashpoint.gateway.context import (
    GatewayContext,
    json_response,
    parse_json_body,
    request_class,
    request_id,
)

_COMMON_KEYS = frozenset(("model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                          "stop", "seed", "stream", "n", "user", "stream_options",
                          "frequency_penalty", "presence_penalty", "logprobs"))
MAX_STOP = 16
# The roles OpenAI's chat API defines. Tools are not served, but a conversation may still
# carry a tool's earlier answer as text.
CHAT_ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))
# What a text-generation function answers with (models/serving/generation.py's OUTPUTS, kept
# in step by tests/gateway/test_openai.py; not imported: that module needs torch, a gateway
# does not).
GENERATION_OUTPUTS = frozenset(("text", "finish_reason", "completion_tokens"))


def generates(spec: Any) -> bool:
    """Whether function ``spec`` serves a text-generation model (the OpenAI routes' kind)."""
    return GENERATION_OUTPUTS <= {t.name for t in spec.outputs}


def _number(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not isinstance(value, int)):
        raise BadRequest(f"{key!r} must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def generation_inputs(body: Any, *, chat: bool) -> dict[str, np.ndarray]:
    """An OpenAI request body as the text-generation task's request tensors."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    allowed = _COMMON_KEYS | {"messages" if chat else "prompt"}
    unknown = set(body) - allowed
    if unknown:
        raise BadRequest(f"unsupported fields {sorted(unknown)}")
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is served")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise BadRequest(f"{key} is not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise BadRequest("logprobs are not supported")
    inputs: dict[str, np.ndarray] = {}
    if chat:
        inputs["messages"] = np.array([json.dumps(chat_messages(body.get("messages"))).encode()],
                                      dtype=object)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be one string")
        inputs["text"] = np.array([prompt.encode()], dtype=object)
    max_tokens = _number(body, "max_completion_tokens", int) or _number(body, "max_tokens", int)
    if max_tokens is not None:
        inputs["max_tokens"] = np.array([max_tokens], dtype=np.int64)
    for key in ("temperature", "top_p"):
        value = _number(body, key, float)
        if value is not None:
            inputs[key] = np.array([value], dtype=np.float32)
    seed = _number(body, "seed", int)
    if seed is not None:
        inputs["seed"] = np.array([seed], dtype=np.int64)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
                isinstance(s, str) and s for s in stop):
            raise BadRequest(f"'stop' must be a string or at most {MAX_STOP} strings")
        if stop:
            # [1, k]: every input shares the request's leading (batch) dimension
            inputs["stop"] = np.array([[s.encode() for s in stop]], dtype=object)
    return inputs


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """A chat body's ``messages`` as the worker takes them: ``{role, content}`` with text
    content. Content may come as OpenAI's list of parts: its text parts are joined (with a
    newline, as other OpenAI-compatible servers do); any other part (an image, audio) is a
    400, as is a role OpenAI does not define."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, "
                             f"got {role!r}")
        if isinstance(content, list):
            kinds = {p.get("type") if isinstance(p, dict) else None for p in content}
            if kinds - {"text"} or not all(isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are served "
                                 f"(type 'text' with a 'text' string)")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def _first(outputs: dict[str, np.ndarray], name: str) -> Any:
    value = outputs[name].reshape(-1)[0]
    return value.decode() if isinstance(value, (bytes, bytearray)) else value


def usage_of(outputs: dict[str, np.ndarray]) -> dict[str, int]:
    prompt, completion = int(_first(outputs, "prompt_tokens")), int(
        _first(outputs, "completion_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class OpenAIRoutes:
    """See the module docstring."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    def route_defs(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
        ]

    async def models(self, request: web.Request) -> web.Response:
        self.ctx.require(request, Role.INVOKE)
        return json_response({"object": "list", "data": [
            {"id": info.spec.name, "object": "model", "created": 0, "owned_by": "flashpoint"}
            for info in self.ctx.backend.list_functions() if generates(info.spec)]})

    async def completions(self, request: web.Request) -> web.Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.Response:
        ctx = self.ctx
        principal = ctx.require(request, Role.INVOKE)
        body = await parse_json_body(ctx, await read_body(request, ctx.config))
        inputs = generation_inputs(body, chat=chat)
        spec = ctx.spec(str(body.get("model", "")))
        if not generates(spec):
            raise BadRequest(f"function {spec.name!r} does not generate text: the OpenAI routes "
                             f"serve text-generation models (invoke it at "
                             f"/v1/functions/{spec.name}/invoke)")
        rid = request_id(request)
        timeout_s = effective_timeout_s(None, spec.timeout_s, ctx.config)
        if body.get("stream"):
            return await self._stream(request, body, inputs, spec.name, rid, timeout_s,
                                      ctx.caller(request, principal), chat=chat)
        result = await ctx.admission.invoke(ctx.backend, ctx.caller(request, principal),
                                            spec.name, inputs, request_id=rid,
                                            timeout_s=timeout_s,
                                            request_class=request_class(request))
        out = result.outputs
        text, finish = str(_first(out, "text")), str(_first(out, "finish_reason"))
        if chat:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return json_response({
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": spec.name,
            "choices": [choice],
            "usage": usage_of(out),
        })

    async def _stream(self, request: web.Request, body: dict[str, Any],
                      inputs: dict[str, np.ndarray], name: str, rid: str, timeout_s: float,
                      caller: str, *, chat: bool) -> web.StreamResponse:
        """``stream: true``: server-sent events, one per token boundary that adds text, a
        last one with ``finish_reason`` (and ``usage`` when ``stream_options.include_usage``),
        then ``data: [DONE]``. A client that goes away ends the stream at the next write,
        which cancels its sequence in the worker."""
        ctx = self.ctx
        open_stream = getattr(ctx.backend, "invoke_stream", None)
        if open_stream is None:
            raise BadRequest("stream: true is not served by this gateway")
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict[str, Any], usage: dict[str, int] | None = None) -> bytes:
            obj: dict[str, Any] = {"id": ident, "object": kind, "created": created,
                                   "model": name, "choices": [choice] if choice else []}
            if usage is not None:
                obj["usage"] = usage
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def delta(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text} if text or finish is None
                        else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        with ctx.admission.admitted(caller):
            stream = open_stream(name, inputs, request_id=rid, timeout_s=timeout_s,
                                 request_class=request_class(request))
            resp: web.StreamResponse | None = None
            try:
                async for item in stream:
                    if resp is None:  # headers only once the request is running (errors
                        resp = web.StreamResponse(headers={  # before it are JSON answers)
                            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                            "X-Request-Id": rid})
                        await resp.prepare(request)
                        if chat:
                            await resp.write(event({"index": 0, "finish_reason": None,
                                                    "delta": {"role": "assistant",
                                                              "content": ""}}))
                    if isinstance(item, StreamChunk):
                        if item.text:
                            await resp.write(event(delta(item.text, None)))
                        continue
                    out = item.outputs
                    await resp.write(event(delta("", str(_first(out, "finish_reason")))))
                    if include_usage:
                        await resp.write(event({}, usage_of(out)))
                    await resp.write(b"data: [DONE]\n\n")
            except ConnectionResetError:
                pass  # the client left: closing the stream below cancels its sequence
            except FlashpointError as exc:
                if resp is None:
                    raise  # nothing sent yet: the middleware's JSON error answer
                with contextlib.suppress(ConnectionResetError):  # too late for a status
                    await resp.write(b"data: " + json.dumps({"error": {
                        "code": exc.code, "message": exc.message}}).encode() + b"\n\n")
            finally:
                await stream.aclose()
        if resp is None:
            raise FlashpointError(f"request {rid}: the stream ended without an answer")
        return resp
