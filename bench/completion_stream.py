"""One streamed completion over the OpenAI route, read as a client sees it (shared by
``bench/generate.py`` and ``bench/generate_partitioned.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamedCompletion:
    """What one ``stream: true`` completion delivered: the clock readings at its first and
    last token-bearing events (``None`` when no text came), the text, and the usage event."""

    first: float | None = None
    last: float | None = None
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Completion tokens, from the usage event (0 when the stream had none)."""
        return int(self.usage.get("completion_tokens", 0))

    def tpot(self) -> float | None:
        """Mean time per output token after the first, in the clock's unit; ``None`` when
        fewer than two tokens came."""
        n = self.tokens
        if self.first is None or self.last is None or n <= 1:
            return None
        return (self.last - self.first) / (n - 1)


async def stream_completion(session: Any, url: str, fn: str, prompt: str, max_tokens: int, *,
                            clock: Callable[[], float] = time.perf_counter,
                            **post_kwargs: Any) -> StreamedCompletion:
    """POST one greedy streamed completion of ``prompt`` to ``fn`` and read its SSE events;
    token times are ``clock()`` readings taken as each event arrives. ``post_kwargs`` go to
    ``session.post`` (e.g. a longer ``timeout``). Raises ``RuntimeError`` on a non-200."""
    body = {"model": fn, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    out = StreamedCompletion()
    async with session.post(f"{url}/v1/completions", json=body, **post_kwargs) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            now = clock()
            for choice in event.get("choices", []):
                if choice.get("text"):
                    out.first = now if out.first is None else out.first
                    out.last = now
                    out.text += choice["text"]
            out.usage = event.get("usage") or out.usage
    return out
