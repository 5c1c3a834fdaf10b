"""Cost-model accuracy check: plans measured for real, ranked against predictions."""
from __future__ import annotations

import json

import pytest

from oases_ds.planner.accuracy import candidate_plans, spearman
from oases_ds.planner.plan import Plan
from support import plan_cli
from support import random_table


def test_candidates_are_distinct_and_start_with_every_uniform_plan():
    table = random_table(3, 3)
    solved = Plan.from_block_degrees([1, 2, 4, 1, 2, 4], table.devices)
    plans = candidate_plans(table, 10, [solved])
    assert len(plans) == 10
    assert len({tuple(p.block_degrees()) for p in plans}) == 10
    assert [set(p.block_degrees()) for p in plans[: len(table.degrees)]] == [{d} for d in table.degrees]
    assert plans[len(table.degrees)].block_degrees() == solved.block_degrees()


def test_spearman_of_a_monotone_relation_is_one():
    assert spearman([1, 2, 3, 4], [10, 20, 35, 90])[0] == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [9, 7, 5, 1])[0] == pytest.approx(-1.0)


@pytest.mark.distributed
def test_accuracy_mode_measures_eight_plans(tmp_path):
    """End to end on 2 ranks with a tiny GPT (profile, solve, measure 8 plans); the
    correlation itself is reported, not asserted: on a shared 2-core box it is noise-bound."""
    out = tmp_path / "acc.json"
    proc = plan_cli("mode=accuracy", "model=gpt_tiny", "devices=2", "micro_batch=8", "accuracy.plans=8",
                    "accuracy.warmup=0", "accuracy.repeats=1", f"accuracy.out={out}", f"planner.cache_dir={tmp_path}",
                    "planner.repeats=1", "planner.warmup=0", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 8
    assert sum(r["is_solver_plan"] for r in result["rows"]) == 1
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in result["rows"])
    assert -1.0 <= result["spearman"] <= 1.0
    assert "Spearman rank correlation predicted vs measured" in proc.stdout
