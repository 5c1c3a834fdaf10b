"""Functions that run inside rank processes started by ``oases_ds.launcher.launch``.

They return plain numbers; the tests assert on them in the parent process.
"""
from __future__ import annotations

import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import IGNORE_INDEX, MLP_UP_CHUNKS, OperatorModel, one_layer_ops
from oases_ds.models.ops import CommOp, short_name
from oases_ds.parallel.collectives import start_all_reduce
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.grads import average_data_parallel_grads
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.costed_merge import HopCosts
from oases_ds.schedule.generators import ScheduleSpec

# (label, spec): the five schedules plus Oases' two ablations.
VARIANTS = [
    ("none", ScheduleSpec("none")),
    ("megatron", ScheduleSpec("megatron")),
    ("megatron_selective", ScheduleSpec("megatron_selective")),
    ("split_overlap", ScheduleSpec("split_overlap")),
    ("oases", ScheduleSpec("oases")),
    ("oases-no-cross-pass", ScheduleSpec("oases", cross_pass=False)),
    ("oases-no-fine-grained", ScheduleSpec("oases", fine_grained_recompute=False)),
    # per-block policies (a plan's attn/mlp_policies): attn0 and mlp1 stored, the rest recomputed
    ("oases-store-mixed", ScheduleSpec("oases", stored_blocks=(0, 3))),
]
EXTRA_VARIANTS = [
    ("oases-store-all", ScheduleSpec("oases", stored_blocks=tuple(range(8)))),  # every block of up to 4 layers stored
    ("oases-store-mixed-no-cross-pass", ScheduleSpec("oases", cross_pass=False, stored_blocks=(1, 2))),
    # under sequence parallelism: attn0 keeps its gathered input, mlp0 re-gathers, attn1 stored, mlp1 gathered
    ("oases-gathered-mixed", ScheduleSpec("oases", stored_blocks=(2,), gathered_blocks=(0, 3))),
    ("oases-gathered-all", ScheduleSpec("oases", gathered_blocks=tuple(range(8)))),
    # more sub-batches than the paper's two (issue 43): every sub-batched schedule at k = 3 and 4
    ("split_overlap-k3", ScheduleSpec("split_overlap", sub_batches=3)),
    ("split_overlap-k4", ScheduleSpec("split_overlap", sub_batches=4)),
    ("oases-k3", ScheduleSpec("oases", sub_batches=3)),
    ("oases-k4", ScheduleSpec("oases", sub_batches=4)),
    ("oases-k4-no-cross-pass", ScheduleSpec("oases", sub_batches=4, cross_pass=False)),
    ("oases-k4-no-fine-grained", ScheduleSpec("oases", sub_batches=4, fine_grained_recompute=False)),
    ("oases-k3-store-mixed", ScheduleSpec("oases", sub_batches=3, stored_blocks=(0, 3))),
    ("oases-k4-store-all", ScheduleSpec("oases", sub_batches=4, stored_blocks=tuple(range(8)))),
]
"""Run only where a test names them (``variants``), not in every parity sweep."""


def synthetic_hop_costs() -> HopCosts:
    """Per-op times shaped like a large model's under sequence parallelism (an MLP's up projection
    longer than a collective, the attention projection shorter), for every op name of the three
    families' sequence-parallel layer: the hops then fall elsewhere than the time-blind merge puts
    them (``test_sequence_parallel`` checks that they do), so a plan's order runs in the parity sweep."""
    heavy = {"qkv": 1.8, "core": 1.2, "proj": 0.6, "mlp_down": 1.6, "mlp": 4.8, "head_in": 1.0, "loss": 1.0,
             **{f"mlp_up{k}": 3.2 / MLP_UP_CHUNKS for k in range(MLP_UP_CHUNKS)}}
    compute, link = {}, {}
    for family in ("gpt", "bert", "llama"):
        for op in one_layer_ops(family, True):
            key = short_name(op)
            if isinstance(op, CommOp):
                link[key] = (key, 2.5)
            else:
                forward = heavy.get(key, 0.0)
                compute[key] = (key, forward, forward, 2 * forward)
    return HopCosts(tuple(compute.values()), tuple(link.values()))


EXTRA_VARIANTS += [  # under sequence parallelism, hops ordered by per-op times (a plan's hop_costs)
    ("oases-hops", ScheduleSpec("oases", hop_costs=synthetic_hop_costs())),
    ("oases-gathered-mixed-hops", ScheduleSpec("oases", stored_blocks=(2,), gathered_blocks=(0, 3),
                                               hop_costs=synthetic_hop_costs())),
]


def variant_spec(label: str) -> ScheduleSpec:
    """The spec of a variant label above, else of a plain schedule name."""
    return dict(VARIANTS + EXTRA_VARIANTS).get(label) or ScheduleSpec(label)


def tiny_config(family: str, dropout: float = 0.1, **options) -> ModelConfig:
    base = dict(family=family, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, seq_len=8, dropout=dropout)
    return ModelConfig(**{**base, **options})


