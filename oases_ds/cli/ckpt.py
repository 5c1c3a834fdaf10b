"""``oases-ckpt``: look inside a checkpoint directory, convert it to and from Hugging Face,
or rewrite it for another layout, without starting a run.

    oases-ckpt info runs/ckpt              # what `latest` names: model, layout, step, precision, files
    oases-ckpt info runs/ckpt --tag step20 # another saved tag
    oases-ckpt info runs/ckpt --json       # the same, as one JSON object
    oases-ckpt convert runs/ckpt --to-hf runs/hf        # the portable state's weights, for from_pretrained
    oases-ckpt convert --from-hf runs/hf runs/ckpt2     # a checkpoint (tag `hf`) any layout resumes from
    oases-ckpt convert --from-hf runs/hf runs/ckpt2 --bf16 --tag start   # for a bf16 run
    oases-ckpt reshard runs/ckpt runs/tp4 --tensor-parallel-size 4      # DeepSpeed's files for another layout
    oases-ckpt reshard runs/old runs/portable                            # add the portable state to an old checkpoint

It parses and dispatches; the work, and why it works that way, is in the library:
:mod:`oases_ds.checkpoint.info` (``info``: reads no tensor), :mod:`oases_ds.checkpoint.convert`
(``convert``: offline, through the portable state) and :mod:`oases_ds.checkpoint.reshard`
(``reshard``: the target layout's ranks load and save it).

A plain argparse CLI with subcommands, like ``oases-data``: its input is a directory, not a
composed training configuration.  Bad input is one ``error:`` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

# Nothing here needs an accelerator: keep DeepSpeed, imported with the package, from probing
# for a GPU and warning that it found none.  A user's setting is kept.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from oases_ds.checkpoint.convert import from_hf, to_hf  # noqa: E402
from oases_ds.checkpoint.info import describe, info_text  # noqa: E402
from oases_ds.checkpoint.reshard import reshard  # noqa: E402
from oases_ds.cli.common import fail  # noqa: E402
from oases_ds.launcher import LaunchError  # noqa: E402


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
    resharding = sub.add_parser("reshard", help="write a checkpoint of another layout (starts its ranks on this machine)")
    resharding.add_argument("directory", help="the checkpoint directory to read")
    resharding.add_argument("out", help="the checkpoint directory to write (new or empty)")
    resharding.add_argument("--tag", default=None, help="the saved tag to read (default: the one `latest` names)")
    resharding.add_argument("--tensor-parallel-size", type=int, default=None, help="TMP degree (default: the saved one)")
    resharding.add_argument("--data-parallel-size", type=int, default=None, help="DP ranks (default: the saved ones)")
    resharding.add_argument("--pipeline-stages", type=int, default=None, help="pipeline stages (default: the saved ones)")
    resharding.add_argument("--zero-stage", type=int, choices=(0, 1), default=None, help="ZeRO stage (default: the saved one)")
    resharding.add_argument("--plan", default=None, help="a plan JSON of oases-plan for per-block degrees (default: "
                         "every block at the TMP degree, or the saved plan when the TMP degree is kept)")
    resharding.add_argument("--timeout-s", type=float, default=600.0, help="launch and process-group timeout")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "convert" and args.bf16 and args.to_hf:
        fail("--bf16 applies to --from-hf only; --to-hf writes the checkpoint's own precision")
    try:
        if args.command == "info":
            info = describe(args.directory, args.tag)
            print(json.dumps(info, indent=1) if args.json else info_text(info))
        elif args.command == "reshard":
            tag, saved, target, step = reshard(args.directory, args.out, args.tag, args.tensor_parallel_size,
                                               args.data_parallel_size, args.pipeline_stages, args.zero_stage, args.plan,
                                               args.timeout_s)
            print(f"wrote {os.path.join(args.out, tag)} (step {step}, {target.describe()}) from "
                  f"{os.path.join(args.directory, tag)} ({saved.describe()}), {target.world} ranks on this machine")
        elif args.to_hf:
            tag = to_hf(args.directory, args.to_hf, args.tag)
            print(f"wrote {args.to_hf} (Hugging Face model) from {os.path.join(args.directory, tag)}")
        else:
            tag = from_hf(args.from_hf, args.directory, args.tag, args.bf16)
            print(f"wrote {os.path.join(args.directory, tag)} (step 0, portable state only) from {args.from_hf}; resume "
                  f"with oases-train model=hf model.path={args.from_hf} checkpoint.dir={args.directory} "
                  "checkpoint.resume=true")
    except LaunchError as err:  # a rank of reshard failed: its one line
        fail(err.summary)
    except (ValueError, OSError) as err:  # CheckpointError and PortableStateError are ValueErrors
        fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)


def entry() -> None:
    main(sys.argv[1:])


if __name__ == "__main__":
    entry()
