"""The analytic cost table: hand-counted FLOPs and bytes, its trends in t and link, the paper presets,
the ILP on a paper-size table, and ``oases-plan cost=analytic`` as a user runs it.

No rank processes: the table is arithmetic; only the CLI tests start one ``oases-plan`` subprocess.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from omegaconf import OmegaConf

from oases_ds.models.config import ModelConfig
from oases_ds.parallel.link import LinkModel
from oases_ds.planner import analytic
from oases_ds.planner.analytic import DeviceModel, analytic_table, block_forward_flops
from oases_ds.planner.costs import BLOCK_KINDS, COST_MODEL_VERSION, CostTable
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.objective import predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.planner.profile import ProfileSpec
from oases_ds.planner.replay import simulate_profiled_layer
from oases_ds.schedule.generators import ScheduleSpec
from support import ROOT, plan_cli

SMALL = ModelConfig(family="gpt", vocab_size=256, hidden_size=64, num_heads=4, num_layers=2, seq_len=16)
ONE_TFLOPS = DeviceModel("test", peak_tflops=2.0, achieved_fraction=0.5)  # 1e12 FLOP/s sustained
PCIE = LinkModel(96.0, 10.0)
RTX3090 = DeviceModel("rtx3090", 71.0, 0.4)
PAPER_PRESETS = {"gpt_7_5b": 7.5e9, "gpt_18_4b": 18.4e9, "gpt_39_1b": 39.1e9, "bert_1_3b": 1.3e9, "llama_65b": 65.2e9}


def preset(name: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "configs", "model", f"{name}.yaml"))))


def table(model: ModelConfig = SMALL, devices: int = 4, micro_batch: int = 16, schedule: str = "oases",
          link: LinkModel = PCIE, device: DeviceModel = ONE_TFLOPS, layers: int = 2):
    spec = ProfileSpec(model=model, devices=devices, micro_batch=micro_batch, schedule=ScheduleSpec(schedule), link=link,
                       cluster="test")
    return analytic_table(spec, device, layers)


# -- compute ---------------------------------------------------------------------
def test_forward_flops_match_a_hand_count():
    H, s = 64, 16  # Megatron: 24 H^2 + 4 s H per token and layer, of which the MLP is 16 H^2
    assert block_forward_flops(SMALL, "attn", 1, tokens=1) == 2 * H * 3 * H + 2 * 2 * s * H + 2 * H * H == 36864
    assert block_forward_flops(SMALL, "mlp", 1, tokens=1) == 2 * 2 * H * 4 * H == 65536
    llama = dataclasses.replace(SMALL, family="llama", ffn_size=96)
    assert block_forward_flops(llama, "mlp", 1, tokens=1) == 3 * 2 * H * 96


def test_flops_of_a_fixed_batch_fall_as_one_over_t_but_a_device_always_does_one_share():
    tokens = 1000.0
    for kind in BLOCK_KINDS:
        one = block_forward_flops(SMALL, kind, 1, tokens)
        for t in (2, 4):
            assert block_forward_flops(SMALL, kind, t, tokens) == pytest.approx(one / t, rel=1e-12)
    # The T/t replicas split the micro-batch, so per device the forward is the same at every degree.
    costs = table(devices=4, micro_batch=16)
    tokens_per_device = 16 / 4 * 16
    for kind, flops in (("attn", 36864), ("mlp", 65536)):
        for t in costs.degrees:
            assert costs.blocks[kind][t].fwd_ms == pytest.approx(tokens_per_device * flops / 1e12 * 1e3, rel=1e-12)


@pytest.mark.parametrize("schedule, recompute", [
    ("oases", {"attn": 1.0, "mlp": 1.0}),          # every product is recomputed
    ("megatron", {"attn": 1.0, "mlp": 1.0}),
    ("none", {"attn": 0.0, "mlp": 0.0}),
    ("megatron_selective", {"attn": 4 * 16 * 64 / 36864, "mlp": 0.0}),  # only the attention core
])
def test_backward_is_twice_forward_plus_what_the_schedule_recomputes(schedule, recompute):
    costs = table(schedule=schedule)
    for kind in BLOCK_KINDS:
        for t in costs.degrees:
            c = costs.blocks[kind][t]
            assert c.bwd_ms == pytest.approx((2 + recompute[kind]) * c.fwd_ms, rel=1e-12)


@pytest.mark.parametrize("schedule, sub_batches, expected", [
    (ScheduleSpec("oases", sub_batches=4), 4, 4),
    (ScheduleSpec("oases"), 2, 2),
    (ScheduleSpec("megatron", sub_batches=4), 4, 1),  # blocking: runs the micro-batch whole
])
def test_the_table_carries_the_sub_batches_its_schedule_runs(schedule, sub_batches, expected):
    """The edge costs read ``CostTable.sub_batches``; a 4-way split reshards 4 sub-batches, megatron one."""
    spec = ProfileSpec(model=SMALL, devices=4, micro_batch=16, schedule=schedule, link=PCIE, cluster="test")
    costs = analytic_table(spec, ONE_TFLOPS, 2)
    assert costs.sub_batches == expected
    assert costs.reshard_bytes == 16 / expected * 16 * 64 * 2  # one sub-batch of fp16 activations


# -- memory ----------------------------------------------------------------------
def test_state_is_sixteen_bytes_per_parameter_and_shrinks_with_t():
    H = 64
    costs = table()
    for t in costs.degrees:  # q, k, v, o weights and q, k, v biases sharded; o bias and LayerNorm replicated
        attn_params = 4 * H * H / t + 3 * H / t + H + 2 * H
        mlp_params = 2 * 4 * H * H / t + 4 * H / t + H + 2 * H
        assert costs.blocks["attn"][t].state_bytes == 16 * attn_params
        assert costs.blocks["mlp"][t].state_bytes == 16 * mlp_params
    for kind in BLOCK_KINDS:
        states = [costs.blocks[kind][t].state_bytes for t in costs.degrees]
        assert states == sorted(states, reverse=True) and len(set(states)) == len(states)


def test_oases_attention_block_holds_one_fp16_tensor_of_the_device_share():
    costs = table(devices=4, micro_batch=16)
    for t in costs.degrees:
        tokens = 16 * t / 4 * 16  # the replica's share grows with t: activations are replicated on its t ranks
        # the fine-grained checkpoint: the block's output after bias-dropout-add, one [b, s, h] tensor
        assert costs.blocks["attn"][t].act_bytes == tokens * 64 * 2
        assert costs.blocks["mlp"][t].act_bytes == costs.blocks["mlp"][1].act_bytes * t  # scales with the share
    assert costs.fixed_bytes > 0
    assert costs.reshard_bytes == 16 / 2 * 16 * 64 * 2  # one sub-batch, fp16


def test_a_paper_size_block_needs_less_memory_at_every_higher_degree():
    costs = table(model=preset("gpt_39_1b"), devices=8, micro_batch=16, device=RTX3090, layers=48)
    for kind in BLOCK_KINDS:
        memory = [costs.blocks[kind][t].memory_bytes for t in costs.degrees]
        assert all(a > b for a, b in zip(memory, memory[1:])), memory


# -- communication ---------------------------------------------------------------
def test_raw_allreduce_is_the_ring_formula_on_the_link():
    costs = table(devices=4, micro_batch=16, schedule="megatron")
    for t in costs.degrees:
        nbytes = 16 * t / 4 * 16 * 64 * 2  # megatron: one batch, the whole share at once
        expected = 0.0 if t == 1 else 10e-3 + 2 * (t - 1) / t * nbytes * 8 / 96e9 * 1e3
        for kind in BLOCK_KINDS:  # synchronous: fwd AllReduce, bwd AllReduce + the recompute's repeat
            assert costs.blocks[kind][t].comm_fwd_ms == pytest.approx(expected, rel=1e-12)
            assert costs.blocks[kind][t].comm_bwd_ms == pytest.approx(2 * expected, rel=1e-12)


def test_a_faster_link_lowers_tmp_comm_and_gradient_sync():
    slow = table(schedule="megatron", link=LinkModel(10.0, 10.0))
    fast = table(schedule="megatron", link=LinkModel(100.0, 10.0))
    for kind in BLOCK_KINDS:
        for t in slow.degrees:
            s, f = slow.blocks[kind][t], fast.blocks[kind][t]
            assert (f.comm_fwd_ms + f.comm_bwd_ms < s.comm_fwd_ms + s.comm_bwd_ms) if t > 1 else s.comm_fwd_ms == 0
            assert (f.grad_sync_ms < s.grad_sync_ms) if t < slow.devices else s.grad_sync_ms == 0
            assert f.fwd_ms == s.fwd_ms and f.state_bytes == s.state_bytes


def test_oases_hides_what_megatron_exposes():
    model = preset("gpt_7_5b")
    oases = table(model=model, devices=8, micro_batch=16, device=RTX3090, schedule="oases")
    megatron = table(model=model, devices=8, micro_batch=16, device=RTX3090, schedule="megatron")
    for kind in BLOCK_KINDS:
        for t in oases.degrees[1:]:
            o, m = oases.blocks[kind][t], megatron.blocks[kind][t]
            assert o.comm_fwd_ms + o.comm_bwd_ms < m.comm_fwd_ms + m.comm_bwd_ms


def test_per_op_evidence_replays_to_the_block_compute():
    """The per-op times kept in the table drive the step simulator; its compute lane must equal the blocks'."""
    costs = table(schedule="megatron", devices=2, micro_batch=4)
    for t in costs.degrees:
        result = simulate_profiled_layer(costs, t, PCIE)
        blocks = sum(costs.blocks[kind][t].fwd_ms + costs.blocks[kind][t].bwd_ms for kind in BLOCK_KINDS)
        assert result.compute_ms == pytest.approx(blocks, rel=1e-9)


