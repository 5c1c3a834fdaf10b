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
vocabulary size, token count, tokenizer, sources, and the tokenizer's special ids).
The sidecar is what lets a file be uint32 when a vocabulary outgrows uint16, what
lets ``data=mmap`` refuse a file made with a bigger vocabulary than the model's
before any rank starts, and what gives a masked-LM run its ``[MASK]`` id, the ids
it must never pick and the vocabulary its random replacements come from: those
belong to the tokenizer, not to the model.  Nothing is ever downloaded.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Literal, Sequence

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
MASK_CANDIDATES = ("[MASK]", "<mask>")
"""Tokens tried, in order, as the masked-LM ``[MASK]`` when ``--mask-token`` is not given."""
PAD_CANDIDATES = ("[PAD]", "<pad>")
"""Tokens tried, in order, as the padding token recorded in the sidecar."""
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
        return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}

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


# -- oases-data: a local tokenizer over local text, streamed into a token file -----------------------
@dataclass(frozen=True)
class CorpusSpec:
    """What ``oases-data`` tokenizes and where it writes.

    Attributes:
        inputs: corpus files or glob patterns (``.txt``: one document per file; ``.jsonl``: one per line).
        tokenizer: a local ``tokenizer.json`` (the ``tokenizers`` library's format); never downloaded.
        out: the training token file; its sidecar is ``out + ".json"``.
        text_field: the field of each ``.jsonl`` record that holds the text.
        eos_token: the separator written after each document; None: the first of
            :data:`EOS_CANDIDATES` the tokenizer knows.
        dtype: "auto" (uint16 when the vocabulary fits, else uint32), "uint16" or "uint32".
        eval_fraction: share of documents written to the held-out file instead (0: none).
        eval_out: the held-out token file; None: ``out`` with ``.eval`` before its extension.
        batch_docs: documents per ``encode_batch`` call (memory holds only this many).
        mask_token: the masked-LM ``[MASK]`` recorded in the sidecar; None: the first of
            :data:`MASK_CANDIDATES` the tokenizer knows (none found: none recorded).
    """

    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    text_field: str = "text"
    eos_token: str | None = None
    dtype: str = "auto"
    eval_fraction: float = 0.0
    eval_out: str | None = None
    batch_docs: int = 256
    mask_token: str | None = None

    def held_out_path(self) -> str:
        if self.eval_out:
            return self.eval_out
        stem, ext = os.path.splitext(self.out)
        return f"{stem}.eval{ext or '.bin'}"


TXT_CHUNK_CHARS = 1 << 20
"""A ``.txt`` document is tokenized in line-aligned pieces of about this many characters, so a
multi-gigabyte file never sits in memory whole (the pieces' ids are concatenated)."""


def load_tokenizer(path: str) -> "Tokenizer":
    """A local tokenizer.json; one line when it is missing or not one."""
    try:  # optional dependency ([hf] extra): only oases-data needs it
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("oases-data needs the tokenizers package; pip install 'oases-ds[hf]'") from None
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {path}: no such file; give a local tokenizer.json "
                         f"(saved by tokenizers' Tokenizer.save or a Hugging Face model folder)")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # noqa: BLE001 -- the Rust side raises plain Exception for any parse error
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"--tokenizer {path}: not a tokenizers tokenizer.json ({first})") from None


