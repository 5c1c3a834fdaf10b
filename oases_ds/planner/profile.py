"""Profiler: one transformer layer under every TMP degree, through the real executor.

Why one layer: GPT, BERT and LLaMA repeat one layer, so its cost at each degree
is the whole profile (paper, Section V-C); the cost table is reused for any
depth (:func:`profile` only re-labels ``layers``).  Why the real executor and
not a micro-benchmark: the planner's node cost is the block's time *under the
schedule*, and only the executor's timeline shows what the schedule hid.

How a degree-t layer is measured on T devices: T rank processes; each builds a
one-layer :class:`~oases_ds.models.operator_model.OperatorModel` on its sub-group
of ``t`` adjacent ranks (``ParallelContext.sub_group``) and runs the batch share
``micro_batch * t / T`` -- so the T/t replicas run side by side, as they would
in a heterogeneous plan.  From the timeline, each instruction is attributed to
its operator's block (``op.block``); embedding and head ops are left out.

What is measured and what is derived, per block and degree:

* forward, recompute and backward compute: timeline, median over repeats,
  the slowest rank (it sets the step);
* raw TMP communication: the block's collective payload priced by the table's link
  model (:func:`_table_link`), times the collectives per block and sub-batch.  A
  blocking AllReduce of it on the degree-t group (through the
  :class:`~oases_ds.parallel.comm.Communicator`, so link emulation applies) is measured
  too and kept as evidence, not priced: what it takes beyond the link time is the
  collective's fixed cost, which the collective overhead below already carries
  (cost model 6; before, both carried it);
* exposed communication: ``exposed="model"`` (default) puts raw comm and compute
  through :func:`~oases_ds.planner.costmodel.exposed_comm_ms`; ``"measured"``
  takes the Sync waits from the timeline.  Both are kept in ``measurements``;
* gradient sync: an AllReduce of the block's gradient bytes on the *replica
  group* (same index in each of the T/t replicas), measured, not modelled;
* collective overhead: the whole one-layer step is timed too; at each degree the
  measured step less the step :func:`~oases_ds.planner.costmodel.simulate_step`
  replays from the measured per-op compute and the link model, net of the
  degree-1 residual and divided by the collectives the step issued, is what one
  collective costs beyond its link time
  (:func:`~oases_ds.planner.costmodel.collective_overhead_ms`);
* the degrees are profiled interleaved, one step of each per round, so a burst of
  load on the machine does not fall on one degree only;
* memory, from shapes, not measured: parameters + gradients + Adam moments (16
  bytes per fp32 parameter) of the block's shards, and the fp32 activations of
  :func:`~oases_ds.planner.memory.memory_rows` (checkpoints and autograd-saved
  tensors per block; embedding, head, logits, working set and collectives in
  flight in the table's constant) -- the model the tests hold to the executor's
  measured peak.
"""
from __future__ import annotations

import dataclasses
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from oases_ds.data.batches import synthetic_batch
from oases_ds.launcher import launch
from oases_ds.models.blocks import layer_parameter_counts
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel, sequence_parallel_ops
from oases_ds.models.ops import CommOp
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.link import LinkModel, link_from_config
from oases_ds.parallel.random import RNGTracker
from oases_ds.planner.costmodel import (
    BlockTiming,
    OpCosts,
    collective_overhead_ms,
    exposed_comm_ms,
    pipelined_comm_ms,
    simulate_step,
)
from oases_ds.planner.costs import (
    BLOCK_KINDS,
    STATE_BYTES_PER_PARAM,
    BlockCost,
    CostTable,
    DegreeProfile,
    OpTimes,
    PassTimes,
    table_key,
)
from oases_ds.planner.memory import memory_rows
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.timeline import clock_for
from oases_ds.schedule.generators import ScheduleSpec, build_schedule
from oases_ds.schedule.instructions import StartAsync
from oases_ds.utils.rounds import rotated

