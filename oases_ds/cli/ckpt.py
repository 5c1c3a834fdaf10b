"""``oases-ckpt``: look inside a checkpoint directory, and convert it to and from Hugging
Face, without starting a run.

    oases-ckpt info runs/ckpt              # what `latest` names: model, layout, step, precision, files
    oases-ckpt info runs/ckpt --tag step20 # another saved tag
    oases-ckpt info runs/ckpt --json       # the same, as one JSON object
    oases-ckpt convert runs/ckpt --to-hf runs/hf        # the portable state's weights, for from_pretrained
    oases-ckpt convert --from-hf runs/hf runs/ckpt2     # a checkpoint (tag `hf`) any layout resumes from
    oases-ckpt convert --from-hf runs/hf runs/ckpt2 --bf16 --tag start   # for a bf16 run
    oases-ckpt reshard runs/ckpt runs/tp4 --tensor-parallel-size 4      # DeepSpeed's files for another layout
    oases-ckpt reshard runs/old runs/portable                            # add the portable state to an old checkpoint

Why a command of its own: a resume refused for a layout mismatch names both layouts,
but before choosing the next run's layout a user wants to know what a checkpoint holds
(and whether its rank files are complete) without launching ranks.  ``info`` reads only
``oases_meta.json``, the portable index and each file's zip directory, never the tensors.

Why ``convert`` works offline: the portable state (:mod:`oases_ds.checkpoint.portable`) holds every
parameter's full fp32 master, so the Hugging Face weights are those masters mapped through
:func:`oases_ds.hf.hf_state_dict` (rounded to bf16 when the run was bf16: what ``save_hf``
on that run writes), and a Hugging Face model becomes a checkpoint by writing its tensors
as masters, one at a time, without building the model or starting ranks.  A checkpoint so
made has no layout (:meth:`~oases_ds.checkpoint.CheckpointMeta.portable_only`): every run
loads it through its portable state, at step 0 with a fresh optimizer, as
``oases-train checkpoint.dir=OUT checkpoint.resume=true model=hf model.path=HFDIR`` (or the
same model given field by field) at any TMP degree, plan, pipeline split or ZeRO stage.

Why ``reshard`` starts ranks: DeepSpeed's rank files are only readable by the layout that
wrote them, and what reads them is DeepSpeed's own load.  ``reshard`` therefore launches the
target layout's ranks on this machine (CPU, gloo), loads the checkpoint as a resume would
(through its portable state; a checkpoint without one is first loaded at its own layout and
saved with one) and saves it: a checkpoint of the target layout, with DeepSpeed's rank files
for it and the portable state.  A resume under another layout needs none of this (it reads
the portable state directly); ``reshard`` is for a checkpoint saved without portable state,
or for rank files DeepSpeed's tools read.

A plain argparse CLI with subcommands, like ``oases-data``: its input is a directory, not a
composed training configuration.  Bad input is one ``error:`` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Sequence

# Nothing here needs an accelerator: keep DeepSpeed, imported with the package, from probing
# for a GPU and warning that it found none.  A user's setting is kept.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from oases_ds.checkpoint import portable
from oases_ds.checkpoint import (STAGING_SUFFIX, CheckpointError, CheckpointMeta, check_complete,
                                 check_rank_files, check_save_tag, publish, read_latest, saved_tags)
from oases_ds.cli.common import fail


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oases-ckpt", description=__doc__.split("\n\n")[0].strip("` \n"))
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="what a checkpoint holds: model, layout, step, precision, rank files")
    info.add_argument("directory", help="the checkpoint directory (oases-train checkpoint.dir)")
    info.add_argument("--tag", default=None, help="a saved tag under DIRECTORY (default: the one `latest` names)")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of the text form")
    convert = sub.add_parser("convert", help="a checkpoint's portable state to a Hugging Face model, or back")
    convert.add_argument("directory", help="the checkpoint directory: read with --to-hf, written with --from-hf")
    way = convert.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-hf", metavar="OUT", help="write a Hugging Face model directory (config.json + "
                     "model.safetensors) from DIRECTORY's portable state")
    way.add_argument("--from-hf", metavar="HFDIR", help="write DIRECTORY, a checkpoint holding HFDIR's weights")
    convert.add_argument("--tag", default=None, help="--to-hf: the saved tag to read (default: the one `latest` "
                         "names); --from-hf: the tag to write (default: hf)")
    convert.add_argument("--bf16", action="store_true", help="--from-hf: for a bf16 run (default: fp32)")
    reshard = sub.add_parser("reshard", help="write a checkpoint of another layout (starts its ranks on this machine)")
    reshard.add_argument("directory", help="the checkpoint directory to read")
    reshard.add_argument("out", help="the checkpoint directory to write (new or empty)")
    reshard.add_argument("--tag", default=None, help="the saved tag to read (default: the one `latest` names)")
    reshard.add_argument("--tensor-parallel-size", type=int, default=None, help="TMP degree (default: the saved one)")
    reshard.add_argument("--data-parallel-size", type=int, default=None, help="DP ranks (default: the saved ones)")
    reshard.add_argument("--pipeline-stages", type=int, default=None, help="pipeline stages (default: the saved ones)")
    reshard.add_argument("--zero-stage", type=int, choices=(0, 1), default=None, help="ZeRO stage (default: the saved one)")
    reshard.add_argument("--plan", default=None, help="a plan JSON of oases-plan for per-block degrees (default: "
                         "every block at the TMP degree, or the saved plan when the TMP degree is kept)")
    reshard.add_argument("--timeout-s", type=float, default=600.0, help="launch and process-group timeout")
    return p


def _resolve_tag(directory: str, tag: str | None) -> str:
    """The completed tag to read: ``tag``, or the one ``latest`` names; one line otherwise."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a directory; give the checkpoint.dir a run saved into")
    if tag is not None:
        return check_complete(directory, tag, source="--tag")
    latest = read_latest(directory)
    if latest is None:
        tags = saved_tags(directory)
        raise CheckpointError(f"{directory} has no `latest` file" + (
            f"; give one of its saved tags with --tag ({', '.join(tags)})" if tags
            else ", and no saved checkpoint: give the checkpoint.dir a run saved into"))
    return latest


