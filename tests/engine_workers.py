"""Rank functions for the DeepSpeed-engine tests (run under oases_ds.launcher)."""
from __future__ import annotations

import os

import torch

from dist_workers import make_batch, tiny_config  # noqa: F401 (re-exported for tests)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(micro: int, gas: int, zero: int = 0, clip: float | None = None, oases: dict | None = None, bf16: bool = False,
              offload: bool = False) -> dict:
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
    if offload:  # the optimizer's fp32 partition and states in host memory; the parity runs keep their SGD
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
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
              bf16: bool = False, optimizer: str = "sgd", plan: str | None = None, dp_overlap: bool = True,
              sequence_parallel: bool = False, check_collectives: bool = False, offload: bool = False,
              overlap_micro_batches: bool = False) -> dict:
    """OasesEngine on this rank's TMP shard and DP share; returns full params after each step,
    and the global gradient norm DeepSpeed's optimizer clipped with (ZeRO-1; None otherwise)."""
    import oases_ds
    from oases_ds.parallel.collectives import start_all_reduce

    ctx_cfg = {"enabled": True, "tensor_parallel_size": tp, "schedule": schedule, "seed": 7,
               "process_group_timeout_s": 120, "dp_overlap": dp_overlap, **({"plan": plan} if plan else {}),
               "sequence_parallel": sequence_parallel, "check_collectives": check_collectives,
               "overlap_micro_batches": overlap_micro_batches}
    cfg = ds_config(micro, gas, zero, oases=ctx_cfg, bf16=bf16, offload=offload)
    if optimizer == "adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    engine, *_ = oases_ds.initialize(model=tiny_config(family), optimizer=sgd if optimizer == "sgd" else None, config=cfg)
    ctx = engine.parallel_context
    ds_reductions = _count_deepspeed_reductions(engine)
    handoff_buffers = _record_handoff_buffers(engine)
    params, losses, grad_norms = [], [], []
    per_rank = micro * gas
    for step in range(steps):
        full = make_batch(tiny_config(family), per_rank * ctx.dp_size, step)
        # DP rank d gets micro-batch a's samples at [(a * dp + d) * micro, ...): the order the
        # reference's one big batch uses, so dropout keys and data line up.
        idx = torch.cat([torch.arange((a * ctx.dp_size + ctx.dp_rank) * micro, (a * ctx.dp_size + ctx.dp_rank + 1) * micro)
                         for a in range(gas)])
        loss = engine.train_batch({k: v[idx] for k, v in full.items()})
        losses.append(float(loss))
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
        params.append(_full_params(engine, ctx))
    engine.eval()  # DeepSpeedEngine.forward -> the model's eager forward (collectives inline)
    full = make_batch(tiny_config(family), per_rank * ctx.dp_size, 999)
    mine = {k: v[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank] for k, v in full.items()}
    eval_loss = float(start_all_reduce(engine(mine).detach(), ctx.dp_group).wait()) / ctx.dp_size
    reducer = engine.dp_reducer
    return {"engine": type(engine).__name__, "params": params, "losses": losses, "global_steps": engine.global_steps,
            "stored_blocks": engine.schedule.stored_blocks,
            "stats": engine.last_stats, "eval_loss": eval_loss, "dp_overlap": reducer is not None,
            "dp_log": list(reducer.log) if reducer else [], "grad_sync_calls": engine.oases_comm.stats.calls_in("grad_sync"),
            "grad_norms": grad_norms, "optimizer": type(engine.optimizer).__name__,
            "partition_gradients": bool(getattr(engine.optimizer, "partition_gradients", False)),
            "cpu_offload": bool(getattr(engine.optimizer, "cpu_offload", False)),
            "sequence_parallel": engine.module.sequence_parallel,
            "deepspeed_reductions": ds_reductions[0], "handoff_buffer_elements": handoff_buffers,
            "pipeline_order": getattr(getattr(engine.executor, "pipe", None), "name", None)}


def _record_handoff_buffers(engine) -> list[int]:
    """The elements of every staging buffer DeepSpeed's ZeRO-1 optimizer holds once the hand-off
    of the overlapped reducer's gradients has set up its buckets (freed at its step, but kept
    by the caching allocator).  Instance attributes: this engine only."""
    sizes: list[int] = []
    handoff, opt = engine._hand_reduced_grads_to_zero, engine.optimizer
    if not hasattr(opt, "setup_buckets"):
        return sizes
    setup = opt.setup_buckets

    def recorded_setup():
        setup()
        sizes.extend(buf.numel() for bucket in opt.ipg_buckets.values() for buf in bucket.buffer)

    def recorded():
        opt.setup_buckets = recorded_setup
        try:
            handoff()
        finally:
            opt.setup_buckets = setup

    engine._hand_reduced_grads_to_zero = recorded
    return sizes


