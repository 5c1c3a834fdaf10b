"""``oases-train``: train a model family from the Hydra configs in ``configs/``.

Started plainly it launches ``nprocs`` rank processes itself (CPU: gloo); started
by ``torchrun`` or the ``deepspeed`` launcher it runs as one rank.  Rank 0
prints progress (step, loss, tokens/s, TMP bytes, exposed communication) and a
summary.  ``eval_every=N`` evaluates every N steps (and always after the last) on
one fixed held-out batch, windows no step trains on (:class:`oases_ds.data.TokenBatches`);
``metrics.csv`` / ``metrics.tensorboard`` log step, loss, eval_loss, lr and tokens/s
(:mod:`oases_ds.utils.metrics`).  ``model=hf model.path=DIR`` starts from a local Hugging Face
checkpoint (each rank reads only its slices); ``export_hf=DIR`` writes the trained model back
in that format (:mod:`oases_ds.hf`).  Hydra lives here and in ``configs/`` only; the library takes typed
configs.

A failing rank ends the run with one line, ``error: rank R: Type: message (full
traceback in <hydra output dir>/rankR-traceback.log)``, exit code 1; when ranks hung or
failed in a collective, the line ends with the first divergence of their flight records
(kept in the Hydra output dir; ``check_collectives=true``: guard mode, which fails in
seconds instead of waiting out ``timeout_s``);
``OASES_VERBOSE=1`` prints the traceback too.  Ctrl-C / SIGTERM end the launcher
and every rank with ``interrupted`` / ``terminated by SIGTERM`` and exit code 130 / 143.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import oases_ds
from oases_ds.cli import schema
from oases_ds.cli.common import CONFIG_DIR, fail, fail_launch, stop, strip_launcher_args
from oases_ds.cli.schema import ClusterSchema, DataSchema, MetricsSchema, ScheduleSchema, unset_schema_of
from oases_ds.config import (OasesConfigError, activation_all_reduce, check_deepspeed_section, parse_oases_section,
                             slow_link_message)
from oases_ds.data import DataConfig, TokenBatches, check_data
from oases_ds.hf import HFCheckpoint, hf_config, save_hf
from oases_ds.launcher import LaunchError, LaunchInterrupted, end_rank, launch, start_fork_server_early
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import check_sequence_parallel
from oases_ds.parallel.context import BACKEND_ENV, check_devices
from oases_ds.parallel.link import link_kwargs
from oases_ds.parallel.topology import Topology
from oases_ds.planner.costs import PRECISIONS
from oases_ds.planner.plan import Plan
from oases_ds.utils.io import write_json_atomic
from oases_ds.utils.metrics import MetricsLog, check_csv, check_tensorboard


# -- typed schema: Hydra converts or rejects every value by type before anything runs -------------
TrainModelSchema = unset_schema_of(ModelConfig, "TrainModelSchema", [("path", Optional[str], None)])
"""``ModelConfig``'s fields, unset unless given (unset: the library's default, or with ``model=hf``
the checkpoint's value), plus ``path``: the local Hugging Face model directory of ``model=hf``
(``family: hf``; the family itself comes from the checkpoint)."""


@dataclass
class CheckpointSchema:
    dir: Optional[str] = None
    every: int = 0
    keep: int = 0  # newest checkpoints kept in dir; 0 keeps all
    resume: bool = False  # from dir's latest; another layout (TMP degree, plan, stages, DP, ZeRO) needs its portable state
    portable: bool = True  # also save every parameter's full value and optimizer state (oases_ds.checkpoint.portable)


@dataclass
class TrainSchema:
    """configs/train.yaml, typed; the comments there say what each key means."""

    model: TrainModelSchema = field(default_factory=TrainModelSchema)
    schedule: ScheduleSchema = field(default_factory=ScheduleSchema)
    cluster: ClusterSchema = field(default_factory=ClusterSchema)
    data: DataSchema = field(default_factory=DataSchema)
    nprocs: int = 2
    tensor_parallel_size: int = 2
    pipeline_stages: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_layers: Optional[List[int]] = None
    steps: int = 60
    micro_batch: int = 8
    grad_accum: int = 1
    overlap_micro_batches: bool = False
    lr: float = 2.0e-3
    warmup_steps: int = 10
    zero_stage: int = 0
    offload: bool = False
    plan: Optional[str] = None
    memory_limit: Any = None  # with plan=auto: bytes or a string such as 2GiB (schema.parse_bytes)
    bf16: bool = False
    fp16: bool = False
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 0
    metrics: MetricsSchema = field(default_factory=MetricsSchema)
    timeout_s: float = 600.0
    check_collectives: bool = False
    check_batch: bool = True
    sequence_parallel: bool = False
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    trace: Optional[str] = None
    stats_out: Optional[str] = None
    export_hf: Optional[str] = None


ConfigStore.instance().store(name="train_schema", node=TrainSchema)

RANGES: dict[str, float] = {"nprocs": 1, "tensor_parallel_size": 1, "pipeline_stages": 1, "steps": 1, "micro_batch": 1, "grad_accum": 1,
                            "warmup_steps": 0, "log_every": 1, "eval_every": 0, "checkpoint.every": 0, "checkpoint.keep": 0}
"""Smallest value of each numeric key (``lr`` and ``timeout_s`` must be > 0)."""


def model_source(model: dict[str, Any]) -> ModelConfig | HFCheckpoint:
    """What ``model.*`` describes: a :class:`ModelConfig` of the given keys, or with
    ``model.path`` a Hugging Face checkpoint whose config the given keys override."""
    given = {key: value for key, value in model.items() if value is not None and key not in ("path", "family")}
    family = model.get("family")
    if family != "hf":
        if model.get("path"):
            raise ValueError(f"model.path is set but model.family={family}; start from a Hugging Face directory "
                             f"with model=hf model.path=DIR")
        return ModelConfig(**({"family": family} if family else {}), **given)
    if not model.get("path"):
        raise ValueError("model.path is not set; model=hf needs a local Hugging Face model directory "
                         "(config.json + safetensors), e.g. model.path=runs/tiny_llama")
    try:
        return HFCheckpoint(model["path"], given)
    except ValueError as err:
        raise ValueError(f"model.path={model['path']}: {err}") from None


def model_config(model: dict[str, Any]) -> ModelConfig:
    source = model_source(model)
    if not isinstance(source, HFCheckpoint):
        return source
    try:
        return source.config()
    except ValueError as err:
        raise ValueError(f"model.path={model['path']}: {err}") from None


def states_label(engine: Any) -> str:
    """Where the run keeps its model states, for the header: ``ZeRO-2, AdamW in host memory |``
    (the optimizer DeepSpeed built, so an offload without its CPU Adam shows); empty at ZeRO 0."""
    stage = engine.zero_optimization_stage()
    if not stage:
        return ""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    where = " in host memory" if getattr(engine.optimizer, "cpu_offload", False) else ""
    return f"ZeRO-{stage}, {type(inner).__name__}{where} | "


def precision(cfg: dict) -> str:
    """The run's training precision, as checkpoints and the planner name it."""
    return "bf16" if cfg["bf16"] else "fp16" if cfg["fp16"] else "fp32"