def test_an_operator_it_cannot_price_is_a_clear_error(monkeypatch):
    shapes = analytic.op_shapes
    monkeypatch.setattr(analytic, "op_shapes", lambda cfg, t: {k: v for k, v in shapes(cfg, t).items() if k != "core"})
    with pytest.raises(ValueError, match=r"no FLOP/size entry for operator 'L0.core'"):
        table()


def test_a_spec_without_a_link_is_refused():
    spec = ProfileSpec(model=SMALL, devices=2, micro_batch=4)
    with pytest.raises(ValueError, match="needs a link"):
        analytic_table(spec, RTX3090, 2)
    with pytest.raises(ValueError, match="achieved_fraction"):
        DeviceModel("x", 10.0, 1.5)


# -- presets and the planner -------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PAPER_PRESETS))
def test_paper_presets_validate_and_have_their_nominal_size(name):
    from oases_ds.models.blocks import layer_parameter_counts

    cfg = preset(name)
    for t in (1, 2, 4, 8):
        cfg.check_tp(t)
    # One embedding table (the papers' counts tie input and output); positions and norms are noise here.
    params = cfg.num_layers * sum(layer_parameter_counts(cfg).values()) + cfg.vocab_size * cfg.hidden_size
    assert params == pytest.approx(PAPER_PRESETS[name], rel=0.03)


