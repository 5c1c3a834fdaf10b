"""The operator sequence: what a model flattens into so that a schedule can run it.

Paper Section IV: a DNN is a sequence of *computation* operators (each with a
Forward, Recompute and Backward) and *communication* operators (started with
StartAsync, finished with Sync).  Activations flowing between operators are
tuples of tensors, e.g. ``(residual, hidden)``, so that a residual stream can
pass by a collective that acts on one element only.

A communication operator names the collective it runs in forward and in
backward.  Megatron's two TMP regions map onto it directly:

* ``copy``  (before a column-parallel linear): forward identity, backward AllReduce.
* ``reduce`` (after a row-parallel linear):     forward AllReduce, backward identity.

Because the forward AllReduce's input gradient equals its output gradient
(paper eq. 1), a recomputation that starts right after a ``reduce`` never needs
to run the collective again -- that is what fine-grained recomputation exploits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from oases_ds.parallel.collectives import Group, Pending, split_for_rank
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.comm import Communicator

Acts = tuple[torch.Tensor, ...]
Collective = Literal["all_reduce", "all_gather", "split"] | None


@dataclass
class OpContext:
    """What an operator may read besides its input tuple: this sub-batch's data
    and where it sits in the global batch (for sharding-invariant dropout).

    Attributes:
        batch: this sub-batch's tensors ("tokens", "labels", ...).
        sample_offset: index of this sub-batch's first sample in the global batch.
        global_batch: samples in the global batch (all DP ranks, all sub-batches).
        loss_scale: factor turning a sum of token losses into this rank's mean loss.
        rng: dropout key source.
        comm: communicator for collectives issued inside an operator (the loss).
        phase: "forward" or "recompute", for accounting those collectives.
        training: dropout on/off.
    """

    batch: dict[str, torch.Tensor]
    sample_offset: int
    global_batch: int
    loss_scale: float
    rng: RNGTracker
    comm: Communicator
    phase: str = "forward"
    training: bool = True


@dataclass(eq=False)
class ComputeOp:
    """A computation operator: ``fn(ctx, inputs) -> outputs``.

    Attributes:
        name: unique within the sequence, e.g. ``"L3.qkv"``.
        layer: transformer layer index (-1 for the embedding, ``num_layers`` for the head).
        block: "embed", "attn", "mlp" or "head" (the planner's unit).
        fn: the computation; must be deterministic given ``ctx`` and inputs.
        is_loss: the last operator; its single output is the scalar loss.
    """

    name: str
    layer: int
    block: str
    fn: Callable[[OpContext, Acts], Acts]
    is_loss: bool = False
    kind: str = field(default="compute", init=False)


@dataclass(eq=False)
class CommOp:
    """A communication operator acting on element ``index`` of the activation tuple.

    Attributes:
        forward: collective run in forward (and re-run in a recomputation that
            includes this operator); ``None`` means identity; ``"split"`` keeps
            this rank's slice along ``dim`` (the partner of an AllGather).
        backward: collective run on the gradient; ``None`` means identity.
        group: the process group; size one makes every collective an identity.
        dim: concatenation dimension of an AllGather.
    """

    name: str
    layer: int
    block: str
    index: int
    forward: Collective
    backward: Collective
    group: Group
    dim: int = 0
    kind: str = field(default="comm", init=False)

    def start(self, comm: Communicator, tensor: torch.Tensor, direction: str, phase: str) -> Pending:
        collective = self.forward if direction == "forward" else self.backward
        if collective == "all_reduce":
            return comm.all_reduce(tensor, self.group, phase)
        if collective == "all_gather":
            return comm.all_gather(tensor, self.group, self.dim, phase)
        if collective == "split":  # local: keep this rank's share, nothing crosses a link
            piece = split_for_rank(tensor, self.group, self.dim)
            return Pending(None, lambda: piece)
        raise ValueError(f"{self.name} has no {direction} collective")


Op = ComputeOp | CommOp


def forward_collective(op: Op) -> bool:
    return isinstance(op, CommOp) and op.forward is not None


def backward_collective(op: Op) -> bool:
    return isinstance(op, CommOp) and op.backward is not None
