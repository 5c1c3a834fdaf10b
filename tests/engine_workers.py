"""Rank functions for the DeepSpeed-engine tests (run under oases_ds.launcher)."""
from __future__ import annotations

import os

import torch

from dist_workers import make_batch, tiny_config  # noqa: F401 (re-exported for tests)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(micro: int, gas: int, zero: int = 0, clip: float | None = None, oases: dict | None = None, bf16: bool = False) -> dict:
    if clip is None:
        clip = float(os.environ.get("OASES_TEST_CLIP", "0.05"))
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if oases is not None:
        cfg["oases"] = oases
    return cfg


def sgd(params):
    """SGD with momentum for parity runs.  (Adam divides by sqrt(v): on a gradient that is
    zero in exact arithmetic -- the attention key bias -- it turns fp32 round-off into
    full-size updates, so Adam runs are compared only as smoke tests.)"""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class RefForDeepSpeed(torch.nn.Module):
    """The independent reference model behind DeepSpeed's ``module(batch) -> loss`` API."""

    def __init__(self, family: str, seed: int, dropout_seed: int) -> None:
        super().__init__()
        from oases_ds.parallel.random import RNGTracker
        from reference_models import ReferenceModel

        self.ref = ReferenceModel(tiny_config(family), seed)
        self.rng = RNGTracker(seed=dropout_seed)

    def forward(self, batch):
        return self.ref(batch["tokens"], batch["labels"], self.rng, self.training)


def reference_run(family: str, steps: int, batch_size: int, zero: int = 0) -> dict:
    """Plain DeepSpeedEngine (oases switched off) on the unsharded reference, full global batch."""
    import oases_ds

    model = RefForDeepSpeed(family, seed=7, dropout_seed=7)
    cfg = ds_config(batch_size, 1, zero, oases={"enabled": False})
    engine, *_ = oases_ds.initialize(model=model, optimizer=sgd, config=cfg)
    params, losses = [], []
    for step in range(steps):
        model.rng.step = engine.global_steps
        batch = make_batch(tiny_config(family), batch_size, step)
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        params.append({n[len("ref."):]: p.detach().clone() for n, p in engine.module.named_parameters()})
    engine.eval()
    eval_loss = float(engine(make_batch(tiny_config(family), batch_size, 999)))
    return {"engine": type(engine).__name__, "params": params, "losses": losses, "eval_loss": eval_loss}


def _full_params(engine, ctx) -> dict[str, torch.Tensor]:
    model = engine.module
    return {name: model.sharding.gather_full(name, p, p.float()) for name, p in model.named_parameters()}


def oases_run(family: str, tp: int, steps: int, micro: int, gas: int = 1, zero: int = 0, schedule: str = "oases",
              bf16: bool = False, optimizer: str = "sgd", plan: str | None = None) -> dict:
    """OasesEngine on this rank's TMP shard and DP share; returns full params after each step."""
    import oases_ds
    from oases_ds.parallel.collectives import start_all_reduce

    ctx_cfg = {"enabled": True, "tensor_parallel_size": tp, "schedule": schedule, "seed": 7,
               "process_group_timeout_s": 120, **({"plan": plan} if plan else {})}
    cfg = ds_config(micro, gas, zero, oases=ctx_cfg, bf16=bf16)
    if optimizer == "adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    engine, *_ = oases_ds.initialize(model=tiny_config(family), optimizer=sgd if optimizer == "sgd" else None, config=cfg)
    ctx = engine.parallel_context
    params, losses = [], []
    per_rank = micro * gas
    for step in range(steps):
        full = make_batch(tiny_config(family), per_rank * ctx.dp_size, step)
        # DP rank d gets micro-batch a's samples at [(a * dp + d) * micro, ...): the order the
        # reference's one big batch uses, so dropout keys and data line up.
        idx = torch.cat([torch.arange((a * ctx.dp_size + ctx.dp_rank) * micro, (a * ctx.dp_size + ctx.dp_rank + 1) * micro)
                         for a in range(gas)])
        loss = engine.train_batch({k: v[idx] for k, v in full.items()})
        losses.append(float(loss))
        params.append(_full_params(engine, ctx))
    engine.eval()  # DeepSpeedEngine.forward -> the model's eager forward (collectives inline)
    full = make_batch(tiny_config(family), per_rank * ctx.dp_size, 999)
    mine = {k: v[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank] for k, v in full.items()}
    eval_loss = float(start_all_reduce(engine(mine).detach(), ctx.dp_group).wait()) / ctx.dp_size
    return {"engine": type(engine).__name__, "params": params, "losses": losses, "global_steps": engine.global_steps,
            "stats": engine.last_stats, "eval_loss": eval_loss}


def checkpoint_run(tp: int, save_dir: str, phase: str) -> dict:
    """phase "save": train 2 steps, save, train 2 more.  phase "resume": load, train 2."""
    import oases_ds

    cfg = ds_config(4, 1, 1, oases={"enabled": True, "tensor_parallel_size": tp, "seed": 7})
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    engine, *_ = oases_ds.initialize(model=tiny_config("gpt"), config=cfg)
    dp = engine.parallel_context.dp_size
    losses = []

    def train(step: int) -> None:
        full = make_batch(tiny_config("gpt"), 4 * dp, step)
        d = engine.parallel_context.dp_rank
        losses.append(float(engine.train_batch({k: v[d * 4 : (d + 1) * 4] for k, v in full.items()})))

    if phase == "save":
        for step in range(2):
            train(step)
        engine.save_checkpoint(save_dir)
    else:
        engine.load_checkpoint(save_dir)
    start = engine.global_steps
    for step in range(start, start + 2):
        train(step)
    return {"losses": losses, "global_steps": engine.global_steps, "listing": sorted(os.listdir(save_dir))}


def bad_world_run() -> str:
    import oases_ds

    try:
        oases_ds.initialize(model=tiny_config("gpt"), config=ds_config(4, 1, oases={"enabled": True, "tensor_parallel_size": 4}))
    except ValueError as err:
        return str(err)
    return "no error"
