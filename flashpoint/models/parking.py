"""Parked prefixes: multi-round, token-based live migration's destination half (ServerlessLLM
§5; issue 21 items 5 and 7).

A sequence about to move here is first *parked*: while its source keeps generating, this
replica prefills the sequence's prompt + the tokens it had generated at a snapshot into a
KV cache held under the request's id, without generating. When the source then stops it and
the request resumes here, the engine finds the parked cache (same request id, same prompt,
its tokens a prefix of the resumed ones) and only extends it with the few tokens the source
generated since the snapshot -- one small pass instead of the whole prefill inside the
client's gap. Anything else (no park, a different prompt, tokens that disagree) discards the
park and prefills as before, so a park can only save time, never change a token.

The prefix holds every snapshot token but the last: that one was sampled on the source and
never fed, like the last token of any hand-off, so a resumed sequence always has at least
one token to extend with and the extension's last position gives its next token.

Each park reserves what the sequence will need (prompt + ``max_tokens``, as a running
sequence does) out of the replica's KV budget when it is asked for; it is refused with
:class:`~flashpoint.errors.KvCacheFull` when that does not fit now, and the reservation
passes to the sequence on resume, or is freed when the park is dropped (unparked, expired,
discarded on a mismatch). Pure data: :class:`~flashpoint.models.generate.GenerationEngine`
does the passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpoint.models.kv_batch import RowSource


@dataclass
class ParkedPrefix:
    """One parked sequence: ``fed_ids`` are the generated tokens its cache holds (after the
    prompt's); ``source`` its keys and values once prefilled (None while it waits for the
    pass); ``reserved_bytes`` what it holds of the replica's KV budget."""

    key: str
    prompt_ids: tuple[int, ...]
    fed_ids: tuple[int, ...]
    reserved_bytes: int
    expires_s: float
    source: RowSource | None = None
    prefill_s: float = 0.0  # how long the pass that prefilled it took

    @property
    def length(self) -> int:
        """Tokens in its cache."""
        return len(self.prompt_ids) + len(self.fed_ids)

    @property
    def ready(self) -> bool:
        return self.source is not None

    def matches(self, prompt_ids: tuple[int, ...] | list[int],
                generated_ids: tuple[int, ...] | list[int]) -> bool:
        """Whether a resumed sequence of these ids may go on from this cache: the same
        prompt, and the cached tokens a strict prefix of its generated ones (at least one
        left to extend with)."""
        n = len(self.fed_ids)
        return (self.ready and tuple(prompt_ids) == self.prompt_ids
                and len(generated_ids) > n and tuple(generated_ids[:n]) == self.fed_ids)
