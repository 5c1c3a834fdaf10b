"""Does stepping plans interleaved slow them?  A check of the accuracy study's own measurement.

Not a test: a diagnostic.  The accuracy study (``oases_ds/planner/accuracy.py``) steps its plans one
step each per round, rotated, so that the machine's drift hits them alike; the interleaved profile
(``accuracy.interleave_profile``) steps a profile's one-layer degrees between them.  If switching
models every step left the caches cold, the measured steps would be slower than a training run's (one
plan, step after step) and the interleaved profile slower than the planner's, and the study would
score the model against a machine no user trains on.

For a stored accuracy result (its ``config``: model, devices, micro-batch, schedule, emulated link,
and its plans), one launch of the study's ranks holds every plan and a profile's degrees, and repeats
``--cycles`` times, back to back so that drift hits the three alike:

1. *profile alone*: ``--rounds`` rounds of the profile's degrees only (as the planner's profiler steps
   them);
2. *interleaved*: ``--rounds`` rounds of every plan and degree, rotated (as ``accuracy.measure_with_profile``);
3. *blocks*: ``--rounds`` rounds in which each plan runs ``--block`` steps in a row, the first untimed
   (as a training run steps one plan).

Every step is timed as the study times it (:func:`oases_ds.planner.accuracy.timed_step`: all ranks
start together, the slowest rank sets the step).  Prints per cycle the median ratio interleaved / alone
for each degree and interleaved / blocks for each plan, and writes every step to ``--out``.

    python benchmarks/interleave_check.py --result /tmp/cost_model_v8_run_j-2026-12-02/planner_accuracy-tmp4.json  # tar xzf benchmarks/results/cost_model_runs/cost_model_v8_run_j-2026-12-02.tar.gz -C /tmp
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oases_ds.launcher import launch  # noqa: E402
from oases_ds.bench.cost_model import plan_of_row  # noqa: E402
from oases_ds.planner.accuracy import AccuracySpec, plan_runners, plan_step_ms, timed_step  # noqa: E402
from oases_ds.planner.profile import ProfileSpec, ProfileSteps  # noqa: E402
from oases_ds.utils.io import write_json_atomic  # noqa: E402
from oases_ds.utils.rounds import rotated  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _rank(config: dict[str, Any], rows: list[dict[str, Any]], cycles: int, rounds: int,
          block: int) -> list[dict[str, list[list[float]]]]:
    """Per cycle, the slowest rank's step times (ms) per degree (``alone``, ``interleaved_profile``) and
    per plan (``interleaved``, ``blocks``)."""
    spec = AccuracySpec.from_config(config, len(rows[0]["attn"]), config["devices"], warmup=0, repeats=0)
    plans = [plan_of_row(r, spec.devices) for r in rows]
    ctx, batch, runners = plan_runners(spec, plans)
    profile = ProfileSteps(ProfileSpec.from_config(config), ctx)

    def plan_ms(i: int) -> float:
        return plan_step_ms(ctx, runners[i], batch)[1]

    def degree_ms(k: int) -> float:
        return timed_step(ctx, functools.partial(profile.step, k, False))[1]

    for i in range(len(runners)):  # one warm step each, untimed
        plan_ms(i)
    for k in range(len(profile)):
        degree_ms(k)
    out = []
    for _ in range(cycles):
        cycle: dict[str, list[list[float]]] = {
            "alone": [[] for _ in range(len(profile))], "interleaved_profile": [[] for _ in range(len(profile))],
            "interleaved": [[] for _ in runners], "blocks": [[] for _ in runners]}
        for rnd in range(rounds):
            for k in rotated(range(len(profile)), rnd):
                cycle["alone"][k].append(degree_ms(k))
        for rnd in range(rounds):
            for i in rotated(range(len(runners) + len(profile)), rnd):
                if i < len(runners):
                    cycle["interleaved"][i].append(plan_ms(i))
                else:
                    cycle["interleaved_profile"][i - len(runners)].append(degree_ms(i - len(runners)))
        for rnd in range(rounds):
            for i in rotated(range(len(runners)), rnd):
                plan_ms(i)  # the first step of a block runs right after another plan's: untimed
                cycle["blocks"][i] += [plan_ms(i) for _ in range(block - 1)]
        out.append(cycle)
    return out


def _ratios(numerator: list[list[float]], denominator: list[list[float]]) -> list[float]:
    """Per item, the ratio of the medians."""
    return [statistics.median(a) / statistics.median(b) for a, b in zip(numerator, denominator)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result", required=True, help="a stored accuracy result (planner_accuracy-<setup>.json)")
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=3, help="steps per plan in a row in the blocks phase (>= 2)")
    parser.add_argument("--out", help="default: benchmarks/results/interleave_check-<setup>-<date>.json")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    for name in ("cycles", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.block < 2:
        parser.error(f"--block must be >= 2 (its first step is untimed), got {args.block}")
    result = json.loads(Path(args.result).read_text())
    config, rows = result["config"], result["rows"]
    cycles = launch(_rank, config["devices"], (config, rows, args.cycles, args.rounds, args.block),
                    timeout_s=args.timeout_s)[0]
    degrees = ProfileSpec.from_config(config).degrees()
    print(f"{len(rows)} plans, degrees {list(degrees)}, {args.rounds} rounds per phase, blocks of {args.block}")
    for c, cycle in enumerate(cycles):
        lowest = statistics.median(cycle["alone"][0])
        print(f"cycle {c}: lowest degree alone {lowest:.1f} ms; interleaved / alone per degree "
              + " ".join(f"{r:.3f}" for r in _ratios(cycle["interleaved_profile"], cycle["alone"]))
              + "; interleaved / blocks per plan "
              + " ".join(f"{r:.3f}" for r in _ratios(cycle["interleaved"], cycle["blocks"])))
    pooled = {key: [sum((cycle[key][i] for cycle in cycles), []) for i in range(len(cycles[0][key]))]
              for key in cycles[0]}
    degree_ratio = _ratios(pooled["interleaved_profile"], pooled["alone"])
    plan_ratio = _ratios(pooled["interleaved"], pooled["blocks"])
    print("all cycles: interleaved / alone per degree " + " ".join(f"{r:.3f}" for r in degree_ratio)
          + f"; interleaved / blocks per plan median {statistics.median(plan_ratio):.3f} "
          f"(min {min(plan_ratio):.3f}, max {max(plan_ratio):.3f})")
    setup = Path(args.result).stem.removeprefix("planner_accuracy-")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        f"interleave_check-{setup}-{datetime.date.today().isoformat()}.json")
    write_json_atomic(out, {
        "result": str(Path(args.result)), "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "rounds": args.rounds, "block": args.block, "degrees": list(degrees),
        "plans": [{"attn": r["attn"], "mlp": r["mlp"]} for r in rows],
        "interleaved_over_alone": degree_ratio, "interleaved_over_blocks": plan_ratio, "cycles": cycles})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