PROFILE_DTYPE_BYTES = 4
"""The profiler runs fp32 (CPU); its memory rows count 4-byte activations."""

_COMPUTE_EVENT = re.compile(r"^([FfRB])(\d+)\.(\d+)$")
_WAIT_EVENT = re.compile(r"^W([rb]?)(\d+)\.(\d+)$")


@dataclass(frozen=True)
class ProfileSpec:
    """Everything a profile depends on; :meth:`key` names it in the cache.

    Attributes:
        model: the model family and sizes (``num_layers`` is ignored: one layer is run).
        devices: T, the TMP group the planner divides; one rank process each.
        micro_batch: samples per micro-batch of the whole TMP group; a degree-t
            replica runs ``micro_batch * t / T`` of them.
        schedule: the schedule the costs are measured under.
        link: emulated link (``None``: this machine as it is).
        cluster: label of the machine / link in the key.
        warmup / repeats: steps discarded, then steps whose median is kept.
        exposed: where the exposed-comm node cost comes from, see module doc.  With
            ``"measured"`` the Sync waits already hold the part of the collective overhead
            that is a late partner, so that part is counted twice (the default, ``"model"``,
            prices the link alone and leaves all of it to the overhead).
        seed: weights and data.
    """

    model: ModelConfig
    devices: int
    micro_batch: int
    schedule: ScheduleSpec = ScheduleSpec()
    link: LinkModel | None = None
    cluster: str = "local"
    warmup: int = 2
    repeats: int = 3
    exposed: Literal["model", "measured"] = "model"
    seed: int = 0
    min_degree: int = 1
    """Smallest TMP degree profiled (a power of two <= devices): a small micro-batch has no whole
    share for the many replicas of a low degree (pipeline stages want small micro-batches, 1F1B
    holding several in flight), so those degrees are left out of the table.  Named in the key."""
    sequence_parallel: bool = False
    """Plan for sequence parallelism: every block at the full degree ``devices`` (the only degree
    profiled), per-block policies ``oases`` (re-gather), ``oases_gathered`` and ``store``.  Named in the key."""

    def __post_init__(self) -> None:
        if self.devices < 1 or self.devices & (self.devices - 1):
            raise ValueError(f"planner.devices must be a power of two >= 1, got {self.devices}")
        if not isinstance(self.schedule, ScheduleSpec):
            raise TypeError(f"ProfileSpec.schedule must be a ScheduleSpec, e.g. ScheduleSpec({self.schedule!r}); got {self.schedule!r}")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"planner.warmup must be >= 0 and planner.repeats >= 1, got {self.warmup}, {self.repeats}")
        if self.exposed not in ("model", "measured"):
            raise ValueError(f"planner.exposed must be 'model' or 'measured', got {self.exposed!r}")
        if self.min_degree < 1 or self.min_degree & (self.min_degree - 1) or self.min_degree > self.devices:
            raise ValueError(f"planner.min_degree must be a power of two <= devices={self.devices}, got {self.min_degree}")
        if self.sequence_parallel and self.devices > 1 and self.model.seq_len % self.devices:
            raise ValueError(f"sequence_parallel splits the sequence over the {self.devices} TMP ranks but model.seq_len="
                             f"{self.model.seq_len} is not divisible by {self.devices}; use a multiple of {self.devices} "
                             f"or sequence_parallel=false")
        sub = self.sub_batches
        for degree in self.degrees():
            self.model.check_tp(degree)
            share = self.micro_batch * degree / self.devices
            if share != int(share) or int(share) % sub:
                raise ValueError(
                    f"micro_batch={self.micro_batch}: the degree-{degree} share micro_batch*{degree}/{self.devices} "
                    f"= {share:g} must be a whole multiple of the schedule's {sub} sub-batches; "
                    f"use a multiple of {self.devices * sub // degree}"
                    + (" or raise planner.min_degree" if degree < self.devices else "")
                )

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ProfileSpec:
        """The profile an ``oases-plan`` config describes (``model``, ``devices``, ``micro_batch``,
        ``schedule``, ``cluster``, ``planner``; a result file keeps it as ``config``): the planner and the
        diagnostics that re-step a stored result's profile build it alike."""
        planner, cluster = cfg["planner"], cfg["cluster"]
        return cls(model=ModelConfig(**cfg["model"]), devices=cfg["devices"], micro_batch=cfg["micro_batch"],
                   schedule=ScheduleSpec.from_mapping(cfg["schedule"]),
                   link=link_from_config(cluster.get("link")), cluster=cluster["name"],
                   warmup=planner["warmup"], repeats=planner["repeats"], exposed=planner["exposed"],
                   seed=planner["seed"], min_degree=planner["min_degree"],
                   sequence_parallel=bool(cfg.get("sequence_parallel", False)))

    @property
    def sub_batches(self) -> int:
        return self.schedule.effective_sub_batches

    def degrees(self) -> tuple[int, ...]:
        """Every power of two from ``min_degree`` up to T, increasing (only T with sequence parallelism)."""
        if self.sequence_parallel:
            return (self.devices,)
        out, degree = [], self.min_degree
        while degree <= self.devices:
            out.append(degree)
            degree *= 2
        return tuple(out)

    def model_label(self) -> str:
        m = self.model
        label = f"{m.family}-v{m.vocab_size}-h{m.hidden_size}-a{m.num_heads}-f{m.ffn}-s{m.seq_len}-mb{self.micro_batch}"
        label = label if self.min_degree == 1 else f"{label}-tmin{self.min_degree}"
        # "-sp2": the sequence-parallel operator sequence whose MLP is two ops (cost model 10); a table
        # labelled "-sp" indexes its per-op times by the older one (refused by CostTable)
        return f"{label}-sp2" if self.sequence_parallel else label

    def cluster_label(self) -> str:
        if self.link is None:
            return self.cluster
        # The sharing model changes every overlapped wait, so a table measured under
        # another one must not be reused.
        return f"{self.cluster}@{self.link.bandwidth_gbps:g}Gbps+{self.link.latency_us:g}us,{self.link.sharing}"

    def key(self) -> str:
        """Equal to :meth:`CostTable.key` of the table this spec produces."""
        return table_key(self.model_label(), self.cluster_label(), self.schedule, self.devices)


