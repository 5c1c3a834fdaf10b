"""Recompute-aware planning, simulated: GPT-39.1B on the paper's 3090 server, ``cost=analytic``.

At three per-device memory limits -- the memory of storing every block, of recomputing every block
(the uniform Oases plan), and their midpoint -- the planner (``planner.recompute=auto``) chooses each
block's TMP degree and policy (``store`` / ``oases``).  For each limit the script prints the planned
step beside the uniform ``oases`` step and the ``none`` step (no recomputation, blocking
collectives), all three replayed over the same analytic per-op costs
(:func:`~oases_ds.planner.replay.replay_plan`), and how much of the gap between ``oases`` and ``none``
the plan closes.  Limits are the planner's own memory bound of the two uniform plans (the bound the
solver holds a plan to); each plan's replayed peak (:func:`~oases_ds.planner.memory.estimate_memory`)
is printed beside it.  Nothing is measured: this is the cost model's prediction for a cluster this
machine is not.

``--measure``: the same table measured here (:mod:`oases_ds.bench.policies`): LLaMA h1024, 4 layers,
seq 512, micro-batch 4, fp32, TMP 2 gloo ranks, link EMULATED at 1 Gbit/s; limits are the measured
peaks of the all-store and all-recompute plans and their midpoint; steps interleaved in one launch.

    python benchmarks/recompute_policies.py                 # 48 layers, writes benchmarks/results/recompute_policies_analytic.json
    python benchmarks/recompute_policies.py --layers 8 --out /tmp/r.json
    python benchmarks/recompute_policies.py --measure       # h1024 measured (~6 min), results/recompute_policies_measured.json
    python benchmarks/recompute_policies.py --report-only   # the dated report from the stored JSONs (measured + analytic)
    python benchmarks/recompute_policies.py --measure --quick --out /tmp/q.json   # h128: the path only, numbers mean nothing
    python benchmarks/recompute_policies.py --measure --devices 1 --size h2048 --micro-batch 8 --out gpu.json  # one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.models.config import ModelConfig  # noqa: E402
from oases_ds.parallel.link import link_from_config  # noqa: E402
from oases_ds.planner.analytic import ACTIVATION_BYTES, DeviceModel, analytic_table  # noqa: E402
from oases_ds.planner.memory import estimate_memory  # noqa: E402
from oases_ds.planner.objective import predict_memory_bytes  # noqa: E402
from oases_ds.planner.plan import Plan  # noqa: E402
from oases_ds.planner.planning import PlanRequest, load_table, make_plan  # noqa: E402
from oases_ds.planner.profile import ProfileSpec  # noqa: E402
from oases_ds.planner.replay import replay_plan  # noqa: E402
from oases_ds.schedule.generators import ScheduleSpec  # noqa: E402
from oases_ds.utils.io import write_json_atomic, write_text_atomic  # noqa: E402

CONFIGS = os.path.join(ROOT, "oases_ds", "configs")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "recompute_policies_analytic.json")
MEASURED_OUT = os.path.join(ROOT, "benchmarks", "results", "recompute_policies_measured.json")
ANALYTIC_OUTS = [DEFAULT_OUT, os.path.join(ROOT, "benchmarks", "results", "recompute_policies_analytic-eth_25g.json")]
MiB = 2**20


def _measured_sizes() -> dict[str, dict]:
    from oases_ds.bench.e2e import FULL_MODEL

    # h2048: for a GPU, where h1024 steps are short enough for host overhead to matter
    return {"h1024": FULL_MODEL, "h2048": dict(FULL_MODEL, hidden_size=2048, num_heads=16, ffn_size=5632,
                                               num_layers=8, seq_len=1024)}


MEASURED_SIZES = _measured_sizes()


def _yaml(group: str, name: str) -> dict:
    with open(os.path.join(CONFIGS, group, f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def _request(model: ModelConfig, cluster: dict, devices: int, micro_batch: int, min_degree: int,
             limit: float | None, schedule: ScheduleSpec = ScheduleSpec()) -> PlanRequest:
    spec = ProfileSpec(model=model, devices=devices, micro_batch=micro_batch, schedule=schedule,
                       link=link_from_config(cluster["link"]), cluster=cluster["name"], min_degree=min_degree)
    return PlanRequest(profile=spec, cost="analytic", device=DeviceModel.from_cluster(cluster), cache_dir=None,
                       memory_limit_bytes=limit, recompute="auto" if schedule.name == "oases" else "oases")


def run(layers: int, devices: int, micro_batch: int, min_degree: int, cluster_name: str) -> dict:
    model = dataclasses.replace(ModelConfig(**_yaml("model", "gpt_39_1b")), num_layers=layers)
    cluster = _yaml("cluster", cluster_name)
    table = load_table(_request(model, cluster, devices, micro_batch, min_degree, None)).table
    none_table = analytic_table(_request(model, cluster, devices, micro_batch, min_degree, None,
                                         ScheduleSpec("none")).profile, DeviceModel.from_cluster(cluster), layers)
    blocks = 2 * layers

    def uniform(degree: int, policy: str) -> Plan:
        return Plan.from_block_degrees([degree] * blocks, devices, [policy] * blocks, solver_name="uniform")

    # the uniform oases plan the planner would pick unbounded among one-degree plans: the baseline
    baseline = min(table.degrees, key=lambda d: replay_plan(table, uniform(d, "oases")).step_ms)

    def peak(plan: Plan) -> float:
        schedule = dataclasses.replace(table.schedule, stored_blocks=plan.stored_blocks())
        return estimate_memory(model, plan.attn_degrees, plan.mlp_degrees, devices, micro_batch, schedule,
                               ACTIVATION_BYTES).peak_bytes

    store_all, oases_all = uniform(baseline, "store"), uniform(baseline, "oases")
    high, low = predict_memory_bytes(table, store_all), predict_memory_bytes(table, oases_all)
    oases_ms, store_ms = replay_plan(table, oases_all).step_ms, replay_plan(table, store_all).step_ms
    none_ms = replay_plan(none_table, Plan.uniform(devices, layers, baseline)).step_ms
    rows = []
    for label, limit in (("store-everything", high), ("midpoint", (high + low) / 2), ("recompute-everything", low)):
        plan = make_plan(_request(model, cluster, devices, micro_batch, min_degree, limit)).plan
        planned_ms = replay_plan(table, plan).step_ms
        gap = oases_ms - none_ms
        rows.append({
            "limit": label, "limit_bytes": limit, "plan": plan.as_table().splitlines(),
            "stored_blocks": len(plan.stored_blocks()), "blocks": blocks,
            "planned_ms": planned_ms, "oases_ms": oases_ms, "none_ms": none_ms, "store_all_ms": store_ms,
            "planned_over_none": planned_ms / none_ms,
            "gap_closed": (oases_ms - planned_ms) / gap if gap > 0 else None,
            "gap_closed_vs_store_all": (oases_ms - planned_ms) / (oases_ms - store_ms) if oases_ms > store_ms else None,
            "plan_bound_bytes": plan.memory_bytes, "plan_replayed_peak_bytes": peak(plan),
        })
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "what": "simulated (cost=analytic), nothing measured", "model": "gpt_39_1b", "layers": layers,
        "cluster": cluster_name, "devices": devices, "micro_batch": micro_batch, "min_degree": min_degree,
        "baseline_degree": baseline, "table": table.key(),
        "note": "limits: the planner's memory bound of the uniform all-store and all-oases plans at the baseline "
                "degree and their midpoint; steps replayed over the analytic per-op costs; none = schedule none "
                "(no recompute, blocking collectives) at the baseline degree; store_all = every block stored at the "
                "baseline degree (no recompute, overlapped); gap_closed = (oases - planned) / (oases - none), null "
                "where none is not faster than oases; gap_closed_vs_store_all likewise against store_all",
        "rows": rows,
    }


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _share(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _measured_section(result: dict, path: str) -> list[str]:
    """The measured table, the spread of the steps it rests on and the issue's three targets, every
    number computed from ``result`` (a ``--measure`` JSON)."""
    from oases_ds.bench.policies import slower_rank_steps

    per_step = {v: slower_rank_steps(per_rank) for v, per_rank in result["step_ms"].items()}
    median = {v: statistics.median(xs) for v, xs in per_step.items()}
    model = result["model"]
    lines = [f"## Measured: {model['family']} h{model['hidden_size']}, {model['num_layers']} layers, "
             f"seq {model['seq_len']}, micro-batch {result['micro_batch']}",
             "",
             f"`{_rel(path)}` ({result['time'][:10]}): {result['what']}; {result['warmup']} warm-up and "
             f"{result['repeats']} timed steps per variant, the variants interleaved in one launch of "
             f"{result['wall_s']:.0f} s.  Limits: the measured peaks of uniform all-`store` and all-`oases` "
             "(TMP at the full group), their midpoint, and the planner's own bound of the all-`oases` plan.",
             "",
             "| limit | MiB | stored | planned ms | oases ms | none ms | all-store ms | planned / none | "
             "planned / all-store | gap closed vs all-store | measured peak MiB | bound error | replay error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "infeasible" in r:
            lines.append(f"| {r['limit']} | {r['limit_bytes'] / MiB:.1f} | no plan | " + " | ".join(["-"] * 10) + " |")
            continue
        lines.append(
            f"| {r['limit']} | {r['limit_bytes'] / MiB:.1f} | {r['stored_blocks']}/{r['blocks']} | "
            f"{r['planned_ms']:.0f} | {r['oases_ms']:.0f} | {r['none_ms']:.0f} | {r['all_store_ms']:.0f} | "
            f"{r['planned_over_none']:.3f} | {r['planned_over_all_store']:.3f} | {_share(r['gap_closed_vs_all_store'])} | "
            f"{r['measured_peak_bytes'] / MiB:.1f} | {r['bound_error']:+.1%} | {r['replay_error']:+.1%} |")
    lines += ["", "Plans (degree and policy per block):", ""]
    lines += [f"- {r['limit']} (`{r['variant']}`): " + "; ".join(r["plan"]) for r in result["rows"] if "plan" in r]
    lines += ["", "Steps per variant (the slower rank's, ms): median (min-max), spread = (max - min) / median:", ""]
    lines += [f"- {v}: {median[v]:.0f} ({min(xs):.0f}-{max(xs):.0f}), spread {(max(xs) - min(xs)) / median[v]:.0%}"
              for v, xs in per_step.items()]
    lines += ["", "### Against the issue's targets", ""]
    rows = {r["limit"]: r for r in result["rows"]}
    gap = abs(median["oases"] - median["none"]) / median["oases"]
    spread = min((max(per_step[v]) - min(per_step[v])) / median[v] for v in ("oases", "none"))
    lines.append(f"- `none` (blocking collectives, nothing recomputed) is {median['none'] / median['oases']:.3f}x "
                 f"uniform `oases` here: the gap between them is {gap:.1%} of a step, "
                 + (f"inside the smaller of their spreads ({spread:.0%}), so a share of it closed is not a "
                    "measurement; the gap to uniform all-`store`"
                    if gap < spread else f"outside their spreads ({spread:.0%}); beside it, the gap to uniform all-`store`")
                 + f" (every block stored, overlapped; {median['all-store'] / median['oases']:.3f}x `oases`) is the "
                 "one a plan can close.")
    if "store-everything" in rows and "planned_ms" in rows["store-everything"]:
        r = rows["store-everything"]
        lines.append(f"- store-everything limit: the plan stores {r['stored_blocks']}/{r['blocks']} blocks, "
                     f"{r['planned_over_none']:.3f}x `none` (target <= 1.03x) and {r['planned_over_all_store']:.3f}x "
                     "all-`store`.")
    if "midpoint" in rows and "planned_ms" in rows["midpoint"]:
        r = rows["midpoint"]
        lines.append(f"- midpoint: closes {r['gap_closed_vs_all_store']:.2f} of the gap from `oases` to all-`store` "
                     "(target >= 0.5 of the gap to `none`).")
    low = rows.get("recompute-everything")
    if low is not None:
        if "infeasible" in low:
            bound = rows.get("recompute-everything-bound", {})
            lines.append("- recompute-everything limit (the measured all-`oases` peak): no plan, because the planner "
                         "holds a plan to its memory bound, which lies above the measured peak "
                         + (f"(for that plan by {bound['bound_error']:+.1%})" if "bound_error" in bound else "")
                         + "; at that bound it plans "
                         + (f"{bound['stored_blocks']}/{bound['blocks']} stored blocks, the uniform `oases` plan."
                            if bound.get("stored_blocks") == 0 else "a plan that stores blocks."))
        else:
            lines.append(f"- recompute-everything limit: {low['stored_blocks']}/{low['blocks']} stored.")
    group = len(result["uniform_peaks"])  # one entry per rank of the TMP group
    uniform_oases = Plan.uniform(group, model["num_layers"], group).as_table().splitlines()
    twin = next((r for r in result["rows"] if r.get("plan") == uniform_oases and r["variant"] != "oases"), None)
    if twin is not None:  # the plan is the uniform oases plan, timed a second time under its own name
        a, b = median[twin["variant"]], median["oases"]
        lines.append(f"- `{twin['variant']}` is the uniform `oases` plan timed a second time: {a:.0f} against {b:.0f} "
                     f"ms, {abs(a - b) / max(a, b):.0%} apart, the repeatability of this run (A/A).")
    return lines


def _analytic_section(result: dict, path: str) -> list[str]:
    """The simulated table of a plain run's JSON."""
    lines = [f"## Simulated: {result['model']} ({result['layers']} layers), TMP {result['devices']} on "
             f"`{result['cluster']}`, micro-batch {result['micro_batch']}",
             "",
             f"`{_rel(path)}` ({result['time'][:10]}): {result['what']}; uniform baseline degree "
             f"{result['baseline_degree']}, planner.min_degree {result['min_degree']}.",
             "",
             "| limit | GiB | stored | planned ms | oases ms | none ms | all-store ms | planned / none | "
             "gap closed vs none | gap closed vs all-store | plan bound GiB | replayed peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gib = 2**30
    for r in result["rows"]:
        lines.append(
            f"| {r['limit']} | {r['limit_bytes'] / gib:.1f} | {r['stored_blocks']}/{r['blocks']} | {r['planned_ms']:.0f} | "
            f"{r['oases_ms']:.0f} | {r['none_ms']:.0f} | {r['store_all_ms']:.0f} | {r['planned_over_none']:.3f} | "
            f"{_share(r['gap_closed'])} | {_share(r['gap_closed_vs_store_all'])} | {r['plan_bound_bytes'] / gib:.1f} | "
            f"{r['plan_replayed_peak_bytes'] / gib:.1f} |")
    return lines


def report(measured_path: str, analytic_paths: list[str]) -> str:
    """The Markdown report of the stored JSONs; the fixed text says what was done, never a number."""
    with open(measured_path) as f:
        measured = json.load(f)
    lines = ["# Recompute-aware planning: store, or recompute, per block",
             "",
             "With `planner.recompute=auto` the planner chooses each attention and MLP block's policy, `store` "
             "(activations kept, no recompute) or `oases` (fine-grained recompute), with its TMP degree, for a "
             "memory limit.  Below: the plan it makes at each limit, timed beside the uniform plans in one "
             "interleaved launch, with its predicted peak (the planner's bound and the memory replay) against "
             "the measured one; then the same study simulated with `cost=analytic`.  "
             "Generated by `python benchmarks/recompute_policies.py --report-only`.",
             ""]
    lines += _measured_section(measured, measured_path)
    for path in analytic_paths:
        if os.path.exists(path):
            with open(path) as f:
                lines += [""] + _analytic_section(json.load(f), path)
    return "\n".join(lines) + "\n"


def write_report(measured_path: str, analytic_paths: list[str], out: str | None = None) -> str:
    with open(measured_path) as f:
        date = json.load(f)["time"][:10]
    out = out or os.path.join(ROOT, "benchmarks", "reports", f"recompute_policies-{date}.md")
    write_text_atomic(out, report(measured_path, analytic_paths))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--devices", type=int, default=None,
                        help="the TMP group: 8 when simulating; with --measure 2 (1: one GPU, policies only)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--min-degree", type=int, default=4)
    parser.add_argument("--cluster", default="pcie_3090")
    parser.add_argument("--out", default=None)
    parser.add_argument("--measure", action="store_true", help="measure here (EMULATED link) instead of simulating")
    parser.add_argument("--quick", action="store_true", help="with --measure: h128 dims, checks the path")
    parser.add_argument("--gbps", type=float, default=1.0, help="with --measure: the emulated link")
    parser.add_argument("--repeats", type=int, default=5, help="with --measure: timed steps per variant")
    parser.add_argument("--size", choices=sorted(MEASURED_SIZES), default="h1024", help="with --measure: the model")
    parser.add_argument("--report-only", action="store_true",
                        help="write benchmarks/reports/recompute_policies-<date>.md from the stored JSONs")
    parser.add_argument("--report", default=None, help="with --report-only: where the report goes")
    args = parser.parse_args(argv)
    if args.report_only:
        print(f"wrote {write_report(args.out or MEASURED_OUT, ANALYTIC_OUTS, args.report)}")
        return None
    if args.measure:
        args.devices = args.devices or 2
        return measured(args)
    args.devices = args.devices or 8
    args.out = args.out or DEFAULT_OUT
    result = run(args.layers, args.devices, args.micro_batch, args.min_degree, args.cluster)
    write_json_atomic(args.out, result, indent=2)
    mib = 2**20
    print(f"{result['model']} {args.layers} layers, TMP {args.devices} on {args.cluster}, micro-batch "
          f"{args.micro_batch}, SIMULATED (cost=analytic); uniform baseline degree {result['baseline_degree']}")
    print(f"{'limit':22} {'MiB':>9} {'stored':>7} {'planned ms':>11} {'oases ms':>9} {'none ms':>9} {'store ms':>9} "
          f"{'/none':>6} {'closed(none)':>12} {'closed(store)':>13} {'bound MiB':>10} {'replayed MiB':>12}")

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for r in result["rows"]:
        print(f"{r['limit']:22} {r['limit_bytes'] / mib:9.0f} {r['stored_blocks']:>3}/{r['blocks']:<3} "
              f"{r['planned_ms']:11.1f} {r['oases_ms']:9.1f} {r['none_ms']:9.1f} {r['store_all_ms']:9.1f} "
              f"{r['planned_over_none']:6.3f} {share(r['gap_closed']):>12} {share(r['gap_closed_vs_store_all']):>13} "
              f"{r['plan_bound_bytes'] / mib:10.0f} {r['plan_replayed_peak_bytes'] / mib:12.0f}")
    print(f"wrote {args.out}")


