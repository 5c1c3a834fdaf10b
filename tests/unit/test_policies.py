"""Per-block recomputation policies (``store`` / ``oases``) as data: the spec, the segments,
the checker, the plan file and the config, no processes.  Gradient parity of mixed policies
runs on gloo ranks in tests/distributed (test_parity, test_heterogeneous, test_pipeline_parity)."""
from dataclasses import replace

import pytest

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel, plan_ops
from oases_ds.planner.costs import _schedule_of_label
from oases_ds.planner.plan import Plan
from oases_ds.schedule.checker import ScheduleError, check
from oases_ds.schedule.generators import (ScheduleSpec, block_index, build_schedule, held_inputs,
                                          schedule_segments)
from oases_ds.schedule.instructions import Backward, Forward, Recompute


def _ops(family: str = "gpt", layers: int = 2):
    return OperatorModel(ModelConfig(family=family, hidden_size=16, num_heads=2, num_layers=layers, seq_len=8,
                                     vocab_size=32)).ops


def _recomputed_blocks(schedule, ops) -> set:
    return {block_index(ops[i.op].layer, ops[i.op].block) for i in schedule.instructions if isinstance(i, Recompute)}


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
@pytest.mark.parametrize("stored", [(), (0,), (1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("cross_pass", [True, False])
def test_a_stored_block_is_never_recomputed_and_the_others_are(family, stored, cross_pass):
    ops = _ops(family)
    schedule = build_schedule(ScheduleSpec("oases", cross_pass=cross_pass, stored_blocks=stored), ops)
    check(schedule, ops)
    assert _recomputed_blocks(schedule, ops) == ({0, 1, 2, 3} - set(stored)) | {None}  # None: the embedding
    assert schedule.stored_blocks == stored


def test_storing_every_block_holds_what_none_holds_inside_the_layers():
    """All stored: every layer op keeps its graph, as under ``none``; only the embedding
    (which no policy covers) is still recomputed from its empty checkpoint."""
    ops = _ops()
    layer_ops = {i for i, op in enumerate(ops) if op.block in ("attn", "mlp")}
    stored = held_inputs(ops, schedule_segments(ScheduleSpec("oases", stored_blocks=(0, 1, 2, 3)), ops))
    kept = held_inputs(ops, schedule_segments(ScheduleSpec("none"), ops))
    assert set(stored) & layer_ops == set(kept) & layer_ops
    recomputed = held_inputs(ops, schedule_segments(ScheduleSpec("oases"), ops))
    assert len(set(recomputed) & layer_ops) < len(set(stored) & layer_ops)


def test_policies_mix_with_degrees_through_reshards():
    """A TMP-4 plan with three degrees: reshard segments belong to the block after them,
    and every mix of policies is a valid schedule."""
    ops, _ = plan_ops("llama", (4, 1), (2, 4), 4)
    for stored in [(0,), (1,), (2, 3), (0, 1, 2, 3)]:
        schedule = build_schedule(ScheduleSpec("oases", stored_blocks=stored), ops)
        check(schedule, ops)
        assert not _recomputed_blocks(schedule, ops) & set(stored)


def test_the_checker_holds_a_schedule_to_its_stored_blocks():
    ops = _ops()
    recomputing = build_schedule(ScheduleSpec("oases"), ops)
    claimed = replace(recomputing, stored_blocks=(0,))  # says it stores attn0, but was built recomputing it
    with pytest.raises(ScheduleError, match=r"L0\.attn_in is in a stored block \(policy store\) but drops its graph"):
        check(claimed, ops)
    attn_in = next(i for i, op in enumerate(ops) if op.name == "L0.attn_in")
    stored_attn = build_schedule(ScheduleSpec("oases", stored_blocks=(0,)), ops)
    ins = list(stored_attn.instructions)
    at = ins.index(Backward(attn_in, 0))
    rerun = ins[:at] + [Recompute(attn_in, 0)] + ins[at:]  # a recompute the plan did not pay for
    with pytest.raises(ScheduleError, match=r"L0\.attn_in is in a stored block \(policy store\) but is recomputed"):
        check(replace(stored_attn, instructions=tuple(rerun)), ops)


@pytest.mark.parametrize("kwargs, message", [
    ({"stored_blocks": (0,), "name": "megatron"},
     r"^schedule.stored_blocks \(policy store\) needs schedule.name=oases with fine_grained_recompute=true, got "
     r"'megatron' with fine_grained_recompute=true; use that schedule or store no blocks$"),
    ({"stored_blocks": (1,), "fine_grained_recompute": False}, r"got 'oases' with fine_grained_recompute=false"),
    ({"stored_blocks": (-1,)}, r"^schedule.stored_blocks must be block indices >= 0 \(attn0 = 0, mlp0 = 1, \.\.\.\), got \(-1,\)$"),
    ({"stored_blocks": "0"}, r"^schedule.stored_blocks must be block indices"),
])
def test_the_spec_refuses_stored_blocks_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScheduleSpec(**kwargs)


def test_stored_blocks_are_normalised_and_named_in_the_label():
    spec = ScheduleSpec("oases", stored_blocks=[3, 0, 3])
    assert spec.stored_blocks == (0, 3)
    assert spec.label == "oases[sb=2,cross=1,fine=1,store=0.3]"
    assert _schedule_of_label(spec.label) == spec
    assert ScheduleSpec.from_mapping({"name": "oases", "stored_blocks": [0, 3]}) == spec


# -- the plan ---------------------------------------------------------------------
def test_a_plan_carries_policies_through_its_file(tmp_path):
    plan = Plan((2, 2, 1), (2, 1, 1), devices=2, attn_policies=("store", "oases", "oases"),
                mlp_policies=["store", "store", "oases"])
    assert plan.block_policies() == ["store", "store", "oases", "store", "oases", "oases"]
    assert plan.stored_blocks() == (0, 1, 3)
    plan.to_json(tmp_path / "plan.json")
    assert Plan.from_json(tmp_path / "plan.json") == plan
    assert plan.as_table().splitlines() == ["layers 0: attn 2 store, mlp 2 store", "layers 1: attn 2 oases, mlp 1 store",
                                            "layers 2: attn 1 oases, mlp 1 oases"]
    assert Plan.from_block_degrees([2, 2, 2, 2], 2, ["oases"] * 4).attn_policies is None  # all oases: the old form
    assert Plan.from_block_degrees([2, 2, 2, 2], 2, ["store", "oases", "oases", "oases"]).stored_blocks() == (0,)


def test_a_plan_without_policies_recomputes_everything():
    plan = Plan((2, 2), (2, 2), devices=2)
    assert plan.stored_blocks() == ()
    assert plan.as_table() == "layers 0-1: attn 2, mlp 2"


@pytest.mark.parametrize("kwargs, message", [
    ({"attn_policies": ("store", "store")}, r"^Plan.attn_policies and Plan.mlp_policies come together; give both or neither$"),
    ({"attn_policies": ("store",), "mlp_policies": ("store",)}, r"^Plan.attn_policies must list one policy per layer \(2\)"),
    ({"attn_policies": ("store", "full"), "mlp_policies": ("oases", "oases")},
     r"^Plan.attn_policies\[1\]='full' unknown; choose one of oases, store, oases_gathered$"),
])
def test_a_plan_refuses_bad_policies_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Plan((2, 2), (2, 2), devices=2, **kwargs)


def test_the_engine_stores_the_plans_blocks_or_refuses_a_schedule_that_cannot(tmp_path):
    from oases_ds.config import OasesConfigError, parse_oases_section
    from oases_ds.engine import planned_schedule

    path = tmp_path / "plan.json"
    Plan((2, 2), (2, 2), devices=2, attn_policies=("store", "oases"), mlp_policies=("oases", "store")).to_json(path)
    oases = parse_oases_section({"enabled": True, "tensor_parallel_size": 2, "plan": str(path)})
    assert planned_schedule(oases) == ScheduleSpec("oases", stored_blocks=(0, 3))
    assert oases.schedule_spec().stored_blocks == ()  # the flat keys alone store nothing
    megatron = parse_oases_section({"enabled": True, "tensor_parallel_size": 2, "plan": str(path), "schedule": "megatron"})
    with pytest.raises(OasesConfigError, match=r"^oases.plan=.*plan.json stores 2 blocks' activations \(policy store\), "
                                               r"which only schedule=oases with fine_grained_recompute=true runs"):
        planned_schedule(megatron)
    # under sequence parallelism a plan's oases_gathered blocks keep their gathered input
    Plan((2, 2), (2, 2), devices=2, attn_policies=("oases", "oases_gathered"),
         mlp_policies=("oases_gathered", "oases")).to_json(path)
    assert planned_schedule(oases) == ScheduleSpec("oases", gathered_blocks=(1, 2))
    with pytest.raises(OasesConfigError, match=r"^oases.plan=.*plan.json keeps the gathered input of 2 blocks "
                                               r"\(policy oases_gathered\), which only schedule=oases"):
        planned_schedule(megatron)
    path.write_text("{")  # cut short after the config was checked: one line, the setting and the path once
    with pytest.raises(OasesConfigError, match=rf"^oases.plan={path}: not valid JSON \(") as err:
        planned_schedule(oases)
    assert str(err.value).count(str(path)) == 1
