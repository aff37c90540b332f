"""Token generation for causal language models: one replica's engine, with continuous
batching.

The engine keeps the running sequences' KV cache as one batch
(:class:`~flashpoint.models.kv_batch.BatchKv`: a preallocated buffer per layer, one row per
sequence, right-aligned, left padding zeroed and masked). One :meth:`GenerationEngine.step`
is a token boundary: the sequences that were added since the last step join -- prefilled
together in one right-padded forward pass, each from position 0 (a row's tokens see only
those before them, so its pads, after its last token, change nothing it computes) -- then
every sequence already running takes one decode step together (the new keys and values are
written into the buffer in place, with an attention mask over the padding and each
sequence's own position ids), the joiners' rows are copied in, and the sequences that
finished (EOS, a stop string, ``max_tokens``, cancelled) leave. A sequence's tokens
therefore do not depend on what it was batched with (greedy ids equal
``model.generate(do_sample=False)``; sampling draws from its own seeded generator).

KV memory is reserved per sequence for its whole life (prompt + ``max_tokens``) out of a
fixed budget per replica, when it joins; a sequence that does not fit now waits for one to
leave, and one that could never fit is refused (:class:`~flashpoint.errors.KvCacheTooSmall`).
The batch's buffer also holds each row's left padding (rows x the longest, as the old
per-step padding did for a moment each step) and some headroom to grow into.

Live migration, multi-round (:mod:`flashpoint.models.parking`): :meth:`GenerationEngine.park`
prefills a sequence that is about to move here while its source still generates; the
resumed sequence (:meth:`~GenerationEngine.add` with its request's key) then joins by
extending that cache with the few tokens generated since, in one small pass (several
together when they extend by as many tokens).

This module is synchronous and owns no thread: :mod:`flashpoint.worker.generation` drives
it from the worker's event loop (steps on the model thread, joins and cancels between them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from flashpoint.errors import InputTooLong, InvalidInput, KvCacheTooSmall
from flashpoint.models.kv_batch import BatchKv, RowSource
from flashpoint.models.parking import ParkedPrefix, ParkingMixin

# One default, so the controller's token count (which cannot import torch) and the engine agree.
from flashpoint.policy.token_load import DEFAULT_MAX_TOKENS


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the model's positions
    CANCELLED = "cancelled"  # its client went away


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens. ``temperature == 0`` is greedy."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 1_000_000:
            raise InvalidInput("max_tokens must be in 1..1000000")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInput("temperature must be in 0..100")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput("top_p must be in (0, 1]")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise InvalidInput("stop: at most 16 non-empty strings")


@dataclass
class GenSequence:
    """One sequence's state inside the engine."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    reserved_bytes: int
    generated: list[int] = field(default_factory=list)
    text: str = ""  # generated text so far (cut at a stop string when one is found)
    emitted: str = ""  # the prefix of ``text`` already reported in events
    finish: FinishReason | None = None
    length: int = 0  # tokens in its KV cache
    pending: int | None = None  # sampled but not yet fed to the model
    generator: torch.Generator | None = None
    # a resumed sequence's parked prefix (live migration): it joins by extending that cache;
    # its reservation is already counted (it took the park's)
    parked: ParkedPrefix | None = None

    @property
    def end(self) -> int:
        """The most tokens its KV cache can hold (what it reserved)."""
        return len(self.prompt_ids) + self.params.max_tokens


