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
        if self.source == "mmap" and not (self.path and os.path.exists(self.path)):
            raise ValueError(f"data.path={self.path!r} does not exist; data.source=mmap needs a uint16 token file")


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


class TokenBatches:
    """Fixed-length windows ``(tokens, labels = tokens shifted by one)`` of a token stream."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, masked_lm: bool = False) -> None:
        self.cfg, self.vocab_size, self.seq_len, self.masked_lm = cfg, vocab_size, seq_len, masked_lm
        if cfg.source == "text":
            self.tokens = embedded_text_tokens()
        elif cfg.source == "mmap":
            self.tokens = np.memmap(cfg.path, dtype=np.uint16, mode="r")
        else:
            self.tokens = None
        if self.tokens is not None:
            top = int(self.tokens.max())
            if top >= vocab_size:
                raise ValueError(f"model.vocab_size={vocab_size} is smaller than token id {top} in data.source={cfg.source}")
            self.windows = (len(self.tokens) - 1) // seq_len
            if self.windows < 1:
                raise ValueError(f"data has {len(self.tokens)} tokens, fewer than model.seq_len+1={seq_len + 1}")
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
