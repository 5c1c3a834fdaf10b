"""Per-rank peak memory in bytes: what the planner bounds and what a step really holds.

Why a replay and not ``params x 16 + held inputs``: the old estimate counted each
held operator's input tuple and nothing else, so it missed what autograd saves
*inside* a kept operator (attention probabilities ``b heads s s``, the MLP's
``F``-wide intermediates, the norms' inputs), the working set of the block being
recomputed and backpropagated, the head's vocab-parallel softmax and the
collectives in flight.  Here the schedule's own instruction list
(:func:`~oases_ds.schedule.generators.build_schedule`, cut by
:func:`~oases_ds.schedule.generators.schedule_segments`) is replayed over the
operator sequence with sizes instead of tensors: buffers appear when an
instruction writes them and die where :func:`~oases_ds.schedule.dataflow.last_reads`
says -- the rule the executor frees by -- so the model follows any change to the
segment structure (what is checkpointed, which op keeps its graph) without
being edited.  What an operator adds is one table, :func:`op_memory`.

The peak is the largest sum over the replay of:

* **model states**: parameters this rank holds x
  :data:`~oases_ds.planner.costs.STATE_BYTES_PER_PARAM` (weight, gradient, Adam
  moments; constant over the step);
* **checkpoints**: the input tuple of each recomputed segment, held from its
  forward until its Recompute (for Oases one ``[b,s,h]`` tensor per block: the
  output of the block's kept tail op);
* **kept graphs**: every operator run with ``keep_graph`` holds its outputs and
  what autograd saved, inputs included only where saved (:func:`op_memory`; the
  executor's grad taps keep nothing else alive), embedding and head included;
* **transient**: the graph of the segment being recomputed, the gradients in
  flight between backward instructions, activations between two operators;
* **logits**: the head's vocab-parallel softmax (``V/t`` per token, fp32: the
  cross-entropy Function computes in fp32 whatever the activation dtype);
* **comm in flight**: each started, not yet synced collective's out-of-place
  payload (a clone for AllReduce, ``k`` parts for AllGather, the contiguous input
  and the ``1/t`` output for ReduceScatter) -- the executor's buffers do not show it
  (it lives in the handle), so it is reported apart from
  :attr:`MemoryEstimate.activation_bytes`.

Under sequence parallelism (``sequence_parallel``) the same replay runs over
:func:`~oases_ds.models.operator_model.sequence_parallel_ops`: the ops between a
block's ReduceScatter and the next AllGather (:func:`sequence_sliced`) see ``1/t`` of
the tokens, an AllGather's result is ``t`` times its input, a ReduceScatter's ``1/t``.

Assumptions, stated: eager PyTorch autograd as of the pinned version (what each
op saves is read off its code, checked against
:class:`~oases_ds.bench.measure.ActivationProbe` in tests); activations in one
dtype of ``dtype_bytes``; norm statistics (mean, rstd) and SDPA's logsumexp in
fp32; the causal mask one ``s x s`` bool per attention call with dropout (SDPA
builds none); the attention route chosen by ``model.dropout`` (training); the rotary tables (model buffers, shared)
not counted; the autograd engine's scratch inside one backward instruction not
counted (it is freed before the next instruction, where the probe samples).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Sequence

from oases_ds.models.blocks import (embed_head_parameter_count, end_parameter_counts, largest_parameter_count,
                                    layer_parameter_counts)
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import MLP_UP_CHUNKS, mlp_up_chunk_share, plan_ops
from oases_ds.models.ops import CommOp, Op, moves_bytes, short_name
from oases_ds.planner.costs import PRECISIONS, STATE_BYTES_PER_PARAM, BlockCost, CostTable, ModelStates
from oases_ds.schedule.dataflow import initial_buffers, last_reads, unread_recomputes
from oases_ds.schedule.generators import ScheduleSpec, build_schedule, schedule_segments
from oases_ds.schedule.instructions import Backward, Forward, Recompute, StartAsync, Sync

NORM_STAT_BYTES = 4
"""Mean / inverse-RMS of a norm are kept in fp32 per token, whatever the activation dtype."""

LOSS_BYTES = 4
"""The vocab-parallel cross-entropy computes its softmax in fp32 (``logits.float()``)."""

SAME_AS_PREVIOUS = -1
"""An :attr:`OpMemory.outputs` entry: the same tensor as the output before it (BERT's ``(x, x)``)."""

TERMS: tuple[str, ...] = ("checkpoint", "kept", "transient", "logits", "comm")
"""Activation terms of :class:`MemoryEstimate`, in the order they are reported."""


def sequence_sliced(ops: Sequence[Op]) -> list[bool]:
    """Which ops run on this rank's ``1/t`` slice of the sequence: those after a ReduceScatter
    and before the next AllGather along the sequence (norms, dropout, residual adds), read off
    the sequence itself; all ``False`` without sequence parallelism."""
    sliced, out = False, []
    for op in ops:
        if isinstance(op, CommOp) and op.dim == 1 and op.forward in ("reduce_scatter", "all_gather"):
            sliced = op.forward == "reduce_scatter"
        out.append(sliced and not isinstance(op, CommOp))
    return out


@dataclass(frozen=True)
class OpMemory:
    """What one compute operator adds, per token of its sub-batch share.

    Attributes:
        outputs: one entry per output tuple element: an ``int`` is the index of the
            input element handed on unchanged (same storage), :data:`SAME_AS_PREVIOUS`
            the previous output again, a ``float`` a new tensor of that many bytes per token.
        saved_inputs: indices of the inputs autograd saves (their storage stays
            alive with the op's graph; the executor's grad taps hold nothing else).
        saved: bytes per token of tensors autograd saves that are neither an
            input nor an output (intermediates such as softmax probabilities).
        fixed: bytes per call independent of the token count (the causal mask).
        views: indices of its new outputs that are views (attention heads, SDPA's output
            without RoPE); the executor releases the values of the graph's copies of new outputs
            right after the forward (``runtime.executor._release_values``), except views, whose
            base they keep: these stay held by the op's graph until its backward.
        grad_of: per input, the output whose gradient tensor autograd hands that input as it
            is (an addition passes its gradient through), ``None`` for a new tensor; inputs past
            the end follow :func:`_grad_sources`' rule for inputs an op only hands on.
    """

    outputs: tuple[int | float, ...]
    saved_inputs: tuple[int, ...] = ()
    saved: float = 0.0
    fixed: float = 0.0
    views: tuple[int, ...] = ()
    grad_of: tuple[int | None, ...] = ()


def op_memory(short: str, cfg: ModelConfig, degree: int, dtype_bytes: int, layer: int = 0,
              neighbour: int | None = None) -> OpMemory:
    """The per-op table: outputs and autograd-saved tensors of each compute operator of
    :mod:`oases_ds.models.operator_model` at TMP ``degree`` (``short``: its name
    without the ``L3.`` prefix; ``layer``: its layer; ``neighbour``: the TMP degree of
    the block across the boundary this op touches -- the previous block for an
    ``*_in`` op, the next for an ``*_out`` op -- ``None`` for the same degree).

    Why each entry is what it is (``e`` = ``dtype_bytes``, ``a`` heads, ``t`` degree),
    read off autograd's saved tensors (``saved_tensors_hooks``, as
    :class:`~oases_ds.bench.measure.ActivationProbe` counts them): a linear layer
    saves its input; LayerNorm saves its input and fp32 mean and rstd, RMSNorm its
    input, ``x/rms`` and ``1/rms``; keyed dropout and the bias-dropout-residual
    output ops save nothing (the mask is regenerated from its key).  The attention
    core takes one of two routes (:func:`~oases_ds.parallel.layers.attention_core`):
    without dropout (attention dropout 0, or eval) fused SDPA saves ``q``, ``k``,
    ``v`` as they arrive, its ``[b,heads,s,d]`` output and an fp32 logsumexp per
    head -- no ``s x s`` tensor and no causal mask; with keyed dropout the manual
    route saves the scaled ``q`` (a new tensor), ``k`` (a contiguous copy when it
    arrives transposed, i.e. without RoPE), ``v`` as a contiguous copy, the softmax
    output and the dropped probabilities (``a s / t`` each per token) and the causal
    mask (one ``s x s`` bool per call).  GQA repeats ``k``/``v`` to the query heads
    inside ``qkv``, so the core sees (and saves) ``H/t``-wide ``k``/``v`` either way
    and the narrower projections die with ``qkv``'s transient.  The GeLU MLP saves
    fc1's output and the GeLU output, the SwiGLU MLP gate, SiLU, up and their
    product (``F/t`` each); the last of these is ``mlp_up``'s output, which
    ``mlp_down`` saves as its input.  Post-LN BERT normalises a block's output at the start
    of the next op -- only where both blocks share a degree (``neighbour``), else
    at the end of the block's own ``*_out`` op.
    """
    H, F, a, s, t, e = cfg.hidden_size, cfg.ffn, cfg.num_heads, cfg.seq_len, degree, dtype_bytes
    drop = cfg.dropout > 0
    fam = cfg.family
    stats = 2 * NORM_STAT_BYTES  # LayerNorm's fp32 mean and rstd
    # what a pre-LN norm saves besides its input: LayerNorm its statistics; RMSNorm x/rms and 1/rms
    norm = H * e + e if fam == "llama" else stats
    # post-LN: whether the norm at this op's block boundary runs in the op that opens the next block
    moved = neighbour is None or neighbour == degree
    if short == "embed":
        return OpMemory((float(H * e),), saved=8 + 1)  # int64 local token ids + bool out-of-range mask
    if short == "embed_out":
        if fam == "llama":  # no positions: dropout's output, or x itself without dropout
            return OpMemory((float(H * e),) if drop else (0,))
        types = 8.0 if cfg.type_vocab_size else 0.0  # int64 segment ids, when the batch carries them
        if fam == "bert" and not moved:  # the embedding norm runs here: it saves x + pos and its statistics
            return OpMemory((float(H * e),), saved=types + H * e + stats)
        return OpMemory((float(H * e),), saved=types)
    bert_entry = fam == "bert" and short in ("attn_in", "mlp_in")
    if bert_entry and not moved:
        return OpMemory((0, 0))  # the previous block (or the embedding) normalised its own output
    if bert_entry:  # post-LN: the previous block's output norm (and, before layer 0, the embedding's)
        return OpMemory((float(H * e), SAME_AS_PREVIOUS), (0,), stats)
    if short in ("attn_in", "mlp_in"):
        return OpMemory((0, float(H * e)), (0,), norm)
    if short == "qkv":  # the linear saves h; BERT's h is x, handed on anyway; the heads are views, except
        # where "half" RoPE concatenates new q and k (k stays a view when GQA repeats it to the query heads)
        half = fam == "llama" and cfg.rotary == "half"
        gqa = 0 < cfg.num_kv_heads < a
        views = (1, 2, 3) if not half else ((2, 3) if gqa else (3,))
        return OpMemory((0, H / t * e, H / t * e, H / t * e), (1,), views=views)
    if short == "core":
        width = H / t * e  # q, k, v and the output, per token
        if not drop:  # fused SDPA: q, k, v as given, its output, fp32 logsumexp per head; without RoPE
            # q arrives as a transposed view, the output comes back in that layout and flattens to a view
            return OpMemory((0, width), (1, 2, 3), width + a / t * NORM_STAT_BYTES, views=(1,) if fam != "llama" else ())
        probs = 2 * a / t * s * e  # softmax output, dropped probabilities
        causal = 0.0 if fam == "bert" else float(s * s)  # one bool s x s mask per call
        if fam == "llama":  # RoPE hands k on contiguous: saved as it is; scaled q and v copies new
            return OpMemory((0, width), (2,), probs + 2 * width, causal)
        return OpMemory((0, width), (), probs + 3 * width, causal)
    if short == "proj":
        return OpMemory((0, float(H * e)), (1,))
    if short in ("attn_out", "mlp_out"):
        if fam == "bert" and not moved:  # post-LN norm here: it saves the residual sum and its statistics
            return OpMemory((float(H * e),), saved=H * e + stats)
        # x + bias-dropout(y): the residual's gradient is the output's, and without dropout y's too
        return OpMemory((float(H * e),), grad_of=(0, None if drop else 0))
    if short == "mlp":
        return OpMemory((0, float(H * e)), (1,), (4 if fam == "llama" else 2) * F / t * e)
    if short.startswith("mlp_up"):  # chunk k of MLP_UP_CHUNKS (sequence parallelism): it saves its slice of
        # h, a view that keeps h whole; hands on x, h but at the last, the chunks before it and a new
        # GeLU output / SwiGLU product on its share of the tokens
        k = int(short[len("mlp_up"):])
        share = mlp_up_chunk_share(s, k)  # of the tokens
        handed = (0,) + ((1,) if k < MLP_UP_CHUNKS - 1 else ()) + tuple(range(2, 2 + k))
        return OpMemory((*handed, F / t * e * share), (1,), (3 if fam == "llama" else 1) * F / t * e * share)
    if short == "mlp_down":  # saves its inputs, mlp_up's output or (sequence parallelism) its chunks
        return OpMemory((0, float(H * e)), tuple(range(1, 1 + MLP_UP_CHUNKS)))
    if short == "head_in":
        if fam == "bert":  # [last block's norm,] dense, GeLU, head norm: the tensors saved besides the input
            return OpMemory((float(H * e),), (0,), (3 * H * e + 2 * stats) if moved else (2 * H * e + stats))
        return OpMemory((float(H * e),), (0,), norm)
    if short == "loss":
        # fp32 softmax over this rank's V/t, int64 local label, bool outside mask, fp32 per-token loss
        return OpMemory((0.0,), (0,), cfg.vocab_size / t * LOSS_BYTES + 8 + 1 + 4)
    raise ValueError(f"the memory model has no entry for operator {short!r} ({fam}); "
                     f"add it to oases_ds.planner.memory.op_memory")


def _neighbours(ops: Sequence[Op], op_degrees: Sequence[int]) -> dict[int, int]:
    """Each block-boundary op's ``neighbour`` for :func:`op_memory`: the degree of the
    compute op before an ``*_in`` op (the embedding's before ``L0.attn_in``) and after
    an ``*_out`` op (the head's after the last ``mlp_out``)."""
    compute = [i for i, op in enumerate(ops) if not isinstance(op, CommOp)]
    found: dict[int, int] = {}
    for n, i in enumerate(compute):
        short = short_name(ops[i])
        if short in ("attn_in", "mlp_in", "head_in") and n > 0:
            found[i] = op_degrees[compute[n - 1]]
        elif short in ("embed_out", "attn_out", "mlp_out") and n + 1 < len(compute):
            found[i] = op_degrees[compute[n + 1]]
    return found


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank peak memory of one training step of one micro-batch, in bytes.

    Attributes:
        state_bytes: model states (parameters x STATE_BYTES_PER_PARAM).
        activation_bytes: peak of what the executor's buffers and autograd hold
            (checkpoints, kept graphs, transient, logits): what
            :class:`~oases_ds.bench.measure.ActivationProbe` measures.
        peak_bytes: largest ``state + activations + comm in flight`` over the step.
        terms: the activation terms (:data:`TERMS`) at the instruction where
            ``peak_bytes`` is reached; they sum to ``peak_bytes - state_bytes``.
        peak_at: that instruction, in the schedule's text form.
        checkpoint_peak_bytes: the most checkpoint bytes held at any instruction (which need
            not be the instruction of ``peak_bytes``).
    """

    state_bytes: float
    activation_bytes: float
    peak_bytes: float
    terms: dict[str, float]
    peak_at: str
    checkpoint_peak_bytes: float = 0.0

    def to_dict(self) -> dict:
        return {"state_bytes": self.state_bytes, "activation_bytes": self.activation_bytes,
                "peak_bytes": self.peak_bytes, "terms": dict(self.terms), "peak_at": self.peak_at,
                "checkpoint_peak_bytes": self.checkpoint_peak_bytes}


def activation_replay(
    cfg: ModelConfig,
    ops: Sequence[Op],
    op_degrees: Sequence[int],
    devices: int,
    micro_batch: int,
    spec: ScheduleSpec,
    dtype_bytes: int,
) -> list[tuple[str, dict[str, float]]]:
    """Live activation bytes by term after every instruction of ``spec``'s schedule.

    ``op_degrees[i]``: TMP degree of op ``i``'s block (for a reshard, the degree it
    reshards *to*); a degree-t op runs ``micro_batch * t / devices`` samples of each
    sub-batch, as a replica of a reduced-degree block does.  ``micro_batch``: samples
    of one micro-batch at the full degree ``devices``.  Under sequence parallelism (``ops``
    from :func:`~oases_ds.models.operator_model.sequence_parallel_ops`) the
    :func:`sequence_sliced` ops run on ``1/t`` of the tokens.
    """
    if len(op_degrees) != len(ops):
        raise ValueError(f"op_degrees has {len(op_degrees)} entries for {len(ops)} operators")
    subs = spec.effective_sub_batches
    if micro_batch < 1 or micro_batch % subs:
        raise ValueError(f"micro_batch={micro_batch} must be a positive multiple of the schedule's {subs} sub-batches")
    schedule = build_schedule(spec, ops)
    frees = last_reads(schedule.instructions, ops)
    graph_only = {ins for ins in unread_recomputes(schedule.instructions, ops, frees)
                  if getattr(ops[ins.op], "graph_only_recompute", False)}  # placeholders: no bytes
    tokens = [micro_batch / subs * cfg.seq_len * t / devices for t in op_degrees]
    tokens = [n / t if sliced else n for n, t, sliced in zip(tokens, op_degrees, sequence_sliced(ops))]
    neighbours = _neighbours(ops, op_degrees)
    table = {i: op_memory(short_name(op), cfg, op_degrees[i], dtype_bytes, op.layer, neighbours.get(i))
             for i, op in enumerate(ops) if not isinstance(op, CommOp)}
    checkpoint_ops = {seg.start for seg in schedule_segments(spec, ops) if seg.recompute}
    # per op, fixed by its table row: which outputs its graph holds after the executor's release
    # (runtime.executor._release_values), and which output's gradient each input's gradient is
    graph_held = {i: _graph_held(mem, ops[i].is_loss) for i, mem in table.items()}
    grad_sources: dict[int, tuple[int | None, ...]] = {}  # filled at each op's first backward (its input count)

    ids = itertools.count()
    size: dict[int, float] = {}
    tag: dict[int, str] = {}  # tensors whose term is theirs whoever holds them (logits, comm)
    buffers: dict[tuple, tuple[int, ...]] = {buf: () for buf in initial_buffers(subs)}
    kind: dict[tuple, str] = {}
    graph_inputs: dict[tuple[int, int], tuple[int, ...]] = {}
    graph_outputs: dict[tuple[int, int], tuple[int, ...]] = {}
    results: dict[tuple, float] = {}  # bytes each collective in flight returns

    def new(nbytes: float, term: str | None = None) -> int:
        tid = next(ids)
        size[tid] = nbytes
        if term:
            tag[tid] = term
        return tid

    out: list[tuple[str, dict[str, float]]] = []
    for idx, ins in enumerate(schedule.instructions):
        i, sub = ins.op, ins.sub
        op = ops[i]
        if isinstance(ins, (Forward, Recompute)):
            inputs = buffers[("act", i, sub)]
            if isinstance(op, CommOp):
                buffers[("act", i + 1, sub)] = inputs
            else:
                mem = table[i]
                outputs: tuple[int, ...] = ()
                for o in mem.outputs:
                    if isinstance(o, float):
                        outputs += (new(0.0 if ins in graph_only else o * tokens[i]),)
                    else:
                        outputs += (outputs[-1] if o == SAME_AS_PREVIOUS else inputs[o],)
                buffers[("act", i + 1, sub)] = outputs
                if isinstance(ins, Recompute) or ins.keep_graph:
                    saved = new(mem.saved * tokens[i] + mem.fixed, "logits" if op.is_loss else None)
                    held = tuple(outputs[k] for k in graph_held[i])
                    buffers[("graph", i, sub)] = (*(inputs[k] for k in mem.saved_inputs), *held, saved)
                    graph_inputs[(i, sub)] = inputs
                    graph_outputs[(i, sub)] = held
                    kind[("graph", i, sub)] = "kept" if isinstance(ins, Forward) else "transient"
            if isinstance(ins, Forward) and i in checkpoint_ops:
                kind[("act", i, sub)] = "checkpoint"
        elif isinstance(ins, Backward):
            if isinstance(op, CommOp):
                buffers[("grad", i, sub)] = buffers[("grad", i + 1, sub)]
            else:
                inputs, out_grads = graph_inputs[(i, sub)], buffers.get(("grad", i + 1, sub), ())
                if i not in grad_sources:
                    grad_sources[i] = _grad_sources(table[i], len(inputs))
                sources = grad_sources[i]
                buffers[("grad", i, sub)] = tuple(out_grads[j] if j is not None and j < len(out_grads) else new(size[t])
                                                  for t, j in zip(inputs, sources))
                # Autograd frees what the op saved as its backward runs (no retain_graph); the
                # executor's graph buffer holds only the outputs until it is dropped after this.
                buffers[("graph", i, sub)] = graph_outputs[(i, sub)]
        elif isinstance(ins, StartAsync):
            src = ("grad", i + 1, sub) if ins.phase == "backward" else ("act", i, sub)
            held = buffers[src]
            payload = size[held[op.index]]
            grows, shrinks = _resize(op, ins.phase, op_degrees, i)
            result_bytes = payload * grows / shrinks
            flight = result_bytes + (payload if shrinks > 1 else 0.0)  # a ReduceScatter's contiguous input, and its output
            buffers[("comm", i, sub, ins.phase)] = (*held, new(flight if moves_bytes(op, ins.phase) else 0.0, "comm"))
            results[("comm", i, sub, ins.phase)] = result_bytes
        elif isinstance(ins, Sync):
            *held, flight = buffers[("comm", i, sub, ins.phase)]
            moved = moves_bytes(op, ins.phase)
            result = new(results.pop(("comm", i, sub, ins.phase))) if moved else held[op.index]  # split: a view
            dst = ("grad", i, sub) if ins.phase == "backward" else ("act", i + 1, sub)
            buffers[dst] = tuple(held[: op.index]) + (result,) + tuple(held[op.index + 1:])
        out.append((str(ins), _terms(buffers, kind, size, tag, ops)))
        for buf in frees[idx]:
            buffers.pop(buf, None)
            kind.pop(buf, None)
    return out


def _graph_held(mem: OpMemory, is_loss: bool) -> tuple[int, ...]:
    """The outputs an op's graph still holds after the forward: inputs it hands on, views, and the
    loss; the executor releases the graph's copies of every other new output."""
    return tuple(k for k, o in enumerate(mem.outputs) if (isinstance(o, int) and o >= 0) or k in mem.views or is_loss)