@dataclass(frozen=True)
class TokenEvent:
    """What one step did to one sequence: its new token (``None`` when it left without
    one: cancelled) and its text delta (text that a stop string could still cut is held
    back until it cannot, so the deltas add up to the final text); ``finish`` once it has
    left."""

    seq_id: int
    token_id: int | None
    text_delta: str
    finish: FinishReason | None


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer, from a ``transformers`` config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 0) or text.n_layer)
    heads = int(getattr(text, "num_attention_heads", 0) or text.n_head)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    hidden = int(getattr(text, "hidden_size", 0) or text.n_embd)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """The next token from one row of logits: argmax when greedy, else temperature, then
    nucleus (top-p) filtering, then a draw from ``generator``."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p  # at least the best
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # drawn on the CPU, where the sequence's generator lives: the same seed gives the same
    # tokens whatever device the model runs on
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


class GenerationEngine(ParkingMixin):
    """See the module docstring. ``model`` is a ``transformers`` causal LM (eval mode);
    ``decode`` turns generated ids into text (stop strings are matched on it)."""

    def __init__(self, model: Any, *, eos_token_ids: Sequence[int], max_positions: int,
                 kv_budget_bytes: int, max_running: int,
                 decode: Callable[[list[int]], str]) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.bytes_per_token = kv_bytes_per_token(model.config, dtype)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_positions = max_positions
        self.kv_budget_bytes = kv_budget_bytes
        self.max_running = max_running
        self.decode = decode
        import inspect

        # transformers 5.x renames ``past_key_values`` to ``cache`` (the old name warns)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the LM head only over the positions whose next token is wanted (as generate does)
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep")
                                if k in params), None)
        self.waiting: deque[GenSequence] = deque()
        self.running: dict[int, GenSequence] = {}
        self.reserved_bytes = 0
        self.steps = 0
        # the last step's joins: seq id -> seconds of the prefill pass it joined in (a resumed
        # sequence's share of its migration gap)
        self.last_prefill_s: dict[int, float] = {}
        # the last step's joins onto a parked prefix: seq id -> seconds that prefix's prefill
        # took (ahead of the move)
        self.last_park_prefill_s: dict[int, float] = {}
        self._next_id = 0
        # live migration's parked prefixes by key (request id), and those not prefilled yet
        self.parked: dict[str, ParkedPrefix] = {}
        self._to_park: list[ParkedPrefix] = []
        self.last_parked: list[str] = []  # keys the last step prefilled
        self.park_hits = 0  # resumed sequences that went on from their parked prefix
        self.park_misses = 0  # parks discarded on a resume that did not match
        # the decoding sequences' KV cache: row i of ``_batch`` is ``_rows[i]``
        self._batch: BatchKv | None = None
        self._rows: list[GenSequence] = []

    # -- joining and leaving ----------------------------------------------------------
    def _fit(self, prompt_ids: Sequence[int], params: SamplingParams
             ) -> tuple[SamplingParams, int]:
        """``params`` with ``max_tokens`` cut to the model's positions, and the bytes the
        sequence reserves; InputTooLong / KvCacheTooSmall as :meth:`add` says."""
        if not prompt_ids:
            raise InvalidInput("the prompt is empty")
        room = self.max_positions - len(prompt_ids)
        if room < 1:
            raise InputTooLong(f"prompt of {len(prompt_ids)} tokens leaves no room in the "
                               f"model's {self.max_positions} positions",
                               limit=self.max_positions, tokens=len(prompt_ids))
        if params.max_tokens > room:
            params = SamplingParams(room, params.temperature, params.top_p, params.seed,
                                    params.stop)
        need = (len(prompt_ids) + params.max_tokens) * self.bytes_per_token
        if need > self.kv_budget_bytes:
            raise KvCacheTooSmall(
                f"the sequence needs {need} bytes of KV cache; the replica reserves "
                f"{self.kv_budget_bytes} in all (ask for fewer max_tokens)",
                need_bytes=need, budget_bytes=self.kv_budget_bytes)
        return params, need

    def add(self, prompt_ids: list[int], params: SamplingParams,
            progress: SequenceProgress | None = None, *, key: str = "") -> int:
        """Queue a sequence to join at the next step; its id. InputTooLong for a prompt the
        model has no room after; KvCacheTooSmall for one that could never be reserved.

        ``progress``: a sequence that another replica began (live migration): it prefills
        prompt + the tokens generated there and goes on as if it had never moved (the same
        ``max_tokens`` budget, stop strings over the whole text, the sampler's state). A
        prefix parked under ``key`` (:meth:`park`) that matches it is extended instead;
        one that does not is discarded."""
        params, need = self._fit(prompt_ids, params)
        generated = list(progress.generated_ids) if progress is not None else []
        if len(generated) >= params.max_tokens:
            raise InvalidInput(f"a resumed sequence already holds {len(generated)} of its "
                               f"{params.max_tokens} tokens")
        self._next_id += 1
        gen = sampler_for(params, progress.rng_state if progress is not None else None)
        seq = GenSequence(self._next_id, list(prompt_ids), params, need, generator=gen)
        if generated:
            seq.generated = generated
            seq.pending = generated[-1]
            seq.text = self.decode([t for t in generated if t not in self.eos_token_ids])
            seq.emitted = progress.emitted_text if progress is not None else ""
        entry = self.parked.get(key) if key else None
        if entry is not None:
            self.unpark(key)
            if entry.matches(prompt_ids, generated):
                # the sequence takes the park's reservation (and its place in the budget)
                self.reserved_bytes += need
                seq.parked = entry
                self.park_hits += 1
            else:
                self.park_misses += 1
        self.waiting.append(seq)
        return self._next_id

    def take_out(self, seq_id: int) -> SequenceProgress | None:
        """Remove a sequence between steps (its cache freed) and return what it generated
        so far, for another replica to go on from (live migration); None if not here."""
        seq = self.running.get(seq_id) or next(
            (s for s in self.waiting if s.seq_id == seq_id), None)
        if seq is None:
            return None
        progress = SequenceProgress(
            tuple(seq.generated), seq.emitted,
            bytes(seq.generator.get_state().numpy().tobytes())
            if seq.generator is not None else None)
        self.cancel(seq_id)
        return progress

    def cancel(self, seq_id: int) -> bool:
        """Drop a sequence (waiting or running) and free its cache; whether it was here. Its
        row leaves the batch's buffer at the next step (at once when it was the last)."""
        seq = self.running.pop(seq_id, None)
        if seq is not None:
            self.reserved_bytes -= seq.reserved_bytes
            seq.finish = FinishReason.CANCELLED
            if not self.running:
                self._batch, self._rows = None, []
            return True
        for i, s in enumerate(self.waiting):
            if s.seq_id == seq_id:
                del self.waiting[i]
                if s.parked is not None:  # it held the park's reservation while waiting
                    self.reserved_bytes -= s.reserved_bytes
                return True
        return False

    @property
    def idle(self) -> bool:
        """No sequence waits or runs and no park waits for its pass (parked prefixes that
        are ready do not keep the engine busy)."""
        return not self.waiting and not self.running and not self._to_park

    @property
    def kv_allocated_bytes(self) -> int:
        """Bytes the batch's KV buffer holds now (padding and headroom included)."""
        return 0 if self._batch is None else self._batch.allocated_bytes

    def _admit(self) -> list[GenSequence]:
        """Waiting sequences that fit now, in order (FIFO: the head blocks the rest)."""
        joined = []
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            held = head.parked is not None  # took its park's reservation already
            if not held and self.reserved_bytes + head.reserved_bytes > self.kv_budget_bytes:
                break
            self.waiting.popleft()
            if not held:
                self.reserved_bytes += head.reserved_bytes
            self.running[head.seq_id] = head
            joined.append(head)
        return joined

    # -- one token boundary -----------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Join, one token for every running sequence, leave (see the module docstring).

        A step in which a resumed sequence (live migration) joins ends after the joins: its
        client has waited since its last token on the source, so its next token is not held
        behind the others' decode (theirs comes a step later, their ids unchanged). Several
        arriving together join in the one batched prefill, so each waits for that one pass,
        not for the prefills of those before it (one per step made the k-th wait k)."""
        events: list[TokenEvent] = []
        self._drop_left()  # rows cancelled or taken out since the last step
        self.last_parked = self._park_pending() if self._to_park else []
        joined = self._admit()
        self.last_prefill_s = {}
        self.last_park_prefill_s = {s.seq_id: s.parked.prefill_s for s in joined
                                    if s.parked is not None}
        rows_of: dict[int, RowSource] = {}  # each joiner's keys and values
        if joined:
            started = time.perf_counter()
            fresh = [s for s in joined if s.parked is None]
            order: list[GenSequence] = []
            tokens: list[int] = []
            if fresh:
                logits, prefilled = self._prefill(fresh)
                rows_of.update({s.seq_id: RowSource(prefilled, j, 0, s.length, s.end)
                                for j, s in enumerate(fresh)})
                order += fresh
                tokens += self._sample(fresh, logits)
            if len(fresh) < len(joined):  # resumed onto their parked prefixes
                warm, logits = self._extend([s for s in joined if s.parked is not None],
                                            rows_of)
                order += warm
                tokens += self._sample(warm, logits)
            took = time.perf_counter() - started
            for seq, token in zip(order, tokens, strict=True):
                self.last_prefill_s[seq.seq_id] = took  # each waited for the whole pass
                events.append(self._take(seq, token))
        resumed = any(len(s.generated) > 1 for s in joined)
        if self._rows and not resumed:
            logits = self._decode()
            for seq, token in zip(self._rows, self._sample(self._rows, logits), strict=True):
                events.append(self._take(seq, token))
        for e in events:
            if e.finish is not None:
                seq = self.running.pop(e.seq_id)
                self.reserved_bytes -= seq.reserved_bytes
        # one copy: the rows that go on, then the joiners that did not finish at once
        keep = [i for i, s in enumerate(self._rows) if s.seq_id in self.running]
        joining = [j for j, s in enumerate(joined) if s.seq_id in self.running]
        if joined or len(keep) < len(self._rows):
            sources = self._batch.sources(keep) if self._batch is not None else []
            sources += [rows_of[joined[j].seq_id] for j in joining]
            self._batch = BatchKv.rebuild(sources)
            self._rows = [self._rows[i] for i in keep] + [joined[j] for j in joining]
        self.steps += 1
        return events

    def _drop_left(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.seq_id in self.running]
        if len(keep) < len(self._rows) and self._batch is not None:
            self._batch = BatchKv.rebuild(self._batch.sources(keep))
            self._rows = [self._rows[i] for i in keep]

    def _prefill(self, seqs: list[GenSequence]
                 ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One forward pass over the joiners' tokens; their next-token logits ``[J, vocab]``
        and the pass's per-layer keys and values (row j's in columns ``0..length``).

        Right padding, every row from position 0, no padding mask: a token sees only the
        tokens before it (causal), so a row's pads, all after its last token, change
        nothing its own tokens compute -- each row is computed as if alone, by the same
        causal attention as ``generate``'s prefill; what the pads compute is discarded."""
        # a resumed sequence (live migration) prefills its generated tokens too: the last
        # one was sampled on the source but never fed to the model
        logits, layers = self._forward_rows([s.prompt_ids + s.generated for s in seqs])
        for s in seqs:
            s.length = len(s.prompt_ids) + len(s.generated)
        return logits, layers

    def _forward_rows(self, rows: list[list[int]]
                      ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`_prefill`'s pass over these rows of token ids."""
        lengths = [len(r) for r in rows]
        longest = max(lengths)
        ids = torch.zeros((len(rows), longest), dtype=torch.long)  # 0: any real token id
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        ids = ids.to(self.device)
        kwargs: dict[str, Any] = {}
        last = sorted({n - 1 for n in lengths})  # the positions whose logits are wanted
        columns = [n - 1 for n in lengths]  # of each row's, in the logits returned
        if self._logits_kw is not None and len(last) == 1:
            kwargs[self._logits_kw] = 1  # the last position (every row ends there)
            columns = [0] * len(rows)
        elif self._logits_kw is not None:  # these positions in every row
            kwargs[self._logits_kw] = torch.tensor(last, device=self.device)
            columns = [last.index(n - 1) for n in lengths]
        positions = torch.arange(longest, device=self.device)[None].expand(len(rows), -1)
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                         position_ids=positions, use_cache=True, **kwargs)
        logits = out.logits[torch.arange(len(rows), device=self.device),
                            torch.tensor(columns, device=self.device)]
        return logits, _layers_of(_cache_of(out))

    def _decode(self) -> torch.Tensor:
        """One decode step for every row of the batch together, its keys and values written
        into the batch's buffer in place; their next-token logits, ``[B, vocab]``."""
        assert self._batch is not None
        mask, positions, cache = self._batch.decode_inputs()
        ids = torch.tensor([[s.pending] for s in self._rows], dtype=torch.long,
                           device=self.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         **{self._cache_kw: cache}, use_cache=True)
        self._batch.advanced()
        for s in self._rows:
            s.length += 1
        return out.logits[:, -1]

    def _sample(self, seqs: list[GenSequence], logits: torch.Tensor) -> list[int]:
        """Each row's next token: the greedy rows' argmax in one call, each sampled row
        from its own generator."""
        greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0.0]
        tokens: list[int] = [0] * len(seqs)
        if greedy:
            picked = torch.argmax(logits if len(greedy) == len(seqs) else logits[greedy],
                                  dim=-1).tolist()
            for i, t in zip(greedy, picked, strict=True):
                tokens[i] = int(t)
        for i, s in enumerate(seqs):
            if s.params.temperature != 0.0:
                tokens[i] = sample_token(logits[i], s.params, s.generator)
        return tokens

    def _take(self, seq: GenSequence, token: int) -> TokenEvent:
        """Record ``seq``'s next token, check whether it finished, and report it."""
        return take_token(seq, token, self.eos_token_ids, self.decode)


