"""What guard mode costs a training step: the same step with it on and off, interleaved.

Guard mode (:mod:`oases_ds.parallel.guard`) all-gathers a 256-byte signature before each
collective and waits for it, so the ranks of a group meet at every issue; the flight
recorder that is on by default appends one record per collective (and writes a ring file
where a run directory is set).  This measures both against a step that records nothing.

Each rank builds one model and three executors over it that differ only in their
:class:`~oases_ds.parallel.comm.Communicator`:

* ``off``: no records kept (``flight_records=0``), no guard;
* ``records``: the default -- the in-memory records and the ring file in a run directory;
* ``guard``: the default plus guard mode.

Rounds are interleaved (:func:`~oases_ds.utils.rounds.rotated`: each round starts with the
next variant), every step starts at a barrier, and a step's time is the slowest rank's
wall time (what a user waits for) and the process CPU time (compute and gloo threads;
preemption on this shared machine inflates wall time, not CPU time).  Quoted: per variant
the median over all timed steps, and the median over rounds of each round's ratio to
``off`` (steps of one round run within seconds of each other).

Used by ``benchmarks/guard_overhead.py``.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.flight import DEFAULT_RECORDS, RUN_DIR_ENV
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.utils.rounds import rotated

VARIANTS = ("off", "records", "guard")


def _communicator(variant: str, run_dir: str) -> Communicator:
    if variant == "off":
        return Communicator.for_run(records=0, env={})
    return Communicator.for_run(records=DEFAULT_RECORDS, check=variant == "guard", env={RUN_DIR_ENV: run_dir})


def guard_worker(model: dict[str, Any], micro_batch: int, schedule: str, rounds: int, steps: int,
                 warmup: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """One rank of the measurement (module docstring); returns, on every rank, each
    variant's per-round lists of (slowest rank's wall seconds, this rank's CPU seconds)."""
    cfg = ModelConfig(**model)
    ctx = ParallelContext.build(tensor_parallel_size=dist.get_world_size() if dist.is_initialized() else 2,
                                timeout_s=timeout_s)
    op_model = OperatorModel(cfg, ctx.tp_group, seed=1)
    run_dir = tempfile.mkdtemp(prefix="oases-guard-bench-")
    executors = {}
    for variant in VARIANTS:
        comm = _communicator(variant, os.path.join(run_dir, variant))
        executors[variant] = Executor.for_schedule(op_model, ScheduleSpec(schedule), rng=RNGTracker(seed=1),
                                                   record=False, comm=comm)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
    batch = {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
    steps_run = {v: 0 for v in VARIANTS}

    def step(variant: str) -> tuple[float, float]:
        steps_run[variant] += 1
        ex = executors[variant]
        ex.comm.step = steps_run[variant]
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        ex.run(batch)
        wall = torch.tensor([time.perf_counter() - wall0], dtype=torch.float64)
        cpu = time.process_time() - cpu0
        op_model.zero_grad(set_to_none=True)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        return float(wall), cpu

    for _ in range(warmup):
        for variant in VARIANTS:
            step(variant)
    out: dict[str, list[list[tuple[float, float]]]] = {v: [] for v in VARIANTS}
    for rnd in range(rounds):
        for variant in rotated(VARIANTS, rnd):
            out[variant].append([step(variant) for _ in range(steps)])
    return {"rank": ctx.rank, "rounds": out,
            "collectives_per_step": {v: sum(ex.comm.recorder.counts.values()) / steps_run[v] for v, ex in executors.items()}}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ratios to ``off`` from every rank's rounds (wall: the slowest rank's, the
    same on every rank; CPU: the mean over ranks)."""
    rank0 = per_rank[0]["rounds"]
    rounds = len(rank0["off"])
    wall = {v: [[w for w, _ in rank0[v][r]] for r in range(rounds)] for v in VARIANTS}
    cpu = {v: [[statistics.fmean(p["rounds"][v][r][i][1] for p in per_rank) for i in range(len(rank0[v][r]))]
                for r in range(rounds)] for v in VARIANTS}
    out: dict[str, Any] = {"rounds": rounds, "steps_per_round": len(rank0["off"][0]), "variants": {}}
    for v in VARIANTS:
        out["variants"][v] = {
            "median_wall_s": statistics.median(x for r in wall[v] for x in r),
            "median_cpu_s": statistics.median(x for r in cpu[v] for x in r),
            "wall_ratio_to_off": statistics.median(statistics.median(wall[v][r]) / statistics.median(wall["off"][r])
                                                   for r in range(rounds)),
            "cpu_ratio_to_off": statistics.median(statistics.median(cpu[v][r]) / statistics.median(cpu["off"][r])
                                                  for r in range(rounds)),
            "wall_s_per_round": [statistics.median(r) for r in wall[v]],
        }
    out["collectives_per_step"] = per_rank[0]["collectives_per_step"]
    return out


def table(result: dict[str, Any]) -> str:
    """The Markdown table of a result JSON (``benchmarks/results/guard_overhead.json``)."""
    rows = ["| variant | median step (wall, s) | wall / off (median of rounds) | median step (CPU, s) | CPU / off |",
            "|---|---|---|---|---|"]
    for v, s in result["summary"]["variants"].items():
        rows.append(f"| {v} | {s['median_wall_s']:.3f} | {s['wall_ratio_to_off']:.3f} | {s['median_cpu_s']:.3f} | "
                    f"{s['cpu_ratio_to_off']:.3f} |")
    return "\n".join(rows)
