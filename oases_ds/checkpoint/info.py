"""What a checkpoint holds, read without loading it: ``oases-ckpt info``.

Why without starting a run: a resume refused for a layout mismatch names both layouts,
but before choosing the next run's layout a user wants to know what a checkpoint holds
(and whether its rank files are complete) without launching ranks.  :func:`describe` reads
only ``oases_meta.json``, the portable index and each file's zip directory, never the
tensors; :func:`info_text` is its text form.
"""
from __future__ import annotations

import os
from typing import Any

from oases_ds.checkpoint import portable as portable_state
from oases_ds.checkpoint.meta import CheckpointMeta
from oases_ds.checkpoint.safe_load import check_rank_files
from oases_ds.checkpoint.tags import resolve_tag, saved_tags


def describe(directory: str, tag: str | None = None) -> dict[str, Any]:
    """What the checkpoint ``directory/tag`` (``latest`` by default) holds, checked complete.

    Raises :class:`CheckpointError` (one line) for a directory that holds no checkpoint,
    a tag that is not a completed one, or a rank or portable file that is missing or cut short."""
    tag = resolve_tag(directory, tag)
    tag_dir = os.path.join(directory, tag)
    meta = CheckpointMeta.read(tag_dir)
    check_rank_files(directory, tag, meta)
    if meta.portable:
        check_rank_files(directory, tag, meta, portable=True)
    files = {name: os.path.getsize(os.path.join(tag_dir, name)) for name, _ in meta.rank_files()}
    return {
        "directory": directory, "tag": tag, "global_steps": meta.global_steps,
        "model": meta.model, "precision": meta.precision, "tensor_parallel_size": meta.tensor_parallel_size,
        "block_degrees": list(meta.block_degrees), "pipeline_layers": list(meta.pipeline_layers),
        "zero_stage": meta.zero_stage, "data_parallel_size": meta.data_parallel_size,
        "files": files, "bytes": sum(files.values()), "tags": saved_tags(directory),
        "portable": _portable_summary(tag_dir) if meta.portable else None,
    }


def _portable_summary(tag_dir: str) -> dict[str, Any]:
    """Parameters, bytes on disk and optimizer state keys of a (checked) portable state."""
    index = portable_state.read_index(tag_dir)
    directory = os.path.join(tag_dir, portable_state.PORTABLE_DIR)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return {"parameters": len(index), "bytes": size,
            "optimizer_state": sorted({k for entry in index.values() for k in entry.state})}


def info_text(info: dict[str, Any]) -> str:
    """:func:`describe`'s answer as the lines ``oases-ckpt info`` prints."""
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
