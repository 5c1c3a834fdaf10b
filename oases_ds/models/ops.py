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

With sequence parallelism they become AllGather along the sequence (backward
ReduceScatter) and ReduceScatter (backward AllGather).

Because the forward AllReduce's input gradient equals its output gradient
(paper eq. 1), a recomputation that starts right after a ``reduce`` never needs
to run the collective again -- that is what fine-grained recomputation exploits.
The same holds for a ReduceScatter (its input gradient is the AllGather of its
output gradient, which the backward runs anyway).

A communication operator runs in one of two ways, looked up in two tables
(:data:`COLLECTIVES`, collective name -> how to start it; :data:`PAIRS`, (forward,
backward) -> the autograd Function running both) so they cannot disagree:
asynchronously (:meth:`CommOp.start`, one direction at a time; the executor
syncs it later) or eagerly (:meth:`CommOp.apply`, both directions at once as the
autograd Function of :mod:`oases_ds.parallel.collectives`; evaluation and a plain
DeepSpeedEngine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from oases_ds.parallel.collectives import (
    GatherFromTensorParallel,
    Group,
    Pending,
    SplitToTensorParallel,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    split_for_rank,
)
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.random import RNGTracker

Acts = tuple[torch.Tensor, ...]
Collective = Literal["all_reduce", "all_gather", "split", "reduce_scatter"] | None


def _start_split(comm: Communicator, tensor: torch.Tensor, group: Group, dim: int, phase: str, label: str) -> Pending:
    """Local: keep this rank's share, nothing crosses a link (so nothing is counted)."""
    piece = split_for_rank(tensor, group, dim)
    return Pending(None, lambda: piece)


@dataclass(frozen=True)
class CollectiveKind:
    """How one named collective runs, one direction at a time.

    Attributes:
        start: async: ``(comm, tensor, group, dim, phase, label) -> Pending``
            (``label`` names it in the flight records).
        moves_bytes: whether it crosses a link; ``split`` keeps a local share (the cost and
            memory models then charge no transfer and no buffer in flight).
    """

    start: Callable[[Communicator, torch.Tensor, Group, int, str, str], Pending]
    moves_bytes: bool = True


COLLECTIVES: dict[str, CollectiveKind] = {
    "all_reduce": CollectiveKind(lambda comm, t, group, dim, phase, label: comm.all_reduce(t, group, phase, label=label)),
    "all_gather": CollectiveKind(lambda comm, t, group, dim, phase, label: comm.all_gather(t, group, dim, phase, label=label)),
    "reduce_scatter": CollectiveKind(
        lambda comm, t, group, dim, phase, label: comm.reduce_scatter(t, group, dim, phase, label=label)),
    "split": CollectiveKind(_start_split, moves_bytes=False),
}
"""The one place a collective's name becomes a collective."""

PAIRS: dict[tuple[Collective, Collective], Callable[[torch.Tensor, Group, int], torch.Tensor]] = {
    ("all_reduce", None): lambda x, group, dim: reduce_from_tensor_parallel(x, group),
    (None, "all_reduce"): lambda x, group, dim: copy_to_tensor_parallel(x, group),
    ("all_gather", "split"): GatherFromTensorParallel.apply,
    ("split", "all_gather"): SplitToTensorParallel.apply,
    ("all_gather", "reduce_scatter"): gather_from_sequence_parallel,
    ("reduce_scatter", "all_gather"): reduce_scatter_to_sequence_parallel,
}
"""Every (forward, backward) pair a communication operator may be -- each direction is the
other's gradient -- and the eager autograd Function that runs both: Megatron's four TMP
regions and sequence parallelism's two (:mod:`oases_ds.parallel.collectives`)."""


@dataclass
class OpContext:
    """What an operator may read besides its input tuple: this sub-batch's data
    and where it sits in the global batch (for sharding-invariant dropout).

    Attributes:
        batch: this sub-batch's tensors ("tokens", "labels", ...).
        sample_offset: index of this sub-batch's first sample in the global batch.
        global_batch: samples in the global batch (all DP ranks, all sub-batches).
        loss_scale: factor turning a sum of token losses into this rank's mean loss:
            1 / labelled tokens as a 0-dim tensor on the batch's device, so computing it
            never waits for the device (a float is accepted where that does not matter).
        rng: dropout key source.
        comm: communicator for collectives issued inside an operator (the loss).
        phase: "forward" or "recompute", for accounting those collectives.
        training: dropout on/off.
        outputs_needed: ``False`` while the executor runs a Recompute whose outputs no
            later instruction reads (the op right before a forward collective that a
            fine-grained recomputation does not re-run): the op must still build the
            autograd graph its Backward runs but may skip computing its outputs' values
            (``RowParallelLinear.partial(values=False)``).  Placeholders then stand in for
            them, which nothing may read.
    """

    batch: dict[str, torch.Tensor]
    sample_offset: int
    global_batch: int
    loss_scale: torch.Tensor | float
    rng: RNGTracker
    comm: Communicator
    phase: str = "forward"
    training: bool = True
    outputs_needed: bool = True


@dataclass(eq=False)
class ComputeOp:
    """A computation operator: ``fn(ctx, inputs) -> outputs``.

    Attributes:
        name: unique within the sequence, e.g. ``"L3.qkv"``.
        layer: transformer layer index (-1 for the embedding, ``num_layers`` for the head).
        block: "embed", "attn", "mlp" or "head" (the planner's unit).
        fn: the computation; must be deterministic given ``ctx`` and inputs.
        is_loss: the last operator; its single output is the scalar loss.
        saves_nothing: its backward needs no activation value (e.g. bias add,
            keyed dropout, residual add), so autograd saves nothing for it.  The
            Oases schedule then keeps its graph from forward instead of cutting a
            checkpoint before it (see ``fine_grained_segments``).
        graph_only_recompute: in a recompute whose outputs nobody reads
            (``OpContext.outputs_needed`` off) it computes no output values, only the
            graph its Backward runs; its new outputs are then placeholders holding no
            memory (the memory model counts them so).  The row-parallel products
            feeding a forward AllReduce (``proj``, ``mlp``).
        light: elementwise work only (norm, bias, dropout, residual add: the ops at a
            block's edges), a small fraction of a block's time.  The merge of sub-batch
            streams may run such ops of one sub-batch between two heavy ops of another
            (:func:`~oases_ds.schedule.generators.merge`).
        continues: the second or a later chunk of one computation split into consecutive ops (the
            sequence-parallel MLP's ``mlp_up1`` ..): the time-blind merge does not let another
            sub-batch hop in before it, so its order is the one it had with the computation whole.
        parts: the same computation as consecutive ops (their names the suffix after the
            layer prefix, e.g. ``mlp_up0``), which a rewrite of the sequence may run instead
            of this op (:func:`~oases_ds.models.operator_model.sequence_parallel_ops` does,
            to give the other sub-batch a point to hop in); empty for an op that is one step.
    """

    name: str
    layer: int
    block: str
    fn: Callable[[OpContext, Acts], Acts]
    is_loss: bool = False
    saves_nothing: bool = False
    graph_only_recompute: bool = False
    light: bool = False
    continues: bool = False
    parts: tuple["ComputeOp", ...] = ()
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
        dim: the dimension an AllGather concatenates and a split or ReduceScatter slices
            (0, the batch, for a reshard between degrees; 1, the sequence, under sequence
            parallelism).
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

    def __post_init__(self) -> None:
        # Each direction's collective must be the other's gradient: that is what lets
        # one autograd Function (``apply``) stand for both directions.
        for this, direction in ((self.forward, "forward"), (self.backward, "backward")):
            if this is not None and this not in COLLECTIVES:
                raise ValueError(f"{self.name}: unknown {direction} collective {this!r}; "
                                 f"use one of {', '.join(COLLECTIVES)}")
        if (self.forward, self.backward) not in PAIRS:
            if self.forward is not None:
                this, fits, got = f"forward {self.forward}", [b for f, b in PAIRS if f == self.forward], self.backward
            else:
                this, fits, got = f"backward {self.backward}", [f for f, b in PAIRS if b == self.backward], self.forward
            raise ValueError(f"{self.name}: {this} needs {' or '.join(x or 'identity' for x in fits)} in the other "
                             f"direction (its gradient), got {got or 'identity'}")

    def collective_in(self, phase: str) -> Collective:
        """The collective this operator runs in ``phase`` (forward and recompute: its forward one)."""
        return self.backward if phase == "backward" else self.forward

    def start(self, comm: Communicator, tensor: torch.Tensor, direction: str, phase: str, label: str = "") -> Pending:
        """Issue this operator's ``direction`` collective on ``tensor``; the caller waits on the handle.
        ``label`` names it in the flight records (default: the operator's name)."""
        collective = self.forward if direction == "forward" else self.backward
        if collective is None:
            raise ValueError(f"{self.name} has no {direction} collective")
        return COLLECTIVES[collective].start(comm, tensor, self.group, self.dim, phase, label or self.name)

    def apply(self, x: torch.Tensor, comm: Communicator | None = None) -> torch.Tensor:
        """Eager: both directions as one autograd Function, synchronous (forward runs now,
        backward when autograd reaches it).  Without autograd (evaluation) and with a
        ``comm``, the forward collective goes through it instead, so it is recorded: the
        same collective, the same result, no backward to wire."""
        if comm is not None and not torch.is_grad_enabled():
            return self.start(comm, x, "forward", "eval", f"{self.name} eval").wait() if self.forward is not None else x
        if self.forward is None and self.backward is None:
            return x
        return PAIRS[(self.forward, self.backward)](x, self.group, self.dim)


Op = ComputeOp | CommOp


def short_name(op: Op) -> str:
    """``op``'s name without its layer prefix (``L3.qkv`` -> ``qkv``; ``embed`` stays ``embed``): what
    every layer's copy of an operator shares, the key of the per-op tables (memory, FLOPs, times)."""
    return op.name.split(".", 1)[-1]


def forward_collective(op: Op) -> bool:
    return isinstance(op, CommOp) and op.forward is not None


def backward_collective(op: Op) -> bool:
    return isinstance(op, CommOp) and op.backward is not None


def sequence_gather(op: Op) -> bool:
    """Whether ``op`` gathers a block's input along the sequence (sequence parallelism's ``copy``:
    forward AllGather, backward ReduceScatter), the one collective a fine-grained
    recomputation may re-run (policy ``oases``, see ``RECOMPUTE_POLICIES``)."""
    return isinstance(op, CommOp) and op.forward == "all_gather" and op.backward == "reduce_scatter"


def moves_bytes(op: Op, phase: str) -> bool:
    """Whether ``op`` sends anything over a link in ``phase`` (:attr:`CollectiveKind.moves_bytes`)."""
    collective = op.collective_in(phase) if isinstance(op, CommOp) else None
    return collective is not None and COLLECTIVES[collective].moves_bytes
