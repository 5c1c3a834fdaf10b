"""TMP collectives as autograd Functions, named for their forward/backward pair.

Megatron's four region mappings, each taking an explicit group:

==========================  ======================  ======================
Function                    forward                 backward
==========================  ======================  ======================
``CopyToTensorParallel``    identity                AllReduce(grad)
``ReduceFromTensorParallel`` AllReduce(x)           identity
``SplitToTensorParallel``   keep this rank's slice  AllGather(grad)
``GatherFromTensorParallel`` AllGather(x)           keep this rank's slice
==========================  ======================  ======================

The executor does not go through autograd for its communication: it starts the
same collectives with :func:`start_all_reduce` / :func:`start_all_gather`, which
return a :class:`Pending` handle that a ``Sync`` instruction waits on.  That is
the async variant: the work runs on the process group's own thread (gloo) or
stream (NCCL) while the caller keeps computing.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Size of ``group``; ``None`` stands for a group of one (no communication)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


class Waiter(Protocol):
    """Who waits on a collective's work for a :class:`Pending` (the flight recorder, which
    dumps a failed wait, or guard mode, which bounds it): ``wait(work, record)``."""

    def wait(self, work: dist.Work, record: Any) -> None: ...


class Pending:
    """An in-flight collective.  ``wait()`` returns its result exactly once."""

    __slots__ = ("_work", "_finish", "_done", "_waiter", "_record")

    def __init__(self, work: dist.Work | None, finish: Callable[[], torch.Tensor]) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._waiter: Waiter | None = None
        self._record: Any = None

    def watched(self, waiter: Waiter | None, record: Any) -> "Pending":
        """Have ``waiter`` wait on the work, for ``record`` (what the recorder logged of it)."""
        self._waiter, self._record = waiter, record
        return self

    def wait(self) -> torch.Tensor:
        if self._done:
            raise RuntimeError("Pending.wait() called twice on one collective")
        self._done = True
        if self._work is not None:
            if self._waiter is None:
                self._work.wait()
            else:
                self._waiter.wait(self._work, self._record)
        return self._finish()


def start_all_reduce(
    tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``tensor`` over ``group`` (sum by default) asynchronously, out of place."""
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    if group_size(group) == 1:
        return Pending(None, lambda: out)
    work = dist.all_reduce(out, op=op, group=group, async_op=True)
    return Pending(work, lambda: out)


def start_all_gather(tensor: torch.Tensor, group: Group, dim: int) -> Pending:
    """Concatenate every rank's ``tensor`` along ``dim`` asynchronously."""
    size = group_size(group)
    src = tensor.detach().contiguous()
    if size == 1:
        return Pending(None, lambda: src)
    parts = [torch.empty_like(src) for _ in range(size)]
    work = dist.all_gather(parts, src, group=group, async_op=True)
    return Pending(work, lambda: torch.cat(parts, dim=dim))


def start_broadcast(tensor: torch.Tensor, src: int, group: Group) -> Pending:
    """Broadcast ``tensor`` from global rank ``src`` of ``group`` asynchronously, in place."""
    if group_size(group) == 1:
        return Pending(None, lambda: tensor)
    work = dist.broadcast(tensor, src, group=group, async_op=True)
    return Pending(work, lambda: tensor)


def start_send(tensor: torch.Tensor, dst: int, group: Group) -> Pending:
    """Send ``tensor`` to global rank ``dst`` of ``group`` asynchronously (pipeline stages).

    The tensor is sent as it is now: a contiguous detached copy is what travels, and
    ``wait()`` (which returns it) must come before that copy may be dropped.  No tag:
    NCCL matches point-to-point messages in issue order only, so a gloo run that relies
    on issue order too proves the order the schedule gives (see the pipeline checker)."""
    src = tensor.detach().contiguous()
    work = dist.isend(src, dst, group=group)
    return Pending(work, lambda: src)


def start_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, group: Group) -> Pending:
    """Post the receive of a ``shape`` tensor from global rank ``src`` of ``group``;
    ``wait()`` returns it once it has arrived."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    work = dist.irecv(buf, src, group=group)
    return Pending(work, lambda: buf)


def split_for_rank(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's equal slice of ``tensor`` along ``dim``."""
    size = group_size(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} not divisible by group size {size}")
    return tensor.chunk(size, dim=dim)[group_rank(group)].contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity.  Backward: AllReduce of the gradient over the TMP group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return start_all_reduce(grad, ctx.group).wait(), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: AllReduce (sum of partial results) over the TMP group.  Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        return start_all_reduce(x, group).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class SplitToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's slice along ``dim``.  Backward: AllGather the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return split_for_rank(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return start_all_gather(grad, ctx.group, ctx.dim).wait(), None, None


class GatherFromTensorParallel(torch.autograd.Function):
    """Forward: AllGather along ``dim``.  Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return start_all_gather(x, group, dim).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return split_for_rank(grad, ctx.group, ctx.dim), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else ReduceFromTensorParallel.apply(x, group)
