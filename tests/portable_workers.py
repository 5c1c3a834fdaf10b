"""Rank functions for the resume-across-layouts tests (run under oases_ds.launcher).

Every run trains the same global batch of ``GLOBAL`` samples per step, whatever its
layout: micro-batch ``a`` of DP rank ``d`` holds samples ``[(a * dp + d) * micro, ...)``,
the order one unsharded batch has, so dropout keys and data line up across layouts.
"""
from __future__ import annotations

import os

import torch

from dist_workers import make_batch, tiny_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")

GLOBAL = 8
FAMILY = "llama"  # no bias whose gradient is zero in exact arithmetic (see engine_workers.sgd): Adam is comparable


def model_config():
    return tiny_config(FAMILY, num_layers=4)


def _engine(layout: dict):
    import oases_ds
    from engine_workers import ds_config

    oases = {"enabled": True, "tensor_parallel_size": layout.get("tp", 1), "pipeline_stages": layout.get("pp", 1),
             "seed": 7, "process_group_timeout_s": 120, **({"plan": layout["plan"]} if layout.get("plan") else {})}
    cfg = ds_config(layout["micro"], layout["gas"], layout.get("zero", 0), clip=1.0, oases=oases, bf16=layout.get("bf16", False))
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}}
    if layout.get("sgd"):
        from engine_workers import sgd

        return oases_ds.initialize(model=model_config(), optimizer=sgd, config=cfg)[0]
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    return oases_ds.initialize(model=model_config(), config=cfg)[0]


def load_error(layout: dict, save_dir: str) -> str:
    """The one line loading ``save_dir`` under ``layout`` raises, or "loaded"."""
    from oases_ds.checkpoint import CheckpointError

    try:
        _engine(layout).load_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def _train(engine, layout: dict, step: int) -> float:
    ctx, micro, gas = engine.parallel_context, layout["micro"], layout["gas"]
    full = make_batch(model_config(), GLOBAL, step)
    idx = torch.cat([torch.arange((a * ctx.dp_size + ctx.dp_rank) * micro, (a * ctx.dp_size + ctx.dp_rank + 1) * micro)
                     for a in range(gas)])
    return float(engine.train_batch({k: v[idx] for k, v in full.items()}))


def snapshot(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Full (unsharded) fp32 master and Adam moments of every parameter this stage holds,
    read through DeepSpeed's public accessors (ZeRO-1: ``safe_get_full_*``; ZeRO 0 fp32: the
    torch optimizer's state) and gathered over TMP: what the resharding must preserve."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    sharding, out, opt = engine.module.sharding, {}, engine.optimizer
    masters = {}  # bf16 with ZeRO 0: DeepSpeed's FP16_UnfusedOptimizer keeps fp32 copies
    if hasattr(opt, "fp32_groups"):
        masters = {id(lp): hp for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(g16, g32)}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "_hp_mapping"):
            values = {"master": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                      "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
        else:
            master = masters.get(id(p), p)
            state = getattr(opt, "optimizer", opt).state[master]
            values = {"master": master.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        out[name] = {k: sharding.gather_full(name, p, v.float()) for k, v in values.items()}
    return out


def weights(engine) -> dict[str, torch.Tensor]:
    """Full weights as the model holds them (bf16 in a bf16 run), for comparisons."""
    sharding = engine.module.sharding
    return {name: sharding.gather_full(name, p, p.detach()) for name, p in engine.module.named_parameters()}


def run(layout: dict, save_dir: str | None, phase: str, steps: int) -> dict:
    """phase "save": train ``steps`` steps, snapshot, save.  "resume": load, snapshot, train
    ``steps``.  "fresh": train ``steps`` from step 0.  Returns losses, snapshot, final weights,
    the step counter and the learning rate the next step would use."""
    engine = _engine(layout)
    out: dict = {"stage": engine.parallel_context.pp_rank, "optimizer": type(engine.optimizer).__name__,
                 "partition_gradients": bool(getattr(engine.optimizer, "partition_gradients", False))}
    if phase == "resume":
        path, client = engine.load_checkpoint(save_dir)
        out.update(path=path, client=client, loaded_step=engine.global_steps, loaded=snapshot(engine),
                   loaded_lr=float(engine.get_lr()[0]), loaded_weights=weights(engine))
    start = engine.global_steps
    out["losses"], out["history"] = [], []
    for step in range(start, start + steps):
        out["losses"].append(_train(engine, layout, step))
        if layout.get("history"):
            out["history"].append(weights(engine))
    if phase == "save":
        out["saved"] = snapshot(engine)
        out["saved_lr"] = float(engine.get_lr()[0])
        engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    out.update(weights=weights(engine), global_steps=engine.global_steps)
    return out


def runs(jobs: list[tuple]) -> list[dict]:
    """:func:`run` of each argument tuple in turn, in one launch (the ranks import torch and
    DeepSpeed once); each builds its own engine from its layout."""
    return [run(*job) for job in jobs]
