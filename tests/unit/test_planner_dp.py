"""The label DP (the default solver) is exact: equal to exhaustive enumeration and to the ILP
on seeded random tables, bound or not, and its Lagrangian bounds are valid bounds."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from oases_ds.cli.plan import SOLVERS, PlannerSchema, PlanSchema, check_solver, run
from oases_ds.planner.costs import CostTable
from oases_ds.planner.dp import BOUNDS, _Chain, _lagrangian_bounds, solve_dp
from oases_ds.planner.ilp import solve
from oases_ds.planner.objective import brute_force, fits_memory, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import PlanInfeasibleError
from support import REL_TOL, memory_extremes, random_table


def with_degrees(table: CostTable, degrees: tuple[int, ...]) -> CostTable:
    """The same random table restricted to fewer profiled degrees (2 instead of 3)."""
    blocks = {kind: {t: by_degree[t] for t in degrees} for kind, by_degree in table.blocks.items()}
    return dataclasses.replace(table, degrees=degrees, blocks=blocks)


def small_tables() -> list[tuple[int, CostTable]]:
    """1-3 layers, 3 degrees (1, 2, 4) or 2 degrees (2, 4 / 1, 4): at most 3^6 = 729 plans each."""
    tables = []
    for seed in range(24):
        table = random_table(seed, 1 + seed % 3)
        if seed % 4 == 3:
            table = with_degrees(table, (2, 4) if seed % 8 == 3 else (1, 4))
        tables.append((seed, table))
    return tables


def binding_limits(table: CostTable) -> list[float]:
    """Limits between the leanest plan and the unconstrained optimum's memory (by brute force)."""
    lean, top = memory_extremes(table)
    return [lean, lean + 0.2 * (top - lean), (lean + top) / 2, lean + 0.9 * (top - lean)]


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("seed,table", small_tables(), ids=[f"seed{s}" for s, _ in small_tables()])
def test_dp_equals_brute_force(seed: int, table: CostTable, bound: str) -> None:
    free = brute_force(table, None)
    binding = 0
    for limit in [None, *binding_limits(table)]:
        dp, oracle = solve_dp(table, limit, bound), brute_force(table, limit)
        binding += oracle.predicted_step_ms > free.predicted_step_ms * (1 + 1e-9)
        # The degrees the DP returns achieve the enumerated optimum (not only its reported number).
        assert predict_step_ms(table, dp) == pytest.approx(oracle.predicted_step_ms, rel=REL_TOL)
        assert dp.predicted_step_ms == pytest.approx(oracle.predicted_step_ms, rel=REL_TOL)
        assert fits_memory(predict_memory_bytes(table, dp), limit)
    assert binding or free.memory_bytes <= memory_extremes(table)[0] * (1 + 1e-9)  # a limit bound, unless it cannot


def test_most_small_tables_have_a_binding_limit() -> None:
    """Guard: the brute-force comparison must mostly run with the memory limit binding."""
    binds = 0
    for _, table in small_tables():
        lean, top = memory_extremes(table)
        binds += brute_force(table, (lean + top) / 2).predicted_step_ms > brute_force(table, None).predicted_step_ms
    assert binds >= 16


@pytest.mark.parametrize("seed", range(12))
def test_lagrangian_bounds_bracket_the_optimum(seed: int) -> None:
    """The proof of optimality rests on these: dual bound <= optimum <= incumbent, incumbent feasible."""
    table = random_table(200 + seed, 2 + seed % 2)
    lean, top = memory_extremes(table)
    limit = lean + (0.2 + 0.05 * seed) * (top - lean)
    optimum = brute_force(table, limit).predicted_step_ms
    bounds = _lagrangian_bounds(_Chain.of(table), limit)
    assert bounds.lower_bound <= optimum * (1 + 1e-9)
    assert bounds.incumbent_cost >= optimum * (1 - 1e-9)
    degrees = [table.degrees[i] for i in bounds.incumbent]
    assert fits_memory(sum(table.blocks[k][t].memory_bytes for k, t in zip(table.block_kinds(), degrees)), limit)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_ilp_on_deeper_tables(seed: int) -> None:
    table = random_table(100 + seed, 6 + 2 * seed)
    # The ILP (brute force is too slow this deep), with a time limit no loaded machine reaches:
    # running out is an error, and this test is about the optimum, not about speed.
    top = solve(table, None, time_limit_s=600).memory_bytes
    lean = sum(min(c.memory_bytes for c in table.blocks[kind].values()) for kind in table.block_kinds())
    for limit in (lean + 0.2 * (top - lean), (lean + top) / 2):
        ilp = solve(table, limit, time_limit_s=600)
        assert solve_dp(table, limit).predicted_step_ms == pytest.approx(ilp.predicted_step_ms, rel=REL_TOL)


def test_infeasible_limit_is_one_line_with_the_minimum() -> None:
    table = random_table(3, 2)
    lean, _ = memory_extremes(table)
    with pytest.raises(PlanInfeasibleError, match="minimum memory any plan needs is") as info:
        solve_dp(table, lean * 0.99)
    assert "\n" not in str(info.value) and f"{lean * 0.99:.6g}" in str(info.value)


def test_unknown_bound_names_the_choices() -> None:
    with pytest.raises(ValueError, match="bound='tight' unknown; choose one of lagrangian, greedy"):
        solve_dp(random_table(0, 1), None, "tight")


def test_solver_choice_is_validated_in_the_config() -> None:
    assert PlannerSchema().solver == "dp" and SOLVERS == ("dp", "ilp")  # dp: exact and fastest (benchmarks/README.md)
    check_solver({"planner": {"solver": "ilp"}})
    with pytest.raises(ValueError) as info:
        check_solver({"planner": {"solver": "gurobi"}})
    assert str(info.value) == "planner.solver='gurobi' unknown; choose one of dp, ilp"


def test_unknown_solver_fails_before_the_cost_table_is_loaded(tmp_path) -> None:
    """Profiling can take minutes, so a typo in planner.solver must stop the run first: the
    table named here does not exist, and the error is about the solver, not the file."""
    cfg = OmegaConf.to_container(OmegaConf.structured(PlanSchema))
    cfg["planner"]["solver"], cfg["table"] = "gurobi", str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"^planner.solver='gurobi' unknown; choose one of dp, ilp$"):
        run(cfg)
