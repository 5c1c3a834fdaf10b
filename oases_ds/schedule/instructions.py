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


def to_text(instructions: list[Instruction]) -> str:
    return " ".join(str(i) for i in instructions)
