"""Profiled costs of one transformer layer at every TMP degree, and the reshard model.

The planner never runs a model: it reads a :class:`CostTable` produced once per
(model, cluster, schedule, devices) by the profiler and saved as JSON, so the
solver can be tested on CPU with synthetic numbers and a profile is reused
across runs (:meth:`CostTable.key`).  Every time is per training step of one
micro-batch on one device, in milliseconds; every size is per device, in bytes.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from oases_ds.models.config import FAMILIES
from oases_ds.parallel.link import LinkModel
from oases_ds.planner.jsonio import check_fields, load_dataclass, parse_dataclass
from oases_ds.schedule.generators import RECOMPUTE_POLICIES, ScheduleSpec
from oases_ds.utils.io import write_json_atomic

BLOCK_KINDS: tuple[str, ...] = ("attn", "mlp")
"""Block kinds in the order they run inside one layer."""

COST_MODEL_VERSION = 10
"""Bumped when the meaning of a table's numbers changes; part of :meth:`CostTable.key`
so a cached profile from an older model is re-profiled, never silently reused.
2: last sub-batch's collective moved from the node to the edge cost; boundary edges.
3: memory from :mod:`oases_ds.planner.memory` (autograd-saved tensors, logits,
working set, collectives in flight); ``fixed_bytes``; edges take the table's ``sub_batches``.
4: each collective's measured overhead beyond the link model (:attr:`BlockCost.overhead_ms`,
:attr:`CostTable.collective_overhead_ms`, on nodes and reshards).
5: tried and rejected (the cost-model study's history); skipped so its cached tables are never
read as another model's.
6: a profiled block's collectives priced at the link model's time, not the measured blocking
AllReduce's, whose fixed cost the collective overhead (v4) already holds.
7: a plan's step is priced by replaying its schedule over the profile's per-op times
(:mod:`oases_ds.planner.replay`); the node and edge costs stay the solvers' search objective.
8: the replay's per-op times scaled per block to the slowest rank's block time
(:func:`~oases_ds.planner.replay.block_scales`), as the block rows always were.
9: the replay spends each collective's overhead as host time on the compute lane where it is
issued, sized to reproduce the profiled step (:func:`~oases_ds.planner.replay.collective_issue_ms`),
instead of adding it after the simulation; the profiler is cost model 8's.
10: memory rows of the executor that releases each op's new outputs after the forward (a table's
``act_bytes`` and ``fixed_bytes`` are lower); under sequence parallelism the MLP is two operators, so a
profile's per-op times are indexed by another sequence (an older sequence-parallel profile would be
read at the wrong operators)."""

TABLE_FORMAT = 2
"""Layout of a table file: 2 has ``family``, the schedule as its settings and the typed ``op_profile``.
A file without ``table_format`` (cost models 3-9 wrote it so) is read by :func:`_upgraded`."""


STAGE_ROLE_NAMES: tuple[str, ...] = ("only", "first", "middle", "last")
"""Roles of a pipeline stage, by the ends of the model it holds (:attr:`CostTable.stage_fixed_bytes`)."""

SLICE_MS = 0.005
"""Cost of taking a local slice of a tensor: no communication, only a copy."""

STATE_BYTES_PER_PARAM = 16
"""Bytes a device holds per parameter it owns, what :attr:`BlockCost.state_bytes` counts:
mixed-precision Adam keeps an fp16 weight and gradient (2 + 2) and an fp32 master weight
and both moments (4 + 4 + 4).  fp32 Adam holds the same 16 (weight, gradient, two moments,
4 each).  One number for the analytic table and the profiler alike."""


PRECISIONS: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Training precision -> bytes of one weight (and of its gradient)."""


