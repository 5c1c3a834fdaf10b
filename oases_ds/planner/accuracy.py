"""Does the cost model rank plans the way the machine does?  (Paper Fig. 9.)

The planner only needs the *order* of plans to be right, so the check is a
Spearman rank correlation between predicted and measured step times over a set
of different plans: every uniform degree, the solver's plan, and seeded random
per-block mixes.  Measured: the real executor on ``T`` rank processes with the
plan's heterogeneous layout, the plans run interleaved (one step each, round
robin) so machine noise hits them alike; the median step is kept.  Measured
steps include the embedding and head, which every plan shares; a constant does
not change a rank correlation.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.link import LinkModel
from oases_ds.parallel.random import RNGTracker
from oases_ds.planner.costs import CostTable
from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec


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


def _measure_rank(spec: AccuracySpec, plans: list[Plan]) -> list[list[float]]:
    ctx = ParallelContext.build(tensor_parallel_size=spec.devices, timeout_s=600)
    gen = torch.Generator().manual_seed(spec.seed)
    seq = torch.randint(0, spec.model.vocab_size, (spec.micro_batch, spec.model.seq_len + 1), generator=gen)
    batch = {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
    runners = []
    for plan in plans:
        model = OperatorModel.for_plan(spec.model, ctx, plan, seed=spec.seed)
        runners.append(Executor.for_schedule(model, spec.schedule, spec.link, RNGTracker(), record=False))
    times: list[list[float]] = [[] for _ in plans]
    for rnd in range(spec.warmup + spec.repeats):
        for i, ex in enumerate(runners):
            for p in ex.model.parameters():
                p.grad = None
            dist.barrier(ctx.tp_group)
            start = time.perf_counter()
            ex.run(batch)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=ctx.tp_group)  # the slowest rank sets the step
            if rnd >= spec.warmup:
                times[i].append(float(elapsed) * 1e3)
    return times


def measure(spec: AccuracySpec, plans: list[Plan], timeout_s: float = 1800) -> list[list[float]]:
    """Per plan, the measured step times in ms (slowest rank of each step)."""
    return launch(_measure_rank, spec.devices, (spec, plans), timeout_s=timeout_s)[0]


def spearman(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """(rho, p-value); p is scipy's two-sided test of no correlation."""
    from scipy.stats import spearmanr  # local: a heavy import only the accuracy study needs

    result = spearmanr(predicted, measured)
    return float(result.statistic), float(result.pvalue)


def report(table: CostTable, plans: list[Plan], times: list[list[float]]) -> dict[str, Any]:
    rows = []
    for plan, t in zip(plans, times):
        rows.append({
            "attn": list(plan.attn_degrees), "mlp": list(plan.mlp_degrees), "solver": plan.solver_name,
            "predicted_ms": predict_step_ms(table, plan), "measured_ms": statistics.median(t),
            "min_ms": min(t), "max_ms": max(t),
        })
    rho, p = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    return {"rows": rows, "spearman": rho, "p_value": p}
