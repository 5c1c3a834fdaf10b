"""Price a whole plan by replaying its schedule over the profile's per-op times.

The cost table's node and edge costs (:mod:`oases_ds.planner.costs`) are additive
so that the DP and the ILP can search over them, and at every block boundary they
guess how much of a collective the neighbouring block hides.  Where the degree
changes those guesses add up wrongly: scored out of sample by the cost-model study
(:mod:`oases_ds.bench.cost_model`), mixes of degrees ranked well below uniform plans,
with every reshard over-priced and degree-1 end blocks under-priced.

So a plan's step is priced the way it runs: its own operator sequence
(:func:`~oases_ds.models.operator_model.plan_ops`, reshards where the model puts them),
the table's schedule's own instruction stream over it, and
:func:`~oases_ds.planner.costmodel.simulate_step` with

* each compute op's Forward / Recompute / Backward time at its block's degree, as
  the profiler measured it on the one-layer model (:attr:`CostTable.op_profile
  <oases_ds.planner.costs.CostTable.op_profile>`: rank 0, median over steps, per
  sub-batch; the embedding and head at the full degree ``T``), scaled per block, degree
  and pass so that the block's ops sum to the *slowest* rank's time for it
  (:func:`block_scales`): the slowest rank sets a TMP step, and on a machine with
  fewer cores than ranks rank 0 alone under-prices the high degrees;
* each block collective's payload as measured at that degree, a reshard's
  AllGather as :func:`~oases_ds.planner.costs.reshard_ms` sizes it, all on the
  table's link model;

with each collective's measured overhead beyond link and compute as host time on the compute
lane, spent as the collective is issued (:func:`collective_issue_ms`): where the lane would
wait for the link anyway it hides, as it does in the run, so a link-bound plan is not charged
for it twice.  Its size per collective is the one that reproduces the profiled one-layer step it
was measured on.  Plus each block its replicas' gradient all-reduce.  Nothing is fitted to the
plans' measured steps.

The additive costs stay the solvers' objective; the replay ranks the solver's
plan against the uniform ones (:func:`rank_by_replay`) and is what the accuracy
check scores.  A profiled table and an analytic one (``cost=analytic``: per-op times from
FLOPs, :mod:`oases_ds.planner.analytic`) both hold per-op times; a hand-made table
without them is priced additively (:func:`can_replay`).
"""
from __future__ import annotations

import dataclasses

import functools
import re
from dataclasses import dataclass, field
from typing import Sequence

from oases_ds.models.operator_model import one_layer_ops, plan_ops
from oases_ds.models.ops import CommOp, Op, moves_bytes
from oases_ds.parallel.link import LinkModel
from oases_ds.planner.costmodel import OpCosts, SimResult, issue_ms_hiding, simulate_step
from oases_ds.planner.costs import PASS_LETTERS, CostTable, OpTimes, reshard_collective
from oases_ds.planner.objective import check_plan_fits_table, fits_memory, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.schedule.costed_merge import HopCosts, hop_costs_from
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
    """Whether ``table`` knows its model family and holds a per-op profile at every degree
    (profiled and analytic tables do; a hand-made one may not)."""
    return table.family is not None and all(degree in table.op_profile for degree in table.degrees)


def _one_layer_index(family: str, sequence_parallel: bool = False) -> dict[str, int]:
    """Op name (layer prefix as ``L0.``) -> its index in the profiled one-layer sequence."""
    return {op.name: i for i, op in enumerate(one_layer_ops(family, sequence_parallel))}


def _checked_family(table: CostTable) -> str:
    if not can_replay(table):
        raise ValueError(f"table {table.key()} has no per-op profile at every degree (op_profile) or no model family "
                         f"to replay; price it with predict_step_ms, or profile it again (cost=profile)")
    assert table.family is not None
    return table.family