def ds_config(cfg: dict) -> dict:
    """The DeepSpeed JSON this run would use (with its "oases" section)."""
    sched, link = cfg["schedule"], cfg["cluster"].get("link")
    return {
        "train_micro_batch_size_per_gpu": cfg["micro_batch"],
        "gradient_accumulation_steps": cfg["grad_accum"],
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg["lr"], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": cfg["lr"],
                                                       "warmup_num_steps": cfg["warmup_steps"]}},
        "zero_optimization": {"stage": cfg["zero_stage"],
                              **({"offload_optimizer": {"device": "cpu"}} if cfg["offload"] else {})},
        "bf16": {"enabled": cfg["bf16"]},
        # DeepSpeed's dynamic loss scale at its defaults (2^16, halved on overflow, doubled after 1000 clean steps)
        **({"fp16": {"enabled": True}} if cfg["fp16"] else {}),
        "oases": {
            "enabled": True,
            "tensor_parallel_size": cfg["tensor_parallel_size"],
            "schedule": sched["name"],
            "sub_batches": sched["sub_batches"],
            "cross_pass": sched["cross_pass"],
            "fine_grained_recompute": sched["fine_grained_recompute"],
            "seed": cfg["seed"],
            "process_group_timeout_s": cfg["timeout_s"],
            "check_collectives": cfg["check_collectives"],
            "check_batch": cfg["check_batch"],
            "sequence_parallel": cfg["sequence_parallel"],
            "portable_checkpoint": cfg["checkpoint"].get("portable", True),
            **({"link": link_kwargs(link)} if link else {}),
            **({"plan": cfg["plan"]} if cfg.get("plan") else {}),
            "pipeline_stages": cfg["pipeline_stages"],
            "pipeline_schedule": cfg["pipeline_schedule"],
            "overlap_micro_batches": cfg["overlap_micro_batches"],
            **({"pipeline_layers": list(cfg["pipeline_layers"])} if cfg.get("pipeline_layers") else {}),
        },
    }


