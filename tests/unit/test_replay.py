"""Pricing a plan by replaying its schedule (oases_ds/planner/replay.py), against hand-computed steps.

The hand table: T=2, gpt, one layer; every compute op costs F=1, B=2 ms at degree 2 and twice that at
degree 1 (the embedding and head always run at degree 2); a block collective moves 1e6 bytes, a
reshard gathers 4e6 * big / T bytes; the link is 8 Gbit/s with no latency, so a 2-rank AllReduce
of 1e6 bytes (ring: 2 * 1/2 of the bytes) and a 2-rank AllGather of 4e6 bytes (1/2 of them) take
1 and 2 ms; each collective's overhead is 0.5 ms.  Under the blocking ``none`` schedule nothing
overlaps, so a step is the sum of its parts.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from oases_ds.bench.cost_model import plan_of_row
from oases_ds.models.operator_model import one_layer_ops
from oases_ds.models.ops import CommOp
from oases_ds.parallel.link import LinkModel
from oases_ds.planner.accuracy import spearman
from oases_ds.planner.costs import BlockCost, CostTable, DegreeProfile, OpTimes, PassTimes
from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.planner.replay import (block_scales, can_replay, rank_by_replay, replay_plan, replayed_or_additive,
                                     simulate_profiled_layer)
from oases_ds.schedule.generators import ScheduleSpec

ROOT = Path(__file__).resolve().parents[2]
NONE = ScheduleSpec("none")


def hand_table(bandwidth_gbps: float = 8.0) -> CostTable:
    ops = one_layer_ops("gpt")
    profiles = {}
    for degree, scale in ((1, 2.0), (2, 1.0)):
        compute = [i for i, op in enumerate(ops) if not isinstance(op, CommOp)]
        profiles[degree] = DegreeProfile(OpTimes(forward_ms={i: 1.0 * scale for i in compute},
                                                 backward_ms={i: 2.0 * scale for i in compute}), 1_000_000)

    def cost(grad_sync: float, state: float) -> BlockCost:
        return BlockCost(fwd_ms=1.0, bwd_ms=1.0, comm_fwd_ms=0.0, comm_bwd_ms=0.0, state_bytes=state, act_bytes=0.0,
                         grad_sync_ms=grad_sync)

    return CostTable(model="gpt-hand", cluster="hand", schedule=NONE, family="gpt", op_profile=profiles,
                     devices=2, degrees=(1, 2),
                     blocks={"attn": {1: cost(0.25, 200.0), 2: cost(0.0, 100.0)},
                             "mlp": {1: cost(0.75, 200.0), 2: cost(0.0, 100.0)}},
                     layers=1, reshard_bytes=4e6, bandwidth_gbps=bandwidth_gbps, latency_us=0.0, sub_batches=1,
                     collective_overhead_ms={2: 0.5})


def test_a_blocking_step_is_the_sum_of_its_parts():
    """gpt has 12 compute ops (4 in embedding and head) and 6 TMP collectives per layer model.
    Uniform 2: 12 x 3 ms + 6 AllReduces x 1 ms + 6 x 0.5 overhead = 45 ms.
    Uniform 1: 4 x 3 + 8 x 6 = 60 ms compute; embedding and head AllReduce 2 x 1 ms; the reshards
    into the layer (backward) and out of it (forward) 2 x 2 ms; 4 x 0.5 overhead; grad sync 0.25 + 0.75: 69 ms.
    attn 2 / mlp 1: 4 x 3 + 5 x 3 + 3 x 6 = 45 compute; 4 AllReduces (embed, attn copy and reduce, head)
    and 2 reshards = 8 ms; 6 x 0.5; grad sync 0.75: 56.75 ms."""
    table = hand_table()
    uniform2 = replay_plan(table, Plan.uniform(2, 1, 2))
    uniform1 = replay_plan(table, Plan.uniform(2, 1, 1))
    mixed = replay_plan(table, Plan.from_block_degrees([2, 1], 2))
    assert (uniform2.step_ms, uniform2.collectives, uniform2.overhead_ms) == pytest.approx((45.0, 6, 3.0))
    assert (uniform1.step_ms, uniform1.collectives, uniform1.grad_sync_ms) == pytest.approx((69.0, 4, 1.0))
    assert (mixed.step_ms, mixed.collectives) == pytest.approx((56.75, 6))
    assert uniform2.exposed_comm_ms == pytest.approx(6.0)  # blocking: every collective waited for in full
    assert replay_plan(table, Plan.uniform(2, 1, 2), overhead=False).step_ms == pytest.approx(42.0)


def test_per_op_times_are_scaled_to_the_slowest_ranks_block_time():
    """Evidence that the slowest rank spent 2 x rank 0's forward on the attention block at degree 2
    (gpt attn: 5 compute ops x 1 ms forward, one sub-batch: 5 ms on rank 0, 10 ms slowest) and the
    same backward (5 x 2 = 10 ms): uniform 2 under ``none`` costs 5 ms more than the 45 ms above,
    and degree 1, with no such evidence, nothing more; the MLP's scale 1 leaves it as it was."""
    table = hand_table()
    profile = dataclasses.replace(table.op_profile[2], block_ms={"attn": PassTimes(10.0, 0.0, 10.0),
                                                                 "mlp": PassTimes(3.0, 0.0, 6.0)})
    scaled = dataclasses.replace(table, op_profile={**table.op_profile, 2: profile})
    assert block_scales(scaled)[(2, "attn", "F")] == pytest.approx(2.0)
    assert block_scales(scaled)[(2, "attn", "B")] == pytest.approx(1.0)
    assert block_scales(scaled)[(2, "mlp", "F")] == pytest.approx(1.0)
    assert replay_plan(scaled, Plan.uniform(2, 1, 2)).step_ms == pytest.approx(50.0)
    assert replay_plan(scaled, Plan.uniform(2, 1, 1)).step_ms == pytest.approx(69.0)


