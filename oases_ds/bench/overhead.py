"""Where a schedule spends compute beyond ``none``: per-phase, per-operator CPU time.

Why this exists: the end-to-end table's target is ``oases`` within 1.10x of ``none`` on a fast link.
The end-to-end table only says *that* a schedule is slower; this says *where*: each rank
runs several schedules on the same model and batch, one step each round-robin (the
starting one rotating), and records per timed step

* wall seconds (the slowest rank's step is what a user waits for),
* CPU seconds of the whole rank process (compute thread plus gloo's threads) and of
  the compute thread alone, and the compute thread's CPU seconds per instruction,
  summed per operator kind (``attn.qkv``, ``mlp.mlp``, ``head.loss`` ... over layers)
  and phase (``fwd``/``rec``/``bwd``), taken through :meth:`Executor.add_hook`,
* the minor page faults the step took (fresh memory the C allocator had to map).

Why CPU time: on this shared 2-core machine the load average is often 5-15, and a
wall-clock interval then mostly measures when the scheduler let the rank run.  The
compute thread's CPU time is the work an operator did (cache and memory-bandwidth
contention still leak in, preemption does not), so ratios of CPU time between
schedules run interleaved in one process stay meaningful where wall ratios swing
by 2x.  Both are reported; the load average is printed beside them.

Used by ``benchmarks/schedule_overhead.py``.
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from oases_ds.data import DataConfig, TokenBatches
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.timeline import op_label
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.schedule.instructions import Instruction
from oases_ds.utils.rounds import rotated


_PHASE = {"Forward": "fwd", "Recompute": "rec", "Backward": "bwd", "StartAsync": "comm", "Sync": "comm"}


def op_kind(label: str) -> str:
    """``L3.attn.qkv`` -> ``attn.qkv``: an operator label without its layer, so layers add up."""
    head, _, rest = label.partition(".")
    return rest if head.startswith("L") and head[1:].isdigit() else label


class CpuProbe:
    """Compute-thread CPU seconds per (operator kind, phase) of one executor's next run,
    through its public instruction hook; ``comm`` is the CPU spent issuing and syncing
    collectives on the compute thread."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.kinds = [op_kind(op_label(op.name, op.layer, op.block)) for op in executor.ops]
        self.seconds: dict[str, float] = defaultdict(float)
        self._t0 = 0.0

    def _hook(self, ins: Instruction, phase: str) -> None:
        if phase == "before":
            self._t0 = time.thread_time()
        else:
            self.seconds[f"{self.kinds[ins.op]} {_PHASE[type(ins).__name__]}"] += time.thread_time() - self._t0

    def run(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One step; wall, process CPU, compute-thread CPU, page faults and the per-op CPU seconds."""
        self.seconds = defaultdict(float)
        remove = self.executor.add_hook(self._hook)
        try:
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
            self.executor.run(batch)
            wall, cpu, thread = time.perf_counter() - wall0, time.process_time() - cpu0, time.thread_time() - thread0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        finally:
            remove()
        phases: dict[str, float] = defaultdict(float)
        for key, sec in self.seconds.items():
            phases[key.rsplit(" ", 1)[1]] += sec
        return {"step_s": wall, "cpu_s": cpu, "thread_cpu_s": thread, "minor_faults": faults,
                "phases": dict(phases), "ops": dict(self.seconds)}


def overhead_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: build one executor per schedule on identical weights and batch, run them
    interleaved (``warmup`` untimed rounds, then ``repeats`` timed ones), return the
    per-step records.  ``spec``: model (ModelConfig kwargs), schedules (a name, or
    ``oases:full_recompute``: recompute outputs nobody reads too, the executor as it was
    before :attr:`Executor.unread_recomputes`, for a before/after ratio in one run), micro_batch,
    tp, warmup, repeats, threads (torch intra-op threads, ``None``: leave as launched),
    timeout_s."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    ctx = ParallelContext.build(tensor_parallel_size=spec["tp"], timeout_s=spec["timeout_s"])
    cfg = ModelConfig(**spec["model"])
    batch = TokenBatches(DataConfig(source="synthetic", seed=0), cfg.vocab_size, cfg.seq_len).batch(
        0, ctx.dp_size, ctx.dp_rank, spec["micro_batch"])
    runners = {}
    for name in spec["schedules"]:
        model = OperatorModel(cfg, group=ctx.tp_group, seed=0)
        schedule, _, variant = name.partition(":")
        executor = Executor.for_schedule(model, ScheduleSpec(schedule), None, RNGTracker())
        if variant == "full_recompute":  # the executor before graph-only recomputes: every output computed
            executor.unread_recomputes = frozenset()
        elif variant:
            raise ValueError(f"schedule {name!r}: unknown variant {variant!r}; the one variant is :full_recompute")
        runners[name] = (CpuProbe(executor), model)
    names = list(runners)
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(spec["warmup"] + spec["repeats"]):
        for name in rotated(names, rep):
            probe, model = runners[name]
            dist.barrier(ctx.tp_group)
            record = probe.run(batch)
            model.zero_grad(set_to_none=True)
            if rep >= spec["warmup"]:
                steps[name].append(record)
    return {"rank": ctx.rank, "threads": torch.get_num_threads(), "steps": steps}


def summarize(ranks: list[dict[str, Any]], base: str) -> dict[str, dict[str, Any]]:
    """Per schedule: medians over timed steps of the wall step (slowest rank), of the CPU
    seconds (mean over ranks) and their per-step ratios to ``base``; rank 0's median
    compute-thread CPU per phase and per operator kind, and its page faults."""
    out: dict[str, dict[str, Any]] = {}
    schedules = list(ranks[0]["steps"])
    n = {name: len(ranks[0]["steps"][name]) for name in schedules}
    wall = {s: [max(r["steps"][s][i]["step_s"] for r in ranks) for i in range(n[s])] for s in schedules}
    cpu = {s: [statistics.mean(r["steps"][s][i]["cpu_s"] for r in ranks) for i in range(n[s])] for s in schedules}
    thread = {s: [statistics.mean(r["steps"][s][i]["thread_cpu_s"] for r in ranks) for i in range(n[s])] for s in schedules}

    def ratio(series: dict[str, list[float]], name: str) -> dict[str, float]:
        rs = [a / b for a, b in zip(series[name], series[base])]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}

    for name in schedules:
        r0 = ranks[0]["steps"][name]
        keys = sorted({k for s in r0 for k in s["ops"]})
        phases = sorted({k for s in r0 for k in s["phases"]})
        out[name] = {
            "step_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name]),
            "thread_cpu_s": statistics.median(thread[name]),
            "wall_ratio": ratio(wall, name), "cpu_ratio": ratio(cpu, name), "thread_cpu_ratio": ratio(thread, name),
            "minor_faults": statistics.median(s["minor_faults"] for s in r0),
            "phases": {p: statistics.median(s["phases"].get(p, 0.0) for s in r0) for p in phases},
            "ops": {k: statistics.median(s["ops"].get(k, 0.0) for s in r0) for k in keys},
        }
    return out


def table(summary: dict[str, dict[str, Any]], base: str) -> list[str]:
    """Plain-text lines: wall and CPU ratios to ``base``, then CPU seconds per operator kind and phase."""
    names = list(summary)

    def r(x: dict[str, float]) -> str:
        return f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})"

    lines = [f"{'schedule':<24}{'wall s':>8}  {'wall ratio':<22}{'cpu s':>8}  {'cpu ratio':<22}{'thread s':>9}  "
             f"{'thread ratio':<22}{'faults':>8}  compute-thread CPU per phase"]
    for name in names:
        s = summary[name]
        ph = " ".join(f"{p} {v:.3f}" for p, v in s["phases"].items())
        lines.append(f"{name:<24}{s['step_s']:>8.3f}  {r(s['wall_ratio']):<22}{s['cpu_s']:>8.3f}  {r(s['cpu_ratio']):<22}"
                     f"{s['thread_cpu_s']:>9.3f}  {r(s['thread_cpu_ratio']):<22}{s['minor_faults']:>8.0f}  {ph}")
    keys = [k for k in sorted({k for s in summary.values() for k in s["ops"]},
                              key=lambda k: -max(s["ops"].get(k, 0.0) for s in summary.values()))
            if max(s["ops"].get(k, 0.0) for s in summary.values()) >= 1e-3]
    lines += ["", f"{'op phase (rank 0, CPU s)':<28}" + "".join(f"{name:>24}" for name in names)]
    for k in keys:
        lines.append(f"{k:<28}" + "".join(f"{summary[name]['ops'].get(k, 0.0):>24.4f}" for name in names))
    lines.append(f"load average now {os.getloadavg()[0]:.1f}; ratios against {base}, per timed step")
    return lines