def block_scales(table: CostTable) -> dict[tuple[int, str, str], float]:
    """``(degree, block kind, pass letter F/R/B) -> factor`` that takes rank 0's per-op times of the
    block to the slowest rank's block time (:attr:`~oases_ds.planner.costs.DegreeProfile.block_ms`);
    1 where either side is missing or zero."""
    ops = one_layer_ops(_checked_family(table), table.sequence_parallel)
    scales: dict[tuple[int, str, str], float] = {}
    for degree in table.degrees:
        profile = table.op_profile[degree]
        for kind, timing in profile.block_ms.items():
            members = [i for i, op in enumerate(ops) if op.block == kind and not isinstance(op, CommOp)]
            for letter in PASS_LETTERS:
                measured = profile.op_ms.of_pass(letter)
                rank0 = table.sub_batches * sum(measured.get(i, 0.0) for i in members)
                slowest = timing.of_pass(letter)
                scales[(degree, kind, letter)] = slowest / rank0 if rank0 > 0 and slowest > 0 else 1.0
    return scales


_FrozenTimes = tuple[tuple[tuple[int, float], ...], ...]


def _frozen(times: OpTimes) -> _FrozenTimes:
    """``times`` as a hashable value (the memo's key)."""
    return tuple(tuple(sorted(times.of_pass(letter).items())) for letter in PASS_LETTERS)


def collective_issue_ms(table: CostTable) -> dict[int, float]:
    """Per group size, the host time one collective spends on the compute lane as it is issued.

    The table's :attr:`~CostTable.collective_overhead_ms` is what one collective added to the
    profiled one-layer step at that degree, charged in full.  Replayed the way the step ran, part
    of it hides behind the link; so the issue time is the one that, placed on the compute lane of
    that same one-layer replay (the profiler's per-op times at the degree, its payload, its link),
    adds the measured total back (:func:`~oases_ds.planner.costmodel.issue_ms_hiding`).  A degree
    without a profile keeps its per-collective overhead as the issue time.  Memoised on those
    inputs (a search per degree): every plan priced on a table needs it, and a study pricing
    stored profiles prices each hundreds of times.
    """
    family = _checked_family(table)
    per_degree = []
    for degree, overhead in sorted(table.collective_overhead_ms.items()):
        profile = table.op_profile.get(degree)
        if overhead <= 0 or profile is None:
            per_degree.append((degree, overhead, None, None))
        else:
            per_degree.append((degree, overhead, _frozen(profile.op_ms), profile.payload_bytes))
    return dict(_issue_ms(family, table.sequence_parallel, table.schedule, table.bandwidth_gbps, table.latency_us,
                          tuple(per_degree)))


@functools.lru_cache(maxsize=512)
def _issue_ms(family: str, sequence_parallel: bool, schedule: ScheduleSpec, bandwidth_gbps: float, latency_us: float,
              per_degree: tuple[tuple[int, float, _FrozenTimes | None, int | None], ...]
              ) -> tuple[tuple[int, float], ...]:
    """:func:`collective_issue_ms` on hashable inputs: per degree (degree, overhead, op times, payload)."""
    ops = one_layer_ops(family, sequence_parallel)
    program = build_schedule(schedule, ops)
    link = LinkModel(bandwidth_gbps, latency_us)
    issue = []
    for degree, overhead, frozen, payload in per_degree:
        if frozen is None or payload is None:
            issue.append((degree, overhead))
            continue
        costs = OpCosts.from_profile(ops, OpTimes(*(dict(items) for items in frozen)), payload, degree)
        issue.append((degree, issue_ms_hiding(program, ops, costs, link, degree, overhead)))
    return tuple(issue)


