"""Schedules as data: expected text forms and the invariant checker, no processes."""
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from oases_ds.schedule import generators
from oases_ds.schedule.checker import ScheduleError, check
from oases_ds.schedule.generators import (SCHEDULES, Schedule, ScheduleSpec, build_schedule, register_schedule,
                                          registered_schedules, schedule_segments)
from oases_ds.schedule.instructions import Backward, Forward, Recompute, StartAsync, Sync
from support import block_ops


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
    schedule = build_schedule(ScheduleSpec(name), ops)
    check(schedule, ops)
    assert str(schedule) == EXPECTED[name]


def test_split_overlap_has_barriers_between_passes():
    ops = block_ops()
    text = str(build_schedule(ScheduleSpec("split_overlap"), ops))
    # every recompute of layer 0 (both sub-batches) precedes its first backward
    assert text.index("R3.1") < text.index("B3.0")
    # the cross-pass Oases schedule instead starts backward of sub-batch 0 before sub-batch 1 finished forward
    oases = str(build_schedule(ScheduleSpec("oases", fine_grained_recompute=False), ops))
    assert oases.index("B5.0") < oases.index("F5.1")


def test_fine_grained_never_recomputes_a_collective():
    ops = block_ops()
    fine = build_schedule(ScheduleSpec("oases"), ops)
    coarse = build_schedule(ScheduleSpec("oases", fine_grained_recompute=False), ops)
    assert not any(isinstance(i, StartAsync) and i.phase == "recompute" for i in fine.instructions)
    assert sum(isinstance(i, StartAsync) and i.phase == "recompute" for i in coarse.instructions) == 2


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("sub_batches", [1, 2, 3])
def test_every_schedule_passes_the_checker_on_a_real_model(name, sub_batches):
    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel

    for family in ("gpt", "bert", "llama"):
        model = OperatorModel(ModelConfig(family=family, hidden_size=16, num_heads=2, num_layers=2, seq_len=4, vocab_size=16))
        check(build_schedule(ScheduleSpec(name, sub_batches=sub_batches), model.ops), model.ops)


def _broken(schedule: Schedule, instructions) -> Schedule:
    return replace(schedule, instructions=tuple(instructions))


def test_checker_rejects_hand_broken_schedules():
    ops = block_ops()
    good = build_schedule(ScheduleSpec("oases"), ops)
    ins = list(good.instructions)

    no_sync = [i for i in ins if not (isinstance(i, Sync) and i.op == 4 and i.sub == 1)]
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


# -- the spec and the registry ---------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "gpipe"}, r"^schedule.name='gpipe' unknown; choose one of none, megatron, megatron_selective, "
                            r"split_overlap, oases$"),
        ({"sub_batches": 0}, r"^schedule.sub_batches must be >= 1, got 0$"),
        ({"sub_batches": "2"}, r"^schedule.sub_batches must be an integer, got '2'$"),
        ({"sub_batches": True}, r"^schedule.sub_batches must be an integer, got True$"),
        ({"cross_pass": "no"}, r"^schedule.cross_pass must be true or false, got 'no'$"),
        ({"fine_grained_recompute": 0}, r"^schedule.fine_grained_recompute must be true or false, got 0$"),
    ],
)
def test_spec_rejects_bad_fields_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScheduleSpec(**kwargs)


def test_build_schedule_wants_a_spec_not_a_name():
    with pytest.raises(TypeError, match=r"expected a ScheduleSpec such as ScheduleSpec\('oases'\), got str"):
        build_schedule("oases", block_ops())
    with pytest.raises(TypeError, match="expected a ScheduleSpec"):
        schedule_segments("oases", block_ops())


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("sub_batches", [1, 3])
def test_sub_batches_apply_only_to_split_overlap_and_oases(name, sub_batches):
    """The one rule, tested once: the spec says how many sub-batches run, and the
    generated schedule really runs that many."""
    spec = ScheduleSpec(name, sub_batches=sub_batches)
    expected = sub_batches if name in ("split_overlap", "oases") else 1
    assert spec.effective_sub_batches == expected
    schedule = build_schedule(spec, block_ops())
    assert schedule.sub_batches == expected
    assert {ins.sub for ins in schedule.instructions} == set(range(expected))


CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "oases_ds" / "configs" / "schedule"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_hydra_schedule_preset_is_a_spec(path):
    raw = yaml.safe_load(path.read_text())
    spec = ScheduleSpec.from_mapping(raw)
    assert (spec.name, spec.sub_batches, spec.cross_pass, spec.fine_grained_recompute) == (
        raw["name"], raw["sub_batches"], raw["cross_pass"], raw["fine_grained_recompute"])
    check(build_schedule(spec, block_ops()), block_ops())


def test_from_mapping_names_unknown_and_missing_keys():
    with pytest.raises(ValueError, match=r"^schedule.sub_batch: unknown key; the schedule keys are name, sub_batches, "):
        ScheduleSpec.from_mapping({"name": "oases", "sub_batch": 4})
    with pytest.raises(ValueError, match=r"^schedule.name: missing; choose one of none, "):
        ScheduleSpec.from_mapping({"sub_batches": 4})
    assert ScheduleSpec.from_mapping({"name": "megatron"}) == ScheduleSpec("megatron")


def test_label_names_only_settings_that_change_the_schedule():
    assert ScheduleSpec("oases").label == "oases"
    assert ScheduleSpec("megatron", sub_batches=4, cross_pass=False).label == "megatron"
    assert ScheduleSpec("oases", sub_batches=4, cross_pass=False).label == "oases[sb=4,cross=0,fine=1]"
    assert ScheduleSpec("split_overlap", fine_grained_recompute=False).label == "split_overlap[sb=2,cross=1,fine=0]"


def test_schedules_come_from_the_registry_and_the_config_accepts_exactly_them():
    from oases_ds.config import OasesConfig

    assert SCHEDULES == registered_schedules() == ("none", "megatron", "megatron_selective", "split_overlap", "oases")
    assert set(OasesConfig.model_fields["schedule"].annotation.__args__) == set(SCHEDULES)
    oases = OasesConfig(schedule="split_overlap", sub_batches=4, cross_pass=False)
    assert oases.schedule_spec() == ScheduleSpec("split_overlap", 4, False, True)


def test_a_registered_schedule_is_built_and_a_name_registers_once(monkeypatch):
    monkeypatch.setattr(generators, "_REGISTRY", dict(generators._REGISTRY))  # leave the real registry as it was
    with pytest.raises(ValueError, match="schedule 'oases' is registered twice"):
        register_schedule("oases", segments=lambda ops, spec: [])(lambda ops, segs, spec: None)

    @register_schedule("megatron_twice", segments=lambda ops, spec: generators.layer_segments(ops))
    def _twice(ops, segs, spec):
        return replace(build_schedule(ScheduleSpec("megatron"), ops), name=spec.name)

    spec = ScheduleSpec("megatron_twice", sub_batches=4)
    assert spec.effective_sub_batches == 1
    assert str(build_schedule(spec, block_ops())) == EXPECTED["megatron"]
    assert "megatron_twice" in registered_schedules()


