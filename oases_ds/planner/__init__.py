"""Oases planner: a layer's cost table -> the solver's per-block TMP degrees -> the plan a replay keeps.

The front door is :func:`make_plan` (:mod:`oases_ds.planner.planning`): a typed
:class:`PlanRequest` in (workload, where the cost table comes from, solver, memory limit, pipeline
stages), a :class:`PlanResult` out (the plan, the candidates the replay priced, the best uniform
plan, the memory replay or the stage split)::

    from oases_ds.planner import PlanRequest, make_plan
    from oases_ds.planner.profile import ProfileSpec

    result = make_plan(PlanRequest(ProfileSpec(model, devices=2, micro_batch=8)))
    result.plan.to_json("plan.json")

The pieces, in the order they run: :mod:`~oases_ds.planner.profile` (or
:mod:`~oases_ds.planner.analytic`) fills a :class:`CostTable`; :mod:`~oases_ds.planner.dp` (or
:mod:`~oases_ds.planner.ilp`, the paper's ILP on OR-Tools) searches its additive node and edge
costs (:mod:`~oases_ds.planner.objective`); :mod:`~oases_ds.planner.replay` prices whole plans the
way they run and keeps the fastest; :mod:`~oases_ds.planner.memory` and
:mod:`~oases_ds.planner.stages` bound memory and split pipeline stages.  The ILP is not imported
here, so importing the planner does not load OR-Tools.
"""
from oases_ds.planner.costs import BlockCost, CostTable, DegreeProfile, reshard_ms
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.objective import brute_force, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError
from oases_ds.planner.planning import PipelineRequest, PlanRequest, PlanResult, load_table, make_plan

__all__ = [
    "BlockCost",
    "CostTable",
    "DegreeProfile",
    "PipelineRequest",
    "Plan",
    "PlanInfeasibleError",
    "PlanRequest",
    "PlanResult",
    "brute_force",
    "load_table",
    "make_plan",
    "predict_memory_bytes",
    "predict_step_ms",
    "reshard_ms",
    "solve_dp",
]
