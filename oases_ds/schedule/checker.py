"""Invariants every schedule must satisfy, checked on the instruction list alone.

A schedule that breaks one would deadlock (a StartAsync never synced, ranks
disagreeing on collective order), compute garbage (a buffer read before it was
written) or silently cost more than it claims (a collective inside a
fine-grained recomputation).  Generators are tested against this checker, and
the checker is tested against hand-broken schedules.

Pipeline schedules (:mod:`oases_ds.schedule.pipeline`) are checked per stage -- each
micro-batch's instructions satisfy the invariants above, with the stage boundary's
buffers received rather than given -- and across stages: every send is matched by a
receive on the neighbour in the same order, and two abstract runs of all stages
together end (no deadlock): one with gloo's transport, where each transfer has its own
channel, and one with NCCL's, where the transfers of one communicator run one after
another in issue order and a send completes only together with its receive.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Mapping, Sequence

from oases_ds.models.ops import CommOp, Op, backward_collective, forward_collective, sequence_gather
from oases_ds.schedule.dataflow import effects, initial_buffers
from oases_ds.schedule.generators import Schedule, block_index
from oases_ds.schedule.instructions import (P2P_TAG, Backward, Forward, Instruction, P2PStart, P2PSync, Recompute,
                                            StartAsync, Sync)
from oases_ds.schedule.pipeline import CHANNEL, PipelineSchedule, transfers


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
            _check_recompute_collective(pos, ins, ops, schedule)
    _check_stored(instructions, ops, schedule.stored_blocks)


def _check_recompute_collective(pos: int, ins: Instruction, ops: Sequence[Op], schedule: Schedule, where: str = "") -> None:
    """A fine-grained recomputation runs no collective, with one exception: under sequence
    parallelism a recomputed block of policy ``oases`` re-gathers its input along the
    sequence from the ``1/t`` checkpoint.  Any other collective in a recomputation (a
    reduction re-run, or the gather of a block planned to keep it) is an error.  That the
    re-gather is waited for before its output is read is the dataflow check's (the
    gathered buffer exists only once its Sync ran)."""
    if not (isinstance(ins, StartAsync) and ins.phase == "recompute"):
        return
    op = ops[ins.op]
    block = block_index(op.layer, op.block)
    if sequence_gather(op) and block is not None and block not in schedule.gathered_blocks:
        return
    why = " (its block keeps the gathered input, policy oases_gathered)" if sequence_gather(op) else ""
    raise ScheduleError(f"{where}#{pos} {ins}: collective inside a fine-grained recomputation{why}")


def _check_stored(instructions: Sequence[Instruction], ops: Sequence[Op], stored_blocks: Sequence[int]) -> None:
    """A block the schedule stores (policy ``store``) is never recomputed and keeps every
    compute op's graph from forward: otherwise it would pay the recompute it was planned
    without, or read a graph that was never kept."""
    stored = set(stored_blocks)
    if not stored:
        return
    for pos, ins in enumerate(instructions):
        op = ops[ins.op] if 0 <= ins.op < len(ops) else None
        if op is None or block_index(op.layer, op.block) not in stored:
            continue
        if isinstance(ins, Recompute) or (isinstance(ins, StartAsync) and ins.phase == "recompute"):
            raise ScheduleError(f"#{pos} {ins}: {op.name} is in a stored block (policy store) but is recomputed")
        if isinstance(ins, Forward) and not ins.keep_graph and not isinstance(op, CommOp):
            raise ScheduleError(f"#{pos} {ins}: {op.name} is in a stored block (policy store) but drops its graph")


def _check_pairs(instructions: Sequence[Instruction]) -> None:
    open_: set[tuple] = set()
    for pos, ins in enumerate(instructions):
        key = (ins.op, ins.sub, getattr(ins, "phase", None), getattr(ins, "kind", None))
        if isinstance(ins, (StartAsync, P2PStart)):
            if key in open_:
                raise ScheduleError(f"#{pos} {ins}: started again before its Sync")
            open_.add(key)
        elif isinstance(ins, (Sync, P2PSync)):
            if key not in open_:
                raise ScheduleError(f"#{pos} {ins}: Sync without a matching StartAsync")
            open_.remove(key)
    if open_:
        raise ScheduleError(f"StartAsync never synced: {sorted(open_)}")


def _check_dataflow(instructions: Sequence[Instruction], ops: Sequence[Op], subs: int,
                    live: set | None = None) -> None:
    live = initial_buffers(subs) if live is None else live
    for pos, ins in enumerate(instructions):
        p2p = isinstance(ins, (P2PStart, P2PSync))
        if (ins.op not in (0, len(ops)) if p2p else not 0 <= ins.op < len(ops)) or not (0 <= ins.sub < subs):
            raise ScheduleError(f"#{pos} {ins}: op or sub-batch out of range")
        reads, writes = effects(ins, ops)
        for buf in reads:
            if buf not in live:
                raise ScheduleError(f"#{pos} {ins}: reads {buf} before it is written")
        for buf in reads:
            if buf[0] in ("graph", "comm", "p2p"):  # consumed by their one reader
                live.discard(buf)
        live.update(writes)


def _check_complete(instructions: Sequence[Instruction], ops: Sequence[Op], subs: int) -> None:
    """Each op runs forward once and backward once per sub-batch, with the right kind
    of instruction (a collective op through StartAsync, the others directly)."""
    fwd: Counter = Counter()
    bwd: Counter = Counter()
    for pos, ins in enumerate(instructions):
        if isinstance(ins, (P2PStart, P2PSync)):
            continue
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


# -- pipeline schedules ----------------------------------------------------------------
def check_pipeline(pipe: PipelineSchedule, ops: Sequence[Op]) -> None:
    """Raise :class:`ScheduleError` unless every micro-batch of one stage's pipeline
    schedule is a valid schedule of its own: each half once, forward first; transfers
    paired with their waits; nothing read before it is written or received (the first
    stage starts from its empty input, the others from nothing); every op forward and
    backward once per sub-batch; and only the transfers the stage's position allows."""
    subs, body = pipe.sub_batches, pipe.body
    allowed = {"recv_act": not body.first, "send_grad": not body.first, "send_act": not body.last,
               "recv_grad": not body.last}
    for half in ("F", "B"):
        micros = [m for h, m in pipe.order if h == half]
        if micros != list(range(pipe.micro_batches)):
            raise ScheduleError(f"stage {pipe.stage}: the {half} halves run micro-batches {micros}; each must run "
                                f"once, in micro-batch order")
    for m in range(pipe.micro_batches):
        if pipe.order.index(("F", m)) > pipe.order.index(("B", m)):
            raise ScheduleError(f"stage {pipe.stage}: micro-batch {m}'s backward runs before its forward")
    for step in pipe.steps:
        if isinstance(step.ins, (P2PStart, P2PSync)) and not allowed[step.ins.kind]:
            raise ScheduleError(f"stage {pipe.stage} of {pipe.stages}: {step}: no {step.ins.kind} on this stage")
    for m in range(pipe.micro_batches):
        instructions = [s.ins for s in pipe.steps if s.micro == m]
        live = initial_buffers(subs) if body.first else set()
        try:
            _check_pairs(instructions)
            _check_dataflow(instructions, ops, subs, live)
            _check_complete(instructions, ops, subs)
            _check_stored([i for i in instructions if not isinstance(i, (P2PStart, P2PSync))], ops,
                          body.schedule.stored_blocks)
        except ScheduleError as err:
            raise ScheduleError(f"stage {pipe.stage} micro-batch {m}: {err}") from None
    if body.schedule.fine_grained:
        for pos, step in enumerate(pipe.steps):
            if not isinstance(step.ins, (P2PStart, P2PSync)):
                _check_recompute_collective(pos, step.ins, ops, body.schedule, f"stage {pipe.stage} micro-batch {step.micro} ")


