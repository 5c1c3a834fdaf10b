"""Token sources for training: embedded text, synthetic tokens, or a memory-mapped token file.

The embedded default needs no download: byte-level tokens (vocabulary 256)
from the Python standard library's own source files, which every Python
installation ships.  Batches are drawn by (step, micro-batch, DP rank) from a
seeded permutation of windows, so every TMP rank of a group reads the same
samples, DP ranks read different ones, and a resumed run reads what the
uninterrupted run would have.

Held-out evaluation reads windows no training step reads: a separate token file
(``data.eval_path``, or the held-out file ``oases-data`` names in the sidecar),
or else the last ``data.eval_fraction`` of the permutation, which training then
never visits.  Without that, an "eval loss" would partly be a training loss.

Real corpora: :func:`tokenize_corpus` (the ``oases-data`` CLI) runs a local
Hugging Face ``tokenizer.json`` over ``.txt`` / ``.jsonl`` files and streams the
ids into a flat token file plus a JSON sidecar (``<file>.json``: dtype,
vocabulary size, token count, tokenizer, sources).  The sidecar is what lets a
file be uint32 when a vocabulary outgrows uint16, and what lets ``data=mmap``
refuse a file made with a bigger vocabulary than the model's before any rank
starts.  Nothing is ever downloaded.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Literal

import numpy as np
import torch

from oases_ds.utils.io import fsync_directory, write_json_atomic

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKEN_BYTES = np.dtype(np.uint16).itemsize
"""A token file without a sidecar (``data.source=mmap``) is a flat array of uint16 token ids."""
TOKEN_DTYPES = ("uint16", "uint32")
UINT16_VOCAB = 65_535
"""The largest vocabulary written as uint16 (``oases-data --dtype auto``)."""
SIDECAR_FORMAT = "oases-tokens/1"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "[SEP]", "<sep>", "<|eos|>")
"""Special tokens tried, in order, as the document separator when ``--eos-token`` is not given."""
EMBEDDED_FILES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
                  "json/decoder.py", "logging/__init__.py", "os.py", "pathlib.py", "random.py", "subprocess.py",
                  "textwrap.py", "typing.py", "unittest/case.py")


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
    """

    dtype: str
    vocab_size: int
    tokens: int
    tokenizer: str = ""
    eos_id: int = -1
    sources: tuple[str, ...] = ()
    held_out: str | None = None
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
            meta = cls(**{**raw, "sources": tuple(raw.get("sources", ()))})
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{side} is not a token-file sidecar ({err}); rewrite it with oases-data or delete it "
                             f"to read {token_file} as plain uint16") from None
        if meta.dtype not in TOKEN_DTYPES:
            raise ValueError(f"{side}: dtype={meta.dtype!r} unknown; oases-data writes uint16 or uint32")
        return meta

    def write(self, token_file: str) -> None:
        write_json_atomic(self.path_for(token_file), {**asdict(self), "sources": list(self.sources)})


def _check_token_file(key: str, path: str) -> TokenFileMeta | None:
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


@dataclass(frozen=True)
class DataConfig:
    """Attributes:
        source: "text" (embedded stdlib bytes), "synthetic" (uniform random tokens) or
            "mmap" (a flat token file at ``path``: uint16, or what its ``oases-data`` sidecar says).
        path: token file for "mmap".
        seed: permutation seed.
        eval_path: held-out token file for evaluation; None: the held-out file ``path``'s
            sidecar names, else the last ``eval_fraction`` of the windows.
        eval_fraction: share of the windows held out of training when there is no held-out file.
    """

    source: Literal["text", "synthetic", "mmap"] = "text"
    path: str | None = None
    seed: int = 0
    eval_path: str | None = None
    eval_fraction: float = 0.01

    def __post_init__(self) -> None:
        if self.source not in ("text", "synthetic", "mmap"):
            raise ValueError(f"data.source={self.source!r} unknown; choose text, synthetic or mmap")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be > 0 and < 1 (share of windows held out "
                             f"for evaluation), e.g. data.eval_fraction=0.01")
        if self.source == "mmap":
            if not self.path:
                raise ValueError("data.path is not set; data.source=mmap needs a token file, e.g. data.path=tokens.bin")
            _check_token_file("data.path", self.path)
        if self.eval_path:
            if self.source == "synthetic":
                raise ValueError("data.eval_path is set but data.source=synthetic reads no file; unset data.eval_path")
            _check_token_file("data.eval_path", self.eval_path)

    def held_out_path(self) -> str | None:
        """The held-out token file: ``eval_path``, else the one ``path``'s sidecar names."""
        if self.eval_path or self.source != "mmap":
            return self.eval_path
        meta = TokenFileMeta.read(self.path)
        if meta and meta.held_out:
            held = os.path.join(os.path.dirname(os.path.abspath(self.path)), meta.held_out)
            _check_token_file(f"data.path={self.path!r}: its sidecar's held_out", held)
            return held
        return None


def embedded_text_tokens() -> np.ndarray:
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks = []
    for rel in EMBEDDED_FILES:
        path = os.path.join(stdlib, rel)
        if os.path.exists(path):
            with open(path, "rb") as f:
                chunks.append(np.frombuffer(f.read(), dtype=np.uint8))
    if not chunks:
        raise RuntimeError(f"no embedded text found under {stdlib}; use data.source=synthetic")
    return np.concatenate(chunks).astype(np.int64)


def read_token_file(path: str) -> np.ndarray:
    """A token file memory-mapped in the dtype its sidecar names (uint16 without one)."""
    meta = TokenFileMeta.read(path)
    return np.memmap(path, dtype=meta.dtype if meta else np.uint16, mode="r")


