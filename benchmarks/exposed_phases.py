"""Where the exposed communication is, and how far each step is from its physical limit (issue 43).

Not a test: ``python benchmarks/exposed_phases.py`` (``--report-only`` rewrites the report's table
from the result file; ``--quick`` runs tiny dims to check the path, numbers mean nothing).

What: LLaMA h1024, 16 heads, 4 layers, seq 256, micro-batch 4, fp32, no dropout, TMP 2 on 2 gloo
ranks, the Oases schedule with every block recomputed (``oases``) and with every block stored
(``store``), on a link EMULATED (the real collective, held to the link model's deadline) at three
ratios of the step's link time to its compute: 0.5, 0.9 (the 85 Mbit/s case of the issue) and 2.
First one launch without a link measures each variant's compute (the compute lane's busy time,
median) and TMP wire bytes per step; each ratio's bandwidth is then ``wire bytes / (ratio x the
oases variant's compute)``, so both variants share a link.  Per ratio one launch runs both
variants in rotated order (:func:`oases_ds.bench.measure.measure_rank`).

Reported per variant and ratio: the step (median of the slowest rank's), its limit max(compute,
link time of the step's traffic) and the ratio between them (target <= 1.10x), and the exposed
(blocking) communication by where the schedule waited: forward, recomputation (the cross-pass
phase), backward, and the embedding's and head's collectives (Timeline.exposed_by_phase), medians
over the repeats on rank 0.  Every number in the report is read from the result file.
"""
from __future__ import annotations

import os
import statistics
import sys
from datetime import datetime, timezone
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sequence_parallel_step import QUICK, spec_of, wire_bytes  # noqa: E402

from oases_ds.bench.provenance import (git_commit, machine, publish_study, result_path, stored_or_measured,  # noqa: E402
                                       study_arguments)
from oases_ds.runtime.timeline import EXPOSURE_PHASES  # noqa: E402

MODEL = dict(family="llama", vocab_size=32000, hidden_size=1024, num_heads=16, num_layers=4, seq_len=256, dropout=0.0)
VARIANTS = (("oases", "oases", False), ("store", "store", False), ("oases-k4", "oases", False, 4),
            ("store-k4", "store", False, 4))
RATIOS = (0.5, 0.9, 2.0)
TARGET = 1.10


def rows_of(ranks: list[dict], variants: tuple = VARIANTS) -> dict:
    rows = {}
    for label, *_ in variants:
        mine = ranks[0]["variants"][label]
        steps = [max(ts) for ts in zip(*(r["variants"][label]["step_s"] for r in ranks))]
        compute = [max(cs) for cs in zip(*(r["variants"][label]["compute_s"] for r in ranks))]
        rows[label] = {"step_s": steps, "compute_s": compute, "link_s": mine["link_s"],
                       "wire_bytes": wire_bytes(mine["comm_bytes"]),
                       "exposed_by_phase_s": {p: statistics.median(e[p] for e in mine["exposed_by_phase_s"])
                                              for p in EXPOSURE_PHASES}}
    return rows


def run(model: dict, repeats: int, warmup: int, variants: tuple = VARIANTS, micro_steps: int = 1) -> dict:
    """One launch without a link (each variant's compute), then one per ratio; ``micro_steps``
    micro-batches per step, and the bandwidth of each ratio from the first variant's traffic."""
    from oases_ds.bench.measure import measure_rank
    from oases_ds.launcher import launch

    def measured(gbps: float | None) -> dict:
        spec = spec_of(model, gbps, repeats, warmup, variants, micro_steps)
        return rows_of(launch(measure_rank, 2, (spec,), timeout_s=3600, threads_per_rank=1), variants)

    out: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
                 "machine": machine(), "model": model, "tensor_parallel_size": 2, "micro_batches_per_step": micro_steps,
                 "repeats": repeats, "warmup": warmup}
    alone = measured(None)
    out["no_link"] = alone
    base = alone[variants[0][0]]
    compute = statistics.median(base["compute_s"])
    out["ratios"] = {}
    for ratio in RATIOS:
        gbps = base["wire_bytes"] * 8 / (ratio * compute) / 1e9
        rows = measured(gbps)
        out["ratios"][str(ratio)] = {"bandwidth_gbps": gbps, "variants": rows}
        for label, r in rows.items():
            print(f"ratio {ratio}: {label:6s} step {statistics.median(r['step_s']):.3f} s, limit "
                  f"{_limit(alone[label], r):.3f} s, exposed {r['exposed_by_phase_s']}", flush=True)
    return out


def _limit(alone: dict, linked: dict) -> float:
    """max(the variant's compute without a link, its traffic's time on this link), medians."""
    return max(statistics.median(alone["compute_s"]), statistics.median(linked["link_s"]))


def table(result: dict) -> str:
    lines = [f"Run of {result['date']} at commit {result['git_commit']} on {result['machine']['processor']} "
             f"({result['machine']['cpu_count']} CPUs), {result['repeats']} repeats after {result['warmup']} warm-up "
             f"(medians):", "",
             "| link / compute | link (Gbit/s) | variant | step (s) | compute (s) | link time (s) | limit (s) "
             f"| step / limit (target <= {TARGET:.2f}x) | " + " | ".join(f"exposed: {p} (s)" for p in EXPOSURE_PHASES) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(EXPOSURE_PHASES)]
    for ratio, data in result["ratios"].items():
        for label, r in data["variants"].items():
            alone = result["no_link"][label]
            step, limit = statistics.median(r["step_s"]), _limit(alone, r)
            phases = " | ".join(f"{r['exposed_by_phase_s'][p]:.3f}" for p in EXPOSURE_PHASES)
            lines.append(f"| {ratio} | {data['bandwidth_gbps']:.4f} | {label} | {step:.3f} | "
                         f"{statistics.median(alone['compute_s']):.3f} | {statistics.median(r['link_s']):.3f} | {limit:.3f} "
                         f"| {step / limit:.3f}x | {phases} |")
    return "\n".join(lines)


def study(name: str, doc: str, title: str, render: Callable[[dict], str], variants: tuple = VARIANTS,
          micro_steps: int = 1) -> None:
    """The command line of a study measured as this one (``--quick``, ``--repeats``, ``--out``,
    ``--report-only``): :func:`run` of ``variants``, rendered by ``render`` into its dated report."""
    parser = study_arguments(doc)
    parser.add_argument("--quick", action="store_true", help="tiny dims, 1 repeat: the path only (give --out elsewhere)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=result_path(name))
    args = parser.parse_args()

    def measure() -> dict:
        quick = args.quick
        return run(QUICK if quick else MODEL, 1 if quick else args.repeats, 0 if quick else 1, variants, micro_steps)

    if args.quick:
        print(render(stored_or_measured(False, args.out, measure)))
        return
    publish_study(name, args.out, measure, render, title, "\n\n".join(doc.split("\n\n")[2:4]),
                  report_only=args.report_only)


def main() -> None:
    study("exposed_phases", __doc__, "Exposed communication by phase, against the limit", table)


if __name__ == "__main__":
    main()
