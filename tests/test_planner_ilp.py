"""Planner core on synthetic cost tables: ILP against a brute-force oracle, no processes."""
from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from oases_ds.planner.costs import BlockCost, CostTable, reshard_ms
from oases_ds.planner.ilp import solve
from oases_ds.planner.plan import Plan, PlanInfeasibleError
from oases_ds.planner.simulate import brute_force, predict_memory_bytes, predict_step_ms

DEGREES = (1, 2, 4)
# Ties between plans are fine (only objectives are compared); this covers solver tolerances.
REL_TOL = 1e-7


def random_table(seed: int, layers: int) -> CostTable:
    """Costs drawn independently per degree so the optimum is not always uniform."""
    rng = random.Random(seed)

    def block(degree: int) -> BlockCost:
        return BlockCost(
            fwd_ms=rng.uniform(1, 10),
            bwd_ms=rng.uniform(2, 20),
            comm_fwd_ms=rng.uniform(0, 5) * (degree > 1),
            comm_bwd_ms=rng.uniform(0, 5) * (degree > 1),
            state_bytes=rng.uniform(1e9, 8e9) / degree,
            act_bytes=rng.uniform(1e8, 1e9) * degree / max(DEGREES),
            grad_sync_ms=rng.uniform(0, 6) / degree,
        )

    return CostTable(
        model=f"random-{seed}",
        cluster="synthetic",
        schedule="oases",
        devices=4,
        degrees=DEGREES,
        blocks={kind: {t: block(t) for t in DEGREES} for kind in ("attn", "mlp")},
        layers=layers,
        reshard_bytes=rng.uniform(1e6, 5e8),
        bandwidth_gbps=rng.choice([10.0, 25.0, 100.0]),
        latency_us=rng.uniform(5, 50),
    )


def memory_extremes(table: CostTable) -> tuple[float, float]:
    """(leanest possible memory, memory of the unconstrained optimum)."""
    lean = sum(min(c.memory_bytes for c in table.blocks[kind].values()) for kind in table.block_kinds())
    return lean, brute_force(table, None).memory_bytes


CASES = [(seed, 2 + seed % 2) for seed in range(24)]


@pytest.mark.parametrize("seed,layers", CASES)
def test_ilp_matches_brute_force_unbounded(seed: int, layers: int) -> None:
    table = random_table(seed, layers)
    plan = solve(table, None)
    assert plan.predicted_step_ms == pytest.approx(brute_force(table, None).predicted_step_ms, rel=REL_TOL)


def _binds(seed: int, layers: int) -> bool:
    lean, unconstrained = memory_extremes(random_table(seed, layers))
    return unconstrained > lean * 1.0001


# Tables where the fastest plan is already the leanest cannot have a binding limit.
BINDING_CASES = [case for case in CASES if _binds(*case)]


@pytest.mark.parametrize("seed,layers", BINDING_CASES)
def test_ilp_matches_brute_force_with_binding_memory(seed: int, layers: int) -> None:
    table = random_table(seed, layers)
    lean, unconstrained = memory_extremes(table)
    limit = (lean + unconstrained) / 2
    oracle = brute_force(table, limit)
    plan = solve(table, limit)
    assert oracle.predicted_step_ms > brute_force(table, None).predicted_step_ms  # the bound binds
    assert plan.predicted_step_ms == pytest.approx(oracle.predicted_step_ms, rel=REL_TOL)
    assert predict_memory_bytes(table, plan) <= limit


def test_most_memory_cases_bind() -> None:
    """Guard against the binding test shrinking its way to green."""
    assert len(BINDING_CASES) >= 20


@pytest.mark.parametrize("seed", range(6))
def test_objective_equals_predicted_step_time(seed: int) -> None:
    table = random_table(seed, layers=3)
    plan = solve(table, sum(memory_extremes(table)) / 2)
    assert plan.predicted_step_ms == pytest.approx(predict_step_ms(table, plan), rel=1e-9)