def test_ilp_plans_gpt_39_1b_over_25gbe_under_a_binding_memory_limit():
    """The paper's cluster case: TMP 8 across nodes on 25 GbE, where a lower degree is faster
    but needs more memory.  (Inside a PCIe node the full degree is fastest *and* leanest, so
    no memory limit could bind there.)"""
    from oases_ds.planner.ilp import solve

    costs = table(model=preset("gpt_39_1b"), devices=8, micro_batch=16, device=RTX3090, layers=48,
                  link=LinkModel(25.0, 20.0))
    free = solve_dp(costs, None)
    lean = sum(min(c.memory_bytes for c in costs.blocks[kind].values()) for kind in costs.block_kinds())
    limit = (lean + free.memory_bytes) / 2
    assert free.memory_bytes > limit  # the limit binds
    plan = solve(costs, limit, time_limit_s=60)
    assert plan.layers == 48 and plan.memory_bytes <= limit
    assert predict_memory_bytes(costs, plan) == plan.memory_bytes
    assert predict_step_ms(costs, plan) == pytest.approx(plan.predicted_step_ms, rel=1e-6)
    assert plan.predicted_step_ms == pytest.approx(solve_dp(costs, limit).predicted_step_ms, rel=1e-6)
    fitting = [predict_step_ms(costs, Plan.uniform(8, 48, t)) for t in costs.degrees
               if predict_memory_bytes(costs, Plan.uniform(8, 48, t)) <= limit]
    assert plan.predicted_step_ms <= min(fitting) + 1e-6
    assert plan.solver_ms < 20_000, plan.solver_ms  # ~1 s on the 2-core development machine