def _op_costs(table: CostTable, ops: Sequence[Op], degrees: Sequence[int], plan_label: object) -> OpCosts:
    """The simulator's inputs for ``ops`` at ``degrees`` (module doc): each op's profiled times,
    scaled to the slowest rank, each collective's payload, a reshard's AllGather."""
    family = _checked_family(table)
    index = _one_layer_index(family, table.sequence_parallel)
    scales = block_scales(table)
    forward: dict[int, float] = {}
    backward: dict[int, float] = {}
    recompute: dict[int, float] = {}
    comm_bytes: dict[int, int] = {}
    ranks: dict[int, int] = {}
    kind: dict[int, str] = {}
    for i, (op, degree) in enumerate(zip(ops, degrees)):
        if isinstance(op, CommOp) and "all_gather" in (op.forward, op.backward) and op.dim == 0:  # a reshard (plan_ops)
            gathered, ranks[i] = reshard_collective(table, degrees[i - 1], degree)
            comm_bytes[i], kind[i] = int(gathered), "all_gather"
            continue
        source = index.get(_LAYER_PREFIX.sub("L0.", op.name))
        if source is None:
            raise ValueError(f"op {op.name} of plan {plan_label} is not in the profiled one-layer model")
        profile = table.op_profile[degree]
        for letter, into in (("F", forward), ("B", backward), ("R", recompute)):
            measured = profile.op_ms.of_pass(letter)
            if source in measured:
                into[i] = measured[source] * scales.get((degree, op.block, letter), 1.0)
        if isinstance(op, CommOp) and degree > 1:
            comm_bytes[i], ranks[i] = profile.payload_bytes, degree
            if table.sequence_parallel:  # a ReduceScatter or an AllGather of the payload: (t-1)/t of it on a ring
                kind[i] = "all_gather"
    return OpCosts(forward_ms=forward, backward_ms=backward, recompute_ms=recompute, comm_bytes=comm_bytes,
                   ranks=ranks, kind=kind, default_ranks=table.devices)


def hop_costs_of(table: CostTable) -> HopCosts | None:
    """The per-op times a sequence-parallel plan on ``table`` orders its hops by
    (:mod:`oases_ds.schedule.costed_merge`), as the replay prices them: every op of the one-layer
    sequence at the full degree (the only one under sequence parallelism), each collective's link
    time and host issue time.  ``None`` without sequence parallelism (nothing hops there) or
    without a per-op profile."""
    if not table.sequence_parallel or not can_replay(table) or table.devices not in table.op_profile:
        return None
    ops = one_layer_ops(_checked_family(table), True)
    costs = _op_costs(table, ops, [table.devices] * len(ops), "one layer")
    link = LinkModel(table.bandwidth_gbps, table.latency_us)
    link_ms = {i: link.seconds(costs.kind.get(i, "all_reduce"), nbytes, costs.ranks.get(i, table.devices)) * 1e3
               for i, nbytes in costs.comm_bytes.items()}
    issue = collective_issue_ms(table).get(table.devices, 0.0)
    return hop_costs_from(ops, costs.forward_ms, costs.recompute_ms, costs.backward_ms, link_ms, issue)


def replay_plan(table: CostTable, plan: Plan, overhead: bool = True) -> PlanReplay:
    """Replay ``plan``'s step under the table's schedule from its per-op profile (module doc), in the
    order its run builds: under sequence parallelism, hops ordered by the times the plan carries
    (:attr:`Plan.hop_costs`, :func:`hop_costs_of` for plans the planner makes), time-blind without them.

    ``overhead=False`` leaves out the per-collective overhead: the ablation the
    accuracy check reports beside the score.
    """
    family = _checked_family(table)
    check_plan_fits_table(table, plan)
    # under sequence parallelism every block at the full degree; its collectives along the sequence
    ops, degrees = plan_ops(family, plan.attn_degrees, plan.mlp_degrees, table.devices, table.sequence_parallel)
    costs = _op_costs(table, ops, degrees, plan.block_degrees())
    program = build_schedule(dataclasses.replace(table.schedule, stored_blocks=plan.stored_blocks(),
                                                 gathered_blocks=plan.gathered_blocks(), hop_costs=plan.hop_costs), ops)
    issue = collective_issue_ms(table) if overhead else {}
    sim = simulate_step(program, ops, costs, LinkModel(table.bandwidth_gbps, table.latency_us), issue_ms=issue)
    comm_bytes, ranks = costs.comm_bytes, costs.ranks
    issued = [ranks[ins.op] for ins in program.instructions
              if isinstance(ins, StartAsync) and comm_bytes.get(ins.op) and moves_bytes(ops[ins.op], ins.phase)]
    grad = sum(table.blocks[k][d].grad_sync_ms for k, d in zip(table.block_kinds(), plan.block_degrees()))
    waits: dict[str, float] = {}
    for event in sim.events:
        if event.lane == "wait":
            waits[event.name] = waits.get(event.name, 0.0) + event.end_ms - event.start_ms
    return PlanReplay(simulated_ms=sim.step_ms, exposed_comm_ms=sim.exposed_comm_ms, overhead_ms=sim.issue_ms,
                      grad_sync_ms=grad, collectives=len(issued), waits_ms=waits)


