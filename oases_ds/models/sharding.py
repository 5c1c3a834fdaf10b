"""How a model's parameters are split over TMP ranks, and how to undo the split.

Every parameter has one *full* (unsharded) value; a parameter's ``tp_dim`` says
along which dimension it is split, and its block's group over how many ranks.
Initial weights, checkpoints and the comparison with an unsharded reference all
go through the full value, which is why any TMP degree -- and every degree a
heterogeneous plan mixes -- starts from, and can be checked against, the same
global weights.

A block planned at degree ``t`` inside a TMP group of ``T`` ranks runs ``T/t``
replicas (paper Section V); this module also says which parameters those
replicas share and must sum gradients over.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from oases_ds.parallel.collectives import Group, group_rank, group_size, start_all_gather
from oases_ds.parallel.context import BlockLayout
from oases_ds.parallel.random import mix_key


def init_full_parameter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic full (unsharded) initial value of parameter ``name``.

    Depends only on (seed, name, shape), so every TMP degree -- and an independent
    reference model -- starts from the same global weights.  Norm weights are near
    one, everything else small and non-zero, so every gradient path is exercised.
    """
    gen = torch.Generator().manual_seed(mix_key(seed, zlib.crc32(name.encode())))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.1 * noise
    return 0.02 * noise if name.endswith("weight") else 0.01 * noise


@dataclass(frozen=True, eq=False)
class Sharding:
    """Which group each parameter of a model is split over.

    Attributes:
        group: the full TMP group (embedding and head; ``None``: one rank).
        layouts: per layer, the (attention, MLP) :class:`BlockLayout`.
        reshard_group: ``(small, large) -> group`` of ranks at the same offset in
            blocks of those degrees; needed only when ``layouts`` mix degrees.
    """

    group: Group
    layouts: tuple[tuple[BlockLayout, BlockLayout], ...]
    reshard_group: Callable[[int, int], Group] | None = None

    @property
    def full_degree(self) -> int:
        return group_size(self.group)

    @property
    def max_replicas(self) -> int:
        """Most copies any block runs: each sub-batch must split evenly among them."""
        return max(max(a.replicas, m.replicas) for a, m in self.layouts)

    def group_of(self, name: str) -> Group:
        """Group a parameter is sharded over: its block's group (norms follow their block)."""
        if name.startswith("layers."):
            idx = int(name.split(".")[1])
            attn = ".attn." in name or ".attn_norm." in name
            return self.layouts[idx][0 if attn else 1].group
        return self.group

    def full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        """Unsharded shape of a parameter."""
        dim = getattr(param, "tp_dim", None)
        shape = list(param.shape)
        if dim is not None:
            shape[dim] = getattr(param, "tp_full", shape[dim] * group_size(self.group_of(name)))
        return tuple(shape)

    def shard_of(self, name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full``, an unsharded value of parameter ``name``."""
        dim = getattr(param, "tp_dim", None)
        if dim is None:
            return full
        group = self.group_of(name)
        local = param.shape[dim]
        start = group_rank(group) * local
        piece = full.narrow(dim, min(start, full.shape[dim]), max(0, min(local, full.shape[dim] - start)))
        if piece.shape[dim] == local:
            return piece
        pad = list(piece.shape)  # vocabulary padding: zero rows past the real vocabulary
        pad[dim] = local - piece.shape[dim]
        return torch.cat((piece, piece.new_zeros(pad)), dim=dim)

    def gather_full(self, name: str, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The unsharded value of ``local`` (a shard of parameter ``name``, or of its
        gradient): the inverse of :meth:`shard_of`.  Collective over the parameter's
        group; always a new tensor, never a view of ``local``."""
        dim = getattr(param, "tp_dim", None)
        local = local.detach().clone()
        if dim is None:
            return local
        full = start_all_gather(local, self.group_of(name), dim).wait()
        return full.narrow(dim, 0, getattr(param, "tp_full", full.shape[dim])).clone()

    def mark_replicated_shards(self, layers: nn.ModuleList) -> None:
        """A block at degree ``t < T`` has ``T/t`` copies of each shard.  DeepSpeed's
        gradient-norm clipping counts a parameter marked ``tensor_model_parallel`` on
        every TMP rank and an unmarked one only on TMP rank 0, so marking the shards
        on replica 0 only makes every shard count exactly once."""
        for i, layer in enumerate(layers):
            if not hasattr(layer, "attn"):  # held by another pipeline stage
                continue
            for layout, module in zip(self.layouts[i], (layer.attn, layer.mlp)):
                if layout.replicas > 1:
                    for p in module.parameters():
                        if getattr(p, "tp_dim", None) is not None:  # replicated ones stay unmarked: TMP rank 0 counts them
                            p.tensor_model_parallel = p.model_parallel = layout.replica == 0  # type: ignore[attr-defined]

    def replica_groups(self, layers: nn.ModuleList) -> list[tuple[list[nn.Parameter], Group]]:
        """Parameters of ``layers`` whose gradient must be summed over the copies of their
        block (each copy saw only its share of the batch), with the group of those copies."""
        out = []
        for i, layer in enumerate(layers):
            if not hasattr(layer, "attn"):  # held by another pipeline stage
                continue
            for layout, kind, module in zip(self.layouts[i], ("attn", "mlp"), (layer.attn, layer.mlp)):
                if layout.replicas > 1:
                    params = list(module.parameters())
                    if kind == "attn":
                        params += list(layer.attn_norm.parameters())
                    else:
                        params += list(layer.mlp_norm.parameters())
                    out.append((params, self.reshard_group(layout.degree, self.full_degree)))
        return out
