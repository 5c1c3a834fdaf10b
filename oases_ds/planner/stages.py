"""Pipeline stages: which contiguous layers each stage runs, and each stage's TMP degrees.

Why stages at all: a model whose layers do not fit one TMP group's memory (the paper's
GPT-39.1B on 24 GiB cards), or a cluster whose links between nodes are too slow for TMP
(a TMP AllReduce per block crosses the link; a pipeline sends one activation per stage
and micro-batch), is cut into ``P`` stages run 1F1B over ``m`` micro-batches, with
Oases' overlapped TMP inside each stage.  The first stage also runs the embedding, the
last the head, the loss and its logits.

**Step time (1F1B).**  Stage ``s`` takes ``t_s`` per micro-batch (forward + backward).
The first micro-batch crosses every stage once (the fill and the drain of the
pipeline), the other ``m - 1`` leave at the pace of the slowest stage::

    T = sum_s t_s + (m - 1) * max_s t_s

For equal stages this is Megatron's ``(m + P - 1)(t_f + t_b)`` with the bubble fraction
``(P - 1) / m`` (Narayanan et al., SC'21, Sec. 2.2); for unequal ones it is Alpa's
pipeline latency (Zheng et al., OSDI'22), and it never exceeds ``(m + P - 1) * max_s t_s``.
It ignores that a stage's forward and backward of one micro-batch can wait on different
neighbours (it takes each stage's ``t_s`` as one block of time).

``t_s`` is the stage's cost-table objective (:func:`~oases_ds.planner.objective.sequence_step_ms`
over its layers: node costs, edges, and the edges from and into the full TMP degree at
its ends -- the activation between stages arrives replicated on the TMP group, as after
the embedding, and leaves as into the head), where each block's gradient all-reduce,
run once per step and not per micro-batch, is charged ``1/m`` per micro-batch; plus
:attr:`PipelineSpec.p2p_ms` for the activation sent forward (all but the last stage) and
for its gradient sent back (all but the first), charged as exposed; plus
:attr:`PipelineSpec.embed_ms` on the first stage and :attr:`PipelineSpec.head_ms` on the last.

**Memory of stage s.**  1F1B lets stage ``s`` run ``P - s`` forwards before its first
backward, so up to ``k_s = min(P - s, m)`` micro-batches are in flight there, each
holding what its blocks hold between forward and backward -- the block rows of the
memory model (:func:`~oases_ds.planner.memory.memory_rows`: checkpoints and kept
graphs, every sub-batch).  So a stage needs its blocks' model states, ``k_s`` x its
blocks' activation rows, and once its role's constant
(:attr:`~oases_ds.planner.costs.CostTable.stage_fixed_bytes`: the working set of the
block in recompute + backward and the collectives in flight; the embedding's states and
activations on the first stage; the head's, the loss's and the logits on the last).
Not counted: the received activation of a micro-batch waiting for its forward (1F1B
receives just in time) and the gradient being sent back (transient, as between blocks).

**Search (exact).**  A table profiles one layer, so every layer costs the same and a
stage's best degrees depend only on its index and layer count; each ``(s, n)`` is
solved by the exact label DP (:func:`~oases_ds.planner.dp.solve_dp`) on the stage's own
table (rows x ``k_s``, the role's constant).  ``T`` is nondecreasing in every ``t_s``,
so for a given split the per-stage optima combine to the split's optimum.  The split:
for every candidate bottleneck ``B`` (the stage times found), a DP over stages gives the
least ``sum t_s`` with every ``t_s <= B``; ``T = min_B (sum + (m - 1) B)`` (Alpa's
enumeration of the slowest stage).  :func:`brute_force_stages` enumerates every split
and every degree of every block, the oracle of ``tests/unit/test_planner_stages.py``.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from oases_ds.planner.costs import BLOCK_KINDS, BlockCost, CostTable
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.objective import fits_memory, sequence_memory_bytes, sequence_step_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError


@dataclass(frozen=True)
class PipelineSpec:
    """The pipeline a split is planned for; times in ms per micro-batch on one device."""

    stages: int
    """P: pipeline stages, each a TMP group of the table's ``devices``."""
    micro_batches: int
    """m: micro-batches per step and pipeline (gradient accumulation steps)."""
    p2p_ms: float = 0.0
    """One micro-batch's stage-boundary activation (or its gradient) over the link between
    stages, one way; charged once forward and once backward per boundary."""
    embed_ms: float = 0.0
    """Embedding forward + backward per micro-batch: the table leaves it out, the first stage runs it."""
    head_ms: float = 0.0
    """Head + loss forward + backward per micro-batch: the table leaves it out, the last stage runs it."""

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PipelineSpec.{name} must be an int >= 1, got {value!r}")
        for name in ("p2p_ms", "embed_ms", "head_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"PipelineSpec.{name} must be a finite number >= 0, got {value!r}")

    def in_flight(self, stage: int) -> int:
        """Micro-batches stage ``stage`` holds between forward and backward at most under 1F1B."""
        return min(self.stages - stage, self.micro_batches)

    def role(self, stage: int) -> str:
        """Which ends of the model the stage holds (:data:`~oases_ds.planner.costs.STAGE_ROLE_NAMES`)."""
        if self.stages == 1:
            return "only"
        return "first" if stage == 0 else "last" if stage == self.stages - 1 else "middle"

    def extra_ms(self, stage: int) -> float:
        """What stage ``stage`` adds per micro-batch besides its blocks: p2p, embedding, head."""
        last = self.stages - 1
        return (self.p2p_ms * ((stage < last) + (stage > 0)) + self.embed_ms * (stage == 0)
                + self.head_ms * (stage == last))


def p2p_ms(table: CostTable, bandwidth_gbps: float | None = None, latency_us: float | None = None) -> float:
    """One micro-batch's stage-boundary activation sent one way, in ms: the table's block
    boundary activation of every sub-batch (``reshard_bytes x sub_batches``) over the link
    between stages, by default the table's own.  Every TMP rank sends its replica to its
    peer in the next stage at once (no scatter/gather across the TMP group), so one
    device's link carries the whole activation."""
    bandwidth = table.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps
    latency = table.latency_us if latency_us is None else latency_us
    if not 0 < bandwidth < math.inf or not 0 <= latency < math.inf:
        raise ValueError(f"pipeline link: bandwidth_gbps must be > 0 and latency_us >= 0, got {bandwidth}, {latency}")
    return (latency * 1e-6 + table.reshard_bytes * table.sub_batches * 8 / (bandwidth * 1e9)) * 1e3


def pipeline_step_ms(stage_ms: Sequence[float], micro_batches: int) -> float:
    """1F1B step time of stages taking ``stage_ms`` per micro-batch: ``sum + (m - 1) max``
    (module doc)."""
    return float(sum(stage_ms) + (micro_batches - 1) * max(stage_ms))


def stage_table(table: CostTable, pipeline: PipelineSpec, stage: int, layers: int) -> CostTable:
    """The cost table of stage ``stage`` running ``layers`` layers: activation rows x the
    micro-batches in flight there, gradient all-reduce / m, and its role's constant."""
    k, m = pipeline.in_flight(stage), pipeline.micro_batches
    role = pipeline.role(stage)
    def scaled(rows: dict[str, dict[int, BlockCost]]) -> dict[str, dict[int, BlockCost]]:
        return {kind: {t: dataclasses.replace(cost, act_bytes=cost.act_bytes * k, grad_sync_ms=cost.grad_sync_ms / m)
                       for t, cost in by_degree.items()} for kind, by_degree in rows.items()}

    fixed = table.fixed_bytes if role == "only" else table.stage_fixed_bytes.get(role, table.fixed_bytes)
    return dataclasses.replace(table, blocks=scaled(table.blocks), store_blocks=scaled(table.store_blocks),
                               layers=layers, fixed_bytes=fixed)


def stage_step_ms(table: CostTable, pipeline: PipelineSpec, stage: int, block_degrees: Sequence[int],
                  block_policies: Sequence[str] | None = None) -> float:
    """``t_s``: stage ``stage``'s time per micro-batch with these block degrees (attn, mlp, ...) and policies."""
    inner = stage_table(table, pipeline, stage, len(block_degrees) // len(BLOCK_KINDS))
    return sequence_step_ms(inner, block_degrees, block_policies) + pipeline.extra_ms(stage)


def stage_memory_bytes(table: CostTable, pipeline: PipelineSpec, stage: int, block_degrees: Sequence[int],
                       block_policies: Sequence[str] | None = None) -> float:
    """Per-device memory bound of stage ``stage`` with these block degrees and policies (module doc)."""
    inner = stage_table(table, pipeline, stage, len(block_degrees) // len(BLOCK_KINDS))
    return sequence_memory_bytes(inner, block_degrees, block_policies)


@dataclass(frozen=True)
class Stage:
    """One stage of a :class:`StagePlan`."""

    index: int
    first_layer: int
    plan: Plan
    """Degrees of the stage's own layers (layer 0 = the model's ``first_layer``)."""
    step_ms: float
    """``t_s``: time per micro-batch, :func:`stage_step_ms`."""
    memory_bytes: float
    """Per-device bound with ``in_flight`` micro-batches held, :func:`stage_memory_bytes`."""
    in_flight: int

    @property
    def layers(self) -> int:
        return self.plan.layers


@dataclass(frozen=True)
class StagePlan:
    """The split, each stage's degrees and the predicted 1F1B step."""

    pipeline: PipelineSpec
    stages: tuple[Stage, ...]
    step_ms: float
    """:func:`pipeline_step_ms` of the stages' times."""
    solver_ms: float = 0.0
    solver_name: str = "stage-dp"

    def layer_counts(self) -> list[int]:
        """Layers per stage, in order: what the runtime's stage partition takes."""
        return [stage.layers for stage in self.stages]

    def block_degrees(self) -> list[int]:
        return [t for stage in self.stages for t in stage.plan.block_degrees()]

    def block_policies(self) -> list[str]:
        return [p for stage in self.stages for p in stage.plan.block_policies()]

    def to_plan(self, table: CostTable) -> Plan:
        """The whole model's plan (every layer's degrees and policies, stages concatenated) carrying
        the split, each stage's time and memory: what ``oases-plan`` writes."""
        return Plan.from_block_degrees(
            self.block_degrees(), table.devices, self.block_policies(), predicted_step_ms=self.step_ms,
            solver_ms=self.solver_ms,
            solver_name=self.solver_name, memory_bytes=max(stage.memory_bytes for stage in self.stages),
            table_key=table.key(), stage_layers=tuple(self.layer_counts()),
            stage_step_ms=tuple(stage.step_ms for stage in self.stages),
            stage_memory_bytes=tuple(stage.memory_bytes for stage in self.stages),
            micro_batches=self.pipeline.micro_batches)

    def as_lines(self) -> list[str]:
        """One line per stage: its layers, time, memory and degrees (Table II form, runs collapsed)."""
        lines = []
        for stage in self.stages:
            last = stage.first_layer + stage.layers - 1
            span = f"layer {stage.first_layer}" if stage.layers == 1 else f"layers {stage.first_layer}-{last}"
            ends = " + embedding" * (stage.index == 0) + " + head/loss" * (stage.index == len(self.stages) - 1)
            degrees = "; ".join(_shifted(stage.plan.as_table(), stage.first_layer).splitlines())
            lines.append(f"stage {stage.index}: {span} ({stage.layers}){ends} | {stage.step_ms:.3f} ms/micro-batch | "
                         f"peak {stage.memory_bytes / 2**20:.1f} MiB ({stage.in_flight} in flight) | {degrees}")
        return lines


def _shifted(table_text: str, offset: int) -> str:
    """A stage plan's ``layers a-b`` rows renumbered to the model's layers."""
    return re.sub(r"layers (\d+)(?:-(\d+))?",
                  lambda m: "layers " + "-".join(str(int(x) + offset) for x in m.groups() if x is not None), table_text)


def _check(table: CostTable, pipeline: PipelineSpec) -> None:
    if pipeline.stages > table.layers:
        raise ValueError(f"pipeline_stages={pipeline.stages} exceeds the {table.layers} layers to plan; "
                         f"use at most {table.layers} stages (a stage runs at least one layer)")


def plan_stages(table: CostTable, pipeline: PipelineSpec, memory_limit_bytes: float | None) -> StagePlan:
    """The split and per-stage degrees minimising :func:`pipeline_step_ms` with every stage
    within ``memory_limit_bytes`` per device (module doc: exact).

    Raises :class:`~oases_ds.planner.plan.PlanInfeasibleError` when no split fits."""
    _check(table, pipeline)
    started = time.perf_counter()
    P, L = pipeline.stages, table.layers
    most = L - (P - 1)  # layers one stage may take, the others taking one each
    times = np.full((P, most + 1), np.inf)
    plans: dict[tuple[int, int], Plan] = {}
    for stage in range(P):
        for n in range(1, most + 1):
            try:
                plan = solve_dp(stage_table(table, pipeline, stage, n), memory_limit_bytes)
            except PlanInfeasibleError:
                break  # rows are >= 0: a longer stage needs at least as much
            plans[stage, n] = plan
            times[stage, n] = plan.predicted_step_ms + pipeline.extra_ms(stage)
    counts = _best_split(times, L, pipeline.micro_batches)
    if counts is None:
        lean = [stage for stage in range(P) if (stage, 1) not in plans]
        held = [max(n for s, n in plans if s == stage) if (stage, 1) in plans else 0 for stage in range(P)]
        raise PlanInfeasibleError(
            f"no split into {P} stages fits {memory_limit_bytes:.6g} bytes per device"
            + (f" (stage {lean[0]} cannot hold even one layer with {pipeline.in_flight(lean[0])} micro-batches in flight)"
               if lean else f" (the stages hold at most {held} layers: {sum(held)} of {L})")
            + f"; use more stages, fewer micro-batches in flight or a smaller micro-batch ({table.key()})")
    return _assemble(table, pipeline, [plans[stage, n] for stage, n in enumerate(counts)], started)


def plan_split(table: CostTable, pipeline: PipelineSpec, memory_limit_bytes: float | None,
               layer_counts: Sequence[int]) -> StagePlan:
    """The best degrees of each stage for a given split (e.g. Megatron's even one, the
    baseline :func:`plan_stages` is compared with).  Raises
    :class:`~oases_ds.planner.plan.PlanInfeasibleError` naming the stage that does not fit."""
    _check(table, pipeline)
    if len(layer_counts) != pipeline.stages or sum(layer_counts) != table.layers or min(layer_counts) < 1:
        raise ValueError(f"layer_counts {list(layer_counts)} must be {pipeline.stages} counts >= 1 "
                         f"summing to the {table.layers} layers")
    started = time.perf_counter()
    plans = []
    for stage, n in enumerate(layer_counts):
        try:
            plans.append(solve_dp(stage_table(table, pipeline, stage, n), memory_limit_bytes))
        except PlanInfeasibleError as err:
            raise PlanInfeasibleError(f"stage {stage} ({n} layers, {pipeline.in_flight(stage)} micro-batches in "
                                      f"flight): {err}") from None
    return _assemble(table, pipeline, plans, started, "stage-dp-given-split")


def _assemble(table: CostTable, pipeline: PipelineSpec, plans: list[Plan], started: float,
              solver_name: str = "stage-dp") -> StagePlan:
    """A :class:`StagePlan` from each stage's degrees, its numbers from the one definition
    (:func:`stage_step_ms`, :func:`stage_memory_bytes`, :func:`pipeline_step_ms`)."""
    stages, first = [], 0
    for stage, plan in enumerate(plans):
        degrees, policies = plan.block_degrees(), plan.block_policies()
        stages.append(Stage(stage, first, plan, stage_step_ms(table, pipeline, stage, degrees, policies),
                            stage_memory_bytes(table, pipeline, stage, degrees, policies), pipeline.in_flight(stage)))
        first += plan.layers
    step = pipeline_step_ms([s.step_ms for s in stages], pipeline.micro_batches)
    return StagePlan(pipeline, tuple(stages), step, (time.perf_counter() - started) * 1e3, solver_name)


def even_split(layers: int, stages: int) -> list[int]:
    """Megatron's split: layers divided evenly, the first stages taking one more when it does not divide."""
    return [layers // stages + (stage < layers % stages) for stage in range(stages)]


def _best_split(times: np.ndarray, layers: int, micro_batches: int) -> list[int] | None:
    """Layers per stage minimising ``sum t_s + (m - 1) max t_s``; ``times[s, n]``: stage s's
    best time with n layers (inf: infeasible).  None when no split is feasible."""
    stages, width = times.shape
    finite = np.unique(times[np.isfinite(times)])
    floor = float(np.where(np.isfinite(times), times, np.inf).min(axis=1).sum())  # sum of each stage's fastest
    used = np.arange(layers + 1)
    before = used[:, None] - np.arange(width)[None, :]  # [layers used after, n] -> layers used before
    valid = before >= 0
    best_total, best_counts = math.inf, None
    for bound in finite:  # ascending: once (m - 1) B + floor cannot win, no larger B can
        if (micro_batches - 1) * bound + floor >= best_total:
            break
        capped = np.where(times <= bound, times, np.inf)
        reach = np.full(layers + 1, np.inf)
        reach[0] = 0.0
        choice = []
        for stage in range(stages):
            via = np.where(valid, reach[np.clip(before, 0, None)], np.inf) + capped[stage][None, :]
            pick = via.argmin(axis=1)
            choice.append(pick)
            reach = via[used, pick]
        total = reach[layers] + (micro_batches - 1) * bound
        if total < best_total:
            counts, left = [], layers
            for stage in range(stages - 1, -1, -1):
                counts.append(int(choice[stage][left]))
                left -= counts[-1]
            best_total, best_counts = float(total), counts[::-1]
    return best_counts


def brute_force_stages(table: CostTable, pipeline: PipelineSpec, memory_limit_bytes: float | None) -> StagePlan:
    """Every split and every degree of every block of every stage, jointly: the test oracle
    (exponential; small tables only)."""
    _check(table, pipeline)
    P, L = pipeline.stages, table.layers
    best: tuple[float, list[int], list[tuple[int, ...]]] | None = None
    feasible: dict[tuple[int, int], list[tuple[tuple[int, ...], float]]] = {}  # (stage, n) -> (degrees, t_s)
    for cuts in itertools.combinations(range(1, L), P - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
        for stage, n in enumerate(counts):
            if (stage, n) not in feasible:
                feasible[stage, n] = [
                    (seq, stage_step_ms(table, pipeline, stage, seq))
                    for seq in itertools.product(table.degrees, repeat=len(BLOCK_KINDS) * n)
                    if fits_memory(stage_memory_bytes(table, pipeline, stage, seq), memory_limit_bytes)]
        for combo in itertools.product(*(feasible[stage, n] for stage, n in enumerate(counts))):
            step = pipeline_step_ms([t for _, t in combo], pipeline.micro_batches)
            if best is None or step < best[0]:
                best = (step, counts, [seq for seq, _ in combo])
    if best is None:
        raise PlanInfeasibleError(f"no split into {P} stages fits {memory_limit_bytes!r} bytes per device")
    plans = [Plan.from_block_degrees(seq, table.devices, solver_name="brute_force") for seq in best[2]]
    return _assemble(table, pipeline, plans, time.perf_counter(), "brute_force")
