"""Price a whole plan by replaying its schedule over the profile's per-op times.

The cost table's node and edge costs (:mod:`oases_ds.planner.costs`) are additive
so that the DP and the ILP can search over them, and at every block boundary they
guess how much of a collective the neighbouring block hides.  Where the degree
changes those guesses add up wrongly: scored out of sample (cost model 6,
``benchmarks/cost_model_oos.py``), mixes of degrees ranked at 0.73-0.88 with fresh
profiles while uniform plans stayed above 0.9.  A residual fit over four mix sets
had every reshard over-priced by ~5 ms and degree-1 end blocks under-priced.

So a plan's step is priced the way it runs: its own operator sequence
(:func:`~oases_ds.planner.memory.plan_ops`, reshards where the model puts them),
the schedule's own instruction stream over it, and
:func:`~oases_ds.planner.costmodel.simulate_step` with

* each compute op's Forward / Recompute / Backward time at its block's degree, as
  the profiler measured it on the one-layer model (``op_ms_rank0``: rank 0, median
  over steps, per sub-batch; the embedding and head at the full degree ``T``),
  scaled per block, degree and pass so that the block's ops sum to the *slowest*
  rank's time for it (the table's ``fwd_ms`` / ``recompute_ms`` / ``bwd_ms`` evidence,
  :func:`block_scales`): the slowest rank sets a TMP step, and with 4 ranks on 2
  cores rank 0 alone priced TMP-4 plans at 0.79-0.87 (cost model 7, run D);
* each block collective's payload as measured at that degree, a reshard's
  AllGather as :func:`~oases_ds.planner.costs.reshard_ms` sizes it, all on the
  table's link model;

with each collective's measured overhead beyond link and compute as host time on the compute
lane, spent as the collective is issued (cost model 9, :func:`collective_issue_ms`): where the
lane would wait for the link anyway it hides, as it does in the run.  Its size per collective is
the one that reproduces the profiled one-layer step it was measured on.  Cost models 4-8 added it
after the simulation, once per collective, and over-priced link-bound plans (uniform TMP 4 ran at
0.955-0.992 of its prediction in all 22 profiles of runs E-K).  Plus each block its replicas'
gradient all-reduce.  Nothing is fitted to the plans' measured steps.

The additive costs stay the solvers' objective; the replay ranks the solver's
plan against the uniform ones (:func:`rank_by_replay`) and is what the accuracy
study scores.  A profiled table and an analytic one (``cost=analytic``: per-op times from
FLOPs, :mod:`oases_ds.planner.analytic`) both hold per-op times; a hand-made table
without them is priced additively (:func:`can_replay`).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from oases_ds.models.ops import CommOp, moves_bytes
from oases_ds.parallel.link import LinkModel
from oases_ds.planner.costmodel import OpCosts, issue_ms_hiding, simulate_step
from oases_ds.planner.costs import CostTable, reshard_collective
from oases_ds.planner.memory import one_layer_ops, plan_ops
from oases_ds.planner.objective import check_plan_fits_table, fits_memory, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.schedule.generators import ScheduleSpec, build_schedule
from oases_ds.schedule.instructions import StartAsync

_LAYER_PREFIX = re.compile(r"^L\d+\.")


@dataclass(frozen=True)
class PlanReplay:
    """A plan's replayed step, in ms, and its parts."""

    simulated_ms: float
    """The schedule replayed on one compute lane and the link (:func:`simulate_step`)."""
    exposed_comm_ms: float
    """Of ``simulated_ms``, the time the compute lane waited for a collective."""
    overhead_ms: float
    """Of ``simulated_ms``, the compute lane's host time issuing collectives (:func:`collective_issue_ms`),
    hidden or not."""
    grad_sync_ms: float
    """Every block's gradient all-reduce across its replicas, as profiled."""
    collectives: int
    """Collectives the step issues (every sub-batch, every pass)."""
    waits_ms: dict[str, float] = field(default_factory=dict, compare=False)
    """Of ``exposed_comm_ms``, the wait at each Sync, named as the executor's timeline names it
    (``W<op>.<sub>``, ``Wb<op>.<sub>``), to set against a measured step's waits."""

    @property
    def step_ms(self) -> float:
        """What the plan is priced at: the simulated step plus the gradient all-reduces it leaves out."""
        return self.simulated_ms + self.grad_sync_ms


def can_replay(table: CostTable) -> bool:
    """Whether ``table`` holds per-op times at every degree (profiled and analytic tables do; a
    hand-made one, or a table file stripped of its ``measurements``, may not)."""
    evidence = table.measurements.get("degrees", {})
    return all(isinstance(evidence.get(str(d)), dict) and "op_ms_rank0" in evidence[str(d)] and
               "allreduce_bytes" in evidence[str(d)] for d in table.degrees)


