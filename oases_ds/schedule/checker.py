"""Invariants every schedule must satisfy, checked on the instruction list alone.

A schedule that breaks one would deadlock (a StartAsync never synced, ranks
disagreeing on collective order), compute garbage (a buffer read before it was
written) or silently cost more than it claims (a collective inside a
fine-grained recomputation).  Generators are tested against this checker, and
the checker is tested against hand-broken schedules.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from oases_ds.models.ops import CommOp, Op, backward_collective, forward_collective
from oases_ds.schedule.dataflow import effects, initial_buffers
from oases_ds.schedule.generators import Schedule
from oases_ds.schedule.instructions import Backward, Forward, Instruction, Recompute, StartAsync, Sync


class ScheduleError(ValueError):
    """A schedule violates an invariant; the message names the instruction."""


def check(schedule: Schedule, ops: Sequence[Op]) -> None:
    """Raise :class:`ScheduleError` on the first violated invariant."""
    instructions = schedule.instructions
    subs = schedule.sub_batches
    _check_pairs(instructions)
    _check_dataflow(instructions, ops, subs)
    _check_complete(instructions, ops, subs)
    if schedule.fine_grained:
        for pos, ins in enumerate(instructions):
            if isinstance(ins, StartAsync) and ins.phase == "recompute":
                raise ScheduleError(f"#{pos} {ins}: collective inside a fine-grained recomputation")


def _check_pairs(instructions: Sequence[Instruction]) -> None:
    open_: set[tuple] = set()
    for pos, ins in enumerate(instructions):
        key = (ins.op, ins.sub, getattr(ins, "phase", None))
        if isinstance(ins, StartAsync):
            if key in open_:
                raise ScheduleError(f"#{pos} {ins}: started again before its Sync")
            open_.add(key)
        elif isinstance(ins, Sync):
            if key not in open_:
                raise ScheduleError(f"#{pos} {ins}: Sync without a matching StartAsync")
            open_.remove(key)
    if open_:
        raise ScheduleError(f"StartAsync never synced: {sorted(open_)}")


def _check_dataflow(instructions: Sequence[Instruction], ops: Sequence[Op], subs: int) -> None:
    live = initial_buffers(subs)
    for pos, ins in enumerate(instructions):
        if not (0 <= ins.op < len(ops)) or not (0 <= ins.sub < subs):
            raise ScheduleError(f"#{pos} {ins}: op or sub-batch out of range")
        reads, writes = effects(ins, ops)
        for buf in reads:
            if buf not in live:
                raise ScheduleError(f"#{pos} {ins}: reads {buf} before it is written")
        for buf in reads:
            if buf[0] in ("graph", "comm"):  # consumed by their one reader
                live.discard(buf)
        live.update(writes)


def _check_complete(instructions: Sequence[Instruction], ops: Sequence[Op], subs: int) -> None:
    """Each op runs forward once and backward once per sub-batch, with the right kind
    of instruction (a collective op through StartAsync, the others directly)."""
    fwd: Counter = Counter()
    bwd: Counter = Counter()
    for pos, ins in enumerate(instructions):
        op = ops[ins.op]
        if isinstance(ins, Forward) or (isinstance(ins, StartAsync) and ins.phase == "forward"):
            if isinstance(ins, Forward) and forward_collective(op):
                raise ScheduleError(f"#{pos} {ins}: {op.name} has a forward collective; use StartAsync")
            if isinstance(ins, Forward) and ins.keep_graph and isinstance(op, CommOp):
                raise ScheduleError(f"#{pos} {ins}: a communication op has no graph to keep")
            fwd[(ins.op, ins.sub)] += 1
        elif isinstance(ins, Backward) or (isinstance(ins, StartAsync) and ins.phase == "backward"):
            if isinstance(ins, Backward) and backward_collective(op):
                raise ScheduleError(f"#{pos} {ins}: {op.name} has a backward collective; use StartAsync")
            bwd[(ins.op, ins.sub)] += 1
        elif isinstance(ins, Recompute) and forward_collective(op):
            raise ScheduleError(f"#{pos} {ins}: recomputing a collective needs StartAsync")
    for i in range(len(ops)):
        for sub in range(subs):
            if fwd[(i, sub)] != 1 or bwd[(i, sub)] != 1:
                raise ScheduleError(
                    f"op {i} ({ops[i].name}) sub-batch {sub}: {fwd[(i, sub)]} forwards, {bwd[(i, sub)]} backwards"
                )