def take_token(seq: GenSequence, token: int, eos_token_ids: frozenset[int],
               decode: Callable[[list[int]], str]) -> TokenEvent:
    """Record ``seq``'s next token (sampled by the caller), check whether it finished (EOS,
    a stop string, ``max_tokens``), update its text and report it: one token boundary, the
    same whether the logits came from a replica's engine or from the last stage of a
    pipeline (:mod:`flashpoint.models.serving.stage_generation`)."""
    seq.generated.append(token)
    seq.pending = token
    finish = None
    if token in eos_token_ids:
        finish = FinishReason.STOP
        text = seq.text
    else:
        text = decode([t for t in seq.generated if t not in eos_token_ids])
        for stop in seq.params.stop:
            at = text.find(stop)
            if at >= 0:
                text, finish = text[:at], FinishReason.STOP
    if finish is None and len(seq.generated) >= seq.params.max_tokens:
        finish = FinishReason.LENGTH
    seq.text = text
    seq.finish = finish
    # Report only text no stop string can still claim: hold back the last
    # (longest stop - 1) characters until the sequence finishes.
    hold = 0 if finish is not None else max((len(s) for s in seq.params.stop), default=1) - 1
    safe = text[:len(text) - hold] if hold else text
    delta = ""
    if safe.startswith(seq.emitted) and len(safe) > len(seq.emitted):
        delta = safe[len(seq.emitted):]
        seq.emitted = safe
    return TokenEvent(seq.seq_id, token, delta, finish)