def cache_path(cache_dir: str | Path, key: str) -> Path:
    """File of a cached table: the key with path-hostile characters replaced."""
    return Path(cache_dir) / (re.sub(r"[^A-Za-z0-9._=+@,\[\]-]", "_", key) + ".json")


def profile(
    spec: ProfileSpec,
    layers: int,
    cache_dir: str | Path | None = None,
    timeout_s: float = 600.0,
) -> tuple[CostTable, bool]:
    """The cost table for ``spec`` labelled for ``layers`` layers, and whether it came from the cache.

    A cached table (same :meth:`ProfileSpec.key`) is reused without launching
    anything; otherwise T rank processes profile the layer and the table is
    written to the cache atomically.
    """
    path = cache_path(cache_dir, spec.key()) if cache_dir is not None else None
    if path is not None and path.exists():
        table = CostTable.from_json(path)
        if table.key() != spec.key():
            raise ValueError(f"{path}: holds a profile for {table.key()!r}, expected {spec.key()!r}")
        return dataclasses.replace(table, layers=layers), True
    started = time.perf_counter()
    per_rank = launch(_profile_rank, spec.devices, (spec,), timeout_s=timeout_s, threads_per_rank=1)
    table = table_from_measurements(spec, per_rank, layers, wall_s=time.perf_counter() - started)
    if path is not None:
        table.to_json(path)
    return table, False