def _grad_sources(mem: OpMemory, inputs: int) -> tuple[int | None, ...]:
    """Per input (``inputs`` of them), the output whose gradient tensor autograd hands that input as it
    is, else ``None`` (a new tensor).  :attr:`OpMemory.grad_of` says so for additions; an input the
    op only hands on (one output is that input, and the op does not save it: ``x`` beside ``qkv``,
    ``core``, ``proj``, ``mlp_up``, ``mlp_down``) gets its output's gradient itself, the same
    storage (the executor's grad tap receives the tensor autograd was given)."""
    sources: list[int | None] = []
    for k in range(inputs):
        if k < len(mem.grad_of) and mem.grad_of[k] is not None:
            sources.append(mem.grad_of[k])
            continue
        handed_on = [j for j, o in enumerate(mem.outputs) if isinstance(o, int) and o == k]
        sources.append(handed_on[0] if len(handed_on) == 1 and k not in mem.saved_inputs else None)
    return tuple(sources)


def _resize(op: CommOp, phase: str, op_degrees: Sequence[int], i: int) -> tuple[int, int]:
    """``(grows, shrinks)``: a collective's result is its input x grows / shrinks.  A reshard's
    AllGather grows by the ratio of the degrees it joins; sequence parallelism's AllGather
    (along the sequence, dim 1) by the degree ``t``, its ReduceScatter shrinks by ``t``."""
    collective = op.collective_in(phase)
    if op.dim == 1 and collective in ("all_gather", "reduce_scatter"):
        return (op_degrees[i], 1) if collective == "all_gather" else (1, op_degrees[i])
    if collective == "all_gather":
        return max(op_degrees[i], op_degrees[i - 1]) // min(op_degrees[i], op_degrees[i - 1]), 1
    return 1, 1


