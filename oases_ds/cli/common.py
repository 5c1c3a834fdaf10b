"""Shared bits of the Hydra entry points."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

# The repository's configs/ (the package is installed in development mode).
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


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