def run_topology(cfg: dict) -> Topology:
    """The run's grid of ranks, checked: torchrun's ``WORLD_SIZE`` where a launcher set it,
    else ``nprocs``; the DP size priced by ``plan=auto`` and recorded in checkpoints is its."""
    world = int(os.environ.get("WORLD_SIZE", cfg["nprocs"]))
    return Topology(world, cfg["tensor_parallel_size"], cfg["pipeline_stages"])


def cuda_ranks() -> bool:
    """Whether this run's ranks will sit on GPUs: CUDA is visible and DeepSpeed is not told
    to use its CPU accelerator (``CUDA_VISIBLE_DEVICES=`` or ``DS_ACCELERATOR=cpu`` train on CPU)."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def check_gpu_count(cfg: dict) -> None:
    """On GPU ranks (:func:`cuda_ranks`), one GPU per rank of this host (:func:`check_devices`)."""
    if cuda_ranks():
        check_devices(int(os.environ.get("LOCAL_WORLD_SIZE", cfg["nprocs"])), torch.cuda.device_count())


def validate(cfg: dict) -> None:
    """Fail before launching anything, with one line naming the field: a rank that finds a
    bad value fails alone, after every other rank has started and waits for it."""
    # Local: oases_ds.checkpoint imports DeepSpeed (seconds); a typo'd key fails before that.
    from oases_ds.checkpoint import CheckpointMeta, preflight

    schema.check_ranges(cfg, RANGES, positive=("lr", "timeout_s"))
    model = model_config(cfg["model"])
    if cfg["export_hf"] and cfg["pipeline_stages"] > 1:
        raise ValueError(f"export_hf={cfg['export_hf']}: not supported with pipeline_stages={cfg['pipeline_stages']} "
                         f"(each stage holds only its layers); export from a run with pipeline_stages=1")
    if cfg["export_hf"]:
        try:
            hf_config(model)
        except ValueError as err:
            raise ValueError(f"export_hf={cfg['export_hf']}: {err}") from None
    ds = ds_config(cfg)
    oases = parse_oases_section(ds["oases"])
    check_deepspeed_section(ds)
    check_data(DataConfig(**cfg["data"]), model.vocab_size, model.seq_len, masked_lm=model.family == "bert")
    check_csv(cfg["metrics"]["csv"])
    check_tensorboard(cfg["metrics"]["tensorboard"])
    topology = run_topology(cfg)
    check_gpu_count(cfg)
    if not oases.plan:
        model.check_tp(oases.tensor_parallel_size)
    stages = oases.stages(model.num_layers)
    replicas = 1
    schedule = oases.schedule_spec()
    if oases.plan:
        plan = Plan.read("plan", oases.plan)
        if plan.layers != model.num_layers or plan.devices != oases.tensor_parallel_size:
            raise ValueError(f"plan={oases.plan} is for {plan.layers} layers on {plan.devices} devices; this run has "
                             f"model.num_layers={model.num_layers}, tensor_parallel_size={oases.tensor_parallel_size}")
        try:  # every degree the plan uses, before any rank starts
            model.check_degrees(oases.tensor_parallel_size, plan.attn_degrees, plan.mlp_degrees)
        except ValueError as err:
            raise ValueError(f"plan={oases.plan}: {err}") from None
        try:
            stages = oases_ds.with_planned_stages(oases, prefix="").stages(model.num_layers)
        except OasesConfigError as err:
            raise ValueError(str(err)) from None
        replicas = plan.devices // min(plan.block_degrees())
        from oases_ds.engine import overridden_sub_batches, planned_schedule  # DeepSpeed loads here, where the run needs it anyway

        try:  # store policies need a schedule that stores blocks: refused here, not on every rank
            schedule = planned_schedule(oases, prefix="")
        except OasesConfigError as err:
            raise ValueError(str(err)) from None
        overridden = overridden_sub_batches(oases, schedule)
        if overridden:
            print(f"oases-train: {overridden}", file=sys.stderr)
    if oases.sequence_parallel and oases.tensor_parallel_size > 1:  # the sequence splits evenly, one degree throughout
        check_sequence_parallel(model, oases.tensor_parallel_size, plan.block_degrees() if oases.plan else [])
    sub_batches = schedule.effective_sub_batches
    if cfg["micro_batch"] % (sub_batches * replicas):
        source = (f"plan={oases.plan}'s sub_batches={sub_batches} (chosen by oases-plan)"
                  if sub_batches != oases.schedule_spec().effective_sub_batches else f"schedule.sub_batches={sub_batches}")
        what = source + (f" x {replicas} replicas of the plan's lowest-degree block" if replicas > 1 else "")
        raise ValueError(f"micro_batch={cfg['micro_batch']} is not divisible by {what}")
    if oases.link:  # else every rank starts, then waits out timeout_s on its first collective
        element_size = PRECISIONS[precision(cfg)]
        slow = slow_link_message(oases.link.model(), oases.process_group_timeout_s,
                                 [activation_all_reduce(model, cfg["micro_batch"], sub_batches, oases.tensor_parallel_size,
                                                        element_size)],
                                 bandwidth_key="cluster.link.bandwidth_gbps", timeout_key="timeout_s")
        if slow:
            raise ValueError(slow)
    ckpt = cfg["checkpoint"]
    expected = CheckpointMeta.build(model, oases.tensor_parallel_size, plan.block_degrees() if oases.plan else None,
                                    precision(cfg), cfg["zero_stage"],
                                    topology.dp_size,
                                    [len(s.layers) for s in stages])
    preflight(ckpt["dir"], ckpt["resume"], expected)


def check_auto_plan(cfg: dict) -> tuple[float, ModelConfig] | None:
    """The memory limit of ``plan=auto`` and the model to plan (None without it), after every cheap
    check that can refuse it: profiling starts rank processes and may take minutes, so a run it
    cannot serve fails first."""
    limit = schema.parse_bytes("memory_limit", cfg["memory_limit"])
    if cfg["plan"] != "auto":
        if limit is not None:
            raise ValueError(f"memory_limit={cfg['memory_limit']} is read only by plan=auto; add plan=auto to plan "
                             f"each block's degree and recompute policy for it, or drop memory_limit")
        return None
    if limit is None:
        raise ValueError("plan=auto needs memory_limit, the per-device bytes the plan may use (e.g. memory_limit=20GiB)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ValueError("plan=auto profiles with ranks of its own, so it cannot run under torchrun or the deepspeed "
                         "launcher: run `oases-plan planner.recompute=auto memory_limit=... out=plan.json` first and "
                         "pass plan=plan.json")
    if cfg["pipeline_stages"] > 1:
        raise ValueError(f"plan=auto plans one TMP group, not pipeline_stages={cfg['pipeline_stages']}: plan the "
                         f"stages with `oases-plan pipeline_stages={cfg['pipeline_stages']} ...` and pass plan=FILE")
    if cfg["schedule"]["name"] != "oases":
        raise ValueError(f"plan=auto chooses between storing and Oases' recompute per block, which needs "
                         f"schedule=oases, not schedule={cfg['schedule']['name']}")
    if cfg["overlap_micro_batches"] and cfg["grad_accum"] > 1:
        raise ValueError("plan=auto fits one micro-batch's activations to memory_limit, but overlap_micro_batches=true "
                         "keeps two in flight; plan with oases-plan for half the memory and pass plan=FILE, or turn "
                         "overlap_micro_batches off")
    schema.check_ranges(cfg, RANGES, positive=("lr", "timeout_s"))
    model = model_config(cfg["model"])
    model.check_tp(cfg["tensor_parallel_size"])
    run_topology(cfg)
    check_gpu_count(cfg)  # the profiling ranks take a GPU each, as the training ranks will
    return limit, model


@contextlib.contextmanager
def _profiling_on_the_training_device() -> Iterator[None]:
    """``plan=auto``'s profiling ranks on the device the training ranks will use.

    Why: the training ranks follow DeepSpeed's accelerator (:func:`cuda_ranks`), the profiling
    ranks the process-group backend (:func:`~oases_ds.parallel.context.resolve_backend`, NCCL on
    a CUDA host).  On a GPU host told to train on the CPU (``DS_ACCELERATOR=cpu``) the plan
    would be priced on the GPUs.  So there the profiling launch gets ``OASES_BACKEND=gloo``
    (CPU ranks), unless the user set a backend; the launcher hands its environment to ranks."""
    if cuda_ranks() or BACKEND_ENV in os.environ:
        yield
        return
    os.environ[BACKEND_ENV] = "gloo"
    try:
        yield
    finally:
        os.environ.pop(BACKEND_ENV, None)


def auto_plan(cfg: dict, model: ModelConfig, limit: float, out: str) -> str:
    """``plan=auto``: profile this run's layer under every TMP degree up to ``tensor_parallel_size``
    (or reuse ``.oases/profiles``), let the planner choose each block's degree and policy (``store``
    or ``oases``) within ``limit``, print the plan as ``oases-plan`` does and write it to ``out``,
    which the run then trains with (and a later run can pass as ``plan=``)."""
    from oases_ds.parallel.link import link_from_config
    from oases_ds.planner.costs import ModelStates
    from oases_ds.planner.plan import PlanInfeasibleError
    from oases_ds.planner.planning import PlanRequest, make_plan, plan_lines
    from oases_ds.planner.profile import ProfileSpec
    from oases_ds.schedule.generators import ScheduleSpec

    spec = ProfileSpec(model=model, devices=cfg["tensor_parallel_size"],
                       micro_batch=cfg["micro_batch"], schedule=ScheduleSpec.from_mapping(cfg["schedule"]),
                       link=link_from_config(cfg["cluster"].get("link")), cluster=cfg["cluster"]["name"],
                       sequence_parallel=cfg["sequence_parallel"])
    states = ModelStates(precision(cfg), cfg["zero_stage"], cfg["offload"],
                         run_topology(cfg).dp_size)  # as this run holds them
    request = PlanRequest(profile=spec, memory_limit_bytes=limit, recompute="auto", timeout_s=cfg["timeout_s"],
                          model_states=states)
    print(f"oases-train: plan=auto: planning degrees and recompute policies for memory_limit="
          f"{limit / 2**20:.1f} MiB per device ({spec.key()}) ...", flush=True)
    try:
        with _profiling_on_the_training_device():
            result = make_plan(request)
    except PlanInfeasibleError as err:
        raise ValueError(f"memory_limit={cfg['memory_limit']}: {err}") from None
    print("\n".join(plan_lines(result, request)), flush=True)
    result.plan.to_json(out)
    print(f"oases-train: plan=auto wrote {out}; training with it", flush=True)
    return out


def train_rank(cfg: dict) -> dict[str, Any]:
    """Everything one rank does; returns rank 0's summary (other ranks: their final loss)."""

    source = model_source(cfg["model"])
    model_cfg = source.config() if isinstance(source, HFCheckpoint) else source
    engine, *_ = oases_ds.initialize(model=source, config=ds_config(cfg))
    ctx = engine.parallel_context
    data = TokenBatches(DataConfig(**cfg["data"]), model_cfg.vocab_size, model_cfg.seq_len, masked_lm=model_cfg.family == "bert")
    ckpt = cfg["checkpoint"]
    if ckpt["resume"] and engine.load_checkpoint(ckpt["dir"])[0] is None:  # validate() saw one; it went away since
        raise FileNotFoundError(f"checkpoint.resume=true but checkpoint.dir={ckpt['dir']} holds no checkpoint")
    is_main = torch.distributed.get_rank() == 0
    gas, micro, dp = cfg["grad_accum"], cfg["micro_batch"], ctx.dp_size
    slots = gas * dp
    history, start_step = [], engine.global_steps
    link = cfg["cluster"].get("link")
    if is_main:
        label = f"EMULATED link {link['bandwidth_gbps']} Gbit/s" if link else "no link emulation"
        print(f"oases-train: {model_cfg.family} h={model_cfg.hidden_size} L={model_cfg.num_layers} | "
              f"{torch.distributed.get_world_size()} ranks = {f'PP {ctx.pp_size} x ' if ctx.pp_size > 1 else ''}"
              f"TMP {ctx.tp_size} x DP {dp} | schedule {cfg['schedule']['name']} | {states_label(engine)}"
              f"{label} | from step {start_step}", flush=True)
    # Every evaluation reads the same held-out batch (windows no training step reads), so eval losses compare.
    def evaluate() -> float:
        return float(engine.eval_batch(data.eval_batch(0, dp, ctx.dp_rank, micro)))

    metrics = MetricsLog(cfg["metrics"]["csv"], cfg["metrics"]["tensorboard"], start_step) if is_main else None
    evals: list[dict[str, float]] = []
    t_start = time.perf_counter()
    saved = False
    try:
        for step in range(start_step, cfg["steps"]):
            parts = [data.batch(step, slots, a * dp + ctx.dp_rank, micro) for a in range(gas)]
            batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            loss = float(engine.train_batch(batch))
            stats = dict(engine.last_stats, step=step + 1, lr=float(engine.get_lr()[0]))
            history.append(stats)
            if is_main and ((step + 1) % cfg["log_every"] == 0 or step == start_step or step + 1 == cfg["steps"]):
                scale = (f" | loss scale {stats['loss_scale']:g}{' (overflow: step skipped)' if stats['skipped'] else ''}"
                         if cfg["fp16"] else "")
                if link:  # the step against max(its work without waits, its traffic's time on the emulated link)
                    scale += (f" | {stats['step_s'] / stats['limit_s']:.2f}x the limit (work {stats['compute_only_s']:.2f} s, "
                              f"link {stats['link_s']:.2f} s)")
                print(f"step {step + 1:>5}/{cfg['steps']} | loss {loss:7.4f} | {stats['tokens_per_s']:>7,.0f} tok/s | "
                      f"TMP {stats['tmp_bytes'] / 2**20:7.2f} MiB/step | exposed comm {stats['exposed_comm_frac']:5.1%}"
                      f"{scale}", flush=True)
            eval_loss = None
            if (cfg["eval_every"] and (step + 1) % cfg["eval_every"] == 0) or step + 1 == cfg["steps"]:
                eval_loss = evaluate()
                evals.append({"step": step + 1, "eval_loss": eval_loss})
                if is_main:
                    print(f"eval {step + 1:>5}/{cfg['steps']} | held-out loss {eval_loss:7.4f}", flush=True)
            if metrics is not None:
                metrics.log(step + 1, loss, eval_loss, stats["lr"], stats["tokens_per_s"])
            saved = bool(ckpt["dir"] and ckpt["every"] and (step + 1) % ckpt["every"] == 0)
            if saved:
                engine.save_checkpoint(ckpt["dir"], keep=ckpt.get("keep", 0))
    finally:
        if metrics is not None:
            metrics.close()
    if ckpt["dir"] and history and not saved:  # the last step's checkpoint, unless just written
        engine.save_checkpoint(ckpt["dir"], keep=ckpt.get("keep", 0))
    eval_loss = evals[-1]["eval_loss"] if evals else evaluate()  # nothing trained (resumed at the end): still report one
    if cfg["trace"] and is_main:
        engine.save_trace(cfg["trace"])
    if cfg["export_hf"]:
        save_hf(engine, cfg["export_hf"])  # collective: every rank gathers its shards
    elapsed = time.perf_counter() - t_start
    done = history[-1] if history else {}
    summary = {
        "steps_run": len(history), "global_steps": engine.global_steps, "first_loss": history[0]["loss"] if history else None,
        "final_loss": done.get("loss"), "eval_loss": eval_loss, "evals": evals, "elapsed_s": elapsed,
        "median_tokens_per_s": sorted(h["tokens_per_s"] for h in history)[len(history) // 2] if history else 0.0,
        "schedule": cfg["schedule"]["name"], "emulated_link": bool(link),
        "skipped_steps": int(sum(h["skipped"] for h in history)),  # fp16 overflows this run (none in bf16/fp32)
        # on an emulated link: the median step over max(work without waits, link time of its traffic)
        "median_vs_limit": (sorted(h["step_s"] / h["limit_s"] for h in history)[len(history) // 2]
                            if history and link else None),
    }
    if is_main and cfg["stats_out"]:
        write_json_atomic(cfg["stats_out"], {"summary": summary, "history": history, "config": cfg})
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    if not summary.get("steps_run"):
        print(f"nothing to train: already at step {summary['global_steps']}")
        return
    print(f"done: {summary['steps_run']} steps in {summary['elapsed_s']:.1f}s | loss {summary['first_loss']:.4f} -> "
          f"{summary['final_loss']:.4f} | held-out loss {summary['eval_loss']:.4f} | "
          f"median {summary['median_tokens_per_s']:,.0f} tok/s | schedule {summary['schedule']}"
          f"{f' | median {limit:.2f}x the limit' if (limit := summary.get('median_vs_limit')) else ''}"
          f"{f' | {skipped} steps skipped (fp16 overflow)' if (skipped := summary.get('skipped_steps')) else ''}", flush=True)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_container(dcfg, resolve=True, throw_on_missing=True)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        if not under_torchrun:
            start_fork_server_early()  # its imports overlap the checks below (a bad OASES_START_METHOD: one line)
        auto = check_auto_plan(cfg)
        if auto is not None:
            limit, model = auto
            cfg["plan"] = auto_plan(cfg, model, limit, os.path.join(HydraConfig.get().runtime.output_dir, "plan.json"))
        validate(cfg)
    except ValueError as err:
        fail(str(err))
    except LaunchInterrupted as err:
        stop(err)
    except LaunchError as err:  # a failed profiling launch: one line, the traceback in Hydra's run dir
        fail_launch(err, HydraConfig.get().runtime.output_dir)
    if under_torchrun:  # torchrun / deepspeed launcher
        try:
            summary = train_rank(cfg)
            if int(os.environ["RANK"]) == 0:
                print_summary(summary)
        except BaseException:  # the launcher judges this rank by its exit code alone
            print(f"oases-train rank {os.environ['RANK']} failed:\n{traceback.format_exc()}", file=sys.stderr)
            end_rank(1)
        end_rank(0)

    # CPU machines: tell DeepSpeed so (it would guess, with a warning); GPU machines: let it detect CUDA.
    env = {} if cuda_ranks() else {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    run_dir = HydraConfig.get().runtime.output_dir  # the ranks' flight records, read if the launch fails
    try:
        summaries = launch(train_rank, cfg["nprocs"], (cfg,), timeout_s=cfg["timeout_s"], env=env, run_dir=run_dir)
    except LaunchInterrupted as err:
        stop(err)
    except LaunchError as err:
        fail_launch(err, HydraConfig.get().runtime.output_dir)
    print_summary(summaries[0])


def entry() -> None:
    strip_launcher_args()
    schema.precheck("train", TrainSchema, sys.argv[1:])
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before or after the launch (during it, the launcher handles it)
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    entry()
