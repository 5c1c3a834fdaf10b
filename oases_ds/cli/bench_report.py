"""``oases-bench report``: the JSON lines of ``oases-bench`` -> one dated Markdown report per study.

Each report states the machine, the configuration and whether (and how) the
link was emulated, then per measurement a table of medians with min-max spread
and ratios against Megatron.  Ratios are taken round by round (the variants of
one round ran back to back), so the spread of a ratio is the spread over rounds,
not the spread of two independent medians.  Plots (matplotlib, Agg): throughput
bars, scaling lines, and a compute/comm Gantt chart of one step per schedule
from rank 0's executor timeline.

    oases-bench report [--results benchmarks/results/bench.jsonl] [--out-dir benchmarks/reports]
    python -m oases_ds.cli.bench_report ...
"""
from __future__ import annotations

import argparse
import os
import sys

from oases_ds.bench.provenance import REPO_ROOT
from oases_ds.bench.report import write_reports


def main(argv: list[str] | None = None) -> list[str]:
    """Parse ``argv``, write the reports (:func:`oases_ds.bench.report.write_reports`), say where."""
    parser = argparse.ArgumentParser(prog="oases-bench report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.path.join(REPO_ROOT, "benchmarks", "results", "bench.jsonl"))
    parser.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "benchmarks", "reports"))
    parser.add_argument("--study", action="append", help="only these studies (repeatable)")
    parser.add_argument("--validation", default=os.path.join(REPO_ROOT, "benchmarks", "results", "validate_link.json"))
    parser.add_argument("--accuracy", default=os.path.join(REPO_ROOT, "benchmarks", "results", "planner_accuracy.json"),
                        help="oases-plan experiment=cost_model's result, for the cost_model report")
    args = parser.parse_args(argv)
    if not os.path.exists(args.results):
        print(f"error: no results at {args.results}; run oases-bench first", file=sys.stderr)
        sys.exit(2)
    written = write_reports(args.results, args.out_dir, args.validation, args.accuracy, args.study)
    for path in written:
        print(f"wrote {os.path.relpath(path)}")
    return written


if __name__ == "__main__":
    main()
