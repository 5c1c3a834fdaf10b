"""Cost model of the overlapped schedule and the step simulator, against hand-drawn timelines."""
from __future__ import annotations

import dataclasses

import pytest

from oases_ds.parallel.link import LinkModel, link_from_config
from oases_ds.planner.costmodel import (
    BlockTiming,
    OpCosts,
    collective_overhead_ms,
    exposed_comm_ms,
    issue_ms_hiding,
    pipelined_comm_ms,
    simulate_step,
)
from oases_ds.planner.costs import BlockCost, CostTable, OpTimes, edge_ms, first_block_ms, last_block_ms, reshard_ms
from oases_ds.planner.objective import brute_force, predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.schedule.generators import ScheduleSpec, build_schedule
from support import block_ops

# 8 Gbit/s, no latency: a 2-rank AllReduce of S bytes puts S bytes on the link, S / 1e6 ms.
LINK = LinkModel(bandwidth_gbps=8.0, latency_us=0.0)
COMPUTE_OPS = (0, 1, 3, 5)  # embed, F_i, F_j, loss of block_ops(); 2 and 4 are collectives


def costs(fwd: float, bwd: float, comm_ms: float) -> OpCosts:
    return OpCosts(
        forward_ms={op: fwd for op in COMPUTE_OPS},
        backward_ms={op: bwd for op in COMPUTE_OPS},
        comm_bytes={2: int(comm_ms * 1e6), 4: int(comm_ms * 1e6)},
    )


def test_megatron_timeline_by_hand():
    """Whole batch: forward 2, backward 4, each collective 2 ms, all blocking.

    F0 0-2 | f1 2-4 | C2 4-6 (wait) | f3 6-8 | F5 8-10 | B5 10-14 | Cb4 14-16 (wait) |
    R1 16-18 | Cr2 18-20 (wait, the recompute repeats the AllReduce) | R3 20-22 | B3 22-26 | B1 26-30 | B0 30-34
    """
    ops = block_ops()
    result = simulate_step(build_schedule(ScheduleSpec("megatron"), ops), ops, costs(2, 4, 2), LINK)
    assert result.step_ms == pytest.approx(34)
    assert result.compute_ms == pytest.approx(28)
    assert result.exposed_comm_ms == pytest.approx(6)
    assert [(e.start_ms, e.end_ms) for e in result.lane("wait")] == [(4, 6), (14, 16), (18, 20)]


def test_oases_hides_what_megatron_exposes_when_comm_equals_compute():
    """Same work in two halves (forward 1, backward 2, collective 1 ms per sub-batch):
    every collective finishes while the other sub-batch computes, so nothing waits and
    the step is pure compute, 28 ms, against Megatron's 34."""
    ops = block_ops()
    result = simulate_step(build_schedule(ScheduleSpec("oases"), ops), ops, costs(1, 2, 1), LINK)
    assert result.compute_ms == pytest.approx(28)
    assert result.exposed_comm_ms == pytest.approx(0)
    assert result.step_ms == pytest.approx(28)
    # C2.0 on the link 2-3 while f0.1, f1.1 run 2-4; Cb4.0 8-9 under F3.1.
    links = {e.name: (e.start_ms, e.end_ms) for e in result.lane("comm")}
    assert links["C2.0:forward"] == (2, 3) and links["C4.0:backward"] == (8, 9)


def test_a_slower_link_exposes_comm_under_oases_too():
    """A 10x slower link (what-if): each collective takes 10 ms per sub-batch; the link is
    shared, so messages queue behind each other::

        compute f0.0 f1.0 f0.1 f1.1 |wait 4-12| F3.0 F5.0 B5.0 |wait 16-22| F3.1 F5.1 B5.1 |wait 26-32|
                B3.0 R0.0 R1.0 B1.0 B0.0 |wait 40-42| B3.1 R0.1 R1.1 B1.1 B0.1            ends at 50
        link    C2.0 2-12, C2.1 12-22, Cb4.0 22-32, Cb4.1 32-42
    """
    ops = block_ops()
    slow = LinkModel(bandwidth_gbps=0.8)
    result = simulate_step(build_schedule(ScheduleSpec("oases"), ops), ops, costs(1, 2, 1), slow)
    assert result.step_ms == pytest.approx(50)
    assert result.exposed_comm_ms == pytest.approx(8 + 6 + 6 + 2)
    assert [(e.start_ms, e.end_ms) for e in result.lane("wait")] == [(4, 12), (16, 22), (26, 32), (40, 42)]
    assert [(e.start_ms, e.end_ms) for e in result.lane("comm")] == [(2, 12), (12, 22), (22, 32), (32, 42)]
    comm = result.lane("comm")
    assert all(b.start_ms >= a.end_ms - 1e-9 for a, b in zip(comm, comm[1:]))  # one message at a time
    megatron = simulate_step(build_schedule(ScheduleSpec("megatron"), ops), ops, costs(2, 4, 2), slow)
    assert result.step_ms < megatron.step_ms


