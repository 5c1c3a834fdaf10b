"""The ``"oases"`` section of a DeepSpeed JSON config, validated.

DeepSpeed silently ignores top-level keys it does not know, so a typo such as
``"sub_batch": 4`` would otherwise run the default schedule without a word.
Every key here is checked (unknown keys are errors), types are strict (``"yes"``,
``1`` or ``"off"`` is not a boolean and ``"2"`` or ``true`` not an integer: JSON
written by hand or by a template engine is where such values come from, and
coercing them silently turns ``"enabled": "off"`` into "on"), and every error is
one line naming the field and what to change.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from oases_ds.models.config import ModelConfig
from oases_ds.models.stages import Stage, split_stages
from oases_ds.parallel.flight import DEFAULT_RECORDS
from oases_ds.parallel.link import LinkModel
from oases_ds.schedule.generators import SCHEDULES, ScheduleSpec, overlap_refusal
from oases_ds.schedule.pipeline import registered_pipelines

PIPELINES = registered_pipelines()


class OasesConfigError(ValueError):
    """The DeepSpeed config asks for something Oases cannot do; one line says what."""


# strict: no coercion between JSON types (an int is still accepted where a float is asked for).
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # a nan or infinite size or time is a typo


class LinkConfig(BaseModel):
    """Emulated link between TMP ranks (benchmarks only; results say "emulated")."""

    model_config = _STRICT
    bandwidth_gbps: float = Field(gt=0, description="link bandwidth in Gbit/s per direction")
    latency_us: float = Field(default=0.0, ge=0, description="per-message latency in microseconds")
    sharing: Literal["fifo", "fair", "ring"] = Field(
        default="fifo", description="concurrent collectives: in turn, shared equally, or interleaved by ring step")

    def model(self) -> LinkModel:
        return LinkModel(self.bandwidth_gbps, self.latency_us, self.sharing)


class OasesConfig(BaseModel):
    """Oases switches.  Defaults reproduce the paper's method (cross-pass schedule,
    fine-grained recomputation, two sub-batches).

    Attributes:
        enabled: use the Oases engine; off returns a plain DeepSpeedEngine.
        tensor_parallel_size: TMP degree; must divide the world size and the model.
        schedule: one of none, megatron, megatron_selective, split_overlap, oases.
        sub_batches: sub-batches per micro-batch (split_overlap, oases).
        cross_pass: oases only -- interleave recompute and backward across passes.
        fine_grained_recompute: oases only -- checkpoint right after forward AllReduces.
        seed: initial weights and dropout keys.
        process_group_timeout_s: every process group's timeout (no hangs on a dead rank).
        link: optional emulated link for benchmarks.
        record_timeline: keep the executor timeline (exposed comm, traces).
        dp_overlap: reduce each block's gradients over DP as its last backward ends,
            overlapped with the schedule (ZeRO 0 or 1, fp32 or bf16); off:
            DeepSpeed reduces after the schedule, fully exposed (the baseline).
        plan: JSON plan (from ``oases-plan``) giving each attention / MLP block its
            own TMP degree; default: every block at ``tensor_parallel_size``.
        pipeline_stages: pipeline stages; the world is ``pipeline_stages x DP x
            tensor_parallel_size`` ranks, each stage a contiguous range of layers.
        pipeline_schedule: the order of micro-batches over stages, ``1f1b`` (at most
            ``stages - stage`` micro-batches in flight) or ``gpipe`` (all forwards first).
        pipeline_layers: layers per stage, first stage first (e.g. ``[3, 2]``);
            default: an even split, the first stages one layer more.
        check_collectives: guard mode (:mod:`oases_ds.parallel.guard`): ranks agree on every
            collective before issuing it, waits are bounded, and a divergence fails in seconds
            with one line naming the first differing collective (``OASES_CHECK_COLLECTIVES=1``
            turns it on too).  Off by default: it costs a small synchronous exchange per collective.
        check_batch: at each step, every rank of a TMP group holds the same batch (one
            8-byte all-gather of a hash of it), or the step stops with one line naming the
            step and the ranks; off for loaders that guarantee it (a batch broadcast in the group).
        sequence_parallel: between blocks each TMP rank holds a ``1/t`` slice of the sequence
            (Megatron's sequence parallelism): the norm, dropout and residual activations and
            each recomputed block's checkpoint shrink ``t``-fold, and every TMP AllReduce becomes
            a ReduceScatter and an AllGather of the same bytes, overlapped by the schedule as
            before.  Needs ``model.seq_len`` divisible by ``tensor_parallel_size`` and one TMP
            degree for every block.
        flight_records: collectives each rank remembers for a hang's diagnosis
            (:mod:`oases_ds.parallel.flight`); 0 keeps none.
        overlap_micro_batches: run a step's micro-batches (``gradient_accumulation_steps``) as one
            cross-pass merge, each micro-batch's forward under the previous one's recomputation and
            backward (:func:`~oases_ds.schedule.generators.micro_batch_merge`): where the link is as slow
            as the compute, a forward is link-bound and a backward compute-bound, and only two micro-batches
            can mix them.  One stage, schedule ``oases`` with ``cross_pass``; each sub-batch holds at most two
            micro-batches.  The DP reduction then runs after the step's schedule (not overlapped with it).
            With one micro-batch per step there is nothing to overlap: the plain executor runs it.
        portable_checkpoint: save, next to DeepSpeed's rank files, the full value and
            optimizer state of every parameter (:mod:`oases_ds.checkpoint.portable`), so that a run
            with another TMP degree, plan, pipeline split, DP size or ZeRO stage can resume
            from it.  Costs a second copy of the fp32 state on disk and a gather per
            parameter at save; ``false`` keeps DeepSpeed's files only.
    """

    model_config = _STRICT
    enabled: bool = False
    tensor_parallel_size: int = Field(default=1, ge=1)
    schedule: Literal[SCHEDULES] = "oases"  # the registered names: a new schedule is accepted here at once
    sub_batches: int = Field(default=2, ge=1)
    cross_pass: bool = True
    fine_grained_recompute: bool = True
    seed: int = 1234
    process_group_timeout_s: float = Field(default=300.0, gt=0)
    link: LinkConfig | None = None
    record_timeline: bool = True
    dp_overlap: bool = True
    plan: str | None = None
    pipeline_stages: int = Field(default=1, ge=1)
    pipeline_schedule: Literal[PIPELINES] = "1f1b"  # the registered orders
    pipeline_layers: list[int] | None = None
    check_collectives: bool = False
    check_batch: bool = True
    sequence_parallel: bool = False
    flight_records: int = Field(default=DEFAULT_RECORDS, ge=0)
    portable_checkpoint: bool = True
    overlap_micro_batches: bool = False

    @model_validator(mode="after")
    def _overlap_runs_one_stage_of_oases(self) -> OasesConfig:
        refused = overlap_refusal(self.schedule, self.cross_pass, self.pipeline_stages)
        if self.overlap_micro_batches and refused:
            raise ValueError(refused)
        return self

    @field_validator("plan")
    @classmethod
    def _plan_exists(cls, path: str | None) -> str | None:
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"plan file {path!r} not found; write one with oases-plan")
        return path

    def stages(self, num_layers: int) -> list[Stage]:
        """Every pipeline stage's layers for a ``num_layers`` model; a split that does not fit
        (more stages than layers, counts not summing up) is an :class:`OasesConfigError`
        naming the field."""
        try:
            return split_stages(num_layers, self.pipeline_stages, self.pipeline_layers)
        except ValueError as err:
            raise OasesConfigError(f"oases.{err}") from None

    def schedule_spec(self) -> ScheduleSpec:
        """The schedule these flat keys describe (the JSON keeps them flat: DeepSpeed users
        write ``"sub_batches": 4`` next to ``"schedule": "oases"``); the blocks a plan stores are
        added where the plan is read (:func:`oases_ds.engine.planned_schedule`)."""
        return ScheduleSpec(self.schedule, self.sub_batches, self.cross_pass, self.fine_grained_recompute)


@dataclass(frozen=True)
class Collective:
    """One collective a training step issues, as the link check prices it.

    Attributes:
        what: its name in messages ("TMP activation AllReduce").
        kind: a :meth:`LinkModel.seconds` kind ("all_reduce", "all_gather", "p2p").
        nbytes: payload bytes on each rank.
        ranks: ranks of its group.
    """

    what: str
    kind: str
    nbytes: int
    ranks: int


def activation_all_reduce(model: ModelConfig, micro_batch: int, sub_batches: int, tensor_parallel_size: int,
                          element_size: int) -> Collective:
    """The TMP AllReduce every layer issues: one sub-batch's ``[b, s, h]`` activations (the
    embedding, attention and MLP outputs all have that size).  Computed from the config alone,
    so ``oases-train`` can price it before any rank starts and the engine after it has."""
    sub_batch = max(1, micro_batch // sub_batches)
    return Collective("TMP activation AllReduce", "all_reduce", sub_batch * model.seq_len * model.hidden_size * element_size,
                      tensor_parallel_size)


def slow_link_message(link: LinkModel, timeout_s: float, collectives: Sequence[Collective], *,
                      bandwidth_key: str = "oases.link.bandwidth_gbps",
                      timeout_key: str = "oases.process_group_timeout_s") -> str | None:
    """One line if the slowest of ``collectives`` cannot cross ``link`` within the process-group
    timeout, else ``None``.  Without it a too-slow link shows up only as ranks waiting out the
    whole timeout.  The keys are named as the caller's user sets them: the engine's DeepSpeed
    section by default, ``oases-train``'s ``cluster.link.bandwidth_gbps`` and ``timeout_s``."""
    timed = [(link.seconds(c.kind, c.nbytes, c.ranks), c) for c in collectives]
    if not timed:
        return None
    seconds, slowest = max(timed, key=lambda pair: pair[0])
    if seconds <= timeout_s:
        return None
    return (f"{bandwidth_key.rpartition('.')[0]}: the {slowest.what} ({slowest.nbytes / 2**20:.3g} MiB over "
            f"{slowest.ranks} ranks) needs {seconds:.3g} s at {bandwidth_key}={link.bandwidth_gbps:g}, longer than "
            f"{timeout_key}={timeout_s:g}: ranks waiting on it would time out; raise {timeout_key} above "
            f"{math.ceil(seconds)} or {bandwidth_key}")