# Model options real checkpoints need, each against the reference at TMP 1 and 2 (test_parity).
OPTION_CASES: dict[str, dict] = {
    "llama_gqa_theta_half": dict(family="llama", num_kv_heads=2, rope_theta=500000.0, rotary="half"),
    "llama_llama3_scaling_tied": dict(family="llama", rope_scaling="llama3", rope_factor=8.0,
                                      rope_original_max_positions=4, tie_embeddings=True),
    "llama_linear_scaling_mqa_tp1": dict(family="llama", num_kv_heads=1, rope_scaling="linear", rope_factor=2.0),
    # Qwen2's q/k/v biases (o none); one k/v head, so at TMP 2 its bias is replicated with its weight
    "llama_qkv_bias_mqa": dict(family="llama", num_kv_heads=1, qkv_bias=True, rotary="half"),
    "gpt_tied_tanh_odd_vocab": dict(family="gpt", tie_embeddings=True, activation="gelu_tanh", vocab_size=63),
    "gpt_gqa_odd_vocab": dict(family="gpt", num_kv_heads=2, vocab_size=61),
    "bert_token_types_odd_vocab": dict(family="bert", type_vocab_size=2, vocab_size=63),
    # BertForMaskedLM's head: decoder tied to the embedding with its own bias; [PAD] = 60 appears
    # in the random tokens, attended, and its row must get no lookup gradient (rank 1 holds it at TMP 2)
    "bert_tied_pad_tanh": dict(family="bert", type_vocab_size=2, vocab_size=63, tie_embeddings=True,
                               pad_token_id=60, activation="gelu_tanh"),
}


def make_batch(cfg: ModelConfig, size: int, step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic global batch; every sample has the same number of labelled
    tokens, so a mean over DP ranks equals the mean over the global batch."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    if cfg.family == "bert":
        tokens = torch.randint(1, cfg.vocab_size, (size, cfg.seq_len), generator=gen)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        picked = torch.arange(cfg.seq_len) % 3 == 0
        labels[:, picked] = tokens[:, picked]
        tokens = tokens.masked_fill(picked, 0)  # 0 is the [MASK] token
        batch = {"tokens": tokens, "labels": labels}
        if cfg.type_vocab_size:  # sentence A then sentence B, split at a per-sample point
            cut = torch.randint(1, cfg.seq_len, (size, 1), generator=gen)
            batch["token_types"] = (torch.arange(cfg.seq_len) >= cut).long()
        return batch
    seq = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=gen)
    return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}


