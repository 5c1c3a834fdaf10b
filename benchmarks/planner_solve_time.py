"""Planner solve time versus model depth: the default label DP against every candidate, interleaved.

Not a test: run ``python benchmarks/planner_solve_time.py``.  The cost tables are
synthetic but shaped like a GPT layer (hidden 4096, 32k tokens per micro-batch)
on a commodity cluster of T=32 devices, 8 per node: PCIe inside a node, 25 Gb/s
between nodes, so TMP degrees above 8 pay inter-node AllReduces.  All layers
share one profile, as in the paper, which makes the memory-bound problem highly
symmetric -- the hard case for branch and bound.  The memory limit is set halfway
between the leanest plan and the unconstrained optimum, so it always binds.

Candidates (:data:`CANDIDATES`): ``dp`` the default (label DP, Lagrangian bound),
``dp-greedy`` the same search with the earlier DP's bounds, ``ilp-SCIP`` / ``ilp-CP_SAT``
the OR-Tools model, ``ilp-SCIP-hint`` SCIP warm-started from the DP's plan.  Every
candidate proves optimality or fails; each run checks its objective against ``dp``'s.
The machine is shared, so the runs are interleaved (repeat r runs every candidate at
every depth before repeat r+1) and the report states medians and ratios to ``dp``
from the same run.

Writes ``benchmarks/results/planner_solve_time.json`` (``--out``, atomically) and
renders it into the dated report ``benchmarks/reports/planner_solve_time-<date>.md`` (``--render-only``
re-renders from the JSON without solving).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oases_ds.bench.provenance import dated_report  # noqa: E402
from oases_ds.planner.costs import BlockCost, CostTable  # noqa: E402
from oases_ds.planner.dp import solve_dp  # noqa: E402
from oases_ds.planner.ilp import solve  # noqa: E402
from oases_ds.planner.objective import check_memory_feasible, predict_step_ms  # noqa: E402
from oases_ds.planner.plan import Plan, PlanInfeasibleError  # noqa: E402
from oases_ds.schedule.generators import ScheduleSpec  # noqa: E402
from oases_ds.utils.io import replace_marked_section, write_json_atomic  # noqa: E402

DEVICES = 32
DEGREES = (1, 2, 4, 8, 16, 32)
HIDDEN = 4096
TOKENS = 16 * 2048  # micro-batch of 16 sequences of 2048 tokens
PEAK_TFLOPS = 71.0  # RTX 3090 fp16 tensor cores
INTRA_GBYTES_S = 10.0  # PCIe within a node of 8
INTER_GBYTES_S = 25 / 8  # 25 Gb/s Ethernet between nodes
OVERLAP = 0.8  # share of a block's compute the overlapped schedule hides comm behind
ACCUMULATION = 8  # micro-batches per optimizer step: grad sync amortised over them
RESULTS = Path(__file__).resolve().parent / "results" / "planner_solve_time.json"
BEGIN, END = "<!-- planner_solve_time: begin (generated) -->", "<!-- planner_solve_time: end -->"
"""The report lines between these markers are rewritten from the JSON; nothing else is touched."""
DEFAULT = "dp"


def allreduce_ms(ranks: int, nbytes: float, gbytes_s: float, latency_ms: float = 0.03) -> float:
    if ranks == 1:
        return 0.0
    return latency_ms + 2 * (ranks - 1) / ranks * nbytes / (gbytes_s * 1e6)


def block_cost(params: float, extra_flops: float, degree: int) -> BlockCost:
    """GEMMs shrink with the degree (efficiency drops); TMP traffic grows with it."""
    efficiency = 0.55 * (1 - 0.05 * math.log2(degree))
    fwd_ms = (2 * params * TOKENS + extra_flops) / DEVICES / (PEAK_TFLOPS * efficiency * 1e9)
    replica_act_bytes = 2 * TOKENS * HIDDEN * degree / DEVICES
    link = INTRA_GBYTES_S if degree <= 8 else INTER_GBYTES_S
    comm_ms = allreduce_ms(degree, replica_act_bytes, link)
    replicas = DEVICES // degree
    grad_link = INTRA_GBYTES_S if degree * replicas <= 8 else INTER_GBYTES_S
    return BlockCost(
        fwd_ms=fwd_ms,
        bwd_ms=3 * fwd_ms,  # recompute + backward
        comm_fwd_ms=max(0.0, comm_ms - OVERLAP * fwd_ms),
        comm_bwd_ms=max(0.0, comm_ms - OVERLAP * 3 * fwd_ms),
        state_bytes=16 * params / degree,  # fp16 params + grads, fp32 master + Adam moments
        act_bytes=replica_act_bytes,
        grad_sync_ms=allreduce_ms(replicas, 2 * params / degree, grad_link) / ACCUMULATION,
    )


def synthetic_table(layers: int) -> CostTable:
    attention_flops = 4 * TOKENS * 2048 * HIDDEN  # scores and weighted sum, sequence 2048
    return CostTable(
        model=f"gpt-h{HIDDEN}-l{layers}",
        cluster="3090-pcie-25gbe",
        schedule=ScheduleSpec("oases"),
        devices=DEVICES,
        degrees=DEGREES,
        blocks={
            "attn": {t: block_cost(4 * HIDDEN**2, attention_flops, t) for t in DEGREES},
            "mlp": {t: block_cost(8 * HIDDEN**2, 0.0, t) for t in DEGREES},
        },
        layers=layers,
        reshard_bytes=2 * TOKENS * HIDDEN / 2,  # one sub-batch
        bandwidth_gbps=INTER_GBYTES_S * 8,
        latency_us=30.0,
    )


def binding_limit(table: CostTable, unconstrained: Plan) -> float:
    lean = sum(min(c.memory_bytes for c in table.blocks[kind].values()) for kind in table.block_kinds())
    return (lean + unconstrained.memory_bytes) / 2


Solver = Callable[[CostTable, "float | None", float], Plan]


def _ilp(backend: str, warm: bool = False) -> Solver:
    def run(table: CostTable, limit: float | None, time_limit_s: float) -> Plan:
        hint = solve_dp(table, limit).block_degrees() if warm else None  # the warm start's DP time counts
        return solve(table, limit, time_limit_s=time_limit_s, backend=backend, hint=hint)
    return run


CANDIDATES: dict[str, Solver] = {
    "dp": lambda table, limit, _: solve_dp(table, limit),
    "dp-greedy": lambda table, limit, _: solve_dp(table, limit, bound="greedy"),
    "ilp-SCIP": _ilp("SCIP"),
    "ilp-SCIP-hint": _ilp("SCIP", warm=True),
    "ilp-CP_SAT": _ilp("CP_SAT"),
    "ilp-CBC": _ilp("CBC"),
    "ilp-HIGHS": _ilp("HIGHS"),
}
"""Name -> solver; the default run measures all but CBC and HiGHS (CBC runs past 60 s at
96 layers, HiGHS is slower than SCIP: ``--candidates`` adds them)."""


def measure(layers_list: list[int], candidates: list[str], repeats: int, ilp_repeats: int,
            time_limit_s: float) -> list[dict]:
    """Every (depth, candidate) ``repeats`` times (ILP candidates: the first ``ilp_repeats``
    of them, they take seconds each), interleaved; one row per pair."""
    tables = {layers: synthetic_table(layers) for layers in layers_list}
    limits = {}
    for layers, table in tables.items():
        limits[layers] = binding_limit(table, solve_dp(table, None))
        check_memory_feasible(table, limits[layers])
    runs: dict[tuple[int, str], list[float]] = {(depth, name): [] for depth in layers_list for name in candidates}
    cpu: dict[tuple[int, str], list[float]] = {key: [] for key in runs}  # process CPU time: less load-bound than wall
    plans: dict[tuple[int, str], Plan] = {}
    errors: dict[tuple[int, str], str] = {}
    for repeat in range(repeats):
        for layers in layers_list:
            for name in candidates:
                key = (layers, name)
                if key in errors or (name.startswith("ilp-") and repeat >= ilp_repeats):
                    continue
                started, started_cpu = time.perf_counter(), time.process_time()
                try:
                    plans[key] = CANDIDATES[name](tables[layers], limits[layers], time_limit_s)
                except (RuntimeError, PlanInfeasibleError) as error:
                    errors[key] = str(error)
                    continue
                runs[key].append((time.perf_counter() - started) * 1e3)
                cpu[key].append((time.process_time() - started_cpu) * 1e3)
                print(f"repeat {repeat} {layers:4d} layers {name:14s} {runs[key][-1]:9.1f} ms", flush=True)
    rows = []
    for layers in layers_list:
        default_ms = statistics.median(runs[layers, DEFAULT]) if runs.get((layers, DEFAULT)) else None
        reference = plans.get((layers, DEFAULT))
        for name in candidates:
            key = (layers, name)
            plan = plans.get(key)
            median = statistics.median(runs[key]) if runs[key] else None
            rows.append({
                "layers": layers, "candidate": name, "memory_limit_bytes": limits[layers],
                "median_ms": median, "runs_ms": runs[key], "error": errors.get(key),
                "median_cpu_ms": statistics.median(cpu[key]) if cpu[key] else None,
                "ratio_to_default": median / default_ms if median and default_ms else None,
                "objective_ms": plan.predicted_step_ms if plan else None,
                "same_objective_as_default": (None if plan is None or reference is None else
                                              math.isclose(plan.predicted_step_ms, reference.predicted_step_ms,
                                                           rel_tol=1e-7)),
                "uniform_t8_step_ms": predict_step_ms(tables[layers], Plan.uniform(DEVICES, layers, 8)),
                "plan": plan.as_table() if plan else None,
            })
    return rows


def render(result: dict) -> str:
    """The report section's body: one row per depth, one column per candidate (median ms,
    ratio to the default from the same run), every number from ``result``."""
    candidates = list(dict.fromkeys(row["candidate"] for row in result["rows"]))
    layers_list = list(dict.fromkeys(row["layers"] for row in result["rows"]))
    by_key = {(row["layers"], row["candidate"]): row for row in result["rows"]}

    def cell(row: dict) -> str:
        if row["median_ms"] is None:  # a PlanSolverError says how long it ran and why it stopped
            ran = re.search(r"after (\d+) ms", row["error"] or "")
            return f"no proof in {int(ran.group(1)) / 1e3:.0f} s" if ran else "failed"
        text = f"{row['median_ms']:.0f}" if row["median_ms"] >= 10 else f"{row['median_ms']:.1f}"
        if row["candidate"] != DEFAULT:
            text += f" ({row['ratio_to_default']:.1f}x)"
        return text + ("" if row["same_objective_as_default"] in (True, None) else " DIFFERENT OPTIMUM")

    lines = [
        f"Generated by `python benchmarks/planner_solve_time.py` on {result['date']} ({result['machine']}; "
        f"load average {result['load_average']}) from `results/planner_solve_time.json`: median wall ms of "
        f"{result['repeats']} interleaved runs per cell ({result['ilp_repeats']} for `ilp-*`, the first ones), "
        f"in brackets the ratio to `{DEFAULT}` in the same run. "
        f"T={result['devices']}, degrees {result['degrees']}, memory limit halfway between the leanest plan "
        "and the unbounded optimum (binding). Every candidate proves optimality; all found the same objective "
        "unless a cell says otherwise.",
        "",
        "| layers | " + " | ".join(f"`{name}` ms" for name in candidates) + " |",
        "|---:|" + "---:|" * len(candidates),
    ]
    for layers in layers_list:
        lines.append(f"| {layers} | " + " | ".join(cell(by_key[layers, name]) for name in candidates) + " |")
    worst = max((by_key[layers, DEFAULT]["median_ms"] or math.inf) for layers in layers_list)
    lines += ["", f"Slowest `{DEFAULT}` median: {worst:.0f} ms."]
    cpu = [by_key[layers, DEFAULT].get("median_cpu_ms") for layers in layers_list]
    if all(ms is not None for ms in cpu):  # recorded since the first run of this table
        lines[-1] += f" Its median process CPU ms ({', '.join(f'{ms:.0f}' for ms in cpu)}) shows the load's share."
    return "\n".join(lines)


def render_report(result: dict, report: Path | None = None) -> Path:
    """Replace the text between :data:`BEGIN` and :data:`END` in ``report`` (atomically; default the
    dated report of ``result``'s day)."""
    report = report or Path(dated_report("planner_solve_time", result["date"]))
    replace_marked_section(report, BEGIN, END, render(result))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48, 96, 128])
    parser.add_argument("--candidates", nargs="+", choices=sorted(CANDIDATES),
                        default=[name for name in CANDIDATES if name not in ("ilp-CBC", "ilp-HIGHS")])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report", type=Path, help="report whose section is replaced (default: the result's dated report)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ilp-repeats", type=int, default=2, help="repeats (the first ones) that run ilp-*")
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--render-only", action="store_true", help="re-render the report from --out, no solving")
    args = parser.parse_args()
    if args.render_only:
        print(f"wrote {render_report(json.loads(args.out.read_text()), args.report)}")
        return
    if DEFAULT not in args.candidates:
        parser.error(f"--candidates must include {DEFAULT} (the ratios are to it)")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = measure(args.layers, args.candidates, args.repeats, min(args.ilp_repeats, args.repeats), args.time_limit_s)
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
                   f"{os.cpu_count()} CPUs shared",
        "load_average": load,
        "devices": DEVICES,
        "degrees": list(DEGREES),
        "repeats": args.repeats,
        "time_limit_s": args.time_limit_s,
        "ilp_repeats": min(args.ilp_repeats, args.repeats),
        "note": "wall ms of one solve incl. model build; interleaved repeats; ratio_to_default = median / dp median",
        "rows": rows,
    }
    write_json_atomic(args.out, result, indent=2, sort_keys=True)
    report = render_report(result, args.report)
    print(render(result))
    print(f"wrote {args.out} and {report}")


if __name__ == "__main__":
    main()
