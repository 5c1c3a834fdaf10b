"""Typed Hydra schemas shared by the entry points, and one-line errors for configs that break them.

Why a schema: without one, ``oases-train steps=abc`` composes happily and fails
later as a ``TypeError`` deep inside validation (or inside a rank).  Each CLI's
top-level dataclass is registered in Hydra's ConfigStore and named first in its
YAML defaults list, so OmegaConf converts or rejects every value by type while
composing.  Pieces that mirror a library dataclass (``ModelConfig``,
``DataConfig``) are derived from it, so the schema follows the library as it
changes.

Why a pre-check: Hydra reports a composition error as several lines and exit 1
(or a traceback).  :func:`precheck` composes the command line's first point with
Hydra's compose API before ``@hydra.main`` runs and turns whatever fails into
``error: <key>: <what>; <fix>`` and exit 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Callable, Literal, Optional, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from oases_ds.cli.common import CONFIG_DIR, fail
from oases_ds.data import DataConfig
from oases_ds.models.config import ModelConfig


def _schema_type(hint: Any) -> Any:
    """An OmegaConf-typable annotation for a library field: ``Literal`` becomes its values'
    type (OmegaConf cannot type ``Literal``), ``X | None`` becomes ``Optional[X]``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return type(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return Optional[_schema_type(rest[0])] if len(rest) == 1 else Any
    return hint


def schema_of(cls: type, name: str) -> type:
    """A Hydra-typable copy of a library dataclass, each field typed by its annotation."""
    hints = typing.get_type_hints(cls)
    return make_dataclass(name, [(f.name, _schema_type(hints[f.name]), field(default=f.default)) for f in fields(cls)])


def unset_schema_of(cls: type, name: str, extra: Sequence[tuple[str, Any, Any]] = ()) -> type:
    """Like :func:`schema_of`, but every field optional and unset (None) unless a preset or
    the command line gives it, plus ``extra`` fields: so a consumer can tell what was given
    (``oases-train model=hf`` applies only those keys over the checkpoint's config)."""
    hints = typing.get_type_hints(cls)
    fields_ = [(f.name, Optional[_schema_type(hints[f.name])], field(default=None)) for f in fields(cls)]
    return make_dataclass(name, fields_ + [(n, t, field(default=d)) for n, t, d in extra])


def _library_schemas() -> tuple[type, type]:
    return schema_of(ModelConfig, "ModelSchema"), schema_of(DataConfig, "DataSchema")


ModelSchema, DataSchema = _library_schemas()


@dataclass
class LinkSchema:
    """A real link: gigabits per second per direction, one-way latency in microseconds."""

    bandwidth_gbps: float = MISSING
    latency_us: float = 0.0
    sharing: Optional[str] = None  # ring | fair | fifo (LinkModel.sharing); None: emulation.sharing


@dataclass
class DeviceSchema:
    """A real device: peak dense throughput (TFLOP/s) and the fraction a training step reaches."""

    name: str = MISSING
    peak_tflops: float = MISSING
    achieved_fraction: float = 0.4


@dataclass
class ClusterSchema:
    name: str = "local"
    link: Optional[LinkSchema] = None
    device: Optional[DeviceSchema] = None
    # TMP degree this link carries in the real cluster (e.g. 2 for an NVLink pair); overrides
    # emulation.reference.tensor_parallel_size when set.
    tensor_parallel_size: Optional[int] = None


@dataclass
class ScheduleSchema:
    """A preset of configs/schedule/ (the name is checked by the library's OasesConfig)."""

    name: str = "oases"
    sub_batches: int = 2
    cross_pass: bool = True
    fine_grained_recompute: bool = True


@dataclass
class MetricsSchema:
    """Where rank 0 logs step, loss, eval_loss, lr, tokens/s (oases_ds.utils.metrics)."""

    csv: Optional[str] = None  # a CSV file; needs nothing installed
    tensorboard: Optional[str] = None  # a TensorBoard log directory; needs the [tensorboard] extra


# -- turning a composition error into one line -------------------------------------------------------
_HINTS = (
    ("converted to Integer", "give a whole number"),
    ("converted to Float", "give a number"),
    ("not a valid bool", "give true or false"),
    ("to string", "give a single value, quoted if needed"),
)


def _known_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a schema defines, nested dataclasses included."""
    keys = []
    for name, inner in _field_schemas(cls).items():
        keys.append(prefix + name)
        if inner is not None:
            keys += _known_keys(inner, prefix + name + ".")
    return keys


def _field_schemas(cls: type) -> dict[str, type | None]:
    """Each field of a schema and the schema dataclass it holds (None for a plain value).
    Read through ``get_type_hints``: under ``from __future__ import annotations`` a field's
    ``type`` is only a string."""
    out: dict[str, type | None] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) is typing.Union:
            hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        out[name] = hint if dataclasses.is_dataclass(hint) else None
    return out


def _unknown_key_line(key: str, schema: type) -> str:
    """``model.hiden_size: not a known key; did you mean model.hidden_size?``"""
    known = _known_keys(schema)
    siblings = [k for k in known if k.rpartition(".")[0] == key.rpartition(".")[0]]
    close = difflib.get_close_matches(key, siblings or known, n=1)
    hint = f"did you mean {close[0]}?" if close else f"known keys here: {', '.join(k.rpartition('.')[2] for k in siblings)}"
    return f"{key}: not a known key; {hint}"


def unknown_keys(cfg: dict, schema: type, prefix: str = "") -> list[str]:
    """Keys in ``cfg`` that ``schema`` does not define.  Hydra's ``+key=value`` adds a key
    even to a typed node (it opens the struct flag), so composition alone misses a typo'd new key."""
    by_name = _field_schemas(schema)
    out = []
    for key, value in cfg.items():
        if key not in by_name:
            out.append(prefix + str(key))
        elif by_name[key] is not None and isinstance(value, dict):
            out += unknown_keys(value, by_name[key], f"{prefix}{key}.")
    return out


def error_line(err: BaseException, schema: type | None = None, culprit: Callable[[], str | None] | None = None) -> str:
    """One line for a Hydra/OmegaConf composition error: the key, what is wrong, the fix.
    For an error that carries no key, ``culprit()`` names the override to blame."""

    chain, e = [], err
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
            group, _, name = e.missing_cfg_file.rpartition("/")
            return f"{group}={name} is not a preset in configs/{group}; choose from {', '.join(sorted(e.options))}"
        key = getattr(e, "full_key", None)
        if not isinstance(e, OmegaConfBaseException) or not key:
            continue
        if isinstance(e, MissingMandatoryValue):
            return f"{key}: missing; give it on the command line, e.g. {key}=..."
        if isinstance(e, (ConfigKeyError, AttributeError)) and schema is not None:
            return _unknown_key_line(key, schema)
        what = str(e).splitlines()[0]
        hint = next((h for marker, h in _HINTS if marker in what), "")
        return f"{key}: {what}" + (f"; {hint}" if hint else "")
    lines = list(dict.fromkeys(l.strip() for e in chain for l in str(e).splitlines() if l.strip()))
    telling = [l for l in lines if not l.startswith(("full_key", "reference_type", "object_type", "To append"))]
    if any("NoneType" in l for l in telling):  # OmegaConf cannot set a key below a null node
        line = "a key below a null node: set the node whole or pick a preset that defines it (e.g. cluster=eth_25g)"
    else:
        line = " | ".join(telling[:2]) or type(err).__name__
    blamed = culprit() if culprit is not None else None
    return f"{blamed}: {line}" if blamed else line


def _culprit(config_name: str, overrides: Sequence[str]) -> str | None:
    """The first override that breaks composition on its own (for errors that name no key)."""
    for override in overrides:
        try:
            compose_config(config_name, [override])
        except Exception:  # noqa: BLE001 -- any composition error marks the culprit
            return override
    return None


# -- the pre-check every entry point runs ------------------------------------------------------------
def presets() -> list[str]:
    """The study presets in configs/experiment/."""
    folder = os.path.join(CONFIG_DIR, "experiment")
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def check_experiment(args: Sequence[str], mine: Sequence[str], cli: str, elsewhere: Callable[[str], str]) -> None:
    """Refuse an ``experiment=`` value that is not one of ``mine``.  ``experiment`` is an
    *optional* Hydra group, and Hydra silently drops an optional group whose option does
    not exist, so ``experiment=foo`` would otherwise run the default configuration.
    ``elsewhere(name)`` is the line for a preset that belongs to the other CLI."""
    known = presets()
    for arg in args:
        key, _, values = arg.partition("=")
        if key.lstrip("+~") != "experiment":
            continue
        for name in values.split(","):
            name = name.strip()
            if name in ("", "null") or name in mine:
                continue
            if name in known:
                fail(elsewhere(name))
            fail(f"experiment={name} is not a preset in configs/experiment; {cli} takes {', '.join(mine)}")


def first_point(args: Sequence[str]) -> list[str]:
    """Command-line overrides with every sweep replaced by its first value (for the up-front check)."""

    out = []
    for o in OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")]):
        if o.key_or_group.startswith("hydra"):
            continue
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()))
            out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(o.input_line)
    return out


