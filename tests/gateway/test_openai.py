"""The OpenAI routes' request parsing (a bad body is a 400 with a code before any model
runs) and their API keys (the same as the native routes'). Served answers are tested
against transformers in tests/cluster/test_generation.py."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest

from flashpoint.errors import BadRequest
from flashpoint.gateway.openai import generation_inputs

from .conftest import ADMIN_KEY, INVOKE_KEY, ThreadedServer


def test_a_completion_body_becomes_generation_tensors() -> None:
    inputs = generation_inputs({"model": "m", "prompt": "hi", "max_tokens": 5,
                                "temperature": 0, "top_p": 0.5, "seed": 3,
                                "stop": ["a", "b"]}, chat=False)
    assert inputs["text"].tolist() == [b"hi"]
    assert inputs["max_tokens"].tolist() == [5] and inputs["seed"].tolist() == [3]
    assert inputs["temperature"].dtype == np.float32 and inputs["top_p"].tolist() == [0.5]
    assert inputs["stop"].shape == (1, 2)  # every input shares the leading dimension
    chat = generation_inputs({"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "stop": "s"}, chat=True)
    assert b'"role": "user"' in chat["messages"][0] and chat["stop"].shape == (1, 1)


def test_chat_content_parts_become_text_and_roles_are_openais() -> None:
    import json

    chat = generation_inputs({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"},
                                     {"type": "text", "text": "two"}], "name": "ann"},
    ]}, chat=True)
    assert json.loads(chat["messages"][0]) == [{"role": "developer", "content": "be brief"},
                                               {"role": "user", "content": "one\ntwo"}]


@pytest.mark.parametrize("messages, says", [
    ([], "non-empty"),
    ("hi", "non-empty"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\].role must be one of"),
    ([{"role": "user"}], r"messages\[0\].content must be"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], "only text parts"),
    ([{"role": "user", "content": ["plain"]}], "only text parts"),
])
def test_bad_chat_messages_are_bad_requests(messages: object, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        generation_inputs({"model": "m", "messages": messages}, chat=True)


@pytest.mark.parametrize("body, says", [
    ({"model": "m"}, "'prompt'"),
    ({"model": "m", "prompt": ["a", "b"]}, "'prompt'"),
    ({"model": "m", "prompt": "a", "n": 2}, "n = 1"),
    ({"model": "m", "prompt": "a", "max_tokens": "9"}, "max_tokens"),
    ({"model": "m", "prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "a", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "a", "stop": ["s"] * 17}, "stop"),
    ({"model": "m", "prompt": "a", "presence_penalty": 1.0}, "presence_penalty"),
    ({"model": "m", "prompt": "a", "tools": []}, "unsupported fields"),
    ([], "JSON object"),
])
def test_bad_bodies_are_bad_requests(body: object, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        generation_inputs(body, chat=False)


async def test_same_api_keys_as_the_native_routes(auth_server: ThreadedServer) -> None:
    async with aiohttp.ClientSession(auth_server.url) as s:
        async with s.get("/v1/models") as r:
            assert r.status == 401
        async with s.post("/v1/completions", json={"model": "identity", "prompt": "a"}) as r:
            assert r.status == 401
        # a function whose model answers as a text-generation model does (its outputs)
        gen_outputs = [{"name": n, "datatype": d, "shape": [-1]} for n, d in (
            ("text", "BYTES"), ("token_ids", "INT64"), ("finish_reason", "BYTES"),
            ("prompt_tokens", "INT64"), ("completion_tokens", "INT64"))]
        async with s.post("/v1/functions", json={"name": "chatty", "model": "identity",
                                                 "outputs": gen_outputs},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status in (200, 201), await r.text()
        async with s.get("/v1/models", headers={"Authorization": f"Bearer {INVOKE_KEY}"}) as r:
            assert r.status == 200
            body = await r.json()
        # the text-generation functions only: "identity" (tensors in, tensors out) is not one
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["chatty"]
        async with s.post("/v1/completions", json={"model": "identity", "prompt": "a"},
                          headers={"Authorization": f"Bearer {INVOKE_KEY}"}) as r:
            err = await r.json()
            assert r.status == 400 and err["code"] == "bad_request", err
            assert "does not generate text" in err["error"], err
        async with s.post("/v1/completions", json={"model": "nope", "prompt": "a"},
                          headers={"Authorization": f"Bearer {INVOKE_KEY}"}) as r:
            assert r.status == 404 and (await r.json())["code"] == "function_not_found"
        async with s.post("/v1/completions", json={"model": "identity", "prompt": "a",
                                                    "n": 3},
                          headers={"Authorization": f"Bearer {INVOKE_KEY}"}) as r:
            assert r.status == 400 and (await r.json())["code"] == "bad_request"


def test_the_gateway_knows_the_generation_tasks_outputs() -> None:
    """The gateway tells a text-generation function by its outputs without importing the
    serving module (it needs torch); the names it looks for are that module's."""
    from flashpoint.gateway.openai import GENERATION_OUTPUTS
    from flashpoint.models.serving.generation import OUTPUTS

    assert GENERATION_OUTPUTS <= set(OUTPUTS)
