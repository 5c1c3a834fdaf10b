"""``oases-data``: tokenize a local corpus into the token file ``oases-train data=mmap`` reads.

    oases-data --tokenizer tokenizer.json --out data/tokens.bin --eval-fraction 0.01 'corpus/*.jsonl' notes.txt

A plain argparse CLI rather than Hydra: its inputs are file lists and globs, not
a composed training configuration.  It parses and dispatches; the work is
:func:`oases_ds.data.tokenize_corpus`.  Bad input is one ``error:`` line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from oases_ds.cli.common import fail
from oases_ds.data import TOKEN_DTYPES, CorpusSpec, tokenize_corpus


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oases-data", description=__doc__.split("\n\n")[0].strip("` \n"))
    p.add_argument("inputs", nargs="+", help=".txt (one document per file) / .jsonl (one per line) files or globs")
    p.add_argument("--tokenizer", required=True, help="a local tokenizer.json (never downloaded)")
    p.add_argument("--out", required=True, help="the token file to write; its sidecar is OUT.json")
    p.add_argument("--text-field", default="text", help="the .jsonl field holding the text (default: text)")
    p.add_argument("--eos-token", default=None, help="document separator token (default: the tokenizer's EOS/sep)")
    p.add_argument("--mask-token", default=None,
                   help="the masked-LM [MASK] token recorded in the sidecar (default: [MASK] or <mask> if the tokenizer has one)")
    p.add_argument("--dtype", default="auto", choices=("auto", *TOKEN_DTYPES),
                   help="auto: uint16 when the vocabulary has <= 65,535 ids, else uint32")
    p.add_argument("--eval-fraction", type=float, default=0.0,
                   help="share of documents written to a held-out file instead (oases-train evaluates on it)")
    p.add_argument("--eval-out", default=None, help="the held-out token file (default: OUT with .eval before its extension)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    spec = CorpusSpec(tuple(args.inputs), args.tokenizer, args.out, args.text_field, args.eos_token, args.dtype,
                      args.eval_fraction, args.eval_out, mask_token=args.mask_token)
    try:
        report = tokenize_corpus(spec)
    except ValueError as err:
        fail(str(err))
    except OSError as err:  # unreadable input, full disk, no permission: name the file
        fail(f"{err.filename or spec.out}: {err.strerror or err}")
    held = f" | held out {report.eval_documents} docs, {report.eval_tokens:,} tokens -> {report.outputs[1]}" \
        if report.eval_documents else ""
    print(f"oases-data: {len(report.files)} files, {report.documents} docs, {report.tokens:,} tokens -> "
          f"{report.outputs[0]} ({report.dtype}, vocabulary {report.vocab_size:,}"
          f"{f', [MASK] id {report.mask_id}' if report.mask_id >= 0 else ''}){held}")


def entry() -> None:
    main(sys.argv[1:])


if __name__ == "__main__":
    entry()
