"""``OasesEngine``: a DeepSpeedEngine whose training step runs through the executor.

Like DeepSpeed's ``PipelineEngine`` it owns the whole step (``train_batch``),
because the Oases schedule interleaves forward, recompute and backward of two
sub-batches -- there is no single ``loss`` tensor to hand to
``engine.backward``.  Everything else stays DeepSpeed's: data-parallel gradient
reduction (over the mpu's DP group only), gradient clipping, optimizer and LR
scheduler step, ZeRO-1 partitioning, bf16 master weights, gradient-accumulation
boundaries, ``global_steps``, checkpoints.

How the executor's gradients enter DeepSpeed: the executor computes this
micro-batch's parameter gradients ``g`` on its own (any previously accumulated
``.grad`` is stashed and put back), then ``engine.backward`` runs on the
surrogate ``sum_p <p, g_p>``, whose gradient is exactly ``g``.  So DeepSpeed's
backward hooks, gradient-accumulation scaling and reductions see one ordinary
backward per micro-batch, at the cost of one multiply-add per parameter.

DeepSpeed internals relied on (tested with deepspeed==0.19.8):
``DeepSpeedEngine._backward_prologue`` / ``_backward_prologue_per_tensor`` and
``deepspeed.runtime.utils.register_output_backward_hooks`` (what
``DeepSpeedEngine.forward`` registers on a loss), and ``save_checkpoint``'s
``save_latest`` flag (to publish a checkpoint only once it is complete).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import register_output_backward_hooks

from oases_ds.config import OasesConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.collectives import start_all_reduce
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.context import ParallelContext
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.checker import check
from oases_ds.schedule.generators import build_schedule

TESTED_DEEPSPEED = ">=0.19.8,<0.20"


class OasesEngine(DeepSpeedEngine):
    """DeepSpeedEngine that trains an :class:`OperatorModel` with an Oases schedule."""

    def __init__(self, *args: Any, oases: OasesConfig, parallel_context: ParallelContext, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, OperatorModel):
            raise TypeError("OasesEngine needs an oases_ds OperatorModel (pass a ModelConfig to oases_ds.initialize)")
        self.oases = oases
        self.parallel_context = parallel_context
        model = self.module
        self.schedule = build_schedule(oases.schedule, model.ops, oases.schedule_options())
        check(self.schedule, model.ops)
        self.oases_comm = Communicator(oases.link.model() if oases.link else None)
        self.executor = Executor(model, self.schedule, self.oases_comm, model.rng, record=oases.record_timeline)
        self.last_stats: dict[str, float] = {}
        self._oases_data_iter: Iterator | None = None

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
        gas, micro = self.gradient_accumulation_steps(), self.train_micro_batch_size_per_gpu()
        micro_batches = self._micro_batches(batch, data_iter, gas, micro)
        ctx = self.parallel_context
        self.module.train()
        self.module.rng.step = self.global_steps  # dropout keys follow the checkpointed step count
        self.oases_comm.stats.reset()
        start = time.perf_counter()
        losses, exposed, tokens = [], 0.0, 0
        for acc, mb in enumerate(micro_batches):
            mb = {k: v.to(self.device) for k, v in mb.items()}
            offset = (acc * ctx.dp_size + ctx.dp_rank) * micro
            losses.append(self._run_schedule(mb, offset, gas * ctx.dp_size * micro))
            exposed += self.executor.timeline.busy("wait")
            tokens += int(mb["tokens"].numel())
            self.step()
        loss = start_all_reduce(torch.stack(losses).mean().float(), ctx.dp_group).wait() / ctx.dp_size
        if self.device.type == "cuda":  # host timers would only see kernel launches
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        stats = self.oases_comm.stats
        self.last_stats = {
            "loss": float(loss),
            "step_s": elapsed,
            "tokens_per_s": tokens * ctx.dp_size / elapsed,
            "tmp_bytes": float(sum(b for (phase, _), b in stats.bytes.items() if phase != "loss")),
            "exposed_comm_s": exposed,
            "exposed_comm_frac": exposed / elapsed,
            "emulated_link": float(self.oases_comm.emulated),
        }
        return loss

    def _run_schedule(self, batch: dict[str, torch.Tensor], offset: int, global_batch: int) -> torch.Tensor:
        params = [p for p in self.module.parameters() if p.requires_grad]
        accumulated = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.executor.run(batch, sample_offset=offset, global_batch=global_batch)
        grads = [p.grad for p in params]
        for p, g in zip(params, accumulated):
            p.grad = g
        if isinstance(self.optimizer, ZeROOptimizer):
            self.optimizer.clear_backward_seen_flag()  # what DeepSpeedEngine.forward does
        if all(g is None for g in grads):
            raise RuntimeError("the schedule produced no parameter gradient; is the model's loss connected to its parameters?")
        surrogate = sum((p * g).sum() for p, g in zip(params, grads) if g is not None)
        register_output_backward_hooks(
            surrogate, preprocess_once_fn=self._backward_prologue, preprocess_per_tensor_fn=self._backward_prologue_per_tensor
        )
        self.backward(surrogate)
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
        loss = self.module(batch)
        self.module.train(was_training)
        return start_all_reduce(loss.float(), self.parallel_context.dp_group).wait() / self.parallel_context.dp_size

    # -- checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint (TMP shards by mp rank, ZeRO states by DP rank),
        written under ``<tag>.partial`` and renamed to ``<tag>`` by rank 0 only
        once every rank finished; ``latest`` is replaced atomically after that.  A
        crash mid-save leaves the previous checkpoint and ``latest`` intact (re-saving
        an existing tag has a moment where only ``<tag>.old`` holds it).  Ranks on
        several nodes need a shared filesystem: rank 0 does the renames."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        partial = f"{tag}.partial"
        ok = super().save_checkpoint(save_dir, partial, client_state or {}, save_latest=False,
                                     exclude_frozen_parameters=exclude_frozen_parameters)
        dist.barrier()
        if dist.get_rank() == 0:
            final, old = os.path.join(save_dir, tag), os.path.join(save_dir, f"{tag}.old")
            shutil.rmtree(old, ignore_errors=True)  # a leftover from an interrupted save
            if os.path.exists(final):
                os.replace(final, old)
            os.replace(os.path.join(save_dir, partial), final)
            shutil.rmtree(old, ignore_errors=True)
            if save_latest:
                tmp = os.path.join(save_dir, "latest.tmp")
                with open(tmp, "w") as f:
                    f.write(tag)
                os.replace(tmp, os.path.join(save_dir, "latest"))
        dist.barrier()
        return ok

    def save_trace(self, path: str) -> None:
        """Chrome/Perfetto trace of the last micro-batch's schedule on this rank."""
        self.executor.timeline.save_chrome_trace(path, dist.get_rank())

