"""Oases: overlapped, automatically planned tensor-model-parallel training for DeepSpeed.

``oases_ds.initialize`` is a drop-in for ``deepspeed.initialize``: same
arguments, same return tuple.  With ``"oases": {"enabled": true, ...}`` in the
DeepSpeed config it returns an :class:`~oases_ds.engine.OasesEngine`; without it,
a plain ``DeepSpeedEngine``, so one script runs either way.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
from typing import Any

from oases_ds._deepspeed_compat import choose_deepspeed_defaults, quiet_deepspeed_deprecations, quiet_scheduler_start
from oases_ds.config import (OasesConfig, OasesConfigError, check_batch_section, check_deepspeed_section,
                             parse_oases_section)
from oases_ds.hf import SUPPORTED, HFCheckpoint, is_hf_model
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext, check_devices
from oases_ds.planner.plan import Plan

__all__ = ["initialize", "build_model", "HFCheckpoint", "ModelConfig", "OperatorModel", "OasesConfig", "OasesConfigError", "ParallelContext"]
__version__ = "0.1.0"


def _load_config(args: Any, config: Any, config_params: Any) -> dict:
    config = config if config is not None else config_params
    if config is None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
    if config is None:
        raise OasesConfigError("no DeepSpeed config: pass config=<dict or path> or args.deepspeed_config")
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise OasesConfigError(f"config must be a dict or a JSON path, got {type(config).__name__}")
    return copy.deepcopy(config)


def build_model(model: ModelConfig, ctx: ParallelContext, oases: OasesConfig) -> OperatorModel:
    """This rank's shard of ``model``: every block at the TMP degree, or at the degrees
    of ``oases.plan``; with pipeline stages, only this rank's stage's layers."""
    stage = oases.stages(model.num_layers)[ctx.pp_rank]
    try:
        plan = Plan.read("oases.plan", oases.plan) if oases.plan else None
    except ValueError as err:  # names oases.plan already
        raise OasesConfigError(str(err)) from None
    try:
        if plan is None:
            return OperatorModel(model, group=ctx.tp_group, seed=oases.seed, stage=stage,
                                 sequence_parallel=oases.sequence_parallel)
        return OperatorModel.for_plan(model, ctx, plan, seed=oases.seed, stage=stage,
                                      sequence_parallel=oases.sequence_parallel)
    except ValueError as err:
        raise OasesConfigError(f"oases.plan={oases.plan}: {err}" if oases.plan else f"oases.{err}"
                               if str(err).startswith("sequence_parallel") else f"model: {err}") from None


def with_planned_stages(oases: OasesConfig, prefix: str = "oases.") -> OasesConfig:
    """``oases`` with the stage split its plan carries.

    ``oases-plan pipeline_stages=P`` balances the stages by the profiled costs and writes the
    split into the plan (``Plan.stage_layers``); a run given that plan takes the split unless
    ``oases.pipeline_layers`` names one, and a plan made for another stage count is refused
    in one line (its degrees and memory were chosen for other stages).  ``prefix`` is how the
    error names the keys: ``oases.`` in a DeepSpeed JSON, nothing on the ``oases-train`` line."""
    if not oases.plan:
        return oases
    try:
        plan = Plan.read(f"{prefix}plan", oases.plan)
    except ValueError:
        return oases  # build_model / the CLI report an unreadable plan in one line
    if plan.stages != oases.pipeline_stages:
        raise OasesConfigError(f"{prefix}plan={oases.plan} was planned for {plan.stages} pipeline stages; this run has "
                               f"{prefix}pipeline_stages={oases.pipeline_stages}: plan again with pipeline_stages="
                               f"{oases.pipeline_stages} or run with pipeline_stages={plan.stages}")
    if oases.pipeline_layers is None and plan.stage_layers is not None:
        return oases.model_copy(update={"pipeline_layers": list(plan.stage_layers)})
    return oases


def _hf_checkpoint(model: Any) -> HFCheckpoint | None:
    """``model`` as a Hugging Face checkpoint to convert, if it is one (a ``transformers``
    model object or an :class:`HFCheckpoint`); an unsupported class is one line."""
    if isinstance(model, HFCheckpoint):
        return model
    if not is_hf_model(model):
        return None
    try:
        return HFCheckpoint(model)
    except ValueError as err:
        raise OasesConfigError(f"model: {err}") from None


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    parallel_context: ParallelContext | None = None,
):
    """Same signature and return tuple as ``deepspeed.initialize``.

    ``model`` is a :class:`ModelConfig` (Oases builds this rank's shard of it), an
    :class:`OperatorModel` already built on ``parallel_context``'s TMP group, or a
    Hugging Face model -- a ``transformers`` model object of a class in
    :data:`oases_ds.hf.SUPPORTED`, or an :class:`HFCheckpoint` (a local directory,
    config overrides) -- converted to its ``ModelConfig`` with this rank's slices of
    its weights loaded before the engine sees them.
    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    """
    # DeepSpeed (and the engine, which imports it) load here, not at the top: every
    # ``oases_ds.*`` import runs this file, and importing DeepSpeed takes seconds and
    # fixes its accelerator (DS_ACCELERATOR) for the process.
    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = _load_config(args, config, config_params)
    oases = with_planned_stages(parse_oases_section(cfg.pop("oases", None)))
    check_batch_section(cfg)
    choose_deepspeed_defaults(cfg)
    if args is not None and getattr(args, "deepspeed_config", None):
        args = copy.copy(args)
        args.deepspeed_config = None  # the dict we pass wins; DeepSpeed refuses both
    port = distributed_port or TORCH_DISTRIBUTED_DEFAULT_PORT
    common = dict(args=args, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
                  lr_scheduler=lr_scheduler, dist_init_required=dist_init_required, collate_fn=collate_fn)
    checkpoint = _hf_checkpoint(model)
    if checkpoint is not None:
        model = checkpoint.config()
    if not oases.enabled:
        if isinstance(model, ModelConfig):
            model = OperatorModel(model, group=None, seed=oases.seed)
            if checkpoint is not None:
                checkpoint.load_into(model)
        with quiet_scheduler_start():
            return deepspeed.initialize(model=model, mpu=mpu, config=cfg, mesh_param=mesh_param, distributed_port=port,
                                        **common)

    from oases_ds.engine import OasesEngine  # local: imports DeepSpeed (see above)

    check_deepspeed_section(cfg)
    if isinstance(model, ModelConfig):
        oases.stages(model.num_layers)  # more stages than layers, a bad split: one line before any group is made
    if mpu is not None:
        raise OasesConfigError("mpu: Oases builds its own groups from oases.tensor_parallel_size; do not pass mpu")
    if get_accelerator().device_name() == "cuda":  # DeepSpeed binds cuda:LOCAL_RANK: "invalid device ordinal" beyond
        try:
            check_devices(int(os.environ.get("LOCAL_RANK", "0")) + 1, get_accelerator().device_count())
        except ValueError as err:
            raise OasesConfigError(str(err)) from None
    ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(), distributed_port=port,
                             dist_init_required=dist_init_required,
                             timeout=datetime.timedelta(seconds=oases.process_group_timeout_s))
    if parallel_context is None:
        try:
            ctx = ParallelContext.build(oases.tensor_parallel_size, oases.process_group_timeout_s,
                                        pipeline_stages=oases.pipeline_stages)
        except ValueError as err:  # the world does not divide into stages x TMP (the message names both keys)
            raise OasesConfigError(str(err)) from None
    else:
        ctx = parallel_context
    if ctx.tp_size != oases.tensor_parallel_size:
        raise OasesConfigError(
            f"oases.tensor_parallel_size={oases.tensor_parallel_size} but parallel_context has TMP size {ctx.tp_size}"
        )
    if ctx.pp_size != oases.pipeline_stages:
        raise OasesConfigError(
            f"oases.pipeline_stages={oases.pipeline_stages} but parallel_context has {ctx.pp_size} stage(s)")
    if isinstance(model, ModelConfig):
        model = build_model(model, ctx, oases)
        if checkpoint is not None:
            checkpoint.load_into(model)
    elif not isinstance(model, OperatorModel):
        raise OasesConfigError(
            f"model: Oases needs an oases_ds.ModelConfig, an OperatorModel or a Hugging Face model "
            f"({', '.join(SUPPORTED)}), got {type(model).__name__}"
        )
    if (model.stage.index, model.stage.stages) != (ctx.pp_rank, ctx.pp_size):
        raise OasesConfigError(f"model: built for pipeline stage {model.stage.index} of {model.stage.stages}, but this "
                               f"rank is stage {ctx.pp_rank} of {ctx.pp_size}; build it with stage=oases.stages(...)[pp_rank]")
    check_batch_section(cfg, ctx.dp_size)
    model_mpu = ctx.mpu()
    config_class = DeepSpeedConfig(cfg, model_mpu)
    quiet_deepspeed_deprecations()
    with quiet_scheduler_start():
        engine = OasesEngine(model=model, mpu=model_mpu, config=cfg, config_class=config_class, oases=oases,
                             parallel_context=ctx, **common)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
