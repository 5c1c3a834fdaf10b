"""The Oases planner ILP (paper eqs. 5-6): one TMP degree per block, minimum step time.

The only module that imports OR-Tools, so everything else in the planner is
plain Python.  Formulation, with blocks b = attn0, mlp0, attn1, mlp1, ...:

* ``choose[b][t]`` binary: block b runs at degree t; exactly one t per block.
* ``switch[b][a][t]`` >= 0: block b at degree a and block b+1 at degree t.  The
  product of two choices is linearised by the flow equalities
  ``sum_t switch[b][a][t] = choose[b][a]`` and ``sum_a switch[b][a][t] = choose[b+1][t]``,
  tighter than the textbook ``y >= x1 + x2 - 1``: without the memory row the LP
  is a shortest path through a layered graph and already integral.
* minimise sum of node costs (``BlockCost.step_ms``, plus the embedding and head
  edges on the first and last block) + edge costs (``edge_ms``: reshard and the last
  sub-batch's collectives),
  subject to sum of per-block memory <= limit.

Why a memory bound makes it slow: the LP may split every block between two
uniform paths (say half degree 4, half degree 8) and pay no reshard at all,
while an integer plan pays two edges per run of changed layers; with identical
layers many plans tie, so branch and bound must close that gap by search.
Measured by the solve-time study (``planner_solve_time.py``; T=32, 6 degrees,
binding limit, 2 shared cores):
SCIP proves the optimum but takes seconds unloaded (5.7 s at 128 layers) and
ran past 120 s at 128 on the loaded machine; CBC ran past 60 s at
96 layers; HiGHS and CP-SAT (8 workers) are slower than SCIP.  Hence SCIP when
``planner.solver=ilp``; any name in :data:`BACKENDS` may be passed.

What did not help: giving SCIP the DP's optimum as a starting solution
(``hint``, measured interleaved by the benchmark as ``ilp-SCIP-hint``) or as an
objective cut-off -- finding the optimum is not the slow part, proving it is.
:mod:`oases_ds.planner.dp` solves the same problem exactly in a fraction of the
time, is tested equal to this ILP and is the default solver.
"""
from __future__ import annotations

import time
from typing import Sequence

from ortools.linear_solver import pywraplp

from oases_ds.planner.costs import CostTable, edge_ms, first_block_ms, last_block_ms
from oases_ds.planner.objective import block_memory_limit, check_memory_feasible, sequence_memory_bytes
from oases_ds.planner.plan import Plan

BACKENDS: dict[str, str] = {"SCIP": "", "CBC": "", "HIGHS": "", "CP_SAT": "num_workers: 8"}
"""pywraplp backend name -> solver-specific parameters."""

DEFAULT_BACKEND = "SCIP"


class PlanSolverError(RuntimeError):
    """The solver stopped without proving an optimum (time limit, numerical trouble)."""


_STATUS_NAMES = {
    pywraplp.Solver.OPTIMAL: "OPTIMAL",
    pywraplp.Solver.FEASIBLE: "FEASIBLE (time limit before proof)",
    pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
    pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
    pywraplp.Solver.ABNORMAL: "ABNORMAL",
    pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
}


def solve(
    table: CostTable,
    memory_limit_bytes: float | None,
    time_limit_s: float = 10,
    backend: str = DEFAULT_BACKEND,
    hint: Sequence[int] | None = None,
) -> Plan:
    """Optimal plan for ``table`` within ``memory_limit_bytes`` per device (None: unbounded).

    ``hint``: block degrees (attn0, mlp0, ...) of a plan the backend starts from (a warm
    start; it still has to prove optimality).  Raises :class:`PlanInfeasibleError` when
    no plan fits and :class:`PlanSolverError` unless the solver proves optimality (zero
    relative gap) within ``time_limit_s``.
    """
    check_memory_feasible(table, memory_limit_bytes)
    started = time.perf_counter()
    solver = pywraplp.Solver.CreateSolver(backend) if backend in BACKENDS else None
    if solver is None:
        raise PlanSolverError(f"OR-Tools backend {backend!r} unavailable; try one of {sorted(BACKENDS)}")
    solver.SuppressOutput()
    if BACKENDS[backend]:
        solver.SetSolverSpecificParametersAsString(BACKENDS[backend])
    solver.SetTimeLimit(int(time_limit_s * 1000))

    kinds = table.block_kinds()
    choices = table.choices()  # (degree, policy): a block takes exactly one
    choose = [{c: solver.BoolVar(f"choose_b{block}_t{c[0]}_{c[1]}") for c in choices} for block in range(len(kinds))]
    for block, options in enumerate(choose):
        solver.Add(solver.Sum(options.values()) == 1, f"one_degree_b{block}")

    switch = []
    for block in range(len(kinds) - 1):
        pairs = {(a, c): solver.NumVar(0.0, 1.0, f"switch_b{block}_{a[0]}{a[1]}to{c[0]}{c[1]}")
                 for a in choices for c in choices}
        for choice in choices:
            solver.Add(solver.Sum(pairs[choice, c] for c in choices) == choose[block][choice])
            solver.Add(solver.Sum(pairs[a, choice] for a in choices) == choose[block + 1][choice])
        switch.append(pairs)

    last = len(kinds) - 1
    node_cost = solver.Sum(
        (table.block_cost(kind, *c).step_ms + (first_block_ms(table, *c) if block == 0 else 0.0)
         + (last_block_ms(table, *c) if block == last else 0.0)) * choose[block][c]
        for block, kind in enumerate(kinds) for c in choices
    )
    edge_cost = solver.Sum(
        edge_ms(table, block, a[0], c[0], a[1], c[1]) * var
        for block, pairs in enumerate(switch) for (a, c), var in pairs.items()
    )
    solver.Minimize(node_cost + edge_cost)

    if memory_limit_bytes is not None:
        # Normalised by the limit so the row's coefficients are O(1), not O(1e10).
        scale = max(memory_limit_bytes, 1.0)
        solver.Add(
            solver.Sum(
                table.block_cost(kind, *c).memory_bytes / scale * choose[block][c]
                for block, kind in enumerate(kinds)
                for c in choices
            )
            <= block_memory_limit(table, memory_limit_bytes) / scale,
            "memory_limit",
        )

    if hint is not None:
        if len(hint) != len(kinds):
            raise ValueError(f"hint has {len(hint)} block degrees, the table has {len(kinds)} blocks")
        solver.SetHint([choose[b][c] for b in range(len(kinds)) for c in choices],
                       [float(hint[b] == c[0] and c[1] == "oases") for b in range(len(kinds)) for c in choices])

    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 0.0)
    status = solver.Solve(params)
    solver_ms = (time.perf_counter() - started) * 1e3
    if status != pywraplp.Solver.OPTIMAL:
        raise PlanSolverError(
            f"{backend} stopped with status {_STATUS_NAMES.get(status, status)} after {solver_ms:.0f} ms "
            f"(time_limit_s={time_limit_s}) for {table.key()}, {table.layers} layers"
        )

    picked = [max(options, key=lambda c: options[c].solution_value()) for options in choose]
    block_degrees, block_policies = [c[0] for c in picked], [c[1] for c in picked]
    return Plan.from_block_degrees(
        block_degrees,
        table.devices,
        block_policies,
        predicted_step_ms=solver.Objective().Value(),
        solver_ms=solver_ms,
        solver_name=f"ortools-{backend}",
        memory_bytes=sequence_memory_bytes(table, block_degrees, block_policies),
        table_key=table.key(),
    )
