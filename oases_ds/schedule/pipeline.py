"""Pipeline schedules: micro-batches over stages, any TMP schedule inside each stage.

A stage runs, per micro-batch, a *forward half* and a *backward half* of the TMP
schedule registered under ``spec.name`` (``oases``, ``megatron``, ``none``, ...).
The halves are the schedule's own instruction list, split stably: the forward
half keeps the Forward instructions and forward collectives in their order, the
backward half everything else (Recompute, Backward, recompute and backward
collectives) in theirs.  Both halves are valid interleavings of the sub-batch
streams, so Oases' cross-pass merge of recompute and backward survives inside the
backward half; only the head of the backward is no longer mixed into the tail of
the forward -- it cannot be on a stage before the last anyway, since its gradient
comes from the next stage.

Point-to-point transfers are added at the stage boundary, per sub-batch, like
collectives (started, then waited by a :class:`P2PSync`)::

    forward half    <a0.0 <a0.1 | W<a0.0 f.. (sub 0) W<a0.1 f.. (sub 1) ... >aL.0 ... >aL.1
    backward half   <gL.0 <gL.1 | W<gL.0 R.. B.. ... >g0.0 ... >g0.1 | W>aL.0 W>aL.1 W>g0.0 W>g0.1

* receives are posted for every sub-batch at the start of the half and waited just
  before the first instruction that reads the buffer, so sub-batch 1's activation
  arrives while sub-batch 0 computes;
* sends start as soon as the buffer is written, but in sub-batch order;
* the sends of micro-batch ``m`` are waited at the end of its backward half.  By then
  the next stage has used the activation (it sent back its gradient), and the
  previous stage posts its gradient receive before any instruction of its own that
  could wait on this stage -- the simulation in
  :func:`~oases_ds.schedule.checker.check_pipeline_links` checks it for each schedule.

Order on the wire: on every link each side sends and receives in the same order --
micro-batch ascending (both schedules below run forwards in micro-batch order and
backwards in micro-batch order) and sub-batch ascending within one -- which is what
NCCL needs (it matches point-to-point messages in order, with no tags) and what the
checker verifies.

One channel per direction (:data:`CHANNEL`).  NCCL runs the point-to-point operations
of one communicator in issue order on one stream, and a send larger than its staging
buffer (a few MiB; a real sub-batch's activation is tens) completes only while the
peer's matching receive runs.  With both directions on one communicator, 1F1B's steady
state deadlocks: after ``F(m+w)`` a stage's stream holds the activation send, the next
stage's holds its gradient send for ``B(m)``, and each waits for a receive queued behind
the other.  So activations and gradients travel on two process groups over the same
ranks (the context's ``pp_group`` and ``pp_grad_group``): each stream then carries
one direction, whose order is the same on both ends, and the checker's NCCL model
(:func:`~oases_ds.schedule.checker.check_pipeline_links`) proves the whole step ends
for each pipeline order.  gloo, whose channels per peer are independent, runs the same.

The two pipeline orders of the halves, ``F``/``B`` of a micro-batch, 4 stages and
8 micro-batches; time goes right::

  gpipe  stage 0  F0 F1 F2 F3 F4 F5 F6 F7                         B0 B1 B2 B3 B4 B5 B6 B7
         stage 3           F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7
  1f1b   stage 0  F0 F1 F2 F3          B0 F4    B1 F5    B2 F6    B3 F7    B4 B5 B6 B7
         stage 3           F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

GPipe keeps all micro-batches' activations until the backwards start; 1F1B at
most ``stages - stage`` (PipeDream-Flush / Megatron's non-interleaved schedule).
Both give the same gradients: a parameter's gradient is the sum over
micro-batches, whatever the order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from oases_ds.models.ops import Op
from oases_ds.schedule.dataflow import effects
from oases_ds.schedule.generators import Schedule, ScheduleSpec, build_schedule, micro_batch_merge, overlap_refusal
from oases_ds.schedule.instructions import (
    Forward,
    Instruction,
    P2PStart,
    P2PSync,
    PipeStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    StartAsync,
    Sync,
)

Half = Literal["F", "B"]
Order = list[tuple[Half, int]]


@dataclass(frozen=True)
class StageBody:
    """One micro-batch on one stage: the TMP schedule's two halves with the transfers.

    Attributes:
        schedule: the TMP schedule the halves come from (its name and sub-batches).
        forward / backward: the halves (see the module docstring).
        first / last: whether the stage is the first / last (no receive / send of
            activations before / after it).
        ops: the stage's operator count (the index of its output boundary).
    """

    schedule: Schedule
    forward: tuple[Instruction, ...]
    backward: tuple[Instruction, ...]
    first: bool
    last: bool
    ops: int


@dataclass(frozen=True)
class PipelineSchedule:
    """The instruction list of one stage for one optimizer step.

    Attributes:
        name: the pipeline order (``1f1b``, ``gpipe``).
        stage / stages: this stage, of how many.
        micro_batches: micro-batches per step (the gradient-accumulation steps).
        body: the per-micro-batch halves.
        order: which half of which micro-batch runs when (``[("F", 0), ("B", 0), ...]``).
        steps: every instruction, tagged with its micro-batch.
    """

    name: str
    stage: int
    stages: int
    micro_batches: int
    body: StageBody
    order: tuple[tuple[Half, int], ...]
    steps: tuple[PipeStep, ...]

    @property
    def sub_batches(self) -> int:
        return self.body.schedule.sub_batches

    def outline(self) -> str:
        """The order of halves, e.g. ``F0 F1 B0 F2 B1 B2``."""
        return " ".join(f"{half}{micro}" for half, micro in self.order)

    def __str__(self) -> str:
        return " ".join(str(step) for step in self.steps)

    def __len__(self) -> int:
        return len(self.steps)


#: The process-group channel each transfer kind travels on (module docstring): the
#: executor sends and receives ``act`` transfers on the pipeline group, ``grad`` ones
#: on the pipeline gradient group.
CHANNEL: dict[str, str] = {"send_act": "act", "recv_act": "act", "send_grad": "grad", "recv_grad": "grad"}


# -- the per-micro-batch body -------------------------------------------------------
def _is_forward(ins: Instruction) -> bool:
    return isinstance(ins, Forward) or (isinstance(ins, (StartAsync, Sync)) and ins.phase == "forward")


def split_halves(schedule: Schedule) -> tuple[tuple[Instruction, ...], tuple[Instruction, ...]]:
    """(forward half, backward half) of a TMP schedule: a stable partition (module docstring)."""
    forward = tuple(ins for ins in schedule.instructions if _is_forward(ins))
    backward = tuple(ins for ins in schedule.instructions if not _is_forward(ins))
    return forward, backward


def _with_transfers(half: Sequence[Instruction], ops: Sequence[Op], subs: int, recv: type[P2PStart] | None,
                    recv_at: int, send: type[P2PStart] | None, send_at: int) -> list[Instruction]:
    """``half`` with receives posted up front and waited before their first reader, and
    sends started, in sub-batch order, once their buffer is written."""
    recv_buf = {"recv_act": "act", "recv_grad": "grad"}
    out: list[Instruction] = []
    waiting: set[int] = set()
    if recv is not None:
        out += [recv(recv_at, sub) for sub in range(subs)]
        waiting = set(range(subs))
    written: set[int] = set()
    next_send = 0
    for ins in half:
        reads, writes = effects(ins, ops)
        if recv is not None:
            for buf in reads:
                if buf[0] == recv_buf[recv.kind] and buf[1] == recv_at and buf[2] in waiting:
                    out.append(P2PSync(recv_at, buf[2], recv.kind))
                    waiting.discard(buf[2])
        out.append(ins)
        if send is not None:
            kind = "act" if send.kind == "send_act" else "grad"
            written.update(buf[2] for buf in writes if buf[0] == kind and buf[1] == send_at)
            while next_send < subs and next_send in written:
                out.append(send(send_at, next_send))
                next_send += 1
    if recv is not None and waiting:
        raise ValueError(f"no instruction of the half reads the received buffer of sub-batches {sorted(waiting)}")
    if send is not None and next_send < subs:
        raise ValueError(f"the half never writes the buffer to send for sub-batch {next_send}")
    return out


def stage_body(spec: ScheduleSpec, ops: Sequence[Op], first: bool, last: bool) -> StageBody:
    """``spec``'s TMP schedule over one stage's ``ops``, split into halves, with the
    transfers to and from the neighbouring stages (module docstring)."""
    schedule = build_schedule(spec, ops, ends_with_loss=last)
    forward, backward = split_halves(schedule)
    subs, end = schedule.sub_batches, len(ops)
    fwd = _with_transfers(forward, ops, subs, None if first else RecvActivation, 0, None if last else SendActivation, end)
    bwd = _with_transfers(backward, ops, subs, None if last else RecvGrad, end, None if first else SendGrad, 0)
    if not last:  # every send of the micro-batch is done by the end of its backward (module docstring)
        bwd += [P2PSync(end, sub, "send_act") for sub in range(subs)]
    if not first:
        bwd += [P2PSync(0, sub, "send_grad") for sub in range(subs)]
    return StageBody(schedule, tuple(fwd), tuple(bwd), first, last, end)


# -- the orders of halves --------------------------------------------------------------
PipelineOrder = Callable[[int, int, int], Order]
_ORDERS: dict[str, PipelineOrder] = {}


def register_pipeline(name: str) -> Callable[[PipelineOrder], PipelineOrder]:
    """Decorator: make ``order(stage, stages, micro_batches)`` the pipeline schedule ``name``.
    An order must run every forward and every backward once, each in micro-batch order
    (that is what makes the transfer order agree on both ends of a link)."""

    def register(order: PipelineOrder) -> PipelineOrder:
        if name in _ORDERS:
            raise ValueError(f"pipeline schedule {name!r} is registered twice; pick another name")
        _ORDERS[name] = order
        return order

    return register


def registered_pipelines() -> tuple[str, ...]:
    return tuple(_ORDERS)


@register_pipeline("gpipe")
def gpipe_order(stage: int, stages: int, micro_batches: int) -> Order:
    """Every forward, then every backward (GPipe; the simple baseline)."""
    return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]


@register_pipeline("1f1b")
def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> Order:
    """Warm up with ``stages - stage - 1`` forwards, then alternate one forward and one
    backward, then drain the backwards: at most ``stages - stage`` micro-batches in flight."""
    warmup = min(stages - stage - 1, micro_batches)
    order: Order = [("F", m) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [("F", warmup + m), ("B", m)]
    order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
    return order


OVERLAP = "overlap"
"""The one-stage order of ``oases.overlap_micro_batches``: a step's micro-batches as one merge, each
forward under the previous micro-batch's backward (:func:`build_overlapped`).  Not a registered
order of halves: its halves interleave instruction by instruction."""


def build_overlapped(spec: ScheduleSpec, ops: Sequence[Op], micro_batches: int) -> PipelineSchedule:
    """One stage (no neighbours) running a step's ``micro_batches`` micro-batches as one cross-pass merge
    (:func:`~oases_ds.schedule.generators.micro_batch_merge`); ``order`` lists the halves as each begins."""
    body = stage_body(spec, ops, first=True, last=True)
    steps = tuple(PipeStep(m, ins) for m, ins in micro_batch_merge(spec, ops, micro_batches))
    order: list[tuple[Half, int]] = []
    for step in steps:
        half: Half = "F" if _is_forward(step.ins) else "B"
        if (half, step.micro) not in order:
            order.append((half, step.micro))
    return PipelineSchedule(OVERLAP, 0, 1, micro_batches, body, tuple(order), steps)


def build_pipeline(name: str, spec: ScheduleSpec, ops: Sequence[Op], stage: int, stages: int,
                   micro_batches: int) -> PipelineSchedule:
    """Stage ``stage``'s instruction list for one optimizer step of ``micro_batches``
    micro-batches: the pipeline order ``name`` over the halves of ``spec``'s TMP schedule
    (or, for :data:`OVERLAP` on a single stage, :func:`build_overlapped`)."""
    if name == OVERLAP:
        refused = overlap_refusal(spec.name, spec.cross_pass, stages)
        if refused:
            raise ValueError(refused)
        return build_overlapped(spec, ops, micro_batches)
    if name not in _ORDERS:
        raise ValueError(f"pipeline_schedule={name!r} unknown; choose one of {', '.join(_ORDERS)}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")
    body = stage_body(spec, ops, first=stage == 0, last=stage == stages - 1)
    order = tuple(_ORDERS[name](stage, stages, micro_batches))
    steps = tuple(PipeStep(m, ins) for half, m in order for ins in (body.forward if half == "F" else body.backward))
    return PipelineSchedule(name, stage, stages, micro_batches, body, order, steps)


def transfers(pipe: PipelineSchedule, kind: str) -> list[tuple[int, int]]:
    """(micro-batch, sub-batch) of each transfer start of ``kind`` (``send_act``...) in
    schedule order: what the checker compares across a link."""
    return [(s.micro, s.ins.sub) for s in pipe.steps if isinstance(s.ins, P2PStart) and s.ins.kind == kind]