def test_fine_grained_segments_checkpoint_one_tensor_per_block_on_a_real_model():
    """1-layer GPT, ops by hand: 0 embed, 1 embed_reduce, 2 embed_out, 3 attn_in, 4 attn_copy,
    5 qkv, 6 core, 7 proj, 8 attn_reduce, 9 attn_out, 10 mlp_in, 11 mlp_copy, 12 mlp,
    13 mlp_reduce, 14 mlp_out, 15 head_in, 16 head_copy, 17 loss."""
    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel

    ops = OperatorModel(ModelConfig(family="gpt", hidden_size=16, num_heads=2, num_layers=1, seq_len=8,
                                    vocab_size=32)).ops
    assert [ops[i].name for i in (8, 9, 13, 14)] == ["L0.attn_reduce", "L0.attn_out", "L0.mlp_reduce", "L0.mlp_out"]
    segs = schedule_segments(ScheduleSpec("oases"), ops)
    assert [(s.start, s.end, s.recompute, s.recompute_end, s.tail_start) for s in segs] == [
        (0, 3, True, 1, 2),     # embedding; its AllReduce is not recomputed, embed_out is a kept tail
        (3, 10, True, 8, 9),    # attention; attn_out is the kept tail
        (10, 15, True, 13, 14),  # MLP; mlp_out is the kept tail
        (15, 18, False, 18, 18),  # head, kept
    ]
    # checkpoints: () of the embedding, x before attention, x' before the MLP; the head's graph
    assert generators.held_inputs(ops, segs) == [0, 3, 10, 15, 17]
    text = str(build_schedule(ScheduleSpec("oases", sub_batches=1), ops)).split()
    assert "F2.0" in text and "F9.0" in text and "F14.0" in text  # tails keep their graph from forward ...
    assert not {"R2.0", "R9.0", "R14.0"} & set(text)  # ... and are never recomputed


def test_segment_bounds_are_validated():
    with pytest.raises(ValueError, match=r"^segment bounds must satisfy start <= recompute_end <= tail_start <= end"):
        generators.Segment(0, 5, True, 4, 3)
    assert generators.Segment(0, 5, True, 4).tail_start == 5


# -- sequence parallelism -----------------------------------------------------------------
def _sp_ops(family: str = "llama", layers: int = 2):
    from oases_ds.models.operator_model import plan_ops, sequence_parallel_ops

    return sequence_parallel_ops(plan_ops(family, [2] * layers, [2] * layers, 2)[0])


def test_sequence_parallel_ops_gather_before_and_reduce_scatter_after_each_block():
    """Every copy becomes an AllGather of the sequence (gradient: ReduceScatter) and every
    reduce a ReduceScatter (gradient: AllGather), both along dim 1; the MLP runs as its parts
    (MLP_UP_CHUNKS chunks of the up projection, then the down projection); nothing else changes."""
    from oases_ds.models.operator_model import MLP_UP_CHUNKS, plan_ops

    plain = plan_ops("gpt", [2, 2], [2, 2], 2)[0]
    sp = _sp_ops("gpt")
    ups = [f"mlp_up{k}" for k in range(MLP_UP_CHUNKS)]
    split = {f"L{i}.mlp": [f"L{i}.{name}" for name in [*ups, "mlp_down"]] for i in range(2)}
    assert [op.name for op in sp] == [name for op in plain for name in split.get(op.name, [op.name])]
    assert [(op.name, op.graph_only_recompute, op.continues) for op in sp
            if op.name.startswith("L1.mlp_") and op.kind == "compute"] == [
        ("L1.mlp_in", False, False), *((f"L1.{name}", False, k > 0) for k, name in enumerate(ups)),
        ("L1.mlp_down", True, False), ("L1.mlp_out", False, False)]
    planned, degrees = plan_ops("gpt", [2, 2], [2, 2], 2, sequence_parallel=True)
    assert [(op.name, op.kind) for op in planned] == [(op.name, op.kind) for op in sp] and degrees == [2] * len(sp)
    pairs = {op.name: (op.forward, op.backward, op.dim) for op in sp if op.kind == "comm"}
    assert pairs["embed_reduce"] == pairs["L1.attn_reduce"] == ("reduce_scatter", "all_gather", 1)
    assert pairs["L0.mlp_copy"] == pairs["head_copy"] == ("all_gather", "reduce_scatter", 1)
    assert len(pairs) == 2 + 4 * 2  # embedding, head, and per layer two copies and two reduces


def _recompute_collectives(schedule, ops):
    return [ops[i.op].name for i in schedule.instructions if isinstance(i, StartAsync) and i.phase == "recompute"]


