"""Heterogeneous TMP at run time: each block at its own degree, against the reference.

A block at degree t < T runs T/t replicas on shares of the batch; reshard
operators move activations between degrees; replica gradients are summed.
Tolerance as in test_parity: fp32 relative error <= 1e-5 per gathered gradient,
every step of 3 SGD steps, dropout on.
"""
import pytest

import dist_workers
import engine_workers as ew
from oases_ds.launcher import launch
from oases_ds.parallel.topology import Topology

TOL = 1e-5
FAMILIES = ["gpt", "bert", "llama"]
# name: (tp, world, micro_batch, (attn degrees, mlp degrees), variants)
PLANS = {
    "tp2_half_at_1": (2, 2, 4, ((2, 1), (1, 2)), None),  # every parity variant, per-block policies included
    "tp4_mixed_4_2_1": (4, 4, 8, ((4, 1), (2, 4)), ["megatron", "split_overlap", "oases", "oases-no-fine-grained",
                                                     "oases-store-mixed", "oases-store-all",
                                                     "oases-store-mixed-no-cross-pass"]),
}
_cache: dict = {}


def results(name):
    if name not in _cache:
        tp, world, micro, plan, variants = PLANS[name]
        _cache[name] = launch(dist_workers.parity_worker, world, (tp, FAMILIES, 3, micro, 0.05, plan, variants), timeout_s=600)
    return _cache[name]


def test_reshard_groups_pair_ranks_at_the_same_offset():
    topo = Topology(world_size=8, tp_size=4)
    assert topo.reshard_group_ranks(2, 4) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.reshard_group_ranks(1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.reshard_group_ranks(1, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.distributed
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", FAMILIES)
def test_heterogeneous_plan_matches_reference(plan, family):
    per_rank = results(plan)
    for rank, res in enumerate(per_rank):
        runs = {k: v for k, v in res.items() if k[0] == family}
        assert runs, "no variant ran"
        for (fam, variant), r in runs.items():
            assert r["grad_err"] <= TOL, f"rank {rank} {variant}: {r['worst_param']} rel err {r['grad_err']:.2e}"
            assert r["loss_err"] <= TOL, f"rank {rank} {variant}: loss rel err {r['loss_err']:.2e}"


@pytest.fixture(scope="module")
def plain_reference():
    """Plain DeepSpeed on the unsharded GPT, 3 steps of 8: the same run for every plan below."""
    return launch(ew.reference_run, 1, ("gpt", 3, 8), timeout_s=300)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("tp, attn, mlp, policies", [
    (2, (2, 1), (1, 2), None),
    (4, (4, 2), (2, 4), None),
    (2, (2, 1), (1, 2), (("store", "oases"), ("oases", "store"))),  # a plan storing attn0 and mlp1 (oases-plan recompute=auto)
])
def test_engine_with_a_plan_file_matches_plain_deepspeed(tmp_path, plain_reference, tp, attn, mlp, policies):
    """Also checks DeepSpeed's gradient clipping (active at 0.05) counts each shard of a
    replicated block once -- including the unsharded biases of a block at a middle
    degree (TMP 4, degree 2), which replica 0's two ranks both hold.  A plan with
    recomputation policies runs them: the engine's schedule stores exactly its blocks."""
    from oases_ds.planner.plan import Plan

    path = tmp_path / "plan.json"
    given = {} if policies is None else {"attn_policies": policies[0], "mlp_policies": policies[1]}
    Plan(attn, mlp, devices=tp, **given).to_json(path)
    ref = plain_reference
    out = launch(ew.oases_run, tp, ("gpt", tp, 3, 8, 1, 0, "oases", False, "sgd", str(path)), timeout_s=300)[0]
    assert tuple(out["stored_blocks"]) == Plan.from_json(path).stored_blocks() == ((0, 3) if policies else ())
    for step in range(3):
        for name, want in ref["params"][step].items():
            err = float((out["params"][step][name] - want).norm() / want.norm())
            assert err <= TOL, f"step {step} {name}: {err:.2e}"


def test_plan_for_wrong_layout_is_a_clear_error(tmp_path):
    from oases_ds.config import OasesConfigError, parse_oases_section

    with pytest.raises(OasesConfigError, match=r"^oases.plan: Value error, plan file '.*missing.json' not found; write one with oases-plan"):
        parse_oases_section({"enabled": True, "plan": str(tmp_path / "missing.json")})


def test_sub_batch_must_split_among_replicas():
    import torch

    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.parallel.context import BlockLayout
    from oases_ds.runtime.executor import Executor
    from oases_ds.schedule.generators import ScheduleSpec

    cfg = ModelConfig(hidden_size=16, num_heads=2, num_layers=1, seq_len=4, vocab_size=16)
    # A degree-1 block with 4 replicas (a layout as a TMP-4 plan would give it).
    model = OperatorModel(cfg, None, 0, [(BlockLayout(1, None, 0, 4), BlockLayout(1, None, 0, 4))], lambda a, b: None)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    batch = {"tokens": torch.zeros(4, 4, dtype=torch.long), "labels": torch.zeros(4, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="use a micro-batch size divisible by sub_batches x 4 = 8"):
        ex.run(batch)
