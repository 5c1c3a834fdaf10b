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
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.link import LinkModel, link_from_config
from oases_ds.parallel.random import RNGTracker
from oases_ds.planner.costs import CostTable
from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.planner.replay import can_replay, replay_plan, replayed_or_additive
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.timeline import clock_for
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.utils.rounds import rotated

if TYPE_CHECKING:
    from oases_ds.planner.profile import ProfileSpec


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
        ``devices`` ranks: ``oases-plan mode=accuracy`` and ``benchmarks/replay_breakdown.py`` measure alike."""
        return cls(model=dataclasses.replace(ModelConfig(**cfg["model"]), num_layers=layers), devices=devices,
                   micro_batch=cfg["micro_batch"], schedule=ScheduleSpec.from_mapping(cfg["schedule"]),
                   link=link_from_config(cfg["cluster"].get("link")), warmup=warmup, repeats=repeats)


def step_breakdown(events: list[Any], own_ms: float) -> dict[str, Any]:
    """One rank's step from its timeline: ``compute_ms`` (compute lane), ``waits_ms`` per Sync
    (``W<op>.<sub>``, ``Wb...``: time blocked on a collective) and ``rest_ms``, the rank's own
    wall time outside both (gradient sync after the schedule, issuing collectives, the host)."""
    compute = sum(e.end - e.start for e in events if e.lane == "compute") * 1e3
    waits: dict[str, float] = {}
    for e in events:
        if e.lane == "wait":
            waits[e.name] = waits.get(e.name, 0.0) + (e.end - e.start) * 1e3
    return {"own_ms": own_ms, "compute_ms": compute, "waits_ms": waits,
            "rest_ms": own_ms - compute - sum(waits.values())}


def _measure_rank(spec: AccuracySpec, plans: list[Plan], record: bool = False,
                  profile: ProfileSpec | None = None) -> list[list[Any]] | dict[str, Any]:
    """Per plan, this rank's timed steps: the step in ms (slowest rank), or with ``record`` each
    step's :func:`step_breakdown` with the step added as ``step_ms``.  With ``profile``, that
    profile's degrees are stepped in the same rounds as the plans, in the same rotation
    (:class:`~oases_ds.planner.profile.ProfileSteps`), and the rank returns ``{"times": ...,
    "profile": <its profile measurements>}``."""
    from oases_ds.planner.profile import ProfileSteps  # profile.py imports this module

    ctx, batch, runners = plan_runners(spec, plans, record)
    steps = ProfileSteps(profile, ctx) if profile is not None else None
    items = len(runners) + (len(steps) if steps is not None else 0)
    times: list[list[Any]] = [[] for _ in plans]
    for rnd in range(spec.warmup + spec.repeats):
        for i in round_order(items, rnd):
            if i >= len(runners):
                steps.step(i - len(runners), timed=rnd >= spec.warmup)
                continue
            ex = runners[i]
            own_ms, step_ms = plan_step_ms(ctx, ex, batch)
            if rnd >= spec.warmup:
                times[i].append({**step_breakdown(ex.timeline.events, own_ms), "step_ms": step_ms} if record else step_ms)
    return times if steps is None else {"times": times, "profile": steps.result()}


def plan_runners(spec: AccuracySpec, plans: list[Plan], record: bool = False
                 ) -> tuple[ParallelContext, dict[str, torch.Tensor], list[Executor]]:
    """This rank's side of a measurement: the TMP context, the seeded batch every plan steps on, and one
    executor per plan, on the rank's device as the profiler places its layers (collective: every rank
    builds them in the same order)."""
    ctx = ParallelContext.build(tensor_parallel_size=spec.devices, timeout_s=600)
    gen = torch.Generator().manual_seed(spec.seed)
    seq = torch.randint(0, spec.model.vocab_size, (spec.micro_batch, spec.model.seq_len + 1), generator=gen).to(ctx.device)
    batch = {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
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


def round_order(plans: int, rnd: int) -> list[int]:
    """Indices of the things measured side by side (plans here, degrees in the profiler) in
    the order round ``rnd`` runs them (:func:`~oases_ds.utils.rounds.rotated`)."""
    return rotated(range(plans), rnd)


def measure(spec: AccuracySpec, plans: list[Plan], timeout_s: float = 1800) -> list[list[float]]:
    """Per plan, the measured step times in ms (slowest rank of each step)."""
    return launch(_measure_rank, spec.devices, (spec, plans), timeout_s=timeout_s)[0]


def measure_with_profile(spec: AccuracySpec, plans: list[Plan], profile: ProfileSpec,
                         timeout_s: float = 1800) -> tuple[list[list[float]], CostTable]:
    """:func:`measure`, with ``profile``'s one-layer degrees stepped in the same interleaved rounds;
    returns the plans' steps and the cost table of that interleaved profile (labelled for the plans'
    layers).  The table has seen the machine the plans ran on, moment for moment: the accuracy study
    scores it beside the profile the planner took before (``accuracy.interleave_profile``)."""
    from oases_ds.planner.profile import table_from_measurements

    started = time.perf_counter()
    per_rank = launch(_measure_rank, spec.devices, (spec, plans, False, profile), timeout_s=timeout_s)
    table = table_from_measurements(profile, [r["profile"] for r in per_rank], spec.model.num_layers,
                                    wall_s=time.perf_counter() - started)
    table.measurements["interleaved_with"] = (
        f"one step per degree in each of the accuracy study's {spec.warmup} warm-up + {spec.repeats} timed rounds of "
        f"{len(plans)} plans; AllReduces and gradient syncs timed after, over the profile's warm-up + repeats")
    return per_rank[0]["times"], table


def measure_breakdown(spec: AccuracySpec, plans: list[Plan], timeout_s: float = 1800) -> list[list[list[dict[str, Any]]]]:
    """Per rank, per plan, each timed step's :func:`step_breakdown` (the same interleaved rounds as
    :func:`measure`, with timelines kept): where a measured step and its replay part
    (``benchmarks/replay_breakdown.py``)."""
    return launch(_measure_rank, spec.devices, (spec, plans, True), timeout_s=timeout_s)


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


def without_overhead(table: CostTable) -> CostTable:
    """``table`` with no collective overhead (the v4 term; with v6 tables, the link model alone):
    the ablation that shows, on the same measured steps, what that term changed."""
    blocks = {kind: {d: dataclasses.replace(c, overhead_ms=0.0) for d, c in by.items()} for kind, by in table.blocks.items()}
    return dataclasses.replace(table, blocks=blocks, collective_overhead_ms={})


def report(table: CostTable, plans: list[Plan], times: list[list[float]]) -> dict[str, Any]:
    """Per plan its predicted and measured step, and the rank correlations between them.

    ``predicted_ms`` is the plan's replayed step (:func:`~oases_ds.planner.replay.replay_plan`,
    cost model 7, scaled in 8, overhead on the compute lane in 9) where ``family`` and ``schedule`` are given and the table holds per-op times,
    else the additive objective.  Beside it, on the same measured steps: the additive objective
    the solvers search (``predicted_additive_ms``, ``spearman_additive``) and the prediction
    without the per-collective overhead (``predicted_without_overhead_ms``)."""
    rows = []
    replayed = can_replay(table)
    ablated = None if replayed else without_overhead(table)
    for plan, t in zip(plans, times):
        additive = predict_step_ms(table, plan)
        if replayed:  # the overhead is host time inside the simulation (cost model 9): replay without it
            predicted = replay_plan(table, plan).step_ms
            plain = replay_plan(table, plan, overhead=False).step_ms
        else:
            predicted, plain = additive, predict_step_ms(ablated, plan)
        rows.append({
            "attn": list(plan.attn_degrees), "mlp": list(plan.mlp_degrees), "solver": plan.solver_name,
            "predicted_ms": predicted, "measured_ms": statistics.median(t),
            "min_ms": min(t), "max_ms": max(t), "times_ms": list(t),
            "predicted_without_overhead_ms": plain, "predicted_additive_ms": additive,
        })
    measured = [r["measured_ms"] for r in rows]
    rho, p = spearman([r["predicted_ms"] for r in rows], measured)
    rho_mixed, mixed = mixed_spearman(rows)
    out = {"rows": rows, "pricing": "replay" if replayed else "additive", "spearman": rho, "p_value": p,
           "spearman_mixed": rho_mixed, "mixed_plans": mixed}
    for name, column in (("without_overhead", "predicted_without_overhead_ms"), ("additive", "predicted_additive_ms")):
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


# -- out-of-sample summary ----------------------------------------------------------
TARGET_SPEARMAN = 0.9
"""What each out-of-sample setup should reach (issue 12): above the paper's 0.844 / 0.876."""


