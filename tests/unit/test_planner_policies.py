"""The planner chooses each block's recomputation policy with its degree: exact against brute force
and the ILP on random tables that price ``store``, the ``store`` costs derived from a real profile,
and the front door planning policies for a memory limit (``planner.recompute=auto``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from oases_ds.models.config import ModelConfig
from oases_ds.planner.analytic import ACTIVATION_BYTES, DeviceModel
from oases_ds.planner.costs import CostTable
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.ilp import solve
from oases_ds.planner.objective import brute_force, fits_memory, predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.planner.planning import PlanRequest, load_table, make_plan, plan_lines
from oases_ds.planner.policies import with_store_costs
from oases_ds.planner.profile import PROFILE_DTYPE_BYTES, ProfileSpec
from oases_ds.parallel.link import LinkModel
from oases_ds.schedule.generators import ScheduleSpec
from support import REL_TOL, random_table, with_random_store

PROFILES = Path(__file__).resolve().parent.parent / "fixtures" / "profiles"


def _limits(table: CostTable) -> list[float | None]:
    """Unbounded, and limits from the leanest plan up to the all-store plan's memory."""
    lean = table.fixed_bytes + sum(min(c.memory_bytes for c in table.blocks[k].values()) for k in table.block_kinds())
    top = brute_force(table, None).memory_bytes
    return [None, lean, lean + 0.3 * (top - lean), (lean + top) / 2, lean + 0.8 * (top - lean)]


@pytest.mark.parametrize("seed", range(10))
def test_dp_and_ilp_equal_brute_force_over_degrees_and_policies(seed):
    table = with_random_store(random_table(seed, 1 + seed % 2), seed)
    chose_store = chose_both = 0
    for limit in _limits(table):
        oracle = brute_force(table, limit)
        for plan in (solve_dp(table, limit), solve(table, limit)):
            assert predict_step_ms(table, plan) == pytest.approx(oracle.predicted_step_ms, rel=REL_TOL)
            assert fits_memory(predict_memory_bytes(table, plan), limit)
        policies = set(oracle.block_policies())
        chose_store += "store" in policies
        chose_both += policies == {"store", "oases"}
    assert chose_store  # with no limit every block stores: it is faster by construction


def test_policies_mix_under_a_binding_limit_on_most_tables():
    """Guard: the comparison above must often run where the optimum mixes the two policies."""
    mixed = sum(set(brute_force(t, _limits(t)[3]).block_policies()) == {"store", "oases"}
                for t in (with_random_store(random_table(s, 2), s) for s in range(10)))
    assert mixed >= 5


def test_a_table_without_store_costs_plans_oases_only():
    table = random_table(3, 2)
    assert table.policies == ("oases",)
    assert solve_dp(table, None).attn_policies is None
    with pytest.raises(ValueError, match=r"prices no policy 'store' \(it prices oases\)"):
        table.block_cost("attn", 2, "store")


def test_store_costs_come_from_a_profile_without_profiling_again():
    """GPT, TMP 4 profile of this machine: a stored block's backward loses exactly its profiled
    recompute, it holds more activations, and its exposed comm is never less (nothing to hide behind)."""
    table = CostTable.from_json(PROFILES / "gpt_t4_cm9.json")
    assert table.model == "gpt-v256-h128-a4-f512-s128-mb16"  # the profiled model, below
    cfg = ModelConfig(family="gpt", hidden_size=128, num_heads=4, ffn_size=512, num_layers=table.layers,
                      seq_len=128, vocab_size=256)
    stored = with_store_costs(table, cfg, 16, PROFILE_DTYPE_BYTES)
    assert stored.policies == ("oases", "store")
    for kind in ("attn", "mlp"):
        for t in table.degrees:
            oases, store = table.blocks[kind][t], stored.store_blocks[kind][t]
            recompute = table.op_profile[t].block_ms[kind].recompute_ms
            assert store.bwd_ms == pytest.approx(oases.bwd_ms - recompute)
            assert store.act_bytes > oases.act_bytes
            assert store.comm_bwd_ms + store.comm_bwd_last_ms >= oases.comm_bwd_ms + oases.comm_bwd_last_ms - 1e-12
            assert (store.fwd_ms, store.state_bytes, store.grad_sync_ms) == (oases.fwd_ms, oases.state_bytes,
                                                                             oases.grad_sync_ms)
    assert stored.fixed_bytes >= table.fixed_bytes


def test_store_costs_need_a_schedule_that_stores():
    table = dataclasses.replace(CostTable.from_json(PROFILES / "gpt_t4_cm9.json"), schedule=ScheduleSpec("megatron"))
    cfg = ModelConfig(family="gpt", hidden_size=64, num_heads=4, num_layers=2, seq_len=32, vocab_size=256)
    with pytest.raises(ValueError, match=r"^planner.recompute=auto chooses between policies store and oases, which only "
                                         r"schedule=oases with fine_grained_recompute=true runs; this table is megatron"):
        with_store_costs(table, cfg, 8, PROFILE_DTYPE_BYTES)


