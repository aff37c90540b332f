"""Scaling a text-generation function on tokens (issue 21 item 4): pure arithmetic.

A generation request's cost is not one unit: a 2-token answer to a short prompt and a
512-token one hold a replica for very different times. So its load is counted in tokens
(:class:`~flashpoint.policy.snapshot.TokenLoad`): a sequence counts its prompt until its
first token, then the part of its ``max_tokens`` it has not generated yet. The controller
does not tokenize (the tokenizer lives with the replicas), so a prompt is estimated from
its bytes until a replica reports the real count (:func:`estimate_prompt_tokens`).

The ``tokens`` autoscaler plug-in (:func:`tokens`) wants enough replicas that

- the tokens outstanding drain within ``drain_s`` at the per-replica token rate ``C``:
  ``W / (C · drain_s)``, and
- the tokens arriving keep each replica at most ``target_utilisation`` busy:
  ``λ_tok / (C · target_utilisation)``,

never more replicas than there are sequences (one sequence runs on one replica) and never
fewer than the concurrency rule asks. ``C`` is the profiled ``replica_tokens_per_s`` when
given, else the peak a replica has been seen to serve (a lower bound, so it errs towards
more replicas); with neither, or for a function that is not a generation function, the
plug-in is the concurrency rule and says so in its reason.

Also here: the time-to-first-token and time-per-output-token arithmetic the controller's
metrics use (:func:`tpot_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpoint.errors import BadRequest
from flashpoint.policy.autoscalers import Proposal, ceil_count, concurrency_target
from flashpoint.policy.snapshot import FunctionLoadSnapshot

# max_tokens of a request that does not say (the engine's default too: models/generate.py).
DEFAULT_MAX_TOKENS = 16
# Bytes of prompt text per token when the controller has to guess (before a replica has
# tokenized it): about 4 for English under the BPE vocabularies of GPT-2 and Llama.
PROMPT_BYTES_PER_TOKEN = 4


def estimate_prompt_tokens(prompt_bytes: int) -> int:
    """A prompt's token count guessed from its UTF-8 length (at least one token)."""
    return max(1, -(-max(0, prompt_bytes) // PROMPT_BYTES_PER_TOKEN))


def outstanding_tokens(prompt_tokens: int, max_tokens: int, generated: int) -> int:
    """Tokens a sequence may still ask of its replica: its prompt until the first token
    comes, then what is left of ``max_tokens``."""
    left = max(0, max_tokens - generated)
    return left + (prompt_tokens if generated == 0 else 0)


def tpot_s(first_token_s: float, last_token_s: float, tokens: int) -> float | None:
    """Time per output token after the first: ``(last − first) / (tokens − 1)``; None
    for fewer than two tokens (no interval to measure)."""
    if tokens < 2 or last_token_s < first_token_s:
        return None
    return (last_token_s - first_token_s) / (tokens - 1)


@dataclass(frozen=True)
class TokensParams:
    """The ``tokens`` plug-in's settings (keys of ``[controller] autoscaler_params``)."""

    # Tokens per second one replica sustains (profiled); 0 = use the peak seen.
    replica_tokens_per_s: float = 0.0
    # The outstanding tokens should drain within this many seconds.
    drain_s: float = 2.0
    # Busy fraction of each replica the arriving tokens may take.
    target_utilisation: float = 0.8

    def __post_init__(self) -> None:
        if self.replica_tokens_per_s < 0:
            raise BadRequest("replica_tokens_per_s must be >= 0")
        if self.drain_s <= 0:
            raise BadRequest("drain_s must be > 0")
        if not 0 < self.target_utilisation <= 1:
            raise BadRequest("target_utilisation must be in (0, 1]")


def token_capacity(load: FunctionLoadSnapshot, params: TokensParams) -> float:
    """Tokens per second one replica serves: profiled if given, else the peak seen; 0 =
    unknown."""
    if params.replica_tokens_per_s > 0:
        return params.replica_tokens_per_s
    return load.tokens.replica_token_rate if load.tokens is not None else 0.0


def tokens(load: FunctionLoadSnapshot, params: TokensParams,
           memory: None) -> tuple[Proposal, None]:
    """The ``tokens`` plug-in (the module docstring gives the rule)."""
    floor = concurrency_target(load)
    t = load.tokens
    if t is None:
        return Proposal(floor, "tokens:no-token-load"), None
    capacity = token_capacity(load, params)
    if capacity <= 0:
        return Proposal(floor, "tokens:unprofiled"), None
    work = t.queued_tokens + t.inflight_tokens
    want = max(ceil_count(work / (capacity * params.drain_s)),
               ceil_count(t.arrival_token_rate / (capacity * params.target_utilisation)))
    want = min(want, max(t.sequences, load.queued + load.inflight))
    if want <= floor:
        return Proposal(floor, "tokens:concurrency"), None
    return Proposal(want, f"tokens:{work}tok@{capacity:.0f}tok/s"), None
