"""The token file ``oases-data`` writes and training reads: flat ids, and a JSON sidecar saying what they are.

Why a module of its own: the writer (:mod:`oases_ds.data.corpus`) and the reader
(:mod:`oases_ds.data.batches`) must agree on one format, so it is described once.  A file
without a sidecar is a flat array of uint16 ids (``data.source=mmap`` on a file made
elsewhere); the sidecar is what lets a file be uint32 when a vocabulary outgrows uint16 and
what lets training refuse a file made with a bigger vocabulary than the model's.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from oases_ds.utils.io import write_json_atomic

TOKEN_BYTES = np.dtype(np.uint16).itemsize
"""A token file without a sidecar (``data.source=mmap``) is a flat array of uint16 token ids."""
TOKEN_DTYPES = ("uint16", "uint32")
UINT16_VOCAB = 65_535
"""The largest vocabulary written as uint16 (``oases-data --dtype auto``)."""
SIDECAR_FORMAT = "oases-tokens/1"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "[SEP]", "<sep>", "<|eos|>")
"""Special tokens tried, in order, as the document separator when ``--eos-token`` is not given."""
MASK_CANDIDATES = ("[MASK]", "<mask>")
"""Tokens tried, in order, as the masked-LM ``[MASK]`` when ``--mask-token`` is not given."""
PAD_CANDIDATES = ("[PAD]", "<pad>")
"""Tokens tried, in order, as the padding token recorded in the sidecar."""
@dataclass(frozen=True)
class TokenFileMeta:
    """The sidecar ``<token file>.json`` that ``oases-data`` writes next to a token file.

    Attributes:
        dtype: "uint16" or "uint32", how each id is stored.
        vocab_size: the tokenizer's vocabulary; every id is below it.
        tokens: ids in the file (its size is ``tokens * itemsize``: a mismatch means a torn or foreign file).
        tokenizer: the tokenizer.json the ids came from.
        eos_id: the id written after each document.
        sources: the corpus files, in the order they were read.
        held_out: the held-out token file of the same run (a name beside this one), if any.
        mask_id: the tokenizer's ``[MASK]`` (:data:`MASK_CANDIDATES` or ``--mask-token``); -1: none.
        pad_id: the tokenizer's ``[PAD]`` (:data:`PAD_CANDIDATES`); -1: none.
        special_ids: ids a masked-LM rule never picks: the tokenizer's special tokens, the
            separator, ``[MASK]`` and ``[PAD]``.
    """

    dtype: str
    vocab_size: int
    tokens: int
    tokenizer: str = ""
    eos_id: int = -1
    sources: tuple[str, ...] = ()
    held_out: str | None = None
    mask_id: int = -1
    pad_id: int = -1
    special_ids: tuple[int, ...] = ()
    format: str = SIDECAR_FORMAT

    @staticmethod
    def path_for(token_file: str) -> str:
        return token_file + ".json"

    @classmethod
    def read(cls, token_file: str) -> "TokenFileMeta | None":
        """The sidecar of ``token_file``; None when it has none (a plain uint16 file)."""
        side = cls.path_for(token_file)
        if not os.path.exists(side):
            return None
        try:
            with open(side) as f:
                raw = json.load(f)
            meta = cls(**{**raw, "sources": tuple(raw.get("sources", ())),
                          "special_ids": tuple(raw.get("special_ids", ()))})
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{side} is not a token-file sidecar ({err}); rewrite it with oases-data or delete it "
                             f"to read {token_file} as plain uint16") from None
        if meta.dtype not in TOKEN_DTYPES:
            raise ValueError(f"{side}: dtype={meta.dtype!r} unknown; oases-data writes uint16 or uint32")
        return meta

    def write(self, token_file: str) -> None:
        write_json_atomic(self.path_for(token_file),
                          {**asdict(self), "sources": list(self.sources), "special_ids": list(self.special_ids)})


def check_token_file(key: str, path: str) -> TokenFileMeta | None:
    """One line for a token file that cannot be read as one; its sidecar when it has one."""
    if not os.path.exists(path):
        raise ValueError(f"{key}={path!r} does not exist; data.source=mmap needs a token file (oases-data writes one)")
    if not os.path.isfile(path):
        raise ValueError(f"{key}={path!r} is not a file; give the token file itself")
    meta = TokenFileMeta.read(path)
    dtype = meta.dtype if meta else "uint16"
    item = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{key}={path!r} is empty; give a file of {dtype} tokens")
    if size % item:
        raise ValueError(f"{key}={path!r} has {size} bytes, not a whole number of {item}-byte "
                         f"{dtype} tokens; the file is truncated or not a {dtype} token file")
    if meta and size != meta.tokens * item:
        raise ValueError(f"{key}={path!r} holds {size // item} tokens but its sidecar {TokenFileMeta.path_for(path)} "
                         f"says {meta.tokens}; the file is torn or from another run: rerun oases-data")
    return meta


def read_token_file(path: str) -> np.ndarray:
    """A token file memory-mapped in the dtype its sidecar names (uint16 without one)."""
    meta = TokenFileMeta.read(path)
    return np.memmap(path, dtype=meta.dtype if meta else np.uint16, mode="r")
