"""Planner solve time versus model depth, for every OR-Tools backend the ILP can use.

Not a test: run ``python benchmarks/planner_solve_time.py``.  The cost tables are
synthetic but shaped like a GPT layer (hidden 4096, 32k tokens per micro-batch)
on a commodity cluster of T=32 devices, 8 per node: PCIe inside a node, 25 Gb/s
between nodes, so TMP degrees above 8 pay inter-node AllReduces.  All layers
share one profile, as in the paper, which makes the memory-bound problem highly
symmetric -- the hard case for branch and bound.  The memory limit is set halfway
between the leanest plan and the unconstrained optimum, so it always binds.

Prints a table and writes ``benchmarks/results/planner_solve_time.json`` (``--out``).
Backend ``DP`` is the exact label DP (:mod:`oases_ds.planner.dp`), for comparison.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oases_ds.planner.costs import BlockCost, CostTable  # noqa: E402
from oases_ds.planner.dp import solve_dp  # noqa: E402
from oases_ds.planner.ilp import BACKENDS, solve  # noqa: E402
from oases_ds.planner.objective import check_memory_feasible, predict_step_ms  # noqa: E402
from oases_ds.planner.plan import Plan, PlanInfeasibleError  # noqa: E402
from oases_ds.utils.io import write_json_atomic  # noqa: E402

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
        schedule="oases",
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


def time_solves(table: CostTable, limit: float | None, backend: str, repeats: int, time_limit_s: float) -> dict:
    runs: list[float] = []
    plan = None
    for _ in range(repeats):
        started = time.perf_counter()
        if backend == "DP":
            plan = solve_dp(table, limit)
        else:
            plan = solve(table, limit, time_limit_s=time_limit_s, backend=backend)
        runs.append((time.perf_counter() - started) * 1e3)
    assert plan is not None
    return {
        "median_ms": statistics.median(runs),
        "runs_ms": runs,
        "objective_ms": plan.predicted_step_ms,
        "plan": plan.as_table(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48, 96, 128])
    choices = sorted(BACKENDS) + ["DP"]  # DP: the exact label DP of oases_ds.planner.dp, no OR-Tools
    parser.add_argument("--backends", nargs="+", default=choices, choices=choices)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    args = parser.parse_args()

    rows = []
    for layers in args.layers:
        table = synthetic_table(layers)
        reference = solve(table, None)
        limit = binding_limit(table, reference)
        check_memory_feasible(table, limit)
        uniform_ms = predict_step_ms(table, Plan.uniform(DEVICES, layers, 8))
        for bound, memory_limit in (("none", None), ("binding", limit)):
            for backend in args.backends:
                try:
                    result = time_solves(table, memory_limit, backend, args.repeats, args.time_limit_s)
                except (RuntimeError, PlanInfeasibleError) as error:
                    result = {"median_ms": None, "error": str(error)}
                row = {"layers": layers, "memory_bound": bound, "memory_limit_bytes": memory_limit,
                       "backend": backend, "uniform_t8_step_ms": uniform_ms, **result}
                rows.append(row)
                outcome = (f"{row['median_ms']:9.1f} ms  objective {row['objective_ms']:.3f} ms"
                           if row["median_ms"] is not None else f"failed: {row['error']}")
                print(f"{layers:6d} {bound:8s} {backend:7s} {outcome}", flush=True)

    write_json_atomic(args.out, {
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "devices": DEVICES,
        "degrees": list(DEGREES),
        "repeats": args.repeats,
        "note": "solve() wall time incl. model build; median of repeats; 2 shared CPU cores",
        "rows": rows,
    }, indent=2, sort_keys=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