def test_infeasible_memory_names_the_minimum() -> None:
    table = random_table(0, layers=2)
    lean, _ = memory_extremes(table)
    with pytest.raises(PlanInfeasibleError, match=re.escape(f"{lean:.6g} bytes")) as info:
        solve(table, lean * 0.99)
    assert f"{lean * 0.99:.6g}" in str(info.value)
    with pytest.raises(PlanInfeasibleError):
        brute_force(table, lean * 0.99)


def test_leanest_limit_is_feasible() -> None:
    table = random_table(1, layers=2)
    lean, _ = memory_extremes(table)
    plan = solve(table, lean * (1 + 1e-9))
    assert predict_memory_bytes(table, plan) == pytest.approx(lean)


def test_reshard_cost_model() -> None:
    table = random_table(2, layers=2)
    assert reshard_ms(table, 2, 2) == 0.0
    # One slice plus one AllGather whichever way: the gather is in forward or in backward.
    assert reshard_ms(table, 1, 4) == reshard_ms(table, 4, 1) > reshard_ms(table, 2, 4) > 0


def test_plan_json_round_trip(tmp_path) -> None:
    table = random_table(3, layers=3)
    plan = solve(table, None)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert Plan.from_json(path) == plan
    assert not [p for p in tmp_path.iterdir() if p.name != "plan.json"]  # no temp file left behind


def test_cost_table_json_round_trip(tmp_path) -> None:
    table = random_table(4, layers=2)
    path = tmp_path / "table.json"
    table.to_json(path)
    loaded = CostTable.from_json(path)
    assert loaded == table
    assert loaded.key() == "random-4|synthetic|oases|4|cm2"


def test_plan_as_table_collapses_runs() -> None:
    plan = Plan((4, 4, 4, 2, 2), (4, 4, 4, 4, 1), devices=4)
    assert plan.as_table() == "layers 0-2: attn 4, mlp 4\nlayers 3: attn 2, mlp 4\nlayers 4: attn 2, mlp 1"
    assert Plan.uniform(8, 12, 8).as_table() == "layers 0-11: attn 8, mlp 8"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(attn_degrees=(4, 3), mlp_degrees=(4, 4), devices=4), r"Plan.attn_degrees\[1\]"),
        (dict(attn_degrees=(4, 4), mlp_degrees=(8, 4), devices=4), r"Plan.mlp_degrees\[0\]"),
        (dict(attn_degrees=(4, 4), mlp_degrees=(4,), devices=4), "Plan.attn_degrees and Plan.mlp_degrees"),
        (dict(attn_degrees=(1,), mlp_degrees=(1,), devices=0), "Plan.devices"),
    ],
)
def test_bad_plan_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Plan(**kwargs)


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(degrees=(1, 3)), "CostTable.degrees"),
        (dict(degrees=(4, 2, 1)), "CostTable.degrees"),
        (dict(layers=0), "CostTable.layers"),
        (dict(bandwidth_gbps=0.0), "CostTable.bandwidth_gbps"),
        (dict(blocks={"attn": {}}), "CostTable.blocks"),
    ],
)
def test_bad_cost_table_names_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(random_table(0, layers=2), **change)


def test_bad_block_cost_names_field() -> None:
    good = random_table(0, layers=2).blocks["attn"][1]
    with pytest.raises(ValueError, match="BlockCost.bwd_ms"):
        dataclasses.replace(good, bwd_ms=-1.0)
    with pytest.raises(ValueError, match="BlockCost.fwd_ms"):
        dataclasses.replace(good, fwd_ms=float("nan"))


def test_bad_json_names_field(tmp_path) -> None:
    path = tmp_path / "plan.json"
    Plan.uniform(4, 2, 2).to_json(path)
    payload = json.loads(path.read_text())
    payload["mlp_degree"] = payload.pop("mlp_degrees")
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"unknown Plan field\(s\) \['mlp_degree'\]"):
        Plan.from_json(path)


def test_plan_must_match_table() -> None:
    with pytest.raises(ValueError, match="layers=3"):
        predict_step_ms(random_table(0, layers=2), Plan.uniform(4, 3, 4))
