"""The one object that owns this process's process groups.

Built once at start-up and passed explicitly to layers, executor, engine and
Lightning strategy (STYLE lesson 4): nothing here is a module global, so two
contexts (say, a test that builds TMP=2 and then TMP=1) never step on each other.
DeepSpeed wants a Megatron-shaped ``mpu`` object; :class:`MPUAdapter` is a thin
view over the context rather than a second home for group state.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from oases_ds.parallel.topology import Coord, Topology

DEFAULT_TIMEOUT_S = 300.0


def default_device() -> torch.device:
    """CUDA (by LOCAL_RANK) when present, else CPU; never hard-coded."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> None:
    """Initialise the default process group from the usual env (torchrun / deepspeed).

    Every group gets a timeout, so that a dead peer turns into an error instead of
    a hang.  gloo on CPU, NCCL on CUDA unless ``backend`` says otherwise.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


NewGroup = Callable[..., "dist.ProcessGroup | None"]


@dataclass
class ParallelContext:
    """Process groups and coordinates of this rank in the PP x DP x TMP grid.

    With pipeline stages (``topology.pp_size > 1``) the context also holds this rank's
    pipeline group (the ranks at its (DP, TMP) coordinate, one per stage), the
    model-parallel group (TMP x PP: where a global gradient norm is summed) and its
    neighbours' global ranks, :attr:`prev_rank` / :attr:`next_rank`, which the
    pipeline executor sends to and receives from.  Nothing about them is global.

    Only the TMP and DP groups exist from the start.  The groups a plan needs
    (one replica of a block at a smaller TMP degree, the ranks that reshard
    activations between two degrees) are created the first time this rank asks
    for them, and only the one holding this rank: building every group of every
    degree on every rank, as ``new_group`` without local synchronisation demands,
    is about 1,500 calls per rank at 512 ranks (``Topology.eager_group_count``),
    most of them for plans that never run.

    Groups are made with ``use_local_synchronization=True``, so only members
    take part.  torch names such a group from its ranks and the number of groups
    the calling rank already has, so members must have created the same number
    before: that holds because every rank creates exactly its TMP and DP groups
    here, and later asks for plan groups in the same order (the model is built
    from the same plan on every rank, one creation per new request).

    Attributes:
        topology: the pure rank arithmetic.
        rank: this process's global rank.
        tp_group / dp_group: process groups containing this rank.
        pp_group: this rank's pipeline group (``None`` with one stage).
        model_group: TMP x PP group of this rank (the TMP group with one stage).
        device: where this rank's tensors live.
        timeout_s: every group's timeout, so a dead peer is an error, not a hang.
        new_group: ``torch.distributed.new_group``-shaped factory (tests count calls).
    """

    topology: Topology
    rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    new_group: NewGroup = field(default=dist.new_group, repr=False)
    _plan_groups: dict[tuple, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)
    pp_group: dist.ProcessGroup | None = None
    model_group: dist.ProcessGroup | None = None

    @classmethod
    def build(
        cls, tensor_parallel_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None,
        pipeline_stages: int = 1,
    ) -> "ParallelContext":
        """Create this rank's TMP and DP groups (and with ``pipeline_stages > 1`` its
        pipeline and model-parallel groups).  Every rank must call it (each blocks until
        the members of its groups have)."""
        init_distributed(timeout_s)
        topo = Topology(world_size=dist.get_world_size(), tp_size=tensor_parallel_size, pp_size=pipeline_stages)
        return cls.for_rank(topo, dist.get_rank(), timeout_s, device or default_device())

    @classmethod
    def for_rank(
        cls, topology: Topology, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None,
        new_group: NewGroup = dist.new_group,
    ) -> "ParallelContext":
        """The context of ``rank`` with groups from ``new_group``; pure but for the factory,
        so a unit test can build all 512 ranks' contexts with a counting fake."""
        ctx = cls(topology, rank, None, None, device or torch.device("cpu"), timeout_s, new_group)
        ctx.tp_group = ctx._create(topology.group_containing(rank, topology.tp_group_ranks()))
        ctx.dp_group = ctx._create(topology.group_containing(rank, topology.dp_group_ranks()))
        if topology.pp_size > 1:  # every rank agrees on pp_size, so all create the same number of groups
            ctx.pp_group = ctx._create(topology.group_containing(rank, topology.pp_group_ranks()))
            ctx.model_group = ctx._create(topology.group_containing(rank, topology.model_group_ranks()))
        else:
            ctx.model_group = ctx.tp_group
        return ctx

    def _create(self, ranks: list[int]) -> dist.ProcessGroup | None:
        return self.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=self.timeout_s),
                              use_local_synchronization=True)

    def _plan_group(self, key: tuple, groups: Callable[[], list[list[int]]]) -> dist.ProcessGroup | None:
        """The group of ``key`` holding this rank, created on first request (see the class docstring)."""
        if key not in self._plan_groups:
            self._plan_groups[key] = self._create(self.topology.group_containing(self.rank, groups()))
        return self._plan_groups[key]

    @property
    def plan_groups_created(self) -> int:
        """Plan groups this rank has created so far (beyond its TMP and DP groups)."""
        return sum(g is not None for g in self._plan_groups.values())

    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_size(self) -> int:
        return self.topology.pp_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.coord.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank this stage receives activations from (``None`` on the first stage)."""
        return self.topology.prev_stage_rank(self.rank)

    @property
    def next_rank(self) -> int | None:
        """Global rank this stage sends activations to (``None`` on the last stage)."""
        return self.topology.next_stage_rank(self.rank)

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last stage at this rank's (DP, TMP) coordinate: where the loss is."""
        return self.topology.rank(Coord(dp=self.dp_rank, tp=self.tp_rank, pp=self.pp_size - 1))

    def tp_src_rank(self) -> int:
        """Global rank of TMP index 0 in this rank's TMP group."""
        return self.topology.rank(Coord(dp=self.dp_rank, tp=0, pp=self.pp_rank))

    def sub_group(self, degree: int) -> dist.ProcessGroup | None:
        """Group sharding one replica of a layer planned at TMP ``degree`` (created on first use)."""
        if degree not in self.topology.degrees():
            raise ValueError(f"TMP degree {degree} not available; tensor_parallel_size={self.tp_size} allows "
                             f"{self.topology.degrees()}")
        if degree == 1:
            return None
        if degree == self.tp_size:
            return self.tp_group
        return self._plan_group(("sub", degree), lambda: self.topology.sub_tp_group_ranks(degree))

    def layout(self, degree: int) -> "BlockLayout":
        """Where this rank sits for a block planned at TMP ``degree``."""
        return BlockLayout(degree, self.sub_group(degree), self.tp_rank // degree, self.tp_size // degree)

    def reshard_group(self, small: int, large: int) -> dist.ProcessGroup | None:
        """Group exchanging activations between degrees ``small < large`` (see Topology),
        created on first use."""
        degrees = self.topology.degrees()
        if small not in degrees or large not in degrees or small >= large:
            raise ValueError(f"no reshard group for degrees {small} -> {large}; both must be in {degrees}, small < large")
        return self._plan_group(("reshard", small, large), lambda: self.topology.reshard_group_ranks(small, large))

    def replica_dp_group(self, degree: int) -> dist.ProcessGroup | None:
        """The replicas of this rank's shard of a degree-``degree`` block, across all DP
        replicas (``Topology.replica_dp_group_ranks``), created on first use."""
        if degree not in self.topology.degrees() or degree >= self.tp_size:
            raise ValueError(f"no replica group for TMP degree {degree}; it must be in {self.topology.degrees()[:-1]}")
        return self._plan_group(("replica_dp", degree),
                                lambda: self.topology.replica_dp_group_ranks(degree, self.tp_size))

    def mpu(self) -> "MPUAdapter":
        return MPUAdapter(self)


@dataclass(frozen=True)
class BlockLayout:
    """A block at TMP ``degree`` inside a TMP group of ``replicas * degree`` ranks.

    Attributes:
        degree: ranks sharding the block's parameters.
        group: those ranks' process group (``None`` for one rank).
        replica: which of the ``replicas`` copies of the block this rank belongs to;
            replica ``r`` processes the ``r``-th share of each sub-batch.
        replicas: copies of the block in the TMP group.
    """

    degree: int
    group: dist.ProcessGroup | None
    replica: int = 0
    replicas: int = 1


class MPUAdapter:
    """Megatron ``mpu`` interface that DeepSpeed queries, answered from a context.

    DeepSpeed uses it to (a) broadcast initial parameters only within the DP
    group, so TMP shards are not overwritten by rank 0's, (b) reduce
    gradients over the DP group only, and (c) name checkpoint files and sum
    gradient norms by the model-parallel (TMP x PP) rank and group.
    """

    def __init__(self, ctx: ParallelContext) -> None:
        self._ctx = ctx

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self._ctx.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ctx.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ctx.tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ctx.tp_src_rank()

    # Megatron's "model parallel" is TMP x PP: the ranks holding one copy of the model.
    # DeepSpeed names checkpoint files by this rank (so each stage saves its own layers)
    # and sums gradient norms over this group; with one stage it is the TMP group.
    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self._ctx.model_group

    def get_model_parallel_rank(self) -> int:
        return self._ctx.pp_rank * self._ctx.tp_size + self._ctx.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self._ctx.pp_size * self._ctx.tp_size

    def get_model_parallel_src_rank(self) -> int:
        return self._ctx.topology.rank(Coord(dp=self._ctx.dp_rank, tp=0, pp=0))

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._ctx.dp_group

    def get_data_parallel_rank(self) -> int:
        return self._ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self._ctx.dp_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ctx.pp_size

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ctx.pp_rank

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self._ctx.pp_group
