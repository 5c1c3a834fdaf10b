"""Shared bits of the Hydra entry points."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import NoReturn

# The Hydra configs ship inside the package (``oases_ds/configs``; the repository's
# top-level ``configs`` is a link to it), so the CLIs work from a wheel as well as a clone.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The source checkout (where ``benchmarks/`` lives); meaningless for a wheel install."""


PLAN_PRESETS: tuple[str, ...] = ("cost_model",)
"""Study presets in configs/experiment/ that ``oases-plan`` runs (the rest are ``oases-bench``'s)."""


def git_commit() -> str:
    """The repository's HEAD, recorded with every result so it can be reproduced."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fail(message: str, detail: str | None = None) -> NoReturn:
    """Exit 2 with one clear line (and, if given, the detail before it)."""
    if detail:
        print(detail, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def strip_launcher_args() -> None:
    """The deepspeed launcher appends ``--local_rank=N``; Hydra would reject it.
    LOCAL_RANK is in the environment as well, so the argument carries nothing."""
    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
