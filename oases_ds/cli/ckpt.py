"""``oases-ckpt``: look inside a checkpoint directory without starting a run.

    oases-ckpt info runs/ckpt              # what `latest` names: model, layout, step, precision, files
    oases-ckpt info runs/ckpt --tag step20 # another saved tag
    oases-ckpt info runs/ckpt --json       # the same, as one JSON object

Why a command of its own: a resume refused for a layout mismatch names both layouts,
but before choosing the next run's layout a user wants to know what a checkpoint holds
(and whether its rank files are complete) without launching ranks.  It reads only
``oases_meta.json`` and each rank file's zip directory, never the tensors.

A plain argparse CLI with subcommands (``info`` today), like ``oases-data``: its input is a
directory, not a composed training configuration.  Bad input is one ``error:`` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

# Nothing here computes: keep DeepSpeed, imported with the package, from probing for a GPU
# and warning that it found none.  A user's setting is kept.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from oases_ds.checkpoint import (META_FILE, CheckpointError, CheckpointMeta, check_complete, check_rank_files,
                                 read_latest, saved_tags)
from oases_ds.cli.common import fail


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oases-ckpt", description=__doc__.split("\n\n")[0].strip("` \n"))
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="what a checkpoint holds: model, layout, step, precision, rank files")
    info.add_argument("directory", help="the checkpoint directory (oases-train checkpoint.dir)")
    info.add_argument("--tag", default=None, help="a saved tag under DIRECTORY (default: the one `latest` names)")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of the text form")
    return p


def describe(directory: str, tag: str | None = None) -> dict[str, Any]:
    """What the checkpoint ``directory/tag`` (``latest`` by default) holds, checked complete.

    Raises :class:`CheckpointError` (one line) for a directory that holds no checkpoint,
    a tag that is not a completed one, or a rank file that is missing or cut short."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a directory; give the checkpoint.dir a run saved into")
    if tag is None:
        tag = read_latest(directory)
        if tag is None:
            tags = saved_tags(directory)
            raise CheckpointError(f"{directory} has no `latest` file" + (
                f"; give one of its saved tags with --tag ({', '.join(tags)})" if tags
                else ", and no saved checkpoint: give the checkpoint.dir a run saved into"))
    else:
        check_complete(directory, tag, source="--tag")
    tag_dir = os.path.join(directory, tag)
    meta = CheckpointMeta.read(tag_dir)
    check_rank_files(directory, tag, meta)
    with open(os.path.join(tag_dir, META_FILE)) as f:
        raw = json.load(f)
    files = {name: os.path.getsize(os.path.join(tag_dir, name)) for name, _ in meta.rank_files()}
    model = meta.model
    return {
        "directory": directory, "tag": tag, "global_steps": int(raw.get("global_steps", 0)),
        "model": model, "precision": meta.precision, "tensor_parallel_size": meta.tensor_parallel_size,
        "block_degrees": list(meta.block_degrees), "pipeline_layers": list(meta.pipeline_layers),
        "zero_stage": meta.zero_stage, "data_parallel_size": meta.data_parallel_size,
        "files": files, "bytes": sum(files.values()), "tags": saved_tags(directory),
    }


def text(info: dict[str, Any]) -> str:
    m = info["model"]
    degrees = info["block_degrees"]
    uniform = all(d == info["tensor_parallel_size"] for d in degrees)
    stages = info["pipeline_layers"]
    lines = [
        f"checkpoint {os.path.join(info['directory'], info['tag'])} | step {info['global_steps']} | {info['precision']}",
        f"model: {m.get('family')} h={m.get('hidden_size')} L={m.get('num_layers')} heads={m.get('num_heads')} "
        f"vocab={m.get('vocab_size')} seq={m.get('seq_len')}",
        f"layout: TMP {info['tensor_parallel_size']}"
        + (" (every block)" if uniform else f", plan block degrees {degrees}")
        + (f" | PP {len(stages)} (layers per stage {stages})" if len(stages) > 1 else "")
        + f" | ZeRO {info['zero_stage']}"
        + (f" over DP {info['data_parallel_size']}" if info["zero_stage"] else ""),
        f"files: {len(info['files'])} rank files, {info['bytes']:,} bytes, all complete",
        f"saved tags (oldest first): {', '.join(info['tags'])}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        info = describe(args.directory, args.tag)
    except CheckpointError as err:
        fail(str(err))
    print(json.dumps(info, indent=1) if args.json else text(info))


def entry() -> None:
    main(sys.argv[1:])


if __name__ == "__main__":
    entry()