def _count_deepspeed_reductions(engine) -> list[int]:
    """Count DeepSpeed's own DP gradient reductions on this engine from now on: its ZeRO 0
    AllReduce (``buffered_allreduce_fallback``) and its ZeRO-1 bucket reduction
    (``average_tensor`` with a non-empty bucket).  With the overlapped reduction there must be
    none: a second reduction of already averaged gradients would leave them unchanged, so
    parity alone could not tell.  Instance attributes: this engine only."""
    count = [0]

    def counted(fn, reduces):
        def wrapper(*args, **kwargs):
            count[0] += int(reduces(*args, **kwargs))
            return fn(*args, **kwargs)
        return wrapper

    engine.buffered_allreduce_fallback = counted(engine.buffered_allreduce_fallback, lambda *a, **k: True)
    if hasattr(engine.optimizer, "average_tensor"):
        engine.optimizer.average_tensor = counted(engine.optimizer.average_tensor, lambda tensor, *a, **k: tensor.numel() > 0)
    return count


def checkpoint_run(tp: int, save_dir: str, phase: str, sequence_parallel: bool = False) -> dict:
    """phase "save": train 2 steps, save, train 2 more.  phase "resume": load, train 2."""
    import oases_ds

    cfg = ds_config(4, 1, 1, oases={"enabled": True, "tensor_parallel_size": tp, "seed": 7,
                                    "sequence_parallel": sequence_parallel})
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


def sequence_parallel_resume_run(root: str) -> dict:
    """:func:`checkpoint_run` saved without sequence parallelism and resumed with it, then saved
    with it and resumed without, in one launch: ``{saved_with_sp: (first, resumed)}``."""
    out = {}
    for saved_sp in (False, True):
        save_dir = os.path.join(root, f"saved_sp{int(saved_sp)}")
        out[saved_sp] = (checkpoint_run(2, save_dir, "save", saved_sp), checkpoint_run(2, save_dir, "resume", not saved_sp))
    return out


def bad_world_run() -> str:
    import oases_ds

    try:
        oases_ds.initialize(model=tiny_config("gpt"), config=ds_config(4, 1, oases={"enabled": True, "tensor_parallel_size": 4}))
    except ValueError as err:
        return str(err)
    return "no error"


