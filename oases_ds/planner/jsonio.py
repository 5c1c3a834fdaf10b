"""Typed JSON loading shared by cost tables and plans.

Writing is :func:`oases_ds.utils.io.write_json_atomic` (the package's one atomic
writer): a profile or plan that took minutes to produce is either the old file
or the new one, never a half-written file a later run would trust.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any, Callable, TypeVar


def _accepted(hint: Any) -> tuple[type, ...] | None:
    """JSON value types a field annotated ``hint`` may hold; None: anything."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [_accepted(a) for a in typing.get_args(hint)]
        return None if None in kinds else tuple(t for k in kinds for t in k)  # type: ignore[union-attr]
    if hint is type(None):
        return (type(None),)
    if hint is float:
        return (int, float)
    if hint in (int, str):
        return (hint,)
    if (origin or hint) in (tuple, list):
        return (list,)
    if (origin or hint) is dict:
        return (dict,)
    return None


def check_fields(data: Any, cls: type, where: str = "") -> None:
    """Reject a JSON object meant for ``cls`` whose fields are unknown, missing or of the wrong
    JSON type, naming the field: ``cls(**data)`` would raise a ``TypeError`` naming neither
    the file nor, for a wrong type, the field."""
    name = f"{where}: " if where else ""
    if not isinstance(data, dict):
        raise ValueError(f"{name}expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"{name}unknown {cls.__name__} field(s) {unknown}")
    if missing := sorted(required - set(data)):
        raise ValueError(f"{name}missing {cls.__name__} field(s) {missing}")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        accepted = _accepted(hints[key])
        if accepted is not None and (not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted)):
            kinds = " or ".join(_JSON_NAMES[t] for t in dict.fromkeys(accepted) if not (t is int and float in accepted))
            raise ValueError(f"{name}{cls.__name__}.{key} must be {kinds}, got {value!r}")


_JSON_NAMES = {int: "a whole number", float: "a number", str: "a string", list: "a list", dict: "an object",
               type(None): "null"}

T = TypeVar("T")


def load_dataclass(path: str | os.PathLike[str], cls: type[T], build: Callable[[dict[str, Any]], T] | None = None) -> T:
    """Read the JSON file at ``path`` into ``cls``: its fields checked (:func:`check_fields`) and passed
    to ``cls``, or, with ``build``, handed to ``build`` as they are (nested fields, an older layout to
    upgrade first), which checks them.

    Every ``ValueError`` -- not JSON, a truncated file, a wrong field, a value the
    dataclass rejects -- comes back as one line that starts with the file's name, so a
    CLI can print it as it is.  A missing or unreadable file stays an ``OSError``.
    """
    with open(path, "rb") as stream:
        raw = stream.read()
    return parse_dataclass(raw, str(path), cls, build)


def parse_dataclass(raw: bytes, path: str, cls: type[T], build: Callable[[dict[str, Any]], T] | None = None) -> T:
    """:func:`load_dataclass` on a file's bytes (``path`` names it in every error): for files read
    from elsewhere than the file system, such as a run archive's members."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno} column {err.colno}); "
                         f"the file is truncated or was edited by hand: write it again") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a JSON text file") from None
    try:
        if build is not None:
            return build(data)
        check_fields(data, cls)
        return cls(**data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
