"""Typed messages of live migration between the controller and a worker (issue 21 item 5).

Controller → worker: :class:`HandOffSequences` (method ``hand_off``): take these streamed
sequences out at the next token boundary; the reply is :class:`HandOffAccepted`. Each
sequence's own ``infer`` call then answers :class:`InferHandedOff` -- a
:class:`SequenceHandOff`, what it generated there -- instead of outputs. The controller sends
the same request on to another replica with that hand-off as the ``InferRequest``'s
``resume`` (messages/controller_worker.py), and that replica prefills prompt + generated
tokens and goes on, its chunks numbered from ``chunks``.

Multi-round moves (ServerlessLLM §5): before ``hand_off``, the controller reads the
sequences from the source without stopping them (:class:`SnapshotSequences` →
:class:`SequenceSnapshots`) and asks the destination to prefill them ahead
(:class:`ParkSequences` → :class:`SequencesParked`, answered once the caches are ready);
:class:`UnparkSequences` drops parks nothing will resume (the request finished, its client
left, it went elsewhere).

Kept apart from ``controller_worker`` so that the migration protocol reads in one place;
it imports nothing of the model code (the controller never loads torch).
"""

from __future__ import annotations

from flashpoint.messages.base import Message


class HandOffSequences(Message, frozen=True):
    """Take the streamed sequences of ``request_ids`` out at the next token boundary."""

    request_ids: tuple[str, ...]


class HandOffAccepted(Message, frozen=True):
    """How many of them will leave (the rest finished already or are not here)."""

    handing_off: int


class SequenceHandOff(Message, frozen=True):
    """One sequence as it left a replica: its prompt's token ids (so the destination does
    not re-tokenize), every token generated so far (over every replica it ran on), the text
    its client has been sent, the sampler's state (``torch.Generator.get_state`` bytes;
    None when greedy) and how many chunks its stream holds (the next one's index)."""

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    emitted_text: str
    rng_state: bytes | None = None
    chunks: int = 0


class InferHandedOff(Message, frozen=True):
    """A streamed ``infer``'s reply when its sequence left for another replica."""

    handed_off: SequenceHandOff
    chunks: int


class SnapshotSequences(Message, frozen=True):
    """Read the running streamed sequences of ``request_ids`` without stopping them."""

    request_ids: tuple[str, ...]


class SequenceSnapshot(Message, frozen=True):
    """One running sequence as it is now: its prompt's ids, its tokens so far (the last
    sampled but not yet fed) and its ``max_tokens`` (what a park reserves for it)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    max_tokens: int


class SequenceSnapshots(Message, frozen=True):
    """The sequences found running (finished or unknown ones are left out)."""

    sequences: tuple[SequenceSnapshot, ...] = ()


class ParkSequences(Message, frozen=True):
    """Prefill these sequences ahead of their resume; drop any nothing resumes within
    ``ttl_s``. Answered once every one is ready or refused."""

    sequences: tuple[SequenceSnapshot, ...]
    ttl_s: float = 10.0


class ParkResult(Message, frozen=True):
    """One park: ``parked`` when its cache is ready (``prefill_s`` the pass's seconds); else
    ``code`` says why not (``kv_cache_full``, ``unparked``, ``expired``, ...)."""

    request_id: str
    parked: bool
    code: str = ""
    prefill_s: float = 0.0


class SequencesParked(Message, frozen=True):
    results: tuple[ParkResult, ...] = ()


class UnparkSequences(Message, frozen=True):
    """Drop the parks of ``request_ids`` (freeing their KV reservation)."""

    request_ids: tuple[str, ...]


class Unparked(Message, frozen=True):
    """How many of them were parked there."""

    dropped: int = 0