_PRIORITY = ("checkpoint", "kept", "transient")

END_PARTS: tuple[str, ...] = ("embed", "head")
"""The ends of the operator sequence, which pipeline stages split: the first stage runs the
embedding, the last the head and the loss."""

STAGE_ROLES: dict[str, tuple[str, ...]] = {"only": END_PARTS, "first": ("embed",), "middle": (), "last": ("head",)}
"""A pipeline stage's role -> the ends it holds (``only``: one stage, the whole model)."""


def _terms(buffers: dict, kind: dict, size: dict, tag: dict, ops: Sequence[Op]) -> dict[str, float]:
    """Bytes of every live tensor, each once, by term: a tagged tensor (logits, comm)
    by its tag, else by the most lasting buffer that holds it.  Besides the terms,
    ``"held:<layer>.<block>"`` sums the checkpoint and kept bytes held by a block's
    buffers (its checkpoints, its kept graphs), which :func:`memory_rows` reads, and
    ``"part:embed"`` / ``"part:head"`` every other byte held by the embedding's / the
    head's buffers (the head's: its graphs and the logits), which a pipeline stage
    without that end does not hold (:attr:`MemoryRows.stage_fixed_bytes`)."""
    term_of: dict[int, tuple[str, int]] = {}  # tensor -> (term, op of the buffer that holds it)
    for buf, held in buffers.items():
        term = kind.get(buf, "transient")
        for tid in held:
            old = term_of.get(tid)
            if old is None or _PRIORITY.index(term) < _PRIORITY.index(old[0]):
                term_of[tid] = (term, buf[1])
    totals = dict.fromkeys(TERMS, 0.0)
    for tid, (term, holder) in term_of.items():
        term = tag.get(tid, term)
        totals[term] += size[tid]
        op = ops[holder]
        if term in ("checkpoint", "kept") and op.block in ("attn", "mlp"):
            key = f"held:{op.layer}.{op.block}"
            totals[key] = totals.get(key, 0.0) + size[tid]
        elif op.block in END_PARTS:
            key = f"part:{op.block}"
            totals[key] = totals.get(key, 0.0) + size[tid]
    return totals


