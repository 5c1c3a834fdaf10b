"""Portable checkpoint state: one full (unsharded) tensor per parameter, so that a
checkpoint saved under one layout resumes under any other.

DeepSpeed's rank files hold what each rank owns, in that rank's layout: a TMP shard
(``mp_rank_XX``: pipeline stage x TMP rank), and with ZeRO-1 a flat partition over the
DP ranks of every parameter the stage holds.  Another TMP degree, another per-block
plan, another pipeline split, another DP size under ZeRO-1, or ZeRO switched on or off,
and those files no longer describe any rank.  Every parameter, however, has one full
value (:mod:`oases_ds.models.sharding`), and Adam's moments are elementwise, so they
shard exactly like the weights.  Next to DeepSpeed's files a checkpoint therefore holds
``<tag>/portable/``:

* ``<parameter name>.pt``: ``{"master": ..., "<state key>": ...}``, the full fp32 value
  (the master copy under bf16, of which the bf16 weight is the rounding) and each
  elementwise optimizer state (``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``).
* ``common.pt``: the optimizer's hyper-parameters per group and its scalar state (Adam's
  ``step``), fp16's dynamic loss scaler (:data:`SCALER_FIELDS`), the LR scheduler, the
  engine's step counters (the step is also the data position: ``oases-train`` reads batch
  ``step`` of the corpus), the client state.
* ``index.json``: every parameter's file, shape and state keys: what a loader checks
  before any rank starts.

Saving is collective: each parameter is gathered over its DP partition (ZeRO-1) and its
TMP group, and written by TMP rank 0 of DP rank 0 of its pipeline stage, into the staged
directory that :func:`oases_ds.checkpoint.publish` makes visible at once.  Loading is
local: each rank maps each file it needs (``mmap``: only the pages of its slice are
read), narrows the full value to its shard with
:meth:`~oases_ds.models.sharding.Sharding.shard_of`, and writes it into the parameter,
the master copy and the optimizer state, whichever of DeepSpeed's optimizers holds them.
Files are read with ``weights_only=True``: tensors and plain containers only.

A portable state may also be written offline, with no run (:func:`write_masters`, for
``oases-ckpt convert --from-hf``): the masters only, at step 0, no optimizer state and no
scheduler in ``common.pt``; a run that loads it starts its optimizer and scheduler afresh.
"""
from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from oases_ds.utils.io import write_json_atomic

PORTABLE_DIR = "portable"
INDEX_FILE = "index.json"
COMMON_FILE = "common.pt"
PORTABLE_FORMAT = 1


SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
"""The state of fp16's dynamic loss scaler that a resume continues (DeepSpeed's own checkpoint
keeps the same): the scale, the iteration counters that time its next raise, and ZeRO's
remaining hysteresis."""


class PortableStateError(ValueError):
    """The portable state cannot be written or read; one line."""


def _elementwise(value: Any) -> bool:
    """Optimizer state with one entry per parameter element (it shards like the weight):
    ``exp_avg`` / ``exp_avg_sq`` / ``momentum_buffer``; ``step`` is a scalar."""
    return torch.is_tensor(value) and value.dim() > 0


