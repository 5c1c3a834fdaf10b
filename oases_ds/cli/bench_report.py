"""``oases-bench report`` (also ``python -m oases_ds.cli.bench_report``): arguments in, reports out.

What a report contains and why its ratios are per round: :mod:`oases_ds.bench.report`,
whose description ``--help`` prints.
"""
from __future__ import annotations

import argparse
import os
import sys

from oases_ds.bench import report
from oases_ds.bench.provenance import REPO_ROOT

USAGE = """
    oases-bench report [--results benchmarks/results/bench.jsonl] [--out-dir benchmarks/reports]
    python -m oases_ds.cli.bench_report ...
"""


def main(argv: list[str] | None = None) -> list[str]:
    """Parse ``argv``, write the reports (:func:`oases_ds.bench.report.write_reports`), say where."""
    parser = argparse.ArgumentParser(prog="oases-bench report", description=report.__doc__ + USAGE,
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
    written = report.write_reports(args.results, args.out_dir, args.validation, args.accuracy, args.study)
    for path in written:
        print(f"wrote {os.path.relpath(path)}")
    return written


if __name__ == "__main__":
    main()