def test_issue_time_on_the_compute_lane_hides_where_the_link_is_the_bottleneck():
    """The slow-link timeline above with 1 ms of host time issuing each of the 4 collectives::

        compute f0.0 f1.0 I 2-3 f0.1 f1.1 I 5-6 |wait 6-13| F3.0 F5.0 B5.0 I 17-18 |wait 18-23| ...
        link    C2.0 3-13, C2.1 13-23, Cb4.0 23-33, Cb4.1 33-43

    Only the first issue delays the link, which every later step waits on: 4 ms of issue time cost
    1 ms (50 -> 51).  Under Megatron's blocking collectives each issue is paid in full (34 + 3)."""
    ops = block_ops()
    slow = LinkModel(bandwidth_gbps=0.8)
    oases = build_schedule(ScheduleSpec("oases"), ops)
    result = simulate_step(oases, ops, costs(1, 2, 1), slow, issue_ms={2: 1.0})
    assert result.step_ms == pytest.approx(51) and result.issue_ms == pytest.approx(4)
    assert [(e.start_ms, e.end_ms) for e in result.lane("comm")] == [(3, 13), (13, 23), (23, 33), (33, 43)]
    assert [(e.start_ms, e.end_ms) for e in result.lane("issue")][:2] == [(2, 3), (5, 6)]
    assert simulate_step(oases, ops, costs(1, 2, 1), slow, issue_ms={4: 1.0}).step_ms == pytest.approx(50)  # other groups
    megatron = build_schedule(ScheduleSpec("megatron"), ops)
    assert simulate_step(megatron, ops, costs(2, 4, 2), LINK, issue_ms={2: 1.0}).step_ms == pytest.approx(37)
    # The inverse: a flat 0.5 ms per collective (1.5 ms over the blocking step's 3) is 0.5 ms of issue time
    # there; a flat 0.25 ms (1 ms over the link-bound step's 4) is 1 ms per collective, 4x the flat charge.
    assert issue_ms_hiding(megatron, ops, costs(2, 4, 2), LINK, 2, 0.5) == pytest.approx(0.5, abs=1e-6)
    assert issue_ms_hiding(oases, ops, costs(1, 2, 1), slow, 2, 0.25) == pytest.approx(1.0, abs=1e-6)
    assert issue_ms_hiding(oases, ops, costs(1, 2, 1), slow, 2, 0.0) == 0.0
    with pytest.raises(ValueError, match="no collective among 4 ranks"):
        issue_ms_hiding(oases, ops, costs(1, 2, 1), slow, 4, 0.25)


def test_link_latency_is_paid_per_collective():
    ops = block_ops()
    base = simulate_step(build_schedule(ScheduleSpec("megatron"), ops), ops, costs(2, 4, 2), LINK)
    latent = simulate_step(build_schedule(ScheduleSpec("megatron"), ops), ops, costs(2, 4, 2), LinkModel(8.0, latency_us=500))
    assert latent.step_ms - base.step_ms == pytest.approx(3 * 0.5)  # three blocking collectives


@pytest.mark.parametrize("spec, compute", [
    (ScheduleSpec("oases", sub_batches=3), 3 * 14),  # per sub-batch: 4 forwards of 1, 2 recomputes of 1, 4 backwards of 2
    (ScheduleSpec("oases", cross_pass=False), 2 * 14),
])
def test_sub_batches_and_cross_pass_ablation_run_through_the_simulator(spec, compute):
    """Each 1 ms collective starts while the next sub-batch still has 2 ms of compute (or
    the next pass begins), so none waits: the step is the compute alone."""
    ops = block_ops()
    result = simulate_step(build_schedule(spec, ops), ops, costs(1, 2, 1), LINK)
    assert result.compute_ms == pytest.approx(compute)
    assert result.step_ms == pytest.approx(compute)
    assert result.lane("wait") == [] and result.comm_ms == pytest.approx(2 * spec.sub_batches)


