"""Shared bits of the Hydra entry points.

How a failed launch reaches the user (:func:`fail_launch`): the last stderr line
is ``error: rank R: ExceptionType: message (full traceback in PATH)`` and the exit
code is 1; the rank's full traceback is kept in ``PATH`` (in the run's output
directory).  Set ``OASES_VERBOSE=1`` to have it printed above that line as well.
SIGINT/SIGTERM end the launch with one line (``interrupted`` / ``terminated by
SIGTERM``) and exit code 128 + signal (130 for Ctrl-C), no traceback.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

from oases_ds.bench.spec import CONFIG_DIR  # noqa: F401 -- every CLI's Hydra config_path

if TYPE_CHECKING:
    from oases_ds.launcher import LaunchError, LaunchInterrupted

PLAN_PRESETS: tuple[str, ...] = ("cost_model",)
"""Study presets in configs/experiment/ that ``oases-plan`` runs (the rest are ``oases-bench``'s)."""


def fail(message: str, detail: str | None = None, code: int = 2) -> NoReturn:
    """Exit ``code`` (2: bad input) with one clear line (and, if given, the detail before it)."""
    if detail:
        print(detail, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def verbose() -> bool:
    """``OASES_VERBOSE=1``: print full tracebacks, not only the one-line error."""
    return os.environ.get("OASES_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on")


def fail_launch(err: LaunchError, log_dir: str) -> NoReturn:
    """Exit 1 with the failing rank's one-line error; keep its traceback in ``log_dir``.

    The traceback is written to a file rather than printed because a user reads
    the last line first, and two ranks' interleaved tracebacks bury it.
    """
    if not err.traceback:
        fail(err.summary, code=1)
    path = os.path.join(os.path.abspath(log_dir), f"rank{err.rank}-traceback.log")
    show = verbose()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(err.traceback)
        where = f"full traceback in {path}"
    except OSError as write_err:  # nowhere to keep it: print it rather than lose it
        where, show = f"traceback above; it could not be saved: {write_err}", True
    fail(f"{err.summary}  ({where})", detail=err.traceback.rstrip() if show else None, code=1)


def stop(err: LaunchInterrupted) -> NoReturn:
    """The user ended the run (Ctrl-C, SIGTERM): one line, the shell's exit code, no traceback."""
    print(err.summary, file=sys.stderr)
    sys.exit(err.exit_code)


def strip_launcher_args() -> None:
    """The deepspeed launcher appends ``--local_rank=N``; Hydra would reject it.
    LOCAL_RANK is in the environment as well, so the argument carries nothing."""
    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