def test_oases_under_sequence_parallelism_regathers_each_recomputed_block_and_checkpoints_its_slice():
    """Policy oases: the AllGather stays inside the block's segment, so the checkpoint is the
    block's 1/t input slice and the recomputation re-gathers it (the only collective the checker
    lets a fine-grained recomputation run); oases_gathered cuts after the gather instead."""
    ops = _sp_ops()
    spec = ScheduleSpec("oases")
    schedule = build_schedule(spec, ops)
    check(schedule, ops)
    gathers = ["L0.attn_copy", "L0.mlp_copy", "L1.attn_copy", "L1.mlp_copy"]
    assert sorted(_recompute_collectives(schedule, ops)) == sorted(gathers * 2)  # each block, each sub-batch, once
    held = generators.held_inputs(ops, schedule_segments(spec, ops))
    assert [ops[i].name for i in held if ops[i].block in ("attn", "mlp")] == [
        "L0.attn_in", "L0.mlp_in", "L1.attn_in", "L1.mlp_in"]

    gathered = replace(spec, gathered_blocks=(0, 1, 2, 3))
    schedule = build_schedule(gathered, ops)
    check(schedule, ops)
    assert _recompute_collectives(schedule, ops) == []
    held = generators.held_inputs(ops, schedule_segments(gathered, ops))
    assert [ops[i].name for i in held if ops[i].block in ("attn", "mlp")] == [
        "L0.attn_in", "L0.qkv", "L0.mlp_in", "L0.mlp_up0", "L1.attn_in", "L1.qkv", "L1.mlp_in", "L1.mlp_up0"]


def test_checker_allows_only_the_regather_of_a_block_that_does_not_keep_it():
    ops = _sp_ops()
    regather = build_schedule(ScheduleSpec("oases"), ops)
    # the same instructions claimed for a plan whose attn0 keeps its gathered input
    with pytest.raises(ScheduleError, match=r"L0\.attn_copy|collective inside a fine-grained recomputation \(its block "
                                            r"keeps the gathered input"):
        check(replace(regather, gathered_blocks=(0,)), ops)
    # a ReduceScatter re-run in a recomputation (Megatron's layer recompute) is no fine-grained schedule
    megatron = build_schedule(ScheduleSpec("megatron"), ops)
    check(megatron, ops)
    with pytest.raises(ScheduleError, match=r"collective inside a fine-grained recomputation$"):
        check(replace(megatron, fine_grained=True), ops)


def test_a_block_cannot_both_store_and_keep_its_gathered_input():
    with pytest.raises(ValueError, match=r"^schedule: block 1 is in both stored_blocks and gathered_blocks"):
        ScheduleSpec("oases", stored_blocks=(1,), gathered_blocks=(1, 2))
    with pytest.raises(ValueError, match=r"^schedule.gathered_blocks \(policy oases_gathered\) needs schedule.name=oases.*keep no gathered inputs$"):
        ScheduleSpec("megatron", gathered_blocks=(0,))


def _uncovered(schedule, ops):
    """Collectives of each phase whose StartAsync..Sync window holds no heavy (not ``light``) compute
    of another sub-batch: nothing but the link's speed hides them."""
    from oases_ds.models.ops import CommOp

    open_: dict = {}
    bad = {"forward": 0, "recompute": 0, "backward": 0}
    for ins in schedule.instructions:
        if isinstance(ins, StartAsync):
            open_[(ins.op, ins.sub, ins.phase)] = False
        elif isinstance(ins, Sync):
            bad[ins.phase] += not open_.pop((ins.op, ins.sub, ins.phase))
        elif not isinstance(ops[ins.op], CommOp) and not ops[ins.op].light:
            for key in open_:
                open_[key] |= key[1] != ins.sub
    return bad


