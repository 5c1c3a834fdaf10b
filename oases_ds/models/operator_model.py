"""GPT, BERT and LLaMA built, for a TMP group, as an operator sequence.

The modules (parameters) are :mod:`oases_ds.models.blocks`; how they are split
over ranks is :mod:`oases_ds.models.sharding`.  This module says what runs on
them and in which order.  The three families differ only in a few switches
(norm type, pre/post-LN, causal mask, MLP kind, positions, head), so one builder
serves all of them.

Per transformer layer the sequence is (paper Section IV, the ``(F_i, C_i, F_j)``
pattern once for attention and once for the MLP)::

    attn_in   (x)        -> (x, h)         norm (pre-LN) or previous norm, duplicate (post-LN)
    attn_copy            fwd id / bwd AllReduce of dh
    qkv       (x, h)     -> (x, q, k, v)   column-parallel, heads local, RoPE
    core      (x, q,k,v) -> (x, ctx)       softmax(qk^T)v, attention dropout
    proj      (x, ctx)   -> (x, y_part)    row-parallel summand
    attn_reduce          fwd AllReduce / bwd id
    attn_out  (x, y)     -> (x',)          bias, dropout, residual
    mlp_in    (x)        -> (x, h)         norm (pre-LN) or attention norm, duplicate (post-LN)
    mlp_copy             fwd id / bwd AllReduce
    mlp       (x, h)     -> (x, y_part)    column- then row-parallel (under sequence parallelism
                                           mlp_up0 .. mlp_up3 -> (x, inner_0 .. inner_3), mlp_down)
    mlp_reduce           fwd AllReduce / bwd id
    mlp_out   (x, y)     -> (x'',)         bias, dropout, residual

Under sequence parallelism the MLP runs as :data:`MLP_UP_CHUNKS` + 1 operators: ``mlp_up0`` ..
``mlp_up3``, the column-parallel linears and the activation, each on a part of the gathered
sequence (the MLP is per token; up to four equal parts of at least :data:`MIN_CHUNK_TOKENS`,
:func:`mlp_up_chunk_bounds`), and ``mlp_down``, the row-parallel one on all of them.
There a block's ReduceScatter and the next block's AllGather have only a norm between them, and
the other sub-batch can start that AllGather only between two of this sub-batch's heavy operators
(the merge's hops, :func:`oases_ds.schedule.generators.merge`); with one MLP operator the MLP's
ReduceScatter stayed exposed with two sub-batches.  The chunks are finer points for a merge that
knows the ops' times (:mod:`oases_ds.schedule.costed_merge`): in a link-bound forward the up
projection outlasts the other sub-batch's collective, and with one operator the link idled for the
difference; the time-blind merge does not hop between chunks (``ComputeOp.continues``).  Without
sequence parallelism a collective is never that close to the next, so the MLP stays one operator
(one fewer step to schedule, and no ``F/t``-wide output held between two ops until the backward).

``attn_out`` and ``mlp_out`` save no activation for backward (``saves_nothing``):
the keyed dropout regenerates its mask, the adds need no values.  So the Oases
schedule keeps their graphs from forward and checkpoints only their output, one
``[b, s, h]`` tensor per block.  That is why post-LN (BERT) applies a block's
LayerNorm -- which saves its input -- at the start of the *next* operator that
reads it (``mlp_in``, the next layer's ``attn_in``, ``head_in``) instead of at
the end of ``*_out``: the math and the parameter names are unchanged, but the
tensor crossing the block boundary is the pre-norm sum, and the norm is
recomputed with the next segment.  Likewise ``embed_out`` (positions + dropout)
saves nothing, and BERT's embedding norm and dropout run in layer 0's ``attn_in``.
A norm is deferred only across a boundary between blocks of the same TMP degree
(a heterogeneous plan's reshard boundary keeps it, and that block then
checkpoints ``(x, y)`` as before): a parameter's replica gradients are summed
by the layout of the block that owns it.

A plan may give each attention and MLP block its own TMP degree ``t`` (paper
Section V): the block then runs ``T/t`` replicas inside the TMP group of ``T``
ranks, each on its share of the sub-batch.  Between blocks of different degree a
``reshard`` operator moves the single-tensor activation ``(x,)``: towards a
smaller degree it keeps this replica's slice of the batch (backward: AllGather of
the gradient); towards a larger one it AllGathers the slices (backward: slice).

Parameter names equal those of a plain unsharded model (``layers.0.attn.q.weight``
...), and every parameter's ``tp_dim`` says how it is split, so full state dicts
can be sharded into and gathered out of any TMP degree (``model.sharding``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from oases_ds.models.blocks import Embedding, Head, OtherStageLayer, TransformerLayer
from oases_ds.models.config import ModelConfig
from oases_ds.models.ops import Acts, CommOp, ComputeOp, Op, OpContext
from oases_ds.models.sharding import Sharding, init_full_parameter
from oases_ds.models.stages import Stage
from oases_ds.parallel.collectives import Group, group_rank, group_size
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.context import BlockLayout, ParallelContext
from oases_ds.parallel.layers import (
    ReplicatedHeadLinear,
    apply_rotary,
    attention_core,
    rotary_inverse_frequencies,
    rotary_tables,
    vocab_parallel_cross_entropy,
)
from oases_ds.parallel.random import RNGTracker, keyed_dropout

IGNORE_INDEX = -100

MLP_UP_CHUNKS = 4
"""Under sequence parallelism the MLP's column-parallel half runs as this many operators, each on
a part of the gathered sequence (module doc, :func:`mlp_up_chunk_bounds`): points where the other
sub-batch can start its next collective.  Priced on LLaMA-7B at seq 4096 on 8 x 3090 (``cost=analytic``,
every block stored, hops ordered by the plan's times), 1, 2, 3 and 4 equal chunks replayed 1794.8,
1794.8, 1760.7 and 1744.8 ms, and 8 chunks as 4 (on links of 60 to 160 Gbit/s, 4 chunks never
slower than 1 or 3).  The time-blind order, which does not hop between chunks, is the same with any
number (1874.6 ms)."""

MIN_CHUNK_TOKENS = 1024
"""The fewest tokens per sample a chunk of the up projection gets (:func:`mlp_up_chunk_bounds`).
Why: small chunks cost on a CPU.  Timed on this project's 2-core host (LLaMA h1024, FFN 2816 at
TMP 2, 2 x 512 tokens, fp32, one thread, autograd forward and backward of the MLP alone), four
256-token chunks took 1.10x the whole MLP (with a first version of the down projection over the
chunks, which concatenated its output).  On emulated links, with four chunks at seq 512, the timed hop
order was 1.042x the time-blind one at 1 Gbit/s (``benchmarks/reports/sequence_parallel_step-2026-12-08.md``),
against 0.976x without chunks in the 2026-12-07 run."""


def mlp_up_chunk_count(seq_len: int) -> int:
    """How many of the :data:`MLP_UP_CHUNKS` up-projection chunks run tokens at a sequence length of
    ``seq_len``: ``seq_len // MIN_CHUNK_TOKENS``, 1 to ``MLP_UP_CHUNKS``."""
    return max(1, min(MLP_UP_CHUNKS, seq_len // MIN_CHUNK_TOKENS))


def mlp_up_chunk_bounds(tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of the :data:`MLP_UP_CHUNKS` up-projection chunks over the ``tokens``
    gathered tokens of a sub-batch (flattened, samples after one another: each chunk a contiguous
    view, which the linears save as it is): empty chunks first, then :func:`mlp_up_chunk_count` equal
    parts.  The op sequence is the same at every length (the cost tables and the schedule index it);
    a short sequence runs its up projection in the last chunk.  Why last: a chunk's output is handed
    on by the chunk ops after it, whose graphs hold it until their backward, so a whole projection
    in the first chunk would be held past the down projection's backward (measured on ranks at seq
    512, LLaMA h1024: a tenth more peak activation memory for re-gathering blocks, as the memory model
    predicted); empty chunks hand on nothing but empty tensors."""
    n = mlp_up_chunk_count(seq_len)
    edges = [tokens * k // n for k in range(n + 1)]
    empty = MLP_UP_CHUNKS - n
    return [(0, 0) if k < empty else (edges[k - empty], edges[k - empty + 1]) for k in range(MLP_UP_CHUNKS)]


def mlp_up_chunk_share(seq_len: int, chunk: int) -> float:
    """The fraction of the tokens chunk ``chunk`` of the up projection runs (:func:`mlp_up_chunk_bounds`):
    what the cost and memory models scale the whole projection's FLOPs and bytes by."""
    n = mlp_up_chunk_count(seq_len)
    return 1.0 / n if chunk >= MLP_UP_CHUNKS - n else 0.0


# Dropout sites: fixed integers so that a reference model can use the same keys.
SITE_EMBED = 0


def check_labelled_tokens(micro_batches: Sequence[dict[str, torch.Tensor]]) -> None:
    """Refuse a step in which some micro-batch has no labelled token (its mean loss would be 0/0).

    Why here and not per micro-batch in the hot loop: turning a count into a Python
    value waits for the device.  This runs once per step, before any of the step's work
    is queued, on the labels as the data loader delivered them, and answers every
    micro-batch with one reduction.  Labels on CPU (the usual loader) cost no device
    sync.  Labels already on the device (a framework that moved the batch first) cost one per
    step, while the device is idle: the previous step ended on its loss read-back.
    """
    if not micro_batches:
        return
    labelled = torch.stack([(mb["labels"] != IGNORE_INDEX).any() for mb in micro_batches])
    if not bool(labelled.all()):
        empty = [i for i, ok in enumerate(labelled.tolist()) if not ok]
        raise ValueError(f"micro-batch {empty[0]} of this step has no labelled tokens (every label is the ignore "
                         f"index {IGNORE_INDEX}); give each micro-batch at least one label that is not {IGNORE_INDEX}")


def dropout_site(layer: int, which: str) -> int:
    """Key site of a dropout call: ``which`` in {"attn_probs", "attn_out", "mlp_out"}."""
    return 1 + 3 * layer + ("attn_probs", "attn_out", "mlp_out").index(which)


class BlockDegrees(Protocol):
    """What :meth:`OperatorModel.for_plan` reads of a plan.  A protocol, so that the
    models need not import the planner (a higher layer); ``oases_ds.planner.plan.Plan``
    has exactly these."""

    @property
    def devices(self) -> int: ...

    @property
    def layers(self) -> int: ...

    @property
    def attn_degrees(self) -> Sequence[int]: ...

    @property
    def mlp_degrees(self) -> Sequence[int]: ...


class OperatorModel(nn.Module):
    """A transformer of one family, sharded for a TMP group, with its operator sequence.

    Args:
        cfg: the model.
        group: TMP group (``None``: unsharded, one rank).
        seed: initial weights come from :func:`~oases_ds.models.sharding.init_full_parameter`
            with this seed.
        layouts: optional per-layer (attention, MLP) :class:`BlockLayout` for
            heterogeneous plans (see :meth:`for_plan`); default: every block on ``group``.
        reshard_group: ``(small, large) -> group`` moving activations between
            degrees; required when ``layouts`` mix degrees.
        stage: the pipeline stage this rank holds (default: the whole model).  A stage
            builds only its layers (the others are :class:`OtherStageLayer`, so names and
            initial weights stay global), the embedding only on the first stage and the
            head and loss only on the last; its operator sequence starts from the
            received residual stream ``(x,)`` and, but on the last stage, ends with the
            ``(x,)`` it sends.  A post-LN block at a stage boundary applies its own output
            norm (it cannot be deferred into the next stage's first op).
        sequence_parallel: between blocks each TMP rank holds a ``1/t`` slice of the
            sequence (Megatron's sequence parallelism): every ``copy`` becomes an AllGather
            along the sequence (backward ReduceScatter) and every ``reduce`` a ReduceScatter
            (backward AllGather); norms, dropout and residual adds run on the slice.  The
            parameters every rank holds whole but now computes on its own slice (norms,
            row-parallel biases, positions) get partial gradients, summed over the group
            after each run (:meth:`sequence_parallel_params`).  One TMP degree for every
            block; the sequence must split evenly over it.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        group: Group = None,
        seed: int = 0,
        layouts: list[tuple[BlockLayout, BlockLayout]] | None = None,
        reshard_group: Callable[[int, int], Group] | None = None,
        stage: Stage | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        full = BlockLayout(group_size(group), group)
        if layouts is None:
            cfg.check_degrees(full.degree)
        elif len(layouts) != cfg.num_layers:
            raise ValueError(f"plan has {len(layouts)} layers but model.num_layers={cfg.num_layers}")
        else:  # every degree the plan uses, each block by what it splits
            cfg.check_degrees(full.degree, [a.degree for a, _ in layouts], [m.degree for _, m in layouts])
        layouts = layouts or [(full, full)] * cfg.num_layers
        self.sequence_parallel = bool(sequence_parallel) and full.degree > 1
        self._tmp_rank = group_rank(group)  # where this rank's slice of the sequence starts, in slices
        if self.sequence_parallel:
            check_sequence_parallel(cfg, full.degree, [d.degree for pair in layouts for d in pair])
        self.stage = stage or Stage(0, 1, 0, cfg.num_layers)
        if self.stage.end > cfg.num_layers or (self.stage.is_last and self.stage.end != cfg.num_layers):
            raise ValueError(f"pipeline stage {self.stage.index} holds layers [{self.stage.start}, {self.stage.end}) "
                             f"of a {cfg.num_layers}-layer model; the stages must cover the layers exactly")
        if self.stage.stages > 1 and cfg.tie_embeddings:
            raise ValueError("model.tie_embeddings with pipeline_stages > 1: the embedding (first stage) and the head "
                             "(last stage) would share one weight across stages, which is not supported; set "
                             "model.tie_embeddings=false or use one stage")
        self.sharding = Sharding(group, tuple(layouts), reshard_group)
        if self.stage.is_first:
            self.embed = Embedding(cfg, group)
        self.layers = nn.ModuleList(TransformerLayer(cfg, a.group, m.group) if self.stage.holds_layer(i) else OtherStageLayer()
                                    for i, (a, m) in enumerate(layouts))
        self.sharding.mark_replicated_shards(self.layers)
        if self.stage.is_last:
            self.head = Head(cfg, group)
        if self.stage.stages > 1:
            self._mark_for_norms()
        self.reset_parameters(seed)
        self.rng = RNGTracker(seed=seed)
        self.comm = Communicator()
        """Where the eager forward (evaluation, a plain DeepSpeedEngine) issues its collectives:
        the engine hands the model its executor's, so that evaluation is recorded with training."""
        self.ops: list[Op] = self._build_ops()
        if self.sequence_parallel:
            self.ops = sequence_parallel_ops(self.ops)

    def forward(
        self, batch: dict[str, torch.Tensor], sample_offset: int = 0, global_batch: int | None = None
    ) -> torch.Tensor:
        """Eager mean loss of ``batch``: the operator sequence in order, collectives
        synchronous through the autograd region Functions.  This is what a plain
        DeepSpeedEngine (Oases switched off) and evaluation run.

        The token count stays a tensor on the labels' device (no host sync per call); a
        batch without labelled tokens gives a NaN loss here (:func:`check_labelled_tokens`
        refuses it before a training step).  On a pipeline stage other than the last
        it returns the stage's output activation; use :meth:`stage_forward` there."""
        return self.stage_forward(batch, (), sample_offset, global_batch)[0]

    def stage_forward(self, batch: dict[str, torch.Tensor], inputs: Acts = (), sample_offset: int = 0,
                      global_batch: int | None = None) -> Acts:
        """This stage's operators in order, eagerly, from ``inputs`` (``()`` on the first
        stage, the received ``(x,)`` on the others); returns the last op's outputs:
        ``(loss,)`` on the last stage, the ``(x,)`` to send on the others."""
        labels = batch["labels"]
        loss_scale = (labels != IGNORE_INDEX).sum().to(torch.float32).reciprocal()
        ctx = OpContext(batch, sample_offset, global_batch or labels.shape[0], loss_scale, self.rng,
                        self.comm, phase="eval" if not torch.is_grad_enabled() else "forward", training=self.training)
        acts: Acts = tuple(inputs)
        for op in self.ops:
            if isinstance(op, CommOp):
                acts = acts[: op.index] + (op.apply(acts[op.index], self.comm),) + acts[op.index + 1 :]
            else:
                acts = op.fn(ctx, acts)
        return acts

    def _mark_for_norms(self) -> None:
        """With stages, DeepSpeed sums gradient norms over the model-parallel group (TMP x PP)
        and counts an unmarked (replicated) parameter only on model-parallel rank 0, which is
        on the first stage: so each stage's replicated parameters are marked on its TMP
        rank 0 instead, and every parameter is counted exactly once."""
        owner = group_rank(self.group) == 0
        for p in self.parameters():
            if getattr(p, "tp_dim", None) is None:
                p.tensor_model_parallel = p.model_parallel = owner  # type: ignore[attr-defined]

    def boundary_shape(self, layer: int, sub_batch: int, seq_len: int) -> tuple[int, int, int]:
        """Shape of the residual stream leaving layer ``layer`` for a sub-batch of
        ``sub_batch`` samples: what a stage ending with that layer sends, and the next
        receives (each replica of a reduced-degree block holds its share of the batch)."""
        replicas = self.sharding.layouts[layer][1].replicas
        seq = seq_len // self.sharding.full_degree if self.sequence_parallel else seq_len
        return (sub_batch // replicas, seq, self.cfg.hidden_size)

    @classmethod
    def for_plan(cls, cfg: ModelConfig, ctx: ParallelContext, plan: BlockDegrees, seed: int = 0,
                 stage: Stage | None = None, sequence_parallel: bool = False) -> "OperatorModel":
        """Build this rank's part of ``cfg`` with the per-block TMP degrees of ``plan``
        (on pipeline ``stage``: its layers, see the class docstring)."""
        if plan.devices != ctx.tp_size:
            raise ValueError(f"plan.devices={plan.devices} but oases.tensor_parallel_size={ctx.tp_size}")
        if plan.layers != cfg.num_layers:
            raise ValueError(f"plan has {plan.layers} layers but model.num_layers={cfg.num_layers}")
        cfg.check_degrees(ctx.tp_size, plan.attn_degrees, plan.mlp_degrees)  # before any group is made
        if sequence_parallel and ctx.tp_size > 1:
            check_sequence_parallel(cfg, ctx.tp_size, [*plan.attn_degrees, *plan.mlp_degrees])
        # every group of the whole plan, on every rank, before this stage picks its own (ParallelContext)
        ctx.create_plan_groups([d for pair in zip(plan.attn_degrees, plan.mlp_degrees) for d in pair])
        layouts = [(ctx.layout(a), ctx.layout(m)) for a, m in zip(plan.attn_degrees, plan.mlp_degrees)]
        return cls(cfg, ctx.tp_group, seed, layouts, ctx.reshard_group, stage, sequence_parallel)

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Under sequence parallelism, the parameters whose gradient on each TMP rank covers only
        its slice of the sequence and must be summed over the group: every parameter held
        whole (``tp_dim`` None) but a replicated key/value projection's, which runs on the
        gathered sequence and sums its gradient itself.  Empty without sequence parallelism."""
        if not self.sequence_parallel:
            return []
        whole_sequence = {id(p) for m in self.modules() if isinstance(m, ReplicatedHeadLinear) for p in m.parameters()}
        return [p for p in self.parameters()
                if p.requires_grad and getattr(p, "tp_dim", None) is None and id(p) not in whole_sequence]

    def _seq_start(self, x: torch.Tensor) -> int:
        """Position of ``x``'s first token in the sequence: 0, or under sequence parallelism the
        start of this rank's slice (``x`` is a slice of the residual stream)."""
        return self._tmp_rank * x.shape[1] if self.sequence_parallel else 0

    # -- weights -----------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        for name, param in self.named_parameters():
            full = init_full_parameter(name, self.sharding.full_shape(name, param), seed)
            param.copy_(self.sharding.shard_of(name, param, full))

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (e.g. from a reference model), keeping this rank's shards."""
        for name, param in self.named_parameters():
            param.copy_(self.sharding.shard_of(name, param, full[name].to(param.dtype)))

    # -- operators ---------------------------------------------------------------
    def _dropout(self, ctx: OpContext, x: torch.Tensor, site: int, offsets=None, full=None, replica: int = 0) -> torch.Tensor:
        """Dropout keyed by the global sample index (and global head index if sharded);
        ``replica`` of a reduced-degree block holds the ``replica``-th batch share."""
        if offsets is None:  # the residual stream (b, s, h): under sequence parallelism this rank's slice of s
            seq = x.shape[1] * (self.sharding.full_degree if self.sequence_parallel else 1)
            offsets = (ctx.sample_offset + replica * x.shape[0], self._seq_start(x)) + (0,) * (x.dim() - 2)
            full = (ctx.global_batch, seq) + tuple(x.shape[2:])
        return keyed_dropout(x, self.cfg.dropout, ctx.rng.key(site), offsets, full, ctx.training)

    def _build_ops(self) -> list[Op]:
        cfg = self.cfg
        pre_ln = cfg.family != "bert"
        ops: list[Op] = []
        stage = self.stage

        def compute(name: str, layer: int, block: str, fn: Callable[[OpContext, Acts], Acts], **kw) -> None:
            ops.append(ComputeOp(name, layer, block, fn, **kw))

        layouts, full = self.sharding.layouts, self.sharding.full_degree

        def defers(src: int, dst: int) -> bool:
            """Post-LN: whether a block's output norm runs in the next op (see module doc).  Only
            between blocks of one degree: a parameter's replica gradients are summed by the
            layout of the block that owns it, so it must run at that block's degree."""
            return not pre_ln and src == dst

        # degree of each block boundary's producer and consumer: embed -> L0.attn -> L0.mlp -> ... -> head
        exits = [defers(layouts[i][1].degree, layouts[i + 1][0].degree if i + 1 < cfg.num_layers else full)
                 for i in range(cfg.num_layers)]
        for boundary in (stage.start - 1, stage.end - 1):  # a stage boundary: the norm runs before the send
            if 0 <= boundary < cfg.num_layers - 1:
                exits[boundary] = False
        embed_defers = defers(full, layouts[0][0].degree)

        def embed_out(c: OpContext, a: Acts) -> Acts:
            x = a[0]
            start = self._seq_start(x)
            if cfg.family != "llama":
                x = x + self.embed.pos[start: start + x.shape[1]]
            if cfg.type_vocab_size:  # segment ids; a batch without them is all segment 0
                types = c.batch.get("token_types")
                x = x + (self.embed.types[0] if types is None
                         else F.embedding(types[:, start: start + x.shape[1]], self.embed.types))
            if embed_defers:  # post-LN: norm and dropout run in L0.attn_in (see module doc)
                return (x,)
            if cfg.family == "bert":
                x = self.embed.norm(x)
            return (self._dropout(c, x, SITE_EMBED),)

        if stage.is_first:  # vocab-parallel lookup, AllReduce, positions + dropout (+ LN for BERT)
            compute("embed", -1, "embed", lambda c, a: (self.embed.word.partial(c.batch["tokens"]),))
            ops.append(CommOp("embed_reduce", -1, "embed", 0, "all_reduce", None, self.group))
            compute("embed_out", -1, "embed", embed_out, saves_nothing=pre_ln or embed_defers, light=True)
        cos_sin = None
        if cfg.family == "llama":  # buffers, so the tables move with the module to its device
            inv_freq = rotary_inverse_frequencies(
                cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor,
                cfg.rope_high_freq_factor, cfg.rope_original_max_positions,
            )
            cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, torch.device("cpu"), inv_freq=inv_freq)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            cos_sin = True

        # the degree the residual stream arrives at: the embedding's, or the previous stage's last block's
        degree = self.sharding.full_degree if stage.is_first else layouts[stage.start - 1][1].degree
        for i in stage.layers:
            layer = self.layers[i]
            attn, mlp = self.sharding.layouts[i]
            ops.extend(self._reshard(f"L{i}.reshard_attn", i, "attn", degree, attn.degree))
            entry = embed_defers if i == 0 else exits[i - 1]
            ops.extend(self._layer_ops(i, layer, attn, mlp, pre_ln, cos_sin, entry, exits[i], defers(attn.degree, mlp.degree)))
            degree = mlp.degree
        if not stage.is_last:
            return ops
        ops.extend(self._reshard("head_reshard", cfg.num_layers, "head", degree, self.sharding.full_degree))

        def head_in(c: OpContext, a: Acts) -> Acts:
            x = a[0]
            if cfg.family == "bert":
                if exits[-1]:  # post-LN: the last block's norm (see module doc)
                    x = self.layers[-1].mlp_norm(x)
                approximate = "tanh" if cfg.mlp_act == "gelu_tanh" else "none"  # the MLP's activation, as HF's hidden_act
                return (self.head.norm(F.gelu(self.head.dense(x), approximate=approximate)),)
            return (self.head.norm(x),)

        def loss(c: OpContext, a: Acts) -> Acts:
            # Tied: the vocab-parallel embedding shard doubles as this rank's decoder rows.
            if cfg.tie_embeddings:  # BERT's tied head keeps its own bias
                logits = F.linear(a[0], self.embed.word.weight, getattr(self.head, "bias", None))
            else:
                logits = self.head.decoder.partial(a[0])
            labels = c.batch["labels"]
            group = self.group

            def all_reduce(t: torch.Tensor, op) -> torch.Tensor:
                return c.comm.all_reduce(t, group, "loss", op, label=f"loss {c.phase}").wait()

            vocab_start = group_rank(group) * logits.shape[-1]
            per_token = vocab_parallel_cross_entropy(logits, labels, vocab_start, all_reduce, cfg.vocab_size)
            valid = (labels != IGNORE_INDEX).to(per_token.dtype)
            return ((per_token * valid).sum() * c.loss_scale,)

        L = cfg.num_layers
        compute("head_in", L, "head", head_in)
        ops.append(CommOp("head_copy", L, "head", 0, None, "all_reduce", self.group))
        compute("loss", L, "head", loss, is_loss=True)
        return ops

    def _reshard(self, name: str, layer: int, block: str, src: int, dst: int) -> list[Op]:
        """:func:`reshard_ops` on the reshard group between the two degrees."""
        if src == dst:
            return []
        if self.sharding.reshard_group is None:
            raise ValueError("layouts mix TMP degrees but no reshard_group was given")
        return reshard_ops(name, layer, block, src, dst, self.sharding.reshard_group(min(src, dst), max(src, dst)))

    def _layer_ops(self, i: int, layer: TransformerLayer, attn_layout: BlockLayout, mlp_layout: BlockLayout, pre_ln: bool,
                   cos_sin: bool | None, entry_norm_here: bool, mlp_norm_deferred: bool,
                   attn_norm_deferred: bool) -> list[Op]:
        """One layer's ops.  Post-LN: ``entry_norm_here`` -- the previous block (or the
        embedding: norm and dropout) deferred its output norm to this ``attn_in``;
        ``attn_norm_deferred`` / ``mlp_norm_deferred`` -- this layer's block output norms
        run in the next op rather than at the end of ``attn_out`` / ``mlp_out``."""
        cfg = self.cfg
        out: list[Op] = []
        attn_group = attn_layout.group
        nh_local = layer.attn.q.out_local // cfg.head_dim
        kv_local = layer.attn.k.out_local // cfg.head_dim
        head_offset = group_rank(attn_group) * nh_local

        def add(name: str, block: str, fn, saves_nothing: bool = False, graph_only_recompute: bool = False,
                parts: tuple[ComputeOp, ...] = ()) -> None:
            out.append(ComputeOp(f"L{i}.{name}", i, block, fn, saves_nothing=saves_nothing,
                                 graph_only_recompute=graph_only_recompute, light=name.endswith(("_in", "_out")),
                                 parts=parts))

        # Post-LN: the previous layer's output norm runs here (see module doc); before
        # layer 0, the embedding's norm and dropout.
        entry_norm = None
        if entry_norm_here:  # never across a stage boundary (see _build_ops), so the module is on this stage
            entry_norm = self.embed.norm if i == 0 else self.layers[i - 1].mlp_norm

        def attn_in(c: OpContext, a: Acts) -> Acts:
            x = a[0]
            if pre_ln:
                return (x, layer.attn_norm(x))
            if entry_norm_here:
                x = entry_norm(x)
                if i == 0:
                    x = self._dropout(c, x, SITE_EMBED, replica=attn_layout.replica)
            return (x, x)

        def qkv(c: OpContext, a: Acts) -> Acts:
            x, h = a
            b, s, _ = h.shape

            def heads(t: torch.Tensor, n: int) -> torch.Tensor:
                return t.view(b, s, n, cfg.head_dim).transpose(1, 2)

            q = heads(layer.attn.q.partial(h), nh_local)
            k, v = heads(layer.attn.k.partial(h), kv_local), heads(layer.attn.v.partial(h), kv_local)
            if cos_sin:
                cos, sin = (t[:s].to(dtype=q.dtype) for t in (self.rope_cos, self.rope_sin))
                q, k = apply_rotary(q, cos, sin, cfg.rotary), apply_rotary(k, cos, sin, cfg.rotary)
            if kv_local != nh_local:  # grouped-query: each k/v head serves nh/nkv consecutive query heads
                k, v = (t.repeat_interleave(nh_local // kv_local, dim=1) for t in (k, v))
            return (x, q, k, v)

        def core(c: OpContext, a: Acts) -> Acts:
            x, q, k, v = a

            def drop(p: torch.Tensor) -> torch.Tensor:
                offsets = (c.sample_offset + attn_layout.replica * p.shape[0], head_offset, 0, 0)
                full = (c.global_batch, cfg.num_heads, p.shape[2], p.shape[3])
                return self._dropout(c, p, dropout_site(i, "attn_probs"), offsets, full)

            # No dropout callable -> the fused SDPA route (eval, or attention dropout 0).
            active = drop if c.training and cfg.dropout > 0.0 else None
            key_mask = c.batch.get("attention_mask")  # (b, s), 1 = a real token (BERT padding)
            if key_mask is not None:  # this replica's rows of the batch, as the dropout offsets above
                key_mask = key_mask[attn_layout.replica * q.shape[0]:(attn_layout.replica + 1) * q.shape[0]]
            return (x, attention_core(q, k, v, causal=cfg.family != "bert", dropout=active, key_mask=key_mask))

        def proj(c: OpContext, a: Acts) -> Acts:
            return (a[0], layer.attn.o.partial(a[1], values=c.outputs_needed))

        def attn_out(c: OpContext, a: Acts) -> Acts:
            x, y = a
            x = x + self._dropout(c, layer.attn.o.add_bias(y), dropout_site(i, "attn_out"), replica=attn_layout.replica)
            return (x,) if pre_ln or attn_norm_deferred else (layer.attn_norm(x),)

        def mlp_in(c: OpContext, a: Acts) -> Acts:
            x = a[0]
            if pre_ln:
                return (x, layer.mlp_norm(x))
            if attn_norm_deferred:  # post-LN: the attention block's output norm
                x = layer.attn_norm(x)
            return (x, x)

        def mlp(c: OpContext, a: Acts) -> Acts:
            x, h = a
            return mlp_down(c, (x, mlp_inner(h)))

        def mlp_inner(h: torch.Tensor) -> torch.Tensor:
            if cfg.family == "llama":
                return F.silu(layer.mlp.gate.partial(h)) * layer.mlp.up.partial(h)
            approximate = "tanh" if cfg.mlp_act == "gelu_tanh" else "none"
            return F.gelu(layer.mlp.fc1.partial(h), approximate=approximate)

        def mlp_up_chunk(k: int) -> Callable[[OpContext, Acts], Acts]:
            """Chunk ``k`` of the column-parallel half on the gathered tokens: ``(x, h, inner_0 ..
            inner_{k-1}) -> (x, h, inner_0 .. inner_k)``, the last chunk without ``h``; each ``inner``
            ``[tokens, F/t]``, the sub-batch's tokens flattened."""
            def up(c: OpContext, a: Acts) -> Acts:
                x, h, *done = a
                flat = h.reshape(-1, h.shape[-1])
                start, end = mlp_up_chunk_bounds(flat.shape[0], h.shape[1])[k]
                inner = mlp_inner(flat[start:end])
                return (x, *done, inner) if k == MLP_UP_CHUNKS - 1 else (x, h, *done, inner)
            return up

        def mlp_down(c: OpContext, a: Acts) -> Acts:
            x, *inners = a
            row = layer.mlp.down if cfg.family == "llama" else layer.mlp.fc2
            if len(inners) == 1:
                return (x, row.partial(inners[0], values=c.outputs_needed))
            # the sequence-parallel chunks of the flattened tokens; y is [b, s, H] (x is [b, s/t, H])
            return (x, row.partial_of_chunks(inners, x.shape[0], values=c.outputs_needed))

        def mlp_out(c: OpContext, a: Acts) -> Acts:
            x, y = a
            row = layer.mlp.down if cfg.family == "llama" else layer.mlp.fc2
            x = x + self._dropout(c, row.add_bias(y), dropout_site(i, "mlp_out"), replica=mlp_layout.replica)
            return (x,) if pre_ln or mlp_norm_deferred else (layer.mlp_norm(x),)

        add("attn_in", "attn", attn_in)
        out.append(CommOp(f"L{i}.attn_copy", i, "attn", 1, None, "all_reduce", attn_group))
        add("qkv", "attn", qkv)
        add("core", "attn", core)
        add("proj", "attn", proj, graph_only_recompute=True)
        out.append(CommOp(f"L{i}.attn_reduce", i, "attn", 1, "all_reduce", None, attn_group))
        add("attn_out", "attn", attn_out, saves_nothing=pre_ln or attn_norm_deferred)
        out.extend(self._reshard(f"L{i}.reshard_mlp", i, "mlp", attn_layout.degree, mlp_layout.degree))
        add("mlp_in", "mlp", mlp_in)
        mlp_group = mlp_layout.group
        out.append(CommOp(f"L{i}.mlp_copy", i, "mlp", 1, None, "all_reduce", mlp_group))
        add("mlp", "mlp", mlp, graph_only_recompute=True,
            parts=(*(ComputeOp(f"mlp_up{k}", i, "mlp", mlp_up_chunk(k), continues=k > 0) for k in range(MLP_UP_CHUNKS)),
                   ComputeOp("mlp_down", i, "mlp", mlp_down, graph_only_recompute=True)))
        out.append(CommOp(f"L{i}.mlp_reduce", i, "mlp", 1, "all_reduce", None, mlp_group))
        add("mlp_out", "mlp", mlp_out, saves_nothing=pre_ln or mlp_norm_deferred)
        return out


def check_sequence_parallel(cfg: ModelConfig, degree: int, block_degrees: Sequence[int]) -> None:
    """Refuse, in one line, a model sequence parallelism cannot split: a sequence the TMP degree
    does not divide, or blocks of different degrees (a reshard between degrees moves the batch,
    and under sequence parallelism the slices of the sequence would have to move too)."""
    if cfg.seq_len % degree:
        raise ValueError(f"sequence_parallel splits the sequence over the {degree} TMP ranks but model.seq_len="
                         f"{cfg.seq_len} is not divisible by {degree}; use a multiple of {degree} or sequence_parallel=false")
    mixed = sorted({d for d in block_degrees if d != degree})
    if mixed:
        raise ValueError(f"sequence_parallel needs every block at the full TMP degree {degree}, but the plan puts blocks at "
                         f"degree {mixed[0]}; plan with planner.min_degree={degree} or set sequence_parallel=false")


def sequence_parallel_ops(ops: Sequence[Op]) -> list[Op]:
    """``ops`` under sequence parallelism: each ``copy`` (forward identity, backward AllReduce)
    becomes an AllGather along the sequence (backward ReduceScatter) and each ``reduce``
    (forward AllReduce) a ReduceScatter along it (backward AllGather); a compute op with
    :attr:`~oases_ds.models.ops.ComputeOp.parts` (the MLP) runs as its parts; other compute ops
    and the reshards between degrees are unchanged.  The one rule :class:`OperatorModel` applies and
    the cost and memory models can apply to :func:`plan_ops`."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, ComputeOp) and op.parts:  # the MLP as two ops: a point for the other sub-batch to hop in
            prefix = op.name.rsplit(".", 1)[0] + "." if "." in op.name else ""
            out.extend(dataclasses.replace(part, name=prefix + part.name, layer=op.layer, block=op.block)
                       for part in op.parts)
            continue
        if isinstance(op, CommOp) and (op.forward, op.backward) == (None, "all_reduce"):
            op = dataclasses.replace(op, forward="all_gather", backward="reduce_scatter", dim=1)
        elif isinstance(op, CommOp) and (op.forward, op.backward) == ("all_reduce", None):
            op = dataclasses.replace(op, forward="reduce_scatter", backward="all_gather", dim=1)
        out.append(op)
    return out


def reshard_ops(name: str, layer: int, block: str, src: int, dst: int, group: Group = None) -> list[Op]:
    """The operator moving the residual stream ``(x,)`` from TMP degree ``src`` to ``dst`` (none at one degree).

    Towards a lower degree there are more replicas, each keeping its share of the batch: a local
    ``split`` forward, whose gradient is an AllGather.  Towards a higher degree the shares are gathered:
    an AllGather forward, a ``split`` of the gradient.  The one rule :class:`OperatorModel` builds its
    reshards by and :func:`plan_ops` models them by."""
    if src == dst:
        return []
    if dst < src:
        return [CommOp(name, layer, block, 0, "split", "all_gather", group, dim=0)]
    return [CommOp(name, layer, block, 0, "all_gather", "split", group, dim=0)]


@functools.lru_cache(maxsize=None)
def one_layer_ops(family: str, sequence_parallel: bool = False) -> tuple[Op, ...]:
    """The operator sequence of a one-layer model of ``family`` (``sequence_parallel``: as
    :func:`sequence_parallel_ops` rewrites it, the sequence a profile under sequence
    parallelism indexes its per-op times by).

    The sequence (names, blocks, collectives) depends on the family only, not on
    the sizes, so it is read off a tiny stand-in: the cost and memory models follow
    the real operator list and fail loudly if an operator they cannot price appears.
    """
    stand_in = ModelConfig(family=family, vocab_size=8, hidden_size=8, num_heads=2, num_layers=1, seq_len=2)
    ops = OperatorModel(stand_in).ops
    return tuple(sequence_parallel_ops(ops) if sequence_parallel else ops)


def plan_ops(family: str, attn_degrees: Sequence[int], mlp_degrees: Sequence[int],
             devices: int, sequence_parallel: bool = False) -> tuple[list[Op], list[int]]:
    """The operator sequence a plan builds, and each op's TMP degree (a reshard's: the degree it
    reshards to), with no process group: the one-layer sequence repeated, and :func:`reshard_ops`
    wherever the degree changes, as :class:`OperatorModel` places its own (into each block, and into
    the head at the full degree).  A paper-size plan is modelled without building the paper-size model.
    ``sequence_parallel``: rewritten by :func:`sequence_parallel_ops`, each part of a split op at
    the degree of the op it replaces."""
    if len(attn_degrees) != len(mlp_degrees):
        raise ValueError(f"plan has {len(attn_degrees)} attention and {len(mlp_degrees)} MLP degrees")
    base = one_layer_ops(family)
    ops: list[Op] = [op for op in base if op.block == "embed"]
    degrees = [devices] * len(ops)
    current = devices

    def reshard(name: str, layer: int, block: str, target: int) -> None:
        nonlocal current
        moved = reshard_ops(name, layer, block, current, target)
        ops.extend(moved)
        degrees.extend([target] * len(moved))
        current = target

    for index, (attn, mlp) in enumerate(zip(attn_degrees, mlp_degrees)):
        for kind, degree in (("attn", attn), ("mlp", mlp)):
            reshard(f"L{index}.reshard_{kind}", index, kind, degree)
            for op in base:
                if op.block == kind:
                    ops.append(dataclasses.replace(op, name=f"L{index}.{op.name.split('.', 1)[-1]}", layer=index))
                    degrees.append(degree)
    reshard("head_reshard", len(attn_degrees), "head", devices)
    head = [dataclasses.replace(op, layer=len(attn_degrees)) for op in base if op.block == "head"]
    ops, degrees = ops + head, degrees + [devices] * len(head)
    if family == "bert":  # post-LN: before a reshard the block normalises its own output (OperatorModel's
        for j, op in enumerate(ops):  # ``defers``), so its *_out op saves the norm's input: no kept tail
            if isinstance(op, CommOp) and "reshard" in op.name and isinstance(ops[j - 1], ComputeOp):
                ops[j - 1] = dataclasses.replace(ops[j - 1], saves_nothing=False)
    if not sequence_parallel:
        return ops, degrees
    widths = [len(op.parts) if isinstance(op, ComputeOp) and op.parts else 1 for op in ops]
    return sequence_parallel_ops(ops), [d for d, n in zip(degrees, widths) for _ in range(n)]