@dataclass(frozen=True)
class Setup:
    """One setup the cost model is scored on without being tuned on it.

    Attributes:
        name: short label; names the result file ``planner_accuracy-<name>.json``.
        differs: what differs from the setup cost model v2 was tuned on, for the report.
        overrides: ``oases-plan experiment=cost_model`` overrides that make the setup.
        mixed_only: score the plans that mix degrees only (:func:`mixed_spearman`).
    """

    name: str
    differs: str
    overrides: tuple[str, ...]
    mixed_only: bool = False


def setup_score(setup: Setup, result: dict[str, Any]) -> tuple[float | None, int]:
    """(rho, plans scored) of one setup's result, over the plans the setup scores."""
    if setup.mixed_only:
        return result.get("spearman_mixed"), result.get("mixed_plans", 0)
    return result["spearman"], len(result["rows"])


def scored_rows(setup: Setup, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result rows ``setup`` ranks: the mixed-degree plans for a ``mixed_only`` setup, else all."""
    return [r for r in result["rows"] if is_mixed(r)] if setup.mixed_only else list(result["rows"])


def plan_of_row(row: dict[str, Any], devices: int) -> Plan:
    """The plan a result row measured (its per-layer attention and MLP degrees)."""
    return Plan(attn_degrees=tuple(row["attn"]), mlp_degrees=tuple(row["mlp"]), devices=devices)


def repriced_spearman(setup: Setup, result: dict[str, Any], table: CostTable) -> float | None:
    """Spearman of ``setup``'s scored rows, their measured steps against ``table``'s predictions
    (replayed as the run's own :func:`report` would, from the model and schedule in its ``config``).

    Why: a setup's score depends on two measurements, the plans' steps and the profile that
    priced them.  The profile is a few seconds of steps, so one taken in a bad moment moves
    every prediction at once; pricing the same measured steps with profiles taken at other
    times separates the model's error from that profile's (``benchmarks/cost_model_oos.py
    --reprofile``).  ``None`` under :data:`MIN_RANKED` plans."""
    rows = scored_rows(setup, result)
    if len(rows) < MIN_RANKED:
        return None
    predicted = replayed_or_additive(table, [plan_of_row(r, table.devices) for r in rows])
    return spearman(predicted, [r["measured_ms"] for r in rows])[0]


def reprofiled_range(result: dict[str, Any]) -> dict[int, tuple[float, float, float, int]]:
    """Per cost model version, (min, median, max, count) of the Spearmans a result was
    re-scored with from fresh profiles (``result["reprofiled"]``); empty when it has none.
    By version: a run measured once can be priced again by a later model, and the two
    must not be pooled."""
    scores: dict[int, list[float]] = {}
    for entry in result.get("reprofiled", []):
        if entry.get("spearman") is not None:
            scores.setdefault(int(entry.get("cost_model", 0)), []).append(entry["spearman"])
    return {version: (min(v), statistics.median(v), max(v), len(v)) for version, v in sorted(scores.items())}


def top_pick_regret(rows: list[dict[str, Any]]) -> float | None:
    """Measured step of the plan the model ranks first over the best measured step among ``rows``
    (1.0: the model's pick is the fastest plan measured).  What a planner's choice costs, where a
    rank correlation over near-tied plans says little; ``None`` without plans."""
    if not rows:
        return None
    pick = min(rows, key=lambda r: r["predicted_ms"])
    return pick["measured_ms"] / min(r["measured_ms"] for r in rows)


def summary_markdown(entries: list[tuple[Setup, str, dict[str, Any] | None]], note: str) -> str:
    """The out-of-sample report: per setup its Spearman against :data:`TARGET_SPEARMAN`,
    computed from each ``(setup, result path, result or None when missing)``."""
    md = ["# Cost-model accuracy out of sample", "",
          "Cost model v2 was tuned on gpt_small, T=2, an EMULATED 0.2 Gbit/s link (`in_sample`). v4 adds each",
          "collective's measured overhead, a term with no fitted constant (the profiler measures it in every setup),",
          "chosen after looking at `in_sample` and `link_1g`; v6 prices a block's collectives at the link model's time,",
          "as the fixed cost of the measured AllReduce is already in that overhead; v7 prices a whole plan by replaying",
          "its schedule over the profile's per-op times (`oases_ds/planner/replay.py`), where v6 summed per-block",
          "node and edge costs; v8 scales the replay's per-op times to the slowest rank's block times (the version is",
          "the `|cm<n>` of each setup's table key below; fresh profiles name their own). The other setups change",
          f"one thing each and were not looked at to build the model. Target: Spearman >= {TARGET_SPEARMAN} in each.",
          "*Without overhead* scores the same measured steps against the predictions with the v4 term removed;",
          "*additive*, against the per-block sum the solvers search (v6's prediction, from the same profile). *Measurement* is",
          "the Spearman of the plans' medians over the even rounds against the odd rounds: how well the measurement",
          "ranks the plans by itself. *Top pick*: the measured step of the plan the model ranks first over the",
          "fastest measured step among the scored plans (1.000: the planner would have chosen the fastest).",
          "*Fresh profiles*: the same measured steps priced by profiles taken again after the run (per cost model",
          "version, min / median / max over them, count in brackets; `--reprofile`): how much of the score is the one",
          "profile the run took. *Interleaved profile*: the same measured steps priced by a profile whose one-layer",
          "steps ran in the measurement's own rounds (`accuracy.interleave_profile`): it saw the machine the plans ran on.", "",
          note, "",
          "| setup | differs from the tuning setup | plans scored | Spearman | p | target met | without overhead "
          "| additive | measurement | top pick | fresh profiles | interleaved profile | result |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setup, path, result in entries:
        if result is None:
            md.append(f"| {setup.name} | {setup.differs} | - | not run | - | - | - | - | - | - | - | - | `{path}` missing |")
            continue
        regret = top_pick_regret(scored_rows(setup, result))
        rho, scored = setup_score(setup, result)
        p = "-" if setup.mixed_only else f"{result['p_value']:.2g}"
        which = f"{scored} mixed of {len(result['rows'])}" if setup.mixed_only else str(scored)
        met = "-" if rho is None else ("yes" if rho >= TARGET_SPEARMAN else "**no**")
        rho_text = "too few plans" if rho is None else f"{rho:.3f}"
        suffix = "_mixed" if setup.mixed_only else ""
        half, plain = result.get("split_half_spearman" + suffix), result.get("spearman_without_overhead" + suffix)
        additive = result.get("spearman_additive" + suffix) if result.get("pricing") == "replay" else None
        half_text, plain_text, additive_text = ("-" if v is None else f"{v:.3f}" for v in (half, plain, additive))
        regret_text = "-" if regret is None else f"{regret:.3f}"
        fresh_text = "; ".join(f"v{version}: {lo:.3f} / {mid:.3f} / {hi:.3f} ({n})"
                               for version, (lo, mid, hi, n) in reprofiled_range(result).items()) or "-"
        interleaved = result.get("interleaved", {}).get("spearman" + suffix)
        interleaved_text = "-" if interleaved is None else f"{interleaved:.3f}"
        md.append(f"| {setup.name} | {setup.differs} | {which} | {rho_text} | {p} | {met} | {plain_text} | {additive_text} | {half_text} "
                  f"| {regret_text} | {fresh_text} | {interleaved_text} | `{path}` |")
    md += ["", "Per setup: `oases-plan experiment=cost_model <overrides>`; overrides, machine, git commit and",
           "settings are in each result file (`config`, `machine`, `git_commit`)."]
    for setup, path, result in entries:
        if result is None:
            continue
        m, acc = result.get("machine", {}), result.get("config", {}).get("accuracy", {})
        md += ["", f"## {setup.name}", "",
               f"- overrides: `{' '.join(setup.overrides) or '(none)'}`; table `{result.get('table_key')}`",
               f"- measured {result.get('time')} on {m.get('cpu_count')} CPUs, git {str(result.get('git_commit'))[:10]}; "
               f"{acc.get('warmup')} warm-up + {acc.get('repeats')} timed rounds",
               "", "| attn | mlp | predicted ms | measured ms | measured / predicted |", "|---|---|---|---|---|"]
        for r in sorted(result["rows"], key=lambda r: r["predicted_ms"]):
            md.append(f"| {','.join(map(str, r['attn']))} | {','.join(map(str, r['mlp']))} | {r['predicted_ms']:.1f} | "
                      f"{r['measured_ms']:.1f} | {r['measured_ms'] / r['predicted_ms']:.3f} |")
    return "\n".join(md) + "\n"
