"""``oases-data``'s library: a local Hugging Face tokenizer over local text, streamed into a token file.

:func:`tokenize_corpus` runs a ``tokenizer.json`` over ``.txt`` / ``.jsonl`` files and streams the
ids into a flat token file plus its sidecar (:class:`~oases_ds.data.token_file.TokenFileMeta`:
dtype, vocabulary size, token count, tokenizer, sources, the tokenizer's special ids), with an
optional held-out file of whole documents.  Memory holds one batch of documents, never the corpus.
Nothing is ever downloaded.
"""
from __future__ import annotations

import glob
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

from oases_ds.data.token_file import (EOS_CANDIDATES, MASK_CANDIDATES, PAD_CANDIDATES, TOKEN_DTYPES, UINT16_VOCAB,
                                      TokenFileMeta)
from oases_ds.utils.io import fsync_directory

if TYPE_CHECKING:
    from tokenizers import Tokenizer


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
