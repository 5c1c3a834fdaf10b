"""Where a result came from: the checkout and the machine, stated in every record.

Why here and not in each entry point: ``oases-bench`` and ``oases-plan
mode=accuracy`` both write records that the report generator reads, so both must
describe the machine with the same keys.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The source checkout (where ``benchmarks/`` lives); meaningless for a wheel install."""


def git_commit() -> str:
    """The repository's HEAD, recorded with every result so it can be reproduced."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "hostname": platform.node()}


def stored_or_measured(report_only: bool, path: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A benchmark script's result: with ``--report-only`` the one stored at ``path``, else
    ``measure()``'s, written there atomically first (a report is then regenerated from either)."""
    from oases_ds.utils.io import write_json_atomic

    if report_only:
        with open(path) as f:
            return json.load(f)
    result = measure()
    write_json_atomic(path, result, indent=2)
    return result


def write_report_section(study: str, day: str, marker: str, body: str, title: str, intro: str) -> str:
    """Put ``body`` between the ``marker`` lines of the study's dated report (:func:`dated_report`),
    which starts, when new, with ``title`` and ``intro`` (the hand-written reading goes after);
    returns the report's path.  Every figure in ``body`` comes from the result file."""
    from oases_ds.utils.io import replace_marked_section

    report = dated_report(study, day)
    if not os.path.exists(report):
        with open(report, "w", encoding="utf-8") as f:
            f.write(f"# {title}\n\n{intro}\n\n")
    replace_marked_section(report, f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", body)
    return report


def study_arguments(doc: str) -> argparse.ArgumentParser:
    """The command line every dated study shares (``--report-only``: report the stored result,
    measure nothing); a script adds its own options to it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the result file")
    return parser


def publish_study(study: str, result_path: str, measure: Callable[[], dict[str, Any]],
                  table: Callable[[dict[str, Any]], str], title: str, intro: str, *, report_only: bool,
                  marker: str | None = None) -> None:
    """Measure (or, with ``report_only``, load) a study's result at ``result_path``, print its
    table and write it into the dated report (:func:`write_report_section`, marker default
    ``study``): the one path every study's numbers take from a run to its report."""
    result = stored_or_measured(report_only, result_path, measure)
    body = table(result)
    print(body)
    report = write_report_section(study, result["date"], marker or study, body, title, intro)
    print(f"wrote {result_path} and {report}")


def result_path(study: str) -> str:
    """``benchmarks/results/<study>.json``: where a dated study keeps its result by default."""
    return os.path.join(REPO_ROOT, "benchmarks", "results", f"{study}.json")


def study_main(study: str, doc: str, measure: Callable[[], dict[str, Any]], table: Callable[[dict[str, Any]], str],
               title: str, intro: slice) -> None:
    """The whole command line of a study without options of its own: ``--report-only`` parsed,
    the result at :func:`result_path`, the report's intro the ``intro`` paragraphs of ``doc``
    (the script's docstring), then :func:`publish_study`."""
    args = study_arguments(doc).parse_args()
    publish_study(study, result_path(study), measure, table, title, "\n\n".join(doc.split("\n\n")[intro]),
                  report_only=args.report_only)


def dated_report(study: str, day: str | None = None) -> str:
    """``benchmarks/reports/<study>-<day>.md``, ``day`` the ISO date its result was measured (default
    today): where a benchmark script writes its generated section, beside the hand-written reading of
    it, so ``benchmarks/README.md`` stays an index and each run of a study has its own dated report."""
    day = (day or datetime.date.today().isoformat())[:10]
    return os.path.join(REPO_ROOT, "benchmarks", "reports", f"{study}-{day}.md")
