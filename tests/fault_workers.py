"""Rank functions that inject one collective fault each (started by ``oases_ds.launcher.launch``).

The fault comes from :class:`FaultyCommunicator`, a :class:`~oases_ds.parallel.comm.Communicator`
that misbehaves on one rank at one step, exactly as a bug in a caller would: it leaves a
collective out, issues it with another shape, or sends pipeline messages out of order.
A different batch is the data's fault, injected by the worker.  Each worker writes the wall
time its faulty step starts to ``stamp`` (so the test can time the failure from there, not
from process start-up) and returns its losses when nothing fails.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from oases_ds.models.operator_model import OperatorModel
from oases_ds.models.stages import split_stages
from oases_ds.parallel.collectives import Pending
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.pipeline import PipelineExecutor, StageLinks
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.schedule.instructions import StartAsync

sys.path.insert(0, os.path.dirname(__file__))
from dist_workers import make_batch, tiny_config  # noqa: E402

FAULT_STEP = 2
FAULTY_RANK = 1


class FaultyCommunicator(Communicator):
    """A communicator that, on ``FAULTY_RANK`` at ``FAULT_STEP``, breaks the collective
    labelled ``target``: ``skip`` does not issue it (its result is the input), ``shape``
    issues it one row longer; ``reorder`` sends the pipeline message ``target`` after the
    next one instead of before it."""

    fault: str = ""
    target: str = ""

    def _armed(self, label: str) -> bool:
        return (self.fault and dist.get_rank() == FAULTY_RANK and self.step == FAULT_STEP and label == self.target)

    def all_reduce(self, tensor, group, phase, op=dist.ReduceOp.SUM, label=""):
        if self._armed(label):
            self.fault, fault = "", self.fault
            if fault == "skip":
                return Pending(None, lambda: tensor.clone())
            if fault == "shape":
                return super().all_reduce(torch.cat([tensor, tensor[:1]]), group, phase, op, label)
        return super().all_reduce(tensor, group, phase, op, label)

    def send(self, tensor, dst, group, label=""):
        held = getattr(self, "_held", None)
        if held is not None:
            self._held = None
            pending = super().send(tensor, dst, group, label)
            held.issue()
            return pending
        if self.fault == "reorder" and dist.get_rank() == 0 and self.step == FAULT_STEP and label == self.target:
            self.fault = ""
            self._held = _Deferred(lambda: super(FaultyCommunicator, self).send(tensor, dst, group, label))
            return self._held
        return super().send(tensor, dst, group, label)


class _Deferred(Pending):
    """A send issued later than asked for (by the next send, or at its wait)."""

    def __init__(self, start) -> None:
        super().__init__(None, self._finish_later)
        self._start, self._inner = start, None

    def issue(self) -> None:
        if self._inner is None:
            self._inner = self._start()

    def _finish_later(self) -> torch.Tensor:
        self.issue()
        return self._inner.wait()


def _comm(fault: str, check: bool) -> FaultyCommunicator:
    comm = FaultyCommunicator.for_run(check=check)
    comm.fault = fault
    return comm


def _stamp(path: str) -> None:
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write(repr(time.time()))


def last_collective_label(executor: Executor) -> str:
    """The label of a step's last TMP collective (what ``skip_last`` leaves out)."""
    ins = [i for i in executor.schedule.instructions if isinstance(i, StartAsync)][-1]
    return executor._comm_labels[ins.op, ins.phase] + f" sb{ins.sub}"


def tmp_fault_worker(fault: str, check: bool, timeout_s: float, stamp: str, steps: int = 3,
                     sleep_s: float = 0.0) -> list[float]:
    """TMP 2 on two ranks, the Oases schedule, ``steps`` steps; ``fault`` at step 2 on rank 1:
    ``skip`` (the first forward AllReduce), ``skip_last`` (the step's last collective: rank 1
    then goes on to the step's metrics reduction on the world group), ``shape``, ``batch``
    (rank 1's batch differs), or ``""`` (none; ``sleep_s``: rank 1 computes that long before
    the step, a slow peer guard mode must wait for)."""
    ctx = ParallelContext.build(tensor_parallel_size=2, timeout_s=timeout_s)
    cfg = tiny_config("gpt", dropout=0.0)
    model = OperatorModel(cfg, ctx.tp_group, seed=7)
    comm = _comm(fault.replace("skip_last", "skip"), check)
    model.comm = comm
    ex = Executor.for_schedule(model, ScheduleSpec("oases"), rng=RNGTracker(seed=11), comm=comm)
    comm.target = last_collective_label(ex) if fault == "skip_last" else "L0.attn_reduce fwd sb0"
    losses = []
    for step in range(1, steps + 1):
        comm.step = step
        batch = make_batch(cfg, 4, step)
        if step == FAULT_STEP:
            _stamp(stamp)
            if fault == "batch" and ctx.rank == FAULTY_RANK:
                batch = make_batch(cfg, 4, step, seed=99)
            if sleep_s and ctx.rank == FAULTY_RANK:
                time.sleep(sleep_s)
        loss = ex.run(batch)
        losses.append(float(comm.all_reduce(loss, dist.group.WORLD, "metrics", label="step loss").wait()))
        for p in model.parameters():
            p.grad = None
    return losses


def pipeline_fault_worker(fault: str, check: bool, timeout_s: float, stamp: str, steps: int = 3) -> list[float]:
    """Two pipeline stages (TMP 1), 1F1B over 2 micro-batches of 2 sub-batches; ``reorder``:
    at step 2 stage 0 sends micro-batch 0's first activation after its second."""
    ctx = ParallelContext.build(tensor_parallel_size=1, timeout_s=timeout_s, pipeline_stages=2)
    cfg = tiny_config("gpt", dropout=0.0, num_layers=2)
    model = OperatorModel(cfg, ctx.tp_group, seed=7, stage=split_stages(2, 2)[ctx.pp_rank])
    comm = _comm(fault, check)
    comm.target = "act mb0 sb0"
    model.comm = comm
    ex = PipelineExecutor.for_pipeline(model, ScheduleSpec("oases"), "1f1b", 2, StageLinks.of(ctx),
                                       rng=RNGTracker(seed=11), comm=comm)
    losses = []
    for step in range(1, steps + 1):
        comm.step = step
        full = make_batch(cfg, 8, step)
        mbs = [{k: v[i * 4:(i + 1) * 4] for k, v in full.items()} for i in range(2)]
        if step == FAULT_STEP:
            _stamp(stamp)
        losses.append(float(ex.run_step(mbs, [0, 4], 8)))
        for p in model.parameters():
            p.grad = None
    return losses


def consequence_first_worker() -> None:
    """Rank 1 fails on its own (guard mode's verdict) a moment after rank 0 fails in a wait (its
    dump written, then gloo's words): the order a busy host produced in CI, rank 0's report read first."""
    from oases_ds.parallel.flight import DUMP_PREFIX, RUN_DIR_ENV
    from oases_ds.parallel.guard import CollectiveMismatchError

    rank = int(os.environ["RANK"])
    if rank == 0:
        with open(os.path.join(os.environ[RUN_DIR_ENV], f"{DUMP_PREFIX}0.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    time.sleep(0.5)
    raise CollectiveMismatchError("collectives diverged in group [0, 1] pg1 at step 2, index 53: ...")
