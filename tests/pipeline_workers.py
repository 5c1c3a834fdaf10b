"""Rank-process functions for the pipeline-stage tests (started by ``oases_ds.launcher.launch``)."""
from __future__ import annotations

import os
import sys

import torch

from oases_ds.models.operator_model import OperatorModel
from oases_ds.models.stages import split_stages
from oases_ds.parallel.collectives import start_all_reduce
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.grads import average_data_parallel_grads
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.pipeline import PipelineExecutor, StageLinks
from oases_ds.schedule.generators import ScheduleSpec

sys.path.insert(0, os.path.dirname(__file__))
from dist_workers import gather_full_grads, make_batch, rel_err, tiny_config, variant_spec  # noqa: E402


def step_micro_batches(full: dict[str, torch.Tensor], micro_batches: int, micro: int, dp: int,
                       dp_rank: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """This DP rank's micro-batches of a global batch and their offsets in it, laid out as
    the engine lays them out: micro-batch ``a`` of DP rank ``r`` holds samples
    ``[(a * dp + r) * micro, ... + micro)``."""
    offsets = [(a * dp + dp_rank) * micro for a in range(micro_batches)]
    return [{k: v[o:o + micro] for k, v in full.items()} for o in offsets], offsets


def pipeline_parity_worker(tp: int, pp: int, families: list[str], schedules: list[str], pipelines: list[str],
                           steps: int, micro_batches: int, micro: int, layers: int = 4, lr: float = 0.05,
                           pipeline_layers: list[int] | None = None,
                           plan: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                           sequence_parallel: bool = False) -> dict:
    """Train each (family, TMP schedule, pipeline order) for ``steps`` SGD steps of
    ``micro_batches`` accumulated micro-batches on ``pp`` stages x ``tp`` TMP x DP, and
    compare after every step this stage's gradients (gathered over TMP, averaged over DP,
    divided by the micro-batch count) and the broadcast loss with an unsharded
    single-process reference trained on the whole global batch.  ``plan``: per-block TMP
    degrees (attention, MLP) of every layer, a heterogeneous plan cut into stages;
    ``sequence_parallel``: each stage splits the sequence between its blocks (and sends slices)."""
    from reference_models import ReferenceModel

    ctx = ParallelContext.build(tensor_parallel_size=tp, timeout_s=120, pipeline_stages=pp)
    dp, dp_rank = ctx.dp_size, ctx.dp_rank
    stage = split_stages(layers, pp, pipeline_layers)[ctx.pp_rank]
    results: dict = {}
    global_batch = micro * micro_batches * dp
    for family in families:
        cfg = tiny_config(family, 0.1, num_layers=layers)
        ref = ReferenceModel(cfg, seed=7)
        ref_rng = RNGTracker(seed=11)
        opt = torch.optim.SGD(ref.parameters(), lr=lr)
        ref_grads, ref_losses = [], []
        for step in range(steps):
            batch = make_batch(cfg, global_batch, step)
            opt.zero_grad()
            loss = ref(batch["tokens"], batch["labels"], ref_rng)
            loss.backward()
            ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            ref_losses.append(float(loss.detach()))
            opt.step()
            ref_rng.advance()
        for schedule in schedules:
            for pipeline in pipelines:
                if plan is None:
                    model = OperatorModel(cfg, group=ctx.tp_group, seed=7, stage=stage,
                                          sequence_parallel=sequence_parallel)
                else:
                    from oases_ds.planner.plan import Plan

                    model = OperatorModel.for_plan(cfg, ctx, Plan(plan[0], plan[1], devices=tp), seed=7, stage=stage)
                rng = RNGTracker(seed=11)
                ex = PipelineExecutor.for_pipeline(model, variant_spec(schedule), pipeline, micro_batches,
                                                   StageLinks.of(ctx), rng=rng)
                sgd = torch.optim.SGD(model.parameters(), lr=lr)
                worst_grad, worst_loss, worst_param = 0.0, 0.0, None
                for step in range(steps):
                    mbs, offsets = step_micro_batches(make_batch(cfg, global_batch, step), micro_batches, micro, dp,
                                                      dp_rank)
                    sgd.zero_grad()
                    loss = ex.run_step(mbs, offsets, global_batch)
                    for p in model.parameters():
                        p.grad /= micro_batches  # DeepSpeed's 1/gas
                    average_data_parallel_grads(model, ctx.dp_group)
                    grads = gather_full_grads(model, ctx)
                    floor = 1e-4 * float(torch.cat([g.flatten() for g in ref_grads[step].values()]).norm())
                    errs = {n: rel_err(g, ref_grads[step][n], floor) for n, g in grads.items()}
                    name = max(errs, key=errs.get)
                    if errs[name] > worst_grad:
                        worst_grad, worst_param = errs[name], name
                    mean_loss = float(start_all_reduce(loss, ctx.dp_group).wait()) / dp
                    worst_loss = max(worst_loss, abs(mean_loss - ref_losses[step]) / abs(ref_losses[step]))
                    sgd.step()
                    rng.advance()
                results[(family, schedule, pipeline)] = {
                    "grad_err": worst_grad, "loss_err": worst_loss, "worst_param": worst_param,
                    "params": sorted(grads), "all_params": sorted(ref_grads[0]), "stage": ctx.pp_rank,
                    "p2p_bytes": ex.comm.stats.bytes_in("pipeline"),
                }
    return results


def pipeline_engine_run(family: str, tp: int, pp: int, steps: int, micro: int, gas: int, schedule: str = "oases",
                        pipeline: str = "1f1b", zero: int = 0, save_dir: str | None = None,
                        resume: bool = False) -> dict:
    """OasesEngine with ``pp`` stages: ``steps`` optimizer steps of ``gas`` micro-batches
    (SGD with momentum, clipping on: ``engine_workers.ds_config``); returns this stage's
    full parameters after every step, the losses, the evaluated loss.  ``save_dir``:
    save after the steps (``resume``: load first, then train)."""
    import oases_ds
    from engine_workers import _full_params, ds_config, sgd

    oases = {"enabled": True, "tensor_parallel_size": tp, "pipeline_stages": pp, "pipeline_schedule": pipeline,
             "schedule": schedule, "seed": 7, "process_group_timeout_s": 120}
    engine, *_ = oases_ds.initialize(model=tiny_config(family), optimizer=sgd, config=ds_config(micro, gas, zero, oases=oases))
    ctx = engine.parallel_context
    if resume:
        engine.load_checkpoint(save_dir)
    params, losses = [], []
    start = engine.global_steps
    for step in range(start, start + steps):
        full = make_batch(tiny_config(family), micro * gas * ctx.dp_size, step)
        idx = torch.cat([torch.arange((a * ctx.dp_size + ctx.dp_rank) * micro, (a * ctx.dp_size + ctx.dp_rank + 1) * micro)
                         for a in range(gas)])
        losses.append(float(engine.train_batch({k: v[idx] for k, v in full.items()})))
        params.append(_full_params(engine, ctx))
    if save_dir is not None and not resume:
        engine.save_checkpoint(save_dir)
    per_rank = micro * gas
    full = make_batch(tiny_config(family), per_rank * ctx.dp_size, 999)
    mine = {k: v[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank] for k, v in full.items()}
    eval_loss = float(engine.eval_batch(mine))
    return {"engine": type(engine).__name__, "params": params, "losses": losses, "eval_loss": eval_loss,
            "stage": ctx.pp_rank, "global_steps": engine.global_steps, "stats": engine.last_stats,
            "partition_gradients": bool(getattr(engine.optimizer, "partition_gradients", False))}


def pipeline_engine_runs(runs: list[tuple]) -> list[dict]:
    """:func:`pipeline_engine_run` of each argument tuple in turn, in one launch (imports once)."""
    return [pipeline_engine_run(*args) for args in runs]


def pipeline_config_error(world_oases: dict, layers: int = 2) -> str:
    """The one-line error ``oases_ds.initialize`` raises for ``world_oases`` (or "no error")."""
    import oases_ds
    from engine_workers import ds_config

    try:
        oases_ds.initialize(model=tiny_config("gpt", num_layers=layers),
                            config=ds_config(2, 1, oases={"enabled": True, "process_group_timeout_s": 60, **world_oases}))
    except ValueError as err:
        return str(err)
    return "no error"


def load_refused(save_dir: str, pp: int) -> str:
    """Load a checkpoint with ``pp`` stages (TMP 1); the error line, or "loaded"."""
    import oases_ds
    from engine_workers import ds_config, sgd
    from oases_ds.checkpoint import CheckpointError

    oases = {"enabled": True, "pipeline_stages": pp, "seed": 7, "process_group_timeout_s": 60}
    engine, *_ = oases_ds.initialize(model=tiny_config("gpt"), optimizer=sgd, config=ds_config(2, 2, oases=oases))
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def lightning_pipeline_run(work_dir: str) -> dict:
    """Trainer(strategy=OasesStrategy(pipeline_stages=2)) on 2 CPU processes (TMP 1), and the
    same Trainer with TMP 2 and one stage, each 1 epoch of ``accumulate_grad_batches=2``;
    returns each rank's (this stage's) parameters of both runs and the logged losses."""
    import lightning_workers as lw
    from lightning_strategy import OasesStrategy

    TinyGPT, Record = lw._module_class(), lw._recorder()
    out: dict = {}
    for name, strategy in (("tmp2", OasesStrategy(tensor_parallel_size=2, seed=lw.SEED)),
                           ("pp2", OasesStrategy(pipeline_stages=2, seed=lw.SEED))):
        module = TinyGPT()
        module.batch_size = lw.MICRO // 2
        record = Record()
        trainer = lw._trainer(strategy, record, os.path.join(work_dir, name), epochs=1, accumulate=2)
        trainer.fit(module)
        ctx = trainer.strategy.parallel_context
        out[name] = {"params": lw.full_params(module.model), "losses": record.losses, "val_losses": record.val_losses,
                     "global_step": trainer.global_step, "layout": (ctx.pp_size, ctx.tp_size, ctx.dp_size),
                     "sampler": dict(trainer.strategy.distributed_sampler_kwargs)}
    return out


def pipeline_link_worker(bandwidth_gbps: float, steps: int, micro_batches: int, micro: int,
                         schedule: str = "oases") -> dict:
    """PP 2 x TMP 1 (2 ranks): the same ``steps`` SGD steps without a link and with an
    emulated one of ``bandwidth_gbps``; each run's step times, losses and final
    parameters, and the activation bytes stage 1 received per step."""
    import time

    from oases_ds.parallel.link import LinkModel

    ctx = ParallelContext.build(tensor_parallel_size=1, timeout_s=120, pipeline_stages=2)
    cfg = tiny_config("gpt", 0.1, num_layers=2, seq_len=16, hidden_size=64)
    stage = split_stages(cfg.num_layers, 2, None)[ctx.pp_rank]
    out: dict = {"stage": ctx.pp_rank}
    for name, link in (("plain", None), ("link", LinkModel(bandwidth_gbps, sharing="ring"))):
        model = OperatorModel(cfg, group=ctx.tp_group, seed=7, stage=stage)
        ex = PipelineExecutor.for_pipeline(model, ScheduleSpec(schedule), "1f1b", micro_batches,
                                           StageLinks.of(ctx), link, rng=RNGTracker(seed=11))
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        times, losses = [], []
        for step in range(steps):
            mbs, offsets = step_micro_batches(make_batch(cfg, micro * micro_batches, step), micro_batches, micro, 1, 0)
            sgd.zero_grad()
            torch.distributed.barrier()  # both stages start the step together
            t0 = time.perf_counter()
            losses.append(float(ex.run_step(mbs, offsets, micro * micro_batches)))
            times.append(time.perf_counter() - t0)
            sgd.step()
            ex.rng.advance()
        out[name] = {"times": times, "losses": losses,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                     "recv_bytes": ex.comm.stats.bytes_in("pipeline", "recv") // steps}
    return out
