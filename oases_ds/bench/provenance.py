"""Where a result came from: the checkout and the machine, stated in every record.

Why here and not in each entry point: ``oases-bench`` and ``oases-plan
mode=accuracy`` both write records that the report generator reads, so both must
describe the machine with the same keys.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import Any

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


def dated_report(study: str, day: str | None = None) -> str:
    """``benchmarks/reports/<study>-<day>.md``, ``day`` the ISO date its result was measured (default
    today): where a benchmark script writes its generated section, beside the hand-written reading of
    it, so ``benchmarks/README.md`` stays an index and each run of a study has its own dated report."""
    day = (day or datetime.date.today().isoformat())[:10]
    return os.path.join(REPO_ROOT, "benchmarks", "reports", f"{study}-{day}.md")
