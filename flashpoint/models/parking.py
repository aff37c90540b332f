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
discarded on a mismatch). :class:`ParkingMixin` is the engine's part
(:class:`~flashpoint.models.generate.GenerationEngine` inherits it): parking, dropping,
expiry, the parks' prefill pass and the resumed sequences' extension pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from flashpoint.errors import InvalidInput, KvCacheFull
from flashpoint.models.kv_batch import BatchKv, RowSource

# The engine's sequences and sampling parameters (``models/generate.py``, which imports this
# module) are typed ``Any`` here: no import back.
GenSequence = Any
SamplingParams = Any


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
    prefill_s: float = 0.0  # how long the pass that prefilled it took (its first round)
    # a later round's park (multi-round): the ready prefix it extends, until its pass
    base: ParkedPrefix | None = None

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


class ParkingMixin:
    """The engine's parking (module docstring). Expects the engine's ``_fit``,
    ``_forward_rows``, ``model``, ``device``, ``reserved_bytes``, ``kv_budget_bytes`` and the
    attributes it sets in ``__init__`` (``parked``, ``_to_park``, ...)."""

    parked: dict[str, ParkedPrefix]
    _to_park: list[ParkedPrefix]
    reserved_bytes: int
    kv_budget_bytes: int
    model: Any
    device: Any
    _cache_kw: str
    _logits_kw: str | None
    _fit: Any
    _forward_rows: Any

    def park(self, key: str, prompt_ids: Sequence[int], generated_ids: Sequence[int],
             params: SamplingParams, *, expires_s: float) -> bool:
        """Prefill ``prompt_ids`` + all but the last of ``generated_ids`` at the next step
        and hold the cache under ``key`` until a sequence resumed under it takes it
        (:meth:`add`), :meth:`unpark` or :meth:`expire` (``expires_s``, on the caller's
        clock). Reserves the sequence's whole need now: KvCacheFull when it does not fit
        (the caller moves the sequence without a park). Parking a key again with a longer
        snapshot of the same sequence (a later round) extends the ready prefix by the new
        tokens in a small pass instead; with any other it replaces it. True when the park is
        ready at once (a later round with no new token), else it is at the next step."""
        params, need = self._fit(prompt_ids, params)
        if len(generated_ids) >= params.max_tokens:
            raise InvalidInput("the sequence has no tokens left to generate")
        fed = tuple(generated_ids[:-1])
        old = self.parked.get(key)
        if old is not None and old.ready and old.prompt_ids == tuple(prompt_ids) \
                and fed[:len(old.fed_ids)] == old.fed_ids:
            # a later round: extend the parked prefix by the tokens generated since (it
            # keeps its reservation); nothing new: it is ready as it is
            if len(fed) == len(old.fed_ids):
                old.expires_s = expires_s
                return True
            later = ParkedPrefix(key, old.prompt_ids, fed, old.reserved_bytes, expires_s,
                                 base=old)
            self.parked[key] = later
            self._to_park.append(later)
            return False
        self.unpark(key)
        if self.reserved_bytes + need > self.kv_budget_bytes:
            raise KvCacheFull(f"parking needs {need} bytes of KV cache; "
                              f"{self.kv_budget_bytes - self.reserved_bytes} are free",
                              retry_after_s=0.5)
        entry = ParkedPrefix(key, tuple(prompt_ids), fed, need, expires_s)
        self.reserved_bytes += need
        self.parked[key] = entry
        self._to_park.append(entry)
        return False

    def unpark(self, key: str) -> bool:
        """Drop the prefix parked under ``key`` (its reservation freed); whether one was."""
        entry = self.parked.pop(key, None)
        if entry is None:
            return False
        if entry in self._to_park:
            self._to_park.remove(entry)
        self.reserved_bytes -= entry.reserved_bytes
        return True

    def expire(self, now_s: float) -> list[str]:
        """Drop the parks whose time is up (nothing resumed them); their keys."""
        gone = [k for k, e in self.parked.items() if e.expires_s <= now_s]
        for k in gone:
            self.unpark(k)
        return gone

    @property
    def parked_bytes(self) -> int:
        """KV budget held by parked prefixes."""
        return sum(e.reserved_bytes for e in self.parked.values())

    def _park_pending(self) -> list[str]:
        """One pass over the parks asked for since the last step (module docstring): the new
        ones prefilled together, a later round's extended from the prefix it replaces; their
        keys. Their logits are not wanted: the resume extends them."""
        parks, self._to_park = self._to_park, []
        started = time.perf_counter()
        fresh = [e for e in parks if e.base is None]
        if fresh:
            _, layers = self._forward_rows([[*e.prompt_ids, *e.fed_ids] for e in fresh])
            for j, e in enumerate(fresh):
                e.source = RowSource(layers, j, 0, e.length, e.length)  # end: set on resume
        later = [e for e in parks if e.base is not None]
        if later:
            _, rows = self._extend_rows(
                [e.base.source for e in later],  # type: ignore[union-attr]
                [list(e.fed_ids[len(e.base.fed_ids):]) for e in later],  # type: ignore[union-attr]
                [e.length for e in later])
            for e, row in zip(later, rows, strict=True):
                # the sequence's prefill stays the first round's; the earlier prefix's cache
                # can go
                e.source, e.prefill_s, e.base = row, e.base.prefill_s, None  # type: ignore[union-attr]
        took = time.perf_counter() - started
        for e in fresh:
            e.prefill_s = took
        return [e.key for e in parks]

    def _extend(self, seqs: list[GenSequence], rows_of: dict[int, RowSource]
                ) -> tuple[list[GenSequence], torch.Tensor]:
        """Resumed sequences onto their parked prefixes, each extended by the tokens its
        source generated after the park (:meth:`_extend_rows`); their next-token logits,
        ``[J, vocab]``, in ``seqs``' order. Their rows go into ``rows_of``."""
        sources = [s.parked.source for s in seqs]
        tails = [(s.prompt_ids + s.generated)[s.parked.length:] for s in seqs]
        logits, rows = self._extend_rows(sources, tails, [s.end for s in seqs])
        for s, row in zip(seqs, rows, strict=True):
            s.length = row.length
            rows_of[s.seq_id] = row
        return seqs, logits

    def _extend_rows(self, sources: list[RowSource], tails: list[list[int]], ends: list[int]
                     ) -> tuple[torch.Tensor, list[RowSource]]:
        """Cached rows extended by ``tails`` (at least one token each): one pass for the
        rows that add as many tokens (a small batch, right-aligned as the running one). Each
        row's next-token logits ``[R, vocab]`` and its new keys and values, in input order;
        ``ends``: how many tokens each may come to hold."""
        by_count: dict[int, list[int]] = {}
        for i, tail in enumerate(tails):
            by_count.setdefault(len(tail), []).append(i)
        logits: list[torch.Tensor | None] = [None] * len(tails)
        rows: list[RowSource | None] = [None] * len(tails)
        for count, group in by_count.items():
            batch = BatchKv.rebuild([replace(sources[i], end=ends[i]) for i in group])
            assert batch is not None
            mask, positions, cache = batch.decode_inputs(count)
            ids = torch.tensor([tails[i] for i in group], dtype=torch.long, device=self.device)
            kwargs: dict[str, Any] = {self._logits_kw: 1} if self._logits_kw else {}
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             **{self._cache_kw: cache}, use_cache=True, **kwargs)
            batch.advanced(count)
            for j, (i, row) in enumerate(zip(group, batch.sources(range(len(group))),
                                             strict=True)):
                logits[i], rows[i] = out.logits[j, -1], row
        return torch.stack(logits), rows  # type: ignore[arg-type]
