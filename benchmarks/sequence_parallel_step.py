"""Sequence parallelism: step time and TMP bytes against the same policy without it, interleaved.

Not a test: ``python benchmarks/sequence_parallel_step.py`` (``--report-only`` rewrites the report's
table from the result file; ``--quick`` runs tiny dims to check the path, numbers mean nothing).

What (issue 40): LLaMA h1024, 16 heads, 4 layers, seq 512, micro-batch 4, fp32, no dropout,
TMP 2 on 2 gloo ranks of this machine, the Oases schedule with every block under one policy --
``store``, ``oases`` (without sequence parallelism: recompute from the block's output; with it:
re-gather the 1/t checkpoint) and, with sequence parallelism, ``oases_gathered`` -- with and
without ``sequence_parallel``, on a link EMULATED at 1 Gbit/s and at 200 Mbit/s (the real
collective, held until the link model's deadline: :class:`~oases_ds.parallel.link.LinkEmulator`).

How: :func:`oases_ds.bench.measure.measure_rank`, every variant in each round in rotated order
(one launch per link), the slowest rank's step per round, medians; TMP bytes per step are the
communicator's payload bytes of one step, summed over forward, recompute and backward, and the
link's wire bytes (an AllReduce moves ``2(t-1)/t`` of its payload, a ReduceScatter or an AllGather
``(t-1)/t``).  Targets: ``store`` with sequence parallelism at most 1.05x the step of ``store``
without it, at the same wire bytes; ``oases`` with it at most 1.25x the wire bytes of ``oases``
without it.  Writes ``benchmarks/results/sequence_parallel_step.json`` and the table of the dated
report; every number there is read from the result file.
"""
from __future__ import annotations

import os
import statistics
import sys
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.bench.provenance import git_commit, machine, publish_study, stored_or_measured, study_arguments  # noqa: E402
from oases_ds.parallel.link import LinkModel  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "sequence_parallel_step.json")
MODEL = dict(family="llama", vocab_size=32000, hidden_size=1024, num_heads=16, num_layers=4, seq_len=512, dropout=0.0)
QUICK = dict(family="llama", vocab_size=256, hidden_size=64, num_heads=4, num_layers=2, seq_len=32, dropout=0.0)
LINKS = {"1gbit": 1.0, "200mbit": 0.2}
TP, MICRO_BATCH = 2, 4
VARIANTS = (  # label, policy of every block, sequence parallel
    ("store", "store", False), ("store+sp", "store", True),
    ("oases", "oases", False), ("oases+sp", "oases", True), ("oases_gathered+sp", "oases_gathered", True),
)


def spec_of(model: dict, gbps: float | None, repeats: int, warmup: int, variants: tuple = VARIANTS,
            micro_steps: int = 1) -> dict:
    """The ``measure_rank`` spec of ``variants`` (label, policy of every block, sequence parallel
    and optionally the sub-batches, else the schedule's default, and whether the step's
    ``micro_steps`` micro-batches run overlapped) at TMP 2, on a link emulated at ``gbps``
    (``None``: no emulation, the compute-only step)."""
    from oases_ds.bench.spec import bench_defaults, resolve

    defaults = bench_defaults()
    link = {"bandwidth_gbps": gbps, "latency_us": 0.0, "sharing": "ring"} if gbps else None
    cluster = {"name": "emulated" if gbps else "local", "link": link, "device": None, "tensor_parallel_size": None}
    spec = resolve({**defaults, "model": model, "schedules": ["oases"], "micro_batch": MICRO_BATCH, "micro_batches": [],
                    "tensor_parallel_size": TP, "data_parallel_size": 1, "warmup": warmup, "repeats": repeats,
                    "pipeline_micro_batches": micro_steps,
                    "gantt": False, "memory_probe": False, "seed": 0, "timeout_s": 1800, "cluster": cluster,
                    "emulation": {**defaults["emulation"], "mode": "literal" if gbps else "off"}})
    base = spec["variants"][0]
    every = list(range(2 * model["num_layers"]))

    def variant(label: str, policy: str, sp: bool, sub_batches: int | None = None, overlap: bool = False,
                hop_costs: dict | None = None) -> dict:
        return {**base, "label": label, "sequence_parallel": sp, "sub_batches": sub_batches or base["sub_batches"],
                "overlap_micro_batches": overlap, "hop_costs": hop_costs,
                "stored_blocks": every if policy == "store" else [],
                "gathered_blocks": every if policy == "oases_gathered" else []}

    spec["variants"] = [variant(*v) for v in variants]
    return spec


def wire_bytes(comm: dict) -> float:
    """Link bytes of one step from the communicator's ``phase/kind -> {calls, bytes}`` (TMP phases only)."""
    link = LinkModel(1.0)
    return sum(link.wire_bytes(key.split("/")[1], v["bytes"], TP) for key, v in comm.items()
               if key.split("/")[0] in ("forward", "recompute", "backward", "loss"))


TIMED_VARIANTS = (  # --timed: the plain variants of store and oases beside the same with per-op times
    ("store", "store", False), ("store+sp", "store", True), ("store+sp+timed", "store", True),
    ("oases", "oases", False), ("oases+sp", "oases", True), ("oases+sp+timed", "oases", True),
)