def state_bytes(cfg: ModelConfig, attn_degrees: Sequence[int], mlp_degrees: Sequence[int], devices: int,
                bytes_per_param: float = STATE_BYTES_PER_PARAM) -> float:
    """Model states one rank holds: embedding, head and every block's shard, x ``bytes_per_param``
    (:meth:`ModelStates.bytes_per_param <oases_ds.planner.costs.ModelStates.bytes_per_param>`)."""
    params = embed_head_parameter_count(cfg, devices)
    params += sum(layer_parameter_counts(cfg, a)["attn"] + layer_parameter_counts(cfg, m)["mlp"]
                  for a, m in zip(attn_degrees, mlp_degrees))
    return float(params * bytes_per_param)


def dp_in_flight_bytes(cfg: ModelConfig, devices: int, states: ModelStates, degree: int | None = None) -> float:
    """The overlapped DP reduction's flat gradient copies alive at once on a rank, at most.

    :class:`~oases_ds.runtime.dp_overlap.DPGradReducer` reduces one bucket per block (and one
    for the head, one for the embedding) in the order the backward finishes them -- head,
    last layer's MLP and attention, ..., first layer's attention, embedding -- and keeps at
    most :data:`~oases_ds.runtime.dp_overlap.MAX_IN_FLIGHT` of them reducing: the bound is the
    largest such run of consecutive buckets, in the gradients' dtype.  Blocks are counted at
    ``degree`` (default: the full TMP degree ``devices``); the ends, the largest buckets, are
    sharded over the full group in every plan.  0 where the reduction is not overlapped."""
    from oases_ds.runtime.dp_overlap import MAX_IN_FLIGHT

    if not states.overlapped_dp_reduction():
        return 0.0
    block = layer_parameter_counts(cfg, degree or devices)
    embed = end_parameter_counts(cfg, devices)["embed"]
    head = embed_head_parameter_count(cfg, devices) - embed  # one stage: a tied head holds no table of its own
    order = [head] + [block[kind] for _ in range(cfg.num_layers) for kind in ("mlp", "attn")] + [embed]
    window = max(sum(order[i:i + MAX_IN_FLIGHT]) for i in range(len(order)))
    return float(window * PRECISIONS[states.precision])