_PARTNER = {"send_act": ("recv_act", +1), "recv_act": ("send_act", -1),
            "send_grad": ("recv_grad", -1), "recv_grad": ("send_grad", +1)}


def check_pipeline_links(pipes: Sequence[PipelineSchedule], channel: Mapping[str, str] = CHANNEL) -> None:
    """Raise :class:`ScheduleError` unless the stages' schedules (stage 0 first) fit together.

    1. On each link every send has a receive on the neighbour, in the same order
       (NCCL matches point-to-point messages in issue order).
    2. No deadlock on gloo: an abstract run of all stages, where a receive's wait blocks
       until the neighbour started the matching send and -- conservatively, as a
       rendezvous transport may -- a send's wait until the neighbour posted the receive,
       and everything else runs (collectives stay inside one stage, whose TMP ranks all
       run the same list), reaches the end of every stage's list.
    3. No deadlock on NCCL (:func:`simulate_nccl`), with the transfers on the process
       groups ``channel`` names (the executor's :data:`~oases_ds.schedule.pipeline.CHANNEL`).
    """
    if [p.stage for p in pipes] != list(range(len(pipes))) or any(p.stages != len(pipes) for p in pipes):
        raise ScheduleError(f"expected the schedules of stages 0..{len(pipes) - 1} in order")
    if len({p.micro_batches for p in pipes}) > 1:
        raise ScheduleError(f"stages disagree on micro-batches: {[p.micro_batches for p in pipes]}")
    for s in range(len(pipes) - 1):
        a, b = pipes[s], pipes[s + 1]
        for sender, kind, receiver, partner in ((a, "send_act", b, "recv_act"), (b, "send_grad", a, "recv_grad")):
            sent, received = transfers(sender, kind), transfers(receiver, partner)
            if sent != received:
                first = next((i for i, (x, y) in enumerate(zip(sent, received)) if x != y), min(len(sent), len(received)))
                raise ScheduleError(
                    f"link {s}-{s + 1}: stage {sender.stage} sends {kind} (micro, sub) {sent[first:first + 3]} where stage "
                    f"{receiver.stage} receives {received[first:first + 3]} (transfer #{first}); both sides must use one order")
    _simulate(pipes)
    simulate_nccl(pipes, channel)


