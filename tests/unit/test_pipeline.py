"""Pipeline stages as data: rank arithmetic with stages, the stage split, the 1F1B and GPipe
schedules with every TMP schedule inside, and the checker that proves the stages' transfers
match and cannot deadlock.  No process group (TMP 1 models on one process)."""
from __future__ import annotations

import itertools
import random

import pytest

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel, sequence_parallel_ops
from oases_ds.models.stages import Stage, split_stages, stage_layer_counts
from oases_ds.parallel.topology import Coord, Topology
from oases_ds.schedule.checker import ScheduleError, check_pipeline, check_pipeline_links, simulate_nccl
from oases_ds.schedule.generators import SCHEDULES, ScheduleSpec, build_schedule
from oases_ds.schedule.instructions import P2PStart, P2PSync, PipeStep, SendActivation
from oases_ds.schedule.pipeline import (CHANNEL, OVERLAP, PipelineSchedule, build_pipeline, gpipe_order,
                                       one_f_one_b_order, transfers)


# -- topology ------------------------------------------------------------------------
def test_rank_order_is_tmp_then_dp_then_pp():
    topo = Topology(world_size=8, tp_size=2, pp_size=2)
    assert topo.dp_size == 2 and topo.stage_size == 4
    assert [topo.coord(r) for r in (0, 1, 2, 5, 7)] == [Coord(0, 0, 0), Coord(0, 1, 0), Coord(1, 0, 0),
                                                         Coord(0, 1, 1), Coord(1, 1, 1)]
    for rank in range(8):
        assert topo.rank(topo.coord(rank)) == rank
    assert topo.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.dp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.pp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.model_group_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for groups in (topo.tp_group_ranks(), topo.dp_group_ranks(), topo.pp_group_ranks(), topo.model_group_ranks()):
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert (topo.prev_stage_rank(5), topo.next_stage_rank(5)) == (1, None)
    assert (topo.prev_stage_rank(3), topo.next_stage_rank(3)) == (None, 7)


def test_one_stage_keeps_the_old_layout():
    assert Topology(8, 2).tp_group_ranks() == Topology(8, 2, 1).tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert Topology(8, 2).pp_group_ranks() == [[r] for r in range(8)]


