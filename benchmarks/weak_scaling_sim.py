"""Weak scaling beyond this machine: SIMULATED from the measured DP 1 step.

The weak-scaling study (``oases-bench --multirun experiment=weak_scaling``) measures
TMP 2 x DP 1 and x DP 2; more DP ranks do not fit on 2 cores.  Under weak scaling
each DP rank keeps its micro-batch, so a TMP group's own step is what DP 1
measured; what grows with the DP degree N is the gradient reduction the engine
runs after backward (not overlapped, for every schedule alike): a ring AllReduce
of the TMP shard's gradients, ``2 (N-1)/N x bytes`` on the link, plus
``2 (N-1)`` latencies.  So the simulated step is ``measured DP-1 step +
ring AllReduce time(N)`` on the study's emulated link.  Everything this prints
beyond DP 1 is SIMULATED; the measured DP 2 point is shown next to it -- on this
machine 4 processes share 2 cores, which the simulation does not model.

    python benchmarks/weak_scaling_sim.py        # reads benchmarks/results/bench.jsonl

With pipeline stages (the paper runs its large models PP x TMP x DP): ``--stages``
profiles one layer per schedule on this machine (the planner's profiler, cached in
``.oases/profiles``), learns for every PP the stage split and each stage's TMP degrees
from those measured costs (:func:`oases_ds.planner.stages.plan_stages`), and tabulates
PP x TMP x DP: the 1F1B step plus the DP gradient reduction of the largest stage.  All
of it SIMULATED.  The measured points (``oases-bench --multirun experiment=weak_scaling_stages``:
PP 1 and 2 x TMP 2, EMULATED link) sit beside the simulated rows through
:func:`measured_pipeline_steps`, only when they ran the same model, micro-batch and m.

    python benchmarks/weak_scaling_sim.py --stages --pp 1,2,4 --dp 1,2,4,8,16,32,64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from datetime import date

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.models.config import ModelConfig  # noqa: E402
from oases_ds.models.operator_model import OperatorModel  # noqa: E402
from oases_ds.parallel.link import LinkModel  # noqa: E402
from oases_ds.bench.provenance import git_commit, machine  # noqa: E402
from oases_ds.bench.spec import load_preset  # noqa: E402
from oases_ds.planner.costs import STATE_BYTES_PER_PARAM, CostTable  # noqa: E402
from oases_ds.planner.profile import ProfileSpec, profile  # noqa: E402
from oases_ds.planner.stages import PipelineSpec, p2p_ms, plan_stages  # noqa: E402
from oases_ds.schedule.generators import ScheduleSpec  # noqa: E402
from oases_ds.utils.io import write_json_atomic, write_text_atomic  # noqa: E402


def shard_grad_bytes(cfg: ModelConfig, tp: int) -> int:
    """fp32 gradient bytes one TMP rank holds (replicated parameters in full)."""
    model = OperatorModel(cfg)
    return sum(4 * (p.numel() // tp if getattr(p, "tp_dim", None) is not None else p.numel())
               for p in model.parameters())


def dp_reduce_s(link: LinkModel, grad_bytes: float, ranks: int) -> float:
    """Ring AllReduce of ``grad_bytes`` over ``ranks`` DP ranks: ``2 (N-1)/N x bytes`` on the link
    and ``2 (N-1)`` latencies (the link model charges one); 0 for one rank."""
    if ranks == 1:
        return 0.0
    return link.seconds("all_reduce", grad_bytes, ranks) + max(0, 2 * (ranks - 1) - 1) * link.latency_us * 1e-6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "bench.jsonl"))
    parser.add_argument("--dp", default="1,2,4,8,16,32,64")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "reports"))
    parser.add_argument("--json-out", default=os.path.join(ROOT, "benchmarks", "results", "weak_scaling_simulated.json"))
    stages = parser.add_argument_group("--stages: PP x TMP x DP from per-layer costs profiled here")
    stages.add_argument("--stages", action="store_true", help="the pipeline-stage study instead of the DP one")
    stages.add_argument("--pp", default="1,2,4")
    stages.add_argument("--tmp", type=int, default=2)
    stages.add_argument("--layers", type=int, default=8)
    stages.add_argument("--model", default="gpt_small")
    stages.add_argument("--cluster", default="cpu_fixed_link")
    stages.add_argument("--schedules", default="megatron,oases")
    stages.add_argument("--micro-batch", type=int, default=8)
    stages.add_argument("--micro-batches", type=int, default=8, help="m per pipeline and step")
    stages.add_argument("--warmup", type=int, default=1)
    stages.add_argument("--repeats", type=int, default=5)
    stages.add_argument("--degrees", choices=("uniform", "learnt"), default="uniform",
                        help="uniform: every block at TMP degree --tmp, as the measured runs (oases-bench) train; "
                             "learnt: plan_stages also picks each block's degree")
    stages.add_argument("--sharing", default="ring",
                        help="link sharing for the profile; ring is oases-bench's default, so the measured column ran with it")
    stages.add_argument("--cache-dir", default=os.path.join(ROOT, ".oases", "profiles"))
    stages.add_argument("--timeout-s", type=float, default=900.0)
    stages.add_argument("--stages-json-out",
                        default=os.path.join(ROOT, "benchmarks", "results", f"{STAGE_REPORT}.json"))
    args = parser.parse_args(argv)
    if args.stages:
        stages_main(args)
        return
    with open(args.results) as f:
        records = [json.loads(line) for line in f if '"weak_scaling"' in line]
    by_dp = {r["data_parallel_size"]: r for r in records if r["study"] == "weak_scaling"}
    if 1 not in by_dp:
        sys.exit("error: no weak_scaling record with data_parallel_size=1; run oases-bench --multirun experiment=weak_scaling")
    base = by_dp[1]
    emu = base["link_emulation"]
    link = LinkModel(emu["emulated_bandwidth_gbps"], emu["emulated_latency_us"])
    cfg = ModelConfig(**base["config"]["model"])
    tp = base["tensor_parallel_size"]
    grad_bytes = shard_grad_bytes(cfg, tp)
    schedules = list(base["variants"])
    rows = []
    for n in (int(x) for x in args.dp.split(",")):
        reduce_s = dp_reduce_s(link, grad_bytes, n)
        row = {"dp": n, "reduce_s": reduce_s, "simulated": n > 1}
        for name in schedules:
            step = base["variants"][name]["median_s"] + reduce_s
            row[name] = {"step_s": step, "tokens_per_s": n * base["variants"][name]["tokens_per_step"] / step}
            if n in by_dp and n > 1:
                row[name]["measured_step_s"] = by_dp[n]["variants"][name]["median_s"]
        rows.append(row)
    today = date.today().isoformat()
    lines = [
        "# Weak scaling over DP, SIMULATED beyond DP 1 (paper Fig. 10)", "",
        f"Generated by `python benchmarks/weak_scaling_sim.py` on {today} from the measured TMP {tp} x DP 1 record "
        f"(git {base['git_commit'][:10]}).", "",
        f"- model: {cfg.family} h={cfg.hidden_size} L={cfg.num_layers} s={cfg.seq_len}, micro-batch "
        f"{base['variants'][schedules[0]]['micro_batch']} per DP rank (global batch grows with DP)",
        f"- link: EMULATED {link.bandwidth_gbps:g} Gbit/s, {link.latency_us:g} us (cluster "
        f"`{emu['cluster']['name']}`); gradient bytes per TMP rank {grad_bytes / 2**20:.2f} MiB (fp32)",
        "- simulated step = measured DP-1 step + ring AllReduce of the gradients over N ranks "
        "(2(N-1)/N x bytes / bandwidth + latencies); not overlapped with backward, as in the engine",
        "- **every DP > 1 number below is SIMULATED**; the measured DP 2 step is shown for contrast (4 processes "
        "on 2 cores there, which the simulation does not model)", "",
        "| DP | reduce s | " + " | ".join(f"{s} step s | {s} tokens/s" for s in schedules)
        + " | oases vs megatron | scaling efficiency (oases) |",
        "|---|---|" + "---|---|" * len(schedules) + "---|---|",
    ]
    first = rows[0]
    for row in rows:
        cells = []
        for s in schedules:
            measured = row[s].get("measured_step_s")
            step = f"{row[s]['step_s']:.3f}" + (f" (measured {measured:.3f})" if measured else "")
            cells.append(f"{step} | {row[s]['tokens_per_s']:,.0f}")
        ratio = row["megatron"]["step_s"] / row["oases"]["step_s"] if "megatron" in row and "oases" in row else float("nan")
        eff = row["oases"]["tokens_per_s"] / (row["dp"] * first["oases"]["tokens_per_s"]) if "oases" in row else float("nan")
        label = f"{row['dp']}{' (sim)' if row['simulated'] else ''}"
        lines.append(f"| {label} | {row['reduce_s']:.3f} | " + " | ".join(cells) + f" | {ratio:.2f}x | {eff:.0%} |")
    lines += ["", "The DP reduction adds the same absolute time to every schedule, so Oases' advantage over "
              "Megatron shrinks as N grows -- as in the paper, where DP scales well for both.", ""]
    path = os.path.join(args.out_dir, f"weak_scaling_simulated-{today}.md")
    write_text_atomic(path, "\n".join(lines))
    write_json_atomic(args.json_out, {"simulated": True, "grad_bytes": grad_bytes, "link": emu, "rows": rows})
    print("\n".join(lines))
    print(f"wrote {path}")




# -- stages: PP x TMP x DP, SIMULATED from measured per-layer costs ------------------------------
STAGE_REPORT = "weak_scaling_stages_simulated"
MEASURED_HOOK = ("the measured column: median steps of oases-bench records with `pipeline_stages` "
                 "(`oases-bench --multirun experiment=weak_scaling_stages`) of the same model, micro-batch and m, "
                 "on this 2-core machine with an EMULATED link -- \"not measured\" where none ran")


def record_dims(record: dict, variant: dict) -> dict:
    """What a measured step must share with a simulated row to stand beside it."""
    model = record.get("config", {}).get("model", {})
    return {"family": model.get("family"), "hidden_size": model.get("hidden_size"),
            "num_layers": model.get("num_layers"), "seq_len": model.get("seq_len"),
            "tmp": record.get("tensor_parallel_size"), "micro_batch": variant.get("micro_batch"),
            "micro_batches": record.get("pipeline_micro_batches")}


def measured_pipeline_steps(path: str, dims: dict | None = None) -> dict[tuple[str, int, int], float]:
    """The measured points: (schedule, PP, DP) -> median step s of every oases-bench record
    that says how many ``pipeline_stages`` it ran (records from before the pipeline runtime
    do not, and ran one micro-batch per step); with ``dims``, only records whose
    :func:`record_dims` agree with it on every key it names.  A later record wins."""
    found: dict[tuple[str, int, int], float] = {}
    if not os.path.exists(path):
        return found
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            stages = record.get("pipeline_stages") or record.get("config", {}).get("pipeline_stages")
            if not stages:
                continue
            for name, variant in record.get("variants", {}).items():
                have = record_dims(record, variant)
                if dims and any(have[k] != v for k, v in dims.items()):
                    continue
                found[name, int(stages), int(record.get("data_parallel_size", 1))] = variant["median_s"]
    return found


def uniform_table(table: CostTable) -> CostTable:
    """``table`` with only its full degree T: every block at the TMP degree the measured runs use."""
    full = table.devices
    return replace(table, degrees=(full,), blocks={kind: {full: costs[full]} for kind, costs in table.blocks.items()})


def stage_rows(tables: dict, pp_list: list[int], dp_list: list[int], micro_batches: int, micro_batch: int,
               seq_len: int, link: LinkModel, measured: dict, degrees: str = "uniform") -> list[dict]:
    """For each schedule, PP and DP: the stage split learnt from the schedule's measured table
    (:func:`oases_ds.planner.stages.plan_stages`), its 1F1B step, plus the DP gradient
    all-reduce of the largest stage (stages reduce at once, each over its own DP group; not
    overlapped, as the engine runs it)."""
    rows = []
    for name, table in tables.items():
        table = uniform_table(table) if degrees == "uniform" else table
        for pp in pp_list:
            pipeline = PipelineSpec(pp, micro_batches, p2p_ms(table))
            staged = plan_stages(table, pipeline, None)
            grad_bytes = max(sum(table.blocks[kind][t].state_bytes for kind, t in
                                 zip(table.block_kinds(), stage.plan.block_degrees())) / STATE_BYTES_PER_PARAM * 4
                             for stage in staged.stages)
            for dp in dp_list:
                reduce_s = dp_reduce_s(link, grad_bytes, dp)
                step_s = staged.step_ms / 1e3 + reduce_s
                tokens = dp * micro_batches * micro_batch * seq_len
                rows.append({"schedule": name, "pp": pp, "tmp": table.devices, "dp": dp,
                             "devices": pp * table.devices * dp, "split": staged.layer_counts(), "degrees": degrees,
                             "stage_ms": [round(s.step_ms, 3) for s in staged.stages], "pipeline_ms": staged.step_ms,
                             "reduce_s": reduce_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
                             "measured_step_s": measured.get((name, pp, dp)), "simulated": True})
    return rows


def stages_main(args: argparse.Namespace) -> None:
    """PP x TMP x DP weak scaling, every number SIMULATED from per-layer costs measured here."""
    model = ModelConfig(**{**load_preset("model", args.model), "num_layers": args.layers})
    cluster = load_preset("cluster", args.cluster)
    link = LinkModel(**{**cluster["link"], "sharing": args.sharing})
    tables = {}
    for name in args.schedules.split(","):
        spec = ProfileSpec(model=model, devices=args.tmp, micro_batch=args.micro_batch,
                           schedule=ScheduleSpec.from_mapping(load_preset("schedule", name, key="--schedules")), link=link,
                           cluster=cluster["name"], warmup=args.warmup, repeats=args.repeats)
        tables[name], reused = profile(spec, args.layers, args.cache_dir, timeout_s=args.timeout_s)
        print(f"{name}: {'reused' if reused else 'profiled'} {tables[name].key()}", flush=True)
    pp_list = [int(x) for x in args.pp.split(",")]
    dp_list = [int(x) for x in args.dp.split(",")]
    dims = {"family": model.family, "hidden_size": model.hidden_size, "num_layers": model.num_layers,
            "seq_len": model.seq_len, "tmp": args.tmp, "micro_batch": args.micro_batch,
            "micro_batches": args.micro_batches}
    rows = stage_rows(tables, pp_list, dp_list, args.micro_batches, args.micro_batch, model.seq_len, link,
                      measured_pipeline_steps(args.results, dims), args.degrees)
    today = date.today().isoformat()
    load = os.getloadavg()[0]
    lines = [
        "# Weak scaling with pipeline stages (PP x TMP x DP), SIMULATED", "",
        f"Generated by `python benchmarks/weak_scaling_sim.py --stages` on {today} (git {git_commit()[:10]}, "
        f"load average {load:.1f} on {os.cpu_count()} CPUs now; tables profiled at "
        f"{', '.join(str(t.measurements.get('profiled_at', '?')) for t in tables.values())}).", "",
        f"- per-layer costs MEASURED here: one {model.family} layer (h={model.hidden_size}, s={model.seq_len}) profiled "
        f"at every TMP degree of {args.tmp} ranks, micro-batch {args.micro_batch}, EMULATED link "
        f"{link.bandwidth_gbps:g} Gbit/s + {link.latency_us:g} us (cluster `{cluster['name']}`); "
        f"table keys: {', '.join(t.key() for t in tables.values())}",
        f"- a {args.layers}-layer model; for each PP the stage split"
        + (" and each stage's TMP degrees are" if args.degrees == "learnt" else f" is (every block at TMP degree {args.tmp}, as "
           "the measured runs train)") + " LEARNT from those costs by `oases_ds.planner.stages.plan_stages` (exact; no memory "
        f"limit; head/embedding not in a profile: 0); link sharing `{args.sharing}`",
        f"- step = 1F1B over m = {args.micro_batches} micro-batches (sum of stage times + (m-1) x slowest, p2p on the same "
        f"link) + ring AllReduce of the largest stage's fp32 gradients over DP ranks (not overlapped)",
        "- weak scaling: every DP replica keeps m micro-batches, so the global batch grows with DP",
        "- the step times are the planner's cost model over the profiled per-layer costs (what the stage planner "
        "optimises), not measured steps: compare Oases with Megatron through measured runs, not through this table",
        f"- **every number is SIMULATED**; {MEASURED_HOOK}", "",
        "| schedule | PP x TMP x DP | devices | split | stage ms | 1F1B step ms | DP reduce s | step s | tokens/s "
        "| efficiency vs DP 1 | measured step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["schedule"], r["pp"]): r for r in rows if r["dp"] == dp_list[0]}
    for r in rows:
        first = base[r["schedule"], r["pp"]]
        eff = r["tokens_per_s"] / (r["dp"] / first["dp"] * first["tokens_per_s"])
        measured = "not measured" if r["measured_step_s"] is None else f"{r['measured_step_s']:.3f}"
        lines.append(f"| {r['schedule']} | {r['pp']} x {r['tmp']} x {r['dp']} | {r['devices']} | {r['split']} | "
                     f"{', '.join(f'{t:.1f}' for t in r['stage_ms'])} | {r['pipeline_ms']:.1f} | {r['reduce_s']:.3f} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {eff:.0%} | {measured} |")
    if "oases" in tables and "megatron" in tables:
        lines += ["", "Oases vs Megatron (same PP x TMP x DP, simulated step ratio): " + ", ".join(
            f"{a['pp']}x{a['tmp']}x{a['dp']} {b['step_s'] / a['step_s']:.2f}x"
            for a in rows if a["schedule"] == "oases"
            for b in rows if b["schedule"] == "megatron" and (b["pp"], b["dp"]) == (a["pp"], a["dp"]))]
    points = sorted({(r["pp"], r["dp"]) for r in rows if r["measured_step_s"] is not None})
    if "oases" in tables and "megatron" in tables and points:
        step = {(r["schedule"], r["pp"], r["dp"]): r["measured_step_s"] for r in rows}
        lines += ["", f"MEASURED on this machine (EMULATED link, {os.cpu_count()} shared CPUs; `{args.results}`), "
                  "Oases vs Megatron median step ratio: " + ", ".join(
                      f"{pp}x{args.tmp}x{dp} {step['megatron', pp, dp] / step['oases', pp, dp]:.2f}x "
                      f"({step['megatron', pp, dp]:.3f} s / {step['oases', pp, dp]:.3f} s)"
                      for pp, dp in points if step.get(("megatron", pp, dp)) and step.get(("oases", pp, dp)))]
    lines.append("")
    path = os.path.join(args.out_dir, f"{STAGE_REPORT}-{today}.md")
    write_text_atomic(path, "\n".join(lines))
    write_json_atomic(args.stages_json_out, {"simulated": True, "date": today, "git_commit": git_commit(),
                                             "machine": machine(), "load_avg": os.getloadavg(), "args": vars(args),
                                             "tables": {n: t.key() for n, t in tables.items()}, "rows": rows})
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
