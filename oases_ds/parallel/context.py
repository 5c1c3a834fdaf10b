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
BACKEND_ENV = "OASES_BACKEND"
"""Environment variable naming the process-group backend, in ``init_process_group``'s
form: ``gloo``, ``nccl`` or per device, ``cpu:gloo,cuda:nccl``."""
_BACKENDS = {"cpu": ("gloo",), "cuda": ("nccl", "gloo")}


def resolve_backend(backend: str | None = None) -> str:
    """The backend to initialise: ``backend``, else ``$OASES_BACKEND``, else by device.

    The default on a CUDA host is ``cpu:gloo,cuda:nccl``, not plain NCCL: tensors on the
    GPU go through NCCL and CPU tensors (a test's CPU model, a small host-side reduction)
    through gloo, where a forced NCCL answers "no backend type associated with device
    type cpu".  ``gloo`` alone makes every rank a CPU rank (:func:`rank_device`), so the
    CPU test tiers run unchanged on a GPU host, several ranks per GPU included.
    Anything else is one line naming the setting."""
    source = "backend" if backend is not None else BACKEND_ENV
    value = backend if backend is not None else os.environ.get(BACKEND_ENV, "")
    if not value:
        return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    value = value.strip().lower()
    if value in ("gloo", "nccl"):
        return value
    pairs = [part.split(":") for part in value.split(",")]
    if not all(len(p) == 2 and p[0] in _BACKENDS and p[1] in _BACKENDS[p[0]] for p in pairs) or \
            len({p[0] for p in pairs}) != len(pairs):
        raise ValueError(f"{source}={value!r} is not a backend; use gloo, nccl or cpu:gloo,cuda:nccl")
    return value


def uses_cuda(backend: str) -> bool:
    """Whether ``backend`` (resolved, or a live group's) gives CUDA tensors a backend:
    then ranks run on GPUs."""
    backend = backend.lower()
    return backend == "nccl" or "cuda:" in backend


def check_devices(ranks_per_host: int, cuda_devices: int) -> None:
    """One line if a host has more ranks than GPUs: NCCL refuses two ranks on one device
    ("Duplicate GPU detected") and DeepSpeed binds rank ``i`` to ``cuda:i`` ("invalid
    device ordinal"), both as a traceback from inside every rank."""
    if ranks_per_host > cuda_devices:
        raise ValueError(
            f"{ranks_per_host} ranks on this host need {ranks_per_host} GPUs (NCCL takes one per rank) but it has "
            f"{cuda_devices}: start at most {cuda_devices} per host (oases-train nprocs={cuda_devices}, torchrun "
            f"--nproc_per_node {cuda_devices}, with tensor_parallel_size to match), or train on the CPU with "
            f"CUDA_VISIBLE_DEVICES= (gloo)")


def rank_device(backend: str) -> torch.device:
    """This rank's device under ``backend``: ``cuda:LOCAL_RANK`` when it runs CUDA tensors,
    else CPU.  ``LOCAL_RANK`` beyond the visible GPUs is an error (:func:`check_devices`),
    not a device taken modulo the count: two ranks on one GPU would fail later in NCCL."""
    if not torch.cuda.is_available() or not uses_cuda(backend):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    check_devices(local + 1, torch.cuda.device_count())
    return torch.device("cuda", local)


def default_device() -> torch.device:
    """This rank's device under the default group's backend once it exists (DeepSpeed may
    have chosen it), else under :func:`resolve_backend`'s; never hard-coded."""
    return rank_device(str(dist.get_backend()) if dist.is_initialized() else resolve_backend())


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> None:
    """Initialise the default process group from the usual env (torchrun / deepspeed).

    Every group gets a timeout, so that a dead peer turns into an error instead of
    a hang.  The backend is :func:`resolve_backend`'s (gloo on CPU, per device on CUDA
    hosts, or what ``backend`` / ``$OASES_BACKEND`` say).
    """
    if dist.is_initialized():
        return
    backend = resolve_backend(backend)
    if uses_cuda(backend) and torch.cuda.is_available():
        torch.cuda.set_device(rank_device(backend))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


NewGroup = Callable[..., "dist.ProcessGroup | None"]
PlanKey = tuple
"""Names one partition of the world into plan groups: ``("sub", d)``, ``("reshard", small,
large)`` or ``("replica_dp", d)`` (see :meth:`Topology.plan_group_keys`)."""


class LateGroupError(RuntimeError):
    """A plan group asked for after start-up: on NCCL its creation would hang (below)."""


