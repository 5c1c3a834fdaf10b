"""Exact dynamic programme for the planner problem: a resource-constrained shortest path.

Why a DP next to the ILP: the objective is a chain -- node costs plus an edge
cost between *adjacent* blocks -- and the only coupling across the chain is the
memory sum.  So the problem is a shortest path through the layered graph
(block, degree) with one resource, and it can be solved exactly by labels: at
each (block, degree) keep every (memory, cost) pair that no other pair beats in
both (a Pareto front).  No memory is discretised, so nothing is rounded away.

Why it is fast where branch and bound is slow: every layer shares one profile,
so a huge number of plans share a memory total; the ILP's LP relaxation cannot
tell them apart and SCIP enumerates them, while the DP keeps one label per
distinct (memory, cost) trade-off.  Two prunes keep the fronts small and stay
exact: a label that cannot fit even if every later block takes its leanest
degree is dropped, and so is one whose cost plus the cheapest possible
remainder already exceeds a feasible plan's cost (the greedy incumbent below).

:func:`solve_dp` is held equal to the ILP and to brute force by
``tests/unit/test_planner_dp.py``; the ILP stays the solver of record and takes the
DP plan as its starting incumbent (:func:`oases_ds.planner.ilp.solve`).
"""
from __future__ import annotations

import bisect
import time
from typing import Sequence

from oases_ds.planner.costs import CostTable, edge_ms, first_block_ms, last_block_ms
from oases_ds.planner.objective import (
    MEMORY_REL_EPS,
    block_memory_limit,
    check_memory_feasible,
    fits_memory,
    sequence_memory_bytes,
    sequence_step_ms,
)
from oases_ds.planner.plan import Plan

class _Front:
    """Pareto front of labels (memory, cost, back-pointer), memory ascending, cost strictly descending."""

    __slots__ = ("memory", "cost", "back")

    def __init__(self) -> None:
        self.memory: list[float] = []
        self.cost: list[float] = []
        self.back: list[tuple[int, int] | None] = []

    def insert(self, memory: float, cost: float, back: tuple[int, int] | None) -> None:
        """Add a label unless dominated; drop the labels it dominates."""
        at = bisect.bisect_right(self.memory, memory)
        if at and self.cost[at - 1] <= cost:  # a leaner-or-equal label is as cheap
            return
        end = at
        while end < len(self.memory) and self.cost[end] >= cost:  # fatter and no cheaper
            end += 1
        self.memory[at:end] = [memory]
        self.cost[at:end] = [cost]
        self.back[at:end] = [back]


def _suffix_minima(values: Sequence[float]) -> list[float]:
    """``out[b]`` = sum of ``values[b:]``; ``out[len] = 0``."""
    out = [0.0] * (len(values) + 1)
    for block in range(len(values) - 1, -1, -1):
        out[block] = out[block + 1] + values[block]
    return out


def _greedy_incumbent(table: CostTable, limit: float | None) -> float:
    """Cost of some feasible plan, for pruning: the cheapest uniform-per-kind plan that fits,
    else the leanest plan (which fits whenever any does)."""
    kinds = table.block_kinds()
    best = float("inf")
    for attn in table.degrees:
        for mlp in table.degrees:
            sequence = [attn if kind == "attn" else mlp for kind in kinds]
            if fits_memory(sequence_memory_bytes(table, sequence), limit):
                best = min(best, sequence_step_ms(table, sequence))
    lean = [min(table.degrees, key=lambda t: table.blocks[kind][t].memory_bytes) for kind in kinds]
    return min(best, sequence_step_ms(table, lean))


def optimal_block_degrees(table: CostTable, memory_limit_bytes: float | None) -> list[int]:
    """The degree of every block (attn0, mlp0, ...) in a minimum-cost plan within the limit.

    Raises :class:`~oases_ds.planner.plan.PlanInfeasibleError` when no plan fits.
    """
    check_memory_feasible(table, memory_limit_bytes)
    kinds = table.block_kinds()
    degrees = table.degrees
    node = [{t: table.blocks[kind][t].step_ms for t in degrees} for kind in kinds]
    for t in degrees:  # the edges from the embedding and into the head depend on one block each
        node[0][t] += first_block_ms(table, t)
        node[-1][t] += last_block_ms(table, t)
    mem = [{t: table.blocks[kind][t].memory_bytes for t in degrees} for kind in kinds]
    edge = [{(a, t): edge_ms(table, block, a, t) for a in degrees for t in degrees} for block in range(len(kinds) - 1)]
    lean_rest = _suffix_minima([min(m.values()) for m in mem])
    cheap_rest = _suffix_minima([min(c.values()) for c in node])
    limit = (float("inf") if memory_limit_bytes is None
             else block_memory_limit(table, memory_limit_bytes * (1 + MEMORY_REL_EPS)))
    # Slack so that float re-association in the sums never prunes the optimum itself.
    incumbent = _greedy_incumbent(table, memory_limit_bytes) * (1 + 1e-9) + 1e-9

    fronts: list[dict[int, _Front]] = []
    first: dict[int, _Front] = {}
    for t in degrees:
        front = _Front()
        if mem[0][t] + lean_rest[1] <= limit and node[0][t] + cheap_rest[1] <= incumbent:
            front.insert(mem[0][t], node[0][t], None)
        first[t] = front
    fronts.append(first)
    for block in range(1, len(kinds)):
        previous = fronts[-1]
        current: dict[int, _Front] = {}
        for t in degrees:
            front = _Front()
            memory_bound = limit - mem[block][t] - lean_rest[block + 1]
            cost_bound = incumbent - node[block][t] - cheap_rest[block + 1]
            for a in degrees:
                source = previous[a]
                step = edge[block - 1][a, t]
                for index, (memory, cost) in enumerate(zip(source.memory, source.cost)):
                    if memory > memory_bound:
                        break  # memory ascending: the rest are fatter still
                    if cost + step <= cost_bound:
                        front.insert(memory + mem[block][t], cost + step + node[block][t], (a, index))
            current[t] = front
        fronts.append(current)

    last = fronts[-1]
    candidates = [(front.cost[-1], t) for t, front in last.items() if front.cost]
    if not candidates:  # only reachable through float trouble: check_memory_feasible passed
        raise RuntimeError(f"DP found no plan for {table.key()} although the leanest plan fits")
    _, degree = min(candidates)
    index = len(last[degree].cost) - 1
    sequence = [degree]
    for block in range(len(kinds) - 1, 0, -1):
        back = fronts[block][degree].back[index]
        assert back is not None
        degree, index = back
        sequence.append(degree)
    sequence.reverse()
    return sequence


def solve_dp(table: CostTable, memory_limit_bytes: float | None) -> Plan:
    """Optimal plan by the label DP (same objective and limit as :func:`oases_ds.planner.ilp.solve`)."""
    started = time.perf_counter()
    sequence = optimal_block_degrees(table, memory_limit_bytes)
    return Plan.from_block_degrees(
        sequence,
        table.devices,
        predicted_step_ms=sequence_step_ms(table, sequence),
        solver_ms=(time.perf_counter() - started) * 1e3,
        solver_name="pareto-dp",
        memory_bytes=sequence_memory_bytes(table, sequence),
        table_key=table.key(),
    )