def sampler_for(params: SamplingParams, rng_state: bytes | None) -> torch.Generator | None:
    """A sequence's sampler: None when greedy; else a CPU generator at ``rng_state`` (the
    state another replica or stage left it in: the same draws follow), or seeded from
    ``params.seed`` (random when none)."""
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device="cpu")
    if rng_state is not None:
        gen.set_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))
    else:
        gen.manual_seed(params.seed if params.seed is not None
                        else int(torch.randint(0, 2**62, ()).item()))
    return gen


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of a ``transformers`` cache (or the legacy tuples)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]


@dataclass(frozen=True)
class SequenceProgress:
    """How far a sequence got on the replica it leaves (live migration): every token it
    generated (the last one sampled but not yet fed to the model), the text already sent
    to its client (text a stop string could still claim is held back, so it may be shorter
    than the decoded tokens), and its sampler's state (``torch.Generator.get_state``;
    None when greedy), so seeded sampling goes on with the very draws it would have made."""

    generated_ids: tuple[int, ...]
    emitted_text: str
    rng_state: bytes | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: its prompt's token ids and how to sample; ``progress``
    when it resumes a sequence another replica began."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    progress: SequenceProgress | None = None


@dataclass(frozen=True)
class GenerationResult:
    """A finished sequence."""

    prompt_tokens: int
    token_ids: tuple[int, ...]
    text: str
    finish: FinishReason
