"""Schedule generators: pure functions from (operator sequence, ScheduleSpec) to instructions.

All five schedules the paper compares are built from three ingredients, so that
a speed difference is a scheduling difference and nothing else:

1. **Segments.**  The sequence is cut into segments, each either *kept* (forward
   keeps its autograd graph) or *recomputed* (forward runs without grad, only the
   segment's input is saved, Recompute runs it again just before Backward).
   Megatron cuts at transformer-layer boundaries, so a recomputation re-runs the
   layer's forward AllReduces; Oases' fine-grained cut is right *after* each
   block's output op (bias, dropout, residual), which follows the block's forward
   AllReduce: the recomputation stops before the AllReduce and never contains a
   collective, the output op keeps its graph from forward (it saves nothing), and
   the checkpoint is the block's output -- one tensor per block::

     segment  [attn_in .. proj | attn_reduce | attn_out ]  [mlp_in .. mlp | mlp_reduce | mlp_out ]
     forward   f  ..  f          S/W           F(kept)     f  ..  f        S/W          F(kept)
     backward  R  ..  R B .. B   (no rerun)    B           R  ..  R B .. B (no rerun)   B
     holds     x (checkpoint)                                x' = attn_out's output
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

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from oases_ds.models.ops import CommOp, Op, backward_collective, forward_collective, sequence_gather
from oases_ds.schedule.closed_forms import BLOCKING, BLOCKING_RECOMPUTE, OASES, SPLIT_OVERLAP, ClosedForm
from oases_ds.schedule.costed_merge import HopCosts, costed_merge
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

@dataclass(frozen=True)
class Segment:
    """Ops ``[start, end)``, run forward once, then backward last op first.

    If ``recompute``: forward keeps only the segment's input (the checkpoint), and
    ops ``[start, recompute_end)`` are run again just before their backward.  A
    forward collective at ``recompute_end`` (fine-grained cut) is not re-run: its
    output's gradient is its input's (paper eq. 1).  Ops ``[tail_start, end)``,
    the *kept tail*, keep the graph their forward built and are never recomputed;
    the fine-grained cut puts there the op right after the collective when it
    saves nothing for backward (``ComputeOp.saves_nothing``: bias, dropout,
    residual), so the checkpoint is that op's output -- one tensor -- rather than
    its inputs ``(x, y)``.  ``tail_start`` defaults to ``end`` (no tail).
    """

    start: int
    end: int
    recompute: bool
    recompute_end: int
    tail_start: int | None = None

    def __post_init__(self) -> None:
        if self.tail_start is None:
            object.__setattr__(self, "tail_start", self.end)
        if not self.start <= self.recompute_end <= self.tail_start <= self.end:
            raise ValueError(f"segment bounds must satisfy start <= recompute_end <= tail_start <= end, got {self}")


@dataclass(frozen=True)
class Schedule:
    """A named instruction list plus what the checker needs to know about it.

    ``stored_blocks``: the blocks (:func:`block_index`) whose activations the schedule stores
    instead of recomputing them; the checker holds it to that (no Recompute of their ops).
    ``gathered_blocks``: under sequence parallelism, the recomputed blocks that keep their
    gathered input (policy ``oases_gathered``); the others re-gather it in their recomputation,
    the one collective a fine-grained recomputation may run (the checker allows exactly that)."""

    name: str
    instructions: tuple[Instruction, ...]
    sub_batches: int
    fine_grained: bool
    stored_blocks: tuple[int, ...] = ()
    gathered_blocks: tuple[int, ...] = ()

    def __str__(self) -> str:
        return to_text(list(self.instructions))

    def __len__(self) -> int:
        return len(self.instructions)


@dataclass(frozen=True)
class _Comm:
    op: int
    sub: int
    phase: CommPhase


_Item = Instruction | _Comm


# -- the spec and the registry ----------------------------------------------------
SegmentRule = Callable[[Sequence[Op], "ScheduleSpec"], list[Segment]]
Generator = Callable[[Sequence[Op], list[Segment], "ScheduleSpec"], Schedule]


@dataclass(frozen=True)
class _Registered:
    generate: Generator
    segments: SegmentRule
    sub_batched: bool
    closed_form: ClosedForm | None


_REGISTRY: dict[str, _Registered] = {}


def register_schedule(name: str, *, segments: SegmentRule, sub_batched: bool = False,
                      closed_form: ClosedForm | None = None) -> Callable[[Generator], Generator]:
    """Decorator: make ``generate(ops, segments, spec) -> Schedule`` the schedule ``name``.

    ``segments(ops, spec)`` is the cut the generator runs over; the memory models
    (profiler, analytic costs) count the same cut, through :func:`schedule_segments`.
    ``sub_batched``: the schedule splits a micro-batch into ``spec.sub_batches``
    sub-batches; the others run it whole (see :attr:`ScheduleSpec.effective_sub_batches`).
    ``closed_form``: the communication it leaves exposed per block
    (:mod:`oases_ds.schedule.closed_forms`), what the planner's node costs use; ``None``: the
    cost model refuses to price the schedule in closed form rather than guess.
    """

    def register(generate: Generator) -> Generator:
        if name in _REGISTRY:
            raise ValueError(f"schedule {name!r} is registered twice; pick another name")
        _REGISTRY[name] = _Registered(generate, segments, sub_batched, closed_form)
        return generate

    return register


def closed_form_of(name: str) -> ClosedForm | None:
    """The closed form the schedule ``name`` registered (``None``: none)."""
    return _REGISTRY[name].closed_form


def registered_schedules() -> tuple[str, ...]:
    """Names of every registered schedule, in registration order."""
    return tuple(_REGISTRY)


_SPEC_KEYS = ("name", "sub_batches", "cross_pass", "fine_grained_recompute", "stored_blocks", "gathered_blocks")

RECOMPUTE_POLICIES: tuple[str, ...] = ("oases", "store", "oases_gathered")
"""What a plan may choose for each attention / MLP block: ``oases`` -- fine-grained recomputation
(checkpoint the block's output, recompute it right before its backward, never re-running a
collective); ``store`` -- keep the block's autograd graph from forward to backward (no recompute,
more memory).  Both run inside one Oases schedule: stored blocks keep the sub-batch overlap of
their collectives, recomputed ones the cross-pass overlap as well.