# -- what each rank does -----------------------------------------------------------
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _timed_collective(comm: Any, tensor: torch.Tensor, group: Any, repeats: int, warmup: int) -> float:
    """Median ms of a blocking AllReduce of ``tensor`` on ``group`` (all its ranks call this).

    Timed by the clock of ``tensor``'s device: on CUDA, events around the issue and
    the wait, so the time is the collective's on the device, not its launch's."""
    clock = clock_for(tensor.device)
    marks = []
    for rep in range(warmup + repeats):
        dist.barrier(group=group)
        t0 = clock.mark()
        comm.all_reduce(tensor, group, "forward").wait()
        if rep >= warmup:
            marks += [t0, clock.mark()]
    seconds = clock.resolve(marks)
    return _median([(seconds[i + 1] - seconds[i]) * 1e3 for i in range(0, len(seconds), 2)])


class _LayerRun:
    """One degree's one-layer model, batch and executor on this rank, and what its timed steps saw.

    Why a class: the degrees' steps are interleaved (:func:`_profile_rank`), so each degree's
    state lives across the loop over steps."""

    def __init__(self, spec: ProfileSpec, ctx: ParallelContext, degree: int) -> None:
        cfg, device = spec.model, ctx.device
        self.degree, self.sub = degree, spec.sub_batches
        self.group = ctx.sub_group(degree)
        self.share = spec.micro_batch * degree // spec.devices
        self.batch = synthetic_batch(cfg.vocab_size, self.share, cfg.seq_len, spec.seed + ctx.rank // degree, device)
        self.model = OperatorModel(dataclasses.replace(cfg, num_layers=1), group=self.group, seed=spec.seed,
                                   sequence_parallel=spec.sequence_parallel).to(device)
        self.executor = Executor.for_schedule(self.model, spec.schedule, spec.link, RNGTracker(spec.seed))
        self.block_of = [op.block for op in self.model.ops]
        self.clock = clock_for(device)
        self.per_rep: dict[str, list[float]] = {}
        self.op_ms: dict[str, list[float]] = {}
        self.op_ms_reps: list[dict[str, float]] = []
        self.step_marks: list[Any] = []

    def step(self, timed: bool) -> None:
        """Run one step (all ranks together); keep its timeline when ``timed``."""
        dist.barrier()
        start = self.clock.mark()
        self.executor.run(self.batch)
        end = self.clock.mark()
        self.model.zero_grad(set_to_none=True)
        if not timed:
            return
        self.step_marks += [start, end]
        sums: dict[str, float] = {}
        ops_this_rep: dict[str, float] = {}
        for event in self.executor.timeline.events:
            ms = (event.end - event.start) * 1e3
            if event.lane == "compute" and (m := _COMPUTE_EVENT.match(event.name)):
                letter, op = m.group(1), int(m.group(2))
                phase = {"F": "fwd", "f": "fwd", "R": "recompute", "B": "bwd"}[letter]
                key = f"{op}:{'B' if phase == 'bwd' else 'F'}" if phase != "recompute" else f"{op}:R"
                ops_this_rep[key] = ops_this_rep.get(key, 0.0) + ms
                if self.block_of[op] in BLOCK_KINDS:
                    name = f"{self.block_of[op]}.{phase}"
                    sums[name] = sums.get(name, 0.0) + ms
            elif event.lane == "wait" and (m := _WAIT_EVENT.match(event.name)):
                op = int(m.group(2))
                if self.block_of[op] in BLOCK_KINDS:
                    name = f"{self.block_of[op]}.{'exposed_fwd' if m.group(1) == '' else 'exposed_bwd'}"
                    sums[name] = sums.get(name, 0.0) + ms
        for kind in BLOCK_KINDS:
            for part in ("fwd", "recompute", "bwd", "exposed_fwd", "exposed_bwd"):
                self.per_rep.setdefault(f"{kind}.{part}", []).append(sums.get(f"{kind}.{part}", 0.0))
        for key, ms in ops_this_rep.items():
            self.op_ms.setdefault(key, []).append(ms / self.sub)  # per sub-batch, as the simulator takes it
        self.op_ms_reps.append({key: ms / self.sub for key, ms in ops_this_rep.items()})

    def result(self) -> dict[str, Any]:
        """Medians of the timed steps, every step's wall and per-op times, and collective counts."""
        result: dict[str, Any] = {name: _median(values) for name, values in self.per_rep.items()}
        result["op_ms"] = {key: _median(values) for key, values in self.op_ms.items()}
        seconds = self.clock.resolve(self.step_marks)
        result["step_ms_reps"] = [(seconds[i + 1] - seconds[i]) * 1e3 for i in range(0, len(seconds), 2)]
        result["op_ms_reps"] = self.op_ms_reps  # per step: the simulator replays each against its own wall time
        # The collectives the simulator puts on the link: the schedule's StartAsyncs, among > 1 rank
        # only (at degree 1 each is an identity).  Those inside an op (the loss's) are in its compute.
        starts = [self.block_of[ins.op] for ins in self.executor.schedule.instructions if isinstance(ins, StartAsync)]
        result["collectives"] = len(starts) if self.degree > 1 else 0
        for kind in BLOCK_KINDS:
            result[f"{kind}.collectives_per_step"] = starts.count(kind) if self.degree > 1 else 0
            ops = [op for op in self.model.ops if isinstance(op, CommOp) and op.block == kind]
            result[f"{kind}.collectives_fwd"] = sum(op.forward is not None for op in ops)
            result[f"{kind}.collectives_bwd"] = sum(op.backward is not None for op in ops)
            # per sub-batch: under sequence parallelism each recomputed block re-gathers its input
            result[f"{kind}.regathers"] = sum(
                isinstance(ins, StartAsync) and ins.phase == "recompute" and self.block_of[ins.op] == kind
                for ins in self.executor.schedule.instructions) // self.sub
        return result


class ProfileSteps:
    """Every degree's one-layer run on this rank, stepped from outside, and the rank's measurements.

    The profiler steps them alone (:func:`_profile_rank`); the accuracy study can step them between
    its plans' steps (``accuracy.interleave_profile``), so that the profile sees the machine of the
    measurement: on a shared machine whose speed drifts over minutes, a profile of a few seconds can
    catch a moment the minutes-long measurement does not (the cost-model study found such profiles).
    Building it is collective (replica groups): every rank builds it at the same point."""

    def __init__(self, spec: ProfileSpec, ctx: ParallelContext) -> None:
        self.spec, self.ctx = spec, ctx
        # Replica groups: the rank at index p of every degree-t sub-group (new_group is collective).
        self.replica_group: dict[int, Any] = {}
        for degree in spec.degrees():
            subs = ctx.topology.sub_tp_group_ranks(degree)
            for p in range(degree):
                members = [g[p] for g in subs]
                group = dist.new_group(ranks=members) if len(members) > 1 else None
                if ctx.rank in members:
                    self.replica_group[degree] = group
        self.runs = [_LayerRun(spec, ctx, degree) for degree in spec.degrees()]

    def __len__(self) -> int:
        return len(self.runs)

    def step(self, index: int, timed: bool) -> None:
        """One step of the ``index``-th degree (increasing), all ranks together."""
        self.runs[index].step(timed)

    def result(self) -> dict[str, Any]:
        """This rank's measurements, as :func:`table_from_measurements` takes them per rank: the timed
        steps' medians per degree, then the blocking AllReduces and gradient syncs timed here."""
        spec, cfg, sub, device = self.spec, self.spec.model, self.spec.sub_batches, self.ctx.device
        out: dict[str, Any] = {"rank": self.ctx.rank, "degrees": {}}
        for degree, run in zip(spec.degrees(), self.runs):
            result = run.result()
            # Raw TMP collective: the block's activation (b/sub, s, H) on the degree-t group.
            comm = Communicator(spec.link)
            payload = torch.zeros(run.share // sub, cfg.seq_len, cfg.hidden_size, device=device)
            result["allreduce_bytes"] = payload.numel() * payload.element_size()
            result["allreduce_ms"] = _timed_collective(comm, payload, run.group, spec.repeats, spec.warmup) if degree > 1 else 0.0
            result["latency_ms"] = (
                _timed_collective(comm, torch.zeros(1, device=device), run.group, spec.repeats, spec.warmup)
                if degree > 1 else 0.0
            )
            # Memory and gradient sync from parameter shapes.
            numel = layer_parameter_counts(cfg, degree)
            for kind in BLOCK_KINDS:
                result[f"{kind}.params"] = numel[kind]
                result[f"{kind}.state_bytes"] = float(numel[kind] * STATE_BYTES_PER_PARAM)
                grads = torch.zeros(numel[kind], device=device)
                replicas = self.replica_group[degree]
                result[f"{kind}.grad_sync_ms"] = (
                    _timed_collective(Communicator(spec.link), grads, replicas, spec.repeats, spec.warmup)
                    if replicas is not None
                    else 0.0
                )
            out["degrees"][str(degree)] = result
        return out


def _profile_rank(spec: ProfileSpec) -> dict[str, Any]:
    """Profile every degree on this rank; returns per-degree measurements.

    The degrees' steps are interleaved, one step of each per round and each round starting
    one degree later (:func:`~oases_ds.utils.rounds.rotated`), as the accuracy check
    interleaves plans: profiled one degree after the other, a burst of load on the machine
    fell on one degree only and biased every plan's prediction that used it."""
    ctx = ParallelContext.build(tensor_parallel_size=spec.devices)  # layer, batch and payloads live where training would
    steps = ProfileSteps(spec, ctx)
    for rep in range(spec.warmup + spec.repeats):
        for i in rotated(range(len(steps)), rep):
            steps.step(i, timed=rep >= spec.warmup)
    return steps.result()


# -- measurements -> cost table ----------------------------------------------------
def _slowest(per_rank: list[dict[str, Any]], degree: int, name: str) -> float:
    return max(float(r["degrees"][str(degree)][name]) for r in per_rank)


def table_from_measurements(
    spec: ProfileSpec, per_rank: list[dict[str, Any]], layers: int, wall_s: float = 0.0
) -> CostTable:
    """Cost table from every rank's measurements; times are the slowest rank's."""
    sub = spec.sub_batches
    link = _table_link(spec, per_rank)
    overhead, overhead_evidence = _collective_overheads(spec, per_rank, link)
    sp = spec.sequence_parallel and spec.devices > 1
    memory = memory_rows(spec.model, spec.schedule, spec.devices, spec.micro_batch, spec.degrees(), PROFILE_DTYPE_BYTES, sp)
    blocks: dict[str, dict[int, BlockCost]] = {kind: {} for kind in BLOCK_KINDS}
    evidence: dict[str, Any] = {}
    op_profile: dict[int, DegreeProfile] = {}
    for degree in spec.degrees():
        rank0 = per_rank[0]["degrees"][str(degree)]
        # The link's time, as the simulator behind the collective overhead prices it: the measured
        # AllReduce's excess over it is in that overhead, and priced here too it counted twice.
        # under sequence parallelism each collective is a ReduceScatter or an AllGather: half the wire bytes
        ar_ms = link.seconds("all_gather" if sp else "all_reduce", rank0["allreduce_bytes"], degree) * 1e3 \
            if degree > 1 else 0.0
        evidence[str(degree)] = {"allreduce_ms": _slowest(per_rank, degree, "allreduce_ms"), "allreduce_link_ms": ar_ms,
                                 "blocks": {},
                                 # every rank's every timed step, kept: a profile taken while the machine ran
                                 # faster than it later does shows here, not in the medians alone
                                 "step_ms_per_rank": [r["degrees"][str(degree)]["step_ms_reps"] for r in per_rank]}
        for kind in BLOCK_KINDS:
            def get(part: str) -> float:
                return _slowest(per_rank, degree, f"{kind}.{part}")

            timing = BlockTiming(
                fwd_ms=get("fwd"),
                recompute_ms=get("recompute"),
                bwd_ms=get("bwd"),
                comm_fwd_ms=rank0[f"{kind}.collectives_fwd"] * sub * ar_ms,
                comm_bwd_ms=(rank0[f"{kind}.collectives_bwd"] + rank0.get(f"{kind}.regathers", 0)) * sub * ar_ms,
            )
            measured = (get("exposed_fwd"), get("exposed_bwd"), 0.0, 0.0)  # the timeline saw the whole layer
            modelled = pipelined_comm_ms(timing, spec.schedule)
            exposed = modelled if spec.exposed == "model" else measured
            blocks[kind][degree] = BlockCost(
                fwd_ms=timing.fwd_ms,
                bwd_ms=timing.recompute_ms + timing.bwd_ms,
                comm_fwd_ms=exposed[0],
                comm_bwd_ms=exposed[1],
                state_bytes=rank0[f"{kind}.state_bytes"],
                act_bytes=memory.act_bytes[kind][degree],
                grad_sync_ms=get("grad_sync_ms"),
                comm_fwd_last_ms=exposed[2],
                comm_bwd_last_ms=exposed[3],
                overhead_ms=rank0[f"{kind}.collectives_per_step"] * overhead[degree],
            )
            evidence[str(degree)]["blocks"][kind] = {
                **dataclasses.asdict(timing),
                "regather_ms": rank0.get(f"{kind}.regathers", 0) * sub * ar_ms,
                "exposed_measured_ms": list(measured[:2]),
                "exposed_modelled_ms": list(modelled),
                "exposed_whole_block_ms": list(exposed_comm_ms(timing, spec.schedule)),
                "params_per_device": rank0[f"{kind}.params"],
            }
        op_profile[degree] = DegreeProfile(
            OpTimes.from_keys(rank0["op_ms"]), int(rank0["allreduce_bytes"]),
            {kind: PassTimes(*(evidence[str(degree)]["blocks"][kind][part] for part in ("fwd_ms", "recompute_ms", "bwd_ms")))
             for kind in BLOCK_KINDS})
    m = spec.model
    return CostTable(
        model=spec.model_label(),
        cluster=spec.cluster_label(),
        schedule=spec.schedule,
        family=spec.model.family,
        op_profile=op_profile,
        devices=spec.devices,
        degrees=spec.degrees(),
        blocks=blocks,
        layers=layers,
        reshard_bytes=float(spec.micro_batch // sub * m.seq_len * m.hidden_size * PROFILE_DTYPE_BYTES),
        bandwidth_gbps=link.bandwidth_gbps,
        latency_us=link.latency_us,
        sub_batches=sub,
        fixed_bytes=memory.fixed_bytes,
        stage_fixed_bytes=memory.stage_fixed_bytes,
        sequence_parallel=sp,
        collective_overhead_ms={degree: overhead[degree] for degree in spec.degrees() if degree > 1},
        measurements={
            "memory": memory.evidence,
            "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "profile_wall_s": wall_s,
            "warmup": spec.warmup,
            "repeats": spec.repeats,
            "exposed_source": spec.exposed,
            "link_emulated": spec.link is not None,
            "bandwidth_source": "link model" if spec.link is not None else "measured AllReduce at degree T",
            "grad_sync_source": "measured AllReduce on the replica group",
            "collective_overhead": overhead_evidence,
            "times": "median over repeats; slowest rank; ms per micro-batch share per device",
            "degrees": evidence,
        },
    )


def _table_link(spec: ProfileSpec, per_rank: list[dict[str, Any]]) -> LinkModel:
    """The link the table prices collectives on: the emulated one, else this machine's effective
    bandwidth and latency from the AllReduces measured at degree T."""
    top = spec.devices
    if spec.link is not None:
        return LinkModel(spec.link.bandwidth_gbps, spec.link.latency_us)
    if top == 1:
        return LinkModel(1e3, 0.0)
    ar_ms = _slowest(per_rank, top, "allreduce_ms")
    wire = 2 * (top - 1) / top * per_rank[0]["degrees"][str(top)]["allreduce_bytes"]
    latency_ms = _slowest(per_rank, top, "latency_ms")
    transfer_s = max(ar_ms - latency_ms, 1e-6) * 1e-3  # the latency share is not bandwidth
    return LinkModel(min(wire * 8 / transfer_s / 1e9, 1e4), latency_ms * 1e3)


def _collective_overheads(
    spec: ProfileSpec, per_rank: list[dict[str, Any]], link: LinkModel
) -> tuple[dict[int, float], dict[str, Any]]:
    """Per degree, one collective's overhead (:func:`~oases_ds.planner.costmodel.collective_overhead_ms`)
    and the evidence behind it.

    Each profiled step's wall time is set against the simulation of the same step's per-op
    compute (a sum of per-op medians would fall short of a noisy step's median and leave
    that shortfall in the residual).  Of the ranks, the smallest residual is kept: that
    rank's compute set the step and the other waited for it, as the table keeps the
    slowest rank's compute.  The median over steps is the degree's residual."""
    ops = OperatorModel(dataclasses.replace(spec.model, num_layers=1)).ops  # same sequence at every degree
    if spec.sequence_parallel and spec.devices > 1:
        ops = sequence_parallel_ops(ops)
    schedule = build_schedule(spec.schedule, ops)
    residual: dict[int, float] = {}
    collectives: dict[int, int] = {}
    evidence: dict[str, Any] = {}
    for degree in spec.degrees():
        results = [rank["degrees"][str(degree)] for rank in per_rank]
        per_step, walls, sims = [], [], []
        for step in range(len(results[0]["step_ms_reps"])):
            pairs = []
            for result in results:
                costs = OpCosts.from_profile(ops, OpTimes.from_keys(result["op_ms_reps"][step]),
                                             result["allreduce_bytes"], degree)
                wall, sim = result["step_ms_reps"][step], simulate_step(schedule, ops, costs, link).step_ms
                pairs.append((wall - sim, wall, sim))
            kept = min(pairs)
            per_step.append(kept[0])
            walls.append(kept[1])
            sims.append(kept[2])
        residual[degree] = _median(per_step)
        collectives[degree] = int(results[0]["collectives"])
        evidence[str(degree)] = {"measured_step_ms": _median(walls), "simulated_step_ms": _median(sims),
                                 "residual_ms": residual[degree], "collectives_per_step": collectives[degree]}
    if 1 not in residual:  # planner.min_degree > 1 or sequence parallelism: no collective-free step to subtract
        evidence["note"] = "no degree-1 step profiled (the reference of the overhead): overhead not charged (0)"
        return {degree: 0.0 for degree in spec.degrees()}, evidence
    overhead = collective_overhead_ms(residual, collectives)
    for degree in spec.degrees():
        evidence[str(degree)]["overhead_per_collective_ms"] = overhead[degree]
    return overhead, evidence


def profile_rows(table: CostTable) -> list[str]:
    """Human-readable per-degree profile, for the CLI."""
    lines = [f"{'block':5} {'t':>3} {'fwd ms':>8} {'bwd ms':>8} {'exp.comm':>9} {'coll.ovh':>9} {'gradsync':>9} "
             f"{'state MiB':>10} {'act MiB':>8}"]
    for kind in BLOCK_KINDS:
        for degree in table.degrees:
            c = table.blocks[kind][degree]
            lines.append(
                f"{kind:5} {degree:>3} {c.fwd_ms:8.3f} {c.bwd_ms:8.3f} {c.comm_fwd_ms + c.comm_bwd_ms:9.3f} "
                f"{c.overhead_ms:9.3f} {c.grad_sync_ms:9.3f} {c.state_bytes / 2**20:10.3f} {c.act_bytes / 2**20:8.3f}"
            )
    return lines