def offload_staging_bytes(cfg: ModelConfig, devices: int, states: ModelStates) -> float:
    """Under optimizer offload, the device buffer DeepSpeed 0.19.8's ZeRO optimizer stages each
    gradient through on its way to the host (``temp_grad_buffer_for_gpu_offload``): the largest
    parameter's shard, in the gradients' dtype; 0 without offload."""
    if not states.offload:
        return 0.0
    return float(largest_parameter_count(cfg, devices) * PRECISIONS[states.precision])


def with_model_states(table: CostTable, states: ModelStates, cfg: ModelConfig) -> CostTable:
    """``table`` re-priced for ``states``: every table is priced at :data:`STATE_BYTES_PER_PARAM`
    (the profiler and the analytic model alike), so each block's ``state_bytes`` and the
    embedding's and head's states inside ``fixed_bytes`` (and each pipeline role's) are
    scaled to ``states.bytes_per_param()``, and the overlapped DP reduction's in-flight copies
    (:func:`dp_in_flight_bytes`) or offload's staging buffer (:func:`offload_staging_bytes`)
    added to the fixed bytes; activations are untouched."""
    per_param = states.bytes_per_param()
    in_flight = dp_in_flight_bytes(cfg, table.devices, states) + offload_staging_bytes(cfg, table.devices, states)
    if per_param == STATE_BYTES_PER_PARAM and not in_flight:
        return table
    ratio = per_param / STATE_BYTES_PER_PARAM

    def scaled(rows: dict[str, dict[int, BlockCost]]) -> dict[str, dict[int, BlockCost]]:
        return {kind: {t: dataclasses.replace(c, state_bytes=c.state_bytes * ratio) for t, c in by_degree.items()}
                for kind, by_degree in rows.items()}

    ends = end_parameter_counts(cfg, table.devices)
    delta = per_param - STATE_BYTES_PER_PARAM
    stage_fixed = {role: value + delta * sum(ends[end] for end in STAGE_ROLES[role])
                   for role, value in table.stage_fixed_bytes.items()}
    return dataclasses.replace(table, blocks=scaled(table.blocks), store_blocks=scaled(table.store_blocks),
                               gathered_blocks=scaled(table.gathered_blocks),
                               fixed_bytes=(table.fixed_bytes + delta * embed_head_parameter_count(cfg, table.devices)
                                            + in_flight),
                               stage_fixed_bytes=stage_fixed)