class _OpenOnUnpickle:
    """A pickle payload: unpickling it calls ``open(marker, "w")``, creating the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_payload(path: str, marker: str) -> None:
    """Overwrite checkpoint file ``path`` with a state dict carrying a code payload."""
    torch.save({"module": {}, "payload": _OpenOnUnpickle(marker)}, path)


def checkpoint_safety_run(root: str) -> dict:
    """One rank.  (1) fp32/bf16 x ZeRO 0/1/2 and fp16 x ZeRO 0/2 (its loss scaler) with Adam +
    WarmupLR: save, load into a fresh engine through the safe loader, compare; (2) a bf16
    checkpoint loaded by an fp32 engine;
    (3) a planted payload; (4) ``latest`` pointing outside the directory."""
    import shutil

    import oases_ds
    from oases_ds.checkpoint import CheckpointError

    def engine_for(bf16: bool, zero: int, fp16: bool = False):
        cfg = ds_config(4, 1, zero, oases={"enabled": True, "tensor_parallel_size": 1, "seed": 7}, bf16=bf16)
        if fp16:
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}}
        return oases_ds.initialize(model=tiny_config("gpt"), config=cfg)[0]

    def refused(engine, directory: str) -> str:
        try:
            engine.load_checkpoint(directory)
        except CheckpointError as err:
            return str(err)
        return "loaded"

    out: dict = {"roundtrip": {}}
    modes = [(precision, zero) for precision in ("fp32", "bf16") for zero in (0, 1, 2)] + [("fp16", 0), ("fp16", 2)]
    for precision, zero in modes:
        mode = f"{precision}_zero{zero}"
        saver = engine_for(precision == "bf16", zero, precision == "fp16")
        saver.train_batch(make_batch(tiny_config("gpt"), 4, 0))
        if precision == "fp16":  # a scale the loader would not start from: 2^8 -> 2^7
            saver.optimizer.loss_scale = 128.0
        saver.save_checkpoint(os.path.join(root, mode))
        loader = engine_for(precision == "bf16", zero, precision == "fp16")
        path, _ = loader.load_checkpoint(os.path.join(root, mode))
        same = all(torch.equal(a, b) for a, b in zip(saver.module.state_dict().values(), loader.module.state_dict().values()))
        out["roundtrip"][mode] = {"path": path, "same_params": same, "global_steps": loader.global_steps,
                                  "lr": loader.get_lr() == saver.get_lr(), "loss_scale": loader.current_loss_scale()}
    fp32 = engine_for(False, 0)
    out["mismatch"] = refused(fp32, os.path.join(root, "bf16_zero0"))
    evil = os.path.join(root, "evil")
    shutil.copytree(os.path.join(root, "fp32_zero0"), evil)
    out["evil_file"] = os.path.join(evil, "global_step1", "mp_rank_00_model_states.pt")
    plant_payload(out["evil_file"], os.path.join(root, "marker"))
    out["payload"] = refused(fp32, evil)
    out["marker_exists"] = os.path.exists(os.path.join(root, "marker"))
    shutil.copytree(os.path.join(root, "fp32_zero0"), os.path.join(root, "outside"))
    os.makedirs(os.path.join(root, "inner"))
    with open(os.path.join(root, "inner", "latest"), "w") as f:
        f.write("../outside/global_step1")
    out["traversal"] = refused(fp32, os.path.join(root, "inner"))
    damaged = os.path.join(root, "damaged")
    shutil.copytree(os.path.join(root, "fp32_zero1"), damaged)
    open(os.path.join(damaged, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "w").close()
    out["damaged"] = refused(engine_for(False, 1), damaged)
    return out


def misuse_run() -> dict:
    """What the engine refuses or reports instead of doing silently wrong, in one launch:
    the slow-link warning at start-up, DeepSpeed's own loop, and a NaN loss."""
    import warnings

    import oases_ds

    def tmp2(**extra) -> dict:
        return {"enabled": True, "tensor_parallel_size": 2, "seed": 7, "process_group_timeout_s": 120, **extra}

    out: dict = {}
    # 1e-7 Gbit/s: one sub-batch's [2, 8, 32] fp32 activations take ~160 s, over the 120 s timeout.
    # This engine only starts (a step at that speed would take minutes).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oases_ds.initialize(model=tiny_config("gpt"), optimizer=sgd,
                            config=ds_config(4, 1, oases=tmp2(link={"bandwidth_gbps": 1e-7})))
    out["link_warnings"] = [str(w.message) for w in caught if str(w.message).startswith("oases.link")]

    engine, *_ = oases_ds.initialize(model=tiny_config("gpt"), optimizer=sgd, config=ds_config(4, 1, oases=tmp2()))
    batch = make_batch(tiny_config("gpt"), 4, 0)
    refused = {}
    for name, call in (("forward", lambda: engine(batch)),
                       ("backward", lambda: engine.backward(torch.ones((), requires_grad=True))),
                       ("step", lambda: engine.step())):
        try:
            call()
            refused[name] = "no error"
        except RuntimeError as err:
            refused[name] = str(err)
    out["refused"], out["steps_after_refusals"] = refused, engine.global_steps
    with torch.no_grad():  # evaluation stays allowed
        out["no_grad_forward"] = float(engine(batch))
    out["first_loss"] = float(engine.train_batch(batch))
    with torch.no_grad():
        engine.module.head.norm.weight.fill_(float("nan"))
    try:
        engine.train_batch(make_batch(tiny_config("gpt"), 4, 1))
        out["nan"] = "no error"
    except FloatingPointError as err:
        out["nan"] = f"{type(err).__name__}: {err}"
    out["global_steps"] = engine.global_steps
    return out