def _one_layer_index(family: str) -> dict[str, int]:
    """Op name (layer prefix as ``L0.``) -> its index in the profiled one-layer sequence."""
    return {op.name: i for i, op in enumerate(one_layer_ops(family))}


def block_scales(table: CostTable, family: str) -> dict[tuple[int, str, str], float]:
    """``(degree, block kind, pass letter F/R/B) -> factor`` that takes rank 0's per-op times of the
    block to the slowest rank's block time the table holds (evidence ``blocks``); 1 where either
    side is missing or zero."""
    ops = one_layer_ops(family)
    scales: dict[tuple[int, str, str], float] = {}
    for degree in table.degrees:
        evidence = table.measurements["degrees"][str(degree)]
        op_ms = evidence["op_ms_rank0"]
        for kind, timing in evidence.get("blocks", {}).items():
            members = [i for i, op in enumerate(ops) if op.block == kind and not isinstance(op, CommOp)]
            for letter, part in (("F", "fwd_ms"), ("R", "recompute_ms"), ("B", "bwd_ms")):
                rank0 = table.sub_batches * sum(float(op_ms.get(f"{i}:{letter}", 0.0)) for i in members)
                slowest = float(timing.get(part, 0.0))
                scales[(degree, kind, letter)] = slowest / rank0 if rank0 > 0 and slowest > 0 else 1.0
    return scales


def collective_issue_ms(table: CostTable, family: str, schedule: ScheduleSpec) -> dict[int, float]:
    """Per group size, the host time one collective spends on the compute lane as it is issued.

    The table's :attr:`~CostTable.collective_overhead_ms` is what one collective added to the
    profiled one-layer step at that degree, charged in full.  Replayed the way the step ran, part
    of it hides behind the link; so the issue time is the one that, placed on the compute lane of
    that same one-layer replay (the profiler's per-op times at the degree, its payload, its link),
    adds the measured total back (:func:`~oases_ds.planner.costmodel.issue_ms_hiding`).  A degree
    without per-op evidence (a hand-made table) keeps its per-collective overhead as the issue time.
    Memoised on those inputs (a search per degree): every plan priced on a table needs it, and the
    pooled study prices each stored profile hundreds of times.
    """
    evidence = table.measurements.get("degrees", {})
    per_degree = []
    for degree, overhead in sorted(table.collective_overhead_ms.items()):
        measured = evidence.get(str(degree), {})
        if overhead <= 0 or "op_ms_rank0" not in measured or "allreduce_bytes" not in measured:
            per_degree.append((degree, overhead, None, None))
        else:
            per_degree.append((degree, overhead, tuple(sorted(measured["op_ms_rank0"].items())),
                               int(measured["allreduce_bytes"])))
    return dict(_issue_ms(family, schedule, table.bandwidth_gbps, table.latency_us, tuple(per_degree)))


@functools.lru_cache(maxsize=512)
def _issue_ms(family: str, schedule: ScheduleSpec, bandwidth_gbps: float, latency_us: float,
              per_degree: tuple[tuple[int, float, tuple[tuple[str, float], ...] | None, int | None], ...]
              ) -> tuple[tuple[int, float], ...]:
    """:func:`collective_issue_ms` on hashable inputs: per degree (degree, overhead, op times, payload)."""
    ops = one_layer_ops(family)
    program = build_schedule(schedule, ops)
    link = LinkModel(bandwidth_gbps, latency_us)
    issue = []
    for degree, overhead, op_ms, payload in per_degree:
        if op_ms is None or payload is None:
            issue.append((degree, overhead))
            continue
        costs = OpCosts.from_profile(ops, dict(op_ms), payload, degree)
        issue.append((degree, issue_ms_hiding(program, ops, costs, link, degree, overhead)))
    return tuple(issue)


