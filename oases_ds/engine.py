"""``OasesEngine``: a DeepSpeedEngine whose training step runs through the executor.

Like DeepSpeed's ``PipelineEngine`` it owns the whole step (``train_batch``),
because the Oases schedule interleaves forward, recompute and backward of two
sub-batches -- there is no single ``loss`` tensor to hand to
``engine.backward``.  Everything else stays DeepSpeed's: data-parallel gradient
reduction (over the mpu's DP group only; where it can, the engine's own, overlapped
with the schedule, see below), gradient clipping, optimizer and LR scheduler step,
ZeRO-1/2 partitioning, optimizer offload, bf16 master weights, gradient-accumulation boundaries,
``global_steps``, checkpoints.

How the executor's gradients enter DeepSpeed: the executor computes this
micro-batch's parameter gradients ``g`` on its own (any previously accumulated
``.grad`` is stashed and put back), then ``engine.backward`` runs on the
surrogate ``sum_p <p, g_p>``, whose gradient is exactly ``g``.  So DeepSpeed's
backward hooks, gradient-accumulation scaling and reductions see one ordinary
backward per micro-batch, at the cost of one multiply-add per parameter.

Except on the last micro-batch of an accumulation window
(:meth:`OasesEngine._overlapped_dp_reducer`): there DeepSpeed's reduction would
run after the schedule, fully exposed, so a
:class:`~oases_ds.runtime.dp_overlap.DPGradReducer` hooked into the executor
instead starts each block's DP AllReduce as soon as the block's last Backward has
run, folds the micro-batch into the accumulated gradient (``1/gas``, as DeepSpeed
scales) and leaves the DP mean in ``.grad``; the surrogate backward is skipped.
With ZeRO 0, ``step`` then clips and updates from ``.grad`` as usual (in bf16 through
DeepSpeed's wrapper that keeps fp32 master weights).
With ZeRO-1 (fp32, or bf16 parameters with fp32 master weights) DeepSpeed's
optimizer runs its own backward epilogue with nothing left to reduce
(:meth:`OasesEngine._hand_reduced_grads_to_zero`): it copies this rank's partition
of the reduced ``.grad`` into its averaged gradients, exactly what its reduction
would have left there, and ``step`` clips (global norm over DP and TMP) and
updates the partition.  ZeRO-2 and offload keep DeepSpeed's reducer after the schedule
(its ZeRO-2 gradient hooks paused while the schedule runs: :meth:`OasesEngine._zero2_hooks_paused`).
``"dp_overlap": false`` keeps DeepSpeed's reducer; fp16
and bf16 parameters with fp32 gradient accumulation (DeepSpeed's ``BF16_Optimizer``)
keep it too.

DeepSpeed internals relied on (tested with deepspeed==0.19.8):
``DeepSpeedEngine._backward_prologue`` / ``_backward_prologue_per_tensor`` and
``deepspeed.runtime.utils.register_output_backward_hooks`` (what
``DeepSpeedEngine.forward`` registers on a loss), ``DeepSpeedZeroOptimizer``'s
``setup_buckets`` / ``overlapping_partition_gradients_reduce_epilogue`` and its
``ipg_buckets`` (to hand it reduced gradients), ``save_checkpoint``'s
``save_latest`` flag (to publish a checkpoint only once it is complete), and the
``checkpoint_engine`` attribute every checkpoint read goes through (replaced by
:class:`~oases_ds.checkpoint.SafeCheckpointEngine`); with pipeline stages,
``set_gradient_accumulation_boundary`` (``None`` restores the counter) and the
``micro_steps`` counter (see :meth:`OasesEngine._run_pipeline`).

What the engine refuses instead of doing silently wrong:

* DeepSpeed's own loop, ``loss = engine(batch); engine.backward(loss);
  engine.step()``, would train without the Oases schedule (eager collectives,
  no sub-batches, no fine-grained recomputation) while looking like it works.
  ``backward`` and ``step`` are refused outside ``train_batch``, and so is
  ``engine(batch)`` in training mode with autograd on.  Unlike DeepSpeed's
  ``PipelineEngine``, which refuses ``forward`` outright, ``engine(batch)`` stays
  allowed for evaluation (``engine.eval()`` or ``torch.no_grad()``): it runs
  the model's eager forward on the shards, which is exact, and scripts written
  for a plain DeepSpeedEngine evaluate that way.
* A non-finite loss raises :class:`NonFiniteLossError` naming the optimizer
  step that produced it, checked on the step's loss after its DP reduction (the
  one host sync a step has anyway, not one per micro-batch).
* A micro-batch without a labelled token (its mean loss would be 0/0) is refused
  before the step runs, by one check per step on the labels as the data loader
  delivered them (:func:`~oases_ds.models.operator_model.check_labelled_tokens`).
  The per-micro-batch loop itself never reads a tensor back to the host: the token
  count and loss scale stay on the device, timings are clock marks resolved after
  the loop (CUDA events on a GPU, see :mod:`oases_ds.runtime.timeline`).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import warnings
from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE, DeepSpeedEngine
from deepspeed.runtime.utils import register_output_backward_hooks
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from oases_ds.checkpoint import portable as portable_state
from oases_ds.checkpoint import (STAGING_SUFFIX, CheckpointError, CheckpointMeta, SafeCheckpointEngine, check_complete,
                                 check_rank_files, check_save_tag, prune, publish, read_latest)
from oases_ds.config import Collective, OasesConfig, OasesConfigError, activation_all_reduce, slow_link_message
from oases_ds.models.operator_model import OperatorModel, check_labelled_tokens
from oases_ds.parallel.collectives import group_size
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.guard import batch_signature, check_collectives_from_env
from oases_ds.parallel.context import ParallelContext
from oases_ds.planner.plan import Plan
from oases_ds.runtime.dp_overlap import DPGradReducer
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.pipeline import PipelineExecutor, StageLinks
from oases_ds.runtime.timeline import clock_for, exposed_by_phase_of
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.schedule.pipeline import OVERLAP

TESTED_DEEPSPEED = ">=0.19.8,<0.20"
HANDOFF_BUCKET_ELEMENTS = 1024
"""Staging buffer of DeepSpeed's ZeRO-1 optimizer on a step whose gradients the overlapped
reducer reduces (:meth:`OasesEngine._small_zero_buckets`): it stages nothing then."""
USE_TRAIN_BATCH = ("OasesEngine runs forward, backward and step as one schedule: call engine.train_batch(batch) instead "
                   "of engine(batch)/engine.backward(loss)/engine.step() (engine(batch) is fine for evaluation, after "
                   "engine.eval() or under torch.no_grad())")


def planned_schedule(oases: OasesConfig, prefix: str = "oases.") -> ScheduleSpec:
    """``oases.schedule_spec()`` storing the blocks ``oases.plan`` gives policy ``store``
    (:meth:`Plan.stored_blocks <oases_ds.planner.plan.Plan.stored_blocks>`), at the plan's sub-batches
    where it records them (:attr:`Plan.sub_batches`), its hops ordered by the times it was priced
    with where it carries them (:attr:`Plan.hop_costs`): what the executor runs.
    A plan that stores blocks under a schedule that cannot store them is an
    :class:`OasesConfigError` naming both and the fix (``prefix``: how it names the plan key,
    ``oases.`` in a DeepSpeed JSON, nothing on the ``oases-train`` line)."""
    spec = oases.schedule_spec()
    if not oases.plan:
        return spec
    try:
        plan = Plan.read(f"{prefix}plan", oases.plan)
    except ValueError as err:  # names the setting already
        raise OasesConfigError(str(err)) from None
    stored, gathered = plan.stored_blocks(), plan.gathered_blocks()
    for blocks, policy, what in ((stored, "store", "stores {} blocks' activations"),
                                 (gathered, "oases_gathered", "keeps the gathered input of {} blocks")):
        if blocks and not (spec.name == "oases" and spec.fine_grained_recompute):
            raise OasesConfigError(f"{prefix}plan={oases.plan} {what.format(len(blocks))} (policy {policy}), "
                                   f"which only schedule=oases with fine_grained_recompute=true runs; this run has "
                                   f"schedule={spec.name}, fine_grained_recompute={str(spec.fine_grained_recompute).lower()}: "
                                   f"use that schedule or a plan without {policy} policies")
    sub_batches = plan.sub_batches or spec.sub_batches  # the plan was chosen at its own sub-batches: they run
    # and its hops in the order its replay priced (sequence parallelism; None otherwise)
    return replace(spec, stored_blocks=stored, gathered_blocks=gathered, sub_batches=sub_batches,
                   hop_costs=plan.hop_costs)


def overridden_sub_batches(oases: OasesConfig, spec: ScheduleSpec) -> str | None:
    """One line saying the plan's sub-batches replace the configured ones, where they differ (else None)."""
    if spec.sub_batches == oases.sub_batches:
        return None
    return (f"plan={oases.plan} was chosen at sub_batches={spec.sub_batches} (oases-plan planner.sub_batches); "
            f"running it so, not at the configured sub_batches={oases.sub_batches}")