def host_sync_run() -> dict:
    """Two steps of 2 micro-batches each with the engine's per-micro-batch hot path (the
    schedule, the surrogate, DeepSpeed's backward) under the host-sync guard, then a step
    whose second micro-batch has no labelled token."""
    import oases_ds
    from support import forbid_host_sync

    oases = {"enabled": True, "tensor_parallel_size": 2, "seed": 7, "process_group_timeout_s": 120}
    engine, *_ = oases_ds.initialize(model=tiny_config("gpt"), optimizer=sgd, config=ds_config(4, 2, oases=oases))
    unguarded, guarded = engine._run_schedule, []

    def run_schedule(*args, **kwargs):
        with forbid_host_sync():
            loss = unguarded(*args, **kwargs)
        guarded.append(loss.detach())
        return loss

    engine._run_schedule = run_schedule  # an instance attribute: this engine only
    losses = [float(engine.train_batch(make_batch(tiny_config("gpt"), 8, step))) for step in range(2)]
    out = {"losses": losses, "guarded": len(guarded), "stats": engine.last_stats}
    batch = make_batch(tiny_config("gpt"), 8, 2)
    batch["labels"][4:] = -100  # micro-batch 1 of the step
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.train_batch(batch)
        out["empty"] = "no error"
    except ValueError as err:
        out["empty"] = str(err)
    out["weights_unchanged"] = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    out["global_steps"] = engine.global_steps
    return out


def guarded_engine_run(check_collectives: bool, steps: int = 2) -> dict:
    """OasesEngine (TMP 2, DP over the rest, the overlapped DP reduction) with the oases
    section's ``check_collectives``; returns the losses, whether guard mode is on (the
    section or ``$OASES_CHECK_COLLECTIVES``) and the labels the flight recorder kept."""
    import oases_ds

    oases = {"enabled": True, "tensor_parallel_size": 2, "seed": 7, "process_group_timeout_s": 60,
             "check_collectives": check_collectives}
    engine, *_ = oases_ds.initialize(model=tiny_config("gpt"), optimizer=sgd, config=ds_config(4, 1, oases=oases))
    ctx = engine.parallel_context
    losses = []
    for step in range(steps):
        full = make_batch(tiny_config("gpt"), 4 * ctx.dp_size, step)
        losses.append(float(engine.train_batch({k: v[ctx.dp_rank * 4:(ctx.dp_rank + 1) * 4] for k, v in full.items()})))
    eval_loss = float(engine.eval_batch(make_batch(tiny_config("gpt"), 4, 999)))
    recorder = engine.oases_comm.recorder
    return {"guard": engine.oases_comm.guard is not None, "losses": losses, "eval_loss": eval_loss,
            "labels": sorted({r.label.split(" sb")[0] for r in recorder.records}),
            "steps": sorted({r.step for r in recorder.records}), "dp_overlap": engine.dp_reducer is not None}


def oases_runs(runs: list[tuple]) -> list[dict]:
    """:func:`oases_run` of each argument tuple in turn, in one launch: the ranks import torch and
    DeepSpeed once for all of them (a launch costs seconds of imports on a small CPU machine).
    Each run builds its own engine and groups; none shares state with the one before."""
    return [oases_run(*args) for args in runs]



def fp16_run(runs: list[dict]) -> list[dict]:
    """Each of ``runs`` (keyword arguments of :func:`_fp16_one`) in turn, in one launch."""
    return [_fp16_one(**run) for run in runs]


def _fp16_engine(precision: str, zero: int, micro: int = 4, tp: int = 2, model: dict | None = None,
                 initial_scale_power: int = 8, pipeline_stages: int = 1, optimizer: str = "adamw"):
    """OasesEngine in ``precision`` ("fp16" with DeepSpeed's dynamic loss scaling, "bf16" or
    "fp32") on ``model`` (default: the tiny GPT), with AdamW or :func:`sgd`."""
    import oases_ds
    from oases_ds.models.config import ModelConfig

    cfg_model = ModelConfig(**model) if model else tiny_config("gpt")
    cfg = ds_config(micro, 1, zero, clip=1.0, oases={"enabled": True, "tensor_parallel_size": tp, "seed": 7,
                                                     "process_group_timeout_s": 120, "pipeline_stages": pipeline_stages})
    if optimizer == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    if precision == "fp16":  # hysteresis 1: the first overflow halves the scale (DeepSpeed's ZeRO default is 2)
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": initial_scale_power,
                       "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = oases_ds.initialize(model=cfg_model, config=cfg, optimizer=sgd if optimizer == "sgd" else None)
    return engine, cfg_model