def estimate_memory(
    cfg: ModelConfig,
    attn_degrees: Sequence[int],
    mlp_degrees: Sequence[int],
    devices: int,
    micro_batch: int,
    spec: ScheduleSpec,
    dtype_bytes: int,
    sequence_parallel: bool = False,
    bytes_per_param: float = STATE_BYTES_PER_PARAM,
) -> MemoryEstimate:
    """Per-rank peak of one step of ``micro_batch`` samples (the whole TMP group's, as
    the planner counts them) under ``spec``, for a plan's per-block degrees (with
    ``sequence_parallel``, all of them ``devices``), model states at ``bytes_per_param``;
    see the module doc for the terms and their assumptions."""
    if len(attn_degrees) != cfg.num_layers:
        raise ValueError(f"plan has {len(attn_degrees)} layers but model.num_layers={cfg.num_layers}")
    ops, degrees = _ops(cfg.family, attn_degrees, mlp_degrees, devices, sequence_parallel)
    states = state_bytes(cfg, attn_degrees, mlp_degrees, devices, bytes_per_param)
    replay = activation_replay(cfg, ops, degrees, devices, micro_batch, spec, dtype_bytes)
    at, terms = max(replay, key=lambda step: _total(step[1]))
    activations = max(_total(t) - t["comm"] for _, t in replay)
    checkpoints = max(t["checkpoint"] for _, t in replay)
    return MemoryEstimate(states, activations, states + _total(terms), {k: terms[k] for k in TERMS}, at, checkpoints)