# -- the CLI -----------------------------------------------------------------------
def test_cli_plans_a_paper_size_model_without_launching(tmp_path):
    out = tmp_path / "plan.json"
    proc = plan_cli("cost=analytic", "model=gpt_39_1b", "cluster=pcie_3090", "devices=8", "micro_batch=16",
                    "layers=4", "memory_limit=22GiB", f"out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"rtx3090@28.4TFLOPs,analytic|oases|8|cm{COST_MODEL_VERSION} | 4 layers | analytic:" in proc.stdout
    assert "per-rank peak " in proc.stdout and "+ logits " in proc.stdout  # the replayed peak, by term
    assert "nothing launched" in proc.stdout and "best uniform:" in proc.stdout
    # the analytic table's per-op times (from FLOPs) are replayed like a profile's
    assert "replayed steps (cost model" in proc.stdout and "8,8,8,8 / 8,8,8,8" in proc.stdout
    plan = Plan.from_json(out)
    assert plan.layers == 4 and plan.memory_bytes <= 22 * 2**30


@pytest.mark.parametrize("overrides, message", [
    (("model=gpt_tiny", "cluster=local"),
     "error: cost=analytic needs cluster.link and cluster.device; cluster=local has no cluster.link and no "
     "cluster.device: pick a cluster that states both (e.g. cluster=pcie_3090) or use cost=profile"),
    (("cluster=cpu_fixed_link",), "error: cost=analytic needs cluster.link and cluster.device; "
                                  "cluster=cpu_fixed_link has no cluster.device:"),
    (("cluster=pcie_3090", "devices=8", "micro_batch=8"), "error: micro_batch=8: the degree-1 share"),
    (("cluster=pcie_3090", "mode=accuracy"), "error: mode=accuracy measures plans on this machine"),
    (("cluster=pcie_3090", "table=costs.json"), "error: table= and cost=analytic both supply the cost table"),
    (("cluster=pcie_3090", "planner.sub_batches=[2,4]"),
     "error: planner.sub_batches with cost=analytic: the analytic model has no arithmetic-density term and always "
     "prefers more sub-batches; profile the candidates (cost=profile) or give one"),
    (("cluster=pcie_3090", "mode=profile", "planner.sub_batches=[2]"),
     "error: planner.sub_batches chooses a plan's sub-batches (mode=plan), not with mode=profile"),
])
def test_cli_bad_analytic_input_is_one_line(tmp_path, overrides, message):
    proc = plan_cli("cost=analytic", *overrides, f"out={tmp_path / 'p.json'}")
    assert proc.returncode == 2, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_cli_records_the_sub_batches_a_plan_was_chosen_at(tmp_path):
    """One candidate with analytic costs (no choice to make, so allowed): the plan is made at it and
    records it, which oases-train then runs (tests/unit/test_planning.py)."""
    out = tmp_path / "plan.json"
    proc = plan_cli("cost=analytic", "model=gpt_39_1b", "cluster=pcie_3090", "devices=8", "micro_batch=32",
                    "layers=2", "planner.sub_batches=[4]", f"out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sub-batches: 4 -> " in proc.stdout and "; chose 4" in proc.stdout and "|oases[sb=4," in proc.stdout
    assert Plan.from_json(out).sub_batches == 4


def test_cli_unknown_cost_names_the_choices(tmp_path):
    proc = plan_cli("cost=guess", f"out={tmp_path / 'p.json'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: cost='guess' unknown; choose one of profile, analytic"


# -- sequence parallelism ------------------------------------------------------------------
def _sp_table(policies: bool = True, link: LinkModel = PCIE):
    """A sequence-parallel analytic table, with (``policies``: as ``planner.recompute=auto`` loads it)
    its store and oases_gathered costs."""
    from oases_ds.planner.analytic import ACTIVATION_BYTES
    from oases_ds.planner.policies import with_store_costs

    model = dataclasses.replace(SMALL, family="llama")
    spec = ProfileSpec(model=model, devices=4, micro_batch=16, schedule=ScheduleSpec("oases"), link=link, cluster="test",
                       sequence_parallel=True)
    table = analytic_table(spec, ONE_TFLOPS, 2)
    return with_store_costs(table, model, 16, ACTIVATION_BYTES) if policies else table


def test_a_sequence_parallel_table_prices_its_three_policies_at_the_full_degree():
    """One degree (T); ``oases`` checkpoints 1/T of the stream and pays one more AllGather per
    sub-batch in the backward (the re-gather), ``oases_gathered`` holds the gathered input instead,
    ``store`` neither recomputes nor re-gathers; its collectives move the AllReduce's wire bytes."""
    plain_spec = ProfileSpec(model=dataclasses.replace(SMALL, family="llama"), devices=4, micro_batch=16,
                             schedule=ScheduleSpec("oases"), link=LinkModel(96.0, 0.0), cluster="test", min_degree=4)
    plain = analytic_table(plain_spec, ONE_TFLOPS, 2)
    sp = _sp_table(link=LinkModel(96.0, 0.0))  # no latency: wire bytes alone
    assert sp.sequence_parallel and sp.degrees == (4,) and sp.policies == ("oases", "store", "oases_gathered")
    assert "-sp" in sp.key() and "-sp" not in plain.key()
    raw = sp.measurements["degrees"]["4"]["blocks"]["attn"]
    raw_plain = plain.measurements["degrees"]["4"]["blocks"]["attn"]
    assert raw["comm_fwd_ms"] == pytest.approx(raw_plain["comm_fwd_ms"])  # ReduceScatter + AllGather = AllReduce
    assert raw["comm_bwd_ms"] == pytest.approx(raw_plain["comm_bwd_ms"] * 1.5)  # + the re-gather (2 -> 3 halves)
    for kind in BLOCK_KINDS:
        oases, gathered, store = (sp.block_cost(kind, 4, p) for p in ("oases", "oases_gathered", "store"))
        assert oases.act_bytes == pytest.approx(plain.blocks[kind][4].act_bytes / 4)
        assert gathered.act_bytes > oases.act_bytes and store.act_bytes > gathered.act_bytes
        assert store.bwd_ms < oases.bwd_ms == gathered.bwd_ms  # the recompute
    assert _sp_table(policies=False).policies == ("oases",)  # planner.recompute=oases: policy oases only


def test_a_sequence_parallel_table_of_the_older_operator_sequence_is_refused(tmp_path):
    """Cost model 10 runs the MLP as two ops under sequence parallelism, so a table profiled before it
    (model label ending in ``-sp``) would be read at the wrong operators: one line, not a wrong plan."""
    table = _sp_table()
    assert table.model.endswith("-sp2")
    table.to_json(tmp_path / "t.json")
    raw = json.loads((tmp_path / "t.json").read_text())
    raw["model"] = raw["model"][: -len("-sp2")] + "-sp"
    (tmp_path / "old.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"CostTable.model '.*-sp': a sequence-parallel table from before cost model 10.*profile it again"):
        CostTable.from_json(tmp_path / "old.json")


def test_oases_plan_plans_sequence_parallelism_and_marks_the_policies(tmp_path):
    """``oases-plan sequence_parallel=true`` as a user runs it: the key names it, every block at the
    full degree with its policy (unbounded memory: nothing recomputes with a re-gather; stored and
    gathered blocks tie in time on this small model)."""
    done = plan_cli("cost=analytic", "model=llama_small", "cluster=pcie_3090", "devices=4", "micro_batch=8",
                    "planner.recompute=auto", "sequence_parallel=true", f"out={tmp_path / 'p.json'}")
    assert done.returncode == 0, done.stderr
    assert "-sp2|" in done.stdout and "g: gathered input kept" in done.stdout, done.stdout
    plan = Plan.from_json(tmp_path / "p.json")
    assert set(plan.block_degrees()) == {4} and "store" in plan.block_policies()
    assert set(plan.block_policies()) <= {"store", "oases_gathered"}
    with pytest.raises(ValueError, match=r"^sequence_parallel splits the sequence over the 4 TMP ranks but "
                                         r"model.seq_len=18 is not divisible by 4"):
        ProfileSpec(model=dataclasses.replace(SMALL, seq_len=18), devices=4, micro_batch=16, sequence_parallel=True)