def measured(args: argparse.Namespace) -> None:
    from oases_ds.bench import e2e
    from oases_ds.bench.policies import measure

    out = args.out or MEASURED_OUT
    model = e2e.QUICK_MODEL if args.quick else MEASURED_SIZES[args.size]
    result = measure(model, micro_batch=args.micro_batch, gbps=args.gbps, repeats=args.repeats, devices=args.devices,
                     cache_dir=None if args.quick else ".oases/profiles")
    write_json_atomic(out, result, indent=2)
    mib = 2**20
    print(f"{result['what']}; {result['table_source']}; {result['wall_s']:.0f} s")
    for r in result["rows"]:
        if "infeasible" in r:
            print(f"{r['limit']:22} {r['limit_bytes'] / mib:9.1f} MiB: {r['infeasible']}")
            continue
        def share(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        print(f"{r['limit']:26} {r['limit_bytes'] / mib:7.1f} MiB  stored {r['stored_blocks']}/{r['blocks']}  planned "
              f"{r['planned_ms']:.0f} ms  oases {r['oases_ms']:.0f}  none {r['none_ms']:.0f}  all-store "
              f"{r['all_store_ms']:.0f}  /none {r['planned_over_none']:.3f}  gap closed vs none "
              f"{share(r['gap_closed'])}, vs all-store {share(r['gap_closed_vs_all_store'])}  peak "
              f"{r['measured_peak_bytes'] / mib:.1f} MiB, bound {r['bound_error']:+.1%}, replay {r['replay_error']:+.1%}"
              + (f"; allocator {r['allocator_peak_bytes'] / mib:.1f} MiB, bound {r['allocator_bound_error']:+.1%}, "
                 f"replay {r['allocator_replay_error']:+.1%}" if "allocator_peak_bytes" in r else ""))
    print("spread (max - min) / median of each variant's steps: "
          + ", ".join(f"{k} {v:.0%}" for k, v in result["spread"].items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