TIMING = BlockTiming(fwd_ms=4.0, recompute_ms=4.0, bwd_ms=8.0, comm_fwd_ms=3.0, comm_bwd_ms=5.0)


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("megatron", (3.0, 8.0)),  # blocking; recompute repeats the forward AllReduce
        ("none", (3.0, 5.0)),
        ("megatron_selective", (3.0, 5.0)),
        ("oases", (1.0, 0.0)),  # 3 - 4/2 forward; 5 - (4+8)/2 < 0 backward
        ("split_overlap", (1.0, 2.0)),  # 3-2 fwd; (3-2) behind recompute + (5-4) behind backward
    ],
)
def test_exposed_comm_by_schedule(schedule, expected):
    assert exposed_comm_ms(TIMING, ScheduleSpec(schedule, sub_batches=2)) == pytest.approx(expected)


def test_one_sub_batch_hides_nothing_and_bad_timings_fail():
    assert exposed_comm_ms(TIMING, ScheduleSpec("oases", sub_batches=1)) == pytest.approx((3.0, 5.0))
    with pytest.raises(ValueError, match="BlockTiming.fwd_ms must be >= 0"):
        BlockTiming(-1.0, 0, 0, 0, 0)


def test_a_schedule_without_a_closed_form_is_named(monkeypatch):
    """A newly registered schedule is not priced as if it were oases."""
    from dataclasses import replace

    from oases_ds.schedule import generators

    monkeypatch.setattr(generators, "_REGISTRY", dict(generators._REGISTRY))  # leave the real registry as it was
    generators.register_schedule("gpipe", segments=lambda ops, spec: generators.layer_segments(ops), sub_batched=True)(
        lambda ops, segs, spec: replace(build_schedule(ScheduleSpec("oases"), ops), name=spec.name))
    with pytest.raises(ValueError, match=r"^schedule.name='gpipe' has no closed form in the cost model; add one"):
        exposed_comm_ms(TIMING, ScheduleSpec("gpipe"))


def test_a_schedule_is_priced_by_the_closed_form_it_registers(monkeypatch):
    """The cost model asks the registry, not a list of names: a schedule registered with its own form
    (here: everything exposed twice) is priced by it, and without a pipelined part leaves the edge nothing."""
    from dataclasses import replace

    from oases_ds.schedule import generators
    from oases_ds.schedule.closed_forms import ClosedForm

    monkeypatch.setattr(generators, "_REGISTRY", dict(generators._REGISTRY))
    twice = ClosedForm(lambda t, s: (2 * t.comm_fwd_ms, 2 * t.comm_bwd_ms))
    generators.register_schedule("twice", segments=lambda ops, spec: generators.layer_segments(ops), sub_batched=True,
                                 closed_form=twice)(lambda ops, segs, spec: replace(build_schedule(ScheduleSpec("oases"), ops),
                                                                                     name=spec.name))
    assert exposed_comm_ms(TIMING, ScheduleSpec("twice")) == pytest.approx((6.0, 10.0))
    assert pipelined_comm_ms(TIMING, ScheduleSpec("twice")) == pytest.approx((6.0, 10.0, 0.0, 0.0))


# fwd 4, recompute 3, backward 5; collectives 10 forward, 12 backward (both sub-batches).
SLOW_LINK_TIMING = BlockTiming(fwd_ms=4.0, recompute_ms=3.0, bwd_ms=5.0, comm_fwd_ms=10.0, comm_bwd_ms=12.0)


@pytest.mark.parametrize(
    "schedule, sub_batches, expected",
    [
        # node: 1/2 * (10 - 4) forward, 1/2 * (12 - 3 - 5) backward; last sub-batch's 10/2, 12/2 to the edge
        ("oases", 2, (3.0, 2.0, 5.0, 6.0)),
        # 3/4 * (10 - 4), 3/4 * (12 - 8); a quarter of each collective to the edge
        ("oases", 4, (4.5, 3.0, 2.5, 3.0)),
        # forward as oases; backward not pipelined across blocks: (10 - 3/2) + (12 - 5/2), nothing to the edge
        ("split_overlap", 2, (3.0, 18.0, 5.0, 0.0)),
        # blocking schedules and one sub-batch keep the whole-block form, nothing to the edge
        ("megatron", 2, (10.0, 22.0, 0.0, 0.0)),
        ("oases", 1, (10.0, 12.0, 0.0, 0.0)),
    ],
)
def test_pipelined_comm_by_schedule(schedule, sub_batches, expected):
    assert pipelined_comm_ms(SLOW_LINK_TIMING, ScheduleSpec(schedule, sub_batches)) == pytest.approx(expected)


