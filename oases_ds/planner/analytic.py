"""A cost table from first principles: FLOPs, bytes and a link model, nothing run.

Why: the profiler (:mod:`oases_ds.planner.profile`) measures one layer on this
machine.  A paper-size layer (GPT-39.1B: h=8192) neither fits a 2-core CPU nor
would its CPU times say anything about an RTX 3090.  So for planning and "what
if" studies at the paper's sizes this module fills the *same*
:class:`~oases_ds.planner.costs.CostTable` -- same fields, same meaning, same
units: per device, per training step of one micro-batch, ms and bytes -- from
the model's shapes, the cluster's device throughput and its link.  What the
profiler measures is computed here; what the profiler already derives (exposed
communication, the reshard edge) goes through the same functions.

Formulas, for a block at TMP degree ``t`` in a TMP group of ``T`` devices, with
hidden size ``H``, MLP width ``F``, sequence ``s``, micro-batch ``B`` split into
``k`` sub-batches (the schedule's):

* **Work per device.**  The ``T/t`` replicas split the micro-batch, so a device
  runs ``B t / T`` samples, ``n = B t s / T`` tokens (as the profiler does).
* **Forward FLOPs per token of a degree-t shard** (multiply-add = 2 FLOPs), only
  matrix products: QKV ``6 H^2/t``, scores and context ``4 s H/t`` (full s x s,
  no causal saving, as Megatron counts), output projection ``2 H^2/t``, MLP
  ``4 H F/t`` (GeLU) or ``6 H F/t`` (SwiGLU's three matrices).  For GPT this is
  Megatron's ``24 H^2 + 4 s H`` per token and layer at t=1.  Per device the
  forward of a block is therefore ``B s / T`` tokens' full-width FLOPs: the same
  at every degree -- TMP degree moves communication and memory, not work.
* **Time** = FLOPs / (``peak_tflops * achieved_fraction``), the cluster's device.
  Backward = 2 x forward (a gradient for the input and one for the weight per
  product); recompute = forward of the ops the schedule recomputes
  (:func:`~oases_ds.schedule.generators.schedule_segments`).
* **Raw TMP communication**: a ring AllReduce of one sub-batch's activation
  (``n/k x H`` fp16) on the ``t`` ranks, timed by the runtime's
  :class:`~oases_ds.parallel.link.LinkModel` (the emulator's model), times the
  block's forward / backward collectives and ``k``.  What the schedule leaves
  *exposed* -- inside the block and, for the last sub-batch, on the edge to the
  next block -- comes from :func:`~oases_ds.planner.costmodel.pipelined_comm_ms`,
  exactly as the profiler's default ``exposed=model``.
* **Gradient sync**: a ring AllReduce of the block's per-device gradients (fp16)
  over its ``T/t`` replicas, on the same link.
* **Memory**: parameters per device (:func:`~oases_ds.models.blocks.layer_parameter_counts`)
  x 16 bytes, plus the fp16 activations the block holds across the step, and the
  table's constant (embedding, head, logits, working set, collectives in flight),
  both from :func:`~oases_ds.planner.memory.memory_rows` -- the same model the
  profiler's table and ``oases-plan``'s per-rank peak use.
* **Reshard edge**: the table stores one sub-batch's block-boundary activation
  in fp16 and the link; :func:`~oases_ds.planner.costs.reshard_ms` prices it.

Assumptions (stated, not measured):

* fp16 activations, TMP payloads, checkpoints and gradients (2 bytes).
* Mixed-precision Adam: 16 bytes per parameter = fp16 weight + fp16 gradient
  (2 + 2) + fp32 master weight, first and second moment (4 + 4 + 4).  (The CPU
  profiler's fp32 weight + gradient + two moments is also 16.)
* One sustained throughput for every matrix product; elementwise work (norms,
  softmax, dropout, residuals, GeLU) is not counted -- it is a few FLOPs per
  element against ``~24 H`` per element for the products, and its memory-bound
  time is what ``achieved_fraction`` absorbs.  Smaller per-shard GEMMs at high
  ``t`` and sub-batch splitting do not lower the throughput here.
* Collectives: ring algorithm, bandwidth and latency of the cluster's link for
  every group size (one flat link, as in the emulator); no compute slowdown
  from a concurrent collective.
* Embedding and head are outside the table, as in a profile.
* Oases ablations (``cross_pass`` or ``fine_grained_recompute`` off) get their own
  recompute and memory, but their exposed communication is priced as full Oases'
  by :func:`~oases_ds.planner.costmodel.pipelined_comm_ms`, as in a profile with
  ``exposed=model``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any
from dataclasses import dataclass

from oases_ds.models.blocks import layer_parameter_counts
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import MLP_UP_CHUNKS, mlp_up_chunk_share, one_layer_ops
from oases_ds.models.ops import CommOp, sequence_gather, short_name
from oases_ds.planner.costmodel import BlockTiming, pipelined_comm_ms
from oases_ds.planner.costs import BLOCK_KINDS, STATE_BYTES_PER_PARAM, BlockCost, CostTable, DegreeProfile, OpTimes, PassTimes
from oases_ds.planner.memory import memory_rows
from oases_ds.planner.profile import ProfileSpec
from oases_ds.schedule.generators import schedule_segments

ACTIVATION_BYTES = 2
"""fp16 activations: checkpoints, TMP AllReduce payloads, resharded tensors."""

GRADIENT_BYTES = 2
"""fp16 gradients, as mixed-precision data parallelism all-reduces them."""

BACKWARD_FLOPS_RATIO = 2
"""Backward of a matrix product: one product for the input gradient, one for the weight gradient."""


@dataclass(frozen=True)
class DeviceModel:
    """A device as the analytic model sees it: one sustained dense throughput.

    Attributes:
        name: label, e.g. "rtx3090".
        peak_tflops: peak dense throughput for the training dtype (TFLOP/s).
        achieved_fraction: share of the peak a training step sustains (0, 1].
    """

    name: str
    peak_tflops: float
    achieved_fraction: float = 0.4

    def __post_init__(self) -> None:
        if not 0 < self.peak_tflops < math.inf:
            raise ValueError(f"cluster.device.peak_tflops must be > 0, got {self.peak_tflops!r}")
        if not 0 < self.achieved_fraction <= 1:
            raise ValueError(f"cluster.device.achieved_fraction must be in (0, 1], got {self.achieved_fraction!r}")

    @classmethod
    def from_cluster(cls, cluster: dict[str, Any]) -> DeviceModel:
        """The device of a cluster profile (``configs/cluster/*.yaml``: ``name``, ``link``, ``device``); one
        line naming what is missing, since without a link and a device nothing can be computed."""
        missing = [f"cluster.{key}" for key in ("link", "device") if not cluster.get(key)]
        if missing:
            raise ValueError(f"cost=analytic needs cluster.link and cluster.device; cluster={cluster['name']} has no "
                             f"{' and no '.join(missing)}: pick a cluster that states both (e.g. cluster=pcie_3090) "
                             f"or use cost=profile")
        try:
            return cls(**cluster["device"])
        except TypeError as err:
            raise ValueError(f"cluster.device: {err}; give name, peak_tflops and achieved_fraction") from None

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.achieved_fraction

    def label(self) -> str:
        return f"{self.name}@{self.peak_tflops * self.achieved_fraction:g}TFLOPs"


@dataclass(frozen=True)
class OpShape:
    """What one compute operator costs per token on a degree-t shard.

    Attributes:
        flops: forward FLOPs of its matrix products.
    """

    flops: float


def op_shapes(cfg: ModelConfig, degree: int) -> dict[str, OpShape]:
    """Per-token cost of each attention / MLP operator, by the name the model gives it
    (``L0.qkv`` -> ``qkv``); the input tuples are those of
    :mod:`oases_ds.models.operator_model` (``(x, h)``, ``(x, q, k, v)``, ...), where
    ``x``, ``h`` and a reduced ``y`` are full width and ``q``, ``k``, ``v`` and the
    attention context are this shard's ``H/t`` heads."""
    H, F, s, t = cfg.hidden_size, cfg.ffn, cfg.seq_len, degree
    mlp_matrices = 3 if cfg.family == "llama" else 2
    up = 2 * H * F * (mlp_matrices - 1) / t  # under sequence parallelism in chunks of the sequence
    return {
        **{f"mlp_up{k}": OpShape(up * mlp_up_chunk_share(s, k)) for k in range(MLP_UP_CHUNKS)},
        "attn_in": OpShape(0.0),
        "qkv": OpShape(2 * H * 3 * H / t),
        "core": OpShape(2 * 2 * s * H / t),
        "proj": OpShape(2 * H * H / t),
        "attn_out": OpShape(0.0),
        "mlp_in": OpShape(0.0),
        "mlp": OpShape(2 * H * F * mlp_matrices / t),
        "mlp_down": OpShape(2 * H * F / t),
        "mlp_out": OpShape(0.0),
    }


def block_forward_flops(cfg: ModelConfig, kind: str, degree: int, tokens: float) -> float:
    """Forward FLOPs of one ``kind`` block on a degree-``degree`` shard running ``tokens`` tokens."""
    ops = one_layer_ops(cfg.family)
    return sum(shape.flops for i, shape in _shapes_by_op(cfg, degree).items() if ops[i].block == kind) * tokens


def _shapes_by_op(cfg: ModelConfig, degree: int, sequence_parallel: bool = False) -> dict[int, OpShape]:
    """Operator index -> shape, for every compute op of an attention or MLP block of the one-layer
    sequence (under ``sequence_parallel``, the rewritten one, whose MLP is two ops)."""
    shapes = op_shapes(cfg, degree)
    out = {}
    for index, op in enumerate(one_layer_ops(cfg.family, sequence_parallel)):
        if op.block not in BLOCK_KINDS or isinstance(op, CommOp):
            continue
        short = short_name(op)
        if short not in shapes:
            raise ValueError(f"the analytic cost model has no FLOP/size entry for operator {op.name!r} "
                             f"({cfg.family}); add it to oases_ds.planner.analytic.op_shapes")
        out[index] = shapes[short]
    return out


def head_ms(spec: ProfileSpec, device: DeviceModel) -> float:
    """Forward + backward of the head's vocabulary projection per micro-batch on one device
    (the last pipeline stage runs it; the table leaves it out): ``2 H V / T`` FLOPs per
    token forward on the full TMP group of ``T``, every token of the micro-batch, backward
    twice that.  The embedding is a lookup (no product) and counts 0; norms, softmax and
    cross-entropy are elementwise, in ``achieved_fraction`` as for the blocks."""
    cfg = spec.model
    tokens = spec.micro_batch * cfg.seq_len
    forward = 2 * cfg.hidden_size * cfg.vocab_size / spec.devices * tokens
    return forward * (1 + BACKWARD_FLOPS_RATIO) / device.flops_per_s * 1e3


def analytic_table(spec: ProfileSpec, device: DeviceModel, layers: int) -> CostTable:
    """The cost table the profiler would fill for ``spec``, computed (see module doc).

    ``spec`` describes the workload and the cluster exactly as for profiling;
    ``spec.link`` is required (it times every collective) and the profiling
    knobs (warmup, repeats, exposed, seed) are unused.

    With ``spec.sequence_parallel`` each block's AllReduce becomes a ReduceScatter and an
    AllGather of the same payload (``(t-1)/t`` of it each on a ring, the AllReduce's wire bytes
    together), and policy ``oases`` re-gathers the block's input in its recomputation (one more
    AllGather per sub-batch, priced with the backward's collectives, which the other sub-batch's
    recompute and backward cover; recorded as ``regather_ms``, so that
    :func:`~oases_ds.planner.policies.with_store_costs` prices ``store`` and ``oases_gathered``
    without it).
    """
    if spec.link is None:
        raise ValueError("the analytic cost model needs a link (bandwidth, latency) to time collectives; "
                         "give the spec a LinkModel")
    cfg, link, sub, T = spec.model, spec.link, spec.sub_batches, spec.devices
    sp = spec.sequence_parallel and T > 1
    ops = list(one_layer_ops(cfg.family, sp))
    segments = schedule_segments(spec.schedule, ops)
    recomputed = {i for seg in segments if seg.recompute for i in range(seg.start, seg.recompute_end)}
    memory = memory_rows(cfg, spec.schedule, T, spec.micro_batch, spec.degrees(), ACTIVATION_BYTES, sp)
    collectives = {
        kind: (sum(isinstance(op, CommOp) and op.block == kind and op.forward is not None for op in ops),
               sum(isinstance(op, CommOp) and op.block == kind and op.backward is not None for op in ops))
        for kind in BLOCK_KINDS
    }
    regathers = {kind: sum(sequence_gather(ops[i]) and ops[i].block == kind for i in recomputed) for kind in BLOCK_KINDS}

    def ms(flops: float) -> float:
        return flops / device.flops_per_s * 1e3

    blocks: dict[str, dict[int, BlockCost]] = {kind: {} for kind in BLOCK_KINDS}
    evidence: dict[str, dict] = {}
    op_profile: dict[int, DegreeProfile] = {}
    for degree in spec.degrees():
        tokens = spec.micro_batch * degree / T * cfg.seq_len  # this device's replica's share
        shapes = _shapes_by_op(cfg, degree, sp)
        payload = tokens / sub * cfg.hidden_size * ACTIVATION_BYTES  # one sub-batch's activation
        # a block's collective: the AllReduce, or under sequence parallelism one of its halves
        allreduce_ms = link.seconds("all_gather" if sp else "all_reduce", payload, degree) * 1e3
        params = layer_parameter_counts(cfg, degree)
        evidence[str(degree)] = {"tokens_per_device": tokens, "allreduce_ms": allreduce_ms, "blocks": {}}
        # per-op ms per sub-batch, as the profiler's, so a plan is replayed on this table as on a profile
        op_ms = OpTimes(forward_ms={i: ms(shape.flops * tokens / sub) for i, shape in shapes.items()},
                        backward_ms={i: ms(shape.flops * tokens / sub) * BACKWARD_FLOPS_RATIO for i, shape in shapes.items()})
        block_ms: dict[str, PassTimes] = {}
        for kind in BLOCK_KINDS:
            mine = {i: shape for i, shape in shapes.items() if ops[i].block == kind}
            forward = block_forward_flops(cfg, kind, degree, tokens)
            recompute = sum(shape.flops for i, shape in mine.items() if i in recomputed) * tokens
            n_fwd, n_bwd = collectives[kind]
            timing = BlockTiming(
                fwd_ms=ms(forward),
                recompute_ms=ms(recompute),
                bwd_ms=ms(BACKWARD_FLOPS_RATIO * forward),
                comm_fwd_ms=n_fwd * sub * allreduce_ms,
                comm_bwd_ms=(n_bwd + regathers[kind]) * sub * allreduce_ms,
            )
            exposed = pipelined_comm_ms(timing, spec.schedule)
            blocks[kind][degree] = BlockCost(
                fwd_ms=timing.fwd_ms,
                bwd_ms=timing.recompute_ms + timing.bwd_ms,
                comm_fwd_ms=exposed[0],
                comm_bwd_ms=exposed[1],
                state_bytes=float(params[kind] * STATE_BYTES_PER_PARAM),
                act_bytes=memory.act_bytes[kind][degree],
                grad_sync_ms=link.seconds("all_reduce", params[kind] * GRADIENT_BYTES, T // degree) * 1e3,
                comm_fwd_last_ms=exposed[2],
                comm_bwd_last_ms=exposed[3],
            )
            evidence[str(degree)]["blocks"][kind] = {
                **dataclasses.asdict(timing),
                "regather_ms": regathers[kind] * sub * allreduce_ms,
                "forward_flops": forward,
                "exposed_modelled_ms": list(exposed),
                "params_per_device": params[kind],
            }
            block_ms[kind] = PassTimes(timing.fwd_ms, timing.recompute_ms, timing.bwd_ms)
        op_profile[degree] = DegreeProfile(op_ms, int(payload), block_ms)
    return CostTable(
        model=spec.model_label(),
        cluster=f"{spec.cluster_label()},{device.label()},analytic",
        schedule=spec.schedule,
        family=cfg.family,
        op_profile=op_profile,
        devices=T,
        degrees=spec.degrees(),
        blocks=blocks,
        layers=layers,
        reshard_bytes=float(spec.micro_batch // sub * cfg.seq_len * cfg.hidden_size * ACTIVATION_BYTES),
        bandwidth_gbps=link.bandwidth_gbps,
        latency_us=link.latency_us,
        sub_batches=sub,
        fixed_bytes=memory.fixed_bytes,
        stage_fixed_bytes=memory.stage_fixed_bytes,
        sequence_parallel=sp,
        measurements={
            "memory": memory.evidence,
            "source": "analytic (oases_ds.planner.analytic): FLOPs / device throughput, LinkModel collectives",
            "device": dataclasses.asdict(device),
            "assumptions": {
                "activation_bytes": ACTIVATION_BYTES,
                "gradient_bytes": GRADIENT_BYTES,
                "state_bytes_per_param": STATE_BYTES_PER_PARAM,
                "backward_flops_ratio": BACKWARD_FLOPS_RATIO,
                "flops_counted": "matrix products only; elementwise work in achieved_fraction",
            },
            "exposed_source": "model",
            "times": "ms per micro-batch share per device, computed",
            "degrees": evidence,
        },
    )
