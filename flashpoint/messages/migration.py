"""Typed messages of live migration between the controller and a worker (issue 21 item 5).

Controller → worker: :class:`HandOffSequences` (method ``hand_off``): take these streamed
sequences out at the next token boundary; the reply is :class:`HandOffAccepted`. Each
sequence's own ``infer`` call then answers :class:`InferHandedOff` -- a
:class:`SequenceHandOff`, what it generated there -- instead of outputs. The controller sends
the same request on to another replica with that hand-off as the ``InferRequest``'s
``resume`` (messages/controller_worker.py), and that replica prefills prompt + generated
tokens and goes on, its chunks numbered from ``chunks``.

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
