"""Sequence parallelism (``oases.sequence_parallel``) on real gloo ranks.

Between blocks each TMP rank holds a ``1/t`` slice of the sequence; a block gathers it
before its first linear and reduce-scatters its output (:mod:`oases_ds.models.operator_model`).
Checked against the same unsharded single-process reference as ``test_parity`` (tolerance
1e-5 relative on every gathered gradient, DP-averaged, and on the loss; fp32, dropout on,
2 SGD steps, the second after an update):

* every schedule and the per-block policies (``oases`` re-gathers in its recomputation,
  ``oases_gathered`` keeps the gathered input, ``store``) x GPT / BERT / LLaMA with GQA
  x TMP 2 with DP 2, and the blocking, the Oases and a mixed-policy schedule at TMP 4 (where
  LLaMA's 2 k/v heads are replicated);
* pipeline stages (PP 2 x TMP 2, 1F1B: the stages send sequence slices);
* through DeepSpeed (``OasesEngine``, TMP 2 x DP 2, ZeRO 0 and 1, the DP reduction
  overlapped): the same parameters as without sequence parallelism after 3 steps, within
  1e-6 relative (summing the slice gradients of norms and biases wrong shows up as 1.6e-5),
  with guard mode on; bf16 trains;
* a checkpoint saved without it resumes with it, and back.
"""
import dataclasses
import math

import pytest

import dist_workers
import engine_workers as ew
import pipeline_workers
from oases_ds.launcher import launch
from oases_ds.models.operator_model import mlp_up_chunk_count, plan_ops
from oases_ds.schedule.checker import check
from oases_ds.schedule.generators import build_schedule

TOL = 1e-5
# GPT, BERT and LLaMA with grouped-query attention (2 k/v heads: sharded at TMP 2, replicated at TMP 4)
MODELS = {"gpt": dict(family="gpt"), "bert": dict(family="bert"), "llama_gqa": dict(family="llama", num_kv_heads=2)}
ALL_VARIANTS = [label for label, _ in dist_workers.VARIANTS] + ["oases-gathered-mixed", "oases-gathered-all",
                                                                "oases-hops", "oases-gathered-mixed-hops"]
LAYOUTS = {  # name: (tp, world, variants)
    "tp2_dp2": (2, 4, ALL_VARIANTS),
    "tp4": (4, 4, ["none", "megatron", "oases", "oases-gathered-mixed"]),  # the rest run at TMP 2 above
}
_cache: dict = {}


def results(layout: str) -> list[dict]:
    if layout not in _cache:
        tp, world, variants = LAYOUTS[layout]
        _cache[layout] = launch(dist_workers.parity_worker, world,
                                (tp, [], 2, 4, 0.05, None, variants, 0.1, MODELS, True), timeout_s=600)
    return _cache[layout]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_every_schedule_and_policy_matches_the_reference(layout, model):
    for rank, per_rank in enumerate(results(layout)):
        for variant in LAYOUTS[layout][2]:
            r = per_rank[(model, variant)]
            assert r["grad_err"] <= TOL, f"rank {rank} {variant}: worst gradient {r['worst_param']} rel err {r['grad_err']:.2e}"
            assert r["loss_err"] <= TOL, f"rank {rank} {variant}: loss rel err {r['loss_err']:.2e}"


@pytest.mark.distributed
def test_a_long_sequence_runs_the_up_projection_in_chunks_and_matches_the_reference():
    """A long sequence runs the MLP's up projection in chunks of 1024 tokens (``mlp_up_chunk_count``:
    four at seq 4096, two at 2048; the sweep above, at seq 8, runs it in the last chunk): the chunks
    and the down projection over them (``_ChunkedLinear``) against the same reference, TMP 2, LLaMA
    with GQA and GPT (biases), dropout 0 (the fused attention), 2 SGD steps; schedules that re-gather,
    keep the gathered input or store, and order hops by time."""
    long = {"llama_gqa_s4096": dict(family="llama", num_kv_heads=2, seq_len=4096),
            "gpt_s2048": dict(family="gpt", seq_len=2048)}
    assert [mlp_up_chunk_count(kw["seq_len"]) for kw in long.values()] == [4, 2]
    variants = ["oases-gathered-mixed", "oases-hops"]  # hops over re-gathering blocks; kept inputs and stores
    for rank, per_rank in enumerate(launch(dist_workers.parity_worker, 2, (2, [], 2, 2, 0.05, None, variants, 0.0,
                                                                           long, True), timeout_s=600)):
        for (model, variant), r in per_rank.items():
            assert r["grad_err"] <= TOL, f"rank {rank} {model} {variant}: {r['worst_param']} rel err {r['grad_err']:.2e}"
            assert r["loss_err"] <= TOL, f"rank {rank} {model} {variant}: loss rel err {r['loss_err']:.2e}"
        assert len(per_rank) == len(long) * len(variants)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("variant", ["oases-hops", "oases-gathered-mixed-hops"])