Under sequence parallelism a block's input is gathered along the sequence before its first
linear, and ``oases`` checkpoints only this rank's ``1/t`` slice, so the recomputation runs the
AllGather again (overlapped with the other sub-batch's work like any collective);
``oases_gathered`` checkpoints the gathered input as well (full size, no collective in the
recomputation).  Without sequence parallelism the two are the same."""


def block_index(layer: int, block: str) -> int | None:
    """Index of an attention / MLP block in execution order (attn0 = 0, mlp0 = 1, attn1 = 2, ...),
    the planner's block index; ``None`` for the embedding and the head."""
    if block not in ("attn", "mlp") or layer < 0:
        return None
    return 2 * layer + (block == "mlp")


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything a schedule depends on besides the operator sequence: one typed value
    that the DeepSpeed config, the Hydra ``schedule`` group, the planner and the
    executor all pass around, so the settings are validated once, here.

    Attributes:
        name: a registered schedule (none, megatron, megatron_selective, split_overlap, oases).
        sub_batches: sub-batches a micro-batch is split into; only sub-batched schedules
            (split_overlap, oases) use it, the others run the micro-batch whole and
            ignore it (so one Hydra ``sub_batches`` serves every schedule).
        cross_pass: oases only; merge recompute and backward across passes (off: barriers).
        fine_grained_recompute: oases only; checkpoint each block's output, right after
            its forward AllReduce and output op, so the recompute never re-runs
            a collective (off: per-layer recomputation re-running them).  Like ``cross_pass`` it is
            ignored by the schedules that have no such switch.
        stored_blocks: oases with fine-grained recomputation only; the blocks (:func:`block_index`)
            whose activations are stored rather than recomputed (policy ``store``), normally
            from a plan's per-block policies (:meth:`~oases_ds.planner.plan.Plan.stored_blocks`).
            Empty: every block recomputed, the paper's schedule.
        gathered_blocks: likewise, the blocks of policy ``oases_gathered``: under sequence
            parallelism their recomputation starts from the gathered input instead of
            re-gathering it (:data:`RECOMPUTE_POLICIES`); no effect without it.
        hop_costs: per-op times, normally the ones a plan was priced with
            (:attr:`Plan.hop_costs <oases_ds.planner.plan.Plan.hop_costs>`): under sequence
            parallelism the merge then orders its hops by them
            (:mod:`oases_ds.schedule.costed_merge`); no effect without it.  Not a setting of
            its own: not in a table's label, not in the Hydra ``schedule`` group.
    """

    name: str = "oases"
    sub_batches: int = 2
    cross_pass: bool = True
    fine_grained_recompute: bool = True
    stored_blocks: tuple[int, ...] = ()
    gathered_blocks: tuple[int, ...] = ()
    hop_costs: HopCosts | None = None

    def __post_init__(self) -> None:
        if self.hop_costs is not None and not isinstance(self.hop_costs, HopCosts):
            raise ValueError(f"schedule.hop_costs must be HopCosts or None, got {type(self.hop_costs).__name__}")
        if not isinstance(self.name, str) or self.name not in _REGISTRY:
            raise ValueError(f"schedule.name={self.name!r} unknown; choose one of {', '.join(_REGISTRY)}")
        if isinstance(self.sub_batches, bool) or not isinstance(self.sub_batches, int):
            raise ValueError(f"schedule.sub_batches must be an integer, got {self.sub_batches!r}")
        if self.sub_batches < 1:
            raise ValueError(f"schedule.sub_batches must be >= 1, got {self.sub_batches}")
        for key in ("cross_pass", "fine_grained_recompute"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"schedule.{key} must be true or false, got {getattr(self, key)!r}")
        for key, policy, fix in (("stored_blocks", "store", "store no blocks"),
                                 ("gathered_blocks", "oases_gathered", "keep no gathered inputs")):
            blocks = getattr(self, key)
            if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__") or any(
                    isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks):
                raise ValueError(f"schedule.{key} must be block indices >= 0 (attn0 = 0, mlp0 = 1, ...), got {blocks!r}")
            object.__setattr__(self, key, tuple(sorted(set(blocks))))
            if getattr(self, key) and not (self.name == "oases" and self.fine_grained_recompute):
                raise ValueError(f"schedule.{key} (policy {policy}) needs schedule.name=oases with "
                                 f"fine_grained_recompute=true, got {self.name!r} with fine_grained_recompute="
                                 f"{str(self.fine_grained_recompute).lower()}; use that schedule or {fix}")
        both = sorted(set(self.stored_blocks) & set(self.gathered_blocks))
        if both:
            raise ValueError(f"schedule: block {both[0]} is in both stored_blocks and gathered_blocks; "
                             f"give each block one policy")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> ScheduleSpec:
        """The spec of a Hydra ``schedule`` group (``configs/schedule/*.yaml``: ``name``,
        ``sub_batches``, ``cross_pass``, ``fine_grained_recompute``); a key it does not
        know is an error, not silently dropped, so a typo cannot run the default."""
        unknown = sorted(set(mapping) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"schedule.{unknown[0]}: unknown key; the schedule keys are {', '.join(_SPEC_KEYS)}")
        if "name" not in mapping:
            raise ValueError(f"schedule.name: missing; choose one of {', '.join(_REGISTRY)}")
        return cls(**dict(mapping))

    def to_mapping(self) -> dict[str, Any]:
        """The inverse of :meth:`from_mapping`: the settings, as a Hydra ``schedule`` group and a cost
        table's file hold them (``hop_costs`` is a plan's, not a setting)."""
        return {key: getattr(self, key) for key in _SPEC_KEYS}

    @property
    def effective_sub_batches(self) -> int:
        """Sub-batches the schedule really runs: ``sub_batches`` for a sub-batched
        schedule (split_overlap, oases), 1 for the others.  The one place this rule lives."""
        return self.sub_batches if _REGISTRY[self.name].sub_batched else 1

    @property
    def label(self) -> str:
        """The name, plus the settings when a sub-batched schedule runs non-default
        ones (``oases[sb=4,cross=0,fine=1]``); names cost tables and cache files."""
        if not _REGISTRY[self.name].sub_batched or dataclasses.replace(self, hop_costs=None) == ScheduleSpec(self.name):
            return self.name
        policies = "".join(f",{name}={'.'.join(map(str, blocks))}"
                           for name, blocks in (("store", self.stored_blocks), ("gathered", self.gathered_blocks)) if blocks)
        return (f"{self.name}[sb={self.sub_batches},cross={int(self.cross_pass)},"
                f"fine={int(self.fine_grained_recompute)}{policies}]")


# -- segments -------------------------------------------------------------------
def _cut(ops: Sequence[Op], starts: list[int], recompute: Callable[[int, int], bool], fine: bool) -> list[Segment]:
    bounds = sorted(set([0, *starts, len(ops)]))
    segs = []
    for a, b in zip(bounds, bounds[1:]):
        rec = recompute(a, b)
        tail = b
        if fine and rec and b - a >= 2 and forward_collective(ops[b - 2]) and getattr(ops[b - 1], "saves_nothing", False):
            tail = b - 1
        rec_end = tail - 1 if fine and rec and forward_collective(ops[tail - 1]) else tail
        segs.append(Segment(a, b, rec, rec_end, tail))
    return segs


def layer_segments(ops: Sequence[Op]) -> list[Segment]:
    """Megatron full recomputation: one recomputed segment per transformer layer;
    embedding and head kept (the head holds the loss and is backpropagated at once).
    A pipeline stage may hold no embedding or no head; its layers are cut the same way."""
    layers = sorted({op.layer for op in ops if op.layer >= 0 and op.block in ("attn", "mlp")})
    starts = [next(i for i, op in enumerate(ops) if op.layer == layer) for layer in layers]
    starts += [i for i, op in enumerate(ops) if op.block == "head"][:1]
    in_layer = {i for i, op in enumerate(ops) if op.block in ("attn", "mlp")}
    return _cut(ops, starts, lambda a, b: a in in_layer, fine=False)


def fine_grained_segments(ops: Sequence[Op], stored_blocks: Sequence[int] = (),
                          gathered_blocks: Sequence[int] = ()) -> list[Segment]:
    """Oases: a segment ends with each forward collective, whose output is not
    recomputed, so recomputation never re-runs a collective.  When the op right
    after the collective saves nothing for backward (``attn_out``/``mlp_out``:
    bias, keyed dropout, residual), the segment ends after it instead, with that
    op as a kept tail: the checkpoint is then the block's output ``(x',)``, not
    the pair ``(x, y)`` (residual and reduced output) the collective leaves.
    The last segment (through the loss) is kept, and so is the segment of each
    block in ``stored_blocks`` (policy ``store``; a segment belongs to the block
    of its first op: ``attn_in`` .. ``attn_out``, ``mlp_in`` .. ``mlp_out``, a
    reshard before the block).

    Under sequence parallelism a block's AllGather of the sequence ends a segment
    only in ``gathered_blocks`` (policy ``oases_gathered``: the gathered input is the
    next segment's checkpoint); elsewhere it stays inside the block's segment and
    its recomputation re-gathers from the ``1/t`` checkpoint."""
    gathered = set(gathered_blocks)
    starts = []
    for i, op in enumerate(ops):
        if sequence_gather(op) and block_index(op.layer, op.block) not in gathered:
            continue
        if forward_collective(op):
            after = ops[i + 1] if i + 1 < len(ops) else None
            starts.append(i + 2 if getattr(after, "saves_nothing", False) else i + 1)
    last = max(starts)
    stored = set(stored_blocks)
    return _cut(ops, starts, lambda a, b: a < last and block_index(ops[a].layer, ops[a].block) not in stored, fine=True)


def selective_segments(ops: Sequence[Op]) -> list[Segment]:
    """Megatron selective recomputation: only the attention core is recomputed."""
    cores = [i for i, op in enumerate(ops) if op.name.endswith(".core")]
    starts = cores + [i + 1 for i in cores]
    core_set = set(cores)
    return _cut(ops, starts, lambda a, b: a in core_set, fine=False)


def schedule_segments(spec: ScheduleSpec, ops: Sequence[Op]) -> list[Segment]:
    """The segments ``spec``'s schedule cuts ``ops`` into: the one choice
    :func:`build_schedule` runs and the memory models (profiler, analytic costs) count."""
    return _REGISTRY[_checked(spec).name].segments(ops, spec)


def held_inputs(ops: Sequence[Op], segs: Sequence[Segment]) -> list[int]:
    """Ops whose input tuple stays alive from forward to backward, increasing.

    A recomputed segment keeps only its first op's input (the checkpoint Recompute
    restarts from); a segment with nothing to recompute (a lone forward collective)
    keeps none.  A kept segment's compute ops keep theirs in the autograd graph,
    except a kept tail's: its ops save nothing (``ComputeOp.saves_nothing``), and
    its output is the next segment's checkpoint.  The transient working set of a
    recompute is not counted: it lives for one segment, not the whole step.
    """
    covered: set[int] = set()
    held = []
    for seg in segs:
        if seg.recompute:
            covered.update(range(seg.start, seg.end))
            if seg.recompute_end > seg.start:
                held.append(seg.start)
    held += [i for i, op in enumerate(ops) if i not in covered and not isinstance(op, CommOp)]
    return sorted(held)


# -- per-sub-batch streams ------------------------------------------------------
def _forward_stream(ops: Sequence[Op], segs: list[Segment], sub: int) -> list[_Item]:
    out: list[_Item] = []
    for seg in segs:
        for i in range(seg.start, seg.end):
            if forward_collective(ops[i]):
                out.append(_Comm(i, sub, "forward"))
            else:
                keep = (not seg.recompute or i >= seg.tail_start) and not isinstance(ops[i], CommOp)
                out.append(Forward(i, sub, keep_graph=keep))
    return out


def _recompute_stream(ops: Sequence[Op], seg: Segment, sub: int) -> list[_Item]:
    if not seg.recompute:
        return []
    return [
        _Comm(i, sub, "recompute") if forward_collective(ops[i]) else Recompute(i, sub)
        for i in range(seg.start, seg.recompute_end)
    ]


def _backward_stream(ops: Sequence[Op], seg: Segment, sub: int) -> list[_Item]:
    return [
        _Comm(i, sub, "backward") if backward_collective(ops[i]) else Backward(i, sub)
        for i in reversed(range(seg.start, seg.end))
    ]


# -- merge ----------------------------------------------------------------------
def merge(streams: Sequence[Sequence[_Item]], light: Callable[[int], bool] | None = None,
          gates: Mapping[tuple[int, int], tuple[int, int]] | None = None,
          continues: Callable[[Instruction], bool] | None = None) -> list[Instruction]:
    """Interleave sub-batch streams, switching sub-batch at every collective.

    A sub-batch runs until it reaches a collective, starts it and yields; when
    its turn comes again it first syncs that collective.  With one stream this
    degenerates to synchronous collectives (StartAsync immediately followed by
    Sync).  Every collective is synced before the merge returns (a barrier).

    ``light(op)``: whether an op is elementwise (:attr:`~oases_ds.models.ops.ComputeOp.light`).
    Given, before each heavy op of one sub-batch, another sub-batch whose collective has
    had a heavy op's time since it started and whose next work up to its next collective
    is light only *hops in*: it syncs, runs that light work and starts the collective,
    then the heavy op goes on.  Why: under sequence parallelism a block ends with a
    ReduceScatter and the next begins with an AllGather, with only a norm between; switching
    at collectives alone leaves one of the two with nothing but that norm to hide behind.
    The generators pass ``light`` only for a sequence-parallel operator sequence; every other
    keeps the merge it was planned, profiled and measured with.  ``continues(item)``: a heavy item that
    continues the one before it in its stream (a chunk of one computation after its first,
    :attr:`~oases_ds.models.ops.ComputeOp.continues`; in a backward, the chunks run last first) is
    neither a point to hop in nor a heavy op's time for this rule: the chunks merge as the
    computation did whole.

    ``gates[(j, p)] = (i, q)``: stream ``j`` emits its item ``p`` only once stream ``i`` has emitted
    its first ``q`` items; until then ``j`` yields as at a collective.  Why: a step that runs several
    micro-batches as one merge (:func:`micro_batch_merge`) must start a micro-batch's backward only
    after its forward, which another stream runs.  A gate no stream can open is an error.
    """
    out: list[Instruction] = []
    pos = [0] * len(streams)
    pending: list[_Comm | None] = [None] * len(streams)
    started = [0] * len(streams)  # heavy ops emitted when each pending collective started
    heavy = 0
    active = [sub for sub, s in enumerate(streams) if s]

    def hop_run(sub: int) -> int | None:
        """Items of ``sub`` up to and including its next collective, if all before it are light and no
        gate before it is closed (a hop must not step over one)."""
        stream, end = streams[sub], pos[sub]
        while end < len(stream) and not isinstance(stream[end], _Comm):
            if not light(stream[end].op) or closed(sub, end):  # type: ignore[misc]
                return None
            end += 1
        return end if end < len(stream) and not closed(sub, end) else None

    def hops(running: int) -> None:
        for sub in active:
            if sub == running or pending[sub] is None or started[sub] == heavy:
                continue
            end = hop_run(sub)
            if end is None:
                continue
            c = pending[sub]
            out.append(Sync(c.op, c.sub, c.phase))
            out.extend(streams[sub][pos[sub]:end])  # type: ignore[arg-type]
            nxt = streams[sub][end]
            out.append(StartAsync(nxt.op, nxt.sub, nxt.phase))  # type: ignore[union-attr]
            pending[sub], started[sub], pos[sub] = nxt, heavy, end + 1  # type: ignore[assignment]

    gates = gates or {}

    def closed(sub: int, at: int | None = None) -> bool:
        """Whether ``sub``'s item ``at`` (default: its next) waits on a gate still closed."""
        gate = gates.get((sub, pos[sub] if at is None else at))
        return gate is not None and pos[gate[0]] < gate[1]

    while active:
        moved = False
        for sub in list(active):
            if pending[sub] is not None:
                c = pending[sub]
                out.append(Sync(c.op, c.sub, c.phase))
                pending[sub] = None
                moved = True
            stream = streams[sub]
            while pos[sub] < len(stream):
                if closed(sub):
                    break
                moved = True
                item = stream[pos[sub]]
                if isinstance(item, _Comm):
                    pos[sub] += 1
                    out.append(StartAsync(item.op, item.sub, item.phase))
                    pending[sub], started[sub] = item, heavy
                    break
                if light is not None and not light(item.op) and not (continues is not None and continues(item)):
                    hops(sub)  # before this item counts as emitted: a gate waiting on it stays closed
                    heavy += 1
                pos[sub] += 1
                out.append(item)
            if pos[sub] >= len(stream) and pending[sub] is None:
                active.remove(sub)
        if not moved:
            raise ValueError(f"merge: every stream waits on a gate no stream can open: "
                             f"{[(sub, pos[sub]) for sub in active][:4]}")
    return out


def _light_rule(ops: Sequence[Op]) -> Callable[[int], bool] | None:
    """The merge's ``light`` test: hops only under sequence parallelism, where they are needed; every
    other sequence keeps the merge it was planned, profiled and measured with (a reshard's collective
    can follow a light op too)."""
    def marked(i: int) -> bool:
        return bool(getattr(ops[i], "light", False))

    return marked if any(sequence_gather(op) for op in ops) else None


def _continues_rule(ops: Sequence[Op]) -> Callable[[Instruction], bool]:
    """The merge's ``continues`` test: the item's op continues the one before it
    (:attr:`~oases_ds.models.ops.ComputeOp.continues`), or in a backward, which runs the chunks
    last first, the op after it continues this one."""
    def marked(item: Instruction) -> bool:
        if isinstance(item, Backward):
            return item.op + 1 < len(ops) and bool(getattr(ops[item.op + 1], "continues", False))
        return bool(getattr(ops[item.op], "continues", False))
    return marked


def _backward_pass(ops: Sequence[Op], segs: list[Segment], sub: int) -> list[_Item]:
    """One sub-batch's recomputation and backward, last segment first (the cross-pass stream's tail)."""
    out: list[_Item] = []
    for seg in reversed(segs):
        out += _recompute_stream(ops, seg, sub) + _backward_stream(ops, seg, sub)
    return out


def _passes(ops: Sequence[Op], segs: list[Segment], subs: int, cross_pass: bool,
            hop_costs: HopCosts | None = None) -> list[Instruction]:
    light, continues = _light_rule(ops), _continues_rule(ops)

    def merged(streams: list[list[_Item]]) -> list[Instruction]:
        if light is None or hop_costs is None or len(streams) < 2:
            return merge(streams, light, continues=continues)
        return costed_merge(streams, light, ops, hop_costs, lambda: merge(streams, light, continues=continues))

    if cross_pass:
        return merged([_forward_stream(ops, segs, sub) + _backward_pass(ops, segs, sub) for sub in range(subs)])
    out = merged([_forward_stream(ops, segs, sub) for sub in range(subs)])
    for seg in reversed(segs):
        out += merged([_recompute_stream(ops, seg, sub) for sub in range(subs)])
        out += merged([_backward_stream(ops, seg, sub) for sub in range(subs)])
    return out


def overlap_refusal(schedule: str, cross_pass: bool, stages: int) -> str | None:
    """Why ``overlap_micro_batches`` cannot run with this schedule and stage count (one line naming the
    fields and the fix), or ``None``: the one check the config, the pipeline builder and the merge share."""
    if stages > 1:
        return (f"overlap_micro_batches=true runs the micro-batches of one stage; with pipeline_stages={stages} "
                f"the pipeline order overlaps them: turn it off")
    if schedule != "oases" or not cross_pass:
        return (f"overlap_micro_batches=true merges micro-batches with the cross-pass oases schedule, not "
                f"schedule={schedule} with cross_pass={str(cross_pass).lower()}; set schedule=oases and "
                f"cross_pass=true, or turn it off")
    return None


def micro_batch_merge(spec: ScheduleSpec, ops: Sequence[Op], micro_batches: int) -> list[tuple[int, Instruction]]:
    """One step of ``micro_batches`` micro-batches as one cross-pass merge: ``(micro-batch, instruction)``
    in order, each micro-batch's forward running under the previous one's recomputation and backward.

    Why: where the link is as slow as the compute, a micro-batch's forward is link-bound (half the
    step's traffic under a quarter of its compute, with recomputation) and its backward compute-bound;
    two sub-batches of one micro-batch cannot mix the two, since a sub-batch's backward needs its whole
    forward.  With gradient accumulation the next micro-batch's forward can.  Each sub-batch ``s`` gets
    two streams, merged round-robin (:func:`merge`)::

        lane A   F0.s  B0.s        B1.s        B2.s  ...  B(M-1).s
        lane B         F1.s        F2.s        F3.s  ...
                 (F(m+1).s starts once B(m).s has; B(m).s waits for F(m).s)

    so each sub-batch lane holds at most two micro-batches (the forward of one, the backward of the
    other): at most ``2 k`` sub-batches' activations live.  (The lanes of different sub-batches drift
    apart by a little: sub-batch 0 may begin micro-batch ``m + 2`` while sub-batch 1 still ends ``m``.)
    The cross-pass merge of one micro-batch (its forward's tail under its backward's head) is kept, and
    one micro-batch is exactly the ``oases`` schedule.  Gradients are sums over micro-batches, whatever the
    order.  Only the cross-pass ``oases`` schedule is merged so (the others define their passes apart).
    """
    spec = _checked(spec)
    refused = overlap_refusal(spec.name, spec.cross_pass, 1)
    if refused:
        raise ValueError(refused)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if not ops or not getattr(ops[-1], "is_loss", False):
        raise ValueError("operator sequence must end with the loss operator")
    segs = schedule_segments(spec, ops)
    k = spec.effective_sub_batches

    def relabelled(items: list[_Item], micro: int) -> list[_Item]:  # a sub-batch id unique per micro-batch
        return [dataclasses.replace(item, sub=micro * k + item.sub) for item in items]

    forward = [_forward_stream(ops, segs, s) for s in range(k)]
    backward = [_backward_pass(ops, segs, s) for s in range(k)]
    f_len, b_len = len(forward[0]), len(backward[0])
    lane_a = [relabelled(forward[s], 0) + [item for m in range(micro_batches) for item in relabelled(backward[s], m)]
              for s in range(k)]
    lane_b = [[item for m in range(1, micro_batches) for item in relabelled(forward[s], m)] for s in range(k)]
    gates: dict[tuple[int, int], tuple[int, int]] = {}
    for s in range(k):
        a, b = s, k + s
        for m in range(1, micro_batches):
            gates[(b, (m - 1) * f_len)] = (a, f_len + (m - 1) * b_len)  # F(m) starts once B(m-1) has
            gates[(a, f_len + m * b_len)] = (b, m * f_len)  # B(m) waits for the end of F(m)
    merged = merge(lane_a + lane_b, _light_rule(ops), gates, _continues_rule(ops))
    return [(ins.sub // k, dataclasses.replace(ins, sub=ins.sub % k)) for ins in merged]


# -- the schedules --------------------------------------------------------------
def _checked(spec: ScheduleSpec) -> ScheduleSpec:
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"expected a ScheduleSpec such as ScheduleSpec({spec!r}), got {type(spec).__name__} {spec!r}")
    return spec


def build_schedule(spec: ScheduleSpec, ops: Sequence[Op], ends_with_loss: bool = True) -> Schedule:
    """The instruction list of ``spec``'s schedule over ``ops`` (the registered generators below).

    ``ends_with_loss=False``: ``ops`` are a pipeline stage before the last, whose output
    is sent on and whose backward starts from the gradient received for it
    (:mod:`oases_ds.schedule.pipeline` adds the transfers).

    ``none``                no recomputation, one batch, synchronous collectives.
    ``megatron``            full per-layer recomputation, synchronous; the recompute
                            re-runs each forward AllReduce (3 per block per step).
    ``megatron_selective``  only the attention core recomputed, synchronous.
    ``split_overlap``       Merak-like: ``sub_batches`` pipelined within each pass,
                            per-layer recomputation, barriers between passes.
    ``oases``               cross-pass schedule with fine-grained recomputation;
                            ``cross_pass`` / ``fine_grained_recompute`` switch each off.
    """
    entry = _REGISTRY[_checked(spec).name]
    if not ops or bool(getattr(ops[-1], "is_loss", False)) != ends_with_loss:
        raise ValueError("operator sequence must end with the loss operator" if ends_with_loss else
                         "a pipeline stage before the last must not hold the loss operator")
    return entry.generate(ops, entry.segments(ops, spec), spec)


@register_schedule("none", segments=lambda ops, spec: [Segment(0, len(ops), False, len(ops))], closed_form=BLOCKING)
def _none(ops: Sequence[Op], segs: list[Segment], spec: ScheduleSpec) -> Schedule:
    return Schedule(spec.name, tuple(_passes(ops, segs, 1, True)), 1, True)


@register_schedule("megatron", segments=lambda ops, spec: layer_segments(ops), closed_form=BLOCKING_RECOMPUTE)
def _megatron(ops: Sequence[Op], segs: list[Segment], spec: ScheduleSpec) -> Schedule:
    return Schedule(spec.name, tuple(_passes(ops, segs, 1, True)), 1, False)


@register_schedule("megatron_selective", segments=lambda ops, spec: selective_segments(ops), closed_form=BLOCKING)
def _megatron_selective(ops: Sequence[Op], segs: list[Segment], spec: ScheduleSpec) -> Schedule:
    return Schedule(spec.name, tuple(_passes(ops, segs, 1, True)), 1, False)


@register_schedule("split_overlap", segments=lambda ops, spec: layer_segments(ops), sub_batched=True,
                   closed_form=SPLIT_OVERLAP)
def _split_overlap(ops: Sequence[Op], segs: list[Segment], spec: ScheduleSpec) -> Schedule:
    subs = spec.effective_sub_batches
    return Schedule(spec.name, tuple(_passes(ops, segs, subs, False, spec.hop_costs)), subs, False)


def _oases_segments(ops: Sequence[Op], spec: ScheduleSpec) -> list[Segment]:
    if spec.fine_grained_recompute:
        return fine_grained_segments(ops, spec.stored_blocks, spec.gathered_blocks)
    return layer_segments(ops)


@register_schedule("oases", segments=_oases_segments, sub_batched=True, closed_form=OASES)
def _oases(ops: Sequence[Op], segs: list[Segment], spec: ScheduleSpec) -> Schedule:
    subs = spec.effective_sub_batches
    return Schedule(spec.name, tuple(_passes(ops, segs, subs, spec.cross_pass, spec.hop_costs)), subs,
                    spec.fine_grained_recompute, spec.stored_blocks, spec.gathered_blocks)


SCHEDULES = registered_schedules()
"""The built-in schedules, in the order the paper compares them."""