def one_line(err: ValidationError, prefix: str) -> str:
    """First pydantic error as ``prefix.field: message (got value)``."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if not loc:  # a check across fields (a model validator): its message names them
        return f"{prefix}: {first['msg'].removeprefix('Value error, ')}"
    got = f" (got {first['input']!r})" if "input" in first and first["type"] != "missing" else ""
    hint = "; remove it or check its spelling" if first["type"] == "extra_forbidden" else ""
    return f"{prefix}.{loc}: {first['msg']}{got}{hint}"


def parse_oases_section(section: Any) -> OasesConfig:
    """Validate the ``"oases"`` section (``None`` means disabled)."""
    if section is None:
        return OasesConfig()
    if isinstance(section, bool):
        return OasesConfig(enabled=section)
    if not isinstance(section, dict):
        raise OasesConfigError(f"oases: expected an object such as {{\"enabled\": true}}, got {section!r}")
    try:
        return OasesConfig(**section)
    except ValidationError as err:
        raise OasesConfigError(one_line(err, "oases")) from None


def offload_device(config: dict) -> str | None:
    """Where ``zero_optimization.offload_optimizer`` puts the optimizer (``"cpu"``, ``"nvme"``),
    or ``None`` without offload (DeepSpeed reads a missing section and ``device: none`` alike)."""
    device = ((config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return None if device in ("none", None) else device


def check_deepspeed_section(config: dict) -> None:
    """Refuse DeepSpeed features the Oases engine does not drive: ZeRO-3 gathers
    parameters in forward hooks, which the executor's per-operator schedule never runs;
    DeepSpeed's ``torch_autocast`` and fp16's ``auto_cast`` would wrap only ``engine(batch)``
    (evaluation), never the schedule, and make activations differ in dtype from the
    parameters a pipeline receive is sized by.  fp16 itself trains: the executor seeds its
    backward with DeepSpeed's loss scale (:meth:`oases_ds.engine.OasesEngine.current_loss_scale`)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2):
        raise OasesConfigError(f"zero_optimization.stage={stage} is not supported with oases (stage 3 gathers "
                               "parameters inside forward hooks the schedule does not run); use 0, 1 or 2")
    offload = offload_device(config)
    if offload is not None and stage == 0:
        raise OasesConfigError(f"zero_optimization.offload_optimizer.device={offload} needs zero_optimization.stage 1 or 2 "
                               "(DeepSpeed offloads the optimizer's partition); set the stage, or remove the offload")
    if zero.get("overlap_comm", False):
        raise OasesConfigError("zero_optimization.overlap_comm=true is not supported with oases (its gradient hooks "
                               "would reduce inside the schedule); set it to false")
    fp16 = config.get("fp16") or {}
    if fp16.get("enabled", False) and (config.get("bf16") or {}).get("enabled", False):
        raise OasesConfigError("fp16.enabled=true and bf16.enabled=true: choose one precision (bf16 where the device "
                               "has it, fp16 with loss scaling where it does not)")
    if fp16.get("enabled", False) and fp16.get("auto_cast", False):
        raise OasesConfigError("fp16.auto_cast=true is not supported with oases (the schedule runs outside "
                               "DeepSpeed's forward); remove it: fp16.enabled=true alone trains the model in fp16")
    if (config.get("torch_autocast") or {}).get("enabled", False):
        raise OasesConfigError("torch_autocast.enabled=true is not supported with oases (the schedule runs outside "
                               "DeepSpeed's forward); use bf16.enabled=true for bf16 training")
    if config.get("pipeline") or config.get("tensor_parallel", {}).get("autotp_size", 0):
        raise OasesConfigError("tensor_parallel.autotp_size / pipeline are not supported with oases; set "
                               "oases.tensor_parallel_size / oases.pipeline_stages")


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_batch_section(config: dict, dp_size: int | None = None) -> None:
    """The DeepSpeed batch keys, checked before ``DeepSpeedConfig`` sees them: it checks
    them with bare ``assert``s (``Gradient accumulation steps: 0 has to be greater than
    0``, or a ``TypeError`` for ``"4"``), which name no config key and vanish under
    ``python -O``.  With ``dp_size`` (the data-parallel size DeepSpeed divides by) the
    values DeepSpeed derives from the given ones are checked too."""
    for key in BATCH_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OasesConfigError(f"{key}: must be an integer >= 1 (got {value!r})")
    train, micro, gas = (config.get(key) for key in BATCH_KEYS)
    if train is None and micro is None:
        raise OasesConfigError("train_micro_batch_size_per_gpu: missing; set it (or train_batch_size)")
    if dp_size is None or train is None:
        return  # DeepSpeed derives train_batch_size from the others: always consistent
    # The derivation of DeepSpeedConfig._set_batch_related_parameters (floor division).
    given_micro, given_gas = micro, gas
    if micro is None:
        micro = train // (dp_size * (gas or 1))
    if gas is None:
        gas = train // (micro * dp_size) if micro >= 1 else 1
    if micro >= 1 and train == micro * gas * dp_size:
        return
    if given_micro is not None and given_gas is not None:
        expected = given_micro * given_gas * dp_size
        raise OasesConfigError(
            f"train_batch_size={train} but train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel "
            f"ranks = {given_micro} x {given_gas} x {dp_size} = {expected}; set it to {expected} or drop it"
        )
    known = given_micro if given_micro is not None else given_gas
    name = BATCH_KEYS[1] if given_micro is not None else BATCH_KEYS[2]
    per = f"{name}={known} x " if known is not None else ""
    raise OasesConfigError(
        f"train_batch_size={train} is not a multiple of {per}{dp_size} data-parallel rank(s); "
        f"set train_micro_batch_size_per_gpu and gradient_accumulation_steps instead"
    )