def load_tokens(cfg: DataConfig) -> np.ndarray | None:
    """The token stream of ``cfg`` (memory-mapped for a file); None for synthetic tokens."""
    if cfg.source == "text":
        return embedded_text_tokens()
    if cfg.source == "mmap":
        return read_token_file(cfg.path)
    return None


def check_tokens(cfg: DataConfig, tokens: np.ndarray | None, vocab_size: int, seq_len: int,
                 key: str | None = None) -> None:
    """Raise one line if the model cannot train on ``tokens``: a file tokenized with a larger
    vocabulary, an id outside the vocabulary (the embedding lookup would fail inside a rank)
    or not one ``seq_len + 1`` window.  ``key`` names the file (default: ``data.path``)."""
    if tokens is None:
        return
    path = cfg.path if key is None else cfg.held_out_path()
    where = f"{key or 'data.path'}={path!r}" if path else f"data.source={cfg.source}"
    meta = TokenFileMeta.read(path) if path else None
    if meta and meta.vocab_size > vocab_size:
        raise ValueError(f"{where} was tokenized with a vocabulary of {meta.vocab_size} (tokenizer {meta.tokenizer}) but "
                         f"model.vocab_size={vocab_size}; set model.vocab_size={meta.vocab_size} or more")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{where} has {len(tokens)} tokens, fewer than one window of model.seq_len+1={seq_len + 1}; "
                         f"give more data or a smaller model.seq_len")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is smaller than token id {top} in {where}; "
                         f"set model.vocab_size={top + 1} or more")


def check_data(cfg: DataConfig, vocab_size: int, seq_len: int) -> None:
    """What :class:`TokenBatches` checks, for a launcher to run before any rank starts."""
    TokenBatches(cfg, vocab_size, seq_len)


def _windows(tokens: np.ndarray, seq_len: int) -> int:
    return (len(tokens) - 1) // seq_len


class TokenBatches:
    """Fixed-length windows ``(tokens, labels = tokens shifted by one)`` of a token stream,
    split into training windows (:meth:`batch`) and held-out windows (:meth:`eval_batch`)."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, masked_lm: bool = False) -> None:
        self.cfg, self.vocab_size, self.seq_len, self.masked_lm = cfg, vocab_size, seq_len, masked_lm
        self.tokens = load_tokens(cfg)
        check_tokens(cfg, self.tokens, vocab_size, seq_len)
        if self.tokens is None:
            return
        held = cfg.held_out_path()
        order = np.random.default_rng(cfg.seed).permutation(_windows(self.tokens, seq_len))
        if held:
            self.eval_tokens = read_token_file(held)
            check_tokens(cfg, self.eval_tokens, vocab_size, seq_len, key="data.eval_path")
            self.order = order
            self.eval_order = np.random.default_rng(cfg.seed + 1).permutation(_windows(self.eval_tokens, seq_len))
        else:  # the permutation's tail is held out: training never reads it
            held_out = max(1, math.ceil(len(order) * cfg.eval_fraction))
            if held_out >= len(order):
                where = f"data.path={cfg.path!r}" if cfg.source == "mmap" else f"data.source={cfg.source}"
                raise ValueError(f"{where} has {len(order)} window(s) of model.seq_len+1={seq_len + 1} tokens: holding "
                                 f"{held_out} out for evaluation leaves none to train on; give more data, a smaller "
                                 f"model.seq_len, or a held-out file (data.eval_path, oases-data --eval-fraction)")
            self.eval_tokens = self.tokens
            self.order, self.eval_order = order[:-held_out], order[-held_out:]
        self.windows = len(self.order)

    def _rows(self, tokens: np.ndarray, order: np.ndarray, first: int, size: int) -> torch.Tensor:
        rows = []
        for j in range(size):
            w = int(order[(first + j) % len(order)])
            rows.append(np.asarray(tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def batch(self, step: int, slots: int, slot: int, size: int) -> dict[str, torch.Tensor]:
        """``size`` training samples for ``slot`` of ``slots`` per step.  Use
        ``slot = micro_batch_index * dp_size + dp_rank`` so each rank gets its own share."""
        first = (step * slots + slot) * size
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + first)
            seq = torch.randint(0, self.vocab_size, (size, self.seq_len + 1), generator=gen)
        else:
            seq = self._rows(self.tokens, self.order, first, size)
        return self._sample(seq, first)

    def eval_batch(self, index: int, slots: int, slot: int, size: int) -> dict[str, torch.Tensor]:
        """``size`` held-out samples (no training step reads them) for ``slot`` of ``slots``;
        ``index`` walks the held-out windows, so evaluation ``index=0`` is the same at every step."""
        first = (index * slots + slot) * size
        if self.tokens is None:  # synthetic: a generator stream training seeds never reach (they are >= 0)
            gen = torch.Generator().manual_seed(2**62 + self.cfg.seed * 7919 + first)
            seq = torch.randint(0, self.vocab_size, (size, self.seq_len + 1), generator=gen)
        else:
            seq = self._rows(self.eval_tokens, self.eval_order, first, size)
        return self._sample(seq, -1 - first)

    def _sample(self, seq: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        if self.masked_lm:  # BERT: predict 15% of positions, replaced by token 0 ([MASK])
            tokens = seq[:, :-1].contiguous()
            gen = torch.Generator().manual_seed((self.cfg.seed * 104729 + first) % 2**63)
            picked = torch.rand(tokens.shape, generator=gen) < 0.15
            picked[:, 0] = True  # at least one labelled token per sample
            labels = torch.where(picked, tokens, torch.full_like(tokens, -100))
            return {"tokens": tokens.masked_fill(picked, 0), "labels": labels}
        return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
