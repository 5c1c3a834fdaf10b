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
    python benchmarks/recompute_policies.py --measure       # h1024 measured (~15 min), results/recompute_policies_measured.json
    python benchmarks/recompute_policies.py --measure --quick --out /tmp/q.json   # h128: the path only, numbers mean nothing
    python benchmarks/recompute_policies.py --measure --devices 1 --size h2048 --micro-batch 8 --out gpu.json  # one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
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
from oases_ds.utils.io import write_json_atomic  # noqa: E402

CONFIGS = os.path.join(ROOT, "oases_ds", "configs")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "recompute_policies_analytic.json")
MEASURED_OUT = os.path.join(ROOT, "benchmarks", "results", "recompute_policies_measured.json")


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
    args = parser.parse_args(argv)
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