def _portable_summary(tag_dir: str) -> dict[str, Any]:
    """Parameters, bytes on disk and optimizer state keys of a (checked) portable state."""
    index = portable.read_index(tag_dir)
    directory = os.path.join(tag_dir, portable.PORTABLE_DIR)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return {"parameters": len(index), "bytes": size,
            "optimizer_state": sorted({k for entry in index.values() for k in entry["state"]})}


def describe(directory: str, tag: str | None = None) -> dict[str, Any]:
    """What the checkpoint ``directory/tag`` (``latest`` by default) holds, checked complete.

    Raises :class:`CheckpointError` (one line) for a directory that holds no checkpoint,
    a tag that is not a completed one, or a rank or portable file that is missing or cut short."""
    tag = _resolve_tag(directory, tag)
    tag_dir = os.path.join(directory, tag)
    meta = CheckpointMeta.read(tag_dir)
    check_rank_files(directory, tag, meta)
    if meta.portable:
        check_rank_files(directory, tag, meta, portable=True)
    files = {name: os.path.getsize(os.path.join(tag_dir, name)) for name, _ in meta.rank_files()}
    model = meta.model
    return {
        "directory": directory, "tag": tag, "global_steps": meta.global_steps,
        "model": model, "precision": meta.precision, "tensor_parallel_size": meta.tensor_parallel_size,
        "block_degrees": list(meta.block_degrees), "pipeline_layers": list(meta.pipeline_layers),
        "zero_stage": meta.zero_stage, "data_parallel_size": meta.data_parallel_size,
        "files": files, "bytes": sum(files.values()), "tags": saved_tags(directory),
        "portable": _portable_summary(tag_dir) if meta.portable else None,
    }


def text(info: dict[str, Any]) -> str:
    m = info["model"]
    degrees = info["block_degrees"]
    uniform = all(d == info["tensor_parallel_size"] for d in degrees)
    stages = info["pipeline_layers"]
    layout = (f"layout: TMP {info['tensor_parallel_size']}"
              + (" (every block)" if uniform else f", plan block degrees {degrees}")
              + (f" | PP {len(stages)} (layers per stage {stages})" if len(stages) > 1 else "")
              + f" | ZeRO {info['zero_stage']}"
              + (f" over DP {info['data_parallel_size']}" if info["zero_stage"] else ""))
    if not info["tensor_parallel_size"]:  # CheckpointMeta.portable_only: converted, no run saved it
        layout = "layout: none (written by oases-ckpt convert: portable state only, no rank files)"
    lines = [
        f"checkpoint {os.path.join(info['directory'], info['tag'])} | step {info['global_steps']} | {info['precision']}",
        f"model: {m.get('family')} h={m.get('hidden_size')} L={m.get('num_layers')} heads={m.get('num_heads')} "
        f"vocab={m.get('vocab_size')} seq={m.get('seq_len')}",
        layout,
        f"files: {len(info['files'])} rank files, {info['bytes']:,} bytes, all complete",
        portable_line(info["portable"]),
        f"saved tags (oldest first): {', '.join(info['tags'])}",
    ]
    return "\n".join(lines)