def replay_plan(table: CostTable, family: str, plan: Plan, schedule: ScheduleSpec,
                overhead: bool = True) -> PlanReplay:
    """Replay ``plan``'s step under ``schedule`` from ``table``'s per-op profile (module doc).

    ``overhead=False`` leaves out the per-collective overhead: the ablation the
    accuracy study reports beside the score.
    """
    if not can_replay(table):
        raise ValueError(f"table {table.key()} has no per-op times to replay (measurements.degrees.<t>.op_ms_rank0); "
                         f"price it with predict_step_ms, or profile it again (cost=profile)")
    check_plan_fits_table(table, plan)
    devices = table.devices
    ops, degrees = plan_ops(family, plan.attn_degrees, plan.mlp_degrees, devices)
    index = _one_layer_index(family)
    scales = block_scales(table, family)
    evidence = table.measurements["degrees"]
    forward: dict[int, float] = {}
    backward: dict[int, float] = {}
    recompute: dict[int, float] = {}
    comm_bytes: dict[int, int] = {}
    ranks: dict[int, int] = {}
    kind: dict[int, str] = {}
    for i, (op, degree) in enumerate(zip(ops, degrees)):
        if isinstance(op, CommOp) and "all_gather" in (op.forward, op.backward):  # a reshard (plan_ops)
            gathered, ranks[i] = reshard_collective(table, degrees[i - 1], degree)
            comm_bytes[i], kind[i] = int(gathered), "all_gather"
            continue
        source = index.get(_LAYER_PREFIX.sub("L0.", op.name))
        if source is None:
            raise ValueError(f"op {op.name} of plan {plan.block_degrees()} is not in the profiled one-layer model")
        op_ms = evidence[str(degree)]["op_ms_rank0"]
        for letter, into in (("F", forward), ("B", backward), ("R", recompute)):
            if f"{source}:{letter}" in op_ms:
                into[i] = float(op_ms[f"{source}:{letter}"]) * scales.get((degree, op.block, letter), 1.0)
        if isinstance(op, CommOp) and degree > 1:
            comm_bytes[i], ranks[i] = int(evidence[str(degree)]["allreduce_bytes"]), degree
    costs = OpCosts(forward_ms=forward, backward_ms=backward, recompute_ms=recompute, comm_bytes=comm_bytes,
                    ranks=ranks, kind=kind, default_ranks=devices)
    program = build_schedule(schedule, ops)
    issue = collective_issue_ms(table, family, schedule) if overhead else {}
    sim = simulate_step(program, ops, costs, LinkModel(table.bandwidth_gbps, table.latency_us), issue_ms=issue)
    issued = [ranks[ins.op] for ins in program.instructions
              if isinstance(ins, StartAsync) and comm_bytes.get(ins.op) and moves_bytes(ops[ins.op], ins.phase)]
    grad = sum(table.blocks[k][d].grad_sync_ms for k, d in zip(table.block_kinds(), plan.block_degrees()))
    waits: dict[str, float] = {}
    for event in sim.events:
        if event.lane == "wait":
            waits[event.name] = waits.get(event.name, 0.0) + event.end_ms - event.start_ms
    return PlanReplay(simulated_ms=sim.step_ms, exposed_comm_ms=sim.exposed_comm_ms, overhead_ms=sim.issue_ms,
                      grad_sync_ms=grad, collectives=len(issued), waits_ms=waits)


def rank_by_replay(table: CostTable, family: str, schedule: ScheduleSpec, solved: Plan,
                   memory_limit_bytes: float | None) -> tuple[Plan, list[tuple[Plan, float]]]:
    """The fastest by replay of the solver's plan and the uniform plans that fit, and every
    (plan, replayed ms) considered, fastest first.

    Why: the solvers search the additive costs, which misprice mixes of degrees (module
    doc); replaying a whole 128-layer plan is too slow to search with, but cheap for the
    few plans a user would otherwise compare by hand.  The returned plan carries its
    replayed step as ``predicted_step_ms`` and ``"<solver>+replay"`` as its solver when
    a uniform plan beat the solver's."""
    candidates = [solved] + [Plan.uniform(table.devices, table.layers, d) for d in table.degrees]
    seen: set[tuple[int, ...]] = set()
    priced: list[tuple[Plan, float]] = []
    for plan in candidates:
        blocks = tuple(plan.block_degrees())
        if blocks in seen or not fits_memory(predict_memory_bytes(table, plan), memory_limit_bytes):
            continue
        seen.add(blocks)
        priced.append((plan, replay_plan(table, family, plan, schedule).step_ms))
    priced.sort(key=lambda pair: pair[1])
    best, ms = priced[0]
    same = tuple(best.block_degrees()) == tuple(solved.block_degrees())
    chosen = Plan(best.attn_degrees, best.mlp_degrees, table.devices, predicted_step_ms=ms,
                  solver_ms=solved.solver_ms, solver_name=solved.solver_name if same else f"{solved.solver_name}+replay",
                  memory_bytes=predict_memory_bytes(table, best), table_key=solved.table_key)
    return chosen, priced


def replayed_or_additive(table: CostTable, family: str | None, schedule: ScheduleSpec | None,
                         plans: Sequence[Plan]) -> list[float]:
    """Each plan's predicted step: replayed where the table and the caller allow it, else
    the additive objective (:func:`~oases_ds.planner.objective.predict_step_ms`)."""
    if family is None or schedule is None or not can_replay(table):
        return [predict_step_ms(table, plan) for plan in plans]
    return [replay_plan(table, family, plan, schedule).step_ms for plan in plans]


def replay_inputs(result: dict[str, Any]) -> tuple[str, ScheduleSpec]:
    """The model family and schedule an accuracy result file was measured with (its ``config``)."""
    cfg = result["config"]
    return cfg["model"]["family"], ScheduleSpec.from_mapping(cfg["schedule"])

