"""Resume across layouts: a checkpoint saved at TMP 2 x PP 2 loads at TMP 4, at TMP 1 x DP 2
with ZeRO-1, and under a mixed per-block plan, through its portable state.

Each resumed run is compared with an unbroken run at the new layout from step 0 on the
same data (every run trains the same global batch; ``portable_workers``).  Tolerances:
losses and weights within 1e-6 relative (per parameter, max |a - b| / max |b|, fp32); the
optimizer moments and the fp32 master after loading equal the saving run's bit for bit (the
conversion only narrows full values).  LLaMA, because GPT's key bias has a gradient that
is zero in exact arithmetic, which Adam turns into round-off-sized full updates.
"""
import os
import shutil

import pytest
import torch

import portable_workers as pw
from oases_ds.checkpoint import CheckpointError, CheckpointMeta, check_rank_files, read_latest
from oases_ds.launcher import launch
from oases_ds.planner.plan import Plan

pytestmark = pytest.mark.distributed  # every test here starts ranks, itself or through a fixture

SAVED_AT = dict(tp=2, pp=2, micro=4, gas=2)
STEPS = 3
REL = 1e-6


def merged(results: list[dict], key: str) -> dict:
    """One dict over the pipeline stages' ranks (each returns the parameters it holds)."""
    out: dict = {}
    for r in results:
        out.update(r[key])
    return out


def worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(got) == set(want)
    return max((float((got[n].float() - want[n].float()).abs().max() / want[n].float().abs().max()), n) for n in want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("portable") / "ckpt")
    results = launch(pw.run, 4, (SAVED_AT, directory, "save", STEPS), timeout_s=600)
    return directory, results


def _plan(tmp_path) -> str:
    path = tmp_path / "mixed.json"
    Plan((4, 2, 4, 2), (2, 4, 2, 4), devices=4).to_json(path)
    return str(path)


@pytest.mark.parametrize("name,ranks,layout", [
    ("tmp4", 4, dict(tp=4, micro=4, gas=2)),
    ("tmp1_dp2_zero1", 2, dict(tp=1, micro=4, gas=1, zero=1)),
    ("tmp4_mixed_plan", 4, dict(tp=4, micro=4, gas=2, plan="mixed")),
])
def test_a_checkpoint_resumes_under_another_layout_as_an_unbroken_run(saved, tmp_path, name, ranks, layout):
    directory, saving = saved
    if layout.get("plan"):
        layout = dict(layout, plan=_plan(tmp_path))
    both = launch(pw.runs, ranks, ([(layout, directory, "resume", STEPS), (layout, None, "fresh", 2 * STEPS)],),
                  timeout_s=600)
    resumed, unbroken = [rank[0] for rank in both], [rank[1] for rank in both]
    first = resumed[0]
    assert first["loaded_step"] == STEPS and first["global_steps"] == 2 * STEPS
    assert first["client"] == {"epoch": 3} and first["path"].endswith(os.path.join("global_step3", "portable"))
    assert first["loaded_lr"] == saving[0]["saved_lr"]
    before, after = merged(saving, "saved"), merged(resumed, "loaded")
    assert set(after) == set(before)
    unequal = [(n, k) for n in before for k in before[n] if not torch.equal(before[n][k], after[n][k])]
    assert not unequal, f"{name}: master / moments changed by resharding: {unequal[:4]}"
    losses = first["losses"]
    want = unbroken[0]["losses"][STEPS:]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want)) <= REL, (losses, want)
    worst, where = worst_relative(merged(resumed, "weights"), merged(unbroken, "weights"))
    assert worst <= REL, f"{name}: {where} differs by {worst:.2e} relative"


