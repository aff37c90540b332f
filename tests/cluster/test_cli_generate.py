"""``flashpoint invoke FN --text P`` with generation options against a real local cluster
serving a Llama-style causal LM: the completion is printed as text (streamed with
``--stream``), equal to ``transformers``' greedy ``generate`` in this process; the counts go
to stderr; a mistake is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from flashpoint.models.sources import publish_source
from flashpoint.models.tiny_hf import make_causal_lm
from flashpoint.registry import make_store
from flashpoint.spec import FunctionSpec
from flashpoint.testing.harness import ClusterFactory, cluster_config
from tests.cli.conftest import assert_one_line_error, run_cli

from .conftest import greedy_reference

pytestmark = pytest.mark.timeout(240)

PROMPT = "a cold start fetches bytes from a peer"


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.stdout == "", r.stdout
    assert_one_line_error(r, *needles)


async def test_invoke_prints_a_completion_and_streams_it(make_cluster: ClusterFactory,
                                                         tmp_path: Path) -> None:
    model_dir = make_causal_lm(tmp_path / "src", family="llama")
    cfg = cluster_config(tmp_path)
    store = make_store(cfg)
    await publish_source(store, "tiny-llama", model_dir)
    cluster = await make_cluster(hosts=1, models=(), config=cfg, store=store, start_timeout_s=90)
    await cluster.controller.register_function(FunctionSpec(name="llm", model="tiny-llama"))
    url, home = cluster.controller.url, tmp_path / "cli-home"
    want_ids, want_text = greedy_reference(model_dir, PROMPT, 9)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return run_cli("invoke", "--url", url, *argv, home=home)

    # a scale from zero, then the text alone on stdout
    done = await asyncio.to_thread(run, "llm", "--text", PROMPT, "--max-tokens", "9",
                                   "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want_text + "\n"
    assert f"{len(want_ids)} tokens" in done.stderr and "finish " in done.stderr

    streamed = await asyncio.to_thread(run, "llm", "--text", PROMPT, "--max-tokens", "9",
                                       "--temperature", "0", "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == want_text + "\n"
    assert f"{len(want_ids)} tokens" in streamed.stderr
    assert "first token after" in streamed.stderr

    # seeded sampling: the same seed, the same text, streamed or not
    seeded = [await asyncio.to_thread(run, "llm", "--text", PROMPT, "--max-tokens", "6",
                                      "--temperature", "1", "--seed", "11", *extra)
              for extra in ((), ("--stream",))]
    assert seeded[0].returncode == seeded[1].returncode == 0
    assert seeded[0].stdout == seeded[1].stdout and seeded[0].stdout.strip()

    # mistakes: one line each, nothing on stdout
    _one_line_error(await asyncio.to_thread(run, "llm", "--text", "a", "--text", "b",
                                            "--stream"), "exactly one --text")
    _one_line_error(await asyncio.to_thread(run, "llm", "--text", "a", "--max-tokens", "0"),
                    "--max-tokens")
    _one_line_error(await asyncio.to_thread(run, "nope", "--text", "a", "--stream"),
                    "404", "function_not_found")
    _one_line_error(await asyncio.to_thread(run, "llm", "--text", "word " * 600, "--stream"),
                    "400", "input_too_long")