def resolve_inputs(patterns: Iterable[str]) -> list[str]:
    """Files named or matched, in order, each once; one line for a pattern that names nothing."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matched = [m for m in matched if os.path.isfile(m)]
        if not matched:
            raise ValueError(f"input {pattern!r} matches no file; give .txt/.jsonl files or a glob such as 'corpus/*.jsonl'")
        for path in matched:
            if not path.endswith((".txt", ".jsonl")):
                raise ValueError(f"input {path!r} is neither .txt nor .jsonl; convert it, or name only those files")
            if path not in files:
                files.append(path)
    if not files:
        raise ValueError("no input files; give .txt/.jsonl files or globs")
    return files


def iter_documents(path: str, text_field: str = "text") -> Iterator[tuple[str, bool]]:
    """The text of ``path`` as ``(piece, ends_a_document)``: a ``.jsonl`` record is one piece
    ending its document; a ``.txt`` file is one document read in line-aligned pieces of about
    :data:`TXT_CHUNK_CHARS`, so a huge file never sits in memory whole."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise ValueError(f"{path}:{number}: not a JSON line ({err.args[0].split(':')[0]}); "
                                     f"each line of a .jsonl must be one JSON object") from None
                if not isinstance(record, dict) or text_field not in record:
                    keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{path}:{number}: no field {text_field!r} (has: {keys}); "
                                     f"pass --text-field NAME to read another field")
                text = record[text_field]
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: field {text_field!r} is a {type(text).__name__}, not text")
                if text.strip():
                    yield text, True
        return
    with open(path, encoding="utf-8") as f:
        previous, yielded = None, False
        for chunk in _line_chunks(f, TXT_CHUNK_CHARS):
            if previous is not None:  # one piece behind, so the last one can say it ends the document
                yield previous, False
                yielded = True
            previous = chunk
        if previous is not None and (yielded or previous.strip()):
            yield previous, True


def _line_chunks(lines: Iterable[str], chars: int) -> Iterator[str]:
    """Consecutive lines joined into pieces of about ``chars`` characters (a piece ends at a line end)."""
    piece: list[str] = []
    size = 0
    for line in lines:
        piece.append(line)
        size += len(line)
        if size >= chars:
            yield "".join(piece)
            piece, size = [], 0
    if piece:
        yield "".join(piece)


def _documents(files: Sequence[str], text_field: str) -> Iterator[tuple[str, bool]]:
    """Every piece of ``files`` (see :func:`iter_documents`); a file that is not UTF-8 is one line naming it."""
    for path in files:
        try:
            yield from iter_documents(path, text_field)
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); convert it to UTF-8") from None


def eos_id(tokenizer: "Tokenizer", token: str | None) -> int:
    """The document separator's id; one line when the tokenizer has none."""
    tried = (token,) if token else EOS_CANDIDATES
    for candidate in tried:
        found = tokenizer.token_to_id(candidate)
        if found is not None:
            return found
    if token:
        raise ValueError(f"--eos-token {token!r} is not in the tokenizer's vocabulary; give one of its special tokens")
    raise ValueError(f"the tokenizer has none of the separator tokens {', '.join(EOS_CANDIDATES)}; "
                     f"pass --eos-token TOKEN naming its end-of-document token")


@dataclass(frozen=True)
class SpecialIds:
    """The ids of a tokenizer that a masked-LM rule needs (see :class:`TokenFileMeta`)."""

    mask_id: int
    pad_id: int
    special_ids: tuple[int, ...]


def special_ids(tokenizer: "Tokenizer", eos: int, mask_token: str | None = None) -> SpecialIds:
    """``[MASK]``, ``[PAD]`` and every special token of ``tokenizer`` (added tokens marked
    special, plus the separator ``eos``); one line when ``mask_token`` is not in its vocabulary."""

    def first(candidates: Sequence[str]) -> int:
        for token in candidates:
            found = tokenizer.token_to_id(token)
            if found is not None:
                return found
        return -1

    mask = first((mask_token,) if mask_token else MASK_CANDIDATES)
    if mask_token and mask < 0:
        raise ValueError(f"--mask-token {mask_token!r} is not in the tokenizer's vocabulary; give one of its special tokens")
    pad = first(PAD_CANDIDATES)
    marked = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    return SpecialIds(mask, pad, tuple(sorted(i for i in marked | {eos, mask, pad} if i >= 0)))


def token_dtype(vocab_size: int, requested: str) -> str:
    if requested == "auto":
        return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"
    if requested not in TOKEN_DTYPES:
        raise ValueError(f"--dtype {requested}: choose auto, uint16 or uint32")
    if requested == "uint16" and vocab_size > UINT16_VOCAB + 1:
        raise ValueError(f"--dtype uint16 cannot hold the tokenizer's vocabulary of {vocab_size} ids; use --dtype uint32 or auto")
    return requested


