"""Checkpoints that are safe to load, safe to lose power during, and readable by any layout.

One home for everything a checkpoint directory holds and every way it is read or written;
the engine saves and loads through it, ``oases-train`` checks with it before any rank
starts, and ``oases-ckpt`` only parses its arguments and calls it.

    meta        oases_meta.json (CheckpointMeta): the facts a run must match, the step, the rank files
    tags        tags, ``latest``, crash-safe publication, pruning
    safe_load   SafeCheckpointEngine (no code from a pickle), rank-file checks, preflight
    portable    the layout-free state: one full tensor per parameter, resharded on load
    info        what a checkpoint holds, read without its tensors         (oases-ckpt info)
    convert     to and from a Hugging Face model, offline                 (oases-ckpt convert)
    reshard     rewritten for another layout by that layout's ranks       (oases-ckpt reshard)

Each module's docstring says why it works the way it does.  The names code has always
imported from ``oases_ds.checkpoint`` are re-exported here; ``info``, ``convert`` and
``reshard`` are imported by name (``from oases_ds.checkpoint.convert import to_hf``), so that
the engine, which imports this package, does not load the launcher and the planner with it.
"""
from __future__ import annotations

from oases_ds.checkpoint.meta import LAYOUT_FACTS, META_FILE, META_FORMAT, CheckpointError, CheckpointMeta
from oases_ds.checkpoint.safe_load import SAFE_GLOBALS, SafeCheckpointEngine, check_rank_files, preflight
from oases_ds.checkpoint.tags import (LATEST, RESAVE_SUFFIX, STAGING_SUFFIX, check_complete, check_save_tag, check_tag,
                                      prune, publish, read_latest, saved_tags, write_latest)

__all__ = [
    "LATEST", "LAYOUT_FACTS", "META_FILE", "META_FORMAT", "RESAVE_SUFFIX", "SAFE_GLOBALS", "STAGING_SUFFIX",
    "CheckpointError", "CheckpointMeta", "SafeCheckpointEngine", "check_complete", "check_rank_files", "check_save_tag",
    "check_tag", "preflight", "prune", "publish", "read_latest", "saved_tags", "write_latest",
]
