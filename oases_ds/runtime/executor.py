"""Runs a schedule's instruction stream over an operator sequence.

The executor knows nothing about schedules: it maps each instruction type to a
handler (as DeepSpeed's PipelineEngine does) and keeps the per-(op, sub-batch)
buffers the instructions read and write.  Computation runs on the calling
thread; collectives are started asynchronously and waited for at Sync, so they
progress on the process group's own thread (gloo) or stream (NCCL) while the
other sub-batch computes.

Every operator runs under its own small autograd graph: its inputs enter through
grad taps (:class:`_GradTap`: the gradient arrives in a slot, no input is kept
alive that autograd did not save), its outputs are handed on detached.  Backward of an operator is
``autograd.backward(outputs, output_grads)`` and yields the input gradients,
which is what lets the schedule put a collective -- or another sub-batch's work --
between any two operators.  A buffer is freed right after its last read
(:func:`~oases_ds.schedule.dataflow.last_reads`), so a recomputing schedule
really holds only its checkpoints.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Literal, Mapping

import torch

from oases_ds.models.operator_model import IGNORE_INDEX, OperatorModel
from oases_ds.models.ops import Acts, CommOp, OpContext
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.grads import all_reduce_grads
from oases_ds.parallel.link import LinkModel
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.timeline import Timeline, clock_for, op_label
from oases_ds.schedule.checker import check
from oases_ds.schedule.dataflow import last_reads, unread_recomputes
from oases_ds.schedule.generators import Schedule, ScheduleSpec, build_schedule
from oases_ds.schedule.instructions import Backward, Forward, Instruction, Recompute, StartAsync, Sync


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` along dim 0 into ``parts`` equal sub-batches."""
    size = batch["tokens"].shape[0]
    if size % parts:
        raise ValueError(
            f"oases.sub_batches={parts} does not divide the micro-batch size {size}; "
            f"use a micro-batch size that is a multiple of {parts}"
        )
    return [{k: v.chunk(parts, dim=0)[j] for k, v in batch.items()} for j in range(parts)]


HookPhase = Literal["before", "after"]
InstructionHook = Callable[[Instruction, HookPhase], None]

# Phase names in the timeline (and so in Chrome traces) per comm phase; the compute
# handlers name theirs ("fwd", "rec", "bwd").
_COMM_PHASE = {"forward": "fwd", "recompute": "rec", "backward": "bwd"}


class _GradTap(torch.autograd.Function):
    """Forward: a view of ``x`` (cut from its history); backward: stores the incoming
    gradient in ``slot`` and stops.

    Why not a detached leaf: a leaf is referenced by its gradient accumulator, so
    an operator's graph kept from forward to backward would keep every input's
    storage alive, whether or not backward needs its values (``attn_out`` needs
    none of ``y``).  Behind a tap the graph holds exactly what autograd saves.
    ``anchor`` is a shared empty tensor that requires grad, so that autograd
    records this Function although ``x`` does not require grad.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, slot: list):
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.slot[0] = grad
        return None, None, None


def _tapped(inputs: Acts, anchor: torch.Tensor) -> tuple[Acts, list[list]]:
    """The op's inputs behind grad taps (floating-point ones) and one gradient slot per input."""
    slots: list[list] = [[None] for _ in inputs]
    taps = tuple(
        _GradTap.apply(t.detach(), anchor, slot) if t.is_floating_point() else t for t, slot in zip(inputs, slots)
    )
    return taps, slots


