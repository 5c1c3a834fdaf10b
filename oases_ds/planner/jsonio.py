"""JSON persistence shared by cost tables, plans and benchmark results.

Writes go to a temporary file in the target's directory and are then renamed
with ``os.replace``: a profile or plan that took minutes to produce is either
the old file or the new one, never a half-written file a later run would trust.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write ``payload`` as JSON at ``path``; readers see the old or the new file only."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(payload, stream, indent=2, sort_keys=True)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        os.unlink(tmp_name)
        raise


def read_dataclass_fields(path: str | os.PathLike[str], cls: type) -> dict[str, Any]:
    """Load a JSON object meant for ``cls`` and reject unknown or missing fields by name.

    Checked here rather than left to ``cls(**data)`` so that a hand-edited file
    fails with the file and field in one line instead of a ``TypeError`` from
    ``__init__``.
    """
    with open(path) as stream:
        data = json.load(stream)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"{path}: unknown {cls.__name__} field(s) {unknown}")
    if missing := sorted(required - set(data)):
        raise ValueError(f"{path}: missing {cls.__name__} field(s) {missing}")
    return data