def test_a_uniform_one_layer_replay_is_the_profiled_layer_simulation():
    """The same step built two ways: the plan's op sequence (operator_model.plan_ops) and the profiler's own
    one-layer model (replay.simulate_profiled_layer), under the overlapped ``oases`` schedule; and
    there two sub-batches hide part of the 12 collectives (10 ms each on a 0.8 Gbit/s link) that the
    blocking schedule would wait for in full."""
    table = dataclasses.replace(hand_table(bandwidth_gbps=0.8), schedule=ScheduleSpec("oases"), sub_batches=2)
    replayed = replay_plan(table, Plan.uniform(2, 1, 2), overhead=False)
    layer = simulate_profiled_layer(table, 2, LinkModel(table.bandwidth_gbps, table.latency_us))
    assert replayed.simulated_ms == pytest.approx(layer.step_ms)
    assert replayed.exposed_comm_ms == pytest.approx(layer.exposed_comm_ms) and 0 < replayed.exposed_comm_ms < 120.0
    assert replayed.collectives == 12
    # With the overhead as host time (cost model 9), the step it was measured on grows by what was measured,
    # 12 collectives x 0.5 ms, though part of each collective's host time hides behind the link.
    issued = replay_plan(table, Plan.uniform(2, 1, 2))
    assert issued.step_ms - replayed.step_ms == pytest.approx(12 * 0.5, abs=1e-5)
    assert issued.overhead_ms > 12 * 0.5 + 1.0


