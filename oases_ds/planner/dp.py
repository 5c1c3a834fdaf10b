"""Exact dynamic programme for the planner problem: a resource-constrained shortest path.

Why a DP next to the ILP: the objective is a chain -- node costs plus an edge
cost between *adjacent* blocks -- and the only coupling across the chain is the
memory sum.  So the problem is a shortest path through the layered graph
(block, degree) with one resource, solved exactly by labels: at each
(block, degree) keep every (memory, cost) pair that no other pair beats in both
(a Pareto front).  Memory is not discretised: a label carries the float sum of
its blocks' bytes, so no plan is rounded in or out of the limit (only
:data:`~oases_ds.planner.objective.MEMORY_REL_EPS`, 1e-12 relative, absorbs
summation order).  The result is optimal by construction, not within a gap.

Why it is fast (hundreds of times faster than SCIP to the same proven optimum in the
solve-time study, ``planner_solve_time.py``):

* a Lagrangian bound (Handler-Zang).  Pricing memory at ``lam`` ms per byte turns
  the problem into an unconstrained shortest path (one backward Viterbi pass,
  blocks x degrees^2); its cost-to-go ``rest(b, t)`` bounds every completion::

      cost of a completion using <= M bytes  >=  rest_lam(b, t) - lam * M

  for every ``lam >= 0``.  A few passes find the ``lam`` where the cheapest
  infeasible and the cheapest feasible path tie (the dual optimum).  Labels whose
  cost plus this bound (at that ``lam`` and at 0) exceed the incumbent are dropped,
  and if the incumbent meets the dual bound it is returned with no search at all.
* an incumbent spliced from the priced paths (a prefix of one, the suffix of
  another): with identical layers the optimum is typically a run of fast, fat
  blocks then a run of lean ones, which a splice finds, so nothing near the
  optimum is pruned late.  The bound is the LP bound and does not see the
  reshard a completion pays to use spare memory, so one label per switch
  position survives (about 27k labels at 128 layers), hence:
* a block's labels are numpy arrays, extended to every degree and filtered to
  per-degree Pareto fronts in one pass per block.

Every prune uses a valid lower bound against a feasible plan's cost, so the plan
returned is the exact optimum (up to a float slack of 1e-9 relative).

A block's state is a (degree, recomputation policy) pair (:meth:`CostTable.choices
<oases_ds.planner.costs.CostTable.choices>`): with a table that prices policy ``store``
the graph has twice the columns and the same search runs on it unchanged.

Measured by the solve-time study (``planner_solve_time.py``, its table in the dated
report the benchmarks index names) against the ILP backends and the same search with
the earlier DP's bounds (``bound="greedy"``: best uniform-per-kind plan, per-block
cheapest nodes).
:func:`solve_dp` is held equal to brute force and to the ILP by
``tests/unit/test_planner_dp.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from oases_ds.planner.costs import BLOCK_KINDS, CostTable, edge_ms, first_block_ms, last_block_ms
from oases_ds.planner.objective import (
    MEMORY_REL_EPS,
    block_memory_limit,
    check_memory_feasible,
    fits_memory,
    sequence_memory_bytes,
    sequence_step_ms,
)
from oases_ds.planner.plan import Plan

BOUNDS: tuple[str, ...] = ("lagrangian", "greedy")
"""Pruning bounds of :func:`optimal_block_degrees`: ``lagrangian`` (default, the fast
one) or ``greedy`` (best uniform-per-kind plan and per-block minima: the earlier DP's
bounds, kept for the benchmark's comparison)."""

COST_SLACK = 1e-9
"""Relative and absolute slack on every cost prune, so float re-association in the
sums never prunes the optimum itself."""

MAX_MULTIPLIER_STEPS = 60
"""Cap on Lagrangian passes; the search normally ends in under ten (each pass moves
to a new breakpoint of a piecewise-linear function)."""


@dataclass(frozen=True)
class _Chain:
    """The problem as arrays over (block, degree index): one place for the costs both
    the bounds and the label search read."""

    node: np.ndarray
    """[blocks, D]: block b's cost at degree i, the embedding / head edges folded into the ends."""
    memory: np.ndarray
    """[blocks, D]: bytes per device."""
    edge: np.ndarray
    """[blocks - 1, D, D]: block b at degree i followed by block b+1 at degree j."""

    @classmethod
    def of(cls, table: CostTable) -> _Chain:
        """Columns are the table's (degree, policy) choices (:meth:`CostTable.choices`): a policy is
        one more state of a block, priced by its own row; the search does not tell them apart."""
        # Every layer shares one profile: build one layer (attn, mlp) and repeat it, and an
        # edge depends on its pair of kinds only, so edge_ms (the definition) runs once per pair.
        kinds, choices, layers = table.block_kinds(), table.choices(), table.layers
        node = np.tile([[table.block_cost(kind, t, p).step_ms for t, p in choices] for kind in BLOCK_KINDS], (layers, 1))
        node[0] += [first_block_ms(table, t, p) for t, p in choices]
        node[-1] += [last_block_ms(table, t, p) for t, p in choices]
        memory = np.tile([[table.block_cost(kind, t, p).memory_bytes for t, p in choices] for kind in BLOCK_KINDS],
                         (layers, 1))
        pairs = [[[edge_ms(table, block, a, t, pa, pt) for t, pt in choices] for a, pa in choices]
                 for block in range(min(len(BLOCK_KINDS), len(kinds) - 1))]  # attn -> mlp, mlp -> attn
        edge = np.tile(pairs, (layers, 1, 1))[: len(kinds) - 1].reshape(len(kinds) - 1, len(choices), len(choices))
        return cls(node, memory, edge)

    @property
    def blocks(self) -> int:
        return self.node.shape[0]

    def priced(self, lam: float) -> tuple[np.ndarray, list[int]]:
        """Cost-to-go with memory priced at ``lam`` per byte, and a path minimising it.

        ``to_go[b, i]``: the cheapest ``cost + lam * memory`` of blocks b.. with block b
        at degree i (block b included) -- one backward Viterbi pass."""
        priced_node = self.node + lam * self.memory
        to_go = np.empty_like(priced_node)
        choice = np.zeros(priced_node.shape, dtype=np.intp)
        to_go[-1] = priced_node[-1]
        for block in range(self.blocks - 2, -1, -1):
            via = self.edge[block] + to_go[block + 1]
            choice[block] = via.argmin(axis=1)
            to_go[block] = priced_node[block] + via[np.arange(via.shape[0]), choice[block]]
        path = [int(to_go[0].argmin())]
        for block in range(self.blocks - 1):
            path.append(int(choice[block, path[-1]]))
        return to_go, path

    def cost(self, path: list[int]) -> float:
        index = np.arange(self.blocks)
        return float(self.node[index, path].sum() + self.edge[index[:-1], path[:-1], path[1:]].sum())

    def memory_of(self, path: list[int]) -> float:
        return float(self.memory[np.arange(self.blocks), path].sum())


@dataclass
class _Bounds:
    """What the pruning needs: a feasible plan and lower bounds on every completion."""

    incumbent: list[int]
    incumbent_cost: float
    lower_bound: float
    """Best Lagrangian dual value: no plan within the limit costs less."""
    rests: list[tuple[float, np.ndarray]]
    """(lam, rest) with ``rest[b, i]`` the priced cost-to-go *after* block b at degree i:
    a completion using at most M bytes costs at least ``rest[b, i] - lam * M``."""


def _lagrangian_bounds(chain: _Chain, limit: float) -> _Bounds:
    """Search the memory price where the cheapest feasible and infeasible paths tie.

    Starting from lam = 0 (infeasible, else the limit does not bind) and a lam large
    enough that the priced optimum fits, each step prices memory at the slope between
    the two current paths; the priced optimum there is either a new breakpoint
    (replacing one side) or ties both, which is the dual optimum."""
    evaluated: dict[float, np.ndarray] = {}
    paths: list[list[int]] = []
    best_dual, best_lam = float("-inf"), 0.0

    def price(lam: float) -> tuple[list[int], float, float]:
        nonlocal best_dual, best_lam
        to_go, path = chain.priced(lam)
        evaluated[lam] = to_go
        paths.append(path)
        dual = float(to_go[0].min()) - lam * limit
        if dual > best_dual:
            best_dual, best_lam = dual, lam
        return path, chain.cost(path), chain.memory_of(path)

    low = price(0.0)
    high = None
    if low[2] > limit:
        spread_cost = float(np.ptp(chain.node, axis=1).sum() + chain.edge.max(axis=(1, 2)).sum())
        spread_memory = max(float(np.ptp(chain.memory, axis=1).sum()), 1.0)
        lam = max(spread_cost, 1e-12) / spread_memory
        for _ in range(MAX_MULTIPLIER_STEPS):
            high = price(lam)
            if high[2] <= limit:
                break
            lam *= 4
    if high is not None and high[2] <= limit:
        for _ in range(MAX_MULTIPLIER_STEPS):
            if low[2] <= high[2]:
                break
            lam = (high[1] - low[1]) / (low[2] - high[2])
            if lam <= 0 or lam in evaluated:
                break
            middle = price(lam)
            line = low[1] + lam * low[2]
            if middle[1] + lam * middle[2] >= line - COST_SLACK * (1 + abs(line)):
                break  # nothing below the segment joining the two paths: lam is the dual optimum
            if middle[2] <= limit:
                high = middle
            else:
                low = middle
    lean = [int(i) for i in chain.memory.argmin(axis=1)]
    incumbent, incumbent_cost = _best_splice(chain, limit, [lean, *paths])

    def rest(lam: float) -> np.ndarray:
        return evaluated[lam] - chain.node - lam * chain.memory

    return _Bounds(incumbent, incumbent_cost, best_dual, [(lam, rest(lam)) for lam in sorted({0.0, best_lam})])


def _best_splice(chain: _Chain, limit: float, paths: list[list[int]]) -> tuple[list[int], float]:
    """Cheapest plan within the limit made of one path's prefix and another's suffix
    (a path with itself: the path whole).

    Why: the priced optima on either side of the dual optimum are typically uniform
    (all lean, all fast), while the optimum runs one up to some layer and the other
    after it, paying a single reshard; the search prunes against this cost, so the
    closer it is to the optimum the fewer labels live.  Vectorised over the cut."""
    index = np.arange(chain.blocks)
    arrays = [np.array(path) for path in paths]
    nodes = [chain.node[index, a] for a in arrays]
    inner = [np.concatenate([[0.0], chain.edge[index[:-1], a[:-1], a[1:]]]) for a in arrays]  # edge into block k
    prefix_cost = [np.concatenate([[0.0], np.cumsum(n + e)]) for n, e in zip(nodes, inner)]  # blocks < k
    prefix_memory = [np.concatenate([[0.0], np.cumsum(chain.memory[index, a])]) for a in arrays]
    best_path, best_cost = [int(i) for i in chain.memory.argmin(axis=1)], float("inf")
    cut = index[1:]  # head takes blocks < cut, tail blocks >= cut
    for p, head in enumerate(arrays):
        whole_memory, whole_cost = prefix_memory[p][-1], prefix_cost[p][-1]
        if whole_memory <= limit and whole_cost < best_cost:
            best_path, best_cost = paths[p], float(whole_cost)
        for q, tail in enumerate(arrays):
            if p == q:
                continue
            memory = prefix_memory[p][cut] + prefix_memory[q][-1] - prefix_memory[q][cut]
            cost = (prefix_cost[p][cut] + prefix_cost[q][-1] - prefix_cost[q][cut] - inner[q][cut]
                    + chain.edge[cut - 1, head[cut - 1], tail[cut]])
            cost = np.where(memory <= limit, cost, np.inf)
            k = int(cost.argmin())
            if cost[k] < best_cost:
                best_path, best_cost = paths[p][:cut[k]] + paths[q][cut[k]:], float(cost[k])
    return best_path, best_cost


def _greedy_bounds(table: CostTable, chain: _Chain, limit: float) -> _Bounds:
    """The earlier DP's bounds: the cheapest uniform-per-kind plan that fits (else the
    leanest) and, for a completion, the sum of each later block's cheapest node."""
    kinds, width = table.block_kinds(), chain.node.shape[1]
    candidates = [[attn if kind == "attn" else mlp for kind in kinds] for attn in range(width) for mlp in range(width)]
    candidates.append([int(i) for i in chain.memory.argmin(axis=1)])
    path = min((p for p in candidates if fits_memory(chain.memory_of(p), limit)), key=chain.cost)
    cheapest = chain.node.min(axis=1)
    after = np.concatenate([np.cumsum(cheapest[::-1])[::-1][1:], [0.0]])  # sum over blocks > b
    rest = np.repeat(after[:, None], width, axis=1)
    return _Bounds(path, chain.cost(path), float("-inf"), [(0.0, rest)])


@dataclass
class _Labels:
    """Every label kept at one block, all degrees together, grouped by degree: within a
    group memory ascends and cost strictly descends (a Pareto front per degree).

    Why one array per block, not one per (block, degree): the search is numpy calls per
    block, and a block has few live degrees but six possible ones."""

    degree: np.ndarray
    """Degree index of the block for each label (ascending)."""
    memory: np.ndarray
    cost: np.ndarray
    source: np.ndarray
    """Index of the label this one extends in the previous block's arrays (-1: first block)."""

    @classmethod
    def pareto(cls, degree: np.ndarray, memory: np.ndarray, cost: np.ndarray, source: np.ndarray,
               width: int) -> _Labels:
        """Keep, per degree, the labels no other beats in both memory and cost (ties: one).

        The per-degree running minimum of cost is taken exactly, on a [degree, rank]
        array padded with +inf, so no float offset can reorder near-ties."""
        order = np.lexsort((cost, memory, degree))
        degree, memory, cost, source = degree[order], memory[order], cost[order], source[order]
        counts = np.bincount(degree, minlength=width)
        rank = np.arange(len(degree)) - np.repeat(np.cumsum(counts) - counts, counts)
        padded = np.full((width, int(counts.max()) + 1), np.inf)
        padded[degree, rank + 1] = cost
        cheaper_before = np.minimum.accumulate(padded, axis=1)[degree, rank]
        keep = cost < cheaper_before
        return cls(degree[keep], memory[keep], cost[keep], source[keep])


def optimal_block_degrees(table: CostTable, memory_limit_bytes: float | None, bound: str = "lagrangian") -> list[int]:
    """The degree of every block (attn0, mlp0, ...) in a minimum-cost plan within the limit
    (:func:`optimal_block_choices` without the policies)."""
    return [degree for degree, _ in optimal_block_choices(table, memory_limit_bytes, bound)]


def optimal_block_choices(table: CostTable, memory_limit_bytes: float | None,
                          bound: str = "lagrangian") -> list[tuple[int, str]]:
    """The (degree, policy) of every block (attn0, mlp0, ...) in a minimum-cost plan within the limit.

    Raises :class:`~oases_ds.planner.plan.PlanInfeasibleError` when no plan fits.
    """
    if bound not in BOUNDS:
        raise ValueError(f"bound={bound!r} unknown; choose one of {', '.join(BOUNDS)}")
    check_memory_feasible(table, memory_limit_bytes)
    chain = _Chain.of(table)
    degrees = table.choices()  # the columns: "degree" below is a column index
    if memory_limit_bytes is None:  # one pass of the plain shortest path is the optimum
        return [degrees[i] for i in chain.priced(0.0)[1]]
    limit = block_memory_limit(table, memory_limit_bytes * (1 + MEMORY_REL_EPS))  # the rows' share: the table's constant is off
    bounds = _lagrangian_bounds(chain, limit) if bound == "lagrangian" else _greedy_bounds(table, chain, limit)
    if bounds.lower_bound >= bounds.incumbent_cost - COST_SLACK * (1 + abs(bounds.incumbent_cost)):
        return [degrees[i] for i in bounds.incumbent]  # meets the dual bound: optimal, no search needed
    incumbent = bounds.incumbent_cost * (1 + COST_SLACK) + COST_SLACK
    width = len(degrees)
    lean = chain.memory.min(axis=1)
    lean_after = np.concatenate([np.cumsum(lean[::-1])[::-1][1:], [0.0]])  # leanest blocks > b: exact, no edges

    def admissible(block: int, degree: np.ndarray, memory: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """Mask of the labels at ``block`` (at ``degree``) that may still complete within
        the limit at a cost <= the incumbent's."""
        ok = memory + lean_after[block] <= limit
        for lam, rest in bounds.rests:
            ok &= cost + rest[block][degree] - lam * (limit - memory) <= incumbent
        return ok

    degree = np.arange(width)
    memory, cost = chain.memory[0], chain.node[0]
    ok = admissible(0, degree, memory, cost)
    labels = [_Labels(degree[ok], memory[ok], cost[ok], np.full(int(ok.sum()), -1))]
    for block in range(1, chain.blocks):
        previous = labels[-1]
        # Every label into every degree of this block: [degree here, label before].
        memory = previous.memory[None, :] + chain.memory[block][:, None]
        cost = previous.cost[None, :] + chain.edge[block - 1][previous.degree].T + chain.node[block][:, None]
        here = np.broadcast_to(degree[:, None], memory.shape)
        ok = admissible(block, here, memory, cost)
        source = np.broadcast_to(np.arange(len(previous.cost))[None, :], memory.shape)
        labels.append(_Labels.pareto(here[ok], memory[ok], cost[ok], source[ok], width))
        if not len(labels[-1].cost):  # the incumbent's own labels are admissible: only float trouble
            return [degrees[i] for i in bounds.incumbent]

    index = int(labels[-1].cost.argmin())
    path = []
    for block in range(chain.blocks - 1, -1, -1):
        path.append(int(labels[block].degree[index]))
        index = int(labels[block].source[index])
    path.reverse()
    return [degrees[i] for i in path]


def solve_dp(table: CostTable, memory_limit_bytes: float | None, bound: str = "lagrangian") -> Plan:
    """Optimal plan by the label DP (same objective and limit as :func:`oases_ds.planner.ilp.solve`)."""
    started = time.perf_counter()
    choices = optimal_block_choices(table, memory_limit_bytes, bound)
    sequence, policies = [degree for degree, _ in choices], [policy for _, policy in choices]
    return Plan.from_block_degrees(
        sequence,
        table.devices,
        policies,
        predicted_step_ms=sequence_step_ms(table, sequence, policies),
        solver_ms=(time.perf_counter() - started) * 1e3,
        solver_name="pareto-dp" if bound == "lagrangian" else f"pareto-dp-{bound}",
        memory_bytes=sequence_memory_bytes(table, sequence, policies),
        table_key=table.key(),
    )