def _fp16_train(engine, cfg_model, steps: range, micro: int = 4, inject: tuple[int, int] | None = None) -> dict:
    """Train ``steps`` (0-based batch indices); per step the loss, the loss scale the step ran
    at, whether DeepSpeed skipped it, the scale after it and whether any parameter changed.
    ``inject = (step, rank)``: after the schedule of that step that global rank alone puts an
    inf into one gradient element, before DeepSpeed sees the gradients."""
    ctx = engine.parallel_context
    name = "run_step" if engine.pipelined else "run"
    run = getattr(engine.executor, name)
    step_now = [0]

    def injected(*args, **kwargs):
        loss = run(*args, **kwargs)
        if inject is not None and step_now[0] == inject[0] and ctx.rank == inject[1]:
            grad = next(p.grad for p in engine.module.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        return loss

    setattr(engine.executor, name, injected)
    out: dict[str, list] = {"losses": [], "scales_run": [], "scales_after": [], "skipped": [], "changed": []}
    for step in steps:
        step_now[0] = step
        full = make_batch(cfg_model, micro * ctx.dp_size, step)
        before = [p.detach().clone() for p in engine.module.parameters()]
        out["losses"].append(float(engine.train_batch({k: v[ctx.dp_rank * micro:(ctx.dp_rank + 1) * micro]
                                                       for k, v in full.items()})))
        out["scales_run"].append(engine.last_stats["loss_scale"])
        out["skipped"].append(int(engine.last_stats["skipped"]))
        out["scales_after"].append(engine.current_loss_scale())
        out["changed"].append(any(not torch.equal(b, p.detach()) for b, p in zip(before, engine.module.parameters())))
    setattr(engine.executor, name, run)
    return out


def _fp16_one(precision: str, zero: int, steps: int, micro: int = 4, inject: tuple[int, int] | None = None,
              **engine_args) -> dict:
    """:func:`_fp16_train` of ``steps`` steps on a new :func:`_fp16_engine`, with its final full parameters."""
    engine, cfg_model = _fp16_engine(precision, zero, micro, **engine_args)
    ctx = engine.parallel_context
    out = _fp16_train(engine, cfg_model, range(steps), micro, inject)
    return {**out, "rank": ctx.rank, "skipped_steps": engine.skipped_steps,
            "dtype": str(next(engine.module.parameters()).dtype), "optimizer": type(engine.optimizer).__name__,
            "params": _full_params(engine, ctx)}


def _scaler_state(engine) -> dict:
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None) or opt.loss_scale_config
    return {"cur_scale": float(scaler.cur_scale), "cur_iter": int(scaler.cur_iter),
            "last_overflow_iter": int(scaler.last_overflow_iter)}


def fp16_checkpoint_run(root: str) -> dict:
    """fp16 at TMP 2, ZeRO 0: 3 steps, an overflow at step 1 (scale 256 -> 128), saved; then
    resumed in the same layout (DeepSpeed's own files) and at TMP 1 x DP 2 under ZeRO-2 (the
    portable state).  Returns each engine's scaler state and, for the resumed ones, the next
    step's scale.  Run on 2 ranks."""
    engine, cfg_model = _fp16_engine("fp16", 0)
    _fp16_train(engine, cfg_model, range(3), inject=(1, 0))
    engine.save_checkpoint(root)
    out = {"saved": _scaler_state(engine)}
    for label, tp, zero in (("native", 2, 0), ("portable", 1, 2)):
        engine, cfg_model = _fp16_engine("fp16", zero, tp=tp)
        engine.load_checkpoint(root)
        out[label] = {**_scaler_state(engine), "global_steps": engine.global_steps,
                      "next": _fp16_train(engine, cfg_model, range(3, 4))}
    return out


def link_limit_run(bandwidth_gbps: float) -> dict:
    """The tiny GPT at TMP 2 on a link emulated at ``bandwidth_gbps`` (no latency), 2 steps:
    the last step's stats and the communicator's payload bytes per (phase, kind)."""
    import oases_ds

    cfg = ds_config(4, 1, oases={"enabled": True, "tensor_parallel_size": 2, "seed": 7,
                                 "link": {"bandwidth_gbps": bandwidth_gbps, "latency_us": 0.0, "sharing": "ring"}})
    engine, *_ = oases_ds.initialize(model=tiny_config("gpt"), optimizer=sgd, config=cfg)
    for step in range(2):
        engine.train_batch(make_batch(tiny_config("gpt"), 4, step))
    return {"stats": dict(engine.last_stats), "bytes": {f"{p}/{k}": b for (p, k), b in engine.oases_comm.stats.bytes.items()}}
