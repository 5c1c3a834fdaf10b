"""Schedule generators: pure functions from (operator sequence, options) to instructions.

All five schedules the paper compares are built from three ingredients, so that
a speed difference is a scheduling difference and nothing else:

1. **Segments.**  The sequence is cut into segments, each either *kept* (forward
   keeps its autograd graph) or *recomputed* (forward runs without grad, only the
   segment's input is saved, Recompute runs it again just before Backward).
   Megatron cuts at transformer-layer boundaries, so a recomputation re-runs the
   layer's forward AllReduces; Oases' fine-grained cut is right *after* each
   forward AllReduce, so a recomputation never contains a collective.
2. **Per-sub-batch streams.**  For one sub-batch, the forward and the backward of
   each segment (Recompute then Backward, last segment first) are a list of
   compute instructions and communication points.
3. **Merge.**  Streams of several sub-batches are interleaved by switching to the
   next sub-batch at every communication point (paper Algorithm 1): start the
   collective of sub-batch 0, compute sub-batch 1 meanwhile, sync sub-batch 0, ...
   Merging each *pass* separately puts a barrier between passes (Fig. 4b);
   merging the whole step as one stream is the cross-pass schedule (Fig. 4d).

Timelines for one block ``(F_i, C_i, F_j)``, two sub-batches ``0``/``1``::

  megatron (1 batch, sync)     compute  Fi   .   Fj | Ri   .   Rj Bj Bi   .
                               comm         Ci      |     Ci           Ci
  split_overlap (barriers)     compute  Fi0 Fi1 Fj0 Fj1 | Ri0 Ri1 Rj0 Rj1 | Bj0 Bi0 Bj1 Bi1 .
                               comm          Ci0 Ci1    |     Ci0 Ci1     |         Ci0  Ci1
  oases (cross-pass, fine)     compute  Fi0 Fi1 Fj0 Fj1 Rj0 Bj0 Ri0 Bi0 Rj1 Bj1 Ri1 Bi1 ...
                               comm          Ci0 Ci1                Ci0(B)        Ci1(B)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from oases_ds.models.ops import CommOp, Op, backward_collective, forward_collective
from oases_ds.schedule.instructions import (
    Backward,
    CommPhase,
    Forward,
    Instruction,
    Recompute,
    StartAsync,
    Sync,
    to_text,
)

SCHEDULES = ("none", "megatron", "megatron_selective", "split_overlap", "oases")


@dataclass(frozen=True)
class ScheduleOptions:
    """Knobs of the schedule family.

    Attributes:
        sub_batches: sub-batches a micro-batch is split into (Oases, split_overlap).
        cross_pass: Oases only; merge recompute and backward across passes.
        fine_grained_recompute: Oases only; checkpoints right after forward AllReduces.
    """

    sub_batches: int = 2
    cross_pass: bool = True
    fine_grained_recompute: bool = True

    def __post_init__(self) -> None:
        if self.sub_batches < 1:
            raise ValueError(f"oases.sub_batches must be >= 1, got {self.sub_batches}")


@dataclass(frozen=True)
class Segment:
    """Ops ``[start, end)``; if ``recompute``, ops ``[start, recompute_end)`` are recomputed."""

    start: int
    end: int
    recompute: bool
    recompute_end: int


@dataclass(frozen=True)
class Schedule:
    """A named instruction list plus what the checker needs to know about it."""

    name: str
    instructions: tuple[Instruction, ...]
    sub_batches: int
    fine_grained: bool

    def __str__(self) -> str:
        return to_text(list(self.instructions))

    def __len__(self) -> int:
        return len(self.instructions)


@dataclass(frozen=True)
class _Comm:
    op: int
    mb: int
    phase: CommPhase


_Item = Instruction | _Comm


# -- segments -------------------------------------------------------------------
def _cut(ops: Sequence[Op], starts: list[int], recompute: Callable[[int, int], bool], fine: bool) -> list[Segment]:
    bounds = sorted(set([0, *starts, len(ops)]))
    segs = []
    for a, b in zip(bounds, bounds[1:]):
        rec = recompute(a, b)
        rec_end = b - 1 if fine and rec and forward_collective(ops[b - 1]) else b
        segs.append(Segment(a, b, rec, rec_end))
    return segs


def layer_segments(ops: Sequence[Op]) -> list[Segment]:
    """Megatron full recomputation: one recomputed segment per transformer layer;
    embedding and head kept (the head holds the loss and is backpropagated at once)."""
    layers = sorted({op.layer for op in ops if op.layer >= 0 and op.block in ("attn", "mlp")})
    starts = [next(i for i, op in enumerate(ops) if op.layer == layer) for layer in layers]
    starts.append(next(i for i, op in enumerate(ops) if op.block == "head"))
    in_layer = {i for i, op in enumerate(ops) if op.block in ("attn", "mlp")}
    return _cut(ops, starts, lambda a, b: a in in_layer, fine=False)


def fine_grained_segments(ops: Sequence[Op]) -> list[Segment]:
    """Oases: a segment ends with each forward collective, whose output is saved, so
    recomputation starts right after it and never re-runs it.  The last segment
    (through the loss) is kept."""
    starts = [i + 1 for i, op in enumerate(ops) if forward_collective(op)]
    last = max(starts)
    return _cut(ops, starts, lambda a, b: a < last, fine=True)


def selective_segments(ops: Sequence[Op]) -> list[Segment]:
    """Megatron selective recomputation: only the attention core is recomputed."""
    cores = [i for i, op in enumerate(ops) if op.name.endswith(".core")]
    starts = cores + [i + 1 for i in cores]
    core_set = set(cores)
    return _cut(ops, starts, lambda a, b: a in core_set, fine=False)


def schedule_segments(name: str, ops: Sequence[Op], options: ScheduleOptions = ScheduleOptions()) -> list[Segment]:
    """The segments schedule ``name`` cuts ``ops`` into: the one choice
    :func:`build_schedule` runs and the memory models (profiler, analytic costs) count."""
    if name not in SCHEDULES:
        raise ValueError(f"oases.schedule={name!r} unknown; choose one of {', '.join(SCHEDULES)}")
    if name == "none":
        return [Segment(0, len(ops), False, len(ops))]
    if name == "megatron_selective":
        return selective_segments(ops)
    if name == "oases" and options.fine_grained_recompute:
        return fine_grained_segments(ops)
    return layer_segments(ops)


def held_inputs(ops: Sequence[Op], segs: Sequence[Segment]) -> list[int]:
    """Ops whose input tuple stays alive from forward to backward, increasing.

    A recomputed segment keeps only its first op's input (the checkpoint Recompute
    restarts from); a kept segment's compute ops keep theirs in the autograd graph.
    The transient working set of a recompute is not counted: it lives for one
    segment, not the whole step.
    """
    covered: set[int] = set()
    held = []
    for seg in segs:
        if seg.recompute:
            covered.update(range(seg.start, seg.recompute_end))
            held.append(seg.start)
    held += [i for i, op in enumerate(ops) if i not in covered and not isinstance(op, CommOp)]
    return sorted(held)


# -- per-sub-batch streams ------------------------------------------------------
def _forward_stream(ops: Sequence[Op], segs: list[Segment], mb: int) -> list[_Item]:
    out: list[_Item] = []
    for seg in segs:
        for i in range(seg.start, seg.end):
            if forward_collective(ops[i]):
                out.append(_Comm(i, mb, "forward"))
            else:
                keep = not seg.recompute and not isinstance(ops[i], CommOp)
                out.append(Forward(i, mb, keep_graph=keep))
    return out


def _recompute_stream(ops: Sequence[Op], seg: Segment, mb: int) -> list[_Item]:
    if not seg.recompute:
        return []
    return [
        _Comm(i, mb, "recompute") if forward_collective(ops[i]) else Recompute(i, mb)
        for i in range(seg.start, seg.recompute_end)
    ]


def _backward_stream(ops: Sequence[Op], seg: Segment, mb: int) -> list[_Item]:
    return [
        _Comm(i, mb, "backward") if backward_collective(ops[i]) else Backward(i, mb)
        for i in reversed(range(seg.start, seg.end))
    ]


# -- merge ----------------------------------------------------------------------
def merge(streams: Sequence[Sequence[_Item]]) -> list[Instruction]:
    """Interleave sub-batch streams, switching sub-batch at every collective.

    A sub-batch runs until it reaches a collective, starts it and yields; when
    its turn comes again it first syncs that collective.  With one stream this
    degenerates to synchronous collectives (StartAsync immediately followed by
    Sync).  Every collective is synced before the merge returns (a barrier).
    """
    out: list[Instruction] = []
    pos = [0] * len(streams)
    pending: list[_Comm | None] = [None] * len(streams)
    active = [mb for mb, s in enumerate(streams) if s]
    while active:
        for mb in list(active):
            if pending[mb] is not None:
                c = pending[mb]
                out.append(Sync(c.op, c.mb, c.phase))
                pending[mb] = None
            stream = streams[mb]
            while pos[mb] < len(stream):
                item = stream[pos[mb]]
                pos[mb] += 1
                if isinstance(item, _Comm):
                    out.append(StartAsync(item.op, item.mb, item.phase))
                    pending[mb] = item
                    break
                out.append(item)
            if pos[mb] >= len(stream) and pending[mb] is None:
                active.remove(mb)
    return out


def _passes(ops: Sequence[Op], segs: list[Segment], mbs: int, cross_pass: bool) -> list[Instruction]:
    if cross_pass:
        streams = []
        for mb in range(mbs):
            s = _forward_stream(ops, segs, mb)
            for seg in reversed(segs):
                s += _recompute_stream(ops, seg, mb) + _backward_stream(ops, seg, mb)
            streams.append(s)
        return merge(streams)
    out = merge([_forward_stream(ops, segs, mb) for mb in range(mbs)])
    for seg in reversed(segs):
        out += merge([_recompute_stream(ops, seg, mb) for mb in range(mbs)])
        out += merge([_backward_stream(ops, seg, mb) for mb in range(mbs)])
    return out


# -- the schedules --------------------------------------------------------------
def build_schedule(name: str, ops: Sequence[Op], options: ScheduleOptions = ScheduleOptions()) -> Schedule:
    """The instruction list of schedule ``name`` over ``ops``.

    ``none``                no recomputation, one batch, synchronous collectives.
    ``megatron``            full per-layer recomputation, synchronous; the recompute
                            re-runs each forward AllReduce (3 per block per step).
    ``megatron_selective``  only the attention core recomputed, synchronous.
    ``split_overlap``       Merak-like: ``sub_batches`` pipelined within each pass,
                            per-layer recomputation, barriers between passes.
    ``oases``               cross-pass schedule with fine-grained recomputation;
                            ``cross_pass`` / ``fine_grained_recompute`` switch each off.
    """
    if name not in SCHEDULES:
        raise ValueError(f"oases.schedule={name!r} unknown; choose one of {', '.join(SCHEDULES)}")
    if not ops or not getattr(ops[-1], "is_loss", False):
        raise ValueError("operator sequence must end with the loss operator")
    segs = schedule_segments(name, ops, options)
    if name in ("none", "megatron", "megatron_selective"):
        return Schedule(name, tuple(_passes(ops, segs, 1, True)), 1, name == "none")
    mbs = options.sub_batches
    if name == "split_overlap":
        return Schedule(name, tuple(_passes(ops, segs, mbs, False)), mbs, False)
    return Schedule(name, tuple(_passes(ops, segs, mbs, options.cross_pass)), mbs, options.fine_grained_recompute)
