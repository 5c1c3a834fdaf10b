"""A step's micro-batches overlapped (``overlap_micro_batches``) against one after the other (issue 43).

Not a test: ``python benchmarks/micro_batch_overlap.py`` (``--report-only`` rewrites the report's
table from the result file; ``--quick`` runs tiny dims to check the path, numbers mean nothing).

What: LLaMA h1024, 16 heads, 4 layers, seq 256, micro-batch 4, fp32, no dropout, TMP 2 on 2 gloo
ranks, 4 micro-batches per step (gradient accumulation), the Oases schedule with every block
recomputed (``oases``) and with every block stored (``store``), each run two ways: the micro-batches
one after the other (the executor once per micro-batch, as the engine runs them by default), and
``-overlap``, the four as one merge where each micro-batch's forward runs under the previous one's
recomputation and backward (:func:`oases_ds.schedule.generators.micro_batch_merge`).  Why: where the
link is as slow as the compute, a forward is link-bound and a backward compute-bound
(``exposed_phases``: the forward holds most of the exposed time), and two sub-batches of one
micro-batch cannot mix them.  The link is EMULATED (the real collective, held to the link model's
deadline) at three ratios of the step's link time to its compute, 0.5, 0.9 and 2, set as in
``exposed_phases`` from a first launch without a link; per ratio one launch runs the four variants
in rotated order (:func:`oases_ds.bench.measure.measure_rank`).

Reported per variant and ratio: the step (median of the slowest rank's), its limit max(compute, link
time of the step's traffic), the ratio between them (target <= 1.10x) and the exposed communication
by phase; then each policy's overlapped step against its sequential one, the median of the per-round
ratios.  Every number in the report is read from the result file.
"""
from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from exposed_phases import study, table as phases_table  # noqa: E402

MICRO_STEPS = 4
VARIANTS = (("oases", "oases", False), ("oases-overlap", "oases", False, None, True),
            ("store", "store", False), ("store-overlap", "store", False, None, True))
POLICIES = ("oases", "store")


def table(result: dict) -> str:
    lines = [phases_table(result), "", f"{result['micro_batches_per_step']} micro-batches per step; the overlapped step "
             "against the sequential one (median of the per-round ratios, min-max):", "",
             "| link / compute | policy | sequential (s) | overlapped (s) | overlapped / sequential |", "|---|---|---|---|---|"]
    for ratio, data in result["ratios"].items():
        for policy in POLICIES:
            seq, ovl = data["variants"][policy]["step_s"], data["variants"][f"{policy}-overlap"]["step_s"]
            rounds = [o / s for o, s in zip(ovl, seq)]
            lines.append(f"| {ratio} | {policy} | {statistics.median(seq):.3f} | {statistics.median(ovl):.3f} | "
                         f"{statistics.median(rounds):.3f}x ({min(rounds):.3f}-{max(rounds):.3f}) |")
    return "\n".join(lines)


def main() -> None:
    study("micro_batch_overlap", __doc__, "Micro-batches overlapped, against the limit", table, VARIANTS, MICRO_STEPS)


if __name__ == "__main__":
    main()