class BatchMismatchError(ValueError):
    """Ranks of one TMP group were handed different batches (:meth:`OasesEngine._check_tmp_batch`)."""


class NonFiniteLossError(FloatingPointError):
    """A training step's loss is NaN or infinite; the message names the optimizer step."""


class OasesEngine(DeepSpeedEngine):
    """DeepSpeedEngine that trains an :class:`OperatorModel` with an Oases schedule."""

    _oases_in_train_batch = False  # a class default: DeepSpeedEngine.__init__ runs before ours sets it

    def __init__(self, *args: Any, oases: OasesConfig, parallel_context: ParallelContext, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_engine = self._safe_checkpoint_engine()
        if not isinstance(self.module, OperatorModel):
            raise TypeError("OasesEngine needs an oases_ds OperatorModel (pass a ModelConfig to oases_ds.initialize)")
        self.oases = oases
        self.parallel_context = parallel_context
        model = self.module
        link = oases.link.model() if oases.link else None
        self._sharded_params = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
        # every plan group on every rank before the first step (a no-op after OperatorModel.for_plan),
        # then sealed: a group some rank asks for later would hang NCCL (ParallelContext)
        parallel_context.create_plan_groups([lay.degree for pair in model.sharding.layouts for lay in pair])
        self.pipelined = parallel_context.pp_size > 1
        # all micro-batches of a step through one schedule: pipeline stages, or one stage's overlapped merge
        # (with one micro-batch per step nothing overlaps: the plain executor, with its overlapped DP reduction)
        self.step_schedule = self.pipelined or (oases.overlap_micro_batches and self.gradient_accumulation_steps() > 1)
        # One communicator for the schedule, the model's eager forward (evaluation) and the step's
        # metrics: one flight record of the rank, one guard (oases.check_collectives or $OASES_CHECK_COLLECTIVES).
        try:
            check = check_collectives_from_env(oases.check_collectives)
        except ValueError as err:
            raise OasesConfigError(str(err)) from None
        if check and self.pipelined and "nccl" in str(dist.get_backend()).lower():
            # its pipeline signatures travel under their own message tag, which NCCL ignores
            raise OasesConfigError("oases.check_collectives=true with pipeline_stages > 1 needs gloo (NCCL matches "
                                   "point-to-point messages by order, not tag); turn it off, or debug the stages on CPU")
        comm = Communicator.for_run(link, oases.flight_records, check)
        model.comm = comm
        spec = planned_schedule(oases)
        overridden = overridden_sub_batches(oases, spec)
        if overridden and dist.get_rank() == 0:
            warnings.warn(overridden, RuntimeWarning, stacklevel=2)
        if self.step_schedule:  # all micro-batches of a step through one pipeline schedule
            self.executor = PipelineExecutor.for_pipeline(
                model, spec, oases.pipeline_schedule if self.pipelined else OVERLAP,
                self.gradient_accumulation_steps(),
                StageLinks.of(parallel_context), link, model.rng, record=oases.record_timeline, comm=comm)
        else:
            self.executor = Executor.for_schedule(model, spec, link, model.rng, record=oases.record_timeline, comm=comm)
        self.schedule = self.executor.schedule
        self.oases_comm = self.executor.comm
        self.last_stats: dict[str, Any] = {}
        self._oases_data_iter: Iterator | None = None
        self.dp_reducer = self._overlapped_dp_reducer()
        if self.dp_reducer is not None:
            self.executor.add_hook(self.dp_reducer)
        if oases.link is not None and dist.get_rank() == 0:
            message = slow_link_message(oases.link.model(), oases.process_group_timeout_s, self._largest_collectives())
            if message:
                warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _largest_collectives(self) -> list[Collective]:
        """The biggest collective of each kind a training step issues: the TMP activation
        AllReduce (priced from the config, as ``oases-train`` prices it before launching);
        a replica group of a plan sums a block's gradients; DeepSpeed sums the gradients over
        the DP group in buckets (not held to the emulated link, but on a real link of that
        speed it would cross it).  The last two need the built model and DeepSpeed's buckets,
        so only the engine checks them."""
        model, ctx, cfg = self.module, self.parallel_context, self.module.cfg
        element = next(model.parameters()).element_size()
        out = [activation_all_reduce(cfg, self.train_micro_batch_size_per_gpu(), self.schedule.sub_batches, ctx.tp_size,
                                     element)]
        for params, group in model.sharding.replica_groups(model.layers):
            out.append(Collective("replica gradient AllReduce", "all_reduce", sum(p.numel() for p in params) * element,
                                  group_size(group)))
        bucket = self.zero_reduce_bucket_size() if self.zero_optimization_stage() else MEMORY_OPT_ALLREDUCE_SIZE
        grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
        dp_bytes = min(grads, int(bucket)) * torch.empty((), dtype=self.communication_data_type).element_size()
        out.append(Collective("DP gradient AllReduce", "all_reduce", dp_bytes, ctx.dp_size))
        return out

    def _overlapped_dp_reducer(self) -> DPGradReducer | None:
        """The per-block DP reduction overlapped with the schedule, where it reproduces
        DeepSpeed's reduction exactly: gradients averaged over DP without a pre-division
        factor, communicated in the gradients' dtype, DeepSpeed counting the micro-batches,
        and an optimizer that takes them as they are -- ZeRO 0 in fp32 or bf16 (the
        optimizer, or DeepSpeed's bf16 wrapper, reads ``.grad``) or DeepSpeed's ZeRO-1
        optimizer in fp32 or bf16 without fp32 gradient accumulation, offload or MoE
        (:meth:`_zero1_takes_reduced_grads`).  Elsewhere (``oases.dp_overlap`` off, fp16,
        DeepSpeed's ``BF16_Optimizer``) DeepSpeed's own reducer runs after the schedule;
        ``None`` then, and with one DP rank."""
        dtype = next(self.module.parameters()).dtype
        if (not self.oases.dp_overlap or self.parallel_context.dp_size == 1 or self.step_schedule
                or self.fp16_enabled()
                or not self.gradient_average or self.gradient_predivide_factor() != 1.0
                or self.communication_data_type != dtype
                or not self.managed_gradient_accumulation()):  # unmanaged: DeepSpeed's step() reduces itself
            return None
        if self.zero_optimization_stage() == 0:
            if isinstance(self.optimizer, ZeROOptimizer):  # BF16_Optimizer: its own fp32 gradient buffers
                return None
            predivide = not self.postscale_gradients()  # DeepSpeedEngine.allreduce_bucket: 1/dp after the sum by default
        elif self._zero1_takes_reduced_grads():
            # its average_tensor divides before reducing; its AllReduce route (reduce_scatter off) after, by default
            predivide = self.optimizer.reduce_scatter or not self.postscale_gradients()
        else:
            return None
        ctx = self.parallel_context
        reducer = DPGradReducer(self.module, self.schedule, self.oases_comm, ctx.dp_group,
                                replica_dp_group=ctx.replica_dp_group, predivide=predivide)
        self.executor.sum_replica_grads = False  # folded into the reducer's AllReduce at the boundary
        return reducer

    @contextlib.contextmanager
    def _zero2_hooks_paused(self) -> Iterator[None]:
        """DeepSpeed's ZeRO-2 optimizer without its gradient hooks while the schedule runs.

        ZeRO-2 reduce-scatters each gradient from a hook that fires as autograd accumulates
        it into ``.grad``; the executor's own per-operator backward would fire it inside the
        schedule (a tied weight twice, DeepSpeed then refusing the second reduction), and the
        hook would take away ``.grad`` the schedule still accumulates into.  So the hooks are
        removed for the schedule and registered again before the surrogate backward, whose
        single pass per parameter is the one backward DeepSpeed expects to reduce."""
        opt = self.optimizer
        if not (isinstance(opt, DeepSpeedZeroOptimizer) and opt.partition_gradients):
            yield
            return
        for handle in opt._grad_acc_hooks:
            handle.remove()
        opt._grad_acc_hooks = []
        try:
            yield
        finally:
            opt.create_gradient_handling_hooks()

    def _zero1_takes_reduced_grads(self) -> bool:
        """Whether the optimizer is DeepSpeed's ZeRO-1 optimizer in the mode whose
        boundary reduction reads the parameters' ``.grad`` and leaves them in place
        (:meth:`_hand_reduced_grads_to_zero` relies on it): no gradient partitioning,
        overlap_comm, CPU offload, separate accumulation dtype or MoE groups."""
        opt = self.optimizer
        return (self.zero_optimization_stage() == 1 and isinstance(opt, DeepSpeedZeroOptimizer)
                and not (opt.partition_gradients or opt.overlap_comm or opt.cpu_offload or opt.use_grad_accum_attribute
                         or opt.has_moe_layers))

    def _hand_reduced_grads_to_zero(self) -> None:
        """Give DeepSpeed's ZeRO-1 optimizer the DP-mean gradients the reducer left in
        ``.grad``: its backward epilogue, run with empty reduction buckets, copies this
        rank's partition of them into its averaged gradients and drops ``.grad`` --
        what its own reduction would have done after communicating.  The buckets are
        checked empty first: a gradient queued there would be reduced a second time."""
        opt = self.optimizer
        queued = sum(bucket.elements for bucket in opt.ipg_buckets.values())
        if queued:
            raise RuntimeError(f"DeepSpeed's ZeRO-1 optimizer has {queued} gradient elements queued for reduction at the "
                               "boundary; the overlapped DP reduction would reduce them twice (set oases.dp_overlap=false)")
        opt.set_gradient_accumulation_boundary(True)
        opt.setup_buckets()  # what its gradient hooks do before a reduction (empty staging buffers)
        opt.overlapping_partition_gradients_reduce_epilogue()

    @contextlib.contextmanager
    def _small_zero_buckets(self) -> Iterator[None]:
        """DeepSpeed's ZeRO-1 optimizer with staging buffers of :data:`HANDOFF_BUCKET_ELEMENTS`.

        Its gradient hooks allocate a ``reduce_bucket_size`` buffer (5e8 elements by default: 1 GiB
        per rank in bf16, 2 in fp32) as soon as a gradient lands, in the schedule's backward too,
        though on a step the overlapped reducer reduces nothing is staged there; the caching
        allocator would keep that memory reserved, outside the planner's count."""
        opt = self.optimizer
        size = opt.reduce_bucket_size
        opt.reduce_bucket_size = HANDOFF_BUCKET_ELEMENTS
        try:
            yield
        finally:
            opt.reduce_bucket_size = size

    def _safe_checkpoint_engine(self) -> SafeCheckpointEngine:
        """DeepSpeed's default engine with a load that cannot run code; the others
        (``checkpoint.writer``, DataStates) load with ``weights_only=False`` too, so
        they are refused rather than silently left unsafe."""
        if type(self.checkpoint_engine) is not TorchCheckpointEngine:
            raise OasesConfigError(f"{type(self.checkpoint_engine).__name__} is not supported with oases (its load can run "
                                   "code from a checkpoint); remove checkpoint.writer / datastates from the config")
        return SafeCheckpointEngine(self._config)

    # -- the training step -------------------------------------------------------
    def train_batch(self, batch: dict[str, torch.Tensor] | None = None, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step: ``gradient_accumulation_steps`` micro-batches through the
        schedule, then DeepSpeed's reduction and update.  Returns the loss averaged
        over micro-batches and DP ranks.

        Args:
            batch: this rank's ``{"tokens", "labels"}`` for the whole step
                (micro-batch size x accumulation steps samples), or
            data_iter: an iterator of micro-batches (default: the engine's
                training data loader, if one was given to ``initialize``).
        """
        self._oases_in_train_batch = True
        try:
            return self._train_batch(batch, data_iter)
        finally:
            self._oases_in_train_batch = False

    def _train_batch(self, batch: dict[str, torch.Tensor] | None, data_iter: Iterator | None) -> torch.Tensor:
        gas, micro = self.gradient_accumulation_steps(), self.train_micro_batch_size_per_gpu()
        micro_batches = self._micro_batches(batch, data_iter, gas, micro)
        ctx = self.parallel_context
        self.module.train()
        self.module.rng.step = self.global_steps  # dropout keys follow the checkpointed step count
        self.oases_comm.stats.reset()
        self.oases_comm.step = self.global_steps + 1  # the step the flight records name (1-based)
        check_labelled_tokens(micro_batches)  # once per step, on the labels as delivered (see its docstring)
        if self.oases.check_batch:
            self._check_tmp_batch(micro_batches)
        clock = clock_for(self.device)
        start = clock.mark()
        # non_blocking: a blocking host-to-device copy waits for the device's queue
        micro_batches = [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]
        losses, timelines, tokens = [], [], 0
        skipped_before = self.skipped_steps
        self.executor.grad_scale = self.current_loss_scale()
        if self.step_schedule:
            losses.append(self._run_pipeline(micro_batches, gas, micro))
            timelines.append(self.executor.timeline)
            tokens = sum(mb["tokens"].numel() for mb in micro_batches)
        for acc, mb in enumerate([] if self.step_schedule else micro_batches):
            offset = (acc * ctx.dp_size + ctx.dp_rank) * micro
            losses.append(self._run_schedule(mb, offset, gas * ctx.dp_size * micro))
            timelines.append(self.executor.timeline)  # read after the loop: on CUDA reading waits for the device
            tokens += mb["tokens"].numel()
            self.step()
        loss = self.oases_comm.all_reduce(torch.stack(losses).mean().float(), ctx.dp_group, "metrics",
                                          label="step loss").wait() / ctx.dp_size
        begun, ended = clock.resolve([start, clock.mark()])
        elapsed = ended - begun
        dp_wait = self.dp_reducer.wait_s if self.dp_reducer is not None else 0.0  # the window's one boundary (arm resets it)
        # every wait, by where: one pass over each timeline
        by_phase = {"optimizer boundary": dp_wait, **exposed_by_phase_of(timelines)}
        exposed = sum(by_phase.values())
        stats = self.oases_comm.stats
        link_s = sum(s for phase, s in stats.link_s.items() if phase != "eval")
        self.last_stats = {
            "loss": float(loss),
            "step_s": elapsed,
            "tokens_per_s": tokens * ctx.dp_size / elapsed,
            # the schedule's TMP collectives; the DP gradient reduction (grad_sync) has its own count
            "tmp_bytes": float(sum(b for (phase, _), b in stats.bytes.items()
                                   if phase not in ("loss", "pipeline", "eval", "grad_sync"))),
            "dp_bytes": float(stats.bytes_in("grad_sync")),
            "pipeline_bytes": float(stats.bytes_in("pipeline")),
            "exposed_comm_s": exposed,
            "exposed_comm_frac": exposed / elapsed,
            "exposed_by_phase_s": by_phase,
            # The physical limit of the step (issue 43): it can be no shorter than its work without
            # any wait, nor than its traffic's time on the emulated link (0 without emulation).
            "compute_only_s": elapsed - exposed,
            "link_s": link_s,
            "limit_s": max(elapsed - exposed, link_s),
            "emulated_link": float(self.oases_comm.emulated),
            "loss_scale": self.executor.grad_scale,  # the step's own (DeepSpeed's step may have changed it since)
            "skipped": float(self.skipped_steps > skipped_before),
        }
        # float(loss) above was the step's one host sync.  An fp16 step whose gradients overflowed
        # was skipped on every rank (DeepSpeed's check reduces over TMP x PP; DP's sum spreads an
        # inf): its weights are unchanged and trustworthy, the loss scale already lowered.
        if not math.isfinite(self.last_stats["loss"]) and not self.last_stats["skipped"]:
            raise NonFiniteLossError(
                f"loss is {self.last_stats['loss']} at optimizer step {self.global_steps} (1-based, engine.global_steps): "
                "lower the learning rate, set gradient_clipping, or check the data; the weights are no longer trustworthy, "
                "resume from a checkpoint saved before it"
            )
        return loss

    def _check_tmp_batch(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Every rank of this TMP group was handed the same step (``oases.check_batch``).

        Why: TMP ranks compute one model on one batch; a loader seeded or sharded by the
        global rank instead of the DP rank hands them different samples, and the collectives
        then add partial results of different batches: training goes on, on garbage, with no
        error.  Megatron avoids it by broadcasting each batch in the TP group; here each rank
        hashes what it was given (keys, shapes, dtypes, bytes; on the host, before the batch
        moves: a batch already on the GPU, as Lightning hands it, is copied back for it, a few
        hundred KiB of token ids) and one all-gather of 8 bytes per rank compares the hashes.
        Its read-back is a host sync at the step's start, while the device is idle (the
        previous step ended on its loss).  Counted as ``metrics``, not as the schedule's TMP traffic."""
        group = self.module.group
        if group_size(group) == 1:
            return
        digest = hashlib.blake2b(" | ".join(batch_signature(mb) for mb in micro_batches).encode(), digest_size=7)
        mine = torch.tensor([int.from_bytes(digest.digest(), "big")], dtype=torch.int64, device=self.device)
        held = self.oases_comm.all_gather(mine, group, 0, "metrics", label="batch check").wait().tolist()
        if len(set(held)) > 1:
            ranks = dist.get_process_group_ranks(group)
            other = [r for r, h in zip(ranks, held) if h != held[0]]
            raise BatchMismatchError(
                f"the ranks of TMP group {ranks} were handed different batches at optimizer step {self.global_steps + 1} "
                f"(1-based): rank {other[0]} holds another batch than rank {ranks[0]}; every rank of a TMP group must get "
                "the samples of its DP rank: seed or shard the data loader by engine.parallel_context.dp_rank, not the "
                "global rank (oases.check_batch=false turns this check off)")

    # -- DeepSpeed's own loop, refused (see the module docstring) --------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.module.training and torch.is_grad_enabled() and not self._oases_in_train_batch:
            raise RuntimeError(USE_TRAIN_BATCH)
        return super().forward(*inputs, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._oases_in_train_batch:
            raise RuntimeError(USE_TRAIN_BATCH)
        return super().backward(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._oases_in_train_batch:
            raise RuntimeError(USE_TRAIN_BATCH)
        self._mark_sharded_grads()
        return super().step(*args, **kwargs)

    def current_loss_scale(self) -> float:
        """fp16's current loss scale (DeepSpeed's dynamic or static scaler, at ZeRO 0, 1 or 2);
        1.0 in fp32 and bf16, which need none.  The executor seeds the loss's backward with it
        (:attr:`~oases_ds.runtime.executor.Executor.grad_scale`)."""
        return float(self.optimizer.loss_scale) if self.fp16_enabled() else 1.0

    def _mark_sharded_grads(self) -> None:
        """Give each TMP-sharded parameter's gradient the parameter's ``tensor_model_parallel``
        mark.  DeepSpeed 0.19.8's bf16 ZeRO-0 optimizer (``FP16_UnfusedOptimizer``) computes the
        clipping norm with ``get_weight_norm`` over the *gradient* tensors and, on TMP ranks > 0,
        skips every tensor without the mark as a replica: unmarked, it dropped those ranks'
        shards from the norm (measured 1.47 where the true norm was 1.64 at TMP 2) and clipped
        too little.  Marking is idempotent and changes nothing where the norm reads parameters."""
        for p in self._sharded_params:  # fixed by the model: listed once in __init__
            if p.grad is not None:
                p.grad.tensor_model_parallel = True  # type: ignore[attr-defined]

    def _run_schedule(self, batch: dict[str, torch.Tensor], offset: int, global_batch: int) -> torch.Tensor:
        params, accumulated = self._stash_grads()
        if self.dp_reducer is not None and self.is_gradient_accumulation_boundary():
            # The schedule's hooks reduce each block over DP as its backward ends; DeepSpeed's
            # backward (gas scaling + reduction) is replaced by the reducer's fold, 1/gas each.
            zero = isinstance(self.optimizer, ZeROOptimizer)
            if zero:
                self.optimizer.clear_backward_seen_flag()  # what DeepSpeedEngine.forward does
            self.dp_reducer.arm(list(zip(params, accumulated)), 1.0 / self.gradient_accumulation_steps())
            with self._small_zero_buckets() if zero else contextlib.nullcontext():
                try:
                    loss = self.executor.run(batch, sample_offset=offset, global_batch=global_batch)
                except BaseException:
                    self.dp_reducer.abandon()  # the next step starts disarmed; the error is the user's news
                    raise
                self.dp_reducer.finish()
                if zero:
                    self._hand_reduced_grads_to_zero()
            return loss
        with self._zero2_hooks_paused():
            loss = self.executor.run(batch, sample_offset=offset, global_batch=global_batch)
        self.backward(self._surrogate(params, accumulated, "the schedule produced no parameter gradient; is the "
                                                           "model's loss connected to its parameters?"))
        return loss

    def _stash_grads(self) -> tuple[list[torch.nn.Parameter], list[torch.Tensor | None]]:
        """The trainable parameters and their accumulated ``.grad``, which is cleared so the
        schedule leaves exactly this run's gradients there."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        accumulated = [p.grad for p in params]
        for p in params:
            p.grad = None
        return params, accumulated

    def _surrogate(self, params: list[torch.nn.Parameter], accumulated: list[torch.Tensor | None],
                   no_grad_message: str) -> torch.Tensor:
        """Hand the schedule's gradients ``g`` (in ``.grad``) to DeepSpeed: put the accumulated
        ones back and return ``sum_p <p, g_p>``, whose backward through ``self.backward`` is
        exactly ``g`` (module docstring), with the hooks DeepSpeed's forward would register."""
        grads = [p.grad for p in params]
        for p, g in zip(params, accumulated):
            p.grad = g
        if isinstance(self.optimizer, ZeROOptimizer):
            self.optimizer.clear_backward_seen_flag()  # what DeepSpeedEngine.forward does
        if all(g is None for g in grads):
            raise RuntimeError(no_grad_message)
        if self.executor.grad_scale == 1.0:
            surrogate = sum((p * g).sum() for p, g in zip(params, grads) if g is not None)
        else:  # fp16: g is already scaled (in fp32, so the surrogate's value cannot overflow)
            surrogate = sum((p.float() * g.float()).sum() for p, g in zip(params, grads) if g is not None)
            if isinstance(self.optimizer, ZeROOptimizer):
                # DeepSpeed 0.19.8's engine.backward scales the loss for its ZeRO optimizers only
                # (scale_if_loss); its ZeRO-0 FP16_UnfusedOptimizer gets the loss unscaled and
                # divides by the scale in step(), so there g must arrive as scaled as it is.
                surrogate = surrogate / self.executor.grad_scale
        register_output_backward_hooks(
            surrogate, preprocess_once_fn=self._backward_prologue, preprocess_per_tensor_fn=self._backward_prologue_per_tensor
        )
        return surrogate

    def _run_pipeline(self, micro_batches: list[dict[str, torch.Tensor]], gas: int, micro: int) -> torch.Tensor:
        """One step's micro-batches through the stage's pipeline schedule, then DeepSpeed's
        reduction and update as for ``gas`` accumulated micro-batches.

        The schedule leaves the sum of the micro-batches' gradients ``g``; one surrogate
        backward ``sum_p <p, g_p>`` at a forced accumulation boundary hands it to
        DeepSpeed, whose backward scales it by ``1/gas`` (as it scales each micro-batch's
        loss) and reduces it over DP; ``micro_steps`` is advanced by the ``gas - 1``
        micro-batches it did not see one by one, so its counters read as without stages.
        Returns the step's mean loss (the last stage's, on every stage)."""
        ctx = self.parallel_context
        params, accumulated = self._stash_grads()
        offsets = [(acc * ctx.dp_size + ctx.dp_rank) * micro for acc in range(gas)]
        with self._zero2_hooks_paused():
            loss = self.executor.run_step(micro_batches, offsets, gas * ctx.dp_size * micro)
        surrogate = self._surrogate(params, accumulated, "the pipeline schedule produced no parameter gradient on this stage")
        self.micro_steps += gas - 1
        self.set_gradient_accumulation_boundary(True)
        try:
            self.backward(surrogate)
            self.step()
        finally:
            self.set_gradient_accumulation_boundary(None)  # None: back to DeepSpeed's own counting
        return loss

    def _micro_batches(self, batch, data_iter, gas: int, micro: int) -> list[dict[str, torch.Tensor]]:
        if batch is not None:
            n = batch["tokens"].shape[0]
            if n != gas * micro:
                raise ValueError(
                    f"train_batch got {n} samples on this rank; expected train_micro_batch_size_per_gpu x "
                    f"gradient_accumulation_steps = {micro} x {gas} = {micro * gas}"
                )
            return [{k: v[i * micro : (i + 1) * micro] for k, v in batch.items()} for i in range(gas)]
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch needs a batch, a data_iter, or training_data given to initialize")
            if self._oases_data_iter is None:
                self._oases_data_iter = iter(RepeatingLoader(self.training_dataloader))
            data_iter = self._oases_data_iter
        return [next(data_iter) for _ in range(gas)]

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss without dropout, averaged over DP ranks."""
        was_training = self.module.training
        self.module.eval()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        loss = self.executor.evaluate(batch) if self.pipelined else self.module(batch)
        self.module.train(was_training)
        return self.oases_comm.all_reduce(loss.float(), self.parallel_context.dp_group, "metrics",
                                          label="eval loss").wait() / self.parallel_context.dp_size

    # -- checkpoints ---------------------------------------------------------------
    def checkpoint_meta(self) -> CheckpointMeta:
        """What a checkpoint of this engine must match to be loaded by it."""
        degrees = [layout.degree for pair in self.module.sharding.layouts for layout in pair]
        precision = "bf16" if self.bfloat16_enabled() else "fp16" if self.fp16_enabled() else "fp32"
        return CheckpointMeta.build(self.module.cfg, self.parallel_context.tp_size, degrees, precision,
                                    self.zero_optimization_stage(), self.parallel_context.dp_size,
                                    [len(s.layers) for s in self.oases.stages(self.module.cfg.num_layers)])

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False,
                        keep: int = 0):
        """DeepSpeed's checkpoint (TMP shards by mp rank, ZeRO states by DP rank), staged
        under ``<tag>.partial`` and published by rank 0 once every rank finished
        (:func:`oases_ds.checkpoint.publish`: ``latest`` names a complete checkpoint at
        every instant, re-saves included).  ``keep > 0`` then removes all but the
        newest ``keep`` checkpoints (never the one ``latest`` names).  Ranks on several
        nodes need a shared filesystem: rank 0 does the renames."""
        if keep < 0:
            raise CheckpointError(f"keep must be >= 0 (0 keeps all), got {keep}")
        tag = check_save_tag(str(tag if tag is not None else f"global_step{self.global_steps}"))
        staged = os.path.join(save_dir, f"{tag}{STAGING_SUFFIX}")
        if dist.get_rank() == 0:
            shutil.rmtree(staged, ignore_errors=True)  # a leftover of an interrupted save
        dist.barrier()
        ok = super().save_checkpoint(save_dir, os.path.basename(staged), client_state or {}, save_latest=False,
                                     exclude_frozen_parameters=exclude_frozen_parameters)
        error = None
        if self.oases.portable_checkpoint:  # collective; a failure on any rank is raised on all
            try:
                portable_state.save(self, staged, client_state)
            except portable_state.PortableStateError as err:
                error = f"saving the portable state of checkpoint {os.path.join(save_dir, tag)} failed: {err}"
        dist.barrier()
        if dist.get_rank() == 0 and error is None:
            try:
                replace(self.checkpoint_meta(), portable=self.oases.portable_checkpoint,
                        global_steps=self.global_steps).write(staged)
                publish(save_dir, tag, staged, save_latest)
                prune(save_dir, keep)
            except OSError as err:
                error = f"saving checkpoint {os.path.join(save_dir, tag)} failed: {err}"
        self._agree_or_raise(error)
        return ok

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load, after checks it lacks: the tag (from ``latest`` or given) is
        a plain name of a completed checkpoint under ``load_dir``, and its
        ``oases_meta.json`` matches this engine; files are unpickled without running
        code (:class:`~oases_ds.checkpoint.SafeCheckpointEngine`).  A failure on any rank
        is raised on every rank, so none is left waiting in a later collective.
        Without a ``latest`` file it returns ``(None, None)`` as DeepSpeed does."""
        if tag is None:
            tag = read_latest(load_dir)
            if tag is None:
                return super().load_checkpoint(load_dir, None)  # DeepSpeed's warning and (None, None)
        else:
            tag = check_complete(load_dir, str(tag))
        tag_dir = os.path.join(load_dir, tag)
        saved, optimizer_states = CheckpointMeta.read(tag_dir), load_optimizer_states and not load_module_only
        route = saved.load_route(tag_dir, self.checkpoint_meta(), optimizer_states=optimizer_states)
        # every rank sees the same files: all raise alike
        check_rank_files(load_dir, tag, saved, optimizer_states, portable=route == "portable")
        result, error = (None, None), None
        try:
            if route == "portable":  # another layout: each rank narrows the full values to its shards
                client = portable_state.load(self, tag_dir, optimizer_states, load_lr_scheduler_states, load_module_only)
                result = (os.path.join(tag_dir, portable_state.PORTABLE_DIR), client)
            else:
                result = super().load_checkpoint(load_dir, tag, load_module_strict=load_module_strict,
                                                 load_optimizer_states=load_optimizer_states,
                                                 load_lr_scheduler_states=load_lr_scheduler_states,
                                                 load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        except (CheckpointError, portable_state.PortableStateError) as err:
            error = str(err)
        self._agree_or_raise(error)
        return result

    def _agree_or_raise(self, error: str | None) -> None:
        """Every rank learns the first rank's error (by rank order) and raises it."""
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e), None)
        if first:
            raise CheckpointError(first)

    def save_trace(self, path: str) -> None:
        """Chrome/Perfetto trace of the last micro-batch's schedule on this rank."""
        self.executor.timeline.save_chrome_trace(path, dist.get_rank())