@dataclass
class ParallelContext:
    """Process groups and coordinates of this rank in the PP x DP x TMP grid.

    With pipeline stages (``topology.pp_size > 1``) the context also holds this rank's
    pipeline groups -- one for activations (:attr:`pp_group`) and one for gradients
    (:attr:`pp_grad_group`), over the same ranks, one per stage, so that each NCCL
    stream carries one direction (see :mod:`oases_ds.schedule.pipeline`) -- the
    model-parallel group (TMP x PP: where a global gradient norm is summed) and its
    neighbours' global ranks, :attr:`prev_rank` / :attr:`next_rank`.  Nothing about
    them is global.

    **Every rank creates every group, in one order.**  Once the default group is bound
    to a device (DeepSpeed does so on CUDA), torch makes each ``new_group`` by splitting
    the world's NCCL communicator, a collective over *all* ranks that has no timeout:
    a rank that creates a group the others do not waits forever.  So groups come in
    whole partitions of the world -- every TMP group, every DP group, ... -- and each
    rank calls ``new_group`` for each group of a partition (keeping its own), in the
    same order on every rank, as Megatron does.  The TMP, DP and pipeline partitions are
    made here; the partitions a plan needs (the sub-TMP groups of its degrees, the
    reshard groups between its consecutive blocks' degrees, the replica groups) are
    made by :meth:`create_plan_groups` from the whole plan, before any stage builds
    its layers, since stages differ in which groups they use but must not differ in
    which they create.  Afterwards the context is *sealed*: asking for a plan group that
    was not made raises :class:`LateGroupError` instead of creating it on some ranks.
    Unsealed (a profiler that steps through degrees on every rank), a request creates
    its partition then and there, which every rank must also do in the same order.

    Attributes:
        topology: the pure rank arithmetic.
        rank: this process's global rank.
        tp_group / dp_group: process groups containing this rank.
        pp_group / pp_grad_group: this rank's pipeline groups for activations / gradients
            (``None`` with one stage).
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
    pp_grad_group: dist.ProcessGroup | None = None
    model_group: dist.ProcessGroup | None = None
    sealed: bool = False

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
        so a unit test can build every rank's context with a counting fake."""
        ctx = cls(topology, rank, None, None, device or torch.device("cpu"), timeout_s, new_group)
        ctx.tp_group = ctx._create(topology.tp_group_ranks())
        ctx.dp_group = ctx._create(topology.dp_group_ranks())
        if topology.pp_size > 1:  # every rank agrees on pp_size, so all create the same groups
            ctx.pp_group = ctx._create(topology.pp_group_ranks())
            ctx.pp_grad_group = ctx._create(topology.pp_group_ranks())
            ctx.model_group = ctx._create(topology.model_group_ranks())
        else:
            ctx.model_group = ctx.tp_group
        return ctx

    def _create(self, partition: list[list[int]]) -> dist.ProcessGroup | None:
        """This rank's group of ``partition``, after calling ``new_group`` for every group of
        it (see the class docstring): all ranks make the same calls in the same order."""
        mine = None
        for ranks in partition:
            group = self.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=self.timeout_s),
                                   use_local_synchronization=False)
            if self.rank in ranks:
                mine = group
        return mine

    def create_plan_groups(self, block_degrees: list[int], data_parallel_reduce: bool = True) -> None:
        """Create, on every rank and in one order, every plan group a plan with these per-block
        degrees (``[L0.attn, L0.mlp, L1.attn, ...]``) uses on any stage, then seal the
        context.  Collective: every rank calls it with the same plan.  ``data_parallel_reduce``
        adds the groups that sum a replicated block's gradient over DP in one AllReduce."""
        for degree in block_degrees:
            self._check_degree(degree)
        for key in self.topology.plan_group_keys(block_degrees, data_parallel_reduce):
            if key not in self._plan_groups:
                self._plan_groups[key] = self._create(self.topology.plan_group_partition(key))
        self.sealed = True

    def _plan_group(self, key: PlanKey) -> dist.ProcessGroup | None:
        """The group of ``key`` holding this rank (see the class docstring for when it is made)."""
        if key not in self._plan_groups:
            if self.sealed:
                raise LateGroupError(f"plan group {key} was not created at start-up; create_plan_groups() makes every "
                                     f"group of the plan on every rank (on NCCL a late one would hang start-up)")
            self._plan_groups[key] = self._create(self.topology.plan_group_partition(key))
        return self._plan_groups[key]

    @property
    def plan_groups_created(self) -> int:
        """Plan groups holding this rank created so far (beyond TMP, DP and pipeline groups)."""
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
        """Group sharding one replica of a layer planned at TMP ``degree``."""
        self._check_degree(degree)
        if degree == 1:
            return None
        if degree == self.tp_size:
            return self.tp_group
        return self._plan_group(("sub", degree))

    def _check_degree(self, degree: int) -> None:
        if degree not in self.topology.degrees():
            raise ValueError(f"TMP degree {degree} not available; tensor_parallel_size={self.tp_size} allows "
                             f"{self.topology.degrees()}")

    def layout(self, degree: int) -> "BlockLayout":
        """Where this rank sits for a block planned at TMP ``degree``."""
        return BlockLayout(degree, self.sub_group(degree), self.tp_rank // degree, self.tp_size // degree)

    def reshard_group(self, small: int, large: int) -> dist.ProcessGroup | None:
        """Group exchanging activations between degrees ``small < large`` (see Topology)."""
        degrees = self.topology.degrees()
        if small not in degrees or large not in degrees or small >= large:
            raise ValueError(f"no reshard group for degrees {small} -> {large}; both must be in {degrees}, small < large")
        return self._plan_group(("reshard", small, large))

    def replica_dp_group(self, degree: int) -> dist.ProcessGroup | None:
        """The replicas of this rank's shard of a degree-``degree`` block, across all DP
        replicas (``Topology.replica_dp_group_ranks``)."""
        if degree not in self.topology.degrees() or degree >= self.tp_size:
            raise ValueError(f"no replica group for TMP degree {degree}; it must be in {self.topology.degrees()[:-1]}")
        if self.dp_size == 1:  # the same ranks as the reshard group to the full degree
            return self.reshard_group(degree, self.tp_size)
        return self._plan_group(("replica_dp", degree))

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
