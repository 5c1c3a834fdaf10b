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

and sequence parallelism's two:

=========================================  ================  ==================
``gather_from_sequence_parallel``          AllGather(x)      ReduceScatter(grad)
``reduce_scatter_to_sequence_parallel``    ReduceScatter(x)  AllGather(grad)
=========================================  ================  ==================

Under sequence parallelism (Korthikanti et al.) every TMP rank holds a ``1/t`` slice of
the sequence between blocks: a block's input is gathered along the sequence before its
column-parallel linear, and its row-parallel summands are reduce-scattered back to slices
(plain TMP's AllReduce split in its two halves).

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


# torch 2.13 renamed reduce_scatter_tensor (which now warns) to reduce_scatter_single; older torch has only the first.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def start_reduce_scatter(tensor: torch.Tensor, group: Group, dim: int) -> Pending:
    """Sum ``tensor`` over ``group`` and keep this rank's equal slice along ``dim``, asynchronously.

    The collective works on dimension 0, so a ``dim`` other than 0 is moved to the front
    (one contiguous copy, as the AllReduce's out-of-place clone) and back in the result
    (a second copy, of the ``1/t`` slice only, so that later ops may ``view`` it)."""
    size = group_size(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} not divisible by group size {size}")
    src = tensor.detach().movedim(dim, 0).contiguous()
    if size == 1:
        return Pending(None, lambda: src.movedim(0, dim).contiguous())
    out = src.new_empty((src.shape[0] // size, *src.shape[1:]))
    work = _reduce_scatter_single(out, src, group=group, async_op=True)
    return Pending(work, lambda: out.movedim(0, dim).contiguous())


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


class _SequenceRegion(torch.autograd.Function):
    """Sequence parallelism's two regions as one Function: ``first`` runs forward and ``second``
    on the gradient, both along ``dim`` (the sequence); see the two functions below."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, first, second) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim, ctx.second = group, dim, second
        return first(x, group, dim).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.second(grad, ctx.group, ctx.dim).wait(), None, None, None, None


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Forward: AllGather along ``dim`` (the sequence).  Backward: ReduceScatter of the gradient:
    every rank's full-sequence gradient is a partial sum (the column-parallel linear after it
    saw only this rank's columns)."""
    return _SequenceRegion.apply(x, group, dim, start_all_gather, start_reduce_scatter)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Forward: ReduceScatter along ``dim`` (the row-parallel summands summed, this rank's slice of
    the sequence kept).  Backward: AllGather of the gradient."""
    return _SequenceRegion.apply(x, group, dim, start_reduce_scatter, start_all_gather)


def copy_to_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else ReduceFromTensorParallel.apply(x, group)