def _ops(family: str, attn_degrees: Sequence[int], mlp_degrees: Sequence[int], devices: int,
         sequence_parallel: bool) -> tuple[list[Op], list[int]]:
    """:func:`plan_ops`, under sequence parallelism rewritten by ``sequence_parallel_ops``
    (refused for mixed degrees, as the model refuses them)."""
    sp = sequence_parallel and devices > 1
    if sp and any(d != devices for d in (*attn_degrees, *mlp_degrees)):
        raise ValueError(f"sequence_parallel needs every block at the full TMP degree {devices}, "
                         f"got degrees {sorted(set((*attn_degrees, *mlp_degrees)))}")
    return plan_ops(family, attn_degrees, mlp_degrees, devices, sp)


def _total(terms: dict[str, float]) -> float:
    return sum(terms[k] for k in TERMS)


@dataclass(frozen=True)
class MemoryRows:
    """The planner's memory rows: a sum over blocks plus one constant.

    Attributes:
        act_bytes: block kind -> degree -> activation bytes one block holds across
            the step (its checkpoints and kept graphs, every sub-batch): what a
            block's degree adds to the peak.
        fixed_bytes: what no block choice changes, or changes only through a
            maximum: embedding and head states at the full degree, and at the peak
            the embedding's and head's activations, the logits, the working set of
            the block being recomputed and backpropagated and the collectives in
            flight -- the largest over the degrees, so a mixed plan is not under-counted.
        evidence: per degree, the replayed peak and its terms (for the table's measurements).
        stage_fixed_bytes: the constant of a pipeline stage by its role
            (:data:`STAGE_ROLES`): as ``fixed_bytes``, less the embedding's bytes and states
            on a stage without the embedding, less the head's (logits included) on one
            without the head; ``only`` equals ``fixed_bytes``.
    """

    act_bytes: dict[str, dict[int, float]]
    fixed_bytes: float
    evidence: dict[str, dict]
    stage_fixed_bytes: dict[str, float] = dataclasses.field(default_factory=dict)


