"""The DeepSpeed engine with pipeline stages against a plain DeepSpeedEngine on the unsharded
reference (``engine_workers.reference_run``: 3 steps of one 8-sample batch, SGD with momentum,
gradient clipping 0.05 active).  Each stage's parameters after every step must match the
reference's to relative error <= 1e-5 (fp32), the loss every rank reports too, and the stages
together must hold every parameter.  So gradient accumulation over the pipelined micro-batches,
DeepSpeed's DP reduction and its clipping (norm summed over TMP x PP) are exact."""
import json

import pytest

import engine_workers as ew
import pipeline_workers as pw
from oases_ds.launcher import launch

TOL = 1e-5
STEPS = 3
pytestmark = pytest.mark.distributed
_refs: dict = {}


def reference(family: str) -> dict:
    if family not in _refs:
        _refs[family] = launch(ew.reference_run, 1, (family, STEPS, 8), timeout_s=300)[0]
    return _refs[family]


def assert_stages_match(per_rank: list[dict], ref: dict) -> None:
    held: set = set()
    for rank, out in enumerate(per_rank):
        assert out["engine"] == "OasesEngine" and out["global_steps"] == STEPS
        for step in range(STEPS):
            for name, got in out["params"][step].items():
                want = ref["params"][step][name]
                err = float((got - want).norm() / want.norm())
                assert err <= TOL, f"rank {rank} step {step} {name}: rel err {err:.2e}"
            assert out["losses"][step] == pytest.approx(ref["losses"][step], rel=TOL), f"rank {rank} step {step}"
        assert out["eval_loss"] == pytest.approx(ref["eval_loss"], rel=TOL), f"rank {rank}"
        held |= set(out["params"][0])
    assert held == set(ref["params"][0])


def test_engine_with_stages_matches_plain_deepspeed():  # PP 2 x TMP 2, 4 micro-batches
    per_rank = launch(pw.pipeline_engine_run, 4, ("gpt", 2, 2, STEPS, 2, 4, "oases", "1f1b"), timeout_s=600)
    assert_stages_match(per_rank, reference("gpt"))
    assert all(out["stats"]["pipeline_bytes"] > 0 for out in per_rank)


ZERO2_TOL = 1e-6  # ZeRO-2 against ZeRO-0 of the same launch: the same sums in another order


def test_zero2_with_stages_matches_zero0_and_plain_deepspeed():
    """PP 2 x DP 2, 2 micro-batches (gpipe, megatron schedule), ZeRO 0 then 2 in one launch:
    each stage's gradients partitioned over its DP group after the pipeline schedule."""
    runs = launch(pw.pipeline_engine_runs, 4, ([("llama", 1, 2, STEPS, 2, 2, "megatron", "gpipe", zero)
                                                 for zero in (0, 2)],), timeout_s=600)
    zero0, zero2 = ([rank[i] for rank in runs] for i in range(2))
    for per_rank in (zero0, zero2):
        assert_stages_match(per_rank, reference("llama"))
    assert [out["partition_gradients"] for out in zero0 + zero2] == [False] * 4 + [True] * 4
    for rank, (a, b) in enumerate(zip(zero0, zero2)):
        for step in range(STEPS):
            for name, want in a["params"][step].items():
                err = float((b["params"][step][name] - want).norm() / want.norm())
                assert err <= ZERO2_TOL, f"rank {rank} step {step} {name}: ZeRO-2 vs ZeRO-0 rel err {err:.2e}"


def test_checkpoint_resumes_with_stages_and_another_stage_count_needs_its_portable_state(tmp_path):
    first = launch(pw.pipeline_engine_run, 2, ("gpt", 1, 2, 4, 2, 2, "oases", "1f1b", 0, str(tmp_path)), timeout_s=300)
    resumed = launch(pw.pipeline_engine_run, 2, ("gpt", 1, 2, 2, 2, 2, "oases", "1f1b", 0, str(tmp_path), True),
                     timeout_s=300)
    for rank in range(2):
        assert resumed[rank]["global_steps"] == 6
        assert resumed[rank]["stage"] == first[rank]["stage"] == rank
    # the resumed run trains steps 4 and 5: bit-identical to a run that never stopped
    cont = launch(pw.pipeline_engine_run, 2, ("gpt", 1, 2, 6, 2, 2, "oases", "1f1b"), timeout_s=300)
    assert resumed[0]["losses"] == cont[0]["losses"][4:]
    # one stage reads the two stages' checkpoint through its portable state (tests/distributed/test_portable_checkpoint.py
    # compares such resumes with unbroken runs); without that state, it is one line
    assert launch(pw.load_refused, 2, (str(tmp_path), 1), timeout_s=300) == ["loaded", "loaded"]
    meta = tmp_path / "global_step4" / "oases_meta.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), portable=False)))
    refused = launch(pw.load_refused, 2, (str(tmp_path), 1), timeout_s=300)
    for msg in refused:
        assert "pipeline_layers (layers per stage)=[1, 1], this run has pipeline_layers (layers per stage)=[2]; it holds " \
               "no portable state" in msg
        assert "\n" not in msg


def test_a_world_that_does_not_divide_into_stages_is_one_line():
    """The split and schedule settings are checked without processes (tests/unit/test_pipeline.py);
    this one needs the world size."""
    for msg in launch(pw.pipeline_config_error, 2, ({"pipeline_stages": 2, "tensor_parallel_size": 2}, 2),
                      timeout_s=120):
        assert msg.startswith("pipeline_stages=2 x tensor_parallel_size=2 = 4 does not divide world size 2"), msg
        assert "\n" not in msg
