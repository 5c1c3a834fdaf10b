"""Which buffers each instruction reads and writes.

One definition serves two users: the invariant checker (no buffer is read
before it is written) and the executor (a buffer is freed right after its last
read, so a schedule keeps exactly the activations it says it keeps).

Buffers, per operator index ``i`` and sub-batch ``sub``:

* ``("act", i, sub)``   input tuple of op ``i`` (= output of op ``i-1``)
* ``("grad", i, sub)``  gradient w.r.t. that input
* ``("graph", i, sub)`` op ``i``'s autograd graph (inputs that require grad + outputs)
* ``("comm", i, sub, phase)`` an in-flight collective
* ``("p2p", kind, i, sub)`` an in-flight point-to-point transfer with a neighbouring
  pipeline stage (``i``: 0 for the stage's input, the op count for its output)
"""
from __future__ import annotations

from typing import Sequence

from oases_ds.models.ops import CommOp, Op
from oases_ds.schedule.instructions import Backward, Forward, Instruction, P2PStart, P2PSync, Recompute, StartAsync, Sync

Buffer = tuple


def initial_buffers(sub_batches: int) -> set[Buffer]:
    """Buffers that exist before the first instruction: the (empty) input of op 0."""
    return {("act", 0, sub) for sub in range(sub_batches)}


def effects(ins: Instruction, ops: Sequence[Op]) -> tuple[list[Buffer], list[Buffer]]:
    """(reads, writes) of one instruction."""
    i, sub = ins.op, ins.sub
    if isinstance(ins, (P2PStart, P2PSync)):
        return p2p_effects(ins)
    op = ops[i]
    is_compute = not isinstance(op, CommOp)
    if isinstance(ins, (Forward, Recompute)):
        writes = [("act", i + 1, sub)]
        if is_compute and (isinstance(ins, Recompute) or ins.keep_graph):
            writes.append(("graph", i, sub))
        return [("act", i, sub)], writes
    if isinstance(ins, Backward):
        reads = [] if getattr(op, "is_loss", False) else [("grad", i + 1, sub)]
        if is_compute:
            reads.append(("graph", i, sub))
        return reads, [("grad", i, sub)]
    if isinstance(ins, StartAsync):
        src = ("grad", i + 1, sub) if ins.phase == "backward" else ("act", i, sub)
        return [src], [("comm", i, sub, ins.phase)]
    if isinstance(ins, Sync):
        dst = ("grad", i, sub) if ins.phase == "backward" else ("act", i + 1, sub)
        return [("comm", i, sub, ins.phase)], [dst]
    raise TypeError(f"unknown instruction {ins!r}")


def p2p_effects(ins: P2PStart | P2PSync) -> tuple[list[Buffer], list[Buffer]]:
    """(reads, writes) of a point-to-point instruction: a send reads the boundary buffer
    and its sync nothing more; a receive's sync writes it."""
    i, sub = ins.op, ins.sub
    flight = ("p2p", ins.kind, i, sub)
    boundary = {"recv_act": ("act", i, sub), "send_act": ("act", i, sub),
                "recv_grad": ("grad", i, sub), "send_grad": ("grad", i, sub)}[ins.kind]
    sending = ins.kind.startswith("send")
    if isinstance(ins, P2PStart):
        return ([boundary] if sending else []), [flight]
    return [flight], ([] if sending else [boundary])


def last_reads(instructions: Sequence[Instruction], ops: Sequence[Op]) -> list[list[Buffer]]:
    """For each instruction, the buffers that die with it: those it reads for the
    last time before they are overwritten or the schedule ends, and those it writes
    that nobody reads (the loss op's output, the token gradient).  The executor
    frees them right after the instruction."""
    frees: list[list[Buffer]] = [[] for _ in instructions]
    read_later: set[Buffer] = set()
    for idx in reversed(range(len(instructions))):
        reads, writes = effects(instructions[idx], ops)
        for buf in writes:
            if buf not in read_later:
                frees[idx].append(buf)
            read_later.discard(buf)
        for buf in reads:
            if buf not in read_later:
                frees[idx].append(buf)
                read_later.add(buf)
    return frees


def unread_recomputes(instructions: Sequence[Instruction], ops: Sequence[Op],
                      frees: Sequence[Sequence[Buffer]] | None = None) -> frozenset[Instruction]:
    """Recomputes whose output no later instruction reads: fine-grained recomputation's last
    op before a forward collective that is not re-run (its output would feed only that
    collective), or a layer's last op under Megatron's (the next layer's input is a
    checkpoint already).  Such an op is recomputed for its autograd graph alone; an op
    marked ``ComputeOp.graph_only_recompute`` then skips computing its outputs' values.
    Each op is recomputed at most once per sub-batch, so the instruction names one.
    ``frees``: :func:`last_reads` of the same list, if already at hand."""
    frees = last_reads(instructions, ops) if frees is None else frees
    return frozenset(ins for ins, dying in zip(instructions, frees)
                     if isinstance(ins, Recompute) and ("act", ins.op + 1, ins.sub) in dying)


def peak_live(instructions: Sequence[Instruction], ops: Sequence[Op], sub_batches: int) -> dict[str, int]:
    """Most buffers of each kind alive at once when the executor runs ``instructions``
    (it frees exactly what :func:`last_reads` says).  ``graph`` counts operators whose
    autograd graph -- their activations -- is held: the memory a schedule trades
    for recomputation."""
    frees = last_reads(instructions, ops)
    live = set(initial_buffers(sub_batches))
    peak: dict[str, int] = {}
    for idx, ins in enumerate(instructions):
        live.update(effects(ins, ops)[1])
        for kind in {b[0] for b in live}:
            peak[kind] = max(peak.get(kind, 0), sum(1 for b in live if b[0] == kind))
        live.difference_update(frees[idx])
    return peak
