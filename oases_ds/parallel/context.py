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


@dataclass
class ParallelContext:
    """Process groups and coordinates of this rank in the DP x TMP grid.

    Attributes:
        topology: the pure rank arithmetic.
        rank: this process's global rank.
        tp_group / dp_group: process groups containing this rank.
        device: where this rank's tensors live.
        sub_tp_groups: degree -> group of ``degree`` ranks inside this rank's TMP
            group (for layers planned with a smaller TMP degree).
    """

    topology: Topology
    rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    sub_tp_groups: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    reshard_groups: dict[tuple[int, int], dist.ProcessGroup | None] = field(default_factory=dict)

    @classmethod
    def build(
        cls, tensor_parallel_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None
    ) -> "ParallelContext":
        """Create all groups.  Collective over the world: every rank must call it."""
        init_distributed(timeout_s)
        world, rank = dist.get_world_size(), dist.get_rank()
        topo = Topology(world_size=world, tp_size=tensor_parallel_size)
        timeout = datetime.timedelta(seconds=timeout_s)

        def mine(groups: list[list[int]]) -> dist.ProcessGroup | None:
            found = None
            for ranks in groups:  # new_group is collective: every rank creates every group
                group = dist.new_group(ranks=ranks, timeout=timeout)
                if rank in ranks:
                    found = group
            return found

        tp_group = mine(topo.tp_group_ranks())
        dp_group = mine(topo.dp_group_ranks())
        subs: dict[int, dist.ProcessGroup | None] = {tensor_parallel_size: tp_group}
        degrees = [d for d in (2**k for k in range(tensor_parallel_size.bit_length())) if tensor_parallel_size % d == 0]
        for degree in degrees:
            if degree < tensor_parallel_size:
                subs[degree] = mine(topo.sub_tp_group_ranks(degree)) if degree > 1 else None
        reshard = {
            (small, large): mine(topo.reshard_group_ranks(small, large))
            for small in degrees for large in degrees if small < large
        }
        return cls(topo, rank, tp_group, dp_group, device or default_device(), timeout_s, subs, reshard)

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

    def tp_src_rank(self) -> int:
        """Global rank of TMP index 0 in this rank's TMP group."""
        return self.topology.rank(Coord(dp=self.dp_rank, tp=0))

    def sub_group(self, degree: int) -> dist.ProcessGroup | None:
        """Group sharding one replica of a layer planned at TMP ``degree``."""
        if degree not in self.sub_tp_groups:
            raise ValueError(f"TMP degree {degree} not available; built for {sorted(self.sub_tp_groups)}")
        return self.sub_tp_groups[degree]

    def layout(self, degree: int) -> "BlockLayout":
        """Where this rank sits for a block planned at TMP ``degree``."""
        return BlockLayout(degree, self.sub_group(degree), self.tp_rank // degree, self.tp_size // degree)

    def reshard_group(self, small: int, large: int) -> dist.ProcessGroup | None:
        """Group exchanging activations between degrees ``small < large`` (see Topology)."""
        if (small, large) not in self.reshard_groups:
            raise ValueError(f"no reshard group for degrees {small} -> {large}")
        return self.reshard_groups[(small, large)]

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
    group, so TMP shards are not overwritten by rank 0's, and (b) reduce
    gradients over the DP group only.
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

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._ctx.dp_group

    def get_data_parallel_rank(self) -> int:
        return self._ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self._ctx.dp_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
