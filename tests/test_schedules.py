"""Schedules as data: expected text forms and the invariant checker, no processes."""
from dataclasses import replace

import pytest

from oases_ds.models.ops import CommOp, ComputeOp
from oases_ds.schedule.checker import ScheduleError, check
from oases_ds.schedule.generators import SCHEDULES, Schedule, ScheduleOptions, build_schedule
from oases_ds.schedule.instructions import Backward, Forward, Recompute, StartAsync, Sync


def _fn(ctx, acts):
    return acts


def block_ops():
    """One TMP block as in the paper, (F_i, C_i, F_j), framed by a layer boundary:
    0 embed | 1 F_i (layer 0) | 2 C_i AllReduce | 3 F_j (layer 0) | 4 copy (bwd AllReduce) | 5 loss."""
    return [
        ComputeOp("embed", -1, "embed", _fn),
        ComputeOp("L0.fi", 0, "attn", _fn),
        CommOp("L0.reduce", 0, "attn", 0, "all_reduce", None, None),
        ComputeOp("L0.fj", 0, "attn", _fn),
        CommOp("head_copy", 1, "head", 0, None, "all_reduce", None),
        ComputeOp("loss", 1, "head", _fn, is_loss=True),
    ]


EXPECTED = {
    # Megatron: layer 0 = ops 1..3 recomputed, re-running the AllReduce (Sr2/Wr2), all synchronous.
    "megatron": "F0.0 f1.0 S2.0 W2.0 f3.0 f4.0 F5.0 B5.0 Sb4.0 Wb4.0 R1.0 Sr2.0 Wr2.0 R3.0 B3.0 B2.0 B1.0 B0.0",
    "none": "F0.0 F1.0 S2.0 W2.0 F3.0 f4.0 F5.0 B5.0 Sb4.0 Wb4.0 B3.0 B2.0 B1.0 B0.0",
    # Oases: checkpoint after the AllReduce; the recompute (R0, R1) never contains it;
    # sub-batch 1 computes while sub-batch 0 communicates, across passes.
    "oases": (
        "f0.0 f1.0 S2.0 f0.1 f1.1 S2.1 W2.0 F3.0 f4.0 F5.0 B5.0 Sb4.0 W2.1 F3.1 f4.1 F5.1 B5.1 Sb4.1 "
        "Wb4.0 B3.0 R0.0 R1.0 B2.0 B1.0 B0.0 Wb4.1 B3.1 R0.1 R1.1 B2.1 B1.1 B0.1"
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_text_forms(name):
    ops = block_ops()
    schedule = build_schedule(name, ops)
    check(schedule, ops)
    assert str(schedule) == EXPECTED[name]


def test_split_overlap_has_barriers_between_passes():
    ops = block_ops()
    text = str(build_schedule("split_overlap", ops))
    # every recompute of layer 0 (both sub-batches) precedes its first backward
    assert text.index("R3.1") < text.index("B3.0")
    # the cross-pass Oases schedule instead starts backward of sub-batch 0 before sub-batch 1 finished forward
    oases = str(build_schedule("oases", ops, ScheduleOptions(fine_grained_recompute=False)))
    assert oases.index("B5.0") < oases.index("F5.1")


def test_fine_grained_never_recomputes_a_collective():
    ops = block_ops()
    fine = build_schedule("oases", ops)
    coarse = build_schedule("oases", ops, ScheduleOptions(fine_grained_recompute=False))
    assert not any(isinstance(i, StartAsync) and i.phase == "recompute" for i in fine.instructions)
    assert sum(isinstance(i, StartAsync) and i.phase == "recompute" for i in coarse.instructions) == 2


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("sub_batches", [1, 2, 3])
def test_every_schedule_passes_the_checker_on_a_real_model(name, sub_batches):
    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel

    for family in ("gpt", "bert", "llama"):
        model = OperatorModel(ModelConfig(family=family, hidden_size=16, num_heads=2, num_layers=2, seq_len=4, vocab_size=16))
        check(build_schedule(name, model.ops, ScheduleOptions(sub_batches=sub_batches)), model.ops)


def _broken(schedule: Schedule, instructions) -> Schedule:
    return replace(schedule, instructions=tuple(instructions))


def test_checker_rejects_hand_broken_schedules():
    ops = block_ops()
    good = build_schedule("oases", ops)
    ins = list(good.instructions)

    no_sync = [i for i in ins if not (isinstance(i, Sync) and i.op == 4 and i.mb == 1)]
    with pytest.raises(ScheduleError, match="never synced"):
        check(_broken(good, no_sync), ops)

    sync_first = [Sync(2, 0, "forward")] + ins
    with pytest.raises(ScheduleError, match="without a matching StartAsync"):
        check(_broken(good, sync_first), ops)

    # Backward of op 1 before its Recompute: reads its graph before it exists.
    pos_r, pos_b = ins.index(Recompute(1, 0)), ins.index(Backward(1, 0))
    swapped = ins.copy()
    swapped[pos_r], swapped[pos_b] = swapped[pos_b], swapped[pos_r]
    with pytest.raises(ScheduleError, match="before it is written"):
        check(_broken(good, swapped), ops)

    # A recomputation that re-runs the forward AllReduce is illegal when fine-grained.
    pos = ins.index(Recompute(1, 0)) + 1
    with_comm = ins[:pos] + [StartAsync(2, 0, "recompute"), Sync(2, 0, "recompute")] + ins[pos:]
    with pytest.raises(ScheduleError, match="collective inside a fine-grained recomputation"):
        check(_broken(good, with_comm), ops)

    missing_backward = [i for i in ins if i != Backward(0, 1)]
    with pytest.raises(ScheduleError, match="0 backwards"):
        check(_broken(good, missing_backward), ops)

    forward_of_collective = [Forward(2, 0) if i == StartAsync(2, 0, "forward") else i for i in ins]
    forward_of_collective.remove(Sync(2, 0, "forward"))
    with pytest.raises(ScheduleError, match="use StartAsync"):
        check(_broken(good, forward_of_collective), ops)


def test_unknown_schedule_and_bad_sub_batches_name_the_field():
    with pytest.raises(ValueError, match="oases.schedule='gpipe' unknown"):
        build_schedule("gpipe", block_ops())
    with pytest.raises(ValueError, match="oases.sub_batches must be >= 1"):
        ScheduleOptions(sub_batches=0)
