"""Megatron-style TMP layers.

Each layer holds only this rank's shard and marks every parameter with
``tp_dim`` (the dimension that is split over TMP ranks, or ``None`` when the
parameter is replicated).  Layers expose the *local* computation (``partial``):
the operator sequence puts the collectives between operators explicitly so the
executor can overlap them; ``forward`` is the eager form with the collectives
inlined through the autograd Functions, for evaluation and for users who just
want a TMP layer.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from oases_ds.parallel.collectives import (
    Group,
    copy_to_tensor_parallel,
    group_rank,
    group_size,
    reduce_from_tensor_parallel,
)


def mark_parallel(p: nn.Parameter, tp_dim: int | None) -> nn.Parameter:
    """Record how ``p`` is split.  ``tensor_model_parallel`` is the Megatron attribute
    DeepSpeed reads so that gradient-norm clipping counts a replicated parameter once
    per TMP group and a sharded one once per shard."""
    p.tp_dim = tp_dim  # type: ignore[attr-defined]
    p.tensor_model_parallel = tp_dim is not None  # type: ignore[attr-defined]
    p.model_parallel = tp_dim is not None  # type: ignore[attr-defined]
    return p


def _param(shape: tuple[int, ...], tp_dim: int | None) -> nn.Parameter:
    return mark_parallel(nn.Parameter(torch.empty(shape)), tp_dim)


def _shard(total: int, group: Group, what: str) -> int:
    size = group_size(group)
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by the TMP degree {size}")
    return total // size


def _mark_padded(p: nn.Parameter, total: int) -> None:
    """Record ``total``, the unpadded size of ``p``'s split dimension (padded up to a
    multiple of the TMP degree), so that :mod:`oases_ds.models.sharding` pads on the
    way in and trims on the way out: full values never carry padding."""
    p.tp_full = total  # type: ignore[attr-defined]


def padded_local(total: int, group: Group) -> int:
    """``ceil(total / degree)``: this rank's rows of a vocabulary padded to the degree."""
    return -(-total // group_size(group))


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by output rows: each rank owns ``out/t`` outputs."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True, pad: bool = False) -> None:
        super().__init__()
        self.group = group
        self.out_local = padded_local(out_features, group) if pad else _shard(out_features, group, "out_features")
        self.weight = _param((self.out_local, in_features), 0)
        self.bias = _param((self.out_local,), 0) if bias else None
        if pad:  # the vocabulary head: rows past out_features are padding
            for p in (self.weight, self.bias):
                if p is not None:
                    _mark_padded(p, out_features)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.partial(copy_to_tensor_parallel(x, self.group))


def vocab_parallel_bias(vocab_size: int, group: Group) -> nn.Parameter:
    """A bias over the vocabulary split like :class:`VocabParallelEmbedding`'s rows (padded to
    the degree): the output bias of a head whose weight is the tied embedding (BERT's
    ``cls.predictions.bias``)."""
    p = _param((padded_local(vocab_size, group),), 0)
    _mark_padded(p, vocab_size)
    return p


class ReplicatedHeadLinear(nn.Module):
    """Key/value projection when there are fewer k/v heads than TMP ranks (Megatron's
    replicated k/v): every rank holds the whole ``[heads * head_dim, in]`` weight and
    computes only the head its query heads read, head ``rank * heads // t``.

    Why the whole weight and an AllReduce of its gradient, not a copy of one head: the
    ``t / heads`` ranks sharing a head each produce part of its gradient; summing the
    (zero elsewhere) full-size gradients over the TMP group gives every rank the full
    gradient, so the replicas stay identical like a norm's weight, and a Hugging Face
    checkpoint's tensor is read and written whole.  Forward: a row slice of the weight;
    backward: AllReduce of the weight (and bias) gradient over the TMP group.
    """

    def __init__(self, in_features: int, heads: int, head_dim: int, group: Group, bias: bool = True) -> None:
        super().__init__()
        self.group = group
        degree = group_size(group)
        if degree % heads:
            raise ValueError(f"{heads} k/v heads cannot be replicated over {degree} TMP ranks; "
                             f"the TMP degree must be a multiple of model.num_kv_heads")
        head = group_rank(group) * heads // degree
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        self.out_local = head_dim
        self.weight = _param((heads * head_dim, in_features), None)
        self.bias = _param((heads * head_dim,), None) if bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_parallel(self.weight, self.group)[self.rows]
        bias = None if self.bias is None else copy_to_tensor_parallel(self.bias, self.group)[self.rows]
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.partial(copy_to_tensor_parallel(x, self.group))


class _GraphOnlyLinear(torch.autograd.Function):
    """Forward: saves ``x`` and ``weight`` and returns a zero-stride placeholder shaped
    like ``F.linear(x, weight)`` -- no product is computed.  Backward: exactly the input
    and weight gradients of ``F.linear(x, weight)``.

    Why: a fine-grained recomputation ends right before a forward AllReduce it does not
    re-run (paper eq. 1), so the row-parallel product feeding that AllReduce is
    recomputed only for its autograd graph; its value is never read.  The graph of a
    linear needs ``x`` and the weight, not the output, so the GEMM (a third of the
    MLP's forward, a quarter of the attention projections') can be skipped.  The
    placeholder is an expanded scalar: it costs no memory and must not be read.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:  # as mm's backward does: (x^T g)^T over the flattened tokens
            grad_w = x.reshape(-1, x.shape[-1]).t().mm(grad.reshape(-1, grad.shape[-1])).t()
        return grad_x, grad_w


class _ChunkedLinear(torch.autograd.Function):
    """``F.linear(torch.cat(chunks), weight)`` over 2-D ``[rows, in]`` chunks without the
    concatenation: forward, each chunk's product written into its rows of the output (or,
    ``values=False``, :class:`_GraphOnlyLinear`'s placeholder); backward, each chunk's input
    gradient and the weight gradient summed over the chunks.

    Why not ``cat`` then ``F.linear``: the linear would save the concatenation, a second copy of
    inputs that autograd already keeps (the sequence-parallel MLP's up-projection chunks, held
    by their own ops' graphs until the backward)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, values: bool, samples: int, *chunks: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight, *chunks)
        rows = sum(c.shape[0] for c in chunks)
        shape = (samples, rows // samples, weight.shape[0])  # the output as a tensor of its own, not a view
        if not values:
            return chunks[0].new_zeros(()).expand(*shape)
        out = chunks[0].new_empty(shape)
        flat, start = out.view(rows, -1), 0
        for c in chunks:
            torch.mm(c, weight.t(), out=flat[start:start + c.shape[0]])
            start += c.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        weight, *chunks = ctx.saved_tensors
        grads = grad.reshape(-1, grad.shape[-1]).split([c.shape[0] for c in chunks])
        grad_chunks = [g.mm(weight) if ctx.needs_input_grad[3 + k] else None for k, g in enumerate(grads)]
        grad_w = None
        if ctx.needs_input_grad[0]:
            for c, g in zip(chunks, grads):
                grad_w = g.t().mm(c) if grad_w is None else grad_w.addmm_(g.t(), c)
        return (grad_w, None, None, *grad_chunks)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by input columns; ``partial`` returns this
    rank's summand (bias excluded), which an AllReduce completes.  The bias is
    replicated and added after the reduction."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True) -> None:
        super().__init__()
        self.group = group
        self.in_local = _shard(in_features, group, "in_features")
        self.weight = _param((out_features, self.in_local), 1)
        self.bias = _param((out_features,), None) if bias else None

    def partial(self, x: torch.Tensor, values: bool = True) -> torch.Tensor:
        """This rank's summand.  ``values=False``: only its autograd graph, for a
        recomputation whose output nobody reads (see :class:`_GraphOnlyLinear`)."""
        if not values and torch.is_grad_enabled():
            return _GraphOnlyLinear.apply(x, self.weight)
        return F.linear(x, self.weight)

    def partial_of_chunks(self, chunks: Sequence[torch.Tensor], samples: int, values: bool = True) -> torch.Tensor:
        """This rank's summand ``[samples, tokens, out]`` for the concatenation of the 2-D ``chunks``
        (rows of the ``samples``' tokens, one after another), which it does not build
        (:class:`_ChunkedLinear`); ``values`` as for :meth:`partial`."""
        if not torch.is_grad_enabled():
            return torch.cat([F.linear(c, self.weight) for c in chunks]).view(samples, -1, self.weight.shape[0])
        return _ChunkedLinear.apply(self.weight, values, samples, *chunks)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(reduce_from_tensor_parallel(self.partial(x), self.group))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; tokens outside this rank's range
    contribute zeros, so an AllReduce of ``partial`` gives the full lookup.

    ``padding_idx``: the token whose row the lookup never trains (``nn.Embedding``'s
    ``padding_idx``, which Hugging Face's BERT and LLaMA set to ``[PAD]``); only the rank
    holding that row passes it on, as a local index.
    """

    def __init__(self, vocab_size: int, dim: int, group: Group, padding_idx: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.vocab_local = padded_local(vocab_size, group)  # padded rows: no token reads them
        self.start = group_rank(group) * self.vocab_local
        self.weight = _param((self.vocab_local, dim), 0)
        _mark_padded(self.weight, vocab_size)
        local_pad = None if padding_idx is None else padding_idx - self.start
        self.local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.vocab_local else None

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.vocab_local)
        # Tokens of other ranks read row 0 and are zeroed below, so their lookup gradient is
        # zero whether or not row 0 is the padding row.
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_parallel(self.partial(tokens), self.group)


AllReduceFn = Callable[[torch.Tensor, dist.ReduceOp.RedOpType], torch.Tensor]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary.

    Forward: three small AllReduces (max, sum of exp, target logit) over the TMP
    group; backward is local (softmax minus one-hot on this rank's slice).  Columns
    at or past ``vocab_size`` are padding (vocabulary rounded up to the TMP degree):
    they are set to -inf, so they get zero probability and zero gradient.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab_start: int, all_reduce: AllReduceFn, vocab_size: int | None):  # type: ignore[override]
        logits = logits.float()
        if vocab_size is not None and vocab_start + logits.shape[-1] > vocab_size:
            logits = logits.clone()
            logits[..., max(vocab_size - vocab_start, 0):] = float("-inf")
        logits_max = all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        local = labels - vocab_start
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target = all_reduce(target, dist.ReduceOp.SUM)
        # In place from here on: ``shifted`` is this function's own (b, s, vocab/t) buffer, and
        # each full-size temporary saved is an allocation and a pass over the largest
        # activation of the model (the same values, bit for bit, as out of place).
        exp = shifted.exp_()
        sum_exp = all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM)
        loss = sum_exp.log() - target
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        # softmax minus one-hot: subtract 1 at each in-range target (0 for a token outside this
        # rank's slice); a scatter, not a full-size one-hot tensor and its product.
        inside = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), inside.neg_())
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, all_reduce: AllReduceFn,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss for vocab-sharded ``logits``.  ``labels`` < 0 are ignored
    by the caller (their loss is computed on a clamped label and masked out);
    ``vocab_size``: the real vocabulary when the shards are padded past it."""
    return _VocabParallelCrossEntropy.apply(logits, labels.clamp(min=0), vocab_start, all_reduce, vocab_size)


class LayerNorm(nn.Module):
    """Replicated LayerNorm (weight and bias identical on every TMP rank)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), None)
        self.bias = _param((dim,), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Replicated RMSNorm (LLaMA): ``x / rms(x) * weight``, no bias.

    The normalisation runs in fp32 and is cast back before the weight, as Hugging Face's
    ``LlamaRMSNorm`` does: in bf16 the mean of squares over thousands of channels loses
    the bits an imported checkpoint was trained with.  Identity in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_inverse_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_positions: int = 8192,
) -> torch.Tensor:
    """The head_dim/2 rotation frequencies of RoPE, with context-extension scaling.

    "linear" stretches every wavelength by ``factor`` (position interpolation).
    "llama3" stretches only the long wavelengths: those longer than
    ``original_max_positions / low_freq_factor`` by ``factor``, those shorter than
    ``original_max_positions / high_freq_factor`` not at all, and blends linearly in
    between, so local word order is seen exactly as in pre-training.

    Computed on the CPU whatever the default device, so that a model built under
    ``torch.device("meta")`` (names and shapes only: ``oases-ckpt convert``) has its tables.
    """
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    if scaling == "linear":
        return inv / factor
    if scaling == "llama3":
        wavelength = 2 * math.pi / inv
        # 0 for short wavelengths (keep), 1 for long ones (divide by factor), a ramp between.
        ramp = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        keep = ramp.clamp(0.0, 1.0)
        return keep * inv + (1 - keep) * inv / factor
    return inv


def rotary_tables(seq_len: int, head_dim: int, device: torch.device, base: float = 10000.0,
                  inv_freq: torch.Tensor | None = None):
    """cos/sin tables of shape (seq, head_dim/2) for rotary position embeddings."""
    inv = rotary_inverse_frequencies(head_dim, base) if inv_freq is None else inv_freq
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv.to(device))
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str = "interleaved") -> torch.Tensor:
    """Rotate pairs of the last dim of ``x`` (b, heads, seq, head_dim): (2i, 2i+1) in
    "interleaved" mode, (i, i + d/2) in "half" mode (Hugging Face's ``rotate_half``)."""
    if mode == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over (b, heads, seq, d); returns (b, seq, heads*d).

    Without ``dropout`` (eval, or attention dropout 0 as LLaMA trains) this is one
    ``scaled_dot_product_attention`` call: flash / memory-efficient kernels on CUDA,
    the fused kernel on CPU, and no (seq x seq) probabilities kept for backward.
    SDPA cannot take an external mask, and the keyed mask must be a function of
    global (sample, head, i, j) (see parallel/random.py), so with ``dropout`` the
    probabilities are materialised -- leanly: the scale goes on q (b,h,s,d) instead of
    the scores (b,h,s,s), and the causal fill is in place on the fresh matmul output.
    benchmarks/micro_attention.py measures both routes against the plain one.

    ``key_mask`` (b, seq) bool, True = attend: BERT's padding mask, so no query reads a
    padding key.  SDPA takes it as a boolean ``attn_mask`` broadcast over heads and
    queries; the dropout route fills the masked scores with -inf before the softmax.
    A query whose keys are all masked (causal with left padding) gets zeros, with finite
    gradients, rather than the NaNs a softmax over no keys gives.
    """
    keep, has_key = None, None
    if key_mask is not None:
        keep = key_mask[:, None, None, :].to(torch.bool)
        if causal:
            keep = keep & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        has_key = keep.any(dim=-1, keepdim=True)  # (b, 1 or h, s_q, 1)
        keep = keep | ~has_key  # an all-masked row attends everywhere (finite), then is zeroed below
    if dropout is None:
        if keep is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    else:
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-1, -2)
        if keep is not None:
            scores.masked_fill_(~keep, float("-inf"))
        elif causal:
            s_q, s_k = scores.shape[-2], scores.shape[-1]
            scores.masked_fill_(torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out = dropout(scores.softmax(dim=-1)) @ v
    if has_key is not None:
        out = out * has_key
    return out.transpose(1, 2).flatten(2)
