"""A checkpoint rewritten for another layout by that layout's ranks: ``oases-ckpt reshard``.

Why ``reshard`` starts ranks: DeepSpeed's rank files are only readable by the layout that
wrote them, and what reads them is DeepSpeed's own load.  :func:`reshard` therefore launches
the target layout's ranks on this machine (CPU, gloo), loads the checkpoint as a resume would
(through its portable state; a checkpoint without one is first loaded at its own layout and
saved with one) and saves it: a checkpoint of the target layout, with DeepSpeed's rank files
for it and the portable state.  A resume under another layout needs none of this (it reads
the portable state directly); ``reshard`` is for a checkpoint saved without portable state,
or for rank files DeepSpeed's tools read.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

from oases_ds.checkpoint.meta import CheckpointError, CheckpointMeta
from oases_ds.checkpoint.safe_load import SafeCheckpointEngine, check_rank_files
from oases_ds.checkpoint.tags import check_new_directory, resolve_tag
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.stages import stage_layer_counts
from oases_ds.planner.plan import Plan


@dataclass(frozen=True)
class Layout:
    """What ``reshard`` starts: ``world = tp x dp x pp`` ranks with these settings."""

    tensor_parallel_size: int
    data_parallel_size: int
    pipeline_layers: tuple[int, ...]
    zero_stage: int
    plan: str | None = None

    @property
    def world(self) -> int:
        """How many ranks this layout has."""
        return self.tensor_parallel_size * self.data_parallel_size * len(self.pipeline_layers)

    def describe(self) -> str:
        """The layout as ``oases-ckpt reshard`` reports it, e.g. ``TMP 1 x DP 2, ZeRO 1``."""
        pp = f"PP {len(self.pipeline_layers)} x " if len(self.pipeline_layers) > 1 else ""
        plan = f", plan {self.plan}" if self.plan else ""
        return f"{pp}TMP {self.tensor_parallel_size} x DP {self.data_parallel_size}, ZeRO {self.zero_stage}{plan}"

    def oases_section(self, timeout_s: float) -> dict[str, Any]:
        """The ``oases`` config section this layout's ranks start with (the portable state on:
        what they save is readable by every layout)."""
        return {"enabled": True, "tensor_parallel_size": self.tensor_parallel_size, "pipeline_stages": len(self.pipeline_layers),
                "pipeline_layers": list(self.pipeline_layers), "process_group_timeout_s": timeout_s,
                "portable_checkpoint": True, **({"plan": self.plan} if self.plan else {})}


_DEEPSPEED_STATE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions"})
"""What DeepSpeed 0.19.8's load hands back as client state besides the caller's own (it
returns every key of the rank file it did not use itself); ``reshard`` keeps the caller's."""


def _reshard_rank(source: str, tag: str, out: str, model: dict, ds_config: dict, oases: dict) -> int:
    """One rank of ``reshard``: the target layout's engine loads ``source/tag`` as a resume
    would and saves it as ``out/tag``.  Returns the step it saved."""
    import oases_ds  # here, in the rank: the package imports its engine, which imports this package

    engine = oases_ds.initialize(model=ModelConfig(**model), config={**ds_config, "oases": oases})[0]
    _, client = engine.load_checkpoint(source, tag)
    own = {k: v for k, v in (client or {}).items() if k not in _DEEPSPEED_STATE_KEYS}
    engine.save_checkpoint(out, tag=tag, client_state=own)
    return int(engine.global_steps)


def _saved_ds_config(tag_dir: str, meta: CheckpointMeta) -> dict[str, Any]:
    """The DeepSpeed config the run saved with (DeepSpeed keeps it in each model-states file),
    for the optimizer and scheduler to rebuild; a run whose optimizer was a callable has none."""
    first = os.path.join(tag_dir, meta.rank_files(optimizer_states=False)[0][0])
    config = SafeCheckpointEngine().load(first, map_location="cpu").get("ds_config") or {}
    if "optimizer" not in config:
        raise CheckpointError(f"{first} has no optimizer in its saved DeepSpeed config (the run passed an optimizer "
                              "object, not a config section), so reshard cannot rebuild it; resume that run's script "
                              "under the new layout instead (the portable state makes that work), or save with the "
                              "optimizer in the config")
    return config


def reshard(directory: str, out: str, tag: str | None = None, tensor_parallel_size: int | None = None,
            data_parallel_size: int | None = None, pipeline_stages: int | None = None, zero_stage: int | None = None,
            plan: str | None = None, timeout_s: float = 600.0) -> tuple[str, Layout, Layout, int]:
    """Write ``out/<tag>``: the checkpoint ``directory/<tag>`` under another layout (module
    docstring).  Unset settings keep the saved ones.  Returns (tag, saved layout, written
    layout, step)."""
    for option, value in (("--tensor-parallel-size", tensor_parallel_size), ("--data-parallel-size", data_parallel_size),
                          ("--pipeline-stages", pipeline_stages)):
        if value is not None and value < 1:  # 0 must not read as "keep the saved value"
            raise CheckpointError(f"{option} must be >= 1, got {value}; leave it out to keep the saved value")
    tag = resolve_tag(directory, tag)
    tag_dir = os.path.join(directory, tag)
    meta = CheckpointMeta.read(tag_dir)
    if not meta.has_layout:
        raise CheckpointError(f"{tag_dir} was written by oases-ckpt convert and has no layout to reshard from; resume "
                              "it under any layout with oases-train checkpoint.resume=true")
    check_rank_files(directory, tag, meta)
    if meta.portable:  # the target layout's ranks read it: every tensor checked before they start
        check_rank_files(directory, tag, meta, portable=True)
    check_new_directory(out)
    ds_config = _saved_ds_config(tag_dir, meta)
    with tempfile.TemporaryDirectory(prefix=".oases-reshard-", dir=os.path.dirname(os.path.abspath(out))) as work:
        saved_plan = None
        if any(d != meta.tensor_parallel_size for d in meta.block_degrees):  # a plan: write it for the saved layout
            saved_plan = os.path.join(work, "saved_plan.json")
            Plan(meta.block_degrees[0::2], meta.block_degrees[1::2], devices=meta.tensor_parallel_size).to_json(saved_plan)
        saved = Layout(meta.tensor_parallel_size, meta.data_parallel_size, meta.pipeline_layers, meta.zero_stage, saved_plan)
        tp = tensor_parallel_size if tensor_parallel_size is not None else saved.tensor_parallel_size
        stages = pipeline_stages if pipeline_stages is not None else len(saved.pipeline_layers)
        layers = saved.pipeline_layers if stages == len(saved.pipeline_layers) else tuple(
            stage_layer_counts(int(meta.model["num_layers"]), stages))
        target = Layout(tp, saved.data_parallel_size if data_parallel_size is None else data_parallel_size, layers,
                        saved.zero_stage if zero_stage is None else zero_stage,
                        plan or (saved_plan if tp == saved.tensor_parallel_size else None))

        def run(layout: Layout, source: str, into: str) -> int:
            config = {**ds_config, "zero_optimization": {**ds_config.get("zero_optimization", {}),
                                                         "stage": layout.zero_stage}}
            steps = launch(_reshard_rank, layout.world, (source, tag, into, meta.model, config,
                                                         layout.oases_section(timeout_s)), timeout_s=timeout_s)
            return steps[0]

        source = directory
        if not meta.portable and target != saved:  # DeepSpeed's files only: give it a portable state at its own layout
            source = os.path.join(work, "portable")
            run(saved, directory, source)
        step = run(target, source, out)
    return tag, saved, target, step