def simulate_profiled_layer(table: CostTable, degree: int, link: LinkModel) -> SimResult:
    """Predict the profiled one-layer step at ``degree`` on another link ("what if 10 GbE"): the
    profile's per-op compute and collective payload replayed over the table's schedule; only the
    link changes (no scaling, no issue time: the layer as rank 0 ran it)."""
    family = _checked_family(table)
    ops = one_layer_ops(family, table.sequence_parallel)
    profile = table.op_profile[degree] if degree in table.op_profile else None
    if profile is None:
        raise ValueError(f"table {table.key()} has no profile at degree {degree}; it has {sorted(table.op_profile)}")
    costs = OpCosts.from_profile(ops, profile.op_ms, profile.payload_bytes, degree)
    return simulate_step(build_schedule(table.schedule, ops), ops, costs, link)


def rank_by_replay(table: CostTable, solved: Plan,
                   memory_limit_bytes: float | None) -> tuple[Plan, list[tuple[Plan, float]]]:
    """The fastest by replay of the solver's plan and the uniform plans that fit, and every
    (plan, replayed ms) considered, fastest first.

    Why: the solvers search the additive costs, which misprice mixes of degrees (module
    doc); replaying a whole 128-layer plan is too slow to search with, but cheap for the
    few plans a user would otherwise compare by hand.  The returned plan carries its
    replayed step as ``predicted_step_ms`` and ``"<solver>+replay"`` as its solver when
    a uniform plan beat the solver's."""
    blocks = 2 * table.layers
    candidates = [solved] + [Plan.uniform(table.devices, table.layers, d) for d in table.degrees]
    if "store" in table.policies:  # and every degree with every block stored
        candidates += [Plan.from_block_degrees([d] * blocks, table.devices, ["store"] * blocks, solver_name="uniform")
                       for d in table.degrees]
    hop = hop_costs_of(table)  # each candidate priced as it would run: with the times the chosen one carries
    candidates = [dataclasses.replace(plan, hop_costs=hop) for plan in candidates]
    seen: set[tuple] = set()
    priced: list[tuple[Plan, float]] = []
    for plan in candidates:
        key = (tuple(plan.block_degrees()), tuple(plan.block_policies()))
        if key in seen or not fits_memory(predict_memory_bytes(table, plan), memory_limit_bytes):
            continue
        seen.add(key)
        priced.append((plan, replay_plan(table, plan).step_ms))
    priced.sort(key=lambda pair: pair[1])
    best, ms = priced[0]
    same = (best.block_degrees(), best.block_policies()) == (solved.block_degrees(), solved.block_policies())
    chosen = Plan.from_block_degrees(best.block_degrees(), table.devices, best.block_policies(), predicted_step_ms=ms,
                                     solver_ms=solved.solver_ms,
                                     solver_name=solved.solver_name if same else f"{solved.solver_name}+replay",
                                     memory_bytes=predict_memory_bytes(table, best), table_key=solved.table_key,
                                     hop_costs=hop)
    return chosen, priced


def replayed_or_additive(table: CostTable, plans: Sequence[Plan]) -> list[float]:
    """Each plan's predicted step: replayed where the table can be (:func:`can_replay`), else
    the additive objective (:func:`~oases_ds.planner.objective.predict_step_ms`)."""
    if not can_replay(table):
        return [predict_step_ms(table, plan) for plan in plans]
    return [replay_plan(table, plan).step_ms for plan in plans]