def compose_config(config_name: str, overrides: Sequence[str]) -> dict[str, Any]:
    """The config Hydra would build for ``overrides`` (one point, no sweep), as a plain dict."""

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        dcfg = compose(config_name=config_name, overrides=list(overrides))
    cfg = OmegaConf.to_container(dcfg, resolve=True, throw_on_missing=True)
    cfg.pop("hydra", None)
    return cfg


def precheck(config_name: str, schema: type, args: Sequence[str],
             check: Callable[[dict], Any] | None = None) -> dict[str, Any] | None:
    """Compose the (first point of the) command line against ``schema`` before Hydra runs; any
    failure, and any ``ValueError`` of ``check``, is one ``error:`` line and exit 2.  Returns the
    composed config (None for ``--help`` and friends, which Hydra answers itself)."""
    if any(a in ("--help", "-h", "--info", "-c") or a.startswith("--cfg") or a.startswith("--hydra-help") for a in args):
        return None
    overrides = first_point(args)
    try:
        cfg = compose_config(config_name, overrides)
    except Exception as err:  # Hydra/OmegaConf composition errors: many types, several lines each
        fail(error_line(err, schema, lambda: _culprit(config_name, overrides)))
    if extra := unknown_keys(cfg, schema):
        fail(_unknown_key_line(extra[0], schema))
    if check is not None:
        try:
            check(cfg)
        except ValueError as err:
            fail(str(err))
    return cfg


def check_ranges(cfg: dict, at_least: dict[str, float], positive: Sequence[str] = ()) -> None:
    """Raise ValueError naming the first dotted key below its minimum (``at_least``) or not a
    finite number > 0 (``positive``): the numeric range checks of a CLI in one table."""
    def value(key: str) -> Any:
        node: Any = cfg
        for part in key.split("."):
            node = node[part]
        return node

    for key, low in at_least.items():
        if not low <= value(key) < math.inf:  # nan fails both comparisons
            raise ValueError(f"{key} must be >= {low:g}, got {value(key)}")
    for key in positive:
        if not 0 < value(key) < float("inf"):
            raise ValueError(f"{key} must be a finite number > 0, got {value(key)}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(field: str, value: Any) -> float | None:
    """``None``, a number of bytes, or a string such as ``"2GiB"`` / ``"300 MB"``."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}={value!r} is not a size; use bytes or e.g. 2GiB, 300MB")
        number, unit = float(match.group(1)), match.group(2).lower()
    if not 0 < number < math.inf:  # nan and 1e400 (infinity) are typos, not sizes
        raise ValueError(f"{field} must be a finite size > 0, got {value!r}")
    return number * _UNITS[unit]
