"""The planner's objective: a plan's predicted step time and memory from a cost table, and a brute-force oracle.

This is the one definition of a plan's cost: the ILP encodes the same sum
(node costs + edge costs) and the tests hold it to this value, so a change in
the cost model cannot silently diverge between solver and prediction.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from oases_ds.planner.costs import CostTable, edge_ms, first_block_ms, last_block_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError

MEMORY_REL_EPS = 1e-12
"""Plans whose memory totals differ by float rounding only are treated as equal
(relative): the same blocks summed in another order can land one ulp above a limit
they meet exactly.  Far below any byte count a profile can tell apart; the ILP's own
feasibility tolerance is looser still."""


def fits_memory(memory_bytes: float, memory_limit_bytes: float | None) -> bool:
    """Whether a plan's memory meets the limit, up to :data:`MEMORY_REL_EPS`: the one
    test of the limit shared by the DP, the brute-force oracle and the tests."""
    return memory_limit_bytes is None or memory_bytes <= memory_limit_bytes * (1 + MEMORY_REL_EPS)


def _policies(table: CostTable, block_degrees: Sequence[int], block_policies: Sequence[str] | None) -> Sequence[str]:
    policies = block_policies if block_policies is not None else ["oases"] * len(block_degrees)
    if len(policies) != len(block_degrees):
        raise ValueError(f"{len(policies)} block policies for {len(block_degrees)} block degrees")
    return policies


def sequence_step_ms(table: CostTable, block_degrees: Sequence[int], block_policies: Sequence[str] | None = None) -> float:
    """Objective of a block-degree sequence (attn0, mlp0, attn1, ...), each block under its policy
    (``None``: every block ``oases``): node costs, the edges between neighbouring blocks, and the
    edges from the embedding and into the head."""
    policies = _policies(table, block_degrees, block_policies)
    kinds = table.block_kinds()
    nodes = sum(table.block_cost(kind, degree, policy).step_ms for kind, degree, policy in zip(kinds, block_degrees, policies))
    edges = sum(edge_ms(table, i, block_degrees[i], block_degrees[i + 1], policies[i], policies[i + 1])
                for i in range(len(block_degrees) - 1))
    ends = first_block_ms(table, block_degrees[0], policies[0]) + last_block_ms(table, block_degrees[-1], policies[-1])
    return nodes + edges + ends


def sequence_memory_bytes(table: CostTable, block_degrees: Sequence[int], block_policies: Sequence[str] | None = None) -> float:
    """Per-device memory of a block-degree sequence: the table's constant plus each block's row (under its policy)."""
    policies = _policies(table, block_degrees, block_policies)
    return table.fixed_bytes + sum(table.block_cost(kind, degree, policy).memory_bytes
                                   for kind, degree, policy in zip(table.block_kinds(), block_degrees, policies))


def check_plan_fits_table(table: CostTable, plan: Plan) -> None:
    """A plan priced by ``table`` must have its devices and layers and use only profiled degrees and priced policies."""
    if plan.devices != table.devices or plan.layers != table.layers:
        raise ValueError(
            f"plan is for devices={plan.devices}, layers={plan.layers}; "
            f"table {table.key()} has devices={table.devices}, layers={table.layers}"
        )
    if unprofiled := sorted(set(plan.block_degrees()) - set(table.degrees)):
        raise ValueError(f"plan uses degrees {unprofiled} not profiled in table {table.key()}")
    if unpriced := sorted(set(plan.block_policies()) - set(table.policies)):
        raise ValueError(f"plan uses policies {unpriced} the table {table.key()} does not price "
                         f"(it prices {', '.join(table.policies)})")


def predict_step_ms(table: CostTable, plan: Plan) -> float:
    """Predicted step time of ``plan``: what the solvers minimise."""
    check_plan_fits_table(table, plan)
    return sequence_step_ms(table, plan.block_degrees(), plan.block_policies())


def predict_memory_bytes(table: CostTable, plan: Plan) -> float:
    check_plan_fits_table(table, plan)
    return sequence_memory_bytes(table, plan.block_degrees(), plan.block_policies())


def block_memory_limit(table: CostTable, memory_limit_bytes: float) -> float:
    """What the blocks' rows may sum to under ``memory_limit_bytes``: the limit less the
    table's constant (:attr:`CostTable.fixed_bytes`), for solvers that sum the rows only."""
    return memory_limit_bytes - table.fixed_bytes


def check_memory_feasible(table: CostTable, memory_limit_bytes: float | None) -> None:
    """Raise :class:`PlanInfeasibleError` when even the leanest plan exceeds the limit.

    Memory is a sum over blocks with no edge terms, so the leanest plan takes
    each block's smallest footprint independently; this exact test lets the
    error state the number a user needs instead of a bare solver status.
    """
    if memory_limit_bytes is None:
        return
    minimum = table.fixed_bytes + sum(min(table.block_cost(kind, degree, policy).memory_bytes for degree, policy in table.choices())
                                      for kind in table.block_kinds())
    if minimum > memory_limit_bytes:
        raise PlanInfeasibleError(
            f"no plan fits: the minimum memory any plan needs is {minimum:.6g} bytes per device, "
            f"limit is {memory_limit_bytes:.6g} bytes ({table.key()})"
        )


def brute_force(table: CostTable, memory_limit_bytes: float | None) -> Plan:
    """Exhaustive search over every block's (degree, policy), exponential in blocks: only the
    test oracle for small tables."""
    check_memory_feasible(table, memory_limit_bytes)

    def split(sequence: tuple[tuple[int, str], ...]) -> tuple[list[int], list[str]]:
        return [degree for degree, _ in sequence], [policy for _, policy in sequence]

    feasible = (
        sequence
        for sequence in itertools.product(table.choices(), repeat=2 * table.layers)
        if fits_memory(sequence_memory_bytes(table, *split(sequence)), memory_limit_bytes)
    )
    degrees, policies = split(min(feasible, key=lambda sequence: sequence_step_ms(table, *split(sequence))))
    return Plan.from_block_degrees(
        degrees,
        table.devices,
        policies,
        predicted_step_ms=sequence_step_ms(table, degrees, policies),
        solver_name="brute_force",
        memory_bytes=sequence_memory_bytes(table, degrees, policies),
        table_key=table.key(),
    )
