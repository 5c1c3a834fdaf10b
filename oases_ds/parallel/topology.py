"""Pure rank arithmetic for a (pipeline x data-parallel x tensor-parallel) grid.

Kept free of ``torch.distributed`` so that the mapping can be unit-tested and
reasoned about without processes (STYLE lesson 5).  The layout follows Megatron:
tensor-parallel ranks are adjacent, then data-parallel, then pipeline stages::

    rank = pp * (dp_size * tp_size) + dp * tp_size + tp

so a TMP group is a contiguous block of ranks and lands on one node when nodes hold
whole TMP groups -- the fast links are spent on the chatty TMP collectives -- and a
pipeline stage is a contiguous block of ``dp_size * tp_size`` ranks, so with one
stage per node only the point-to-point activations of the stage boundary (one
``[b, s, h]`` tensor per micro-batch each way) cross the slow inter-node link.
With ``pp_size = 1`` (the default) this is the old ``rank = dp * tp_size + tp``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Coord:
    """Position of one rank in the grid (``pp``: its pipeline stage)."""

    dp: int
    tp: int
    pp: int = 0


@dataclass(frozen=True)
class Topology:
    """A ``world_size = pp_size * dp_size * tp_size`` grid of ranks.

    Attributes:
        world_size: total number of ranks.
        tp_size: tensor-model-parallel degree (ranks that share one layer).
        pp_size: pipeline stages (each holds a contiguous range of layers).
    """

    world_size: int
    tp_size: int
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tp_size}")
        if self.pp_size < 1:
            raise ValueError(f"pipeline_stages must be >= 1, got {self.pp_size}")
        if self.world_size % (self.tp_size * self.pp_size):
            if self.pp_size == 1:
                raise ValueError(
                    f"tensor_parallel_size={self.tp_size} does not divide world size {self.world_size}; "
                    f"launch a multiple of {self.tp_size} processes or change tensor_parallel_size"
                )
            model = self.tp_size * self.pp_size
            raise ValueError(
                f"pipeline_stages={self.pp_size} x tensor_parallel_size={self.tp_size} = {model} does not divide "
                f"world size {self.world_size}; launch a multiple of {model} processes or change either"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage (``dp_size * tp_size``, contiguous)."""
        return self.dp_size * self.tp_size

    def coord(self, rank: int) -> Coord:
        self._check_rank(rank)
        within = rank % self.stage_size
        return Coord(dp=within // self.tp_size, tp=within % self.tp_size, pp=rank // self.stage_size)

    def rank(self, coord: Coord) -> int:
        if not (0 <= coord.dp < self.dp_size and 0 <= coord.tp < self.tp_size and 0 <= coord.pp < self.pp_size):
            raise ValueError(f"{coord} outside a {self.pp_size}x{self.dp_size}x{self.tp_size} grid")
        return coord.pp * self.stage_size + coord.dp * self.tp_size + coord.tp

    def tp_group_ranks(self) -> list[list[int]]:
        """Every TMP group, each a list of global ranks (one group per (stage, DP index))."""
        return [[p * self.stage_size + d * self.tp_size + t for t in range(self.tp_size)]
                for p in range(self.pp_size) for d in range(self.dp_size)]

    def dp_group_ranks(self) -> list[list[int]]:
        """Every DP group, each a list of global ranks (one group per (stage, TMP index))."""
        return [[p * self.stage_size + d * self.tp_size + t for d in range(self.dp_size)]
                for p in range(self.pp_size) for t in range(self.tp_size)]

    def pp_group_ranks(self) -> list[list[int]]:
        """Every pipeline group: the ranks at one (DP, TMP) coordinate, stage 0 first.
        Activations travel between neighbours of such a group."""
        return [[p * self.stage_size + d * self.tp_size + t for p in range(self.pp_size)]
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def model_group_ranks(self) -> list[list[int]]:
        """Every model-parallel group (Megatron's "model parallel" = TMP x PP): the ranks
        holding one full copy of the model between them, one group per DP index.  A global
        gradient norm is summed over such a group."""
        return [[p * self.stage_size + d * self.tp_size + t for p in range(self.pp_size) for t in range(self.tp_size)]
                for d in range(self.dp_size)]

    def next_stage_rank(self, rank: int) -> int | None:
        """The rank at the same (DP, TMP) coordinate one stage later (``None`` on the last stage)."""
        c = self.coord(rank)
        return None if c.pp == self.pp_size - 1 else self.rank(Coord(c.dp, c.tp, c.pp + 1))

    def prev_stage_rank(self, rank: int) -> int | None:
        """The rank at the same (DP, TMP) coordinate one stage earlier (``None`` on the first stage)."""
        c = self.coord(rank)
        return None if c.pp == 0 else self.rank(Coord(c.dp, c.tp, c.pp - 1))

    def sub_tp_group_ranks(self, degree: int) -> list[list[int]]:
        """Groups of ``degree`` adjacent ranks inside each TMP group.

        A layer planned with TMP degree ``degree < tp_size`` runs ``tp_size // degree``
        replicas inside each TMP group; these are the groups that shard one replica.
        """
        if degree < 1 or self.tp_size % degree:
            raise ValueError(f"degree {degree} must divide tensor_parallel_size {self.tp_size}")
        return [grp[i : i + degree] for grp in self.tp_group_ranks() for i in range(0, self.tp_size, degree)]

    def reshard_group_ranks(self, small: int, large: int) -> list[list[int]]:
        """Groups that move activations between TMP degrees ``small < large``.

        Under degree ``d`` the ``tp_size`` ranks of a TMP group form ``tp_size/d``
        replicas of ``d`` adjacent ranks, each holding its share of the batch.  Going
        from ``large`` to ``small``, a ``large``-replica's share splits among the
        ``large/small`` ``small``-replicas inside it; the ranks that exchange pieces
        are those at the same offset within their ``small``-replica:
        ``{start + o + j * small : j < large/small}``.  The same groups hold the
        copies of one parameter shard of a degree-``small`` block when
        ``large == tp_size`` (its gradient is summed over them).
        """
        for d in (small, large):
            if d < 1 or self.tp_size % d:
                raise ValueError(f"degree {d} must divide tensor_parallel_size {self.tp_size}")
        if large % small or small >= large:
            raise ValueError(f"need small < large with small dividing large, got {small}, {large}")
        groups = []
        for grp in self.tp_group_ranks():
            for start in range(0, self.tp_size, large):
                for offset in range(small):
                    groups.append([grp[start + offset + j * small] for j in range(large // small)])
        return groups

    def replica_dp_group_ranks(self, small: int, large: int) -> list[list[int]]:
        """The reshard groups of degrees ``small < large`` joined across DP: the ranks holding
        one parameter shard of a degree-``small`` block in every replica and every DP
        replica.  One AllReduce over such a group sums a replicated block's gradient over
        its replicas and over DP at once."""
        first = [ranks for ranks in self.reshard_group_ranks(small, large) if max(ranks) < self.tp_size]
        return [sorted(p * self.stage_size + d * self.tp_size + t for d in range(self.dp_size) for t in ranks)
                for p in range(self.pp_size) for ranks in first]

    def degrees(self) -> list[int]:
        """The TMP degrees a plan may give a block: powers of two dividing ``tp_size``."""
        return [d for d in (2**k for k in range(self.tp_size.bit_length())) if self.tp_size % d == 0]

    def group_containing(self, rank: int, groups: list[list[int]]) -> list[int]:
        """The one group of a partition of the world (any ``*_group_ranks`` list) that holds ``rank``."""
        self._check_rank(rank)
        for ranks in groups:
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is in none of the {len(groups)} groups")

    def plan_group_keys(self, block_degrees: Sequence[int], data_parallel_reduce: bool = True) -> list[tuple]:
        """The partitions of plan groups a plan with per-block TMP degrees ``block_degrees``
        (``[L0.attn, L0.mlp, L1.attn, ...]``) uses on any rank, in one canonical order.

        * ``("sub", d)``: the groups sharding one replica of a degree-``d`` block, for each
          degree ``1 < d < tp_size`` of the plan (degree 1 needs none, ``tp_size`` is the TMP group);
        * ``("reshard", small, large)``: for each change of degree along embedding ->
          L0.attn -> L0.mlp -> ... -> head (both ends at ``tp_size``), the groups moving
          activations across it, and for each degree ``d < tp_size`` the groups summing its
          replicas' gradients (``(d, tp_size)``);
        * ``("replica_dp", d)``: with ``data_parallel_reduce`` and more than one DP replica,
          the groups summing a degree-``d`` block's gradient over its replicas and DP at once.

        A function of the whole plan, not of a stage's layers: every rank must create the
        same groups (``ParallelContext`` explains why)."""
        for d in block_degrees:
            if d < 1 or self.tp_size % d:
                raise ValueError(f"degree {d} must divide tensor_parallel_size {self.tp_size}")
        degrees = sorted(set(block_degrees))
        keys: set[tuple] = {("sub", d) for d in degrees if 1 < d < self.tp_size}
        path = [self.tp_size, *block_degrees, self.tp_size]
        keys |= {("reshard", min(a, b), max(a, b)) for a, b in zip(path, path[1:]) if a != b}
        keys |= {("reshard", d, self.tp_size) for d in degrees if d < self.tp_size}
        if data_parallel_reduce and self.dp_size > 1:
            keys |= {("replica_dp", d) for d in degrees if d < self.tp_size}
        kinds = ("sub", "reshard", "replica_dp")
        return sorted(keys, key=lambda k: (kinds.index(k[0]), k[1:]))

    def plan_group_partition(self, key: tuple) -> list[list[int]]:
        """The groups of the partition ``key`` names (:meth:`plan_group_keys`)."""
        kind, *degrees = key
        if kind == "sub":
            return self.sub_tp_group_ranks(*degrees)
        if kind == "reshard":
            return self.reshard_group_ranks(*degrees)
        if kind == "replica_dp":
            return self.replica_dp_group_ranks(degrees[0], self.tp_size)
        raise ValueError(f"unknown plan group kind {kind!r}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
