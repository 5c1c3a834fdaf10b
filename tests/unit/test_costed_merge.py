"""The sub-batch merge ordered by per-op times (``oases_ds.schedule.costed_merge``): what the planner
prices a sequence-parallel plan with is what its run executes, never slower by that model than the
time-blind merge, and carried in the plan file.

The case is the one issue 40 names: LLaMA-7B at seq 4096 on one 8 x RTX 3090 server (TMP 8 over
PCIe, micro-batch 2, every block stored), priced analytically (FLOPs / the card's throughput, the
link model), as ``benchmarks/sequence_parallel_plans.py`` plans it.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from oases_ds.config import OasesConfig
from oases_ds.engine import planned_schedule
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import plan_ops
from oases_ds.parallel.link import LinkModel
from oases_ds.planner.analytic import DeviceModel
from oases_ds.planner.costmodel import simulate_step
from oases_ds.planner.plan import Plan
from oases_ds.planner.planning import PlanRequest, load_table, make_plan
from oases_ds.planner.profile import ProfileSpec
from oases_ds.planner.replay import _op_costs, hop_costs_of, replay_plan
from oases_ds.schedule.checker import check
from oases_ds.schedule.costed_merge import HopCosts
from oases_ds.schedule.generators import ScheduleSpec, build_schedule

LLAMA_7B = ModelConfig(family="llama", vocab_size=32000, hidden_size=4096, num_heads=32, num_layers=32, ffn_size=11008,
                       seq_len=4096, dropout=0.0)
RTX3090 = DeviceModel("rtx3090", 71.0, 0.4)
PCIE = LinkModel(96.0, 10.0)


def request(sequence_parallel: bool, limit_gib: float = 22.0) -> PlanRequest:
    spec = ProfileSpec(model=LLAMA_7B, devices=8, micro_batch=2, link=PCIE, cluster="pcie_3090", min_degree=8,
                       sequence_parallel=sequence_parallel)
    return PlanRequest(spec, cost="analytic", device=RTX3090, memory_limit_bytes=limit_gib * 2**30, recompute="auto")


@pytest.fixture(scope="module")
def sp_table():
    return load_table(request(True)).table


def store_all(layers: int) -> Plan:
    return Plan.from_block_degrees([8] * (2 * layers), 8, ["store"] * (2 * layers))


def test_the_replay_orders_hops_by_time_and_prices_the_7b_step_lower(sp_table):
    """Every block stored: the time-blind order replays at 1874.6 ms (the 1.144x of the report
    before), the timed one at 1744.8 ms (1794.8 ms with the MLP's up projection as one op: its
    chunks are the points the timed order needs), the same instructions otherwise (the checker
    proves it)."""
    plan = dataclasses.replace(store_all(32), hop_costs=hop_costs_of(sp_table))
    timed = replay_plan(sp_table, plan).step_ms
    assert replay_plan(sp_table, store_all(32)).step_ms == pytest.approx(1874.6, abs=0.1)  # no times: as it would run
    ops, degrees = plan_ops("llama", plan.attn_degrees, plan.mlp_degrees, 8, True)
    spec = dataclasses.replace(sp_table.schedule, stored_blocks=plan.stored_blocks())
    blind = build_schedule(spec, ops)
    costs = _op_costs(sp_table, ops, degrees, "store all")
    blind_ms = simulate_step(blind, ops, costs, PCIE).step_ms
    assert blind_ms == pytest.approx(1874.6, abs=0.1) and timed == pytest.approx(1744.8, abs=0.1)
    hop = hop_costs_of(sp_table)
    program = build_schedule(dataclasses.replace(spec, hop_costs=hop), ops)
    check(program, ops)
    assert sorted(map(repr, program.instructions)) == sorted(map(repr, blind.instructions))
    assert simulate_step(program, ops, costs, PCIE).step_ms == pytest.approx(timed, rel=1e-12)


def test_the_planned_sequence_parallel_7b_plan_carries_its_times_and_its_run_builds_the_replayed_order(sp_table, tmp_path):
    result = make_plan(request(True))
    plan = result.plan
    assert plan.hop_costs == hop_costs_of(sp_table) and plan.hop_costs is not None
    assert plan.block_policies() == ["store"] * 64 and plan.predicted_step_ms == pytest.approx(1744.8, abs=0.1)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert Plan.from_json(path) == plan
    spec = planned_schedule(OasesConfig(tensor_parallel_size=8, plan=str(path), sequence_parallel=True))
    ops, _ = plan_ops("llama", plan.attn_degrees, plan.mlp_degrees, 8, True)
    replayed = build_schedule(dataclasses.replace(sp_table.schedule, stored_blocks=plan.stored_blocks(),
                                                  hop_costs=hop_costs_of(sp_table)), ops)
    assert spec.hop_costs == plan.hop_costs
    assert build_schedule(spec, ops).instructions == replayed.instructions
    assert make_plan(request(False)).plan.hop_costs is None  # nothing hops without sequence parallelism


def test_the_order_is_never_slower_by_its_own_model_than_the_time_blind_one(sp_table):
    """Per-op times that favour the time-blind hops (every collective free, so every hop is one the
    time-blind merge makes too): the merge keeps the time-blind order."""
    hop = hop_costs_of(sp_table)
    free = HopCosts(hop.compute_ms, tuple((name, 0.0) for name, _ in hop.link_ms))
    ops, _ = plan_ops("llama", [8] * 4, [8] * 4, 8, True)
    spec = ScheduleSpec("oases")
    assert build_schedule(dataclasses.replace(spec, hop_costs=free), ops).instructions == \
        build_schedule(spec, ops).instructions


def test_times_missing_an_op_leave_the_time_blind_order():
    ops, _ = plan_ops("llama", [2] * 2, [2] * 2, 2, True)
    partial = HopCosts((("qkv", 1.0, 1.0, 2.0),), (("attn_copy", 2.0),))
    spec = ScheduleSpec("oases")
    assert build_schedule(dataclasses.replace(spec, hop_costs=partial), ops).instructions == \
        build_schedule(spec, ops).instructions


@pytest.mark.parametrize("hop_costs, message", [
    ({"compute_ms": [["qkv", 1.0, 1.0]], "link_ms": []}, r"Plan.hop_costs.compute_ms must be a list of \[name, ms, ms, ms\] rows"),
    ({"compute_ms": [["qkv", 1.0, 1.0, -2.0]], "link_ms": []}, r"Plan.hop_costs.compute_ms\[0\]\[3\] must be a finite number >= 0"),
    ({"compute_ms": [], "link_ms": [["", 1.0]]}, r"Plan.hop_costs.link_ms\[0\]\[0\] must be an op name"),
    ({"compute_ms": [], "link_ms": [["attn_copy", "slow"]]}, r"Plan.hop_costs.link_ms\[0\]\[1\] must be a finite number"),
    ({"compute_ms": [], "link_ms": [], "speed": 1}, "Plan.hop_costs must be an object with compute_ms, link_ms and issue_ms"),
    ([1, 2], "Plan.hop_costs must be an object"),
])
def test_a_plan_files_bad_times_are_one_line_naming_the_field(tmp_path, hop_costs, message):
    path = tmp_path / "plan.json"
    Plan((2,), (2,), 2).to_json(path)
    payload = json.loads(path.read_text())
    path.write_text(json.dumps(dict(payload, hop_costs=hop_costs)))
    with pytest.raises(ValueError, match=f"^{path}: {message}"):
        Plan.from_json(path)


@pytest.mark.parametrize("sub_batches", [2, 3, 4])
@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_every_timed_order_passes_the_checker(sp_table, family, sub_batches):
    """The checker proves what the executor runs (each collective synced once, before its result is
    read; recompute collectives only where a re-gather is allowed); with three and four sub-batches a
    move can hold two hop choices."""
    ops, _ = plan_ops(family, [8] * 3, [8] * 3, 8, True)
    hop = hop_costs_of(sp_table)
    assert hop.per_op(ops) is not None  # every op timed: the timed merge runs, not its fallback
    for spec in (ScheduleSpec("oases", sub_batches=sub_batches), ScheduleSpec("oases", sub_batches=sub_batches,
                 stored_blocks=(0, 3), gathered_blocks=(1, 4)), ScheduleSpec("oases", sub_batches=sub_batches,
                 cross_pass=False), ScheduleSpec("split_overlap", sub_batches=sub_batches)):
        timed = build_schedule(dataclasses.replace(spec, hop_costs=hop), ops)
        check(timed, ops)