def test_replica_groups_stay_inside_a_stage():
    topo = Topology(world_size=8, tp_size=2, pp_size=2)
    assert topo.replica_dp_group_ranks(1, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_world_not_divisible_by_stages_times_tmp_names_both_fields():
    with pytest.raises(ValueError, match=r"pipeline_stages=2 x tensor_parallel_size=2 = 4 does not divide world size 6"):
        Topology(world_size=6, tp_size=2, pp_size=2)


# -- the stage split -------------------------------------------------------------------
def test_even_split_gives_the_first_stages_the_extra_layers():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(7, 3) == [3, 2, 2]
    assert stage_layer_counts(3, 3) == [1, 1, 1]


def _brute_min_max(costs: list[float], stages: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_cost_split_minimises_the_most_expensive_stage(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
    counts = stage_layer_counts(n, stages, costs)
    assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
    bounds = [sum(counts[:k]) for k in range(stages + 1)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(_brute_min_max(costs, stages), rel=1e-12)


def test_cost_split_moves_layers_off_an_expensive_stage_and_equal_costs_split_evenly():
    assert stage_layer_counts(4, 2, [1, 1, 1, 1]) == [2, 2]
    assert stage_layer_counts(4, 2, [5, 1, 1, 1]) == [1, 3]
    assert stage_layer_counts(6, 3, [1, 1, 1, 1, 1, 1]) == [2, 2, 2]


def test_split_errors_name_the_field():
    with pytest.raises(ValueError, match=r"pipeline_stages=5 exceeds model.num_layers=4"):
        stage_layer_counts(4, 5)
    with pytest.raises(ValueError, match=r"costs has 3 entries for model.num_layers=4"):
        stage_layer_counts(4, 2, [1, 2, 3])
    with pytest.raises(ValueError, match=r"pipeline_layers=\[3, 2\] sums to 5 but model.num_layers=4"):
        split_stages(4, 2, [3, 2])
    with pytest.raises(ValueError, match=r"pipeline_layers has 3 entries for pipeline_stages=2"):
        split_stages(4, 2, [1, 1, 2])
    with pytest.raises(ValueError, match=r"positive whole number"):
        split_stages(4, 2, [4, 0])
    assert split_stages(4, 2, [1, 3]) == [Stage(0, 2, 0, 1), Stage(1, 2, 1, 4)]


# -- stage models --------------------------------------------------------------------
def _cfg(family: str = "gpt", layers: int = 4, **kw) -> ModelConfig:
    return ModelConfig(family=family, vocab_size=64, hidden_size=32, num_heads=4, num_layers=layers, seq_len=8,
                       dropout=0.1, **kw)


def _stage_models(family: str, stages: int, layers: int = 4) -> list[OperatorModel]:
    cfg = _cfg(family, layers)
    return [OperatorModel(cfg, seed=3, stage=s) for s in split_stages(layers, stages)]


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_stages_partition_the_parameters_of_the_whole_model(family):
    whole = dict(OperatorModel(_cfg(family), seed=3).named_parameters())
    parts = [dict(m.named_parameters()) for m in _stage_models(family, 2)]
    assert set(parts[0]).isdisjoint(parts[1])
    assert set(parts[0]) | set(parts[1]) == set(whole)
    assert any(n.startswith("embed.") for n in parts[0]) and not any(n.startswith("head.") for n in parts[0])
    assert any(n.startswith("head.") for n in parts[1]) and not any(n.startswith("embed.") for n in parts[1])
    assert all(int(n.split(".")[1]) >= 2 for n in parts[1] if n.startswith("layers."))
    for part in parts:  # same global initial weights
        for name, p in part.items():
            assert p.equal(whole[name]), name


def test_tied_embeddings_with_stages_are_refused_in_one_line():
    with pytest.raises(ValueError, match="model.tie_embeddings with pipeline_stages > 1") as err:
        OperatorModel(_cfg(tie_embeddings=True), stage=Stage(0, 2, 0, 2))
    assert "\n" not in str(err.value)


# -- schedules as data ----------------------------------------------------------------
def test_orders_of_halves():
    assert " ".join(f"{h}{m}" for h, m in one_f_one_b_order(0, 3, 4)) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert " ".join(f"{h}{m}" for h, m in one_f_one_b_order(2, 3, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert " ".join(f"{h}{m}" for h, m in one_f_one_b_order(0, 4, 2)) == "F0 F1 B0 B1"
    assert " ".join(f"{h}{m}" for h, m in gpipe_order(1, 3, 3)) == "F0 F1 F2 B0 B1 B2"


def test_the_none_body_of_a_middle_stage_reads_as_expected():
    models = _stage_models("gpt", 3, layers=3)
    mid = models[1]
    pipe = build_pipeline("1f1b", ScheduleSpec("none"), mid.ops, 1, 3, 1)
    n = len(mid.ops)
    text = str(pipe)
    # receive posted and waited before the first op; output sent after the last forward
    assert text.startswith("0:<a0.0 0:W<a0.0 0:F0.0 ")
    assert f"0:F{n - 1}.0 0:>a{n}.0 0:<g{n}.0 0:W<g{n}.0 0:B{n - 1}.0" in text
    assert text.endswith(f"0:B0.0 0:>g0.0 0:W>a{n}.0 0:W>g0.0")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pipeline", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 4), (3, 5), (4, 3)])
def test_every_tmp_schedule_inside_every_pipeline_passes_the_checker(schedule, pipeline, stages, micro_batches):
    models = _stage_models("gpt", stages, layers=4)
    pipes = [build_pipeline(pipeline, ScheduleSpec(schedule), m.ops, s, stages, micro_batches)
             for s, m in enumerate(models)]
    for pipe, model in zip(pipes, models):
        check_pipeline(pipe, model.ops)
    check_pipeline_links(pipes)
    subs = pipes[0].sub_batches
    expected = [(m, s) for m in range(micro_batches) for s in range(subs)]
    assert transfers(pipes[0], "send_act") == expected == transfers(pipes[1], "recv_act")
    assert transfers(pipes[1], "send_grad") == expected == transfers(pipes[0], "recv_grad")


def test_oases_inside_a_stage_keeps_sub_batch_overlap_in_the_forward_half():
    models = _stage_models("gpt", 2)
    pipe = build_pipeline("1f1b", ScheduleSpec("oases"), models[1].ops, 1, 2, 2)
    forward = " ".join(str(i) for i in pipe.body.forward)
    # sub-batch 1's receive is waited only after sub-batch 0 started its first collective
    assert forward.index("W<a0.1") > forward.index("S")
    check_pipeline(pipe, models[1].ops)


def _pipes(pipeline_per_stage: list[str], micro_batches: int = 2, schedule: str = "none") -> tuple[list, list]:
    models = _stage_models("gpt", len(pipeline_per_stage))
    pipes = [build_pipeline(name, ScheduleSpec(schedule), m.ops, s, len(models), micro_batches)
             for s, (name, m) in enumerate(zip(pipeline_per_stage, models))]
    return pipes, models


def test_checker_finds_a_deadlock_between_mismatched_orders():
    # stage 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation,
    # which stage 1 (GPipe) needs before it runs any backward.
    pipes, models = _pipes(["1f1b", "gpipe"])
    zero = pipes[0]
    eager = PipelineSchedule(zero.name, 0, 2, 2, zero.body, (("F", 0), ("B", 0), ("F", 1), ("B", 1)),
                             tuple(PipeStep(m, i) for h, m in (("F", 0), ("B", 0), ("F", 1), ("B", 1))
                                   for i in (zero.body.forward if h == "F" else zero.body.backward)))
    check_pipeline(eager, models[0].ops)  # fine on its own
    with pytest.raises(ScheduleError, match="deadlock: stage 0 at .*W<g.*stage 1 at .*W<a"):
        check_pipeline_links([eager, pipes[1]])


ONE_GROUP = {kind: "pp" for kind in CHANNEL}  # both directions on one communicator: the order before the fix


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["oases", "megatron", "none"])
def test_nccl_model_catches_1f1b_on_one_group_and_passes_one_group_per_direction(stages, schedule):
    # NCCL runs one communicator's transfers in issue order; with activations and gradients on
    # one group, 1F1B's first steady-state step puts a send at the head of both neighbours'
    # streams (the activation of F(m+w), the gradient of B(m)), each waiting for a receive
    # queued behind the other's send.
    models = _stage_models("gpt", stages, layers=4)
    pipes = [build_pipeline("1f1b", ScheduleSpec(schedule), m.ops, s, stages, 4) for s, m in enumerate(models)]
    heads = rf"^NCCL deadlock: stage 0 at .* queued pp: >a{stages - 1}\.0; .*stage {stages - 1} at .* queued pp: >g0\.0$"
    with pytest.raises(ScheduleError, match=heads):
        simulate_nccl(pipes, ONE_GROUP)
    simulate_nccl(pipes, CHANNEL)  # what the executor uses: a group per direction
    check_pipeline_links(pipes)  # gloo and NCCL models, with CHANNEL


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("micro_batches", [1, 4, 8])
def test_gpipe_is_safe_on_nccl_with_one_group_or_two(stages, micro_batches):
    # every forward send precedes every gradient transfer on both ends, so the FIFO orders agree
    models = _stage_models("gpt", stages, layers=4)
    pipes = [build_pipeline("gpipe", ScheduleSpec("oases"), m.ops, s, stages, micro_batches) for s, m in enumerate(models)]
    simulate_nccl(pipes, ONE_GROUP)
    simulate_nccl(pipes, CHANNEL)


def test_nccl_model_finds_a_receive_posted_behind_a_send_to_the_same_peer():
    # 1 micro-batch, 1F1B on two stages is safe; move stage 1's first gradient send before its
    # activation receive is even waited on and the one-group FIFO on stage 1 is >g before <a
    pipes, _ = _pipes(["1f1b", "1f1b"], micro_batches=1)
    simulate_nccl(pipes, ONE_GROUP)
    one = pipes[1]
    steps = list(one.steps)
    send = next(i for i, s in enumerate(steps) if isinstance(s.ins, P2PStart) and s.ins.kind == "send_grad")
    steps.insert(0, steps.pop(send))
    broken = PipelineSchedule(one.name, 1, 2, 1, one.body, one.order, tuple(steps))
    with pytest.raises(ScheduleError, match="NCCL deadlock"):
        simulate_nccl([pipes[0], broken], ONE_GROUP)


def test_checker_finds_sends_out_of_order():
    pipes, _ = _pipes(["1f1b", "1f1b"])
    steps = list(pipes[0].steps)
    sends = [i for i, s in enumerate(steps) if isinstance(s.ins, SendActivation)]
    steps[sends[0]], steps[sends[1]] = steps[sends[1]], steps[sends[0]]  # micro 0 and micro 1 swapped
    broken = PipelineSchedule(pipes[0].name, 0, 2, 2, pipes[0].body, pipes[0].order, tuple(steps))
    with pytest.raises(ScheduleError, match=r"link 0-1: stage 0 sends send_act .* where stage 1 receives"):
        check_pipeline_links([broken, pipes[1]])


def test_checker_finds_a_receive_never_waited_and_a_transfer_on_the_wrong_stage():
    pipes, models = _pipes(["1f1b", "1f1b"])
    one = pipes[1]
    steps = tuple(s for s in one.steps if not (isinstance(s.ins, P2PSync) and s.ins.kind == "recv_act" and s.micro == 1))
    with pytest.raises(ScheduleError, match="stage 1 micro-batch 1"):
        check_pipeline(PipelineSchedule(one.name, 1, 2, 2, one.body, one.order, steps), models[1].ops)
    stray = (PipeStep(0, SendActivation(len(models[1].ops), 0)),) + one.steps
    with pytest.raises(ScheduleError, match="no send_act on this stage"):
        check_pipeline(PipelineSchedule(one.name, 1, 2, 2, one.body, one.order, stray), models[1].ops)


def test_pipeline_names_and_micro_batches_are_validated():
    ops = _stage_models("gpt", 2)[0].ops
    with pytest.raises(ValueError, match="pipeline_schedule='zigzag' unknown; choose one of"):
        build_pipeline("zigzag", ScheduleSpec("none"), ops, 0, 2, 2)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
        build_pipeline("1f1b", ScheduleSpec("none"), ops, 0, 2, 0)
    assert all(isinstance(s.ins, (P2PStart, P2PSync)) or s.ins.op < len(ops)
               for s in build_pipeline("gpipe", ScheduleSpec("oases"), ops, 0, 2, 2).steps)


# -- one stage, micro-batches overlapped ---------------------------------------------------
def _in_flight(pipe: PipelineSchedule, sub: int) -> int:
    """The most micro-batches that sub-batch ``sub`` has begun and not finished at any of its instructions."""
    steps = [(i, s.micro) for i, s in enumerate(pipe.steps) if s.ins.sub == sub]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, m in steps:
        first.setdefault(m, i)
        last[m] = i
    return max(sum(first[m] <= i <= last[m] for m in first) for i, _ in steps)


@pytest.mark.parametrize("spec", [ScheduleSpec("oases"), ScheduleSpec("oases", sub_batches=3, stored_blocks=(0, 3)),
                                  ScheduleSpec("oases", fine_grained_recompute=False), ScheduleSpec("oases", sub_batches=4)])
@pytest.mark.parametrize("micro_batches", [1, 2, 5])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_overlapped_micro_batches_pass_the_checker_with_two_in_flight(spec, micro_batches, sequence_parallel):
    ops = OperatorModel(ModelConfig(family="llama", vocab_size=16, hidden_size=8, num_heads=2, num_layers=2,
                                    seq_len=4)).ops
    ops = sequence_parallel_ops(ops) if sequence_parallel else ops  # the merge then hops over light ops
    pipe = build_pipeline(OVERLAP, spec, ops, 0, 1, micro_batches)
    check_pipeline(pipe, ops)  # every micro-batch a valid schedule of its own: each op once per sub-batch, in order
    assert pipe.name == OVERLAP and len(pipe) == micro_batches * len(build_schedule(spec, ops))
    if micro_batches == 1:  # one micro-batch is exactly the oases schedule
        assert [s.ins for s in pipe.steps] == list(build_schedule(spec, ops).instructions)
        return
    assert max(_in_flight(pipe, sub) for sub in range(pipe.sub_batches)) == 2  # per sub-batch lane
    # the next micro-batch's forward starts before this one's backward ends: they overlap
    for m in range(micro_batches - 1):
        end_of_backward = max(i for i, s in enumerate(pipe.steps) if s.micro == m)
        assert min(i for i, s in enumerate(pipe.steps) if s.micro == m + 1) < end_of_backward


def test_merge_gates_hold_a_stream_and_a_hop_never_steps_over_one():
    """``merge(gates=...)``: a stream waits at its gated item until the other stream has emitted enough,
    also when the light-op hops would run it; a gate nothing can open is an error, not a hang."""
    from oases_ds.schedule.generators import _Comm, merge
    from oases_ds.schedule.instructions import Forward

    # stream 0: a collective, then a light op (2) and its next collective; stream 1: heavy ops only, so
    # each of them offers stream 0 a hop over its light op -- which the gate at that op must stop
    a = [Forward(0, 0), _Comm(1, 0, "forward"), Forward(2, 0), _Comm(3, 0, "forward"), Forward(4, 0)]
    b = [Forward(10, 1) for _ in range(6)]
    gated = merge([a, b], light=lambda op: op == 2, gates={(0, 2): (1, 5)})
    light_op = next(i for i, ins in enumerate(gated) if isinstance(ins, Forward) and ins.op == 2)
    fifth_of_b = [i for i, ins in enumerate(gated) if ins.sub == 1][4]
    assert light_op > fifth_of_b, " ".join(map(str, gated))  # op 2 only once stream 1 emitted 5 items
    with pytest.raises(ValueError, match="every stream waits on a gate no stream can open"):
        merge([a, a[:1] + [_Comm(1, 1, "forward")] + a[2:]], gates={(0, 1): (1, 2), (1, 1): (0, 2)})


def test_overlapped_micro_batches_are_refused_where_they_cannot_run():
    from oases_ds.config import OasesConfigError, parse_oases_section

    ops = _stage_models("gpt", 2)[0].ops
    with pytest.raises(ValueError, match="runs the micro-batches of one stage; with pipeline_stages=2"):
        build_pipeline(OVERLAP, ScheduleSpec("oases"), ops, 0, 2, 2)
    ops = OperatorModel(ModelConfig(family="gpt", vocab_size=16, hidden_size=8, num_heads=2, num_layers=1, seq_len=4)).ops
    with pytest.raises(ValueError, match="not schedule=oases with cross_pass=false; set schedule=oases and cross_pass=true"):
        build_pipeline(OVERLAP, ScheduleSpec("oases", cross_pass=False), ops, 0, 1, 2)
    cases = [({"pipeline_stages": 2}, "oases: overlap_micro_batches=true runs the micro-batches of one stage; with "
                                      "pipeline_stages=2 the pipeline order overlaps them: turn it off"),
             ({"schedule": "megatron"}, "oases: overlap_micro_batches=true merges micro-batches with the cross-pass "
                                        "oases schedule, not schedule=megatron with cross_pass=true"),
             ({"cross_pass": False}, "oases: overlap_micro_batches=true merges micro-batches with the cross-pass oases "
                                     "schedule, not schedule=oases with cross_pass=false")]
    for section, expected in cases:
        with pytest.raises(OasesConfigError) as err:
            parse_oases_section({"enabled": True, "overlap_micro_batches": True, **section})
        assert str(err.value).startswith(expected), str(err.value)
        assert "\n" not in str(err.value)
    assert parse_oases_section({"overlap_micro_batches": True}).overlap_micro_batches


# -- the "oases" section -----------------------------------------------------------------
def test_pipeline_keys_of_the_oases_section_are_validated_in_one_line():
    from oases_ds.config import OasesConfigError, parse_oases_section

    oases = parse_oases_section({"enabled": True, "pipeline_stages": 2, "pipeline_layers": [1, 3]})
    assert [(s.start, s.end) for s in oases.stages(4)] == [(0, 1), (1, 4)]
    assert [(s.start, s.end) for s in parse_oases_section({"pipeline_stages": 2}).stages(5)] == [(0, 3), (3, 5)]
    cases = [({"pipeline_stages": 2}, 1, "oases.pipeline_stages=2 exceeds model.num_layers=1"),
             ({"pipeline_stages": 2, "pipeline_layers": [2, 1]}, 2,
              "oases.pipeline_layers=[2, 1] sums to 3 but model.num_layers=2"),
             ({"pipeline_stages": 2, "pipeline_schedule": "zigzag"}, 2,
              "oases.pipeline_schedule: Input should be 'gpipe' or '1f1b' (got 'zigzag')"),
             ({"pipeline_stages": 0}, 2, "oases.pipeline_stages: Input should be greater than or equal to 1"),
             ({"pipeline_stages": "2"}, 2, "oases.pipeline_stages: Input should be a valid integer")]
    for section, layers, expected in cases:
        with pytest.raises(OasesConfigError) as err:
            parse_oases_section({"enabled": True, **section}).stages(layers)
        assert str(err.value).startswith(expected), str(err.value)
        assert "\n" not in str(err.value)


def test_a_staged_plan_gives_its_split_unless_pipeline_layers_names_one(tmp_path):
    """``oases-plan pipeline_stages=2`` writes its balanced split into the plan; a run given
    the plan takes it (``oases_ds.with_planned_stages``), an explicit ``pipeline_layers`` wins,
    and a plan made for other stages is one line."""
    import oases_ds
    from oases_ds.config import OasesConfig, OasesConfigError
    from oases_ds.planner.plan import Plan

    path = tmp_path / "staged.json"
    Plan((2, 2, 2, 2), (2, 2, 2, 2), 2, stage_layers=(1, 3)).to_json(path)
    base = dict(enabled=True, tensor_parallel_size=2, plan=str(path))
    planned = oases_ds.with_planned_stages(OasesConfig(**base, pipeline_stages=2))
    assert [len(s.layers) for s in planned.stages(4)] == [1, 3]
    explicit = oases_ds.with_planned_stages(OasesConfig(**base, pipeline_stages=2, pipeline_layers=[2, 2]))
    assert [len(s.layers) for s in explicit.stages(4)] == [2, 2]
    with pytest.raises(OasesConfigError, match=r"^oases.plan=.* was planned for 2 pipeline stages; this run has "
                                               r"oases.pipeline_stages=1: plan again with pipeline_stages=1 or run with "
                                               r"pipeline_stages=2$"):
        oases_ds.with_planned_stages(OasesConfig(**base, pipeline_stages=1))