class Executor:
    """Executes one schedule on one model; reusable across steps.

    Args:
        model: the operator model (this rank's shards).
        schedule: instruction list from :func:`~oases_ds.schedule.generators.build_schedule`
            (:meth:`for_schedule` builds and checks it from a spec).
        comm: communicator (accounting, flight records, optional guard mode and link emulation).
        rng: dropout key source, advanced by the caller once per optimizer step.
        record: keep a timeline of every instruction.
    """

    def __init__(
        self,
        model: OperatorModel,
        schedule: Schedule,
        comm: Communicator | None = None,
        rng: RNGTracker | None = None,
        record: bool = True,
    ) -> None:
        self.model = model
        self.ops = model.ops
        self.schedule = schedule
        self.comm = comm or Communicator()
        self.rng = rng or RNGTracker()
        self.record = record
        self.timeline = Timeline()
        self._frees = last_reads(schedule.instructions, self.ops)
        self._empties: dict[tuple, torch.Tensor] = {}  # _release_values' shared empty tensors
        self.unread_recomputes = unread_recomputes(schedule.instructions, self.ops, self._frees)
        """Recomputes whose output no instruction reads (:func:`~oases_ds.schedule.dataflow.unread_recomputes`).
        They run with ``OpContext.outputs_needed`` off: an op marked ``graph_only_recompute``
        builds only the graph its Backward needs (no output GEMM)."""
        self._labels = [op_label(op.name, op.layer, op.block) for op in self.ops]
        self._comm_labels = {(i, phase): f"{op.name} {short}" for i, op in enumerate(self.ops) if isinstance(op, CommOp)
                             for phase, short in _COMM_PHASE.items()}
        self._record_tag = ""  # the pipeline executor prefixes its micro-batch ("mb3 ")
        self._is_comm = [isinstance(op, CommOp) for op in self.ops]
        self._hooks: list[InstructionHook] = []
        self._replica_groups = model.sharding.replica_groups(model.layers)  # fixed by the plan: derive once, not per micro-batch
        self._sequence_parallel_params = model.sequence_parallel_params()
        self.sum_replica_grads = True
        """Complete replica blocks' gradients at the end of :meth:`run`; a caller that sums
        them later itself (the DP reducer folds the sum into its AllReduce at the
        accumulation boundary, which is exact because both sums are linear) turns it off."""
        self.grad_scale = 1.0
        """The seed of the loss's backward: fp16's dynamic loss scale, which the engine sets
        from DeepSpeed's scaler before each run, so every gradient the schedule computes in
        fp16 is ``grad_scale`` times the true one (small gradients stay above fp16's
        underflow) and DeepSpeed's optimizer unscales, checks for overflow and skips."""
        self._handlers: dict[type, Callable[[Instruction], None]] = {
            Forward: self._forward,
            Recompute: self._recompute,
            Backward: self._backward,
            StartAsync: self._start,
            Sync: self._sync,
        }
        self._buffers: dict[tuple, object] = {}
        self._ctx: list[OpContext] = []
        self._rng_states: dict[tuple[int, int], tuple[int, int]] = {}
        self._losses: list[torch.Tensor] = []
        self._anchor = torch.empty(0, requires_grad=True)  # see _GradTap

    @classmethod
    def for_schedule(
        cls,
        model: OperatorModel,
        spec: ScheduleSpec,
        link: LinkModel | None = None,
        rng: RNGTracker | None = None,
        record: bool = True,
        comm: Communicator | None = None,
    ) -> Executor:
        """The executor of ``spec``'s schedule over ``model``: build the schedule, prove it
        with the invariant checker (a broken schedule would deadlock or read garbage;
        checking is pure and costs far less than one step), and give it ``comm`` or a
        communicator on ``link`` (``None``: the real link as it is)."""
        schedule = build_schedule(spec, model.ops)
        check(schedule, model.ops)
        return cls(model, schedule, comm or Communicator(link), rng, record)

    # -- public ------------------------------------------------------------------
    def add_hook(self, hook: InstructionHook) -> Callable[[], None]:
        """Call ``hook(instruction, "before")`` and ``hook(instruction, "after")`` around
        every instruction of every later :meth:`run`, in schedule order; returns a
        function that removes it.

        Why a hook: measurements that must see the executor between instructions
        (peak activation memory, custom tracing) would otherwise wrap its private
        handler table.  ``"after"`` comes once the instruction's outputs are in
        :attr:`buffers` and before the buffers it read for the last time are freed,
        so it sees the instruction's high-water mark.  A hook that raises aborts the run.
        """
        self._hooks.append(hook)

        def remove() -> None:
            if hook in self._hooks:
                self._hooks.remove(hook)

        return remove

    @property
    def buffers(self) -> Mapping[tuple, object]:
        """Read-only view of the live buffers (activations, graphs, gradients, collectives
        in flight), keyed like the schedule's dataflow; for hooks that measure memory.  A graph
        buffer's outputs that are not views hold no values (:func:`_release_values`)."""
        return MappingProxyType(self._buffers)

    def run(self, batch: dict[str, torch.Tensor], sample_offset: int = 0, global_batch: int | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch; parameter ``.grad`` accumulates.

        Args:
            batch: "tokens" and "labels" (b, s) for this rank (identical on all TMP
                ranks of a group).
            sample_offset / global_batch: where this micro-batch sits in the step's
                global batch (keys dropout; default: this rank alone).
        Returns the micro-batch's mean loss (detached).
        """
        self.comm.check_batch(batch, self.model.group)  # guard mode only: the TMP ranks hold one batch
        self._prepare(batch, sample_offset, global_batch)
        handlers, hooks, buffers = self._handlers, self._hooks, self._buffers
        for ins, frees in zip(self.schedule.instructions, self._frees):  # the hot loop: see benchmarks/host_overhead.py
            if hooks:
                for hook in hooks:
                    hook(ins, "before")
            handlers[type(ins)](ins)
            if hooks:
                for hook in hooks:
                    hook(ins, "after")
            for buf in frees:
                buffers.pop(buf, None)
        leftover = list(self._buffers)
        self._buffers.clear()
        if leftover:
            raise RuntimeError(f"schedule left buffers alive: {leftover[:4]}")
        self._sum_sequence_parallel_grads()
        if self.sum_replica_grads:
            self._sum_replica_grads()
        self.comm.check_step()  # guard mode only: every group's records agree before anything else runs
        return torch.stack(self._losses).sum()

    def _sum_sequence_parallel_grads(self) -> None:
        """Under sequence parallelism each TMP rank computed the gradient of a norm, a
        row-parallel bias or the positions on its slice of the sequence: one flat AllReduce
        over the TMP group completes them (Megatron sums them after backward the same way).
        Once per run, on the run's own gradient: the engine stashes what earlier
        micro-batches accumulated, so nothing is summed twice."""
        if self._sequence_parallel_params:
            all_reduce_grads(self._sequence_parallel_params, self.comm, self.model.group, label="sequence-parallel grads")

    def _sum_replica_grads(self) -> None:
        """Blocks planned below the full TMP degree ran as several replicas, each on its
        share of the batch: their gradients are partial sums, completed here (one
        flat AllReduce per replica group)."""
        for params, group in self._replica_groups:
            all_reduce_grads(params, self.comm, group, label="replica grads")

    # -- set-up --------------------------------------------------------------------
    def _prepare(self, batch, sample_offset, global_batch) -> list[OpContext]:
        parts = self.schedule.sub_batches
        subs = split_batch(batch, parts)
        b = batch["tokens"].shape[0]
        replicas = self.model.sharding.max_replicas
        seq, degree = batch["tokens"].shape[1], self.model.sharding.full_degree
        if self.model.sequence_parallel and seq % degree:
            raise ValueError(f"sequence_parallel splits the sequence over the {degree} TMP ranks but this batch's sequence "
                             f"has {seq} tokens; pad or cut batches to a multiple of {degree} or set sequence_parallel=false")
        if (b // parts) % replicas:
            raise ValueError(
                f"a sub-batch of {b // parts} samples cannot be shared by the {replicas} replicas of the plan's "
                f"lowest-degree block; use a micro-batch size divisible by sub_batches x {replicas} = {parts * replicas}"
            )
        # The token count stays a tensor on the batch's device: int() here would make the host wait
        # for the device once per micro-batch.  An all-ignored batch is refused before the step
        # (OasesEngine, through check_labelled_tokens), not here; run directly, it gives a NaN loss.
        tokens = (batch["labels"] != IGNORE_INDEX).sum()
        loss_scale = tokens.to(torch.float32).reciprocal()
        self.timeline = Timeline(clock_for(batch["tokens"].device))  # a fresh one: a caller may still read the last
        self._ctx = [
            OpContext(
                batch=sub,
                sample_offset=sample_offset + j * (b // parts),
                global_batch=global_batch or b,
                loss_scale=loss_scale,
                rng=self.rng,
                comm=self.comm,
                training=True,  # evaluation goes through OperatorModel.forward
            )
            for j, sub in enumerate(subs)
        ]
        self._buffers = {("act", 0, sub): () for sub in range(parts)}
        self._losses = []
        self._rng_states = {}
        return self._ctx

    # -- handlers ------------------------------------------------------------------
    # Each compute handler times itself inline (no closure per instruction) and hands the
    # timeline the instruction, whose name is formatted only when the timeline is read.
    def _run_compute(self, ins: Instruction, keep_graph: bool, phase: str) -> None:
        op = self.ops[ins.op]
        buffers = self._buffers
        inputs = buffers[("act", ins.op, ins.sub)]
        if self._is_comm[ins.op]:  # identity in this direction
            buffers[("act", ins.op + 1, ins.sub)] = inputs
            return
        ctx = self._ctx[ins.sub]
        ctx.phase = phase
        ctx.outputs_needed = not (phase == "recompute" and ins in self.unread_recomputes)
        key = (ins.op, ins.sub)
        if phase == "forward":
            self._rng_states[key] = self.rng.capture()
        else:  # replay exactly the dropout its forward saw
            saved = self.rng.capture()
            self.rng.restore(self._rng_states[key])
        if keep_graph:
            with torch.enable_grad():
                taps, slots = _tapped(inputs, self._anchor)
                outputs = op.fn(ctx, taps)
            del taps  # the graph alone decides which input values stay alive
            self._buffers[("graph", ins.op, ins.sub)] = (slots, outputs)
            passed = tuple(t.detach() for t in outputs)
            if not op.is_loss:
                _release_values(outputs, self._empties)
        else:
            with torch.no_grad():
                passed = op.fn(ctx, inputs)
        if phase != "forward":
            self.rng.restore(saved)
        if op.is_loss and phase == "forward":
            self._losses.append(passed[0].detach())
        self._buffers[("act", ins.op + 1, ins.sub)] = passed

    def _forward(self, ins: Forward) -> None:
        if not self.record:
            return self._run_compute(ins, ins.keep_graph, "forward")
        t0 = self.timeline.clock.mark()
        self._run_compute(ins, ins.keep_graph, "forward")
        self._record_compute(ins, t0, "fwd")

    def _recompute(self, ins: Recompute) -> None:
        if not self.record:
            return self._run_compute(ins, True, "recompute")
        t0 = self.timeline.clock.mark()
        self._run_compute(ins, True, "recompute")
        self._record_compute(ins, t0, "rec")

    def _backward(self, ins: Backward) -> None:
        if not self.record:
            return self._run_backward(ins)
        t0 = self.timeline.clock.mark()
        self._run_backward(ins)
        self._record_compute(ins, t0, "bwd")

    def _record_compute(self, ins: Instruction, t0, phase: str) -> None:
        timeline = self.timeline
        timeline.add(ins, "compute", ins.sub, t0, timeline.clock.mark(), self._labels[ins.op], phase)

    def _run_backward(self, ins: Backward) -> None:
        op = self.ops[ins.op]
        if self._is_comm[ins.op]:
            self._buffers[("grad", ins.op, ins.sub)] = self._buffers[("grad", ins.op + 1, ins.sub)]
            return
        slots, outputs = self._buffers[("graph", ins.op, ins.sub)]
        if op.is_loss:
            loss = outputs[0]
            torch.autograd.backward(loss, None if self.grad_scale == 1.0 else torch.full_like(loss, self.grad_scale))
        else:
            grads = self._buffers[("grad", ins.op + 1, ins.sub)]
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
            if pairs:
                _backward_from(tuple(o for o, _ in pairs), tuple(g for _, g in pairs))
        self._buffers[("grad", ins.op, ins.sub)] = tuple(slot[0] for slot in slots)

    def _start(self, ins: StartAsync) -> None:
        op = self.ops[ins.op]
        assert isinstance(op, CommOp)
        t0 = self.timeline.clock.mark() if self.record else None  # before the issue: the collective cannot start earlier
        src = ("grad", ins.op + 1, ins.sub) if ins.phase == "backward" else ("act", ins.op, ins.sub)
        acts = self._buffers[src]
        direction = "backward" if ins.phase == "backward" else "forward"
        pending = op.start(self.comm, acts[op.index], direction, ins.phase,
                           f"{self._record_tag}{self._comm_labels[ins.op, ins.phase]} sb{ins.sub}")
        self._buffers[("comm", ins.op, ins.sub, ins.phase)] = (pending, acts, t0)

    def _wait_timed(self, ins: Instruction, pending, started, comm_name: str, label: str, phase: str) -> torch.Tensor:
        """``pending.wait()``; when recording, the wait goes on the ``wait`` lane (exposed
        communication) and the transfer, from ``started`` to its end, on the ``comm`` lane."""
        if not self.record:
            return pending.wait()
        clock = self.timeline.clock
        t0 = clock.mark()
        result = pending.wait()
        t1 = clock.mark()  # on CUDA: fires once the compute stream may go on, i.e. the transfer is done
        self.timeline.add(ins, "wait", ins.sub, t0, t1, label, phase)
        self.timeline.add(comm_name, "comm", ins.sub, started, t1, label, phase)
        return result

    def _sync(self, ins: Sync) -> None:
        op = self.ops[ins.op]
        pending, acts, started = self._buffers[("comm", ins.op, ins.sub, ins.phase)]
        result = self._wait_timed(ins, pending, started, f"C{ins.op}.{ins.sub}:{ins.phase}", self._labels[ins.op],
                                  _COMM_PHASE[ins.phase])
        dst = ("grad", ins.op, ins.sub) if ins.phase == "backward" else ("act", ins.op + 1, ins.sub)
        self._buffers[dst] = _replace(acts, op.index, result)


def _release_values(outputs: Acts, empties: dict[tuple, torch.Tensor]) -> None:
    """Let the graph's own copies of an op's new outputs stop holding their values.

    The op's Backward needs only each output's place in the graph (``grad_fn``), not its
    values; the values live on in the detached twins handed to the next ops, and in whatever
    autograd saved, for exactly as long as those need them.  Without this the graph buffer kept
    every new output until the op's own backward: a row-parallel product after its AllReduce
    was consumed, an MLP half's output after the other half's backward freed it (Megatron-LM
    frees pipeline outputs the same way, ``deallocate_output_tensor``).  A view is left as it is
    (its base would stay alive through it anyway).  :func:`_backward_from` calls torch's engine
    directly, which takes an output whose values are gone.  An op must not return a tensor that
    autograd also saves (no op here does): its backward would find the values gone and stop with a
    size error.  ``empties``: one empty tensor per (dtype, device), shared, so releasing allocates
    nothing per op."""
    for t in outputs:
        if t.grad_fn is not None and t._base is None:
            key = (t.dtype, t.device)
            empty = empties.get(key)
            if empty is None:
                empty = empties[key] = torch.empty(0, dtype=t.dtype, device=t.device)
            t.data = empty


def _backward_from(outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> None:
    """``torch.autograd.backward(outputs, grads)`` without its argument checks.

    Each gradient here is the one autograd computed for the next op's input, the detached
    twin of ``outputs``, so shapes and dtypes match by construction; the public function's
    ``_make_grads`` checks them again through symbolic-shape comparisons, a tenth of the host
    time of a step of small ops (``benchmarks/host_overhead.py``).  torch's own engine call
    (``torch.autograd.graph._engine_run_backward``, private, tested with torch 2.13; in older
    torch the engine method it wraps) takes them as they are.  It is also what lets an output
    whose values :func:`_release_values` released stand for its place in the graph: the engine
    checks a gradient against the shape the graph recorded, not against the output's values."""
    _ENGINE_RUN_BACKWARD(outputs, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


_ENGINE_RUN_BACKWARD = (getattr(torch.autograd.graph, "_engine_run_backward", None)
                        or torch.autograd.Variable._execution_engine.run_backward)  # what it wraps, in older torch


def _replace(acts: Acts, index: int, value: torch.Tensor) -> Acts:
    return acts[:index] + (value,) + acts[index + 1 :]

