"""Gradient reductions outside the schedule: one flat bucket per group.

They go through a :class:`~oases_ds.parallel.comm.Communicator` (not a raw
process group) so that their bytes are counted under ``grad_sync`` and an
emulated link holds them too -- a benchmark's step then pays for them as a real
cluster would.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from oases_ds.parallel.comm import Communicator


def all_reduce_grads(
    params: Iterable[torch.nn.Parameter], comm: Communicator, group: dist.ProcessGroup | None, mean: bool = False,
    label: str = "grads",
) -> None:
    """Sum (or average) the gradients of ``params`` over ``group`` as one flat bucket
    through ``comm`` (so it is counted, recorded as ``label``, and held to an emulated
    link if there is one)."""
    size = 1 if group is None else dist.get_world_size(group)
    grads = [p.grad for p in params if p.grad is not None]
    if size == 1 or not grads:
        return
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group, "grad_sync", label=label).wait()
    if mean:
        flat /= size
    copy_from_flat(grads, flat)


def copy_from_flat(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the consecutive pieces of ``flat`` (a reduced bucket) back into ``grads``, in place."""
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def average_data_parallel_grads(model: torch.nn.Module, dp_group: dist.ProcessGroup | None,
                                comm: Communicator | None = None) -> None:
    """Mean of parameter gradients over the DP group (what DeepSpeed does for the engine),
    through ``comm`` (default: the model's, where it has one)."""
    comm = comm or getattr(model, "comm", None) or Communicator()
    all_reduce_grads(list(model.parameters()), comm, dp_group, mean=True, label="dp grads")
