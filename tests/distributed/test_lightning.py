"""Trainer(strategy="oases") end to end: 2 CPU processes (gloo), TMP=2, tiny GPT.

One pair of rank processes runs every Trainer (see
``lightning_workers.lightning_runs``) and the same steps straight through
``oases_ds.initialize`` + ``engine.train_batch``; the tests below check parts of
that one result.  Parameters are gathered over the TMP shards and compared per
parameter, fp32, relative error <= 1e-5 (the Trainer drives the very same
engine, so they agree to round-off; the accumulation run differs from the
one-batch run by summation order only).
"""
import json

import pytest
import torch

import lightning_workers as lw
from oases_ds.launcher import launch

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("lightning")
    config = work / "ds_config.json"
    config.write_text(json.dumps({"oases": {"seed": lw.SEED}}))  # TMP degree: by default the 2 devices
    return launch(lw.lightning_runs, 2, (str(work),), timeout_s=300,
                  env={"PL_DEEPSPEED_CONFIG_PATH": str(config)}, threads_per_rank=1)[0]


def assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = float((got[name] - ref).norm() / ref.norm())
        assert err <= TOL, f"{name}: rel err {err:.2e}"


def test_trainer_matches_the_engine_driven_directly(runs):
    trainer, direct = runs["trainer"], runs["direct"]
    assert_params_close(trainer["params"], direct["params"][-1])
    assert trainer["losses"] == pytest.approx(direct["losses"], rel=TOL)
    assert trainer["global_step"] == trainer["engine_steps"] == 4  # one Lightning step per engine step
    assert trainer["sampler"] == {"num_replicas": 1, "rank": 0}  # 2 ranks, TMP=2: one DP rank, not two
    assert trainer["logged"]["tmp_bytes"] > 0  # strategy="oases", devices=2 shards the model (TMP 1 would send none)


def test_a_plan_with_store_policies_trains_the_same_trajectory(runs):
    """Trainer(strategy=OasesStrategy(plan=...)) with attn0 and mlp1 stored: the engine's schedule
    stores exactly those blocks, and storing instead of recomputing changes no number."""
    planned, trainer = runs["planned"], runs["trainer"]
    assert planned["stored_blocks"] == (0, 3) and trainer["stored_blocks"] == ()
    assert planned["losses"] == pytest.approx(trainer["losses"], rel=TOL)
    assert_params_close(planned["params"], trainer["params"])


def test_sequence_parallelism_trains_the_same_trajectory(runs):
    """OasesStrategy(sequence_parallel=True): the engine splits the sequence between blocks, and
    the losses and parameters are those of the run without it (the tolerance above)."""
    sp, trainer = runs["sequence_parallel"], runs["trainer"]
    assert sp["sequence_parallel"] and not trainer["sequence_parallel"]
    assert sp["losses"] == pytest.approx(trainer["losses"], rel=TOL)
    assert_params_close(sp["params"], trainer["params"])


def test_validation_runs_through_eval_batch(runs):
    assert len(runs["trainer"]["val_losses"]) == lw.EPOCHS
    assert runs["trainer"]["val_losses"] == pytest.approx(runs["direct"]["val_losses"], rel=TOL)


def test_resume_from_a_lightning_checkpoint_continues_the_same_trajectory(runs):
    trainer, resumed = runs["trainer"], runs["resumed"]
    assert runs["listing"] == ["checkpoint", "latest"]  # DeepSpeed directory checkpoint, published atomically
    assert resumed["steps"] == [3, 4] and resumed["global_step"] == resumed["engine_steps"] == 4
    assert resumed["losses"] == trainer["losses"][2:]  # bit-identical: model shards, optimizer, step restored
    for name, ref in trainer["params"].items():
        assert torch.equal(resumed["params"][name], ref), name


def test_a_lightning_checkpoint_resumes_under_another_layout(runs):
    """Saved at TMP 2, resumed at TMP 1 x DP 2: the Trainer starts from the very weights the
    TMP-2 resume starts from (bit for bit) and goes on from step 2.  (The trajectories are not
    compared: Lightning's sampler puts the samples at other offsets under DP 2, so dropout
    differs; tests/distributed/test_portable_checkpoint.py compares trajectories.)"""
    same, other = runs["resumed"], runs["resumed_tmp1"]
    assert other["sampler"] == {"num_replicas": 2, "rank": 0}  # 2 devices at TMP 1: DP 2
    assert other["logged"]["tmp_bytes"] == 0  # was the DP gradient reduction's 119296 bytes, counted as TMP
    assert other["start_params"].keys() == same["start_params"].keys()
    for name, ref in same["start_params"].items():
        assert torch.equal(other["start_params"][name], ref), name
    assert other["steps"] == [3, 4] and other["global_step"] == other["engine_steps"] == 4
    assert all(loss == loss and loss < 10 for loss in other["losses"])


