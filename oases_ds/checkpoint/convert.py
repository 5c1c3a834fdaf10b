"""A checkpoint to and from a Hugging Face model, offline: ``oases-ckpt convert``.

Why offline: the portable state (:mod:`oases_ds.checkpoint.portable`) holds every
parameter's full fp32 master, so the Hugging Face weights are those masters mapped through
:func:`oases_ds.hf.hf_state_dict` (rounded to bf16 when the run was bf16: what ``save_hf``
on that run writes), and a Hugging Face model becomes a checkpoint by writing its tensors
as masters, one at a time, without building the model or starting ranks.  A checkpoint so
made has no layout (:meth:`~oases_ds.checkpoint.meta.CheckpointMeta.portable_only`): every run
loads it through its portable state, at step 0 with a fresh optimizer, as
``oases-train checkpoint.dir=OUT checkpoint.resume=true model=hf model.path=HFDIR`` (or the
same model given field by field) at any TMP degree, plan, pipeline split or ZeRO stage.

The mapping itself (which Oases parameter is which Hugging Face tensor) is
:mod:`oases_ds.hf`'s, shared with loading and saving a live model; this module only reads
and writes checkpoints around it.  Errors name ``oases-ckpt``'s options, its caller.
"""
from __future__ import annotations

import os
import shutil

import torch

from oases_ds.checkpoint import portable as portable_state
from oases_ds.checkpoint.meta import CheckpointError, CheckpointMeta
from oases_ds.checkpoint.safe_load import check_rank_files
from oases_ds.checkpoint.tags import STAGING_SUFFIX, check_new_directory, check_save_tag, publish, resolve_tag
from oases_ds.hf import HFCheckpoint, hf_config, write_hf
from oases_ds.models.config import ModelConfig


def to_hf(directory: str, out: str, tag: str | None = None) -> str:
    """Write the Hugging Face model directory ``out`` from the portable masters of the
    checkpoint ``directory/tag``; returns the tag read.  One process: the masters are read
    memory-mapped, so a parameter is read when it is written."""
    check_new_directory(out)
    tag = resolve_tag(directory, tag)
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
    index = portable_state.read_index(tag_dir)
    dtype = torch.bfloat16 if meta.precision == "bf16" else torch.float32  # a bf16 weight is its master rounded
    full = {name: portable_state.read_full(tag_dir, name, index)["master"].to(dtype) for name in index}
    write_hf(cfg, full, out, config)
    return tag


def from_hf(source: str, directory: str, tag: str | None = None, bf16: bool = False) -> str:
    """Write the checkpoint ``directory/tag`` (default ``hf``) holding the Hugging Face model
    ``source``'s weights as portable masters, published as a run's checkpoint is (staged
    under ``<tag>.partial``, then :func:`~oases_ds.checkpoint.publish`); returns the tag.

    Under ``bf16`` the masters are the weights rounded to bf16: what a fresh bf16 run
    starting from ``source`` has (DeepSpeed builds its fp32 masters from the bf16 weights)."""
    tag = check_save_tag("hf" if tag is None else tag)
    check_new_directory(directory)
    try:
        checkpoint = HFCheckpoint(source)
        cfg = checkpoint.config()
    except ValueError as err:
        raise CheckpointError(f"--from-hf {source}: {err}") from None
    shapes = portable_state.model_shapes(cfg)
    round_to = torch.bfloat16 if bf16 else torch.float32
    os.makedirs(directory, exist_ok=True)
    staged = os.path.join(directory, f"{tag}{STAGING_SUFFIX}")
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    try:
        portable_state.write_masters(staged, ((name, value.to(round_to).float())
                                              for name, value in checkpoint.full_values(cfg, shapes)))
        CheckpointMeta.portable_only(cfg, bf16).write(staged)
        publish(directory, tag, staged)
    except ValueError as err:  # a tensor missing from the safetensors files
        raise CheckpointError(f"--from-hf {source}: {err}") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return tag
