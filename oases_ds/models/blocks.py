"""The modules of GPT, BERT and LLaMA, described once: embedding, transformer layer, head.

They hold parameters only; what runs on them, in which order and around which
collectives, is the operator sequence built in :mod:`oases_ds.models.operator_model`.
Kept apart so that a layer's parameters can be built and counted without a
process group or an operator sequence (the planner counts a paper-size layer on
the meta device).  The three families differ only in a few switches: norm type,
biases, MLP kind and learned positions; parameter names equal those of a plain
unsharded model (``layers.0.attn.q.weight`` ...).
"""
from __future__ import annotations

import torch
from torch import nn

from oases_ds.models.config import ModelConfig
from oases_ds.parallel.collectives import Group, group_size
from oases_ds.parallel.layers import (
    ColumnParallelLinear,
    ReplicatedHeadLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_parallel,
    vocab_parallel_bias,
)


def _norm(cfg: ModelConfig, size: int) -> nn.Module:
    return RMSNorm(size, cfg.eps) if cfg.family == "llama" else LayerNorm(size, cfg.eps)


class Embedding(nn.Module):
    """Vocab-parallel token embedding over the full TMP group, learned positions (GPT, BERT),
    BERT's token-type table and embedding norm."""

    def __init__(self, cfg: ModelConfig, group: Group) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.word = VocabParallelEmbedding(cfg.vocab_size, H, group, padding_idx=cfg.pad_token_id)
        if cfg.family != "llama":
            self.pos = mark_parallel(nn.Parameter(torch.empty(cfg.seq_len, H)), None)
        if cfg.type_vocab_size:
            self.types = mark_parallel(nn.Parameter(torch.empty(cfg.type_vocab_size, H)), None)
        if cfg.family == "bert":
            self.norm = LayerNorm(H, cfg.eps)


class TransformerLayer(nn.Module):
    """One layer: attention (q, k, v column-parallel, o row-parallel) and MLP (GELU fc1/fc2,
    or LLaMA's gated SiLU gate/up/down), each sharded over its own block's group.  LLaMA has
    no biases except, with ``qkv_bias`` (Qwen2), those of q, k and v: split with their rows,
    or held whole with a replicated k/v head."""

    def __init__(self, cfg: ModelConfig, attn_group: Group, mlp_group: Group) -> None:
        super().__init__()
        bias = cfg.family != "llama"
        qkv_bias = bias or cfg.qkv_bias
        self.attn_norm = _norm(cfg, cfg.hidden_size)
        self.mlp_norm = _norm(cfg, cfg.hidden_size)
        H = cfg.hidden_size
        self.attn = nn.Module()
        self.attn.q = ColumnParallelLinear(H, H, attn_group, qkv_bias)
        if cfg.kv_heads < group_size(attn_group):  # fewer k/v heads than ranks: each rank holds its query heads' one
            self.attn.k = ReplicatedHeadLinear(H, cfg.kv_heads, cfg.head_dim, attn_group, qkv_bias)
            self.attn.v = ReplicatedHeadLinear(H, cfg.kv_heads, cfg.head_dim, attn_group, qkv_bias)
        else:  # grouped-query: fewer k/v heads, split over the ranks
            self.attn.k = ColumnParallelLinear(H, cfg.kv_dim, attn_group, qkv_bias)
            self.attn.v = ColumnParallelLinear(H, cfg.kv_dim, attn_group, qkv_bias)
        self.attn.o = RowParallelLinear(H, H, attn_group, bias)
        self.mlp = nn.Module()
        if cfg.family == "llama":
            self.mlp.gate = ColumnParallelLinear(H, cfg.ffn, mlp_group, bias=False)
            self.mlp.up = ColumnParallelLinear(H, cfg.ffn, mlp_group, bias=False)
            self.mlp.down = RowParallelLinear(cfg.ffn, H, mlp_group, bias=False)
        else:
            self.mlp.fc1 = ColumnParallelLinear(H, cfg.ffn, mlp_group, bias)
            self.mlp.fc2 = RowParallelLinear(cfg.ffn, H, mlp_group, bias)


class OtherStageLayer(nn.Module):
    """Stands in for a transformer layer that another pipeline stage holds: no parameters.

    Why a placeholder rather than a shorter list: the ``ModuleList``'s indices stay the
    global layer indices, so parameter names (``layers.5.attn.q.weight``), initial
    weights, plans and checkpoints read the same with or without stages."""


