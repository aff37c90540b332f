"""Typed messages of a generation served by a pipeline of stages (issue 21 item 6).

A cold causal language model deployed with partitioned scale-up serves its first tokens
through a pipeline of stages while the hosts complete the model. One token step is one
pipeline request; the controller (``controller/pipeline_target.py``) runs the token loop and
the stages are stateless between steps (the step carries the sequence's whole state, so no
stage holds a KV cache: every step recomputes prompt + generated tokens):

* controller → first stage: a :class:`PipelineStep` (the request's tensors, the tokens and
  text so far, the sampler's state), one BYTES tensor ``step``;
* first stage → the next ones: a :class:`StepCarry` (the prompt's ids, the sampling
  parameters, the sequence's state), one BYTES tensor after the hidden states and the mask,
  passed on untouched by middle stages;
* last stage → controller: a :class:`StepResult` (the new token, its text delta, whether the
  sequence finished, the state for the next step).

Each message travels msgpack-encoded (msgspec) inside one BYTES tensor of an activation
frame; :func:`encode` and :func:`decode` are the codec edge (a malformed one is a
:class:`~flashpoint.errors.ProtocolError`). Nothing here imports torch: the controller
decodes results.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from flashpoint.errors import ProtocolError
from flashpoint.messages.base import Message

M = TypeVar("M", bound=Message)


class PipelineStep(Message, frozen=True):
    """One token step of one sequence, as the controller sends it to the first stage:
    ``inputs`` is the request's tensors in wire form (``tensors.encode_tensors``: the first
    stage prepares them as a whole replica would); ``generated_ids``, ``emitted_text`` and
    ``rng_state`` (``torch.Generator`` state bytes; None when greedy or not drawn yet) are
    the sequence so far. ``prompt_ids`` (after the first step, or from a hand-off) spare the
    first stage the tokenizer and keep the very ids the sequence began with."""

    inputs: dict[str, Any]
    prompt_ids: tuple[int, ...] = ()
    generated_ids: tuple[int, ...] = ()
    emitted_text: str = ""
    rng_state: bytes | None = None


class StepCarry(Message, frozen=True):
    """What the last stage needs besides the hidden states to take the step's token."""

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    emitted_text: str
    rng_state: bytes | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


class StepResult(Message, frozen=True):
    """The step's token (``token_id``), the text its client gets now (``text_delta``), the
    finish reason once the sequence ended (``finish``: ``stop`` or ``length``; empty while
    it goes on), the whole text so far (``text``, cut at a stop string), and the state the
    next step (or a hand-off) goes on from."""

    token_id: int
    text_delta: str
    finish: str
    text: str
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    emitted_text: str
    rng_state: bytes | None = None


def encode(msg: Message) -> bytes:
    """``msg`` as the bytes of one BYTES tensor element."""
    return msgspec.msgpack.encode(msg)


def decode(kind: type[M], data: Any) -> M:
    """The message of type ``kind`` in ``data`` (bytes, or a one-element BYTES array);
    ProtocolError when it is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        try:
            (data,) = list(getattr(data, "reshape", lambda _: data)(-1))
        except (TypeError, ValueError):
            raise ProtocolError(f"a {kind.__name__} travels as one BYTES element") from None
    try:
        return msgspec.msgpack.decode(bytes(data), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {kind.__name__}: {exc}") from None
