"""The planner's front door, ``make_plan``, called as a script would: no CLI, no Hydra, no process.

What it must show: the same plan ``oases-plan`` writes for the same inputs (pinned in
tests/integration/test_plan_pinned.py), the replay keeping the fastest of the solver's plan and the
uniform ones, the stage split, and a request that cannot be planned refused before anything runs.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from oases_ds.models.config import ModelConfig
from oases_ds.parallel.link import LinkModel
from oases_ds.planner import PipelineRequest, PlanInfeasibleError, PlanRequest, make_plan
from oases_ds.planner.analytic import DeviceModel
from oases_ds.planner.planning import load_table
from oases_ds.planner.profile import ProfileSpec

PROFILES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
MODEL = ModelConfig(family="gpt", vocab_size=32000, hidden_size=2048, num_heads=16, num_layers=4, seq_len=1024)
RTX3090 = DeviceModel("rtx3090", 71.0, 0.4)


def analytic(**kwargs) -> PlanRequest:
    spec = ProfileSpec(model=MODEL, devices=4, micro_batch=8, link=LinkModel(10.0, 25.0), cluster="eth_10g")
    return PlanRequest(spec, cost="analytic", device=RTX3090, **kwargs)


def test_a_table_file_plans_as_oases_plan_does():
    """The cm8 profile of the pinned ``table_cm8`` case: uniform degree 1, replayed at 405.491 ms."""
    result = make_plan(PlanRequest(None, table_path=str(PROFILES / "gpt_t2_cm8.json")))
    assert result.plan.block_degrees() == [1] * 8 and result.plan.solver_name == "pareto-dp"
    assert result.plan.predicted_step_ms == pytest.approx(405.49075800813466, rel=1e-12)
    assert [ms for _, ms in result.replayed] == sorted(ms for _, ms in result.replayed)
    assert result.best_uniform == (1, pytest.approx(405.49075800813466, rel=1e-12))
    assert result.memory is None  # a table file's model is not described by the request
    assert result.loaded.source == f"from {PROFILES / 'gpt_t2_cm8.json'}"


def test_the_replay_keeps_the_fastest_candidate_and_the_memory_is_replayed():
    result = make_plan(analytic())
    considered = [plan.block_degrees() for plan, _ in result.replayed]
    assert result.plan.block_degrees() == considered[0]
    assert all([d] * 8 in considered for d in (1, 2, 4))  # every uniform plan fits: no limit
    assert result.plan.predicted_step_ms == result.replayed[0][1] <= result.best_uniform[1]
    assert result.memory is not None and result.memory.peak_bytes > result.memory.state_bytes > 0
    assert "nothing launched" in result.loaded.source


def test_a_memory_limit_binds_or_is_refused():
    unbounded = make_plan(analytic())
    tight = make_plan(analytic(memory_limit_bytes=unbounded.plan.memory_bytes * 0.9))
    assert tight.plan.memory_bytes <= unbounded.plan.memory_bytes * 0.9
    with pytest.raises(PlanInfeasibleError, match="no plan fits"):
        make_plan(analytic(memory_limit_bytes=1e6))


def test_stages_are_split_and_set_beside_the_even_split():
    result = make_plan(analytic(pipeline=PipelineRequest(2, micro_batches=4)))
    assert result.stages is not None and result.stages.pipeline.micro_batches == 4
    assert sum(result.plan.stage_layers) == 4 and result.plan.micro_batches == 4
    assert result.stages.even == [2, 2] and result.stages.staged.step_ms <= result.stages.even_plan.step_ms
    assert result.replayed is None and result.memory is None


def test_the_table_loads_once_when_the_caller_has_it():
    request = PlanRequest(None, table_path=str(PROFILES / "gpt_t4_cm9.json"), layers=2)
    loaded = load_table(request)
    assert loaded.table.layers == 2
    given, again = make_plan(request, loaded).plan, make_plan(request).plan
    assert (given.block_degrees(), given.predicted_step_ms) == (again.block_degrees(), again.predicted_step_ms)


@pytest.mark.parametrize("kwargs, message", [
    (dict(profile=None), "a plan needs a workload"),
    (dict(profile=None, cost="guess"), "cost='guess' unknown; choose one of profile, analytic"),
    (dict(profile=None, cost="analytic", table_path="t.json"), "table= and cost=analytic both supply the cost table"),
    (dict(profile=None, table_path="t.json", solver="gurobi"), "planner.solver='gurobi' unknown; choose one of dp, ilp"),
])
def test_a_request_that_cannot_be_planned_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanRequest(**kwargs)
    with pytest.raises(ValueError, match="cost=analytic needs the cluster's link and device"):
        PlanRequest(ProfileSpec(model=MODEL, devices=4, micro_batch=8), cost="analytic", device=RTX3090)
