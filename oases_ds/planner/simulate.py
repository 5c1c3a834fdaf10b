"""Former name of :mod:`oases_ds.planner.objective`, kept for ``oases_ds/cli/plan.py`` only.

The CLI is reworked on another branch and still imports this name; once its import
reads ``oases_ds.planner.objective``, delete this file.  Nothing else may import it.
"""
from __future__ import annotations

from oases_ds.planner.objective import predict_memory_bytes, predict_step_ms

__all__ = ["predict_memory_bytes", "predict_step_ms"]