class _TokenWriter:
    """Appends ids to a hidden temporary file beside ``path``; :meth:`publish` syncs and renames
    it over ``path`` (the old file or the new, never a torn one), :meth:`discard` removes it."""

    def __init__(self, path: str, dtype: str) -> None:
        self.path, self.dtype, self.tokens = os.path.abspath(path), np.dtype(dtype), 0
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        handle, self.tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        self.stream = os.fdopen(handle, "wb")

    def write(self, ids: np.ndarray) -> None:
        self.stream.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(ids)

    def publish(self) -> None:
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, self.path)
        fsync_directory(os.path.dirname(self.path))

    def discard(self) -> None:
        if not self.stream.closed:
            self.stream.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


@dataclass
class CorpusReport:
    """What :func:`tokenize_corpus` wrote."""

    files: list[str]
    documents: int = 0
    tokens: int = 0
    eval_documents: int = 0
    eval_tokens: int = 0
    dtype: str = ""
    vocab_size: int = 0
    mask_id: int = -1
    outputs: list[str] = field(default_factory=list)


def tokenize_corpus(spec: CorpusSpec) -> CorpusReport:
    """Tokenize ``spec.inputs`` into ``spec.out`` (+ held-out file) and their sidecars.

    Streaming: ``batch_docs`` documents are encoded at a time and their ids appended to
    the temporary file, so memory does not grow with the corpus.  Every ``1/eval_fraction``-th
    document (spread evenly, deterministic) goes to the held-out file.  Outputs are published
    only when the whole corpus is through: an error leaves any previous files untouched.
    """
    if not 0.0 <= spec.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction {spec.eval_fraction} must be >= 0 and < 1")
    tokenizer = load_tokenizer(spec.tokenizer)
    files = resolve_inputs(spec.inputs)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab, spec.dtype)
    eos = eos_id(tokenizer, spec.eos_token)
    specials = special_ids(tokenizer, eos, spec.mask_token)
    report = CorpusReport(files=files, dtype=dtype, vocab_size=vocab, mask_id=specials.mask_id)
    writers = [_TokenWriter(spec.out, dtype)]
    if spec.eval_fraction:
        writers.append(_TokenWriter(spec.held_out_path(), dtype))
    try:
        pending: list[tuple[int, bool]] = []  # (writer, ends a document) per piece in the batch
        texts: list[str] = []
        index, held = 0, None

        def flush() -> None:
            encodings = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
            for (which, last), encoding in zip(pending, encodings):
                ids = encoding.ids + [eos] if last else encoding.ids
                writers[which].write(np.asarray(ids, dtype=np.int64))
            pending.clear()
            texts.clear()

        for piece, last in _documents(files, spec.text_field):
            if held is None:  # a document starts: it goes to the held-out file evenly often
                held = bool(spec.eval_fraction) and math.floor((index + 1) * spec.eval_fraction) > math.floor(
                    index * spec.eval_fraction)
                index += 1
                if held:
                    report.eval_documents += 1
                else:
                    report.documents += 1
            pending.append((int(held), last))
            texts.append(piece)
            if last:
                held = None
            if len(pending) >= spec.batch_docs:
                flush()
        flush()
        report.tokens = writers[0].tokens
        report.eval_tokens = writers[1].tokens if len(writers) > 1 else 0
        if report.documents == 0:
            raise ValueError(f"no text to train on in {', '.join(files)}: every document is empty"
                             + (" or held out (lower --eval-fraction)" if report.eval_documents else ""))
        if len(writers) > 1 and report.eval_documents == 0:
            raise ValueError(f"--eval-fraction {spec.eval_fraction} held out no document of {report.documents}; "
                             f"raise it to at least {1 / report.documents:.3g} or give more documents")
        held_name = None
        if len(writers) > 1:
            writers[1].publish()
            held_name = os.path.relpath(writers[1].path, os.path.dirname(writers[0].path))
            TokenFileMeta(dtype, vocab, report.eval_tokens, os.path.abspath(spec.tokenizer), eos,
                          tuple(os.path.abspath(f) for f in files), None, specials.mask_id, specials.pad_id,
                          specials.special_ids).write(writers[1].path)
        writers[0].publish()
        TokenFileMeta(dtype, vocab, report.tokens, os.path.abspath(spec.tokenizer), eos,
                      tuple(os.path.abspath(f) for f in files), held_name, specials.mask_id, specials.pad_id,
                      specials.special_ids).write(writers[0].path)
        report.outputs = [w.path for w in writers]
        return report
    finally:
        for writer in writers:
            writer.discard()
