"""Typed, frozen instructions: a schedule is a list of these, nothing more.

Every instruction names an operator (its index in the operator sequence) and a
sub-batch.  The text form of each is compact so that whole schedules can be
compared as strings in tests::

    f3.0   Forward of op 3 on sub-batch 0, activations not kept (recomputed later)
    F3.0   Forward of op 3 on sub-batch 0, autograd graph kept for Backward
    R3.0   Recompute op 3 (forward again, keeping the graph)
    B3.0   Backward of op 3
    S3.0 / W3.0     StartAsync / Sync of op 3's forward collective
    Sr3.0 / Wr3.0   ... of the forward collective re-run inside a recomputation
    Sb3.0 / Wb3.0   ... of op 3's backward collective

Pipeline stages add point-to-point transfers at the stage boundary, started like a
collective and waited by a Sync-like :class:`P2PSync` (``L``: the stage's op count)::

    <a0.1  / W<a0.1    receive sub-batch 1's input activation from the previous stage
    >aL.1  / W>aL.1    send sub-batch 1's output activation to the next stage
    <gL.1  / W<gL.1    receive the gradient of that output from the next stage
    >g0.1  / W>g0.1    send the gradient of the input to the previous stage

and a pipeline schedule runs many micro-batches, so its steps carry one:
``3:F5.1`` is ``F5.1`` of micro-batch 3 (:class:`PipeStep`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CommPhase = Literal["forward", "recompute", "backward"]
_PHASE_TAG = {"forward": "", "recompute": "r", "backward": "b"}


@dataclass(frozen=True)
class Instruction:
    """``op``: index in the operator sequence; ``sub``: the sub-batch (never a micro-batch:
    a schedule runs one micro-batch, split into sub-batches)."""

    op: int
    sub: int

    def _ids(self) -> str:
        return f"{self.op}.{self.sub}"


@dataclass(frozen=True)
class Forward(Instruction):
    """Run op forward; ``keep_graph`` keeps its autograd graph for Backward,
    otherwise it runs without grad and only its output is passed on."""

    keep_graph: bool = False

    def __str__(self) -> str:
        return ("F" if self.keep_graph else "f") + self._ids()


@dataclass(frozen=True)
class Recompute(Instruction):
    """Run op forward again from its saved (or just recomputed) input, keeping the graph."""

    def __str__(self) -> str:
        return "R" + self._ids()


@dataclass(frozen=True)
class Backward(Instruction):
    """Backpropagate through op: input gradient from output gradient; parameter grads accumulate."""

    def __str__(self) -> str:
        return "B" + self._ids()


@dataclass(frozen=True)
class StartAsync(Instruction):
    """Start the collective of a communication op without waiting for it."""

    phase: CommPhase = "forward"

    def __str__(self) -> str:
        return "S" + _PHASE_TAG[self.phase] + self._ids()


@dataclass(frozen=True)
class Sync(Instruction):
    """Wait for the collective started by the matching StartAsync; its result becomes visible."""

    phase: CommPhase = "forward"

    def __str__(self) -> str:
        return "W" + _PHASE_TAG[self.phase] + self._ids()


P2PKind = Literal["recv_act", "send_act", "recv_grad", "send_grad"]
P2P_TAG: dict[str, str] = {"recv_act": "<a", "send_act": ">a", "recv_grad": "<g", "send_grad": ">g"}


@dataclass(frozen=True)
class P2PStart(Instruction):
    """Start one point-to-point transfer with a neighbouring stage; the subclasses say
    which.  ``op`` is the boundary it crosses: 0 (this stage's input) or the op count
    (its output)."""

    kind = "recv_act"  # class constant of each subclass, not a field

    def __str__(self) -> str:
        return P2P_TAG[self.kind] + self._ids()


@dataclass(frozen=True)
class RecvActivation(P2PStart):
    """Post the receive of sub-batch ``sub``'s input ``(x,)`` from the previous stage."""

    kind = "recv_act"


@dataclass(frozen=True)
class SendActivation(P2PStart):
    """Start sending this stage's output ``(x,)`` of sub-batch ``sub`` to the next stage."""

    kind = "send_act"


@dataclass(frozen=True)
class RecvGrad(P2PStart):
    """Post the receive of the gradient of this stage's output from the next stage."""

    kind = "recv_grad"


@dataclass(frozen=True)
class SendGrad(P2PStart):
    """Start sending the gradient of this stage's input to the previous stage."""

    kind = "send_grad"


@dataclass(frozen=True)
class P2PSync(Instruction):
    """Wait for the transfer ``kind`` of (``op``, ``sub``) started by a :class:`P2PStart`;
    a received tensor becomes the buffer it fills, a sent one may be freed."""

    kind: P2PKind = "recv_act"

    def __str__(self) -> str:
        return "W" + P2P_TAG[self.kind] + self._ids()


@dataclass(frozen=True)
class PipeStep:
    """One instruction of a pipeline schedule: ``ins`` run on micro-batch ``micro``'s
    buffers (each micro-batch in flight on a stage has its own)."""

    micro: int
    ins: Instruction

    def __str__(self) -> str:
        return f"{self.micro}:{self.ins}"


def to_text(instructions: list[Instruction]) -> str:
    return " ".join(str(i) for i in instructions)
