"""Token sources for training: embedded text, synthetic tokens, or a memory-mapped token file.

The embedded default needs no download: byte-level tokens (vocabulary 256)
from the Python standard library's own source files, which every Python
installation ships.  Batches are drawn by (step, micro-batch, DP rank) from a
seeded permutation of windows, so every TMP rank of a group reads the same
samples, DP ranks read different ones, and a resumed run reads what the
uninterrupted run would have.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

TOKEN_BYTES = np.dtype(np.uint16).itemsize
"""A token file (``data.source=mmap``) is a flat array of uint16 token ids."""
EMBEDDED_FILES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
                  "json/decoder.py", "logging/__init__.py", "os.py", "pathlib.py", "random.py", "subprocess.py",
                  "textwrap.py", "typing.py", "unittest/case.py")


@dataclass(frozen=True)
class DataConfig:
    """Attributes:
        source: "text" (embedded stdlib bytes), "synthetic" (uniform random tokens) or
            "mmap" (a flat uint16 token file at ``path``).
        path: token file for "mmap".
        seed: permutation seed.
    """

    source: Literal["text", "synthetic", "mmap"] = "text"
    path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("text", "synthetic", "mmap"):
            raise ValueError(f"data.source={self.source!r} unknown; choose text, synthetic or mmap")
        if self.source == "mmap":
            if not self.path:
                raise ValueError("data.path is not set; data.source=mmap needs a uint16 token file, e.g. data.path=tokens.bin")
            if not os.path.exists(self.path):
                raise ValueError(f"data.path={self.path!r} does not exist; data.source=mmap needs a uint16 token file")
            if not os.path.isfile(self.path):
                raise ValueError(f"data.path={self.path!r} is not a file; give the uint16 token file itself")
            size = os.path.getsize(self.path)
            if size == 0:
                raise ValueError(f"data.path={self.path!r} is empty; give a file of uint16 tokens")
            if size % TOKEN_BYTES:
                raise ValueError(f"data.path={self.path!r} has {size} bytes, not a whole number of {TOKEN_BYTES}-byte "
                                 f"uint16 tokens; the file is truncated or not a uint16 token file")


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


def load_tokens(cfg: DataConfig) -> np.ndarray | None:
    """The token stream of ``cfg`` (memory-mapped for a file); None for synthetic tokens."""
    if cfg.source == "text":
        return embedded_text_tokens()
    if cfg.source == "mmap":
        return np.memmap(cfg.path, dtype=np.uint16, mode="r")
    return None


def check_tokens(cfg: DataConfig, tokens: np.ndarray | None, vocab_size: int, seq_len: int) -> None:
    """Raise one line if the model cannot train on ``tokens``: an id outside the vocabulary
    (the embedding lookup would fail inside a rank) or not one ``seq_len + 1`` window."""
    if tokens is None:
        return
    where = f"data.path={cfg.path!r}" if cfg.source == "mmap" else f"data.source={cfg.source}"
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{where} has {len(tokens)} tokens, fewer than one window of model.seq_len+1={seq_len + 1}; "
                         f"give more data or a smaller model.seq_len")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is smaller than token id {top} in {where}; "
                         f"set model.vocab_size={top + 1} or more")


def check_data(cfg: DataConfig, vocab_size: int, seq_len: int) -> None:
    """What :class:`TokenBatches` checks, for a launcher to run before any rank starts."""
    check_tokens(cfg, load_tokens(cfg), vocab_size, seq_len)


class TokenBatches:
    """Fixed-length windows ``(tokens, labels = tokens shifted by one)`` of a token stream."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, masked_lm: bool = False) -> None:
        self.cfg, self.vocab_size, self.seq_len, self.masked_lm = cfg, vocab_size, seq_len, masked_lm
        self.tokens = load_tokens(cfg)
        check_tokens(cfg, self.tokens, vocab_size, seq_len)
        if self.tokens is not None:
            self.windows = (len(self.tokens) - 1) // seq_len
            self.order = np.random.default_rng(cfg.seed).permutation(self.windows)

    def batch(self, step: int, slots: int, slot: int, size: int) -> dict[str, torch.Tensor]:
        """``size`` samples for ``slot`` of ``slots`` per step.  Use
        ``slot = micro_batch_index * dp_size + dp_rank`` so each rank gets its own share."""
        first = (step * slots + slot) * size
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + first)
            seq = torch.randint(0, self.vocab_size, (size, self.seq_len + 1), generator=gen)
        else:
            rows = []
            for j in range(size):
                w = int(self.order[(first + j) % self.windows])
                rows.append(np.asarray(self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1], dtype=np.int64))
            seq = torch.from_numpy(np.stack(rows))
        if self.masked_lm:  # BERT: predict 15% of positions, replaced by token 0 ([MASK])
            tokens = seq[:, :-1].contiguous()
            gen = torch.Generator().manual_seed(self.cfg.seed * 104729 + first)
            picked = torch.rand(tokens.shape, generator=gen) < 0.15
            picked[:, 0] = True  # at least one labelled token per sample
            labels = torch.where(picked, tokens, torch.full_like(tokens, -100))
            return {"tokens": tokens.masked_fill(picked, 0), "labels": labels}
        return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
