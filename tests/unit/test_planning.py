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
from oases_ds.planner.costs import STATE_BYTES_PER_PARAM, ModelStates
from oases_ds.planner.memory import estimate_memory
from oases_ds.planner.planning import load_table
from oases_ds.planner.profile import ProfileSpec

PROFILES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
MODEL = ModelConfig(family="gpt", vocab_size=32000, hidden_size=2048, num_heads=16, num_layers=4, seq_len=1024)
RTX3090 = DeviceModel("rtx3090", 71.0, 0.4)


def analytic(micro_batch: int = 8, **kwargs) -> PlanRequest:
    spec = ProfileSpec(model=MODEL, devices=4, micro_batch=micro_batch, link=LinkModel(10.0, 25.0), cluster="eth_10g")
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


@pytest.mark.parametrize("states, per_param", [
    (ModelStates(), 16),                                              # bf16: 2 + 2 + 12 (every stored table's price)
    (ModelStates("fp32"), 16),                                        # 4 + 4 + two moments, no separate master
    (ModelStates("bf16", 1, data_parallel_size=4), 2 + 2 + 12 / 4),   # the optimizer's 12 split over DP
    (ModelStates("fp32", 1, data_parallel_size=2), 4 + 4 + 12 / 2),   # DeepSpeed keeps an fp32 partition copy
    (ModelStates("bf16", 2, data_parallel_size=4), 2 + 2 + 12 / 4),   # gradients whole in the schedule: ZeRO-1's peak
    (ModelStates("fp16", 2, offload=True, data_parallel_size=2), 4),  # the optimizer in host memory
])
def test_model_states_price_precision_zero_and_offload(states, per_param):
    assert states.bytes_per_param() == per_param


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="fp8"), "precision='fp8'; choose one of fp32, bf16, fp16"),
    (dict(zero_stage=3), "zero_stage=3; oases trains with ZeRO 0, 1 or 2"),
    (dict(data_parallel_size=0), "data_parallel_size=0; give an integer >= 1"),
    (dict(offload=True), "offload=true needs zero_stage 1 or 2"),
])
def test_model_states_that_cannot_be_trained_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelStates(**kwargs)


def test_a_plan_prices_model_states_as_requested_and_fits_more_where_they_shrink():
    """Per block and for the embedding and head: the states scale to the requested bytes per
    parameter, activations stay, and the replayed memory's states term says the same."""
    default = make_plan(analytic())
    zero1 = ModelStates("bf16", 1, data_parallel_size=4)
    lean = make_plan(analytic(model_states=zero1))
    base, priced = load_table(analytic()).table, load_table(analytic(model_states=zero1)).table
    ratio = zero1.bytes_per_param() / STATE_BYTES_PER_PARAM
    for kind, by_degree in base.blocks.items():
        for t, cost in by_degree.items():
            assert priced.blocks[kind][t].state_bytes == pytest.approx(cost.state_bytes * ratio, rel=1e-12)
            assert priced.blocks[kind][t].act_bytes == cost.act_bytes
    states = default.memory.state_bytes
    assert lean.memory.state_bytes == pytest.approx(states * ratio, rel=1e-12)
    # the table's constant moved by the embedding's and head's share of the same change
    assert base.fixed_bytes - priced.fixed_bytes > 0
    assert "states bf16, ZeRO 1 over DP 4" in lean.loaded.source
    plan = default.plan  # the same degrees priced both ways: only the states differ
    assert estimate_memory(MODEL, plan.attn_degrees, plan.mlp_degrees, 4, 8, analytic().profile.schedule, 2,
                           bytes_per_param=zero1.bytes_per_param()).state_bytes == pytest.approx(states * ratio, rel=1e-12)
    # between the two unbounded plans' memory: the leaner states keep their fastest plan, the default
    # ones must give up speed for memory (or fit nothing)
    assert lean.plan.memory_bytes < default.plan.memory_bytes
    limit = (lean.plan.memory_bytes + default.plan.memory_bytes) / 2
    assert make_plan(analytic(model_states=zero1, memory_limit_bytes=limit)).plan.predicted_step_ms == \
        pytest.approx(lean.plan.predicted_step_ms, rel=1e-12)
    try:
        squeezed = make_plan(analytic(memory_limit_bytes=limit)).plan
    except PlanInfeasibleError:
        return
    assert squeezed.memory_bytes <= limit and squeezed.predicted_step_ms >= default.plan.predicted_step_ms


def test_a_table_file_with_other_model_states_is_refused():
    with pytest.raises(ValueError, match="re-pricing model states needs the model; plan from the model"):
        PlanRequest(None, table_path="t.json", model_states=ModelStates(zero_stage=1, data_parallel_size=2))