@dataclass(frozen=True)
class ModelStates:
    """How a rank holds its parameters' model states: precision, ZeRO stage, optimizer offload
    and the DP size ZeRO partitions over -- what ``bytes_per_param`` prices.

    Default: bf16, ZeRO 0, no offload, which is :data:`STATE_BYTES_PER_PARAM`, the number
    every stored table was priced with; :func:`~oases_ds.planner.memory.with_model_states`
    re-prices a table for another setting."""

    precision: str = "bf16"
    zero_stage: int = 0
    offload: bool = False
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={self.zero_stage!r}; oases trains with ZeRO 0, 1 or 2")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size!r}; give an integer >= 1")
        if self.offload and self.zero_stage == 0:
            raise ValueError("offload=true needs zero_stage 1 or 2 (DeepSpeed offloads the optimizer's partition)")

    def bytes_per_param(self) -> float:
        """Device bytes per parameter this rank holds, at the step's peak (Adam).

        The weight and its gradient are whole at every stage: the schedule computes each
        micro-batch's gradients whole, and under ZeRO-2 DeepSpeed reduce-scatters them only
        after the schedule (``OasesEngine._zero2_hooks_paused``), so ZeRO-2 lowers no peak
        here.  The optimizer's 12 bytes (fp32 master and two moments; fp32 at ZeRO 0 has no
        separate master: 8) are split over DP from ZeRO-1 on and leave the device with offload."""
        weight = PRECISIONS[self.precision]
        if self.offload:
            return float(2 * weight)
        optimizer = 8 if (self.precision == "fp32" and self.zero_stage == 0) else 12
        return 2 * weight + optimizer / (self.data_parallel_size if self.zero_stage else 1)

    def overlapped_dp_reduction(self) -> bool:
        """Whether the engine reduces gradients over DP overlapped with the schedule (its
        default where it reproduces DeepSpeed's reduction: DP > 1, ZeRO 0 or 1, no offload,
        not fp16; ``OasesEngine._overlapped_dp_reducer``), whose in-flight flat copies the
        memory model then charges (:func:`~oases_ds.planner.memory.dp_in_flight_bytes`)."""
        return (self.data_parallel_size > 1 and self.zero_stage <= 1 and not self.offload
                and self.precision != "fp16")

    def label(self) -> str:
        where = ", optimizer in host memory" if self.offload else ""
        return (f"{self.precision}, ZeRO {self.zero_stage} over DP {self.data_parallel_size}{where}: "
                f"{self.bytes_per_param():g} B of model states per parameter")


def check_degree(field: str, degree: object, devices: int) -> None:
    """Raise unless ``degree`` is a power of two dividing ``devices``.

    Power-of-two degrees are the only ones profiled (paper, Section V-C) and the
    only ones whose sub-groups nest inside each other (``Topology.sub_tp_group_ranks``).
    """
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"{field}: degree must be a positive int, got {degree!r}")
    if degree & (degree - 1) or devices % degree:
        raise ValueError(f"{field}: degree {degree} must be a power of two dividing devices={devices}")


@dataclass(frozen=True)
class BlockCost:
    """Cost of one attention or MLP block at one TMP degree, per device and step."""

    fwd_ms: float
    """Forward compute."""
    bwd_ms: float
    """Backward compute including the recompute pass (full recomputation), under
    the overlapped schedule being planned for."""
    comm_fwd_ms: float
    """TMP communication left exposed in forward after overlap with the other sub-batch."""
    comm_bwd_ms: float
    """TMP communication left exposed in backward after overlap."""
    state_bytes: float
    """Parameters + gradients + optimizer state held by one device (shrinks with t)."""
    act_bytes: float
    """Activations the block holds across the step, every sub-batch: its checkpoints
    and the outputs and autograd-saved tensors of the ops it keeps
    (:func:`~oases_ds.planner.memory.memory_rows`)."""
    grad_sync_ms: float
    """All-reduce of this block's gradients across its ``T/t`` replicas; a lower
    degree means more replicas of larger shards, which is the price of less TMP traffic."""
    comm_fwd_last_ms: float = 0.0
    """Forward collective of the *last* sub-batch, not in the node cost: in a
    pipelined schedule it hides behind the first sub-batch's compute of the next
    block, so what shows depends on that block -- :func:`edge_ms` charges it."""
    comm_bwd_last_ms: float = 0.0
    """Backward collective of the last sub-batch, hidden behind the previous block's
    backward (recompute + backward) of the first sub-batch; :func:`edge_ms` charges it."""
    overhead_ms: float = 0.0
    """What the block's TMP collectives cost the step beyond their link time, hidden or not:
    each is a barrier between the block's ranks and is issued and completed by the host.
    Its collectives per step times :attr:`CostTable.collective_overhead_ms` at the block's
    degree (:func:`~oases_ds.planner.costmodel.collective_overhead_ms`); 0 where not measured
    (analytic tables)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"BlockCost.{f.name} must be a finite number >= 0, got {value!r}")

    @property
    def step_ms(self) -> float:
        """Node cost in the ILP objective: everything this block adds to a step."""
        return self.fwd_ms + self.bwd_ms + self.comm_fwd_ms + self.comm_bwd_ms + self.grad_sync_ms + self.overhead_ms

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.act_bytes


PASS_LETTERS: tuple[str, ...] = ("F", "R", "B")
"""Forward, Recompute, Backward: the passes a compute op runs, as the executor's timeline names them."""


