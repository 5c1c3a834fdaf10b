"""Pipeline-stage planning (oases_ds/planner/stages.py) is exact: equal to enumerating every
split and every block degree of every stage jointly, on seeded random tables with the
memory limit free and binding; the 1F1B formula, the in-flight memory and the ends of the
model move layers the way they must; plans with stages round-trip through JSON and plans
without them still load."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
from omegaconf import OmegaConf

from oases_ds.cli.plan import PlanSchema, run
from oases_ds.models.blocks import end_parameter_counts
from oases_ds.models.config import ModelConfig
from oases_ds.planner.costs import STATE_BYTES_PER_PARAM, CostTable
from oases_ds.planner.memory import memory_rows
from oases_ds.planner.objective import fits_memory, sequence_step_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError
from oases_ds.planner.stages import (PipelineSpec, brute_force_stages, even_split, p2p_ms, pipeline_step_ms,
                                     plan_split, plan_stages, stage_memory_bytes, stage_step_ms, stage_table)
from oases_ds.schedule.generators import ScheduleSpec
from support import REL_TOL, random_table


def with_degrees(table: CostTable, degrees: tuple[int, ...]) -> CostTable:
    blocks = {kind: {t: by_degree[t] for t in degrees} for kind, by_degree in table.blocks.items()}
    return dataclasses.replace(table, degrees=degrees, blocks=blocks)


def staged_table(seed: int, layers: int, degrees: tuple[int, ...]) -> CostTable:
    """A random table with a random constant per stage role (first/last above middle)."""
    rng = random.Random(1000 + seed)
    middle = rng.uniform(1e8, 1e9)
    roles = {"middle": middle, "first": middle + rng.uniform(1e8, 2e9), "last": middle + rng.uniform(1e8, 3e9)}
    roles["only"] = roles["first"] + roles["last"] - middle
    return dataclasses.replace(with_degrees(random_table(seed, layers), degrees), fixed_bytes=roles["only"],
                               stage_fixed_bytes=roles)


def random_pipeline(seed: int, stages: int) -> PipelineSpec:
    rng = random.Random(2000 + seed)
    return PipelineSpec(stages, rng.choice([1, 2, 3, 8]), p2p_ms=rng.uniform(0, 5), embed_ms=rng.uniform(0, 5),
                        head_ms=rng.uniform(0, 30))


def lean_limit(table: CostTable, pipeline: PipelineSpec) -> float:
    """The least limit any split fits: memory has no edge terms, so a stage's leanest
    degrees are each block's leanest, and a split needs its fattest stage's."""
    leanest = {}
    for stage in range(pipeline.stages):
        for n in range(1, table.layers + 1):
            seq = [min(table.degrees, key=lambda t: table.blocks[kind][t].act_bytes * pipeline.in_flight(stage)
                       + table.blocks[kind][t].state_bytes) for kind in table.block_kinds()[: 2 * n]]
            leanest[stage, n] = stage_memory_bytes(table, pipeline, stage, seq)
    splits = [[b - a for a, b in zip((0, *cuts), (*cuts, table.layers))]
              for cuts in itertools.combinations(range(1, table.layers), pipeline.stages - 1)]
    return min(max(leanest[s, n] for s, n in enumerate(split)) for split in splits)


CASES = [(seed, 3 + seed % 2, 2 + (seed % 3 == 2), (1, 2, 4) if seed % 2 else (2, 4)) for seed in range(12)]
"""(seed, layers, stages, degrees): 3-4 layers, 2-3 stages, 2 or 3 degrees; the oracle
enumerates at most 3 splits x 3^6 x 3^2 degree choices."""


@pytest.mark.parametrize("seed,layers,stages,degrees", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_plan_stages_equals_brute_force(seed: int, layers: int, stages: int, degrees: tuple[int, ...]) -> None:
    table, pipeline = staged_table(seed, layers, degrees), random_pipeline(seed, stages)
    free = brute_force_stages(table, pipeline, None)
    lean, top = lean_limit(table, pipeline), max(s.memory_bytes for s in free.stages)
    for limit in [None, lean, lean + 0.3 * (top - lean), (lean + top) / 2]:
        found, oracle = plan_stages(table, pipeline, limit), brute_force_stages(table, pipeline, limit)
        assert found.step_ms == pytest.approx(oracle.step_ms, rel=REL_TOL)
        # the returned split and degrees achieve it, recomputed from the one definition, and fit
        recomputed = [stage_step_ms(table, pipeline, s.index, s.plan.block_degrees()) for s in found.stages]
        assert pipeline_step_ms(recomputed, pipeline.micro_batches) == pytest.approx(oracle.step_ms, rel=REL_TOL)
        assert sum(found.layer_counts()) == layers and min(found.layer_counts()) >= 1
        for s in found.stages:
            assert fits_memory(stage_memory_bytes(table, pipeline, s.index, s.plan.block_degrees()), limit)


def test_most_cases_have_a_binding_limit() -> None:
    """Guard: the comparison above must mostly run with the memory limit changing the answer."""
    binds = 0
    for seed, layers, stages, degrees in CASES:
        table, pipeline = staged_table(seed, layers, degrees), random_pipeline(seed, stages)
        free = brute_force_stages(table, pipeline, None)
        lean, top = lean_limit(table, pipeline), max(s.memory_bytes for s in free.stages)
        binds += brute_force_stages(table, pipeline, lean + 0.3 * (top - lean)).step_ms > free.step_ms * (1 + 1e-9)
    assert binds >= 8


def uniform_table(layers: int) -> CostTable:
    """One degree (4 of 4): each layer costs the same, so splits are checked by hand."""
    return dataclasses.replace(with_degrees(random_table(7, layers), (4,)), fixed_bytes=0.0, stage_fixed_bytes={})


def test_equal_stages_give_megatrons_formula() -> None:
    """Equal stages: T = (m + P - 1) t (Megatron, SC'21), the split even."""
    table = uniform_table(8)
    for stages, micro_batches in [(2, 1), (2, 8), (4, 4), (8, 3)]:
        pipeline = PipelineSpec(stages, micro_batches)
        plan = plan_stages(table, pipeline, None)
        assert plan.layer_counts() == [8 // stages] * stages
        t = sequence_step_ms(stage_table(table, pipeline, 0, 8 // stages), [4] * (2 * 8 // stages))
        assert plan.step_ms == pytest.approx((micro_batches + stages - 1) * t, rel=REL_TOL)


def test_gradient_sync_is_charged_once_per_step() -> None:
    """m micro-batches of one stage pay m x compute but one gradient all-reduce."""
    table = dataclasses.replace(uniform_table(1), layers=1)
    no_sync = dataclasses.replace(table, blocks={kind: {t: dataclasses.replace(c, grad_sync_ms=0.0) for t, c in by.items()}
                                                 for kind, by in table.blocks.items()})
    syncs = table.blocks["attn"][4].grad_sync_ms + table.blocks["mlp"][4].grad_sync_ms
    assert syncs > 0
    for m in (1, 5):
        pipeline = PipelineSpec(1, m)
        difference = m * (stage_step_ms(table, pipeline, 0, [4, 4]) - stage_step_ms(no_sync, pipeline, 0, [4, 4]))
        assert difference == pytest.approx(syncs, rel=1e-9)


def test_the_head_moves_layers_off_the_last_stage() -> None:
    """A head costing two layers: 8 layers over 2 stages balance as 5 + (3 + head)."""
    table = uniform_table(8)
    layer = sequence_step_ms(stage_table(table, PipelineSpec(2, 4), 0, 1), [4, 4])
    pipeline = PipelineSpec(2, 4, head_ms=2 * layer)
    plan = plan_stages(table, pipeline, None)
    assert plan.layer_counts() == [5, 3]
    assert plan.step_ms == pytest.approx(brute_force_stages(table, pipeline, None).step_ms, rel=REL_TOL)
    assert plan.step_ms < plan_split(table, pipeline, None, even_split(8, 2)).step_ms


def test_in_flight_micro_batches_move_layers_to_later_stages() -> None:
    """1F1B's stage s holds P - s micro-batches: under a limit the first stage gets the fewest
    layers, the even split does not fit, and the error names the stage that does not."""
    table = uniform_table(8)
    table = dataclasses.replace(table, blocks={kind: {4: dataclasses.replace(by[4], state_bytes=1e9, act_bytes=1e9)}
                                               for kind, by in table.blocks.items()})
    pipeline = PipelineSpec(4, 8)
    # a layer: 2e9 states + 2e9 x (in flight: 4, 3, 2, 1) -> 10e9, 8e9, 6e9, 4e9 on stages 0-3;
    # under 16e9 stages hold at most 1, 2, 2, 4 layers: the balanced split of 8 is 1, 2, 2, 3
    plan = plan_stages(table, pipeline, 16e9)
    assert plan.layer_counts() == [1, 2, 2, 3]
    assert [s.memory_bytes for s in plan.stages] == pytest.approx([10e9, 16e9, 12e9, 12e9])
    assert plan.step_ms == pytest.approx(brute_force_stages(table, pipeline, 16e9).step_ms, rel=REL_TOL)
    with pytest.raises(PlanInfeasibleError, match=r"^stage 0 \(2 layers, 4 micro-batches in flight\): no plan fits"):
        plan_split(table, pipeline, 16e9, even_split(8, 4))
    with pytest.raises(PlanInfeasibleError, match=r"stage 0 cannot hold even one layer with 4 micro-batches in flight"):
        plan_stages(table, pipeline, 5e9)
    with pytest.raises(PlanInfeasibleError, match=r"the stages hold at most \[1, 1, 1, 2\] layers: 5 of 8\)"):
        plan_stages(table, pipeline, 10e9)


def test_bad_pipelines_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"^PipelineSpec.micro_batches must be an int >= 1, got 0$"):
        PipelineSpec(2, 0)
    with pytest.raises(ValueError, match=r"^PipelineSpec.p2p_ms must be a finite number >= 0, got -1"):
        PipelineSpec(2, 2, p2p_ms=-1.0)
    with pytest.raises(ValueError, match=r"^pipeline_stages=5 exceeds the 4 layers to plan; use at most 4 stages"):
        plan_stages(uniform_table(4), PipelineSpec(5, 8), None)


def test_a_staged_plan_round_trips_and_old_plans_load(tmp_path) -> None:
    table = uniform_table(4)
    plan = plan_stages(table, PipelineSpec(2, 4), None).to_plan(table)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    loaded = Plan.from_json(path)
    assert loaded == plan and loaded.stage_layers == (2, 2) and loaded.stages == 2 and loaded.micro_batches == 4
    old = {k: v for k, v in json.loads(path.read_text()).items()
           if k not in ("stage_layers", "stage_step_ms", "stage_memory_bytes", "micro_batches")}
    path.write_text(json.dumps(old))
    assert Plan.from_json(path).stages == 1
    path.write_text(json.dumps({**old, "stage_layers": [1, 2]}))
    with pytest.raises(ValueError, match=r"plan.json: Plan.stage_layers \[1, 2\] sum to 3; the plan has 4 layers$"):
        Plan.from_json(path)


def test_stage_constants_split_the_ends_of_the_model() -> None:
    """The memory model's per-role constant: a middle stage holds neither the embedding's nor the
    head's states and activations (logits included); one stage holds what the table's constant says."""
    cfg = ModelConfig(family="gpt", vocab_size=4096, hidden_size=64, num_heads=4, num_layers=2, seq_len=32,
                      tie_embeddings=True)  # a vocabulary large enough for the logits to be the last stage's peak
    rows = memory_rows(cfg, ScheduleSpec("oases"), 2, 4, (1, 2), 4)
    fixed = rows.stage_fixed_bytes
    ends = end_parameter_counts(cfg, 2)
    assert fixed["only"] == rows.fixed_bytes
    assert fixed["middle"] < min(fixed["first"], fixed["last"]) <= max(fixed["first"], fixed["last"]) < fixed["only"]
    assert fixed["first"] - fixed["middle"] >= ends["embed"] * STATE_BYTES_PER_PARAM
    # the last stage keeps its own copy of the tied word embedding, and the logits: V/t fp32 for each of
    # a sub-batch's 4 / 2 x 32 tokens
    assert ends["head"] >= 4096 * 64 / 2
    logits = 4 / 2 * 32 * 4096 / 2 * 4
    assert fixed["last"] - ends["head"] * STATE_BYTES_PER_PARAM >= logits > fixed["middle"]


def test_oases_plan_prints_and_writes_the_stage_split(tmp_path, capsys) -> None:
    table = dataclasses.replace(staged_table(3, 6, (1, 2, 4)))
    table.to_json(tmp_path / "table.json")
    cfg = OmegaConf.to_container(OmegaConf.structured(PlanSchema))
    cfg.update(table=str(tmp_path / "table.json"), pipeline_stages=3, micro_batches=6, out=str(tmp_path / "plan.json"))
    run(cfg)
    out = capsys.readouterr().out
    plan = Plan.from_json(tmp_path / "plan.json")
    expected = plan_stages(table, PipelineSpec(3, 6, p2p_ms=p2p_ms(table)), None)
    assert list(plan.stage_layers) == expected.layer_counts()
    assert plan.predicted_step_ms == pytest.approx(expected.step_ms, rel=REL_TOL)
    assert "stage 0: layers 0-" in out and "+ embedding" in out and "+ head/loss" in out and "predicted 1F1B step" in out
    assert "even split [2, 2, 2]" in out


def test_min_degree_leaves_low_degrees_out_of_the_table() -> None:
    """Small micro-batches (what 1F1B wants) have no whole share for a degree-1 block's replicas:
    ``planner.min_degree`` profiles from there up, and names itself in the cache key."""
    from oases_ds.planner.analytic import DeviceModel, analytic_table
    from oases_ds.planner.profile import ProfileSpec
    from oases_ds.parallel.link import LinkModel

    cfg = ModelConfig(family="gpt", vocab_size=512, hidden_size=64, num_heads=8, num_layers=2, seq_len=32)
    with pytest.raises(ValueError, match=r"use a multiple of 16 or raise planner.min_degree"):
        ProfileSpec(cfg, 8, 4)
    spec = ProfileSpec(cfg, 8, 4, link=LinkModel(10.0, 10.0), min_degree=4)
    table = analytic_table(spec, DeviceModel("d", 10.0), 2)
    assert spec.degrees() == table.degrees == (4, 8)
    assert "-tmin4|" in spec.key() and "-tmin4|" in table.key()
    with pytest.raises(ValueError, match=r"^planner.min_degree must be a power of two <= devices=8, got 3$"):
        ProfileSpec(cfg, 8, 16, min_degree=3)


@pytest.mark.parametrize("overrides, says", [
    ({"pipeline_stages": 0}, "pipeline_stages must be >= 1, got 0"),
    ({"micro_batches": 0}, "micro_batches must be >= 1, got 0; leave it null for 4 x pipeline_stages"),
    ({"pipeline_link_gbps": 0.0}, "pipeline_link_gbps must be > 0, got 0.0; leave it null for the cluster's link"),
    ({"pipeline_stages": 2, "mode": "accuracy"}, "mode=accuracy measures plans of one TMP group; it takes pipeline_stages=1"),
    ({"pipeline_stages": 7}, "pipeline_stages=7 exceeds the 6 layers to plan; use at most 6 stages"),
])
def test_oases_plan_refuses_bad_pipeline_keys_in_one_line(tmp_path, overrides, says) -> None:
    staged_table(3, 6, (1, 2, 4)).to_json(tmp_path / "table.json")
    cfg = OmegaConf.to_container(OmegaConf.structured(PlanSchema))
    cfg.update(table=str(tmp_path / "table.json"), out=str(tmp_path / "plan.json"), **overrides)
    with pytest.raises(ValueError) as err:
        run(cfg)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)
    assert not (tmp_path / "plan.json").exists()
