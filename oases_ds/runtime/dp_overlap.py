"""Data-parallel gradient reduction overlapped with the schedule's backward.

Why: reducing gradients after the schedule (DeepSpeed's way) leaves the whole
DP AllReduce exposed after the last Backward.  A block's gradient is final as
soon as the last Backward touching its parameters has run, so on the last
micro-batch of an accumulation window its bucket can be summed over the DP
group while the schedule backpropagates through the blocks below it::

    compute  ... B(L1.mlp) B(L1.attn)  B(L0.mlp)  B(L0.attn)  B(embed) | wait | step
    DP comm             [ L1.mlp ][ L1.attn ][ L0.mlp ][ L0.attn ][emb]|

Only the last micro-batch reduces (an earlier one's gradient is not complete),
so gradient accumulation stays exact: a bucket reduces ``accumulated + g / gas``,
the value DeepSpeed's accumulation would have produced.  The accumulation is
folded in place into the already accumulated ``.grad``; the only extra memory is
the flat copies of the (at most ``max_in_flight``) blocks reducing at once.

Who consumes the result: with ZeRO 0 the optimizer reads ``.grad`` directly; with
ZeRO-1 DeepSpeed's optimizer keeps this rank's partition of the reduced ``.grad``
(``OasesEngine`` hands it over), so each bucket is a full AllReduce whose other
partitions are dropped: what DeepSpeed's ZeRO-1 does by default too
(``use_multi_rank_bucket_allreduce``), twice the bytes of a reduce-scatter but no
DeepSpeed internals to re-implement.  The division by the DP size happens where DeepSpeed's
own route would do it (``predivide``), so it rounds as that route does.

How long :meth:`DPGradReducer.finish` waits is the exposed part of the reduction;
it is timed with the clock of the parameters' device
(:func:`~oases_ds.runtime.timeline.clock_for`): host time means nothing for NCCL,
whose ``wait`` returns before the collective is done.

Blocks a plan runs as several replicas need their gradients summed over the
replicas too.  Both sums are linear, so at the boundary one AllReduce over the
shard's replicas across DP does both (``replica_dp_group``), and the executor
skips its own per-micro-batch replica sum; without that group the executor sums
after each run and those buckets reduce over DP in :meth:`finish`, not overlapped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.collectives import Pending, group_size
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.grads import copy_from_flat
from oases_ds.runtime.executor import HookPhase
from oases_ds.runtime.timeline import Clock, clock_for
from oases_ds.schedule.generators import Schedule
from oases_ds.schedule.instructions import Backward, Instruction

BlockKey = tuple[int, str]  # (layer, block) as the operators name them

MAX_IN_FLIGHT = 2
"""Buckets reducing at once by default: the flat copies alive beside the gradients, which the
memory model charges (:func:`oases_ds.planner.memory.dp_in_flight_bytes`)."""

_LAYER_PARAM = re.compile(r"^layers\.(\d+)\.(attn|mlp)(_norm)?\.")


def block_of(name: str, num_layers: int) -> BlockKey | None:
    """The (layer, block) whose operators use parameter ``name`` (the norm before a block
    belongs to it); ``None`` for a name outside the known layout."""
    if name.startswith("embed."):
        return (-1, "embed")
    if name.startswith("head."):
        return (num_layers, "head")
    match = _LAYER_PARAM.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


@dataclass
class Bucket:
    """One block's parameters, reduced as one flat tensor.

    Attributes:
        key: the block, ``(layer, block)``.
        params: its parameters that take gradients, in model order.
        trigger: the last Backward of the block's operators in the schedule, after
            which its gradient is final; ``None``: reduced in :meth:`DPGradReducer.finish`.
        group: the DP group, or for a block a plan runs as several replicas its
            replicas across DP (the sum over them, divided by the DP size).
    """

    key: BlockKey
    params: list[torch.nn.Parameter]
    trigger: Instruction | None
    group: dist.ProcessGroup | None
    pending: Pending | None = field(default=None, repr=False)


class DPGradReducer:
    """Executor hook that starts each block's DP gradient AllReduce as soon as its
    last Backward has run on the boundary micro-batch (see the module docstring).

    Args:
        model: the operator model (its parameter names say which block they serve).
        schedule: the instruction list the executor runs.
        comm: the executor's communicator (bytes counted under ``grad_sync``; an
            emulated link holds the buckets too).
        dp_group: the data-parallel group; the result is the mean over it.
        max_in_flight: buckets reducing at once; starting one more first completes the
            oldest, so at most this many block-sized reduced copies are alive (not a
            whole gradient's worth at the end of the schedule).
        replica_dp_group: TMP degree -> the group of a shard's replicas across DP
            (``ParallelContext.replica_dp_group``).  Given, a replicated block's bucket
            sums over its replicas and DP in one AllReduce, and the executor must not
            sum replicas itself (``Executor.sum_replica_grads = False``); ``None``: the
            executor sums them after each run and the reducer reduces them over DP after.
        predivide: divide each rank's contribution by the DP size before the sum, as
            DeepSpeed's ZeRO-1 reduce-scatter does; ``False``: multiply the sum by
            ``1 / dp`` after, as its ZeRO 0 AllReduce does.  The same value for a
            power-of-two DP size; chosen to match DeepSpeed's route at any size.
        clock: times :attr:`wait_s`; default :func:`clock_for` the parameters' device
            (CUDA events on a GPU, where host time only sees the kernel launches).
    """

    def __init__(self, model: OperatorModel, schedule: Schedule, comm: Communicator, dp_group: dist.ProcessGroup | None,
                 max_in_flight: int = MAX_IN_FLIGHT, replica_dp_group: Callable[[int], dist.ProcessGroup | None] | None = None,
                 predivide: bool = False, clock: Clock | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 (buckets reducing at once), got {max_in_flight}")
        self.comm, self.dp_group, self.max_in_flight, self.predivide = comm, dp_group, max_in_flight, predivide
        self.clock: Clock = clock or clock_for(next(model.parameters()).device)
        self._in_flight: list[Bucket] = []
        self._started: set[int] = set()  # id() of the buckets started in this boundary run
        self.dp_size = group_size(dp_group)
        last: dict[BlockKey, Instruction] = {}
        for ins in schedule.instructions:
            if isinstance(ins, Backward):
                op = model.ops[ins.op]
                last[(op.layer, op.block)] = ins
        full = model.sharding.full_degree
        replicas = {id(p): group_size(g) for params, g in model.sharding.replica_groups(model.layers) for p in params}
        # Summed over the TMP group at the end of each run (Executor._sum_sequence_parallel_grads): reduced after it.
        after_run = {id(p) for p in model.sequence_parallel_params()}
        grouped: dict[tuple[BlockKey | None, int], list[torch.nn.Parameter]] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                key, copies = block_of(name, len(model.layers)), replicas.get(id(p), 1)
                if key is None or (copies > 1 and replica_dp_group is None) or id(p) in after_run:
                    key, copies = None, 1  # outside the known layout, or summed over replicas / TMP after the run
                grouped.setdefault((key, copies), []).append(p)
        self.buckets = []
        late: list[torch.nn.Parameter] = []
        for (key, copies), params in grouped.items():
            if key is None or key not in last:
                late += params
            else:  # a block at degree full/copies: one AllReduce sums over its replicas and over DP
                group = dp_group if copies == 1 else replica_dp_group(full // copies)  # type: ignore[misc]
                self.buckets.append(Bucket(key, params, last[key], group))
        if late:
            self.buckets.append(Bucket((len(model.layers) + 1, "after_schedule"), late, None, dp_group))
        self._by_trigger: dict[Instruction, list[Bucket]] = {}
        for b in self.buckets:
            if b.trigger is not None:
                self._by_trigger.setdefault(b.trigger, []).append(b)
        self._accumulated: dict[int, torch.Tensor | None] | None = None
        self._scale = 1.0
        self.log: list[str] = []  # instruction / bucket order of the last armed run, for tests and traces
        self._wait_marks: tuple[Any, Any] | None = None  # clock marks around finish()'s wait, resolved when read
        self._wait_s = 0.0

    @property
    def wait_s(self) -> float:
        """How long the last :meth:`finish` waited for the buckets: the exposed part of the
        reduction (0 before the first).  Read after the step: on CUDA reading waits for the
        device, so finish() only takes marks."""
        if self._wait_marks is not None:
            start, end = self.clock.resolve(list(self._wait_marks))
            self._wait_s, self._wait_marks = end - start, None
        return self._wait_s

    @property
    def armed(self) -> bool:
        return self._accumulated is not None

    def arm(self, accumulated: list[tuple[torch.nn.Parameter, torch.Tensor | None]], micro_batch_scale: float) -> None:
        """The next :meth:`Executor.run` is the accumulation window's last micro-batch:
        reduce ``accumulated + micro_batch_scale * g`` for each parameter, where
        ``g`` is the gradient that run leaves in ``.grad``."""
        self._accumulated = {id(p): g for p, g in accumulated}
        self._started = set()
        self._in_flight = []
        self._scale = micro_batch_scale
        self._wait_marks, self._wait_s = None, 0.0  # this window's wait; set by finish()
        self.log = []

    def __call__(self, ins: Instruction, phase: HookPhase) -> None:
        if self._accumulated is None:
            return
        if phase == "before" and isinstance(ins, Backward):
            self.log.append(str(ins))
        elif phase == "after":
            for bucket in self._by_trigger.get(ins, ()):
                self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        assert self._accumulated is not None
        grads = []
        for p in bucket.params:
            g, before = p.grad, self._accumulated.pop(id(p), None)
            if g is None:  # no gradient this micro-batch
                g = before if before is not None else torch.zeros_like(p)
            elif before is not None:
                g = before.add_(g, alpha=self._scale)  # in place: no second gradient-sized buffer
            else:
                g = g.mul_(self._scale)
            p.grad = g
            grads.append(g)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.predivide and self.dp_size > 1:
            flat.div_(self.dp_size)
        self._started.add(id(bucket))
        bucket.pending = self.comm.all_reduce(flat, bucket.group, "grad_sync", label=f"dp grad L{bucket.key[0]}.{bucket.key[1]}")
        self.log.append(f"dp:{bucket.key[0]}.{bucket.key[1]}")
        self._in_flight.append(bucket)
        while len(self._in_flight) > self.max_in_flight:  # bound the reduced copies alive at once
            self._complete(self._in_flight.pop(0))

    def _complete(self, bucket: Bucket) -> None:
        assert bucket.pending is not None
        flat = bucket.pending.wait()
        bucket.pending = None
        if not self.predivide and self.dp_size > 1:
            flat.mul_(1.0 / self.dp_size)
        copy_from_flat([p.grad for p in bucket.params], flat)  # _start set every .grad

    def finish(self) -> None:
        """After the run: reduce what waits for the schedule's end, wait for every
        bucket, and put the DP mean into ``.grad``.  Disarms."""
        if self._accumulated is None:
            raise RuntimeError("DPGradReducer.finish without arm: no boundary micro-batch ran")
        t0 = self.clock.mark()
        for bucket in self.buckets:
            if id(bucket) not in self._started:
                self._start(bucket)
        for bucket in self._in_flight:
            self._complete(bucket)
        self._wait_marks = (t0, self.clock.mark())
        self._in_flight = []
        self._accumulated = None

    def abandon(self) -> None:
        """The run failed: forget the buckets in flight (starting the rest could wait on
        peers that failed too) and disarm.  The gradients are not to be used."""
        for bucket in self.buckets:
            bucket.pending = None
        self._in_flight = []
        self._accumulated = None