def portable_line(summary: dict[str, Any] | None) -> str:
    """The text form of :func:`describe`'s ``portable``: whether another layout can resume."""
    if summary is None:
        return "portable state: none (resumes only under its own layout)"
    state = ", ".join(summary["optimizer_state"]) or "no optimizer state"
    return (f"portable state: {summary['parameters']} parameters, {summary['bytes'] / 2**20:.1f} MiB ({state}): "
            "resumable under any layout")


def to_hf(directory: str, out: str, tag: str | None = None) -> str:
    """Write the Hugging Face model directory ``out`` from the portable masters of the
    checkpoint ``directory/tag``; returns the tag read.  One process: the masters are read
    memory-mapped, so a parameter is read when it is written."""
    from oases_ds.hf import hf_config, write_hf
    from oases_ds.models.config import ModelConfig

    _check_out(out)
    tag = _resolve_tag(directory, tag)
    tag_dir = os.path.join(directory, tag)
    meta = CheckpointMeta.read(tag_dir)
    if not meta.portable:
        raise CheckpointError(f"checkpoint {tag_dir} holds no portable state (saved with oases.portable_checkpoint=false "
                              f"or by an older oases_ds), so it cannot be converted offline; export it from a run resumed "
                              f"at its own layout: oases-train ... checkpoint.dir={directory} checkpoint.resume=true "
                              f"steps={meta.global_steps} export_hf={out}")
    check_rank_files(directory, tag, meta, portable=True)
    cfg = ModelConfig(**meta.model)
    try:
        config = hf_config(cfg)
    except ValueError as err:  # a model no Hugging Face class states
        raise CheckpointError(f"checkpoint {tag_dir} cannot be converted: {err}") from None
    index = portable.read_index(tag_dir)
    dtype = torch.bfloat16 if meta.precision == "bf16" else torch.float32  # a bf16 weight is its master rounded
    full = {name: portable.read_full(tag_dir, name, index)["master"].to(dtype) for name in index}
    write_hf(cfg, full, out, config)
    return tag


def from_hf(source: str, directory: str, tag: str | None = None, bf16: bool = False) -> str:
    """Write the checkpoint ``directory/tag`` (default ``hf``) holding the Hugging Face model
    ``source``'s weights as portable masters, published as a run's checkpoint is (staged
    under ``<tag>.partial``, then :func:`~oases_ds.checkpoint.publish`); returns the tag.

    Under ``bf16`` the masters are the weights rounded to bf16: what a fresh bf16 run
    starting from ``source`` has (DeepSpeed builds its fp32 masters from the bf16 weights)."""
    from oases_ds.hf import HFCheckpoint
    from oases_ds.models.operator_model import OperatorModel

    tag = check_save_tag("hf" if tag is None else tag)
    _check_out(directory)
    try:
        checkpoint = HFCheckpoint(source)
        cfg = checkpoint.config()
    except ValueError as err:
        raise CheckpointError(f"--from-hf {source}: {err}") from None
    with torch.device("meta"):  # names and full shapes only: no memory for the weights
        model = OperatorModel(cfg)
    shapes = {name: tuple(model.sharding.full_shape(name, p)) for name, p in model.named_parameters() if p.requires_grad}
    round_to = torch.bfloat16 if bf16 else torch.float32
    os.makedirs(directory, exist_ok=True)
    staged = os.path.join(directory, f"{tag}{STAGING_SUFFIX}")
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    try:
        portable.write_masters(staged, ((name, value.to(round_to).float())
                                        for name, value in checkpoint.full_values(cfg, shapes)))
        CheckpointMeta.portable_only(cfg, bf16).write(staged)
        publish(directory, tag, staged)
    except ValueError as err:  # a tensor missing from the safetensors files
        raise CheckpointError(f"--from-hf {source}: {err}") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return tag


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
        return self.tensor_parallel_size * self.data_parallel_size * len(self.pipeline_layers)

    def describe(self) -> str:
        pp = f"PP {len(self.pipeline_layers)} x " if len(self.pipeline_layers) > 1 else ""
        plan = f", plan {self.plan}" if self.plan else ""
        return f"{pp}TMP {self.tensor_parallel_size} x DP {self.data_parallel_size}, ZeRO {self.zero_stage}{plan}"

    def oases_section(self, timeout_s: float) -> dict[str, Any]:
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
    import oases_ds
    from oases_ds.models.config import ModelConfig

    engine = oases_ds.initialize(model=ModelConfig(**model), config={**ds_config, "oases": oases})[0]
    _, client = engine.load_checkpoint(source, tag)
    own = {k: v for k, v in (client or {}).items() if k not in _DEEPSPEED_STATE_KEYS}
    engine.save_checkpoint(out, tag=tag, client_state=own)
    return int(engine.global_steps)


