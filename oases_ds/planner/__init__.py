"""Oases planner: profiled cost table -> ILP -> per-layer TMP degree plan.

``solve`` lives in :mod:`oases_ds.planner.ilp` and is not re-exported here, so
importing the cost table or a plan does not load OR-Tools.
"""
from oases_ds.planner.costs import BlockCost, CostTable, reshard_ms
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.objective import brute_force, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError

__all__ = [
    "BlockCost",
    "CostTable",
    "Plan",
    "PlanInfeasibleError",
    "brute_force",
    "predict_memory_bytes",
    "predict_step_ms",
    "reshard_ms",
    "solve_dp",
]