def _dark(ops):
    """``ops`` with no op marked light: the merge as it was before hops."""
    from oases_ds.models.ops import CommOp

    return [op if isinstance(op, CommOp) else replace(op, light=False) for op in ops]


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_light_marks_change_no_schedule_without_sequence_parallelism(family):
    """Hops are for sequence parallelism only: every other schedule, mixed degrees with their
    reshards included, is instruction for instruction what it was."""
    from oases_ds.models.operator_model import plan_ops

    ops = plan_ops(family, [2, 1], [1, 2], 2)[0]
    for spec in (ScheduleSpec("oases"), ScheduleSpec("oases", sub_batches=3), ScheduleSpec("oases", cross_pass=False),
                 ScheduleSpec("oases", stored_blocks=(0, 3)), ScheduleSpec("split_overlap"), ScheduleSpec("megatron")):
        assert build_schedule(spec, ops).instructions == build_schedule(spec, _dark(ops)).instructions, spec.label


def test_under_sequence_parallelism_a_sub_batch_hops_in_to_start_its_next_gather():
    """A block's ReduceScatter and the next block's AllGather have only a norm between them: switching
    sub-batches at collectives alone leaves 16 of the 36 forward collectives of a 4-layer LLaMA with no
    heavy work of the other sub-batch to hide behind.  Hopping in between two heavy ops (the MLP runs
    as several, its up-projection chunks and mlp_down, so it has such a point) leaves 2 -- the sequence's first, before the
    other sub-batch has started, and its last -- and none in backward; with 3 sub-batches none at all.
    Were the MLP one op, hopping would leave 9: its ReduceScatter each time."""
    from oases_ds.models.operator_model import plan_ops, sequence_parallel_ops

    ops = _sp_ops(layers=4)
    store = ScheduleSpec("oases", stored_blocks=tuple(range(8)))
    before, after = (_uncovered(build_schedule(store, o), ops) for o in (_dark(ops), ops))
    assert (before["forward"], after["forward"], after["backward"]) == (16, 2, 0) and before["backward"] > 0
    whole = sequence_parallel_ops([replace(op, parts=()) if op.kind == "compute" else op
                                   for op in plan_ops("llama", [2] * 4, [2] * 4, 2)[0]])
    assert _uncovered(build_schedule(store, whole), whole)["forward"] == 9
    for spec in (store, ScheduleSpec("oases"), ScheduleSpec("oases", sub_batches=3)):
        check(build_schedule(spec, ops), ops)
    assert _uncovered(build_schedule(ScheduleSpec("oases", sub_batches=3), ops), ops) == {
        "forward": 0, "recompute": 0, "backward": 0}


def test_the_up_projection_chunks_cover_the_sequence_in_parts_of_at_least_min_chunk_tokens():
    """``mlp_up_chunk_bounds``: consecutive, covering every gathered token once, equal non-empty parts
    (one per MIN_CHUNK_TOKENS of the sequence, at least one) after the empty ones; the cost and
    memory models' shares add up to the whole projection."""
    from oases_ds.models.operator_model import MIN_CHUNK_TOKENS, MLP_UP_CHUNKS, mlp_up_chunk_bounds, mlp_up_chunk_share

    for seq in (2, 8, 512, MIN_CHUNK_TOKENS, 2 * MIN_CHUNK_TOKENS, 3000, 4 * MIN_CHUNK_TOKENS, 10000):
        for samples in (1, 2, 3):
            tokens = samples * seq
            bounds = mlp_up_chunk_bounds(tokens, seq)
            real = [(start, end) for start, end in bounds if end > start]
            assert len(bounds) == MLP_UP_CHUNKS and real[0][0] == 0 and real[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(real, real[1:]))
            assert bounds[MLP_UP_CHUNKS - len(real):] == real  # the empty chunks first
            sizes = [end - start for start, end in real]
            assert len(sizes) == max(1, min(MLP_UP_CHUNKS, seq // MIN_CHUNK_TOKENS)) and max(sizes) - min(sizes) <= 1
            assert len(sizes) == 1 or min(sizes) >= samples * MIN_CHUNK_TOKENS
        assert sum(mlp_up_chunk_share(seq, k) for k in range(MLP_UP_CHUNKS)) == pytest.approx(1.0)