def _saved_ds_config(tag_dir: str, meta: CheckpointMeta) -> dict[str, Any]:
    """The DeepSpeed config the run saved with (DeepSpeed keeps it in each model-states file),
    for the optimizer and scheduler to rebuild; a run whose optimizer was a callable has none."""
    from oases_ds.checkpoint import SafeCheckpointEngine

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
    import tempfile

    from oases_ds.launcher import launch
    from oases_ds.models.stages import stage_layer_counts
    from oases_ds.planner.plan import Plan

    tag = _resolve_tag(directory, tag)
    tag_dir = os.path.join(directory, tag)
    meta = CheckpointMeta.read(tag_dir)
    if not meta.has_layout:
        raise CheckpointError(f"{tag_dir} was written by oases-ckpt convert and has no layout to reshard from; resume "
                              "it under any layout with oases-train checkpoint.resume=true")
    check_rank_files(directory, tag, meta)
    _check_out(out)
    ds_config = _saved_ds_config(tag_dir, meta)
    with tempfile.TemporaryDirectory(prefix=".oases-reshard-", dir=os.path.dirname(os.path.abspath(out))) as work:
        saved_plan = None
        if any(d != meta.tensor_parallel_size for d in meta.block_degrees):  # a plan: write it for the saved layout
            saved_plan = os.path.join(work, "saved_plan.json")
            Plan(meta.block_degrees[0::2], meta.block_degrees[1::2], devices=meta.tensor_parallel_size).to_json(saved_plan)
        saved = Layout(meta.tensor_parallel_size, meta.data_parallel_size, meta.pipeline_layers, meta.zero_stage, saved_plan)
        tp = tensor_parallel_size or saved.tensor_parallel_size
        stages = pipeline_stages or len(saved.pipeline_layers)
        layers = saved.pipeline_layers if stages == len(saved.pipeline_layers) else tuple(
            stage_layer_counts(int(meta.model["num_layers"]), stages))
        target = Layout(tp, data_parallel_size or saved.data_parallel_size, layers,
                        saved.zero_stage if zero_stage is None else zero_stage,
                        plan or (saved_plan if tp == saved.tensor_parallel_size else None))
        if target.world < 1 or min(target.tensor_parallel_size, target.data_parallel_size) < 1:
            raise CheckpointError("--tensor-parallel-size, --data-parallel-size and --pipeline-stages must be >= 1")

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


def _check_out(path: str) -> None:
    """An output is a new or empty directory: never written over what is there."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"{path} exists and is not an empty directory; give a new or empty directory to write into")


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "info":
        try:
            info = describe(args.directory, args.tag)
        except CheckpointError as err:
            fail(str(err))
        print(json.dumps(info, indent=1) if args.json else text(info))
        return
    if args.command == "reshard":
        from oases_ds.launcher import LaunchError

        try:
            tag, saved, target, step = reshard(args.directory, args.out, args.tag, args.tensor_parallel_size,
                                               args.data_parallel_size, args.pipeline_stages, args.zero_stage, args.plan,
                                               args.timeout_s)
        except LaunchError as err:  # a rank failed: its one line
            fail(err.summary)
        except (CheckpointError, portable.PortableStateError, OSError, ValueError) as err:
            fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        print(f"wrote {os.path.join(args.out, tag)} (step {step}, {target.describe()}) from "
              f"{os.path.join(args.directory, tag)} ({saved.describe()}), {target.world} ranks on this machine")
        return
    if args.bf16 and args.to_hf:
        fail("--bf16 applies to --from-hf only; --to-hf writes the checkpoint's own precision")
    try:
        if args.to_hf:
            tag = to_hf(args.directory, args.to_hf, args.tag)
            print(f"wrote {args.to_hf} (Hugging Face model) from {os.path.join(args.directory, tag)}")
        else:
            tag = from_hf(args.from_hf, args.directory, args.tag, args.bf16)
            print(f"wrote {os.path.join(args.directory, tag)} (step 0, portable state only) from {args.from_hf}; resume "
                  f"with oases-train model=hf model.path={args.from_hf} checkpoint.dir={args.directory} "
                  "checkpoint.resume=true")
    except (CheckpointError, portable.PortableStateError, OSError) as err:
        fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)


def entry() -> None:
    main(sys.argv[1:])


if __name__ == "__main__":
    entry()
