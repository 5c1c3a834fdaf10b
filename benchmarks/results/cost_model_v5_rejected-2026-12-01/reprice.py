"""Re-price the plans of this folder's runs with cost model 4's reshard edge and with the rejected
cost model 5's, on the same measured steps and the same profiles (``profiles/``), and print each
setup's Spearman: ``python benchmarks/results/cost_model_v5_rejected-2026-12-01/reprice.py``.

Cost model 5 (tried 2026-12-01, not kept) priced a reshard between two blocks as the first
sub-batch's AllGather in full and each later one hidden behind the first sub-batch's compute of
the neighbouring block (``there.fwd_ms / s`` towards a larger degree, ``here.bwd_ms / s``
towards a smaller one).  The runs' stored predictions are cost model 5's; the profiles' numbers
are the same in both models (only the edge formula differs), so the tables load as model 4's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

import oases_ds.planner.costs as costs  # noqa: E402
from oases_ds.planner.accuracy import is_mixed, spearman  # noqa: E402
from oases_ds.planner.objective import predict_step_ms  # noqa: E402
from oases_ds.planner.plan import Plan  # noqa: E402


def v5_edge(table: costs.CostTable, block: int, t_from: int, t_to: int) -> float:
    kinds = table.block_kinds()
    here, there = table.blocks[kinds[block]][t_from], table.blocks[kinds[block + 1]][t_to]
    if t_from == t_to:
        return costs.edge_ms(table, block, t_from, t_to)
    small, big = sorted((t_from, t_to))
    ranks = big // small
    gather = costs.allgather_ms(table, ranks, table.reshard_bytes * big / table.devices)
    overhead = table.collective_overhead_ms.get(ranks, 0.0)
    s = table.sub_batches
    hide = there.fwd_ms / s if t_to > t_from else here.bwd_ms / s
    reshard = s * (costs.SLICE_MS + overhead) + gather + (s - 1) * max(0.0, gather - hide)
    return reshard + here.comm_fwd_last_ms + there.comm_bwd_last_ms


def main() -> None:
    import oases_ds.planner.objective as objective

    tables = {}
    for path in sorted((HERE / "profiles").glob("*.json")):
        table = costs.CostTable.from_json(path)
        tables[table.key().replace(f"|cm{costs.COST_MODEL_VERSION}", "|cm5")] = table
    v4_edge = objective.edge_ms
    for name, mixed_only in [("in_sample", 0), ("link_1g", 0), ("llama", 0), ("bert", 0), ("tmp4", 0), ("mixed", 1)]:
        result = json.loads((HERE / f"planner_accuracy-{name}.json").read_text())
        table = tables[result["table_key"]]
        plans = [Plan.from_block_degrees([x for pair in zip(r["attn"], r["mlp"]) for x in pair], table.devices)
                 for r in result["rows"]]
        objective.edge_ms = v5_edge
        p5 = [predict_step_ms(table, p) for p in plans]
        objective.edge_ms = v4_edge
        p4 = [predict_step_ms(table, p) for p in plans]
        assert all(abs(a - r["predicted_ms"]) < 1e-6 for a, r in zip(p5, result["rows"])), name
        idx = [i for i, r in enumerate(result["rows"]) if is_mixed(r)] if mixed_only else range(len(plans))
        measured = [result["rows"][i]["measured_ms"] for i in idx]
        s4 = spearman([p4[i] for i in idx], measured)[0]
        s5 = spearman([p5[i] for i in idx], measured)[0]
        half = result["split_half_spearman_mixed" if mixed_only else "split_half_spearman"]
        print(f"{name:10s} cost model 4 {s4:.3f}  cost model 5 {s5:.3f}  split-half {half:.3f}")


if __name__ == "__main__":
    main()