def test_rank_by_replay_keeps_the_fastest_plan_that_fits():
    table = hand_table()
    solved = Plan.from_block_degrees([2, 1], 2, predicted_step_ms=1.0, solver_name="dp")
    chosen, priced = rank_by_replay(table, solved, None)
    assert chosen.block_degrees() == [2, 2] and chosen.solver_name == "dp+replay"
    assert chosen.predicted_step_ms == pytest.approx(45.0)
    assert [ms for _, ms in priced] == pytest.approx([45.0, 56.75, 69.0])
    # A link 1000x slower and reshards of 1/1000 the bytes: an AllReduce takes 1000 ms, an AllGather 2 ms, so
    # uniform 1 (2 AllReduces) is fastest, then the solver's plan (4), then uniform 2 (6); a limit under uniform
    # 1's 400 bytes of states leaves the solver's plan (300 bytes) the best that fits.
    slow = dataclasses.replace(hand_table(bandwidth_gbps=0.008), reshard_bytes=4e3)
    assert rank_by_replay(slow, solved, None)[0].block_degrees() == [1, 1]
    kept, considered = rank_by_replay(slow, solved, 350.0)
    assert kept.block_degrees() == [2, 1] and kept.solver_name == "dp" and len(considered) == 2


def test_a_table_without_per_op_times_is_priced_additively():
    table = dataclasses.replace(hand_table(), op_profile={2: hand_table().op_profile[2]})
    familyless = dataclasses.replace(hand_table(), family=None)
    assert not can_replay(table) and not can_replay(familyless) and can_replay(hand_table())
    with pytest.raises(ValueError, match="no per-op profile.*cost=profile"):
        replay_plan(table, Plan.uniform(2, 1, 2))
    plan = Plan.uniform(2, 1, 2)
    assert replayed_or_additive(table, [plan]) == [predict_step_ms(table, plan)] != replayed_or_additive(hand_table(), [plan])
    only_2 = dataclasses.replace(hand_table(), degrees=(2,), blocks={k: {2: v[2]} for k, v in hand_table().blocks.items()},
                                 op_profile={2: hand_table().op_profile[2]})
    with pytest.raises(ValueError, match=r"degrees \[1\] not profiled"):
        replay_plan(only_2, Plan.uniform(2, 1, 1))


def test_replay_ranks_the_committed_cm6_mixes():
    """Run C of the cost-model study (cost model 6; 14 plans, 12 mixes) and the profile it was priced with
    (a table file of the older format): the additive objective scored 0.941 over its 14 plans, the replay
    of the same profile is recomputed here and must reach 0.9."""
    fixtures = ROOT / "tests" / "fixtures"
    result = json.loads((fixtures / "study_runs" / "run_c_mixed.json").read_text())
    table = dataclasses.replace(CostTable.from_json(fixtures / "profiles" / "gpt_t2_cm6.json"), layers=4)
    predicted = replayed_or_additive(table, [plan_of_row(r, 2) for r in result["rows"]])
    assert spearman(predicted, [r["measured_ms"] for r in result["rows"]])[0] >= 0.9


def test_the_replay_names_each_syncs_wait_as_the_timeline_does():
    """Uniform 2 under ``oases`` on the hand table: the waits per Sync sum to the exposed time, and every
    name is one of the schedule's Syncs as the executor's timeline writes it (``W<op>.<sub>``, ``Wb..``),
    so a measured step's waits can be set against them (benchmarks/replay_breakdown.py)."""
    from oases_ds.schedule.generators import build_schedule
    from oases_ds.schedule.instructions import Sync

    oases = ScheduleSpec.from_mapping({"name": "oases", "sub_batches": 1})
    table = dataclasses.replace(hand_table(bandwidth_gbps=0.8), schedule=oases, sub_batches=1)  # 10 ms AllReduces
    replay = replay_plan(table, Plan.uniform(2, 1, 2))
    syncs = {str(ins) for ins in build_schedule(oases, one_layer_ops("gpt")).instructions if isinstance(ins, Sync)}
    assert replay.waits_ms and set(replay.waits_ms) <= syncs
    assert all(name.startswith("W") for name in replay.waits_ms)
    assert sum(replay.waits_ms.values()) == pytest.approx(replay.exposed_comm_ms)
    assert replay.exposed_comm_ms > 0