def test_bf16_master_and_moments_move_from_zero2_partitions_to_another_layout(tmp_path):
    """bf16, ZeRO-2 over DP 2 (flat fp32 partitions, gradients partitioned too) -> ZeRO 0 at TMP 2 (DeepSpeed's
    FP16_UnfusedOptimizer: fp32 copies per parameter): master and moments bit for bit, and
    each bf16 weight is its master rounded; training goes on."""
    directory = str(tmp_path / "ckpt")
    src = dict(tp=1, micro=4, gas=1, zero=2, bf16=True)
    dst = dict(tp=2, micro=4, gas=2, bf16=True)
    saving = launch(pw.run, 2, (src, directory, "save", 2), timeout_s=600)
    resumed = launch(pw.run, 2, (dst, directory, "resume", 1), timeout_s=600)
    assert saving[0]["optimizer"] == "DeepSpeedZeroOptimizer" and resumed[0]["optimizer"] == "FP16_UnfusedOptimizer"
    assert saving[0]["partition_gradients"]
    before, after = saving[0]["saved"], resumed[0]["loaded"]
    assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])
    loaded = resumed[0]["loaded_weights"]
    assert all(loaded[n].dtype == torch.bfloat16 and torch.equal(loaded[n], before[n]["master"].bfloat16()) for n in before)
    assert resumed[0]["global_steps"] == 3 and all(map(torch.isfinite, map(torch.tensor, resumed[0]["losses"])))


def test_another_layout_without_portable_state_or_another_model_is_one_line(saved, tmp_path):
    directory, _ = saved
    tag_dir = os.path.join(directory, read_latest(directory))
    meta = CheckpointMeta.read(tag_dir)
    assert meta.portable
    run = CheckpointMeta.build(pw.model_config(), 4, None, "fp32", 0, 1)
    assert meta.load_route(tag_dir, run) == "portable"
    assert meta.load_route(tag_dir, CheckpointMeta.build(pw.model_config(), 2, None, "fp32", 0, 1, [2, 2])) == "native"
    from dataclasses import replace

    with pytest.raises(CheckpointError) as err:
        replace(meta, portable=False).load_route(tag_dir, run)
    assert str(err.value) == (f"checkpoint {tag_dir} was saved with tensor_parallel_size=2, pipeline_layers (layers per "
                              "stage)=[2, 2], this run has tensor_parallel_size=4, pipeline_layers (layers per stage)=[4]; "
                              "it holds no portable state (saved with oases.portable_checkpoint=false, or by an older "
                              "oases_ds), so only its own layout loads it")
    other = CheckpointMeta.build(pw.tiny_config("llama", num_layers=4, hidden_size=64), 4, None, "fp32", 0, 1)
    with pytest.raises(CheckpointError, match=r"saved with model\.hidden_size=32, this run has model\.hidden_size=64$"):
        meta.load_route(tag_dir, other)


def test_a_damaged_portable_file_is_named_before_loading(saved, tmp_path):
    directory, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    tag = read_latest(str(copy))
    victim = copy / tag / "portable" / "layers.1.mlp.up.weight.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        check_rank_files(str(copy), tag, CheckpointMeta.read(str(copy / tag)), portable=True)
    assert str(err.value).startswith(f"checkpoint file {victim} is damaged (not a complete torch file")
    assert "full value and optimizer state of parameter layers.1.mlp.up.weight" in str(err.value)
    (copy / tag / "portable" / "index.json").unlink()
    with pytest.raises(CheckpointError, match="has no portable/index.json: its portable state was not saved"):
        check_rank_files(str(copy), tag, CheckpointMeta.read(str(copy / tag)), portable=True)


def test_another_optimizer_is_one_line_and_changes_nothing(saved):
    """AdamW's moments are not SGD's momentum: loading them into another optimizer is refused on
    every rank (before any parameter is written)."""
    directory, _ = saved
    lines = launch(pw.load_error, 4, (dict(tp=4, micro=4, gas=2, sgd=True), directory), timeout_s=300)
    assert lines == [lines[0]] * 4
    assert lines[0] == (f"checkpoint {os.path.join(directory, 'global_step3')} holds the state of an optimizer AdamW, this "
                        "run has SGD; configure the same optimizer, or load with load_optimizer_states=False")
