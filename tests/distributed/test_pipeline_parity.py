"""Pipeline stages against the unsharded single-process reference, on real gloo ranks.

PP 2 x TMP 2 (4 ranks) and PP 2 x TMP 1 x DP 2 (4 ranks); every registered TMP schedule (``none``,
``megatron``, ``megatron_selective``, ``split_overlap``, ``oases``) inside each stage; 1F1B and GPipe; GPT and LLaMA with dropout
on; 2 SGD steps of 4 accumulated micro-batches (the second after an update).  After every step each stage's
gradients (gathered over TMP, averaged over DP, divided by the micro-batch count as
DeepSpeed's accumulation does) must match the reference's, trained on the whole global
batch at once, to relative error <= 1e-5 (fp32; the norm floor for exactly-zero
gradients is ``dist_workers.rel_err``'s), and the loss every rank reports (the last
stage's, broadcast) to 1e-5 relative.  Between them the stages must cover every
parameter of the reference exactly once.
"""
import pytest

import pipeline_workers
from oases_ds.launcher import launch

FAMILIES = ["gpt", "llama"]
SCHEDULES = ["none", "megatron", "megatron_selective", "split_overlap", "oases"]  # every registered TMP schedule
PIPELINES = ["1f1b", "gpipe"]
LAYOUTS = {"pp2_tp2": (2, 2), "pp2_dp2": (1, 2)}  # name: (tp, pp), 4 ranks each
TOL = 1e-5
_cache: dict = {}


def results(layout: str) -> list[dict]:
    if layout not in _cache:
        tp, pp = LAYOUTS[layout]
        _cache[layout] = launch(pipeline_workers.pipeline_parity_worker, 4,
                                (tp, pp, FAMILIES, SCHEDULES, PIPELINES, 2, 4, 2), timeout_s=600)
    return _cache[layout]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_stages_match_the_unsharded_reference(layout, family, schedule, pipeline):
    per_rank = results(layout)
    covered: dict[int, set] = {}
    for rank, res in enumerate(per_rank):
        r = res[(family, schedule, pipeline)]
        assert r["grad_err"] <= TOL, f"rank {rank}: worst gradient {r['worst_param']} rel err {r['grad_err']:.2e}"
        assert r["loss_err"] <= TOL, f"rank {rank}: loss rel err {r['loss_err']:.2e}"
        assert r["p2p_bytes"] > 0, f"rank {rank}: no point-to-point traffic"
        covered.setdefault(r["stage"], set()).update(r["params"])
    assert covered[0].isdisjoint(covered[1])
    assert covered[0] | covered[1] == set(per_rank[0][(family, schedule, pipeline)]["all_params"])


@pytest.mark.distributed
def test_a_heterogeneous_plan_cut_into_stages_matches_the_reference():
    """PP 2 x TMP 2 with per-block degrees that change at the stage boundary (layer 1's MLP at
    degree 1 sends replica shares of the batch; layer 2's attention receives them) and an
    uneven explicit split [1, 3]: the same tolerance, also with per-block policies (attn0 and mlp1
    stored: one stored block in each stage; and every block stored)."""
    plan = ((2, 1, 2, 1), (1, 1, 2, 2))
    per_rank = launch(pipeline_workers.pipeline_parity_worker, 4,
                      (2, 2, ["gpt"], ["oases", "none", "oases-store-mixed", "oases-store-all"], ["1f1b"], 2, 2, 4, 4,
                       0.05, [1, 3], plan), timeout_s=600)
    for rank, res in enumerate(per_rank):
        for key, r in res.items():
            assert r["grad_err"] <= TOL, f"rank {rank} {key}: worst gradient {r['worst_param']} rel err {r['grad_err']:.2e}"
            assert r["loss_err"] <= TOL, f"rank {rank} {key}: loss rel err {r['loss_err']:.2e}"


OVERLAP_SCHEDULES = ["oases", "oases-no-fine-grained", "oases-store-mixed", "oases-store-all", "oases-k4"]


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_overlapped_micro_batches_match_the_unsharded_reference(sequence_parallel):
    """``overlap_micro_batches``: one stage runs a step's 4 micro-batches as one merge, each forward under
    the previous micro-batch's backward (two micro-batches in flight).  TMP 2 x DP 2, GPT and LLaMA with
    dropout, the oases schedule with and without fine-grained recomputation, with stored blocks and
    4 sub-batches, and under sequence parallelism: the same tolerance as above (gradients divided by
    the micro-batch count, 2 SGD steps), so the order changes nothing but time."""
    schedules = OVERLAP_SCHEDULES if not sequence_parallel else ["oases", "oases-gathered-mixed"]
    per_rank = launch(pipeline_workers.pipeline_parity_worker, 4,
                      (2, 1, FAMILIES, schedules, ["overlap"], 2, 4, 4, 2, 0.05, None, None, sequence_parallel),
                      timeout_s=600)
    for rank, res in enumerate(per_rank):
        assert len(res) == len(FAMILIES) * len(schedules)
        for (family, schedule, _), r in res.items():
            assert r["grad_err"] <= TOL, f"rank {rank} {family}/{schedule}: worst gradient {r['worst_param']} rel err {r['grad_err']:.2e}"
            assert r["loss_err"] <= TOL, f"rank {rank} {family}/{schedule}: loss rel err {r['loss_err']:.2e}"
            assert r["params"] == r["all_params"]  # one stage holds every parameter