def _finite_ms(where: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class OpTimes:
    """Per-op compute of the profiled one-layer sequence, in ms per sub-batch, by the op's index in
    :func:`~oases_ds.models.operator_model.one_layer_ops`.  An op missing from a pass does not run
    it (a collective) or was not timed; ``recompute_ms`` holds only the ops the schedule recomputes."""

    forward_ms: dict[int, float] = field(default_factory=dict)
    recompute_ms: dict[int, float] = field(default_factory=dict)
    backward_ms: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("forward_ms", "recompute_ms", "backward_ms"):
            for op, ms in getattr(self, name).items():
                if not isinstance(op, int) or op < 0:
                    raise ValueError(f"OpTimes.{name}: op index {op!r} must be an int >= 0")
                _finite_ms(f"OpTimes.{name}[{op}]", ms)

    @classmethod
    def from_keys(cls, op_ms: dict[str, float]) -> OpTimes:
        """From ``{"<op>:F|R|B": ms}``, the keys the profiler builds from the executor's timeline."""
        passes: dict[str, dict[int, float]] = {letter: {} for letter in PASS_LETTERS}
        for key, ms in op_ms.items():
            op, _, letter = key.partition(":")
            if not op.isdigit() or letter not in passes:
                raise ValueError(f"per-op time {key!r} is not '<op index>:F|R|B'")
            passes[letter][int(op)] = float(ms)
        return cls(passes["F"], passes["R"], passes["B"])

    def of_pass(self, letter: str) -> dict[int, float]:
        """The times of pass ``letter`` (one of :data:`PASS_LETTERS`)."""
        return {"F": self.forward_ms, "R": self.recompute_ms, "B": self.backward_ms}[letter]

    def scaled(self, factor: float) -> OpTimes:
        """Every time multiplied by ``factor`` (a faster or slower machine, same ops)."""
        return OpTimes(*({op: ms * factor for op, ms in self.of_pass(letter).items()} for letter in PASS_LETTERS))


@dataclass(frozen=True)
class PassTimes:
    """One block's compute in each pass, summed over its ops and the schedule's sub-batches, in ms."""

    forward_ms: float
    recompute_ms: float
    backward_ms: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _finite_ms(f"PassTimes.{f.name}", getattr(self, f.name))

    def of_pass(self, letter: str) -> float:
        return {"F": self.forward_ms, "R": self.recompute_ms, "B": self.backward_ms}[letter]


@dataclass(frozen=True)
class DegreeProfile:
    """What the profiler measured of the one-layer model at one TMP degree that a plan's step is
    replayed from (:func:`~oases_ds.planner.replay.replay_plan`): why typed and on the table, and not
    in :attr:`CostTable.measurements`, is that the planner's choice between plans depends on it."""

    op_ms: OpTimes
    """Rank 0's per-op compute (median over the timed steps)."""
    payload_bytes: int
    """Bytes of one block collective: a sub-batch's ``[b/s, seq, hidden]`` activation share."""
    block_ms: dict[str, PassTimes] = field(default_factory=dict)
    """Per block kind, the slowest rank's compute of the block (the table's block rows hold the same
    time): the replay scales rank 0's per-op times to it, as the slowest rank sets a TMP step.  A kind
    missing here is not scaled."""

    def __post_init__(self) -> None:
        if not isinstance(self.payload_bytes, int) or isinstance(self.payload_bytes, bool) or self.payload_bytes < 0:
            raise ValueError(f"DegreeProfile.payload_bytes must be a whole number >= 0, got {self.payload_bytes!r}")
        for kind in self.block_ms:
            if kind not in BLOCK_KINDS:
                raise ValueError(f"DegreeProfile.block_ms has kind {kind!r}; kinds are {', '.join(BLOCK_KINDS)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (string keys)."""
        return {"op_ms": {name: {str(op): ms for op, ms in getattr(self.op_ms, name).items()}
                          for name in ("forward_ms", "recompute_ms", "backward_ms")},
                "payload_bytes": self.payload_bytes,
                "block_ms": {kind: dataclasses.asdict(times) for kind, times in self.block_ms.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> DegreeProfile:
        check_fields(data, cls, where)
        op_ms = data["op_ms"]
        check_fields(op_ms, OpTimes, f"{where}.op_ms")
        for name, times in op_ms.items():
            if not isinstance(times, dict) or not all(str(op).isdigit() for op in times):
                raise ValueError(f"{where}.op_ms.{name} must map op indices (whole numbers) to ms, got {times!r}")
        blocks = {}
        for kind, times in data.get("block_ms", {}).items():
            check_fields(times, PassTimes, f"{where}.block_ms.{kind}")
            blocks[kind] = PassTimes(**times)
        return cls(OpTimes(**{name: {int(op): float(ms) for op, ms in times.items()} for name, times in op_ms.items()}),
                   data["payload_bytes"], blocks)


@dataclass(frozen=True)
class CostTable:
    """Profile of one layer under each TMP degree, plus what the edge model needs."""

    model: str
    """Model label: the family, sizes and micro-batch the table was made for (:meth:`ProfileSpec.model_label
    <oases_ds.planner.profile.ProfileSpec.model_label>`)."""
    cluster: str
    """Cluster / link label, e.g. ``"3090-pcie"``."""
    schedule: ScheduleSpec
    """Schedule the times were measured under; a plan's step is replayed under it."""
    devices: int
    """T: size of the TMP group the planner divides among blocks."""
    degrees: tuple[int, ...]
    """Profiled TMP degrees, increasing powers of two dividing ``devices``."""
    blocks: dict[str, dict[int, BlockCost]]
    """Block kind -> degree -> cost; every kind in :data:`BLOCK_KINDS` at every degree."""
    layers: int
    """Transformer layers; each is an attn block followed by an mlp block."""
    reshard_bytes: float
    """Bytes of one block-boundary activation for a whole sub-batch (all replicas together)."""
    bandwidth_gbps: float
    """Link bandwidth for resharding collectives, in gigabits per second."""
    latency_us: float
    """Per-collective link latency, in microseconds."""
    fixed_bytes: float = 0.0
    """Per-device bytes no block's degree adds to linearly: embedding and head states,
    and at the peak the embedding's and head's activations, the logits, the working
    set of the block in recompute + backward and the collectives in flight
    (:func:`~oases_ds.planner.memory.memory_rows`).  A plan's memory is this plus
    its blocks' :attr:`BlockCost.memory_bytes`."""
    measurements: dict[str, Any] = field(default_factory=dict)
    """Free-form evidence behind the numbers (raw comm, measured exposed comm, every timed step,
    how grad sync was obtained), written by the profiler; nothing prices a plan from it.
    JSON-ready: string keys only."""
    sub_batches: int = 2
    """Sub-batches the schedule really runs per micro-batch (``ScheduleSpec.effective_sub_batches``:
    1 for a blocking schedule).  Each sub-batch is resharded separately and the last one's
    collective overlaps ``1/sub_batches`` of the neighbouring block, so the edge costs depend on
    it.  2, the paper's split, when a table written before this field is loaded."""
    stage_fixed_bytes: dict[str, float] = field(default_factory=dict)
    """:attr:`fixed_bytes` of a pipeline stage by its role (``"first"``: embedding only,
    ``"middle"``: neither end, ``"last"``: head, loss and logits only; ``"only"``: the whole
    model), from :func:`~oases_ds.planner.memory.memory_rows`.  Empty in a table written
    before pipeline stages: :mod:`oases_ds.planner.stages` then charges every stage the
    whole :attr:`fixed_bytes`, an over-count, never an under-count."""
    collective_overhead_ms: dict[int, float] = field(default_factory=dict)
    """Group size -> measured step time one collective among that many ranks costs beyond its
    link time (:func:`~oases_ds.planner.costmodel.collective_overhead_ms`; the profiler measures it
    at each degree, on the degree's own group).  The block rows already hold their own
    collectives' share (:attr:`BlockCost.overhead_ms`); :func:`reshard_ms` charges it per
    AllGather.  Missing sizes cost 0."""
    family: str | None = None
    """Model family of the profiled layer (``gpt``, ``bert``, ``llama``): whose operator sequence a plan
    is replayed over.  ``None`` for a hand-made table, which is priced additively."""
    op_profile: dict[int, DegreeProfile] = field(default_factory=dict)
    """Degree -> the one-layer profile a plan's step is replayed from; empty for a hand-made table
    (:func:`~oases_ds.planner.replay.can_replay`)."""
    store_blocks: dict[str, dict[int, BlockCost]] = field(default_factory=dict)
    """Block kind -> degree -> cost under policy ``store`` (activations kept, no recompute;
    :func:`~oases_ds.planner.costmodel.stored_block_cost`), beside :attr:`blocks`, which are the
    schedule's own policy ``oases``.  Empty: the table prices ``oases`` only (a table written
    before policies, or a schedule that cannot store blocks), and every plan recomputes."""
    gathered_blocks: dict[str, dict[int, BlockCost]] = field(default_factory=dict)
    """Likewise under policy ``oases_gathered`` (a sequence-parallel table only: the recomputed block
    keeps its gathered input instead of re-gathering it).  Empty: not priced."""
    sequence_parallel: bool = False
    """The costs are those of sequence parallelism (every block at :attr:`devices`; ``blocks`` is
    policy ``oases``, which re-gathers each block's input in its recomputation)."""

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleSpec):
            raise TypeError(f"CostTable.schedule must be a ScheduleSpec, e.g. ScheduleSpec({self.schedule!r}); "
                            f"got {self.schedule!r}")
        if self.family is not None and self.family not in FAMILIES:
            raise ValueError(f"CostTable.family={self.family!r} unknown; choose one of {', '.join(FAMILIES)} or None")
        for degree in self.op_profile:
            if degree not in self.degrees:
                raise ValueError(f"CostTable.op_profile has degree {degree}, not one of the table's {list(self.degrees)}")
        if not isinstance(self.sub_batches, int) or isinstance(self.sub_batches, bool) or self.sub_batches < 1:
            raise ValueError(f"CostTable.sub_batches must be an int >= 1 (the schedule's effective sub-batches), "
                             f"got {self.sub_batches!r}")
        if self.devices < 1:
            raise ValueError(f"CostTable.devices must be >= 1, got {self.devices}")
        if self.layers < 1:
            raise ValueError(f"CostTable.layers must be >= 1, got {self.layers}")
        object.__setattr__(self, "degrees", tuple(self.degrees))
        if not self.degrees or list(self.degrees) != sorted(set(self.degrees)):
            raise ValueError(f"CostTable.degrees must be non-empty, increasing and unique, got {self.degrees}")
        for degree in self.degrees:
            check_degree("CostTable.degrees", degree, self.devices)
        if sorted(self.blocks) != sorted(BLOCK_KINDS):
            raise ValueError(f"CostTable.blocks must have kinds {list(BLOCK_KINDS)}, got {sorted(self.blocks)}")
        for kind, by_degree in self.blocks.items():
            if sorted(by_degree) != list(self.degrees):
                raise ValueError(
                    f"CostTable.blocks[{kind!r}] has degrees {sorted(by_degree)}, expected {list(self.degrees)}"
                )
        for name in ("store_blocks", "gathered_blocks"):
            rows = getattr(self, name)
            if not rows:
                continue
            if not (self.schedule.name == "oases" and self.schedule.fine_grained_recompute):
                raise ValueError(f"CostTable.{name}: schedule {self.schedule.label} cannot run per-block policies "
                                 f"(they need oases with fine_grained_recompute); leave {name} empty")
            if sorted(rows) != sorted(BLOCK_KINDS) or any(sorted(by_degree) != list(self.degrees)
                                                          for by_degree in rows.values()):
                raise ValueError(f"CostTable.{name} must have kinds {list(BLOCK_KINDS)} at degrees "
                                 f"{list(self.degrees)}, like CostTable.blocks")
        if self.gathered_blocks and not self.sequence_parallel:
            raise ValueError("CostTable.gathered_blocks prices policy oases_gathered, which only sequence parallelism "
                             "has; leave it empty or set sequence_parallel")
        if self.sequence_parallel and self.model.endswith("-sp"):
            raise ValueError(f"CostTable.model {self.model!r}: a sequence-parallel table from before cost model 10, "
                             f"whose per-op times follow the older operator sequence (one MLP op); profile it again")
        if self.sequence_parallel and self.degrees != (self.devices,):
            raise ValueError(f"CostTable.sequence_parallel: every block runs at the full degree {self.devices}, "
                             f"but the table has degrees {list(self.degrees)}")
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"CostTable.bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if not 0 <= self.fixed_bytes < math.inf:
            raise ValueError(f"CostTable.fixed_bytes must be a finite number >= 0, got {self.fixed_bytes!r}")
        for role, value in self.stage_fixed_bytes.items():
            if role not in STAGE_ROLE_NAMES:
                raise ValueError(f"CostTable.stage_fixed_bytes has role {role!r}; roles are {', '.join(STAGE_ROLE_NAMES)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"CostTable.stage_fixed_bytes[{role!r}] must be a finite number >= 0, got {value!r}")
        for ranks, ms in self.collective_overhead_ms.items():
            if not isinstance(ranks, int) or ranks < 1 or not 0 <= ms < math.inf:
                raise ValueError(f"CostTable.collective_overhead_ms must map group sizes >= 1 to finite ms >= 0, "
                                 f"got {ranks!r}: {ms!r}")
        if self.reshard_bytes < 0 or self.latency_us < 0:
            raise ValueError(
                f"CostTable.reshard_bytes and latency_us must be >= 0, got {self.reshard_bytes}, {self.latency_us}"
            )

    def key(self) -> str:
        """Identity of the profile: a table is reusable for any run sharing this key."""
        return table_key(self.model, self.cluster, self.schedule, self.devices)

    def block_kinds(self) -> list[str]:
        """Kind of each block in execution order: attn0, mlp0, attn1, mlp1, ..."""
        return list(BLOCK_KINDS) * self.layers

    def choices(self) -> list[tuple[int, str]]:
        """Every (degree, policy) a block may take under this table: the solvers' states."""
        return [(degree, policy) for policy in self.policies for degree in self.degrees]

    @property
    def policies(self) -> tuple[str, ...]:
        """The recomputation policies this table prices: ``oases`` and, with :attr:`store_blocks`, ``store``;
        with :attr:`gathered_blocks` (sequence parallelism), ``oases_gathered``."""
        return ("oases",) + (("store",) if self.store_blocks else ()) + (("oases_gathered",) if self.gathered_blocks else ())

    def block_cost(self, kind: str, degree: int, policy: str = "oases") -> BlockCost:
        """The cost of a ``kind`` block at ``degree`` under ``policy``; a policy the table does not
        price is one line saying how to get it."""
        if policy == "oases":
            return self.blocks[kind][degree]
        if policy == "store" and self.store_blocks:
            return self.store_blocks[kind][degree]
        if policy == "oases_gathered" and self.gathered_blocks:
            return self.gathered_blocks[kind][degree]
        raise ValueError(f"table {self.key()} prices no policy {policy!r} (it prices {', '.join(self.policies)}); "
                         f"profile again with planner.recompute=auto under schedule oases")

    def to_json(self, path: str | os.PathLike[str]) -> None:
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        payload["table_format"] = TABLE_FORMAT
        payload["degrees"] = list(self.degrees)
        payload["schedule"] = {key: value for key, value in self.schedule.to_mapping().items()
                               if key not in ("stored_blocks", "gathered_blocks") or value}  # none in a profile: the old layout
        for name in ("blocks", "store_blocks", "gathered_blocks"):
            payload[name] = {
                kind: {str(degree): dataclasses.asdict(cost) for degree, cost in by_degree.items()}
                for kind, by_degree in getattr(self, name).items()
            }
        payload["op_profile"] = {str(degree): profile.to_dict() for degree, profile in self.op_profile.items()}
        write_json_atomic(path, payload, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> CostTable:
        """Load a table; any defect is one ``ValueError`` line naming the file and the field."""
        return load_dataclass(path, cls, _table_from_dict)

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> CostTable:
        """A table from a file's bytes read elsewhere than the file system (``where`` names it in errors)."""
        return parse_dataclass(raw, where, cls, _table_from_dict)


def table_key(model: str, cluster: str, schedule: ScheduleSpec, devices: int) -> str:
    """The one format of a table's identity (:meth:`CostTable.key`), which a profile spec names
    before it is measured (:meth:`~oases_ds.planner.profile.ProfileSpec.key`)."""
    return f"{model}|{cluster}|{schedule.label}|{devices}|cm{COST_MODEL_VERSION}"


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A table file written before :data:`TABLE_FORMAT` 2, in that layout: the schedule from its label,
    the family from the model label's prefix (the profiler and the analytic table start it so; else
    ``None``), and each degree's ``op_ms_rank0`` / ``allreduce_bytes`` / block times moved out of
    ``measurements.degrees`` into ``op_profile`` (the rest stays there as evidence)."""
    data = dict(data)
    label = data.get("schedule")
    if isinstance(label, str):
        data["schedule"] = _schedule_of_label(label).to_mapping()
    prefix = str(data.get("model", "")).split("-", 1)[0]
    data.setdefault("family", prefix if prefix in FAMILIES else None)
    measurements = dict(data.get("measurements", {}))
    evidence = measurements.get("degrees")
    if isinstance(evidence, dict) and "op_profile" not in data:
        profiles, kept = {}, {}
        for degree, measured in evidence.items():
            measured = dict(measured) if isinstance(measured, dict) else measured
            if isinstance(measured, dict) and "op_ms_rank0" in measured and "allreduce_bytes" in measured:
                blocks = {kind: {"forward_ms": timing["fwd_ms"], "recompute_ms": timing["recompute_ms"],
                                 "backward_ms": timing["bwd_ms"]}
                          for kind, timing in measured.get("blocks", {}).items()
                          if all(part in timing for part in ("fwd_ms", "recompute_ms", "bwd_ms"))}
                times = OpTimes.from_keys(measured.pop("op_ms_rank0"))
                profiles[degree] = {"op_ms": {"forward_ms": times.forward_ms, "recompute_ms": times.recompute_ms,
                                              "backward_ms": times.backward_ms},
                                    "payload_bytes": int(measured.pop("allreduce_bytes")), "block_ms": blocks}
            kept[degree] = measured
        measurements["degrees"] = kept
        data["measurements"] = measurements
        data["op_profile"] = profiles
    return data


def _schedule_of_label(label: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` whose :attr:`~ScheduleSpec.label` is ``label`` (``oases``,
    ``oases[sb=4,cross=0,fine=1]``)."""
    name, _, options = label.partition("[")
    if not options:
        return ScheduleSpec(name)
    values = dict(part.split("=", 1) for part in options.rstrip("]").split(","))
    stored, gathered = (tuple(int(b) for b in values[key].split(".")) if values.get(key) else ()
                        for key in ("store", "gathered"))
    return ScheduleSpec(name, sub_batches=int(values["sb"]), cross_pass=values["cross"] == "1",
                        fine_grained_recompute=values["fine"] == "1", stored_blocks=stored, gathered_blocks=gathered)


def _table_from_dict(data: dict[str, Any]) -> CostTable:
    # unknown fields first: another kind of file (a plan given as table=) is named as such, not as an old table
    if isinstance(data, dict) and (unknown := sorted(set(data) - {f.name for f in dataclasses.fields(CostTable)}
                                                     - {"table_format"})):
        raise ValueError(f"unknown CostTable field(s) {unknown}")
    if "fixed_bytes" not in data:
        raise ValueError(f"a cost table of an older cost model (no fixed_bytes); profile again (version {COST_MODEL_VERSION})")
    version = data.pop("table_format", None)
    if version is None:
        data = _upgraded(data)
    elif version != TABLE_FORMAT:
        raise ValueError(f"table_format {version!r} is not one this code reads ({TABLE_FORMAT}); profile again")
    check_fields(data, CostTable)
    if not isinstance(data["schedule"], dict):
        raise ValueError(f"schedule must be an object of schedule settings, got {data['schedule']!r}")
    schedule = ScheduleSpec.from_mapping(data["schedule"])
    profiles = data.get("op_profile", {})
    if not isinstance(profiles, dict) or not all(str(k).isdigit() for k in profiles):
        raise ValueError(f"op_profile must map degrees (whole numbers) to profiles, got {profiles!r}")
    op_profile = {int(degree): DegreeProfile.from_dict(profile, f"op_profile.{degree}")
                  for degree, profile in profiles.items()}
    rows: dict[str, dict[str, dict[int, BlockCost]]] = {"blocks": {}, "store_blocks": {}, "gathered_blocks": {}}
    for name, into in rows.items():
        for kind, by_degree in data.get(name, {}).items():
            if not isinstance(by_degree, dict):
                raise ValueError(f"{name}.{kind} must map degrees to BlockCost objects, got {by_degree!r}")
            into[kind] = {}
            for degree, cost in by_degree.items():
                if not str(degree).isdigit():
                    raise ValueError(f"{name}.{kind}: degree {degree!r} is not a whole number")
                if isinstance(cost, dict) and "comm_fwd_last_ms" not in cost:
                    raise ValueError(f"a cost table of an older cost model (no comm_fwd_last_ms); "
                                     f"profile again (version {COST_MODEL_VERSION})")
                check_fields(cost, BlockCost, f"{name}.{kind}.{degree}")
                into[kind][int(degree)] = BlockCost(**cost)
    overhead = data.get("collective_overhead_ms", {})
    if not isinstance(overhead, dict) or not all(str(k).isdigit() for k in overhead):
        raise ValueError(f"collective_overhead_ms must map group sizes (whole numbers) to ms, got {overhead!r}")
    return CostTable(**{**data, "schedule": schedule, **rows, "op_profile": op_profile,
                        "collective_overhead_ms": {int(k): float(v) for k, v in overhead.items()}})


def allgather_ms(table: CostTable, ranks: int, gathered_bytes: float) -> float:
    """Ring AllGather among ``ranks`` producing ``gathered_bytes`` on each: every rank
    receives the ``(ranks-1)/ranks`` it lacks, after one link latency -- the same link
    model the runtime's emulator uses."""
    return LinkModel(table.bandwidth_gbps, table.latency_us).seconds("all_gather", gathered_bytes, ranks) * 1e3


def reshard_collective(table: CostTable, t_from: int, t_to: int) -> tuple[float, int]:
    """(gathered bytes, ranks) of the AllGather of one sub-batch's reshard between two different
    degrees: the big group's share ``reshard_bytes * big / T`` among ``big // small`` ranks
    (:func:`reshard_ms` says why)."""
    small, big = sorted((t_from, t_to))
    return table.reshard_bytes * big / table.devices, big // small


def reshard_ms(table: CostTable, t_from: int, t_to: int) -> float:
    """Edge cost (forward + backward) between a block at degree ``t_from`` and the next at ``t_to``.

    At degree t the T devices form T/t replicas; each replica works on t/T of the
    sub-batch and holds that share of the boundary activation replicated on its
    t ranks (Megatron blocks end in an AllReduce).  Sub-groups nest, so with
    ``small = min(t_from, t_to)``, ``big = max(...)`` and ``k = big // small``:

    * big -> small: each device already holds a superset of the rows it needs,
      forward is a local slice.  Its backward must hand every rank of the big
      group the full gradient, an AllGather among k ranks.
    * small -> big: forward gathers the k smaller shares, an AllGather among k
      ranks; backward keeps the local rows of the replicated gradient, a slice.

    So either direction costs one slice and one AllGather of the big group's
    share ``reshard_bytes * big / T``, once per sub-batch (``table.sub_batches``).  The gathered block
    input is what the next block checkpoints, so recompute does not repeat the
    gather.  The time is charged as fully exposed: the schedule has no compute
    of the same sub-batch to hide it behind, and each AllGather pays the measured
    overhead of one collective among its ``k`` ranks (:attr:`CostTable.collective_overhead_ms`).
    """
    if t_from == t_to:
        return 0.0
    gathered_bytes, ranks = reshard_collective(table, t_from, t_to)
    overhead = table.collective_overhead_ms.get(ranks, 0.0)
    return table.sub_batches * (SLICE_MS + allgather_ms(table, ranks, gathered_bytes) + overhead)


def edge_ms(table: CostTable, block: int, t_from: int, t_to: int, p_from: str = "oases", p_to: str = "oases") -> float:
    """Edge cost between block ``block`` at ``t_from`` and block ``block + 1`` at ``t_to``.

    Besides the reshard, it carries the collectives the node costs leave out
    (:attr:`BlockCost.comm_fwd_last_ms`): with ``s`` sub-batches (``table.sub_batches``), block i's forward
    collective of the last sub-batch overlaps sub-batch 0's compute of block i+1
    (``fwd_ms / s``), and block i+1's backward collective of the last sub-batch
    overlaps sub-batch 0's backward of block i (``bwd_ms / s``)::

        compute  ..i(s0) i(s1) | i+1(s0) i+1(s1) ..
        link          [C_i(s0)][C_i(s1)]

    Only when both blocks run at the same degree: a reshard between them is a
    segment boundary of its own, so the collective is waited for in full, after
    which the reshard's AllGather is charged as :func:`reshard_ms` says.  ``p_from`` /
    ``p_to``: the blocks' recomputation policies (a stored block has no recompute to hide behind).
    """
    kinds = table.block_kinds()
    here, there = table.block_cost(kinds[block], t_from, p_from), table.block_cost(kinds[block + 1], t_to, p_to)
    if t_from == t_to:
        sub_batches = table.sub_batches
        return (max(0.0, here.comm_fwd_last_ms - there.fwd_ms / sub_batches)
                + max(0.0, there.comm_bwd_last_ms - here.bwd_ms / sub_batches))
    return reshard_ms(table, t_from, t_to) + here.comm_fwd_last_ms + there.comm_bwd_last_ms


def first_block_ms(table: CostTable, degree: int, policy: str = "oases") -> float:
    """Edge from the embedding (always at the full degree T) into the first block.

    The embedding's compute is not in the table, so the first block's last backward
    collective is charged in full, as at a reshard."""
    first = table.block_cost(table.block_kinds()[0], degree, policy)
    return reshard_ms(table, table.devices, degree) + first.comm_bwd_last_ms


def last_block_ms(table: CostTable, degree: int, policy: str = "oases") -> float:
    """Edge from the last block into the head (always at the full degree T); see :func:`first_block_ms`."""
    last = table.block_cost(table.block_kinds()[-1], degree, policy)
    return reshard_ms(table, degree, table.devices) + last.comm_fwd_last_ms
