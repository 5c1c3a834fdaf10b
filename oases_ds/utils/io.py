"""Atomic file writes: the one way ``oases_ds`` and its benchmarks put a file on disk.

Why one writer: a plan, a cost table or a benchmark record can take minutes to
produce, a checkpoint's ``latest`` decides what a restart loads, and a rank's
report is how the launcher judges it.  Each must be the old file or the new one,
never a torn one, even after a crash or a power cut.  So every writer here

1. writes to a temporary file in the target's directory (same filesystem, so the
   rename below is atomic),
2. flushes and ``fsync``\\ s it (the data is on disk before the name points at it),
3. renames it over the target with ``os.replace``,
4. ``fsync``\\ s the directory where the platform allows it (the rename itself is
   on disk; Windows cannot open a directory, some filesystems refuse the call).

A failure at any step removes the temporary file and leaves the target as it was, and
an ``OSError`` names the target (the path the caller gave), never the temporary.
This module imports nothing of ours: every layer may use it.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

PathLike = str | os.PathLike[str]

_UMASK = os.umask(0)
os.umask(_UMASK)
"""The process umask, read once at import (reading it means setting it, which is not
thread-safe later).  ``mkstemp`` creates files private to their owner (0600); a
written file gets the mode ``open(path, "w")`` would give it instead."""


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data``; readers see the old content or the new, nothing between.

    Creates the parent directory if needed.  The temporary file is
    ``.<name>.<random>.tmp`` beside the target (hidden, so a directory listing
    never mistakes it for a result); the file gets the mode a plain ``open``
    would give it (``0666`` less the umask), so other users and nodes can read
    a plan or a report as before.
    """
    target = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(target)
    try:
        os.makedirs(directory, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    except OSError as err:
        raise _against(err, path) from None
    try:
        if hasattr(os, "fchmod"):  # not on Windows, where modes mean little
            os.fchmod(handle, 0o666 & ~_UMASK)
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise _against(err, path) from None
        raise
    fsync_directory(directory)


def _against(err: OSError, path: PathLike) -> OSError:
    """``err`` told against ``path``, the file the caller asked for.  Why: the OS names the
    file it was handed -- the hidden ``.<name>.<random>.tmp``, or the directory being made --
    and an error line naming a file the user never gave sends them looking for it.  Same
    class (``FileNotFoundError`` ...) and errno, so callers catch what they caught before."""
    if err.errno is None:  # raised without an errno (by a wrapper, a test): nothing to re-tell
        return err
    return type(err)(err.errno, err.strerror, os.fspath(path))


def write_text_atomic(path: PathLike, text: str) -> None:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: PathLike, payload: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    """:func:`write_bytes_atomic` of ``payload`` as JSON, ending in a newline.

    The payload is serialised before the file is opened, so a value JSON cannot
    encode raises here and leaves ``path`` untouched.  ``indent`` and
    ``sort_keys`` are the caller's layout: planner files (plans, cost tables)
    sort their keys so that two runs diff cleanly; traces and records keep the
    order they were built in.
    """
    write_text_atomic(path, json.dumps(payload, indent=indent, sort_keys=sort_keys) + "\n")


def fsync_directory(directory: PathLike) -> None:
    """Make a rename inside ``directory`` durable, where the platform supports it.

    Windows cannot open a directory (``PermissionError``) and some filesystems
    refuse ``fsync`` on one (``EINVAL``); there the rename is as durable as the
    platform makes it, and the written file itself was already synced.
    """
    try:
        handle = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def replace_marked_section(path: PathLike, begin: str, end: str, body: str, *, append: bool = True) -> None:
    """Rewrite the text between the ``begin`` and ``end`` marker lines of the file at ``path``
    with ``body``, atomically; the rest of the file is untouched.

    Why one function: every benchmark regenerates its own table in its dated report
    from its result file, so no figure there is hand-written.  Where the markers are
    missing, the block is appended (``append``) or the call fails in one line naming them.
    """
    text = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else ""
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text[text.index(begin):]:
        start = text.index(begin)
        stop = text.index(end, start) + len(end)
        text = text[:start] + block + text[stop:]
    elif append:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    else:
        raise ValueError(f"{path}: markers {begin!r} / {end!r} missing; add them where the generated text belongs")
    write_text_atomic(path, text)


def read_json_input(key: str, path: str, loader: Callable[[str], T], hint: str) -> T:
    """``loader(path)`` for the setting ``key``, its failure as the one line a user needs: a file
    that cannot be opened is ``key=path: <reason>; <hint>``, a malformed one ``key=<loader's
    message>`` (the loaders, e.g. ``Plan.from_json``, start their message with the path).

    Why one function: a plan or a cost table is a JSON file a user names, in a CLI setting or
    in a DeepSpeed config, and read by the CLI's checks, the planner and every rank; each of
    those reads fails with the same line, naming the setting, whichever reads it first."""
    try:
        return loader(path)
    except OSError as err:
        raise ValueError(f"{key}={path}: {err.strerror or err}; {hint}") from None
    except ValueError as err:
        raise ValueError(f"{key}={err}") from None