def _simulate(pipes: Sequence[PipelineSchedule]) -> None:
    pos = [0] * len(pipes)
    started: list[set[tuple]] = [set() for _ in pipes]  # (kind, micro, sub) started on each stage
    while True:
        moved = False
        for s, pipe in enumerate(pipes):
            while pos[s] < len(pipe.steps):
                step = pipe.steps[pos[s]]
                ins = step.ins
                if isinstance(ins, P2PSync):
                    partner, direction = _PARTNER[ins.kind]
                    if (partner, step.micro, ins.sub) not in started[s + direction]:
                        break
                elif isinstance(ins, P2PStart):
                    started[s].add((ins.kind, step.micro, ins.sub))
                pos[s] += 1
                moved = True
        if all(p == len(pipe.steps) for p, pipe in zip(pos, pipes)):
            return
        if not moved:
            blocked = ", ".join(f"stage {s} at #{p} {pipe.steps[p]}" for s, (p, pipe) in enumerate(zip(pos, pipes))
                                if p < len(pipe.steps))
            raise ScheduleError(f"deadlock: {blocked}")


def simulate_nccl(pipes: Sequence[PipelineSchedule], channel: Mapping[str, str] = CHANNEL) -> None:
    """Raise :class:`ScheduleError` if the stages can deadlock under NCCL's semantics.

    The model, per stage (one rank stands for the stage's TMP ranks, which run the same
    list), of what the device does with what the host issued:

    * the compute stream runs the stage's instructions in order; a ``P2PStart`` queues
      its transfer on the stream of its communicator (``channel[kind]``: one FIFO for
      every transfer of that process group, whichever neighbour it goes to, so the
      model is conservative for torch's per-peer communicators too) and moves on;
    * a transfer at the head of its queue completes together with its partner on the
      neighbour, once that one is at the head of the same channel's queue there (a
      rendezvous: NCCL's large messages wait for the receiving kernel; small ones may
      not, so this finds every order that can hang);
    * a ``P2PSync`` holds the compute stream until its transfer completed.

    The run must reach the end of every stage's list with every queue empty.
    """
    queues: list[dict[str, deque]] = [{} for _ in pipes]
    done: list[set[tuple]] = [set() for _ in pipes]  # (kind, micro, sub) completed on each stage
    pos = [0] * len(pipes)
    while True:
        moved = False
        for s, pipe in enumerate(pipes):  # each compute stream as far as it goes
            while pos[s] < len(pipe.steps):
                step = pipe.steps[pos[s]]
                ins = step.ins
                if isinstance(ins, P2PSync) and (ins.kind, step.micro, ins.sub) not in done[s]:
                    break
                if isinstance(ins, P2PStart):
                    queues[s].setdefault(channel[ins.kind], deque()).append((ins.kind, step.micro, ins.sub))
                pos[s] += 1
                moved = True
        for s in range(len(pipes)):  # rendezvous of queue heads
            for name, queue in queues[s].items():
                if not queue:
                    continue
                kind, micro, sub = queue[0]
                partner, direction = _PARTNER[kind]
                other = queues[s + direction].get(name)
                if other and other[0] == (partner, micro, sub):
                    queue.popleft()
                    other.popleft()
                    done[s].add((kind, micro, sub))
                    done[s + direction].add((partner, micro, sub))
                    moved = True
        if all(p == len(pipe.steps) for p, pipe in zip(pos, pipes)) and not any(q for qs in queues for q in qs.values()):
            return
        if not moved:
            heads = "; ".join(
                f"stage {s} at #{p} {pipe.steps[p] if p < len(pipe.steps) else 'end'}, queued "
                + ", ".join(f"{name}: {P2P_TAG[q[0][0]]}{q[0][1]}.{q[0][2]}" for name, q in queues[s].items() if q)
                for s, (p, pipe) in enumerate(zip(pos, pipes)))
            raise ScheduleError(f"NCCL deadlock: {heads}")