def test_pipelined_comm_hides_fully_when_compute_covers_it():
    fast_link = BlockTiming(fwd_ms=4.0, recompute_ms=3.0, bwd_ms=5.0, comm_fwd_ms=2.0, comm_bwd_ms=6.0)
    # nothing left on the node; the last sub-batch's collective still goes to the edge
    assert pipelined_comm_ms(fast_link, ScheduleSpec("oases", 2)) == pytest.approx((0.0, 0.0, 1.0, 3.0))


# -- edge costs take the schedule's sub-batch count from the table --------------------
def two_layer_table(sub_batches: int) -> CostTable:
    """A hand-sized T=2 table: 8 Gbit/s is 1e6 bytes per ms, 100 us per collective.

    Node costs (fwd + bwd + comm + grad sync): attn 13 at t=1, 8 at t=2; mlp 20 at t=1, 12 at t=2.
    """
    def cost(fwd, bwd, comm_fwd, comm_bwd, grad_sync, fwd_last, bwd_last):
        return BlockCost(fwd_ms=fwd, bwd_ms=bwd, comm_fwd_ms=comm_fwd, comm_bwd_ms=comm_bwd, state_bytes=0.0,
                         act_bytes=0.0, grad_sync_ms=grad_sync, comm_fwd_last_ms=fwd_last, comm_bwd_last_ms=bwd_last)

    return CostTable(
        model="hand", cluster="hand", schedule=ScheduleSpec("oases"), devices=2, degrees=(1, 2),
        blocks={"attn": {1: cost(4, 8, 0, 0, 1, 0, 0), 2: cost(2, 4, 1, 1, 0, 5, 3)},
                "mlp": {1: cost(6, 12, 0, 0, 2, 0, 0), 2: cost(3, 6, 1, 2, 0, 4, 6)}},
        layers=2, reshard_bytes=4e6, bandwidth_gbps=8.0, latency_us=100.0, sub_batches=sub_batches,
    )


# One reshard between degrees 1 and 2, per sub-batch: slice 0.005 + AllGather of the degree-2 share
# (4e6 * 2/2 bytes, half of it received) = 0.005 + 0.1 + 2.0 = 2.105 ms.
RESHARD_PER_SUB_BATCH = 2.105


@pytest.mark.parametrize("sub_batches, same_degree_edge, step", [
    # attn(2) -> mlp(2): max(0, 5 - 3/s) + max(0, 6 - 4/s)
    # plan attn 2,1 / mlp 2,2: nodes 8+12+13+12 = 45; mixed edges (2.105 s + 4) + (2.105 s + 6); ends 3 + 4
    (1, 2.0 + 2.0, 45 + 4.0 + 2 * 2.105 + 10 + 7),
    (2, 3.5 + 4.0, 45 + 7.5 + 4 * 2.105 + 10 + 7),
    (4, 4.25 + 5.0, 45 + 9.25 + 8 * 2.105 + 10 + 7),
])
def test_edge_costs_use_the_tables_sub_batches(sub_batches, same_degree_edge, step):
    table = two_layer_table(sub_batches)
    assert reshard_ms(table, 1, 2) == reshard_ms(table, 2, 1) == pytest.approx(sub_batches * RESHARD_PER_SUB_BATCH)
    assert edge_ms(table, 0, 2, 2) == pytest.approx(same_degree_edge)
    assert edge_ms(table, 1, 2, 1) == pytest.approx(sub_batches * RESHARD_PER_SUB_BATCH + 4.0)  # mlp(2)'s last forward
    assert edge_ms(table, 2, 1, 2) == pytest.approx(sub_batches * RESHARD_PER_SUB_BATCH + 6.0)  # mlp(2)'s last backward
    assert first_block_ms(table, 1) == pytest.approx(sub_batches * RESHARD_PER_SUB_BATCH)  # embedding at T=2
    assert first_block_ms(table, 2) == pytest.approx(3.0) and last_block_ms(table, 2) == pytest.approx(4.0)
    plan = Plan.from_block_degrees([2, 2, 1, 2], 2)
    assert predict_step_ms(table, plan) == pytest.approx(step)