def test_the_hop_variants_run_another_order_than_the_time_blind_merge(model, variant):
    """The ``-hops`` variants above carry per-op times (a plan's ``hop_costs``): their parity means
    something only if those times move hops.  Shown on the sequence a TMP-2 rank of the sweep runs
    (``plan_ops``: the operator model's sequence without building its process groups)."""
    cfg = dist_workers.tiny_config(**MODELS[model])
    ops, _ = plan_ops(cfg.family, [2] * cfg.num_layers, [2] * cfg.num_layers, 2, sequence_parallel=True)
    spec = dist_workers.variant_spec(variant)
    timed = build_schedule(spec, ops)
    check(timed, ops)
    assert timed.instructions != build_schedule(dataclasses.replace(spec, hop_costs=None), ops).instructions


@pytest.mark.distributed
def test_pipeline_stages_send_sequence_slices_and_match_the_reference():
    schedules = ["none", "megatron", "megatron_selective", "split_overlap", "oases", "oases-gathered-mixed"]
    per_rank = launch(pipeline_workers.pipeline_parity_worker, 4,
                      (2, 2, ["gpt", "llama"], schedules, ["1f1b"], 2, 2, 2, 4, 0.05, None, None, True), timeout_s=600)
    for rank, res in enumerate(per_rank):
        for (family, schedule, _), r in res.items():
            assert r["grad_err"] <= TOL, f"rank {rank} {family}/{schedule}: {r['worst_param']} rel err {r['grad_err']:.2e}"
            assert r["loss_err"] <= TOL, f"rank {rank} {family}/{schedule}: loss rel err {r['loss_err']:.2e}"
            # 2 steps x 2 micro-batches, each one message out and one in, of [2 samples, 8 / 2 tokens, 32] fp32:
            # half what the same run moves without sequence parallelism (16384 bytes)
            assert r["p2p_bytes"] == 2 * 2 * 2 * (2 * 4 * 32 * 4), f"rank {rank}: {r['p2p_bytes']} bytes between stages"


@pytest.mark.distributed
def test_the_engine_trains_the_same_parameters_with_and_without_it():
    runs = [("llama", 2, 3, 2, 2, zero, "oases", False, "sgd", None, True, sp, sp) for zero in (0, 1) for sp in (False, True)]
    runs.append(("gpt", 2, 2, 2, 1, 0, "oases", True, "sgd", None, True, True, False))  # bf16
    out = launch(ew.oases_runs, 4, (runs,), timeout_s=600)
    for rank, per_rank in enumerate(out):
        for zero in (0, 1):
            plain, sp = per_rank[2 * zero], per_rank[2 * zero + 1]
            assert (plain["sequence_parallel"], sp["sequence_parallel"]) == (False, True)
            assert plain["dp_overlap"] and sp["dp_overlap"], "the overlapped DP reduction is the route under test"
            for step, (a, b) in enumerate(zip(sp["params"], plain["params"])):
                for name in b:
                    err = float((a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12))
                    assert err <= 1e-6, f"rank {rank} zero {zero} step {step}: {name} rel err {err:.2e}"
        bf16 = per_rank[4]
        assert bf16["sequence_parallel"] and all(math.isfinite(x) for x in bf16["losses"])


@pytest.mark.distributed
def test_a_checkpoint_resumes_with_and_without_it(tmp_path):
    out = launch(ew.sequence_parallel_resume_run, 2, (str(tmp_path),), timeout_s=600)[0]
    for saved_sp, (first, resumed) in out.items():
        assert resumed["global_steps"] == first["global_steps"] == 4
        for a, b in zip(resumed["losses"], first["losses"][2:]):
            assert abs(a - b) <= TOL * abs(b), f"saved with sequence_parallel={saved_sp}: resumed {a} vs {b}"