def test_accumulate_grad_batches_maps_to_gradient_accumulation_steps(runs):
    acc, direct = runs["accumulate"], runs["direct"]
    assert (acc["gas"], acc["micro"]) == (2, lw.MICRO // 2)
    assert acc["global_step"] == acc["engine_steps"] == 2  # 4 Lightning batches, 2 optimizer steps
    assert acc["losses"] == pytest.approx(direct["losses"][:2], rel=TOL)
    assert_params_close(acc["params"], direct["params"][1])


def test_overlapped_micro_batches_train_the_accumulated_trajectory(runs):
    """OasesStrategy(overlap_micro_batches=True) with accumulate_grad_batches=2: the two micro-batches of a
    step run as one merge, and the trajectory is the direct engine's (the tolerance above)."""
    ovl, direct = runs["accumulate_overlapped"], runs["direct"]
    assert ovl["pipeline_order"] == "overlap" and runs["accumulate"]["pipeline_order"] is None
    assert (ovl["gas"], ovl["global_step"], ovl["engine_steps"]) == (2, 2, 2)
    assert ovl["losses"] == pytest.approx(direct["losses"][:2], rel=TOL)
    assert_params_close(ovl["params"], direct["params"][1])


def test_progress_bar_and_logs_show_throughput_and_tmp_bytes(runs):
    out = runs["trainer"]
    assert {"tokens_per_s", "tmp_bytes", "train_loss", "val_loss"} <= set(out["prog_bar"])
    assert out["logged"]["tokens_per_s"] > 0 and out["logged"]["tmp_bytes"] > 0
    assert 0 <= out["logged"]["exposed_comm_frac"] <= 1


def test_devices_not_divisible_by_tmp_degree_is_one_clear_line(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    import lightning_strategy  # noqa: F401  (registers "oases")

    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"oases": {"tensor_parallel_size": 2}}))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(config))
    with pytest.raises(MisconfigurationException) as err:  # at construction: no process is launched
        pl.Trainer(strategy="oases", accelerator="cpu", devices=3, logger=False)
    assert str(err.value).startswith("tensor_parallel_size=2 does not divide world size 3")
    assert "\n" not in str(err.value)


def test_a_module_outside_the_protocol_is_one_clear_line():
    msg = launch(lw.protocol_error_run, 2, timeout_s=120, threads_per_rank=1)[0]
    assert msg.startswith('MisconfigurationException: strategy="oases" trains an OasesLightningModule'), msg
    assert msg.endswith("got Plain") and "\n" not in msg


def test_a_nan_loss_stops_the_trainer_naming_the_step(runs):
    assert runs["nan"].startswith("NonFiniteLossError: loss is nan at optimizer step 2 (1-based"), runs["nan"]
    assert "\n" not in runs["nan"]


def test_strategy_by_name_takes_its_tmp_degree_from_the_devices(monkeypatch):
    """Trainer(strategy="oases", devices=2) used to train plain data parallel (TMP 1, tmp_bytes 0)."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    import lightning_strategy  # noqa: F401  (registers "oases")
    from lightning_strategy import OasesStrategy

    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH", raising=False)
    by_name = pl.Trainer(strategy="oases", accelerator="cpu", devices=2, logger=False).strategy
    assert by_name.oases.tensor_parallel_size == by_name.config["oases"]["tensor_parallel_size"] == 2
    explicit = pl.Trainer(strategy=OasesStrategy(tensor_parallel_size=1), accelerator="cpu", devices=2, logger=False).strategy
    assert explicit.oases.tensor_parallel_size == explicit.config["oases"]["tensor_parallel_size"] == 1
    # a default degree the model cannot be sharded by: one line when fit connects the module
    three = pl.Trainer(strategy="oases", accelerator="cpu", devices=3, logger=False).strategy
    with pytest.raises(MisconfigurationException) as err:
        three.connect(lw._module_class()())  # tiny GPT: 4 heads
    assert str(err.value) == ("tensor_parallel_size=3 does not divide model.num_heads=4; pick a TMP degree that divides "
                              "it or change model.num_heads (strategy=\"oases\" takes its TMP degree from devices=3; pass "
                              "strategy=OasesStrategy(tensor_parallel_size=...) to choose another)")
