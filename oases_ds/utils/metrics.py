"""Training metrics on disk: a CSV that needs nothing installed, and TensorBoard when it is.

Why a CSV first: it opens anywhere (a spreadsheet, pandas, ``column -t``), needs no
optional package, and survives a crash row by row.  Each row is one ``write`` of a
whole line followed by a flush, so a killed run leaves complete rows (at worst its
last row missing), never a half line.  A resumed run first drops the rows past the
step it resumes from (they belong to the lost tail of the crashed run) with an
atomic rewrite, then appends; a fresh run starts the file over.

TensorBoard (``tensorboard`` package, the ``[tensorboard]`` extra) is checked for
up front by :func:`check_tensorboard`, so asking for it without the package is one
line before any rank starts, not a traceback inside rank 0.
"""
from __future__ import annotations

import csv
import math
import os
from typing import Any

from oases_ds.utils.io import write_text_atomic

COLUMNS = ("step", "loss", "eval_loss", "lr", "tokens_per_s")
"""The CSV header, in order; ``eval_loss`` is empty on steps that did not evaluate."""


def check_tensorboard(log_dir: str | None) -> None:
    """Raise one line when TensorBoard logging is asked for and cannot be done."""
    if not log_dir:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 -- optional: needs the tensorboard package
    except ImportError:
        raise ValueError(f"metrics.tensorboard={log_dir} needs the tensorboard package, which is not installed; "
                         f"pip install 'oases-ds[tensorboard]' or unset metrics.tensorboard (metrics.csv needs nothing)") from None


def check_csv(path: str | None) -> None:
    """Raise one line when ``path`` exists but is not a metrics CSV of this layout (appending would mix formats)."""
    if not path or not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    if os.path.isdir(path):
        raise ValueError(f"metrics.csv={path} is a directory; give a file path, e.g. metrics.csv={path}/metrics.csv")
    with open(path, newline="") as f:
        header = f.readline().strip()
    if header != ",".join(COLUMNS):
        raise ValueError(f"metrics.csv={path} exists and is not an oases-train metrics file (header {header[:60]!r}); "
                         f"give another path or delete it")


def _cell(value: float | None) -> str:
    if value is None:
        return ""
    return repr(float(value)) if math.isfinite(value) else str(value)


class MetricsLog:
    """Rank 0's metric sinks for one run: ``csv_path`` and, if given, a TensorBoard ``tb_dir``."""

    def __init__(self, csv_path: str | None, tb_dir: str | None, start_step: int) -> None:
        self.csv_path, self.writer, self._stream = csv_path, None, None
        if csv_path:
            kept = self._rows_up_to(csv_path, start_step) if start_step else []
            write_text_atomic(csv_path, "".join(",".join(r) + "\n" for r in [list(COLUMNS), *kept]))
            self._stream = open(csv_path, "a", newline="")  # noqa: SIM115 -- held open for the run, closed by close()
        if tb_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency, checked by check_tensorboard

            self.writer = SummaryWriter(log_dir=tb_dir)

    @staticmethod
    def _rows_up_to(path: str, step: int) -> list[list[str]]:
        if not os.path.exists(path):
            return []
        with open(path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        return [r for r in rows if len(r) == len(COLUMNS) and r[0].isdigit() and int(r[0]) <= step]

    def log(self, step: int, loss: float, eval_loss: float | None, lr: float, tokens_per_s: float) -> None:
        """One row (one write call, flushed) and the same scalars to TensorBoard."""
        if self._stream is not None:
            self._stream.write(",".join([str(step), _cell(loss), _cell(eval_loss), _cell(lr), _cell(tokens_per_s)]) + "\n")
            self._stream.flush()
        if self.writer is not None:
            scalars: dict[str, Any] = {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s}
            if eval_loss is not None:
                scalars["eval/loss"] = eval_loss
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._stream is not None:
            os.fsync(self._stream.fileno())
            self._stream.close()
            self._stream = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