@pytest.mark.parametrize("sub_batches, best_ms", [
    # uniform 2 by hand: nodes 40; attn->mlp edges 2x(same_degree_edge); mlp->attn max(0, 4 - 2/s) + max(0, 3 - 6/s);
    # ends 3 + 4.  Uniform 1: 66 + 2 reshards (70.2 at s=1).  A mix runs some block at degree 1, so it reshards
    # down and back up (>= 2 x 2.105 s) and pays the degree-2 neighbours' last collectives in full at those
    # edges; e.g. attn 1,2 / mlp 2,2 at s=1: 45 + 2.105 + (2.105 + 6) + 2 + 4 + 4 = 65.2 > 57.
    (1, 40 + 2 * 4.0 + 2.0 + 0.0 + 7),
    (2, 40 + 2 * 7.5 + 3.0 + 0.0 + 7),
    (4, 40 + 2 * 9.25 + 3.5 + 1.5 + 7),
])
def test_brute_force_on_the_hand_table_picks_degree_two_everywhere(sub_batches, best_ms):
    best = brute_force(two_layer_table(sub_batches), None)
    assert best.block_degrees() == [2, 2, 2, 2]
    assert best.predicted_step_ms == pytest.approx(best_ms)


def test_a_table_without_a_whole_sub_batch_count_is_refused():
    with pytest.raises(ValueError, match=r"^CostTable.sub_batches must be an int >= 1 .*got 0$"):
        two_layer_table(0)


def test_sub_batches_survive_json_and_an_older_table_reads_as_two(tmp_path):
    import json

    path = tmp_path / "t.json"
    two_layer_table(4).to_json(path)
    assert CostTable.from_json(path).sub_batches == 4
    data = json.loads(path.read_text())
    del data["sub_batches"]  # written before the field existed: the paper's 2 was hard-coded then
    path.write_text(json.dumps(data))
    assert CostTable.from_json(path).sub_batches == 2


# -- cost model v4: what a collective costs beyond its link time -------------------
def test_collective_overhead_is_the_residual_above_degree_one_per_collective():
    # degree 1: 2 ms the simulator does not see (executor overhead, no collective);
    # degree 2: 26 ms over 12 collectives -> (26 - 2) / 12 = 2; degree 4 below degree 1 -> 0, not negative.
    overhead = collective_overhead_ms({1: 2.0, 2: 26.0, 4: 1.0}, {1: 0, 2: 12, 4: 24})
    assert overhead == pytest.approx({1: 0.0, 2: 2.0, 4: 0.0})
    assert collective_overhead_ms({1: 2.0, 2: 5.0}, {2: 0}) == {1: 0.0, 2: 0.0}  # no collective: nothing to divide
    with pytest.raises(ValueError, match="needs the degree-1 residual"):
        collective_overhead_ms({2: 5.0}, {2: 4})


def test_recompute_times_replace_forward_times_in_the_simulator():
    """The Megatron timeline of test_megatron_timeline_by_hand with R1 and R3 at 1 ms
    instead of their forward's 2: two ms less compute, the same three blocking waits."""
    ops = block_ops()
    base = costs(2, 4, 2)
    faster = OpCosts(base.forward_ms, base.backward_ms, base.comm_bytes, recompute_ms={1: 1.0, 3: 1.0})
    result = simulate_step(build_schedule(ScheduleSpec("megatron"), ops), ops, faster, LINK)
    assert result.step_ms == pytest.approx(32)
    assert result.compute_ms == pytest.approx(26)
    assert result.exposed_comm_ms == pytest.approx(6)