def profiled_hop_costs(model: dict, gbps: float) -> dict:
    """The per-op times a plan for ``model`` with sequence parallelism on this link would carry
    (``Plan.hop_costs``): the planner's profile of one layer at TMP 2 on this machine (``cost=profile``),
    its collectives priced on the link model at ``gbps``, as ``oases-plan`` would price them."""
    import dataclasses

    from oases_ds.models.config import ModelConfig
    from oases_ds.planner.profile import ProfileSpec, profile
    from oases_ds.planner.replay import hop_costs_of

    spec = ProfileSpec(model=ModelConfig(**model), devices=TP, micro_batch=MICRO_BATCH, link=LinkModel(gbps, 0.0),
                       cluster=f"emulated_{gbps:g}g", min_degree=TP, sequence_parallel=True)
    table, _ = profile(spec, model["num_layers"], cache_dir=None)
    return dataclasses.asdict(hop_costs_of(table))


def run(model: dict, repeats: int, warmup: int, timed: bool = False) -> dict:
    from oases_ds.bench.measure import measure_rank
    from oases_ds.launcher import launch

    out: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
                 "machine": machine(), "model": model, "tensor_parallel_size": TP, "micro_batch": MICRO_BATCH,
                 "dtype": "fp32", "repeats": repeats, "warmup": warmup, "links": {}}
    variants = TIMED_VARIANTS if timed else VARIANTS
    for link, gbps in LINKS.items():
        spec = spec_of(model, gbps, repeats, warmup, variants)
        if timed:
            hop_costs = profiled_hop_costs(model, gbps)
            out.setdefault("hop_costs", {})[link] = hop_costs
            for v in spec["variants"]:
                if v["label"].endswith("+timed"):
                    v["hop_costs"] = hop_costs
        ranks = launch(measure_rank, TP, (spec,), timeout_s=3600, threads_per_rank=1)
        rows = {}
        for label, policy, sp in variants:
            steps = [max(ts) for ts in zip(*(r["variants"][label]["step_s"] for r in ranks))]
            comm = ranks[0]["variants"][label]["comm_bytes"]
            rows[label] = {"policy": policy, "sequence_parallel": sp, "step_s": steps,
                           "step_s_median": statistics.median(steps), "comm_bytes": comm,
                           "payload_bytes": sum(v["bytes"] for k, v in comm.items()
                                                if k.split("/")[0] in ("forward", "recompute", "backward", "loss")),
                           "wire_bytes": wire_bytes(comm),
                           "exposed_comm_frac_median": statistics.median(
                               ranks[0]["variants"][label]["exposed_comm_frac"])}
            print(f"{link:8s} {label:18s} step {rows[label]['step_s_median']:.3f} s, wire "
                  f"{rows[label]['wire_bytes'] / 2**20:.1f} MiB, exposed {rows[label]['exposed_comm_frac_median']:.1%}",
                  flush=True)
        out["links"][link] = {"bandwidth_gbps": gbps, "variants": rows}
    return out


def table(result: dict) -> str:
    lines = [f"Run of {result['date']} at commit {result['git_commit']}"
             + (f" ({result['note']})" if result.get("note") else "") + ":", "",
             "| link | variant | step, median (s) | vs. without SP | TMP wire bytes per step | vs. without SP "
             "| TMP payload bytes | exposed comm, median |", "|---|---|---|---|---|---|---|---|"]
    for link, data in result["links"].items():
        rows = data["variants"]
        for label, r in rows.items():
            base = rows.get("oases" if r["policy"] == "oases_gathered" else r["policy"]) if r["sequence_parallel"] else None
            step = f"{r['step_s_median'] / base['step_s_median']:.3f}x" if base else ""
            wire = f"{r['wire_bytes'] / base['wire_bytes']:.3f}x" if base else ""
            lines.append(f"| {link} | {label} | {r['step_s_median']:.3f} | {step} | {r['wire_bytes']:,.0f} | {wire} "
                         f"| {r['payload_bytes']:,} | {r['exposed_comm_frac_median']:.1%} |")
    if "oases_gathered+sp" in next(iter(result["links"].values()))["variants"]:
        lines.append("")
        lines.append("`oases_gathered+sp` is compared with `oases` without sequence parallelism.")
    return "\n".join(lines)


def main() -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny dims, 1 repeat: the path only (give --out elsewhere)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=RESULTS, help="result file; its name also names its table in the report")
    parser.add_argument("--note", default="", help="what this run is (stored with it, shown above its table)")
    parser.add_argument("--timed", action="store_true",
                        help="store and oases with sequence parallelism also with the per-op times a plan would carry "
                             "(profiled here first, per link): the hop order of oases_ds/schedule/costed_merge.py")
    args = parser.parse_args()

    def measure() -> dict:
        quick = args.quick
        return {**run(QUICK if quick else MODEL, 1 if quick else args.repeats, 0 if quick else 1, args.timed),
                "note": args.note}

    if args.quick:
        stored_or_measured(False, args.out, measure)
        return
    publish_study("sequence_parallel_step", args.out, measure, table,
                  "Sequence parallelism: step time and TMP bytes (emulated links)",
                  "\n\n".join(__doc__.split("\n\n")[2:4]), report_only=args.report_only,
                  marker=os.path.splitext(os.path.basename(args.out))[0])


if __name__ == "__main__":
    main()