def gather_full_grads(model: OperatorModel, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Unsharded gradients: each sharded parameter gathered over its block's group."""
    return {name: model.sharding.gather_full(name, p, p.grad) for name, p in model.named_parameters()}


def rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """||a - ref|| / max(||ref||, floor).

    The floor (1e-4 x the norm of the whole reference gradient) covers gradients
    that are zero in exact arithmetic -- the attention key bias, since softmax
    ignores a constant shift -- whose fp32 round-off (~1e-10) has no meaningful
    relative size.  Every gradient larger than the floor is compared relatively."""
    return float((a - ref).norm() / max(float(ref.norm()), floor))


def parity_worker(tp: int, families: list[str], steps: int, micro_batch: int, lr: float = 0.05,
                  plan: tuple[tuple[int, ...], tuple[int, ...]] | None = None, variants: list[str] | None = None,
                  dropout: float = 0.1, options: dict[str, dict] | None = None,
                  sequence_parallel: bool = False) -> dict:
    """Train every schedule variant for ``steps`` SGD steps and compare, after every
    step, gathered gradients and the loss with the unsharded reference.  ``options``:
    label -> ModelConfig fields, run instead of the plain ``families``;
    ``sequence_parallel``: the sharded model splits the sequence between blocks."""
    import sys, os

    sys.path.insert(0, os.path.dirname(__file__))
    from reference_models import ReferenceModel

    ctx = ParallelContext.build(tensor_parallel_size=tp, timeout_s=120)
    dp, dp_rank = ctx.dp_size, ctx.dp_rank
    results: dict = {}
    configs = {f: tiny_config(f, dropout) for f in families} if options is None else {
        label: tiny_config(**{"dropout": dropout, **kw}) for label, kw in options.items()}
    for family, cfg in configs.items():
        ref = ReferenceModel(cfg, seed=7)
        ref_rng = RNGTracker(seed=11)
        opt = torch.optim.SGD(ref.parameters(), lr=lr)
        ref_grads, ref_losses = [], []
        for step in range(steps):
            batch = make_batch(cfg, micro_batch * dp, step)
            opt.zero_grad()
            loss = ref(batch["tokens"], batch["labels"], ref_rng, token_types=batch.get("token_types"))
            loss.backward()
            ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            ref_losses.append(float(loss.detach()))
            opt.step()
            ref_rng.advance()
        for label, spec in VARIANTS + EXTRA_VARIANTS:
            if label not in (variants if variants is not None else dict(VARIANTS)):
                continue
            if plan is None:
                model = OperatorModel(cfg, group=ctx.tp_group, seed=7, sequence_parallel=sequence_parallel)
            else:
                from oases_ds.planner.plan import Plan

                model = OperatorModel.for_plan(cfg, ctx, Plan(plan[0], plan[1], devices=tp), seed=7,
                                               sequence_parallel=sequence_parallel)
            rng = RNGTracker(seed=11)
            ex = Executor.for_schedule(model, spec, rng=rng)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            worst_grad, worst_loss, worst_param = 0.0, 0.0, None
            for step in range(steps):
                full = make_batch(cfg, micro_batch * dp, step)
                local = {k: v[dp_rank * micro_batch : (dp_rank + 1) * micro_batch] for k, v in full.items()}
                opt.zero_grad()
                loss = ex.run(local, sample_offset=dp_rank * micro_batch, global_batch=micro_batch * dp)
                average_data_parallel_grads(model, ctx.dp_group)
                grads = gather_full_grads(model, ctx)
                floor = 1e-4 * float(torch.cat([g.flatten() for g in ref_grads[step].values()]).norm())
                errs = {n: rel_err(grads[n], g, floor) for n, g in ref_grads[step].items()}
                worst_name = max(errs, key=errs.get)
                if errs[worst_name] > worst_grad:
                    worst_grad, worst_param = errs[worst_name], (worst_name, float(ref_grads[step][worst_name].norm()))
                mean_loss = float(start_all_reduce(loss, ctx.dp_group).wait()) / dp
                worst_loss = max(worst_loss, abs(mean_loss - ref_losses[step]) / abs(ref_losses[step]))
                opt.step()
                rng.advance()
            results[(family, label)] = {"grad_err": worst_grad, "loss_err": worst_loss, "last_loss": mean_loss, "worst_param": worst_param}
    return results


def comm_worker(tp: int, micro_batch: int) -> dict:
    """Bytes per phase of one step of megatron and oases on a GPT."""
    ctx = ParallelContext.build(tensor_parallel_size=tp, timeout_s=120)
    cfg = tiny_config("gpt")
    out = {}
    for name in ("megatron", "oases", "split_overlap"):
        model = OperatorModel(cfg, group=ctx.tp_group, seed=1)
        ex = Executor.for_schedule(model, ScheduleSpec(name), rng=RNGTracker())
        comm = ex.comm
        ex.run(make_batch(cfg, micro_batch, 0))
        out[name] = {
            phase: (comm.stats.bytes_in(phase, "all_reduce"), comm.stats.calls_in(phase, "all_reduce"))
            for phase in ("forward", "recompute", "backward", "loss")
        }
    out["allreduce_payload"] = micro_batch * cfg.seq_len * cfg.hidden_size * 4
    out["layers"] = cfg.num_layers
    return out


def padding_mask_worker(tp: int) -> dict:
    """A BERT batch with a right-padded sample and ``attention_mask``: loss and gradients
    (eager, and through the Oases schedule) against the same samples run unpadded one at a
    time; and the loss without the mask, which must differ (padding keys read)."""
    cfg = ModelConfig(family="bert", vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, seq_len=16,
                      dropout=0.0, type_vocab_size=2)
    group = ParallelContext.build(tensor_parallel_size=tp, timeout_s=120).tp_group if tp > 1 else None
    model = OperatorModel(cfg, group=group, seed=0)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, 64, (2, 16), generator=gen)
    length = 10
    tokens[0, length:] = 0  # [PAD]
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[0, [1, 4, 8]] = tokens[0, [1, 4, 8]]
    labels[1, [0, 5, 11, 15]] = tokens[1, [0, 5, 11, 15]]
    mask = torch.ones_like(tokens)
    mask[0, length:] = 0
    padded = {"tokens": tokens, "labels": labels, "attention_mask": mask}

    def grads() -> dict[str, torch.Tensor]:
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    n0, n1 = 3, 4
    ref = (model({"tokens": tokens[:1, :length], "labels": labels[:1, :length]}) * n0
           + model({"tokens": tokens[1:], "labels": labels[1:]}) * n1) / (n0 + n1)
    ref.backward()
    ref_grads = grads()
    eager = model(padded)
    eager.backward()
    eager_grads = grads()
    ex = Executor.for_schedule(model, ScheduleSpec("oases"), rng=RNGTracker(seed=1))
    scheduled = ex.run(dict(padded))
    sched_grads = grads()
    with torch.no_grad():
        unmasked = float(model({"tokens": tokens, "labels": labels}))

    # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift): a norm floor, as rel_err.
    floor = 1e-4 * float(torch.cat([g.flatten() for g in ref_grads.values()]).norm())

    def worst(g: dict[str, torch.Tensor]) -> float:
        return max(float((g[n] - r).norm() / max(float(r.norm()), floor)) for n, r in ref_grads.items())

    return {"ref": float(ref.detach()), "eager": float(eager.detach()), "scheduled": float(scheduled.detach()),
            "unmasked": unmasked, "eager_grad_err": worst(eager_grads), "sched_grad_err": worst(sched_grads)}