class Head(nn.Module):
    """Final norm (BERT: the masked-LM transform, dense + activation + norm) and the
    vocab-parallel decoder over the full TMP group (none with ``tie_embeddings``: the loss
    then reads the embedding table; a tied BERT head keeps its own vocab-parallel ``bias``)."""

    def __init__(self, cfg: ModelConfig, group: Group) -> None:
        super().__init__()
        H = cfg.hidden_size
        if cfg.family == "bert":
            self.dense = nn.Linear(H, H)
            for p in self.dense.parameters():
                mark_parallel(p, None)
            self.norm = LayerNorm(H, cfg.eps)
        else:
            self.norm = _norm(cfg, H)
        if not cfg.tie_embeddings:
            self.decoder = ColumnParallelLinear(H, cfg.vocab_size, group, bias=cfg.family == "bert", pad=True)
        elif cfg.family == "bert":
            self.bias = vocab_parallel_bias(cfg.vocab_size, group)


def layer_parameter_counts(cfg: ModelConfig, degree: int = 1) -> dict[str, int]:
    """Parameters one device holds of one layer's "attn" and "mlp" block at TMP degree ``degree``.

    Counted on the layer itself, built on the meta device (shapes, no storage),
    so a paper-size layer costs nothing to count and the count cannot drift from
    the model: a parameter split over TMP ranks (``tp_dim`` set) contributes
    ``numel / degree``, a replicated one (norms, row-parallel biases) all of it.
    Each norm belongs to the block it normalises for.  With fewer k/v heads than ranks the
    k and v projections (and their biases) are held whole on every rank
    (:class:`ReplicatedHeadLinear`), which a layer built without a group cannot show, so
    they are counted whole here.
    """
    cfg.check_tp(degree)
    with torch.device("meta"):
        layer = TransformerLayer(cfg, None, None)
    replicated_kv = cfg.kv_heads < degree
    counts = {"attn": 0, "mlp": 0}
    for name, param in layer.named_parameters():
        kind = "attn" if name.split(".")[0].startswith("attn") else "mlp"
        whole = replicated_kv and name.startswith(("attn.k.", "attn.v."))
        counts[kind] += param.numel() if whole else _per_device(param, degree)
    return counts


def embed_head_parameter_count(cfg: ModelConfig, degree: int) -> int:
    """Parameters one device holds of the embedding and the head, both sharded over the
    full TMP group of ``degree`` ranks; counted on the meta device, as
    :func:`layer_parameter_counts` (the memory model's model states)."""
    cfg.check_tp(degree)
    with torch.device("meta"):
        modules = (Embedding(cfg, None), Head(cfg, None))
    return sum(_per_device(param, degree) for module in modules for param in module.parameters())


def end_parameter_counts(cfg: ModelConfig, degree: int) -> dict[str, int]:
    """Parameters one device holds of the embedding (``"embed"``) and of the head (``"head"``)
    apart, for pipeline stages: the first stage holds the one, the last the other.  With
    ``tie_embeddings`` the head reads the word embedding, so the last stage holds its own copy
    of that table (Megatron's tied-embedding copy, kept equal by an all-reduce of the two
    gradients) and ``"head"`` counts it; on one stage :func:`embed_head_parameter_count` is the
    right count (one table)."""
    cfg.check_tp(degree)
    with torch.device("meta"):
        embed, head = Embedding(cfg, None), Head(cfg, None)
    counts = {"embed": sum(_per_device(p, degree) for p in embed.parameters()),
              "head": sum(_per_device(p, degree) for p in head.parameters())}
    if cfg.tie_embeddings:
        counts["head"] += _per_device(embed.word.weight, degree)
    return counts


def largest_parameter_count(cfg: ModelConfig, degree: int) -> int:
    """The most elements one parameter holds on one device at TMP degree ``degree`` (usually the
    word embedding's or the head's shard): what DeepSpeed's optimizer offload sizes its device
    staging buffer by (the memory model's ``offload_staging_bytes``)."""
    cfg.check_tp(degree)
    with torch.device("meta"):
        modules = (Embedding(cfg, None), Head(cfg, None), TransformerLayer(cfg, None, None))
    return max(_per_device(p, degree) for module in modules for p in module.parameters())


def _per_device(param: nn.Parameter, degree: int) -> int:
    """A parameter split over TMP ranks (``tp_dim`` set) is held ``1/degree`` per device, a replicated one whole."""
    return param.numel() // degree if getattr(param, "tp_dim", None) is not None else param.numel()