PROBE_LAYERS = 3
"""Layers of the uniform model replayed per degree: the middle one holds what any inner
layer holds at the peak; the first and last differ, and that difference goes to the constant."""


def memory_rows(cfg: ModelConfig, spec: ScheduleSpec, devices: int, micro_batch: int,
                degrees: Sequence[int], dtype_bytes: int, sequence_parallel: bool = False) -> MemoryRows:
    """Per-block activation bytes and the constant, from replays of uniform plans.

    For each degree ``t``, a :data:`PROBE_LAYERS`-layer model at ``t`` is replayed.
    A block's row is what its middle-layer instance holds (checkpoints and kept
    graphs) at the instant the middle layer holds most; the constant is the most the
    replay holds *besides* every block's held bytes at once (embedding, head,
    logits, the block in recompute + backward, collectives in flight), the largest
    over the degrees, plus the embedding's and head's states.  Since at every
    instruction the live bytes are the blocks' held bytes plus the rest, ``states +
    sum of rows + constant`` bounds the replayed peak of any plan of these
    degrees; it is tight when the peak falls where every block holds its all,
    as it does once blocks outweigh embedding and head (tests measure the gap).
    ``sequence_parallel``: the replays run sequence parallelism (``degrees`` then only ``devices``).
    """
    probe = dataclasses.replace(cfg, num_layers=PROBE_LAYERS)
    rows: dict[str, dict[int, float]] = {"attn": {}, "mlp": {}}
    fixed = 0.0
    stage_other = dict.fromkeys(STAGE_ROLES, 0.0)
    evidence: dict[str, dict] = {}
    middle = PROBE_LAYERS // 2
    for t in degrees:
        ops, op_degrees = _ops(cfg.family, [t] * PROBE_LAYERS, [t] * PROBE_LAYERS, devices, sequence_parallel)
        replay = activation_replay(probe, ops, op_degrees, devices, micro_batch, spec, dtype_bytes)
        # one instant, the one where the middle layer holds most: attribution between its two
        # blocks shifts during backward (a kept tail's output outlives the next block's checkpoint)
        _, most = max(replay, key=lambda step: sum(step[1].get(f"held:{middle}.{k}", 0.0) for k in rows))
        for kind in rows:
            rows[kind][t] = most.get(f"held:{middle}.{kind}", 0.0)
        other = max(_total(terms) - sum(v for k, v in terms.items() if k.startswith("held:")) for _, terms in replay)
        fixed = max(fixed, other)
        for role, ends in STAGE_ROLES.items():
            dropped = {f"part:{end}" for end in END_PARTS if end not in ends}
            stage_other[role] = max(stage_other[role], max(
                _total(terms) - sum(v for k, v in terms.items() if k.startswith("held:") or k in dropped)
                for _, terms in replay))
        at, terms = max(replay, key=lambda step: _total(step[1]))
        evidence[str(t)] = {"peak_at": at, "activation_peak_bytes": _total(terms), "non_block_bytes": other,
                            **{f"{k}_bytes": terms[k] for k in TERMS}}
    states = embed_head_parameter_count(cfg, devices) * STATE_BYTES_PER_PARAM
    ends = end_parameter_counts(cfg, devices)
    stage_fixed = {role: stage_other[role] + STATE_BYTES_PER_PARAM * sum(ends[end] for end in held)
                   for role, held in STAGE_ROLES.items() if role != "only"}
    return MemoryRows(rows, fixed + states, evidence, {"only": fixed + states, **stage_fixed})


def memory_lines(estimate: MemoryEstimate) -> list[str]:
    """The per-rank peak as ``oases-plan`` prints it: total, then each term."""
    mib = 2**20
    terms = " + ".join(f"{name} {estimate.terms[name] / mib:.1f}" for name in TERMS)
    return [f"per-rank peak {estimate.peak_bytes / mib:.1f} MiB = states {estimate.state_bytes / mib:.1f} + {terms} "
            f"(MiB, at {estimate.peak_at})"]