def _analytic_request(limit: float | None, recompute: str = "auto", gbps: float = 25.0,
                      min_degree: int = 1) -> PlanRequest:
    """A GPT-39.1B-wide model (4 layers) on 8 devices over a ``gbps`` link, priced analytically."""
    model = ModelConfig(family="gpt", hidden_size=8192, num_heads=64, num_layers=4, seq_len=1024, vocab_size=51200)
    spec = ProfileSpec(model=model, devices=8, micro_batch=16, link=LinkModel(gbps, 10.0), cluster=f"eth-{gbps:g}g",
                       min_degree=min_degree)
    device = DeviceModel(name="v100", peak_tflops=125.0, achieved_fraction=0.5)
    return PlanRequest(profile=spec, cost="analytic", device=device, cache_dir=None, memory_limit_bytes=limit,
                       recompute=recompute)


def test_a_compute_bound_model_with_room_stores_every_block():
    """On a fast link the recompute is pure cost: unbounded, every block is stored."""
    free = make_plan(_analytic_request(None, gbps=1000.0)).plan
    assert free.block_policies() == ["store"] * 8


def test_auto_recompute_stores_what_the_limit_leaves_room_for():
    """At the all-oases plan's own memory: nothing stored (the same plan as planner.recompute=oases);
    between it and the all-store plan's: a mix, at least as fast.  On this comm-bound 25 Gbit/s link
    storing an attention block gains nothing (its recompute was hiding communication), which the
    replay shows as a tie.  Every block at degree 8 (``planner.min_degree``), so that the limit is
    spent on policies: with lower degrees allowed, this model spends it on degree 4 instead."""
    table = load_table(_analytic_request(None, min_degree=8)).table
    blocks = 2 * table.layers
    top = predict_memory_bytes(table, Plan.from_block_degrees([8] * blocks, 8, ["store"] * blocks))
    bottom = predict_memory_bytes(table, Plan.uniform(8, table.layers, 8))
    lowest = make_plan(_analytic_request(bottom, min_degree=8)).plan
    assert lowest.stored_blocks() == () and lowest.block_degrees() == [8] * blocks
    middle = make_plan(_analytic_request((top + bottom) / 2, min_degree=8))
    assert 0 < len(middle.plan.stored_blocks()) < blocks
    assert middle.plan.predicted_step_ms <= lowest.predicted_step_ms
    assert middle.memory is not None and middle.memory.peak_bytes > make_plan(_analytic_request(bottom, min_degree=8)).memory.peak_bytes
    lines = plan_lines(middle, _analytic_request((top + bottom) / 2, min_degree=8))
    assert any(line.strip().startswith("layers") and " store" in line for line in lines)
    assert any("MiB of it unused" in line for line in lines)


def test_auto_recompute_from_a_table_file_without_a_model_is_one_line(tmp_path):
    path = tmp_path / "t.json"
    CostTable.from_json(PROFILES / "gpt_t4_cm9.json").to_json(path)
    with pytest.raises(ValueError, match=r"^planner.recompute=auto: the table .*t.json prices no policy store and table= "
                                         r"describes no model to derive it for"):
        load_table(PlanRequest(profile=None, table_path=str(path), recompute="auto"))
    with pytest.raises(ValueError, match=r"^planner.recompute='always' unknown; choose one of oases, auto$"):
        PlanRequest(profile=None, table_path=str(path), recompute="always")


def test_a_table_with_store_costs_round_trips(tmp_path):
    table = with_random_store(random_table(1, 2), 1)
    table.to_json(tmp_path / "t.json")
    assert CostTable.from_json(tmp_path / "t.json") == table


def test_pipeline_stages_plan_policies_and_the_plan_file_keeps_them():
    from oases_ds.planner.stages import PipelineSpec, plan_stages, stage_memory_bytes, stage_step_ms

    table = with_random_store(random_table(4, 4), 4)
    pipeline = PipelineSpec(2, 4, 0.1)
    staged = plan_stages(table, pipeline, None)
    plan = staged.to_plan(table)
    assert plan.block_policies() == staged.block_policies() and "store" in plan.block_policies()
    for stage in staged.stages:  # each stage's numbers are priced with its policies
        degrees, policies = stage.plan.block_degrees(), stage.plan.block_policies()
        assert stage.step_ms == pytest.approx(stage_step_ms(table, pipeline, stage.index, degrees, policies))
        assert stage.memory_bytes == pytest.approx(stage_memory_bytes(table, pipeline, stage.index, degrees, policies))