class _OptimizerAccess:
    """One parameter's master value and elementwise optimizer state, full over DP and
    this rank's TMP shard, whichever of DeepSpeed's optimizers holds them.

    Three kinds, found by probing DeepSpeed 0.19.8 in each mode (fp32/bf16 x ZeRO 0/1):

    * a torch optimizer over the parameters themselves (fp32, ZeRO 0);
    * ``FP16_UnfusedOptimizer`` (bf16, ZeRO 0): fp32 copies in ``fp32_groups``, the torch
      optimizer over those;
    * parameters linked to flat fp32 partitions (``_hp_mapping``: ZeRO-1 in fp32 or bf16,
      ``BF16_Optimizer``), read and written through DeepSpeed's public fragment API
      (``safe_get_full_*`` all-reduce over the DP group; ``safe_set_full_*`` write this
      rank's fragment).
    """

    def __init__(self, optimizer: Any, params: list[nn.Parameter]) -> None:
        self.wrapper = optimizer
        self.partitioned = bool(params) and hasattr(params[0], "_hp_mapping")
        self.inner: torch.optim.Optimizer = getattr(optimizer, "optimizer", optimizer)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise PortableStateError(f"portable checkpoints need a torch optimizer inside DeepSpeed's, got "
                                     f"{type(self.inner).__name__}; set oases.portable_checkpoint=false")
        if self.partitioned and not hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
            raise PortableStateError(f"{type(optimizer).__name__} links parameters to partitions in a way portable "
                                     "checkpoints do not know; set oases.portable_checkpoint=false")
        self.masters: dict[int, torch.Tensor] = {}
        if hasattr(optimizer, "fp16_groups") and hasattr(optimizer, "fp32_groups"):
            self.masters = {id(lp): hp for lp_group, hp_group in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                            for lp, hp in zip(lp_group, hp_group)}
        self.order = [q for group in self.inner.param_groups for q in group["params"]]

    # -- reading -------------------------------------------------------------------
    def _holder(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor the torch optimizer keys ``param``'s state by (not partitioned)."""
        return self.masters.get(id(param), param)

    def state_keys(self) -> list[str]:
        """Elementwise state keys, the same on every rank (all step together); none before the first step."""
        first = next(iter(self.inner.state.values()), {})
        return sorted(k for k, v in first.items() if _elementwise(v))

    def scalars(self) -> dict[str, Any]:
        """Scalar state (Adam's ``step``): one value for every parameter, since all are updated each step."""
        first = next(iter(self.inner.state.values()), {})
        return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in first.items() if not _elementwise(v)}

    def _dynamic_scaler(self) -> Any:
        """fp16's dynamic loss scaler: ``loss_scaler`` of DeepSpeed's ZeRO optimizer,
        ``loss_scale_config`` of its ZeRO-0 ``FP16_UnfusedOptimizer``; None in fp32/bf16 and
        for a static scale (which the config, not the state, sets)."""
        scaler = getattr(self.wrapper, "loss_scaler", None) or getattr(self.wrapper, "loss_scale_config", None)
        dynamic = getattr(scaler, "dynamic", None) or getattr(scaler, "dynamic_loss_scale", False)
        return scaler if dynamic else None

    def scaler_state(self) -> dict[str, float] | None:
        """The dynamic loss scaler's state (:data:`SCALER_FIELDS` it has), or None."""
        scaler = self._dynamic_scaler()
        if scaler is None:
            return None
        return {k: float(getattr(scaler, k)) for k in SCALER_FIELDS if getattr(scaler, k, None) is not None}

    def set_scaler_state(self, state: dict[str, float] | None) -> None:
        """Continue fp16's loss scale where the checkpoint left it (under any ZeRO stage:
        the fields both scalers have; ZeRO's hysteresis counter only between ZeRO runs)."""
        scaler = self._dynamic_scaler()
        if scaler is None or not state:
            return
        for key, value in state.items():
            if key in SCALER_FIELDS and hasattr(scaler, key):
                setattr(scaler, key, value if key == "cur_scale" else int(value))

    def hyper(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups]

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """fp32 value of ``param``'s TMP shard, full over DP (collective over DP when partitioned)."""
        if self.partitioned:
            from deepspeed.utils import safe_get_full_fp32_param

            return safe_get_full_fp32_param(param)
        return self._holder(param).detach().float()

    def state(self, param: nn.Parameter, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self.partitioned:
            from deepspeed.utils import safe_get_full_optimizer_state

            self.wrapper._lazy_init_hp_params_optimizer_state()  # linked by DeepSpeed's first step; idempotent
            return {k: safe_get_full_optimizer_state(param, k) for k in keys}
        held = self.inner.state[self._holder(param)]
        return {k: held[k].detach() for k in keys}

    # -- writing -------------------------------------------------------------------
    @torch.no_grad()
    def set_masters(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Each parameter, and its master copy, from its shard's fp32 value."""
        if self.partitioned:
            from deepspeed.utils import safe_set_full_fp32_param
        for param, value in values.items():
            if self.partitioned:
                safe_set_full_fp32_param(param, value)
            elif id(param) in self.masters:
                self.masters[id(param)].copy_(value)
            param.copy_(value.to(param.dtype))

    @torch.no_grad()
    def set_state(self, states: dict[nn.Parameter, dict[str, torch.Tensor]], scalars: dict[str, Any],
                  hyper: list[dict[str, Any]]) -> None:
        """The optimizer's state from each parameter's shard of it, its scalars and its
        hyper-parameters, through the torch optimizer's ``load_state_dict`` (which puts
        ``step`` where that optimizer keeps it)."""
        if len(hyper) != len(self.inner.param_groups):
            raise PortableStateError(f"the checkpoint's optimizer has {len(hyper)} parameter groups, this run's has "
                                     f"{len(self.inner.param_groups)}; build the optimizer with the same groups")
        keys = sorted({k for s in states.values() for k in s})
        index = {id(q): i for i, q in enumerate(self.order)}

        def own(scalars: dict[str, Any]) -> dict[str, Any]:  # torch steps ``step`` in place: one tensor per entry
            return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}

        if self.partitioned:  # state for each flat partition, filled below through its fragments
            entries = {i: {**own(scalars), **{k: torch.zeros_like(q) for k in keys}} for i, q in enumerate(self.order)}
        else:
            entries = {index[id(self._holder(p))]: {**own(scalars), **{k: v.to(self._holder(p).device) for k, v in s.items()}}
                       for p, s in states.items()}
        groups = [{**saved, "params": [index[id(q)] for q in group["params"]]}
                  for saved, group in zip(hyper, self.inner.param_groups)]
        self.inner.load_state_dict({"state": entries, "param_groups": groups})
        if self.partitioned:
            from deepspeed.utils import safe_set_full_optimizer_state

            self.wrapper._hp_optimizer_states_linked = False  # link the fragments to the new state tensors
            self.wrapper._lazy_init_hp_params_optimizer_state()
            for param, state in states.items():
                for k, value in state.items():
                    safe_set_full_optimizer_state(param, value, k)


def _params(engine: Any) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def save(engine: Any, tag_dir: str, client_state: dict | None = None) -> None:
    """Write ``tag_dir/portable/`` (module docstring).  Collective: every rank calls it,
    in the same parameter order within its stage."""
    ctx, sharding = engine.parallel_context, engine.module.sharding
    named = _params(engine)
    access = _OptimizerAccess(engine.optimizer, [p for _, p in named])
    keys = access.state_keys()
    writer = ctx.tp_rank == 0 and ctx.dp_rank == 0
    directory = os.path.join(tag_dir, PORTABLE_DIR)
    if writer:
        os.makedirs(directory, exist_ok=True)
    written: dict[str, dict[str, Any]] = {}
    error = None
    for name, param in named:  # every rank takes part in every gather, even after its own write failed
        values = {"master": access.master(param), **access.state(param, keys)}
        full = {k: sharding.gather_full(name, param, v).cpu() for k, v in values.items()}
        if writer and error is None:
            file = f"{name}.pt"
            try:
                torch.save(full, os.path.join(directory, file))
            except OSError as err:
                error = f"rank {dist.get_rank()} could not write {os.path.join(directory, file)}: {err.strerror or err}"
            written[name] = {"file": file, "shape": list(full["master"].shape), "state": keys}
    everyone: list[tuple[dict, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (written, error))
    first = next((e for _, e in everyone if e), None)  # type: ignore[misc]
    if first:
        raise PortableStateError(first)
    if dist.get_rank() != 0:
        return
    scheduler = engine.lr_scheduler
    params = {name: entry for part, _ in everyone for name, entry in part.items()}  # type: ignore[misc]
    _finish(directory, {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                        "skipped_steps": engine.skipped_steps,
                        "optimizer": {"class": type(access.inner).__name__, "hyper": access.hyper(),
                                      "scalars": access.scalars(), "loss_scaler": access.scaler_state()},
                        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                        "client_state": dict(client_state or {})}, params)


def _finish(directory: str, common: dict[str, Any], params: dict[str, dict[str, Any]]) -> None:
    """``common.pt``, then ``index.json`` (what a loader checks first) last, atomically."""
    torch.save({"format": PORTABLE_FORMAT, **common}, os.path.join(directory, COMMON_FILE))
    write_json_atomic(os.path.join(directory, INDEX_FILE), {"format": PORTABLE_FORMAT, "params": params})


def write_masters(tag_dir: str, values: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write ``tag_dir/portable/`` holding only each parameter's full fp32 value, at step 0:
    no optimizer state (a run that loads it starts its optimizer afresh, with its own
    hyper-parameters) and no scheduler.  One process, no engine: what ``oases-ckpt
    convert --from-hf`` writes into a staged checkpoint; ``values`` is read one at a time."""
    directory = os.path.join(tag_dir, PORTABLE_DIR)
    os.makedirs(directory, exist_ok=True)
    params: dict[str, dict[str, Any]] = {}
    for name, value in values:
        file = f"{name}.pt"
        torch.save({"master": value.detach().to(torch.float32).contiguous()}, os.path.join(directory, file))
        params[name] = {"file": file, "shape": list(value.shape), "state": []}
    _finish(directory, {"global_steps": 0, "global_samples": 0, "skipped_steps": 0, "optimizer": {},
                        "lr_scheduler": None, "client_state": {}}, params)


@dataclass(frozen=True)
class IndexEntry:
    """One parameter's line of ``index.json``: its file (a plain name inside ``portable/``),
    its full shape and the optimizer state keys its file holds beside ``master``."""

    file: str
    shape: tuple[int, ...]
    state: tuple[str, ...]


def _plain_file_name(name: Any) -> bool:
    """A file name that can only mean a file directly inside ``portable/``: no separator, no
    ``.``/``..``, not absolute, no NUL.  The index is data from the checkpoint, not a path."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not os.path.isabs(name)
            and not any(c in name for c in ("/", "\\", "\0")) and not (os.altsep and os.altsep in name))


def _index_entry(where: str, name: str, raw: Any) -> IndexEntry:
    """``raw`` as an :class:`IndexEntry`, or one line naming the parameter and what is wrong."""
    if not isinstance(raw, dict) or set(raw) != {"file", "shape", "state"}:
        raise PortableStateError(f"{where}: the entry of parameter {name!r} is {raw!r}, not an object with exactly "
                                 "file, shape and state; the index was edited or damaged: copy the whole checkpoint again")
    file, shape, state = raw["file"], raw["shape"], raw["state"]
    if not _plain_file_name(file):
        raise PortableStateError(f"{where}: parameter {name!r} names file {file!r}, which is not a plain file name inside "
                                 f"{PORTABLE_DIR}/; refusing to read outside the checkpoint")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PortableStateError(f"{where}: parameter {name!r} has shape {shape!r}, not a list of sizes")
    if not isinstance(state, list) or not all(isinstance(k, str) and k and k != "master" for k in state):
        raise PortableStateError(f"{where}: parameter {name!r} has state {state!r}, not a list of optimizer state keys")
    return IndexEntry(file, tuple(shape), tuple(state))


def read_index(tag_dir: str) -> dict[str, IndexEntry]:
    """Parameter name -> :class:`IndexEntry`, every entry checked (a plain file name, a
    shape, state keys); one line naming the parameter and the entry otherwise."""
    path = os.path.join(tag_dir, PORTABLE_DIR, INDEX_FILE)
    where = f"checkpoint {tag_dir} {PORTABLE_DIR}/{INDEX_FILE}"
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise PortableStateError(f"checkpoint {tag_dir} has no {PORTABLE_DIR}/{INDEX_FILE}: its portable state was not "
                                 "saved or not completed") from None
    except (OSError, ValueError) as err:
        raise PortableStateError(f"checkpoint {tag_dir} has an unreadable {PORTABLE_DIR}/{INDEX_FILE}: {err}") from None
    if not isinstance(raw, dict) or raw.get("format") != PORTABLE_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise PortableStateError(f"{where} has format {found!r}, this oases_ds reads format {PORTABLE_FORMAT}")
    if not isinstance(raw.get("params"), dict):
        raise PortableStateError(f"{where} has no object of parameters (params); copy the whole checkpoint again")
    entries = {name: _index_entry(where, name, entry) for name, entry in raw["params"].items()}
    files_seen: dict[str, str] = {}
    for name, entry in entries.items():
        if entry.file in (COMMON_FILE, INDEX_FILE) or files_seen.setdefault(entry.file, name) != name:
            raise PortableStateError(f"{where}: parameter {name!r} names file {entry.file!r}, which holds "
                                     f"{files_seen.get(entry.file, 'the common state')}")
    return entries


def files(tag_dir: str) -> list[tuple[str, str]]:
    """``(path relative to tag_dir, what it holds)`` of every portable file the index names,
    each checked to stay inside ``portable/``: a plain name (:func:`read_index`) that is no
    link out of it either."""
    directory = os.path.realpath(os.path.join(tag_dir, PORTABLE_DIR))
    for name, entry in (index := read_index(tag_dir)).items():
        if os.path.dirname(os.path.realpath(os.path.join(directory, entry.file))) != directory:
            raise PortableStateError(f"portable checkpoint file {os.path.join(tag_dir, PORTABLE_DIR, entry.file)} of "
                                     f"parameter {name} is a link out of {PORTABLE_DIR}/; refusing to read outside the "
                                     "checkpoint")
    out = [(f"{PORTABLE_DIR}/{COMMON_FILE}", "optimizer hyper-parameters, LR scheduler and step of the portable state")]
    out += [(f"{PORTABLE_DIR}/{entry.file}", f"full value and optimizer state of parameter {name}")
            for name, entry in index.items()]
    return out


def model_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Every trained parameter's full shape for the :class:`~oases_ds.models.config.ModelConfig`
    ``model``, from a model built on the meta device (no memory for the weights)."""
    from oases_ds.models.operator_model import OperatorModel

    with torch.device("meta"):
        built = OperatorModel(model)
    return {name: tuple(built.sharding.full_shape(name, p)) for name, p in built.named_parameters() if p.requires_grad}


def _read(path: str) -> Any:
    """A portable file, memory-mapped (nothing is read until a tensor's pages are touched),
    tensors and plain containers only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise PortableStateError(f"portable checkpoint file {path} is missing") from None
    except pickle.UnpicklingError:  # never pass on torch's advice to load it with weights_only=False
        raise PortableStateError(f"portable checkpoint file {path} holds objects other than tensors; refused (loading it "
                                 "could run code): use checkpoints saved by oases_ds") from None
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PortableStateError(f"cannot read portable checkpoint file {path}: {reason}") from None


def _parameter_problem(held: Any, entry: IndexEntry, full_shape: tuple[int, ...] | None) -> str | None:
    """What is wrong with a parameter file's contents against its index entry and the
    model's full shape, as the end of "portable checkpoint file <path> ...", or None.
    Looks only at keys, dtypes and shapes: the data stays unread."""
    if not isinstance(held, dict):
        return f"holds a {type(held).__name__}, not the tensors of one parameter"
    if full_shape is not None and entry.shape != tuple(full_shape):
        return f"is listed in {INDEX_FILE} with shape {list(entry.shape)}, but this model's is {list(full_shape)}"
    for key in ("master", *entry.state):
        value = held.get(key)
        if not torch.is_tensor(value):
            return f"lacks {key}" if value is None else f"holds {key} as a {type(value).__name__}, not a tensor"
        if not value.is_floating_point():
            return f"holds {key} as {str(value.dtype).replace('torch.', '')}, not floating point"
        if tuple(value.shape) != entry.shape:
            return f"holds {key} with shape {list(value.shape)}, but {INDEX_FILE} says {list(entry.shape)}"
    return None


_COMMON_TYPES = {"global_steps": int, "global_samples": int, "skipped_steps": int, "optimizer": dict,
                 "client_state": dict}


def _common_problem(held: Any) -> str | None:
    """What is wrong with ``common.pt``'s contents (module docstring), or None."""
    if not isinstance(held, dict):
        return f"holds a {type(held).__name__}, not the common state"
    for key, kind in _COMMON_TYPES.items():
        if not isinstance(held.get(key), kind):
            return f"lacks {key}" if key not in held else f"holds {key} as a {type(held[key]).__name__}"
    scaler = held["optimizer"].get("loss_scaler")
    if scaler is not None and not (isinstance(scaler, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in scaler.values())):
        return f"holds optimizer.loss_scaler as {scaler!r}, not numbers"
    if held.get("lr_scheduler") is not None and not isinstance(held["lr_scheduler"], dict):
        return f"holds lr_scheduler as a {type(held['lr_scheduler']).__name__}"
    return None


def check(tag_dir: str, shapes: dict[str, tuple[int, ...]] | None) -> None:
    """Check the whole portable state of ``tag_dir`` before anything loads it.  Its files
    stay inside ``portable/`` (:func:`files`); ``shapes`` (:func:`model_shapes`; None: not
    compared) are exactly the index's parameters and shapes; every file unpickles under
    ``weights_only`` and holds, for each parameter, ``master`` and each state key the index
    names, floating point, of the index's shape; ``common.pt`` holds the common state.
    Files are memory-mapped and only their pickles read, not their data (seconds for a 7B
    model's files: ``benchmarks/portable_preflight.py``).  Raises :class:`PortableStateError`,
    one line naming the file or parameter."""
    files(tag_dir)
    index = read_index(tag_dir)
    if shapes is not None:
        missing = [name for name in shapes if name not in index]
        extra = [name for name in index if name not in shapes]
        if missing or extra:
            which = f"no portable state for parameter {missing[0]}" if missing else f"parameter {extra[0]}, not in this model"
            raise PortableStateError(f"checkpoint {tag_dir} holds {which} ({len(missing)} missing, {len(extra)} extra); "
                                     "is it a checkpoint of the same model?")
    for name, entry in index.items():
        path = os.path.join(tag_dir, PORTABLE_DIR, entry.file)
        problem = _parameter_problem(_read(path), entry, None if shapes is None else shapes[name])
        if problem:
            raise PortableStateError(f"portable checkpoint file {path} of parameter {name} {problem}; refused: copy the "
                                     "whole checkpoint again")
    path = os.path.join(tag_dir, PORTABLE_DIR, COMMON_FILE)
    problem = _common_problem(_read(path))
    if problem:
        raise PortableStateError(f"portable checkpoint file {path} {problem}; refused: copy the whole checkpoint again")


def read_full(tag_dir: str, name: str, index: dict[str, IndexEntry] | None = None) -> dict[str, torch.Tensor]:
    """The full tensors saved for parameter ``name`` (memory-mapped: read on access), checked
    against its index entry; ``index``: :func:`read_index` of ``tag_dir``, when reading many
    (read once)."""
    index = read_index(tag_dir) if index is None else index
    if name not in index:
        raise PortableStateError(f"checkpoint {tag_dir} has no portable state for parameter {name}")
    path = os.path.join(tag_dir, PORTABLE_DIR, index[name].file)
    held = _read(path)
    problem = _parameter_problem(held, index[name], None)
    if problem:
        raise PortableStateError(f"portable checkpoint file {path} of parameter {name} {problem}; refused")
    return held


def read_common(tag_dir: str) -> dict[str, Any]:
    path = os.path.join(tag_dir, PORTABLE_DIR, COMMON_FILE)
    held = _read(path)
    problem = _common_problem(held)
    if problem:
        raise PortableStateError(f"portable checkpoint file {path} {problem}; refused")
    return held


@torch.no_grad()
def load(engine: Any, tag_dir: str, optimizer_states: bool = True, lr_scheduler_states: bool = True,
         module_only: bool = False) -> dict:
    """Set this rank's parameters, master copies and (``optimizer_states``) optimizer state
    from ``tag_dir/portable/``, then (``lr_scheduler_states``) the scheduler and, unless
    ``module_only``, the step counters, as DeepSpeed's load does; returns the client state.
    No collective: every rank reads only the files of the parameters it holds."""
    sharding = engine.module.sharding
    index = read_index(tag_dir)
    named = _params(engine)
    missing = [name for name, _ in named if name not in index]
    if missing:
        raise PortableStateError(f"checkpoint {tag_dir} has no portable state for {len(missing)} parameter(s) of this "
                                 f"model, e.g. {missing[0]}; is it a checkpoint of the same model?")
    access = _OptimizerAccess(engine.optimizer, [p for _, p in named])
    common = read_common(tag_dir)
    masters, states = {}, {}
    for name, param in named:
        full = read_full(tag_dir, name, index)
        shape = index[name].shape
        if shape != tuple(sharding.full_shape(name, param)):
            raise PortableStateError(f"checkpoint {tag_dir} holds parameter {name} with shape {list(shape)}, this model's is "
                                     f"{list(sharding.full_shape(name, param))}")
        masters[param] = sharding.shard_of(name, param, full["master"]).to(param.device, torch.float32)
        if optimizer_states:
            states[param] = {k: sharding.shard_of(name, param, full[k]).to(param.device) for k in index[name].state}
    saved_class, this_class = common["optimizer"].get("class"), type(access.inner).__name__
    if optimizer_states and any(states.values()) and saved_class not in (None, this_class):  # None: saved before it was kept
        raise PortableStateError(f"checkpoint {tag_dir} holds the state of an optimizer {saved_class}, this run has "
                                 f"{this_class}; configure the same optimizer, or load with load_optimizer_states=False")
    access.set_masters(masters)
    if optimizer_states and any(states.values()):  # none (``write_masters``): the optimizer starts afresh
        if not common.get("optimizer"):
            raise PortableStateError(f"checkpoint {tag_dir} holds optimizer state but its {PORTABLE_DIR}/{COMMON_FILE} "
                                     "has no optimizer hyper-parameters; copy the whole checkpoint again")
        access.set_state(states, common["optimizer"]["scalars"], common["optimizer"]["hyper"])
        access.set_scaler_state(common["optimizer"].get("loss_scaler"))
    if module_only:
        return dict(common["client_state"])
    if lr_scheduler_states and engine.lr_scheduler is not None and common["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(common["lr_scheduler"])
    engine.global_steps = common["global_steps"]
    engine.global_samples = common["global_samples"]
    engine.skipped_steps = common["skipped_steps"]
    return dict(common["client_state"])
