"""Where a plan's replayed step and its measured step part: compute, each Sync's wait, the rest.

Not a test: a diagnostic for the cost model.  The accuracy study (``benchmarks/cost_model_oos.py``)
says *whether* the replay (``oases_ds/planner/replay.py``) ranks plans as the machine does; this says
*where* a plan's prediction is off.  For the setup of a stored accuracy result (its ``config``: model,
devices, micro-batch, schedule, emulated link), it runs the chosen plans interleaved with timelines
kept (``cost_model.measure_breakdown``) and sets, per plan,

* the measured compute (per rank), each Sync's wait (median over steps; min / median / max over the
  ranks) and the rest of each rank's step (gradient sync, issuing collectives, the host)
* against the replay's compute, its wait at the same Sync, and its overhead + gradient sync,

priced by a stored profile (``--profile``; default: the newest stored profile of the result's
setup and this cost model, ``cost_model.stored_tables``).  Writes ``--out`` (JSON, every step of every
rank) and prints the Syncs whose measured wait differs most from the replay's.

    tar xzf benchmarks/results/cost_model_runs/cost_model_v9_run_m-2026-12-02.tar.gz -C /tmp   # a stored run
    python benchmarks/replay_breakdown.py --result /tmp/cost_model_v9_run_m-2026-12-02/planner_accuracy-tmp4.json \\
        --plan 4,4,4,4/4,4,4,4 --plan 1,1,1,1/1,1,1,1 --rounds 8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oases_ds.bench.cost_model import measure_breakdown, plan_of_row, stored_tables  # noqa: E402
from oases_ds.planner.accuracy import AccuracySpec  # noqa: E402
from oases_ds.planner.costs import CostTable  # noqa: E402
from oases_ds.planner.plan import Plan  # noqa: E402
from oases_ds.planner.replay import replay_plan  # noqa: E402
from oases_ds.utils.io import write_json_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_plan(text: str, devices: int) -> Plan:
    """``"1,1,2,4/4,4,2,1"``: attention degrees per layer / MLP degrees per layer."""
    try:
        attn, mlp = (tuple(int(d) for d in part.split(",")) for part in text.split("/"))
    except ValueError:
        raise SystemExit(f"error: --plan {text!r}: write attention/MLP degrees per layer, e.g. 1,1,2,4/4,4,2,1")
    return Plan(attn_degrees=attn, mlp_degrees=mlp, devices=devices)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def compare(plan: Plan, replay: Any, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One plan's measured steps (``per_rank``: each rank's timed steps) against its replay."""
    names = sorted({n for steps in per_rank for s in steps for n in s["waits_ms"]} | set(replay.waits_ms))
    waits = {}
    for name in names:
        by_rank = [_median([s["waits_ms"].get(name, 0.0) for s in steps]) for steps in per_rank]
        waits[name] = {"predicted": replay.waits_ms.get(name, 0.0), "measured_min": min(by_rank),
                       "measured_median": _median(by_rank), "measured_max": max(by_rank)}
    part = {key: [_median([s[key] for s in steps]) for steps in per_rank] for key in ("compute_ms", "rest_ms", "own_ms")}
    return {
        "attn": list(plan.attn_degrees), "mlp": list(plan.mlp_degrees),
        "measured": {"step_ms": _median([s["step_ms"] for s in per_rank[0]]), **part,
                     "waits_ms": [sum(_median([s["waits_ms"].get(n, 0.0) for s in steps]) for n in names) for steps in per_rank]},
        "predicted": {"step_ms": replay.step_ms,  # since cost model 9 the issue time is in the simulated step
                      "compute_ms": replay.simulated_ms - replay.exposed_comm_ms - replay.overhead_ms,
                      "waits_ms": replay.exposed_comm_ms, "rest_ms": replay.overhead_ms + replay.grad_sync_ms},
        "syncs": waits,
    }


def summary(row: dict[str, Any], top: int) -> str:
    """A few lines per plan: step, compute, waits and rest, predicted against measured (over ranks),
    then the ``top`` Syncs whose median measured wait is furthest from the replay's."""
    m, p = row["measured"], row["predicted"]

    def span(values: list[float]) -> str:
        return f"{min(values):7.1f}-{max(values):7.1f}"
    lines = [f"plan {','.join(map(str, row['attn']))}/{','.join(map(str, row['mlp']))}: "
             f"step measured {m['step_ms']:.1f} ms, replayed {p['step_ms']:.1f} ms",
             f"  compute  replayed {p['compute_ms']:7.1f}  measured per rank {span(m['compute_ms'])}",
             f"  waits    replayed {p['waits_ms']:7.1f}  measured per rank {span(m['waits_ms'])}",
             f"  rest     replayed {p['rest_ms']:7.1f}  measured per rank {span(m['rest_ms'])}  (overhead + gradient sync)"]
    worst = sorted(row["syncs"].items(), key=lambda kv: -abs(kv[1]["measured_median"] - kv[1]["predicted"]))[:top]
    for name, w in worst:
        lines.append(f"  {name:10s} replayed {w['predicted']:7.1f}  measured {w['measured_min']:6.1f} / "
                     f"{w['measured_median']:6.1f} / {w['measured_max']:6.1f} (min / median / max over ranks)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True, help="a stored accuracy result (planner_accuracy-<setup>.json)")
    parser.add_argument("--profile", help="cost table that prices the plans (default: the newest stored one of the setup)")
    parser.add_argument("--plan", action="append", help="attn/mlp degrees per layer, e.g. 1,1,2,4/4,4,2,1 "
                                                        "(repeatable; default: every plan of the result)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per plan (default 8)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--top", type=int, default=4, help="Syncs listed per plan (default 4)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replay_breakdown.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    result = json.loads(Path(args.result).read_text())
    cfg = result["config"]
    if args.profile:
        table = CostTable.from_json(args.profile)
    else:
        found = stored_tables(ROOT / "benchmarks" / "results", result["table_key"])
        if not found:
            raise SystemExit(f"error: no stored profile for {result['table_key']}; pass --profile")
        table = found[-1][1]
    layers = len(result["rows"][0]["attn"])
    table = dataclasses.replace(table, layers=layers)
    plans = ([parse_plan(text, table.devices) for text in args.plan] if args.plan
             else [plan_of_row(r, table.devices) for r in result["rows"]])
    replays = [replay_plan(table, plan) for plan in plans]  # refuses a plan the table cannot price
    spec = AccuracySpec.from_config(cfg, layers, table.devices, args.warmup, args.rounds)  # as oases-plan measured it
    per_rank = measure_breakdown(spec, plans, timeout_s=cfg.get("timeout_s", 1800))
    rows = [compare(plan, replay, [rank[i] for rank in per_rank]) for i, (plan, replay) in enumerate(zip(plans, replays))]
    write_json_atomic(args.out, {"result": args.result, "table_key": table.key(),
                                 "profiled_at": table.measurements.get("profiled_at"), "rounds": args.rounds,
                                 "rows": rows, "steps": per_rank})
    for row in rows:
        print(summary(row, args.top))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