@pytest.mark.parametrize("family, tied", [("llama", False), ("gpt", True)])
def test_dp_in_flight_bytes_bound_the_reducers_buckets_in_backward_order(family, tied):
    """The memory model's bound on the overlapped DP reduction's flat copies is the largest run of
    MAX_IN_FLIGHT consecutive buckets, bucketed as DPGradReducer buckets (``block_of``) and ordered
    as the backward finishes them; none where the reduction is not overlapped."""
    import torch

    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.planner.memory import dp_in_flight_bytes
    from oases_ds.runtime.dp_overlap import MAX_IN_FLIGHT, block_of

    cfg = ModelConfig(family=family, vocab_size=96, hidden_size=32, num_heads=4, num_layers=3, seq_len=8,
                      tie_embeddings=tied)
    with torch.device("meta"):
        model = OperatorModel(cfg)
    buckets: dict = {}
    for name, p in model.named_parameters():
        key = block_of(name, cfg.num_layers)
        buckets[key] = buckets.get(key, 0) + p.numel()
    order = sorted(buckets, key=lambda k: (-k[0], k[1] != "head", k[1] != "mlp"))  # head, L2.mlp, L2.attn, ..., embed
    assert order[0] == (cfg.num_layers, "head") if not tied else order[-1] == (-1, "embed")
    sizes = [buckets[k] for k in order]
    window = max(sum(sizes[i:i + MAX_IN_FLIGHT]) for i in range(len(sizes)))
    assert dp_in_flight_bytes(cfg, 1, ModelStates("fp32", 1, data_parallel_size=2)) == window * 4
    assert dp_in_flight_bytes(cfg, 1, ModelStates("bf16", 0, data_parallel_size=2)) == window * 2
    for quiet in (ModelStates("fp32", 1), ModelStates("bf16", 2, data_parallel_size=2),
                  ModelStates("bf16", 1, offload=True, data_parallel_size=2), ModelStates("fp16", 0, data_parallel_size=2)):
        assert dp_in_flight_bytes(cfg, 1, quiet) == 0.0  # DP 1, or DeepSpeed's reducer after the schedule


def test_offload_staging_is_the_largest_parameter_shard_in_the_gradients_dtype():
    """DeepSpeed's offload stages each gradient through one device buffer of the largest
    parameter's size: the memory model charges exactly that, and only under offload."""
    import torch

    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.planner.memory import offload_staging_bytes

    cfg = ModelConfig(family="llama", vocab_size=96, hidden_size=32, num_heads=4, num_layers=2, seq_len=8)
    with torch.device("meta"):
        largest = max(p.numel() for p in OperatorModel(cfg).parameters())  # TMP 1: whole parameters
    assert offload_staging_bytes(cfg, 1, ModelStates("fp32", 1, offload=True)) == largest * 4
    assert offload_staging_bytes(cfg, 1, ModelStates("bf16", 2, offload=True, data_parallel_size=2)) == largest * 2
    assert offload_staging_bytes(cfg, 1, ModelStates("fp32", 1)) == 0.0


def test_sub_batches_are_chosen_per_plan_by_the_replayed_step():
    """``choose_sub_batches`` plans at every candidate, each at its own table, and keeps the fastest
    predicted step; a candidate the micro-batch cannot split is reported, not chosen.  (Analytic tables
    here: the library allows them; oases-plan refuses them with several candidates, since they price no
    density loss -- see test_planner_analytic.py::test_cli_bad_analytic_input_is_one_line.)"""
    from oases_ds.planner.planning import at_sub_batches, choose_sub_batches

    choice = choose_sub_batches(analytic(16), (4, 2, 3))
    tried = dict(choice.tried)
    assert set(tried) == {2, 3, 4} and isinstance(tried[2], float) and isinstance(tried[4], float)
    assert "3 sub-batches" in tried[3]  # the degree-1 share of 4 samples has no 3 whole sub-batches
    for k in (2, 4):  # each candidate's step is that k's own plan
        assert tried[k] == make_plan(at_sub_batches(analytic(16), k)).plan.predicted_step_ms
    chosen = choice.result.plan
    assert chosen.sub_batches == min((2, 4), key=tried.get) and chosen.predicted_step_ms == min(tried[2], tried[4])
    assert choice.result.loaded.table.sub_batches == chosen.sub_batches
    assert choice.line().startswith("sub-batches: 2 -> ") and choice.line().endswith(f"chose {chosen.sub_batches}")
    with pytest.raises(ValueError, match=r"planner.sub_batches=\[3\]: the micro-batch splits into none of them: 3: "
                                         r"micro_batch=16: .* use a multiple of"):
        choose_sub_batches(analytic(16), (3,))
    with pytest.raises(PlanInfeasibleError, match="no candidate of planner.sub_batches gives a plan that fits: 2: "
                                                  "nothing fits: "):
        choose_sub_batches(analytic(16, memory_limit_bytes=1e6), (2, 3))
    with pytest.raises(ValueError, match="planner.sub_batches: a cost-table file holds one sub-batch count"):
        choose_sub_batches(PlanRequest(None, table_path=str(PROFILES / "gpt_t2_cm8.json")), (2, 4))


def test_a_plan_keeps_its_sub_batches_and_the_run_takes_them(tmp_path):
    from oases_ds.config import OasesConfig
    from oases_ds.engine import overridden_sub_batches, planned_schedule
    from oases_ds.planner.plan import Plan

    path = tmp_path / "plan.json"
    Plan((2, 2), (2, 2), 2, sub_batches=4).to_json(path)
    assert Plan.from_json(path).sub_batches == 4
    oases = OasesConfig(tensor_parallel_size=2, plan=str(path))
    spec = planned_schedule(oases)
    assert spec.sub_batches == 4 and overridden_sub_batches(oases, spec) == (
        f"plan={path} was chosen at sub_batches=4 (oases-plan planner.sub_batches); running it so, not at the "
        f"configured sub_batches=2")
    Plan((2, 2), (2, 2), 2).to_json(path)  # a plan without its own: the configured ones, nothing said
    assert planned_schedule(oases).sub_batches == 2 and overridden_sub_batches(oases, planned_schedule(oases)) is None
    with pytest.raises(ValueError, match="Plan.sub_batches must be an int >= 1, got 0"):
        Plan((2,), (2,), 2, sub_batches=0)
