"""Does the cost model rank plans the way the machine does?  (Paper Fig. 9.)

The planner only needs the *order* of plans to be right, so the check is a
Spearman rank correlation between predicted and measured step times over a set
of different plans: every uniform degree, the solver's plan, and seeded random
per-block mixes.  Measured: the real executor on ``T`` rank processes with the
plan's heterogeneous layout, the plans run interleaved (one step each, round
robin, each round starting one plan later, so no plan keeps one position in
the round) so machine noise hits them alike; the median step is kept.  Whether the
measurement itself can rank the plans is reported beside the model's score: the
Spearman between the medians of the odd and of the even rounds
(:func:`split_half_spearman`).  Measured
steps include the embedding and head, which every plan shares; a constant does
not change a rank correlation.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from oases_ds.data.batches import synthetic_batch
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.link import LinkModel, link_from_config
from oases_ds.parallel.random import RNGTracker
from oases_ds.planner.costs import CostTable
from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.planner.profile import ProfileSpec, ProfileSteps, table_from_measurements
from oases_ds.planner.replay import can_replay, replay_plan, replayed_or_additive
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.timeline import clock_for
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.utils.rounds import rotated


def candidate_plans(table: CostTable, count: int, extra: list[Plan], seed: int = 0) -> list[Plan]:
    """Uniform plans at every degree, then ``extra`` (e.g. the solver's), then random
    distinct per-block mixes until ``count`` plans (fewer if the space is smaller)."""
    plans: list[Plan] = [Plan.uniform(table.devices, table.layers, d) for d in table.degrees]
    seen = {p.block_degrees().__repr__() for p in plans}
    for plan in extra:
        key = repr(plan.block_degrees())
        if key not in seen:
            seen.add(key)
            plans.append(plan)
    rng = random.Random(seed)
    space = len(table.degrees) ** (2 * table.layers)
    while len(plans) < min(count, space):
        blocks = [rng.choice(table.degrees) for _ in range(2 * table.layers)]
        if repr(blocks) not in seen:
            seen.add(repr(blocks))
            plans.append(Plan.from_block_degrees(blocks, table.devices))
    return plans


@dataclass(frozen=True)
class AccuracySpec:
    """What to measure: the model (with ``num_layers`` = the table's), devices, batch,
    schedule, link (emulated if set), warm-up and measured rounds."""

    model: ModelConfig
    devices: int
    micro_batch: int
    schedule: ScheduleSpec
    link: LinkModel | None
    warmup: int = 2
    repeats: int = 5
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any], layers: int, devices: int, warmup: int, repeats: int) -> AccuracySpec:
        """The measurement an ``oases-plan`` config describes (``model``, ``micro_batch``, ``schedule``,
        ``cluster.link``; a result file keeps it as ``config``), for a ``layers``-layer model on
        ``devices`` ranks: ``oases-plan mode=accuracy`` and the cost-model study's breakdown measure alike."""
        return cls(model=dataclasses.replace(ModelConfig(**cfg["model"]), num_layers=layers), devices=devices,
                   micro_batch=cfg["micro_batch"], schedule=ScheduleSpec.from_mapping(cfg["schedule"]),
                   link=link_from_config(cfg["cluster"].get("link")), warmup=warmup, repeats=repeats)


def measure_rank(spec: AccuracySpec, plans: list[Plan], profile: ProfileSpec | None = None,
                 keep: Callable[[Executor, float, float], Any] | None = None) -> list[list[Any]] | dict[str, Any]:
    """This rank's side of a measurement: per plan, what is kept of each timed step -- the slowest rank's
    step in ms, or ``keep(executor, own ms, slowest ms)`` (the executors then record their timelines).
    With ``profile``, that profile's degrees are stepped in the same rounds as the plans, in the same
    rotation (:class:`~oases_ds.planner.profile.ProfileSteps`), and the rank returns ``{"times": ...,
    "profile": <its profile measurements>}``.  ``keep`` is a module-level function: it travels to the
    rank processes."""
    ctx, batch, runners = plan_runners(spec, plans, record=keep is not None)
    steps = ProfileSteps(profile, ctx) if profile is not None else None
    items = len(runners) + (len(steps) if steps is not None else 0)
    times: list[list[Any]] = [[] for _ in plans]
    for rnd in range(spec.warmup + spec.repeats):
        for i in rotated(range(items), rnd):
            if i >= len(runners):
                steps.step(i - len(runners), timed=rnd >= spec.warmup)
                continue
            ex = runners[i]
            own_ms, step_ms = plan_step_ms(ctx, ex, batch)
            if rnd >= spec.warmup:
                times[i].append(step_ms if keep is None else keep(ex, own_ms, step_ms))
    return times if steps is None else {"times": times, "profile": steps.result()}


def plan_runners(spec: AccuracySpec, plans: list[Plan], record: bool = False
                 ) -> tuple[ParallelContext, dict[str, torch.Tensor], list[Executor]]:
    """This rank's side of a measurement: the TMP context, the seeded batch every plan steps on, and one
    executor per plan, on the rank's device as the profiler places its layers (collective: every rank
    builds them in the same order)."""
    ctx = ParallelContext.build(tensor_parallel_size=spec.devices, timeout_s=600)
    batch = synthetic_batch(spec.model.vocab_size, spec.micro_batch, spec.model.seq_len, spec.seed, ctx.device)
    runners = [Executor.for_schedule(OperatorModel.for_plan(spec.model, ctx, plan, seed=spec.seed).to(ctx.device),
                                     spec.schedule, spec.link, RNGTracker(), record=record) for plan in plans]
    return ctx, batch, runners


def timed_step(ctx: ParallelContext, run: Callable[[], None]) -> tuple[float, float]:
    """``run()`` on every rank of the TMP group, started together (a barrier); returns (this rank's ms,
    the slowest rank's ms): the slowest rank sets a TMP step.  Timed on the device's clock
    (:func:`~oases_ds.runtime.timeline.clock_for`: events on a GPU, whose kernels are still running when
    ``run`` returns) and reduced on the device (NCCL takes no CPU tensor)."""
    clock = clock_for(ctx.device)
    dist.barrier(ctx.tp_group)
    marks = [clock.mark()]
    run()
    marks.append(clock.mark())
    start, end = clock.resolve(marks)
    own = end - start
    elapsed = torch.tensor(own, device=ctx.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    return own * 1e3, float(elapsed) * 1e3


def plan_step_ms(ctx: ParallelContext, executor: Executor, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """One measured step of a plan: its gradients dropped (a training step starts without the last
    one's), then :func:`timed_step` (this rank's ms, the slowest rank's ms)."""
    for p in executor.model.parameters():
        p.grad = None
    return timed_step(ctx, functools.partial(executor.run, batch))


def measure(spec: AccuracySpec, plans: list[Plan], timeout_s: float = 1800) -> list[list[float]]:
    """Per plan, the measured step times in ms (slowest rank of each step)."""
    return launch(measure_rank, spec.devices, (spec, plans), timeout_s=timeout_s)[0]


def measure_with_profile(spec: AccuracySpec, plans: list[Plan], profile: ProfileSpec,
                         timeout_s: float = 1800) -> tuple[list[list[float]], CostTable]:
    """:func:`measure`, with ``profile``'s one-layer degrees stepped in the same interleaved rounds;
    returns the plans' steps and the cost table of that interleaved profile (labelled for the plans'
    layers).  The table has seen the machine the plans ran on, moment for moment: the accuracy study
    scores it beside the profile the planner took before (``accuracy.interleave_profile``)."""
    started = time.perf_counter()
    per_rank = launch(measure_rank, spec.devices, (spec, plans, profile), timeout_s=timeout_s)
    table = table_from_measurements(profile, [r["profile"] for r in per_rank], spec.model.num_layers,
                                    wall_s=time.perf_counter() - started)
    table.measurements["interleaved_with"] = (
        f"one step per degree in each of the accuracy study's {spec.warmup} warm-up + {spec.repeats} timed rounds of "
        f"{len(plans)} plans; AllReduces and gradient syncs timed after, over the profile's warm-up + repeats")
    return per_rank[0]["times"], table


def spearman(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """(rho, p-value); p is scipy's two-sided test of no correlation."""
    from scipy.stats import spearmanr  # local: a heavy import only the accuracy study needs

    result = spearmanr(predicted, measured)
    return float(result.statistic), float(result.pvalue)


def is_mixed(row: dict[str, Any]) -> bool:
    """Whether a result row's plan runs blocks at more than one degree."""
    return len(set(row["attn"]) | set(row["mlp"])) > 1


MIN_RANKED = 3
"""Fewest plans a rank correlation is reported over: with two, it is +-1 whatever the model."""


def mixed_spearman(rows: list[dict[str, Any]]) -> tuple[float | None, int]:
    """(rho, count) over the plans that mix degrees only; rho ``None`` under :data:`MIN_RANKED`.

    Uniform plans sit far apart, so they alone can carry a high Spearman over all plans;
    choosing *between* mixes is the planner's real job, and its harder test."""
    mixed = [r for r in rows if is_mixed(r)]
    if len(mixed) < MIN_RANKED:
        return None, len(mixed)
    return spearman([r["predicted_ms"] for r in mixed], [r["measured_ms"] for r in mixed])[0], len(mixed)


def without_overhead_ms(table: CostTable, plan: Plan) -> float:
    """The planner's price of ``plan`` without the per-collective overhead: replayed without the
    collectives' host time, or, for a table priced additively, with the overhead rows at 0."""
    if can_replay(table):
        return replay_plan(table, plan, overhead=False).step_ms
    blocks = {kind: {d: dataclasses.replace(c, overhead_ms=0.0) for d, c in by.items()} for kind, by in table.blocks.items()}
    return predict_step_ms(dataclasses.replace(table, blocks=blocks, collective_overhead_ms={}), plan)


BASELINES: dict[str, Callable[[CostTable, Plan], float]] = {
    "without_overhead": without_overhead_ms,
    "additive": predict_step_ms,
}
"""Named baselines scored beside the planner's price (:func:`~oases_ds.planner.replay.replayed_or_additive`)
on the same measured steps, each a column ``predicted_<name>_ms`` and a score ``spearman_<name>``: the
prediction without the per-collective overhead (what that term changes), and the additive per-block sum
the solvers search (what the replay changes)."""


def report(table: CostTable, plans: list[Plan], times: list[list[float]]) -> dict[str, Any]:
    """Per plan its predicted and measured step, and the rank correlations between them.

    ``predicted_ms`` is the planner's price (the replay where the table has a per-op profile, else the
    additive objective); beside it, each of :data:`BASELINES`."""
    rows = []
    for plan, t, predicted in zip(plans, times, replayed_or_additive(table, plans)):
        rows.append({
            "attn": list(plan.attn_degrees), "mlp": list(plan.mlp_degrees), "solver": plan.solver_name,
            "predicted_ms": predicted, "measured_ms": statistics.median(t),
            "min_ms": min(t), "max_ms": max(t), "times_ms": list(t),
            **{f"predicted_{name}_ms": price(table, plan) for name, price in BASELINES.items()},
        })
    measured = [r["measured_ms"] for r in rows]
    rho, p = spearman([r["predicted_ms"] for r in rows], measured)
    rho_mixed, mixed = mixed_spearman(rows)
    out = {"rows": rows, "pricing": "replay" if can_replay(table) else "additive", "spearman": rho, "p_value": p,
           "spearman_mixed": rho_mixed, "mixed_plans": mixed}
    for name in BASELINES:
        column = f"predicted_{name}_ms"
        out[f"spearman_{name}"] = spearman([r[column] for r in rows], measured)[0]
        out[f"spearman_{name}_mixed"] = mixed_spearman([{**r, "predicted_ms": r[column]} for r in rows])[0]
    out.update({
        "split_half_spearman": split_half_spearman(times),
        "split_half_spearman_mixed": split_half_spearman([t for r, t in zip(rows, times) if is_mixed(r)]),
        "cost_table": {  # the profile behind every prediction: a miss can be traced to a block and degree
            "blocks": {kind: {str(d): dataclasses.asdict(c) for d, c in by.items()} for kind, by in table.blocks.items()},
            "collective_overhead_ms": {str(k): v for k, v in table.collective_overhead_ms.items()},
            "collective_overhead": table.measurements.get("collective_overhead"),
        }})
    return out


@dataclass(frozen=True)
class AccuracyCheck:
    """What ``mode=accuracy`` measured: the plans (uniform, the solver's, seeded mixes), the
    :func:`report` of their steps (each row tagged ``is_solver_plan``), and, where a profile was
    stepped in the same rounds, that profile's table (to be kept beside the result) with
    ``result["interleaved"]`` its scores of the same steps."""

    plans: list[Plan]
    result: dict[str, Any]
    interleaved: CostTable | None = None


def check_plans(table: CostTable, solved: Plan, plans: list[Plan], spec: AccuracySpec,
                interleave: ProfileSpec | None = None, timeout_s: float = 1800) -> AccuracyCheck:
    """Measure ``plans`` for real and score ``table``'s predictions of them (:func:`report`); with
    ``interleave``, that profile's degrees are stepped in the same rounds and score the same steps too
    (``accuracy.interleave_profile``: the profile saw the machine the plans ran on)."""
    interleaved = None
    if interleave is not None:
        if not can_replay(table):
            raise ValueError("accuracy.interleave_profile=true needs a profiled table (cost=profile, no table=); "
                             "set it false to score this table alone")
        times, interleaved = measure_with_profile(spec, plans, interleave, timeout_s=timeout_s)
    else:
        times = measure(spec, plans, timeout_s=timeout_s)
    result = report(table, plans, times)
    if interleaved is not None:
        scored = report(interleaved, plans, times)
        result["interleaved"] = {"table_key": interleaved.key(), "profiled_at": interleaved.measurements.get("profiled_at"),
                                 **{k: scored[k] for k in ("spearman", "spearman_mixed", "spearman_additive",
                                                           "spearman_additive_mixed")}}
    for r in result["rows"]:
        r["is_solver_plan"] = r["attn"] == list(solved.attn_degrees) and r["mlp"] == list(solved.mlp_degrees)
    return AccuracyCheck(plans, result, interleaved)


def check_lines(checked: AccuracyCheck) -> list[str]:
    """What ``oases-plan mode=accuracy`` prints: per plan its predicted and measured step, the rank
    correlation, the solver's plan against the best uniform one measured, the interleaved profile's score."""
    result = checked.result

    def degrees(values: list[int]) -> str:
        return ",".join(str(d) for d in values)

    lines = [f"{'attn degrees':<16}{'mlp degrees':<16}{'predicted ms':>13}{'measured ms':>13}{'min-max':>18}"]
    for r in result["rows"]:
        tag = "  <- solver's plan" if r["is_solver_plan"] else ""
        lines.append(f"{degrees(r['attn']):<16}{degrees(r['mlp']):<16}{r['predicted_ms']:>13.2f}{r['measured_ms']:>13.2f}"
                     f"{r['min_ms']:>9.1f}-{r['max_ms']:<8.1f}{tag}")
    best = min((r for r in result["rows"] if not is_mixed(r)), key=lambda r: r["measured_ms"])
    mine = next(r for r in result["rows"] if r["is_solver_plan"])
    lines += [f"Spearman rank correlation predicted vs measured: {result['spearman']:.3f} (p={result['p_value']:.3g}, "
              f"{len(checked.plans)} plans; paper: 0.844 / 0.876)",
              f"measured: solver plan {mine['measured_ms']:.1f} ms vs best uniform (degree {best['attn'][0]}) "
              f"{best['measured_ms']:.1f} ms -> {best['measured_ms'] / mine['measured_ms']:.3f}x"]
    entry = result.get("interleaved")
    if entry is not None:
        lines.append(f"with the profile interleaved in the same rounds ({entry.get('table', entry['table_key'])}): "
                     f"Spearman {entry['spearman']:.3f}"
                     + (f", mixes only {entry['spearman_mixed']:.3f}" if entry["spearman_mixed"] is not None else ""))
    return lines


def split_half_spearman(times: list[list[float]]) -> float | None:
    """How well the measurement ranks the plans by itself: Spearman between each plan's
    median over the even rounds and over the odd rounds.  Well below 1, the plans' medians
    differ by less than the noise, and no cost model can score high against them.
    ``None`` with fewer than :data:`MIN_RANKED` plans or 2 rounds."""
    if len(times) < MIN_RANKED or min(len(t) for t in times) < 2:
        return None
    even = [statistics.median(t[0::2]) for t in times]
    odd = [statistics.median(t[1::2]) for t in times]
    return spearman(even, odd)[0]
