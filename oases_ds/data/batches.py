"""Training batches: fixed-length windows of a token stream, drawn the same on every TMP rank of a group.

Sources: byte-level tokens (vocabulary 256) from the Python standard library's own source
files, which every Python installation ships, so the default needs no download; synthetic
uniform tokens; or a memory-mapped token file (:mod:`oases_ds.data.token_file`).  Batches are
drawn by (step, micro-batch, DP rank) from a seeded permutation of windows, so every TMP rank
of a group reads the same samples, DP ranks read different ones, and a resumed run reads what
the uninterrupted run would have.

Held-out evaluation reads windows no training step reads: a separate token file
(``data.eval_path``, or the held-out file ``oases-data`` names in the sidecar), or else the
last ``data.eval_fraction`` of the permutation, which training then never visits.  Without
that, an "eval loss" would partly be a training loss.  A masked-LM run takes its ``[MASK]``
id, the ids it must never pick and the vocabulary of its random replacements from the
sidecar: those belong to the tokenizer, not to the model.
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from oases_ds.data.token_file import MASK_CANDIDATES, TokenFileMeta, check_token_file, read_token_file

EMBEDDED_FILES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
                  "json/decoder.py", "logging/__init__.py", "os.py", "pathlib.py", "random.py", "subprocess.py",
                  "textwrap.py", "typing.py", "unittest/case.py")


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
            check_token_file("data.path", self.path)
        if self.eval_path:
            if self.source == "synthetic":
                raise ValueError("data.eval_path is set but data.source=synthetic reads no file; unset data.eval_path")
            check_token_file("data.eval_path", self.eval_path)

    def held_out_path(self) -> str | None:
        """The held-out token file: ``eval_path``, else the one ``path``'s sidecar names."""
        if self.eval_path or self.source != "mmap":
            return self.eval_path
        meta = TokenFileMeta.read(self.path)
        if meta and meta.held_out:
            held = os.path.join(os.path.dirname(os.path.abspath(self.path)), meta.held_out)
            check_token_file(f"data.path={self.path!r}: its sidecar's held_out", held)
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


def check_data(cfg: DataConfig, vocab_size: int, seq_len: int, masked_lm: bool = False) -> None:
    """What :class:`TokenBatches` checks, for a launcher to run before any rank starts."""
    TokenBatches(cfg, vocab_size, seq_len, masked_lm)


def _windows(tokens: np.ndarray, seq_len: int) -> int:
    return (len(tokens) - 1) // seq_len


@dataclass(frozen=True)
class MaskedLM:
    """BERT's masked-LM rule (Devlin et al. 2019, as ``transformers``' data collator):
    pick ``rate`` of the positions that are not special tokens (padding, ``[CLS]``,
    ``[SEP]``, ``[MASK]`` are never predicted), label them, and feed 80% of them as
    ``mask_id``, 10% as a random token and 10% unchanged -- so the model cannot learn
    that only ``[MASK]`` positions matter.

    The ids belong to the tokenizer: :meth:`for_data` reads them from a token file's
    sidecar.  The defaults are the byte-level rule of the embedded text and of synthetic
    tokens, which have no tokenizer (the NUL byte, id 0, stands for ``[MASK]``).

    Attributes:
        mask_id: the ``[MASK]`` token.
        special_ids: tokens never picked (real vocabularies: ``[PAD]``, ``[CLS]``, ``[SEP]``, ``[MASK]``).
        rate: share of the candidate positions picked.
        vocab_size: random replacements are drawn below it (the tokenizer's vocabulary);
            ``None``: the model's.
    """

    mask_id: int = 0
    special_ids: tuple[int, ...] = (0,)
    rate: float = 0.15
    vocab_size: int | None = None

    @classmethod
    def for_data(cls, cfg: DataConfig) -> "MaskedLM":
        """The rule for ``cfg``'s tokens: a token file's ids come from its ``oases-data``
        sidecar, and a file whose tokenizer has no ``[MASK]`` (or that has no sidecar) is
        refused in one line -- masking with a guessed id would train on a real token."""
        if cfg.source != "mmap":
            return cls()
        meta = TokenFileMeta.read(cfg.path)
        if meta is None:
            raise ValueError(f"data.path={cfg.path!r} has no sidecar {TokenFileMeta.path_for(cfg.path)}, so its [MASK] "
                             f"id is unknown and a masked-LM model (family bert) needs it; write the file with oases-data")
        if meta.mask_id < 0:
            raise ValueError(f"data.path={cfg.path!r} has no [MASK] id: its tokenizer {meta.tokenizer or '(unknown)'} has "
                             f"none of {', '.join(MASK_CANDIDATES)}, and a masked-LM model (family bert) needs one; rerun "
                             f"oases-data with --mask-token TOKEN, or use a tokenizer that has a mask token")
        return cls(meta.mask_id, tuple(meta.special_ids) or (meta.mask_id,), vocab_size=meta.vocab_size)


class TokenBatches:
    """Fixed-length windows ``(tokens, labels = tokens shifted by one)`` of a token stream,
    split into training windows (:meth:`batch`) and held-out windows (:meth:`eval_batch`)."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, masked_lm: bool | MaskedLM = False) -> None:
        """``masked_lm``: BERT batches; ``True`` takes the rule of ``cfg``'s tokens (:meth:`MaskedLM.for_data`)."""
        self.cfg, self.vocab_size, self.seq_len = cfg, vocab_size, seq_len
        self.masked_lm: MaskedLM | None = MaskedLM.for_data(cfg) if masked_lm is True else (masked_lm or None)
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
        if self.masked_lm is not None:
            return self._masked(seq[:, :-1].contiguous(), first, self.masked_lm)
        return lm_batch(seq)

    def _masked(self, tokens: torch.Tensor, first: int, rule: MaskedLM) -> dict[str, torch.Tensor]:
        """BERT inputs and labels of ``tokens`` under ``rule`` (see :class:`MaskedLM`)."""
        gen = torch.Generator().manual_seed((self.cfg.seed * 104729 + first) % 2**63)
        candidate = ~torch.isin(tokens, torch.tensor(rule.special_ids, dtype=tokens.dtype))
        picked = (torch.rand(tokens.shape, generator=gen) < rule.rate) & candidate
        # A sample with no pick labels its first candidate: every sample adds to the loss.
        empty = ~picked.any(dim=1) & candidate.any(dim=1)
        picked[empty, candidate[empty].int().argmax(dim=1)] = True
        labels = torch.where(picked, tokens, torch.full_like(tokens, -100))
        roll = torch.rand(tokens.shape, generator=gen)
        random_ids = torch.randint(0, rule.vocab_size or self.vocab_size, tokens.shape, generator=gen)
        inputs = tokens.masked_fill(picked & (roll < 0.8), rule.mask_id)
        inputs = torch.where(picked & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
        return {"tokens": inputs, "labels": labels}


def lm_batch(seq: torch.Tensor) -> dict[str, torch.Tensor]:
    """A causal-LM batch of ``[samples, seq_len + 1]`` token windows: each position's label is the next
    token (``tokens = seq[:, :-1]``, ``labels = seq[:, 1:]``, each contiguous, as the embedding and the
    loss read them)."""
    return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}


def synthetic_batch(vocab_size: int, samples: int, seq_len: int, seed: int,
                    device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """A seeded batch of uniform random tokens (:func:`lm_batch` of ``samples`` windows), drawn on the
    CPU so every rank and device gets the same ids for the same seed, then moved to ``device``: what
    the profiler, the accuracy check and the benchmarks step on when the data's content does not matter."""
    seq = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return lm_batch(seq if device is None else seq.to(device))
