"""Each schedule's closed form: how much of a block's TMP communication it leaves exposed.

Why beside the schedules: the form is a property of the schedule (what overlaps what), so a
schedule registers its own with :func:`~oases_ds.schedule.generators.register_schedule`
(``closed_form=``) and the cost model (:func:`~oases_ds.planner.costmodel.exposed_comm_ms`)
asks the registry, never a list of names.  A schedule registered without one cannot be
priced in closed form and says so.

With ``s`` sub-batches the compute that can hide one sub-batch's collective is the other
``(s-1)/s`` of the pass; with ``s == 1`` nothing overlaps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BlockTiming:
    """Measured cost of one block for one micro-batch share on one device (ms).

    ``fwd_ms`` is the forward compute and ``recompute_ms`` the part of the
    backward pass that re-runs it; ``bwd_ms`` is the backward compute *without*
    the recompute.  ``comm_fwd_ms`` / ``comm_bwd_ms`` are the raw durations of
    the block's forward and backward collectives, summed over sub-batches, as if
    nothing overlapped them.
    """

    fwd_ms: float
    recompute_ms: float
    bwd_ms: float
    comm_fwd_ms: float
    comm_bwd_ms: float

    def __post_init__(self) -> None:
        for name in ("fwd_ms", "recompute_ms", "bwd_ms", "comm_fwd_ms", "comm_bwd_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"BlockTiming.{name} must be >= 0, got {getattr(self, name)}")


Whole = Callable[[BlockTiming, int], tuple[float, float]]
"""(timing, sub-batches) -> (forward, backward) exposed communication of one block on its own."""
Pipelined = Callable[[BlockTiming, int, tuple[float, float]], tuple[float, float, float, float]]
"""(timing, sub-batches >= 2, the whole-block form) -> (forward, backward) exposed in the block's node
cost and the last sub-batch's (forward, backward) collective left to the edge with its neighbour."""


@dataclass(frozen=True)
class ClosedForm:
    """A schedule's exposed communication: ``whole`` for one block; ``pipelined`` inside a sequence of
    blocks, where the last sub-batch's collective overlaps the neighbouring block (``None``: the
    schedule does not pipeline across blocks, its whole-block form holds and the edge gets nothing)."""

    whole: Whole
    pipelined: Pipelined | None = None


def _hidden(comm: float, compute: float, sub_batches: int) -> float:
    """What of ``comm`` the other ``(s-1)/s`` of ``compute`` leave showing."""
    return max(0.0, comm - (sub_batches - 1) / sub_batches * compute)


def _blocking(t: BlockTiming, sub_batches: int) -> tuple[float, float]:
    """``none`` / ``megatron_selective``: synchronous, nothing hidden; neither recompute re-runs a
    collective (none recomputes nothing, selective only the attention core)."""
    return t.comm_fwd_ms, t.comm_bwd_ms


def _blocking_recompute(t: BlockTiming, sub_batches: int) -> tuple[float, float]:
    """``megatron``: synchronous, and the layer's recompute repeats the forward AllReduce, so backward
    exposes ``comm_bwd + comm_fwd``."""
    return t.comm_fwd_ms, t.comm_bwd_ms + t.comm_fwd_ms


def _split_overlap(t: BlockTiming, sub_batches: int) -> tuple[float, float]:
    """``split_overlap`` (Merak-like): each collective of a sub-batch overlaps the other sub-batches'
    compute *of the same pass*: forward behind forward, the repeated forward AllReduce behind
    recompute, backward behind backward."""
    forward = _hidden(t.comm_fwd_ms, t.fwd_ms, sub_batches)
    return forward, _hidden(t.comm_fwd_ms, t.recompute_ms, sub_batches) + _hidden(t.comm_bwd_ms, t.bwd_ms, sub_batches)


def _oases(t: BlockTiming, sub_batches: int) -> tuple[float, float]:
    """``oases``: forward as split_overlap; fine-grained recompute drops the repeated AllReduce and the
    cross-pass schedule hides the backward collective behind the other sub-batches' recompute *and*
    backward."""
    return _hidden(t.comm_fwd_ms, t.fwd_ms, sub_batches), _hidden(t.comm_bwd_ms, t.recompute_ms + t.bwd_ms, sub_batches)


def _pipelined_forward(t: BlockTiming, sub_batches: int) -> float:
    """In a sequence, collective ``j < s-1`` of a forward pass hides behind the later sub-batches of
    this block: ``(s-1)/s * (comm - compute)`` for the first ``s-1`` together; the last one is the edge's."""
    return (sub_batches - 1) / sub_batches * max(0.0, t.comm_fwd_ms - t.fwd_ms)


def _split_overlap_pipelined(t: BlockTiming, sub_batches: int, whole: tuple[float, float]) -> tuple[float, float, float, float]:
    """Forward pipelines across blocks; backward does not (its whole-block form, nothing to the edge)."""
    return _pipelined_forward(t, sub_batches), whole[1], t.comm_fwd_ms / sub_batches, 0.0


def _oases_pipelined(t: BlockTiming, sub_batches: int, whole: tuple[float, float]) -> tuple[float, float, float, float]:
    """Forward and the cross-pass backward both pipeline: the last sub-batch's collective of each
    pass overlaps sub-batch 0 of the neighbouring block."""
    backward = (sub_batches - 1) / sub_batches * max(0.0, t.comm_bwd_ms - t.recompute_ms - t.bwd_ms)
    return _pipelined_forward(t, sub_batches), backward, t.comm_fwd_ms / sub_batches, t.comm_bwd_ms / sub_batches


BLOCKING = ClosedForm(_blocking)
BLOCKING_RECOMPUTE = ClosedForm(_blocking_recompute)
SPLIT_OVERLAP = ClosedForm(_split_overlap, _split_overlap_pipelined)
OASES = ClosedForm(_oases, _oases_pipelined)