def test_overhead_is_in_the_node_cost_and_in_every_reshard_all_gather():
    """two_layer_table with a block overhead on the degree-2 blocks and 0.5 ms per collective
    among 2 ranks.  Per sub-batch a reshard is 2.105 + 0.5 ms."""
    base = two_layer_table(2)
    blocks = {kind: {d: dataclasses.replace(c, overhead_ms=(2.0 if d == 2 else 0.0)) for d, c in by.items()}
              for kind, by in base.blocks.items()}
    table = dataclasses.replace(base, blocks=blocks, collective_overhead_ms={2: 0.5})
    assert table.blocks["attn"][2].step_ms == pytest.approx(8 + 2)  # fwd 2 + bwd 4 + comm 1 + 1 + overhead 2
    assert reshard_ms(table, 1, 2) == pytest.approx(2 * (RESHARD_PER_SUB_BATCH + 0.5))
    # plan attn 2,1 / mlp 2,2 at s=2 (see test_edge_costs_use_the_tables_sub_batches): 45 + 7.5 + 4 x 2.105 + 10 + 7,
    # plus 3 degree-2 blocks x 2 ms and 2 reshards x 2 sub-batches x 0.5 ms.
    plan = Plan.from_block_degrees([2, 2, 1, 2], 2)
    assert predict_step_ms(table, plan) == pytest.approx(45 + 7.5 + 4 * 2.105 + 10 + 7 + 3 * 2.0 + 4 * 0.5)


def test_collective_overheads_survive_json_and_bad_ones_are_named(tmp_path):
    import json

    path = tmp_path / "t.json"
    dataclasses.replace(two_layer_table(2), collective_overhead_ms={2: 0.25}).to_json(path)
    assert CostTable.from_json(path).collective_overhead_ms == {2: 0.25}
    with pytest.raises(ValueError, match=r"CostTable.collective_overhead_ms must map group sizes >= 1 to finite ms >= 0"):
        dataclasses.replace(two_layer_table(2), collective_overhead_ms={2: -1.0})
    data = json.loads(path.read_text())
    data["collective_overhead_ms"] = {"two": 1.0}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="collective_overhead_ms must map group sizes"):
        CostTable.from_json(path)


def test_profiler_overhead_keeps_the_rank_that_set_each_step_and_the_median_step():
    """Synthetic profile of a tiny GPT layer: no compute, so the simulator's step is the link
    time alone; each step's wall time is that plus a known extra.  Per step the smaller
    residual of the two ranks counts (the other rank waited for it), then the median:
    degree 1 extras (1, 1, 1) -> 1; degree 2 min(5, 9), min(7, 3), min(100, 8) = 5, 3, 8 -> 5;
    12 collectives -> (5 - 1) / 12 per collective."""
    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.planner.profile import ProfileSpec, _collective_overheads

    tiny = ModelConfig(family="gpt", vocab_size=64, hidden_size=32, num_heads=4, num_layers=1, seq_len=8)
    link = LinkModel(bandwidth_gbps=1.0, latency_us=50.0)
    spec = ProfileSpec(model=tiny, devices=2, micro_batch=4, link=link)
    ops = OperatorModel(tiny).ops
    payload = 2 * 8 * 32 * 4
    link_only = simulate_step(build_schedule(spec.schedule, ops), ops, OpCosts.from_profile(ops, OpTimes(), payload, 2), link).step_ms
    assert link_only > 0

    def rank(extras_1, extras_2):
        def degree(extras, base, collectives):
            return {"op_ms_reps": [{}] * 3, "allreduce_bytes": payload, "collectives": collectives,
                    "step_ms_reps": [base + e for e in extras]}
        return {"degrees": {"1": degree(extras_1, 0.0, 0), "2": degree(extras_2, link_only, 12)}}

    overhead, evidence = _collective_overheads(spec, [rank((1, 1, 1), (5, 7, 100)), rank((1, 1, 1), (9, 3, 8))], link)
    assert overhead == pytest.approx({1: 0.0, 2: 4 / 12})
    assert evidence["2"]["residual_ms"] == pytest.approx(5) and evidence["2"]["collectives_per_step"] == 12


def test_a_configs_link_node_becomes_the_emulated_link_and_a_null_field_takes_the_default():
    """``cluster.link`` as Hydra hands it over: a null ``sharing`` gets ``LinkModel``'s own default, not None;
    no link node (the machine's own link) gives no emulated link."""
    link = link_from_config({"bandwidth_gbps": 0.5, "latency_us": 50.0, "sharing": None})
    assert link == LinkModel(0.5, 50.0) and link.sharing == LinkModel(1.0, 0.0).sharing
    assert link_from_config({"bandwidth_gbps": 1.0, "latency_us": 0.0, "sharing": "ring"}).sharing == "ring"
    assert link_from_config(None) is None and link_from_config({}) is None
