"""Runs one stage's pipeline schedule: many micro-batches in flight, transfers to the neighbours.

A :class:`PipelineExecutor` is an :class:`~oases_ds.runtime.executor.Executor` whose
instructions come tagged with a micro-batch (:class:`~oases_ds.schedule.instructions.PipeStep`).
Each micro-batch in flight has its own buffers, sub-batch contexts and saved dropout
states (a :class:`_Micro`); before an instruction runs, the executor points its
handlers at that micro-batch's.  The compute and collective handlers are the plain
executor's, unchanged, so every TMP schedule runs inside a stage exactly as it runs
alone; the point-to-point handlers added here start a send or post a receive to the
neighbouring stage and wait for it at the matching ``P2PSync``: activations on the
pipeline group, gradients on the pipeline gradient group (both have the context's
timeout, so a dead stage is an error).

Two groups because NCCL executes the point-to-point operations of one communicator in
issue order on one stream: with both directions on one, 1F1B's steady state deadlocks
once a message outgrows NCCL's staging buffer (:mod:`oases_ds.schedule.pipeline`).  The
checker's NCCL model proves the two-group order for each pipeline schedule; it has
not yet run on several GPUs.

The loss exists on the last stage only; :meth:`PipelineExecutor.run` broadcasts the
step's loss over the pipeline group so that every rank reports the same number.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.collectives import Group, Pending
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.link import LinkModel
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.checker import check_pipeline
from oases_ds.schedule.dataflow import last_reads
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.schedule.instructions import (
    P2PStart,
    P2PSync,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from oases_ds.schedule.pipeline import CHANNEL, PipelineSchedule, build_pipeline


@dataclass(frozen=True)
class StageLinks:
    """Who this stage talks to, passed in (never looked up globally).

    Attributes:
        prev_rank / next_rank: global ranks of the neighbouring stages at this rank's
            (DP, TMP) coordinate; ``None`` at the ends.
        group: the pipeline group holding them, for activations and the loss broadcast
            (its timeout bounds every wait).
        last_rank: global rank of the last stage, which owns the loss.
        grad_group: the pipeline group over the same ranks for gradients (module
            docstring); ``None`` sends them on ``group``, which only gloo tolerates.
    """

    prev_rank: int | None
    next_rank: int | None
    group: Group
    last_rank: int
    grad_group: Group = None

    @classmethod
    def of(cls, ctx: ParallelContext) -> "StageLinks":
        return cls(ctx.prev_rank, ctx.next_rank, ctx.pp_group, ctx.last_stage_rank, ctx.pp_grad_group)

    def group_for(self, kind: str) -> Group:
        """The process group a transfer of ``kind`` travels on (:data:`CHANNEL`)."""
        if CHANNEL[kind] == "grad" and self.grad_group is not None:
            return self.grad_group
        return self.group


@dataclass
class _Micro:
    """What one micro-batch in flight holds on this stage."""

    buffers: dict[tuple, object]
    contexts: list
    rng_states: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    sub_batch: int = 0
    seq_len: int = 0


class PipelineExecutor(Executor):
    """Executes one stage's :class:`PipelineSchedule` on its :class:`OperatorModel`.

    Args:
        model: this stage's operator model (``model.stage`` says which).
        pipe: the stage's pipeline schedule (:meth:`for_pipeline` builds and checks it).
        links: the neighbouring ranks and the pipeline group.
        comm / rng / record: as for :class:`Executor`.
    """

    def __init__(self, model: OperatorModel, pipe: PipelineSchedule, links: StageLinks,
                 comm: Communicator | None = None, rng: RNGTracker | None = None, record: bool = True) -> None:
        super().__init__(model, pipe.body.schedule, comm, rng, record)
        if pipe.stage != model.stage.index or pipe.stages != model.stage.stages:
            raise ValueError(f"schedule of stage {pipe.stage}/{pipe.stages} given to the model of stage "
                             f"{model.stage.index}/{model.stage.stages}")
        self.pipe = pipe
        self.links = links
        self._step_frees = self._frees_per_step()
        for kind in (RecvActivation, SendActivation, RecvGrad, SendGrad):
            self._handlers[kind] = self._p2p_start
        self._handlers[P2PSync] = self._p2p_sync
        self._micros: dict[int, _Micro] = {}
        self._current: _Micro | None = None  # the micro-batch whose instruction runs now

    @classmethod
    def for_pipeline(cls, model: OperatorModel, spec: ScheduleSpec, pipeline: str, micro_batches: int,
                     links: StageLinks, link: LinkModel | None = None, rng: RNGTracker | None = None,
                     record: bool = True, comm: Communicator | None = None) -> "PipelineExecutor":
        """Build ``pipeline``'s schedule (``1f1b``, ``gpipe``, or on one stage ``overlap``: the step's
        micro-batches as one merge) with ``spec``'s TMP schedule inside, for ``model``'s stage, prove it
        with the checker, and wrap it."""
        stage = model.stage
        pipe = build_pipeline(pipeline, spec, model.ops, stage.index, stage.stages, micro_batches)
        check_pipeline(pipe, model.ops)
        return cls(model, pipe, links, comm or Communicator(link), rng, record)

    def _frees_per_step(self) -> list[list[tuple]]:
        """Buffers that die with each step: :func:`last_reads` over each micro-batch's own
        instructions (every micro-batch has its own buffers), mapped back to the steps."""
        frees: list[list[tuple]] = [[] for _ in self.pipe.steps]
        for m in range(self.pipe.micro_batches):
            index = [i for i, s in enumerate(self.pipe.steps) if s.micro == m]
            for i, dead in zip(index, last_reads([self.pipe.steps[i].ins for i in index], self.ops)):
                frees[i] = dead
        return frees

    # -- public ------------------------------------------------------------------
    def run_step(self, micro_batches: list[dict[str, torch.Tensor]], sample_offsets: list[int],
                 global_batch: int) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step; parameter
        ``.grad`` accumulates the sum of the micro-batches' mean-loss gradients (divide by
        their number for the step's mean, as DeepSpeed's accumulation does).

        Args:
            micro_batches: this rank's micro-batches (the same on every stage and TMP rank
                of a pipeline: the first stage reads the tokens, the last the labels).
            sample_offsets: each micro-batch's first sample in the step's global batch.
            global_batch: samples in the step (all micro-batches, all DP ranks).
        Returns the mean over micro-batches of their mean losses, on every stage.
        """
        if len(micro_batches) != self.pipe.micro_batches or len(sample_offsets) != len(micro_batches):
            raise ValueError(f"the pipeline schedule runs {self.pipe.micro_batches} micro-batches per step (gradient "
                             f"accumulation steps); got {len(micro_batches)} micro-batches and "
                             f"{len(sample_offsets)} offsets")
        self._micros = {}
        for m, (mb, offset) in enumerate(zip(micro_batches, sample_offsets)):
            contexts = self._prepare(mb, offset, global_batch)  # the plain executor's per-micro-batch set-up
            buffers = self._buffers if self.model.stage.is_first else {}
            self._micros[m] = _Micro(buffers, contexts, sub_batch=mb["tokens"].shape[0] // self.pipe.sub_batches,
                                     seq_len=mb["tokens"].shape[1])
        self._losses = []
        self.comm.check_batch(micro_batches[0], self.model.group)  # guard mode only: the TMP ranks hold one batch
        tags = [f"mb{m} " for m in range(len(micro_batches))]
        for idx, step in enumerate(self.pipe.steps):
            micro = self._micros[step.micro]
            self._buffers, self._ctx, self._rng_states = micro.buffers, micro.contexts, micro.rng_states
            self._current = micro
            self._record_tag = tags[step.micro]
            for hook in self._hooks:
                hook(step.ins, "before")
            self._handlers[type(step.ins)](step.ins)
            for hook in self._hooks:
                hook(step.ins, "after")
            for buf in self._step_frees[idx]:
                micro.buffers.pop(buf, None)
        leftover = [(m, b) for m, micro in self._micros.items() for b in micro.buffers]
        self._micros = {}
        self._buffers = {}
        if leftover:
            raise RuntimeError(f"pipeline schedule left buffers alive: {leftover[:4]}")
        self._record_tag = ""
        self._sum_sequence_parallel_grads()
        if self.sum_replica_grads:
            self._sum_replica_grads()
        self.comm.check_step()  # guard mode only: every group's and link's records agree
        return self._broadcast_loss(len(micro_batches))

    def run(self, batch: dict[str, torch.Tensor], sample_offset: int = 0, global_batch: int | None = None) -> torch.Tensor:
        """A one-micro-batch step (the plain executor's signature): only valid when the
        schedule runs one micro-batch."""
        return self.run_step([batch], [sample_offset], global_batch or batch["tokens"].shape[0])

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor], sample_offset: int = 0,
                 global_batch: int | None = None) -> torch.Tensor:
        """Mean loss of ``batch`` through the stages, eagerly and without a schedule: each
        stage receives its input, runs its operators (:meth:`OperatorModel.stage_forward`)
        and sends its output on; the last stage's loss is broadcast to every stage."""
        model, links = self.model, self.links
        param = next(model.parameters())
        inputs: tuple = ()
        if not model.stage.is_first:
            shape = model.boundary_shape(model.stage.start - 1, batch["tokens"].shape[0], batch["tokens"].shape[1])
            inputs = (self.comm.recv(shape, param.dtype, param.device, links.prev_rank, links.group, "eval act").wait(),)
        out = model.stage_forward(batch, inputs, sample_offset, global_batch)
        if not model.stage.is_last:
            self.comm.send(out[0], links.next_rank, links.group, "eval act").wait()
            loss = torch.zeros((), dtype=torch.float32, device=param.device)
        else:
            loss = out[0].float()
        return self.comm.broadcast(loss, links.last_rank, links.group, "metrics", "eval loss broadcast").wait()

    def _broadcast_loss(self, micro_batches: int) -> torch.Tensor:
        """The last stage's mean micro-batch loss, on every stage of the pipeline."""
        device = next(self.model.parameters()).device
        if self.model.stage.is_last:
            loss = (torch.stack(self._losses).sum() / micro_batches).float()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        return self.comm.broadcast(loss, self.links.last_rank, self.links.group, "metrics", "loss broadcast").wait()

    # -- transfers -------------------------------------------------------------------
    def _p2p_start(self, ins: P2PStart) -> None:
        micro = self._current
        links = self.links
        t0 = self.timeline.clock.mark() if self.record else None
        if ins.kind in ("send_act", "send_grad"):
            acts = self._buffers[("act" if ins.kind == "send_act" else "grad", ins.op, ins.sub)]
            if len(acts) != 1 or acts[0] is None:
                raise RuntimeError(f"{ins}: a stage boundary carries one tensor, got {len(acts)} "
                                   f"({'None' if acts and acts[0] is None else 'tuple'})")
            dst = links.next_rank if ins.kind == "send_act" else links.prev_rank
            pending: Pending = self.comm.send(acts[0], dst, links.group_for(ins.kind), self._transfer_label(ins))
        else:
            layer = self.model.stage.start - 1 if ins.kind == "recv_act" else self.model.stage.end - 1
            shape = self.model.boundary_shape(layer, micro.sub_batch, micro.seq_len)
            param = next(self.model.parameters())
            src = links.prev_rank if ins.kind == "recv_act" else links.next_rank
            pending = self.comm.recv(shape, param.dtype, param.device, src, links.group_for(ins.kind),
                                     self._transfer_label(ins))
        self._buffers[("p2p", ins.kind, ins.op, ins.sub)] = (pending, t0)

    def _transfer_label(self, ins: P2PStart) -> str:
        """The name both ends record for one message (``act mb0 sb1``): the channel, the
        micro-batch and the sub-batch, which the sender and the receiver share (their
        operator indices differ, each stage numbering its own)."""
        return f"{CHANNEL[ins.kind]} {self._record_tag}sb{ins.sub}"

    def _p2p_sync(self, ins: P2PSync) -> None:
        pending, started = self._buffers[("p2p", ins.kind, ins.op, ins.sub)]
        result = self._wait_timed(ins, pending, started, f"P{ins.op}.{ins.sub}:{ins.kind}", "pipeline." + ins.kind, "p2p")
        if ins.kind == "recv_act":
            self._buffers[("act", ins.op, ins.sub)] = (result,)
        elif ins.kind == "recv_grad":
            self._buffers[("grad", ins.op, ins.sub)] = (result,)
