"""The label DP is exact: equal to brute force and to the ILP on random tables, bound or not."""
from __future__ import annotations

import pytest

from oases_ds.planner.dp import solve_dp
from oases_ds.planner.ilp import solve
from oases_ds.planner.objective import brute_force, fits_memory, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import PlanInfeasibleError
from support import REL_TOL, memory_extremes, random_table


def limits(table):
    """From the leanest plan up to the unconstrained optimum's memory (found by the ILP,
    so deep tables need no brute force)."""
    lean = sum(min(c.memory_bytes for c in table.blocks[kind].values()) for kind in table.block_kinds())
    top = solve(table, None).memory_bytes
    return [None, lean, lean + 0.2 * (top - lean), (lean + top) / 2, top]


@pytest.mark.parametrize("seed", range(30))
def test_dp_equals_brute_force(seed):
    table = random_table(seed, 2 + seed % 2)
    for limit in limits(table):
        dp, oracle = solve_dp(table, limit), brute_force(table, limit)
        assert dp.predicted_step_ms == pytest.approx(oracle.predicted_step_ms, rel=REL_TOL)
        assert dp.predicted_step_ms == pytest.approx(predict_step_ms(table, dp), rel=1e-12)
        assert fits_memory(predict_memory_bytes(table, dp), limit)


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_ilp_on_deeper_tables(seed):
    table = random_table(100 + seed, 6 + 2 * seed)
    for limit in limits(table)[1:4]:
        assert solve_dp(table, limit).predicted_step_ms == pytest.approx(solve(table, limit).predicted_step_ms, rel=REL_TOL)


def test_dp_infeasible_states_the_minimum():
    table = random_table(3, 2)
    lean, _ = memory_extremes(table)
    with pytest.raises(PlanInfeasibleError, match="minimum memory any plan needs is"):
        solve_dp(table, lean * 0.99)
