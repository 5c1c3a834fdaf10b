"""Checkpoints that are safe to load and safe to lose power during.

Why this exists, in five parts:

* **No code from a checkpoint.**  DeepSpeed 0.19.8 reads every checkpoint file
  with ``torch.load(weights_only=False)``: a file whose pickle carries a
  ``__reduce__`` payload runs it on every rank.  :class:`SafeCheckpointEngine`
  reads with ``weights_only=True`` and allowlists only the DeepSpeed classes
  that fp32, bf16 and ZeRO-1 checkpoints really contain (found by saving one in
  each mode and loading it back: ``tests/distributed/test_checkpoint.py`` repeats that).
* **``latest`` is data, not a path.**  It must name a plain tag (no separator,
  no ``..``) whose directory exists and was completed by :func:`publish`.
* **Crash-safe publication.**  A checkpoint is written under ``<tag>.partial``,
  renamed to a directory ``latest`` does not name, then ``latest`` is switched
  atomically, then the superseded copy is removed.  Re-saving tag ``T`` while
  ``latest`` names ``T`` publishes ``T.resaved`` (and the next re-save ``T``
  again), so at every instant ``latest`` names a complete checkpoint.
* **Mismatches refused in one line.**  Each checkpoint carries
  ``oases_meta.json`` (:class:`CheckpointMeta`: model, TMP degree and per-block
  degrees, precision, ZeRO stage, DP size); a run that differs is refused
  before DeepSpeed reads anything, instead of failing deep inside it.
* **Every file its layout needs, checked first.**  The meta says which rank files
  DeepSpeed wrote (:meth:`CheckpointMeta.rank_files`); :func:`check_rank_files` names
  a missing, empty, unreadable or cut-short one before any rank starts.  DeepSpeed
  itself would find it only inside the ranks, as an ``EOFError`` on one of them or an
  ``AssertionError`` about the checkpoint count.

All functions are filesystem logic for one process; the engine calls the
writers on rank 0 between barriers.  Several nodes need a shared filesystem.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from oases_ds import portable as portable_state
from oases_ds.models.config import ModelConfig
from oases_ds.utils.io import write_json_atomic, write_text_atomic

_MODEL_DEFAULTS = {name: f.default for name, f in ModelConfig.__dataclass_fields__.items()}
"""What a run had for a ModelConfig field its checkpoint predates (every field has a default)."""

LATEST = "latest"
META_FILE = "oases_meta.json"
STAGING_SUFFIX = ".partial"
RESAVE_SUFFIX = ".resaved"
META_FORMAT = 1

SAFE_GLOBALS: tuple[type, ...] = (LossScaler, ZeroStageEnum, fragment_address)
"""Beyond tensors and plain containers, what DeepSpeed 0.19.8 pickles into fp32/bf16
checkpoints with ZeRO 0 or 1: the ZeRO optimizer state's static loss scaler, its
stage enum and its parameter-fragment addresses.  Nothing else is unpickled."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or a checkpoint directory that cannot be; one line."""


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with a load that cannot run code.

    Saving is unchanged.  Loading refuses any pickled global outside
    :data:`SAFE_GLOBALS` (``weights_only=True``), so a tampered file fails with a
    :class:`CheckpointError` naming it instead of executing its payload.
    """

    def load(self, path: str, map_location: Any = None) -> Any:
        try:
            with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL (\S+)", str(err))
            what = f"a pickled {found.group(1)}" if found else "a pickled object"
            raise CheckpointError(
                f"refusing to load checkpoint file {path}: it holds {what}, which is not a tensor, a container or one "
                "of DeepSpeed's checkpoint classes (unpickling it could run code); use checkpoints saved by oases_ds"
            ) from None
        except (OSError, RuntimeError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"cannot read checkpoint file {path}: {reason}") from None


@dataclass(frozen=True)
class CheckpointMeta:
    """The facts a checkpoint's tensors depend on; a run must match them to resume.

    The schedule is absent on purpose: every schedule computes the same
    parameters over the same shards, so switching it on resume is allowed.

    Attributes:
        model: the :class:`ModelConfig` as a dict.
        tensor_parallel_size: the TMP degree (DeepSpeed's mp ranks = shard files).
        block_degrees: TMP degree of each block in execution order (attn0, mlp0, ...):
            a plan's layout, or every block at ``tensor_parallel_size``.
        precision: "bf16" or "fp32" (master weights and optimizer state layout).
        zero_stage: 0 or 1 (whether optimizer state is partitioned).
        data_parallel_size: DP ranks; compared only when ``zero_stage`` partitions
            the optimizer state across them.
        pipeline_layers: layers of each pipeline stage (``(num_layers,)``: one stage).
            Each stage saves its own layers (its own mp-rank files), so a different
            split cannot read them.
        portable: the checkpoint also holds its state layout-free (:mod:`oases_ds.portable`),
            so a run with another layout (any fact in :data:`LAYOUT_FACTS`) can load it.
            Not a fact a run must match; ``False`` in checkpoints saved before it existed.

    A checkpoint no run saved (``oases-ckpt convert --from-hf``, :meth:`portable_only`) has
    no layout: ``tensor_parallel_size`` 0, no block degrees, ZeRO 0 over DP 0, and no rank
    files.  No run has TMP degree 0, so :meth:`load_route` always finds another layout and
    takes the portable route, with the same checks of model and precision as any resume.
    """

    model: dict
    tensor_parallel_size: int
    block_degrees: tuple[int, ...]
    precision: str
    zero_stage: int
    data_parallel_size: int
    pipeline_layers: tuple[int, ...] = ()
    portable: bool = False

    @classmethod
    def build(cls, model: ModelConfig, tensor_parallel_size: int, block_degrees: Sequence[int] | None, bf16: bool,
              zero_stage: int, data_parallel_size: int, pipeline_layers: Sequence[int] | None = None) -> CheckpointMeta:
        """The one constructor the engine (from itself) and ``oases-train`` (from its config) share."""
        degrees = tuple(block_degrees) if block_degrees else (tensor_parallel_size,) * (2 * model.num_layers)
        layers = tuple(int(n) for n in pipeline_layers) if pipeline_layers else (model.num_layers,)
        return cls(model.to_dict(), tensor_parallel_size, tuple(int(d) for d in degrees), "bf16" if bf16 else "fp32",
                   int(zero_stage), data_parallel_size, layers)

    @classmethod
    def portable_only(cls, model: ModelConfig, bf16: bool) -> CheckpointMeta:
        """The meta of a checkpoint that holds only its portable state (no rank files, no
        layout: see the class docstring), which every run loads through that state."""
        return cls(model.to_dict(), 0, (), "bf16" if bf16 else "fp32", 0, 0, (model.num_layers,), portable=True)

    @property
    def has_layout(self) -> bool:
        """Whether a run saved it (rank files of a layout); ``False``: portable state only."""
        return self.tensor_parallel_size > 0

    @classmethod
    def read(cls, tag_dir: str) -> CheckpointMeta:
        path = os.path.join(tag_dir, META_FILE)
        try:
            with open(path) as f:
                raw = json.load(f)
            fields = {k: raw[k] for k in cls.__dataclass_fields__ if k not in ("pipeline_layers", "portable")}
            fields["portable"] = bool(raw.get("portable", False))  # saved before portable state existed: none
            fields["block_degrees"] = tuple(fields["block_degrees"])
            # saved before a ModelConfig field existed: that run had the field's default
            fields["model"] = {**_MODEL_DEFAULTS, **fields["model"]}
            # saved before pipeline stages existed: one stage
            fields["pipeline_layers"] = tuple(raw.get("pipeline_layers") or (raw["model"]["num_layers"],))
            return cls(**fields)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {tag_dir} has no {META_FILE}: it was not saved by oases_ds or not "
                                  "completed, so its layout cannot be checked") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"checkpoint {tag_dir} has an unreadable {META_FILE}: {err}") from None

    def write(self, tag_dir: str, global_steps: int) -> None:
        """Atomically, into a staged checkpoint; ``saved_at`` orders tags for pruning."""
        write_json_atomic(os.path.join(tag_dir, META_FILE),
                          {"format": META_FORMAT, **asdict(self), "global_steps": global_steps, "saved_at": time.time()})

    def differences(self, run: CheckpointMeta, optimizer_states: bool = True) -> list[tuple[str, Any, Any]]:
        """``(name, saved, this run)`` for every fact that differs; names as the user sets them."""
        diffs = [(f"model.{k}", self.model.get(k), run.model.get(k))
                 for k in sorted(set(self.model) | set(run.model)) if self.model.get(k) != run.model.get(k)]
        pairs = [("tensor_parallel_size", self.tensor_parallel_size, run.tensor_parallel_size)]
        if (self.tensor_parallel_size == run.tensor_parallel_size  # else the degrees differ as a consequence
                and len(self.block_degrees) == len(run.block_degrees)):
            pairs.append(("plan block degrees", list(self.block_degrees), list(run.block_degrees)))
        if sum(self.pipeline_layers) == sum(run.pipeline_layers):  # else model.num_layers differs, named above
            pairs.append(("pipeline_layers (layers per stage)", list(self.pipeline_layers), list(run.pipeline_layers)))
        pairs.append(("precision", self.precision, run.precision))
        if optimizer_states:
            pairs.append(("zero_stage", self.zero_stage, run.zero_stage))
            if self.zero_stage > 0 and self.zero_stage == run.zero_stage:
                pairs.append(("data_parallel_size (ZeRO partitions)", self.data_parallel_size, run.data_parallel_size))
        return diffs + [(name, saved, now) for name, saved, now in pairs if saved != now]

    def rank_files(self, optimizer_states: bool = True) -> list[tuple[str, str]]:
        """``(file name, what it holds)`` of every rank file DeepSpeed 0.19.8 writes for this
        layout: the model states of each model-parallel rank (``mpu.get_model_parallel_rank``:
        pipeline stage x TMP degree + TMP rank; written by DP rank 0) and, with ZeRO, the
        optimizer-state partition of each DP rank for each of them (``bf16_`` in front in bf16).
        None without a layout (:attr:`has_layout`): TMP degree 0 makes 0 model-parallel ranks."""
        model_parallel = self.tensor_parallel_size * len(self.pipeline_layers)
        files = [(f"mp_rank_{mp:02d}_model_states.pt", f"model states of model-parallel rank {mp} of {model_parallel}")
                 for mp in range(model_parallel)]
        if optimizer_states and self.zero_stage > 0:
            prefix = "bf16_" if self.precision == "bf16" else ""
            files += [(f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt",
                       f"ZeRO optimizer states of data-parallel rank {dp} of {self.data_parallel_size}, "
                       f"model-parallel rank {mp} of {model_parallel}")
                      for dp in range(self.data_parallel_size) for mp in range(model_parallel)]
        return files

    def refuse_mismatch(self, tag_dir: str, run: CheckpointMeta, optimizer_states: bool = True) -> None:
        """Raise unless ``run`` can load this checkpoint as DeepSpeed wrote it (same layout)."""
        diffs = self.differences(run, optimizer_states)
        if diffs:
            raise CheckpointError(_mismatch_line(tag_dir, diffs))

    def load_route(self, tag_dir: str, run: CheckpointMeta, optimizer_states: bool = True) -> str:
        """How ``run`` loads this checkpoint: ``"native"`` (same layout: DeepSpeed's own files)
        or ``"portable"`` (another layout: the layout-free state, resharded on load; always
        for a checkpoint without a layout, whose TMP degree 0 differs from every run's); one
        line naming both sides when neither can (another model or precision, or another
        layout and no portable state)."""
        diffs = self.differences(run, optimizer_states)
        if not diffs:
            return "native"
        if any(name not in LAYOUT_FACTS for name, _, _ in diffs):
            raise CheckpointError(_mismatch_line(tag_dir, [d for d in diffs if d[0] not in LAYOUT_FACTS]))
        if not self.portable:
            raise CheckpointError(f"{_mismatch_line(tag_dir, diffs)}; it holds no portable state (saved with "
                                  "oases.portable_checkpoint=false, or by an older oases_ds), so only its own layout "
                                  "loads it")
        return "portable"


LAYOUT_FACTS = frozenset({"tensor_parallel_size", "plan block degrees", "pipeline_layers (layers per stage)",
                          "zero_stage", "data_parallel_size (ZeRO partitions)"})
"""The facts of :meth:`CheckpointMeta.differences` that only say how the state is split over
ranks; the portable state converts between any two values of them."""


def _mismatch_line(tag_dir: str, diffs: list[tuple[str, Any, Any]]) -> str:
    saved = ", ".join(f"{name}={value}" for name, value, _ in diffs)
    now = ", ".join(f"{name}={value}" for name, _, value in diffs)
    return f"checkpoint {tag_dir} was saved with {saved}, this run has {now}"


def check_tag(tag: str, source: str = "tag") -> str:
    """A tag is one plain directory name under the checkpoint directory, never a path."""
    if (not tag or tag in (".", "..") or "/" in tag or "\\" in tag or os.sep in tag
            or (os.altsep and os.altsep in tag) or "\0" in tag or tag != tag.strip()):
        raise CheckpointError(f"{source} names {tag!r}, which is not a plain checkpoint tag (a directory name with no "
                              "path separator); refusing to read outside the checkpoint directory")
    return tag


def read_latest(directory: str) -> str | None:
    """The tag ``directory/latest`` names, checked to be a completed checkpoint; ``None``
    when there is no ``latest`` file."""
    latest = os.path.join(directory, LATEST)
    if not os.path.isfile(latest):
        return None
    try:
        with open(latest) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read {latest}: {err}") from None
    return check_complete(directory, check_tag(tag, source=latest), source=latest)


def check_complete(directory: str, tag: str, source: str = "tag") -> str:
    """``tag`` exists under ``directory`` as a checkpoint :func:`publish` completed."""
    check_tag(tag, source)
    tag_dir = os.path.join(directory, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"{source} names tag {tag!r}, but {tag_dir} does not exist")
    if not os.path.isfile(os.path.join(tag_dir, META_FILE)):
        raise CheckpointError(f"{source} names tag {tag!r}, but {tag_dir} has no {META_FILE} (not saved by oases_ds, "
                              "or not completed)")
    return tag


def check_rank_files(directory: str, tag: str, saved: CheckpointMeta, optimizer_states: bool = True,
                     portable: bool = False) -> None:
    """Every file ``saved``'s layout needs (``portable``: every file of its portable state) is
    in ``directory/tag``, a non-empty file, readable, and a complete torch file
    (``torch.save`` writes a zip archive; its directory is at the end, so a file cut short by
    a crash or an interrupted copy has none).  Reads only each file's zip directory, not the
    tensors."""
    tag_dir = os.path.join(directory, tag)
    if portable:
        try:
            needed = portable_state.files(tag_dir)
        except portable_state.PortableStateError as err:
            raise CheckpointError(str(err)) from None
    else:
        needed = saved.rank_files(optimizer_states)
    for name, holds in needed:
        path = os.path.join(tag_dir, name)
        problem = _rank_file_problem(path)
        if problem:
            raise CheckpointError(f"checkpoint file {path} {problem}: it holds the {holds}; copy the whole checkpoint "
                                  f"{tag_dir} again, or write an older tag into {os.path.join(directory, LATEST)}")


def _rank_file_problem(path: str) -> str | None:
    """What is wrong with one rank file, as the end of "checkpoint file <path> ...", or None."""
    if not os.path.lexists(path):
        return "is missing"
    if not os.path.isfile(path):
        return "is not a file"
    try:
        if os.path.getsize(path) == 0:
            return "is empty"
        with zipfile.ZipFile(path):
            pass
    except zipfile.BadZipFile as err:
        return f"is damaged (not a complete torch file: {err})"
    except OSError as err:
        return f"is unreadable ({err.strerror or err})"
    return None


def check_save_tag(tag: str) -> str:
    """Save tags are plain and do not end with the suffixes :func:`publish` reserves."""
    check_tag(tag)
    for suffix in (STAGING_SUFFIX, RESAVE_SUFFIX, ".tmp"):
        if tag.endswith(suffix):
            raise CheckpointError(f"checkpoint tag {tag!r} ends with {suffix!r}, which oases_ds reserves; pick another tag")
    if tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} would overwrite the {LATEST} file; pick another tag")
    return tag


def _latest_or_none(directory: str) -> str | None:
    """What ``latest`` names now, whether or not it is usable (a save replaces a bad one)."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def write_latest(directory: str, tag: str) -> None:
    """Atomic switch: readers see the old tag or the new one, never a torn file."""
    write_text_atomic(os.path.join(directory, LATEST), tag)


def publish(directory: str, tag: str, staged: str, save_latest: bool = True) -> str:
    """Make the complete checkpoint in ``staged`` the tag ``tag``; returns its directory name.

    Each step leaves ``latest`` naming a complete checkpoint::

        staged ---rename---> target  (a name latest does not name: T, or T.resaved if latest names T)
        latest ---replace--> target  (atomic)
        other copy of T ---> removed (unless latest still names it)
    """
    current = _latest_or_none(directory)
    resaved = f"{tag}{RESAVE_SUFFIX}"
    target, other = (resaved, tag) if current == tag else (tag, resaved)
    target_dir = os.path.join(directory, target)
    if os.path.exists(target_dir):  # not named by latest: a leftover, or an older copy this save supersedes
        shutil.rmtree(target_dir)
    os.replace(staged, target_dir)
    if save_latest:
        write_latest(directory, target)
    if other != (target if save_latest else current):
        shutil.rmtree(os.path.join(directory, other), ignore_errors=True)
    return target


def saved_tags(directory: str) -> list[str]:
    """Completed checkpoints under ``directory``, oldest first (by their save time)."""
    found = []
    for name in os.listdir(directory):
        meta = os.path.join(directory, name, META_FILE)
        if name.endswith(STAGING_SUFFIX) or not os.path.isfile(meta):
            continue
        try:
            with open(meta) as f:
                saved_at = float(json.load(f).get("saved_at", 0.0))
        except (OSError, ValueError, TypeError):
            saved_at = 0.0
        found.append((saved_at, name))
    return [name for _, name in sorted(found)]


def prune(directory: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` checkpoints (0: all), and always the one ``latest`` names;
    returns the tags removed."""
    if keep < 0:
        raise CheckpointError(f"checkpoint.keep must be >= 0 (0 keeps all), got {keep}")
    if keep == 0:
        return []
    tags = saved_tags(directory)
    protected = set(tags[-keep:]) | {_latest_or_none(directory)}
    removed = [t for t in tags if t not in protected]
    for tag in removed:
        shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
    return removed


def _writable_reason(directory: str) -> str | None:
    """Why a checkpoint cannot be written under ``directory`` (which may not exist yet), or None."""
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        return "it is a file, not a directory"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, so no directory can be created under it"
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".oases-probe-"):
            pass
    except OSError as err:
        return f"cannot create files in {existing} ({err.strerror or err})"
    return None


def preflight(directory: str | None, resume: bool, expected: CheckpointMeta | None = None) -> None:
    """Checks ``oases-train`` runs before any rank starts.

    ``resume=True`` with nothing to resume is an error, not a fresh start: an
    explicit resume that silently trains from step 0 would overwrite the run it
    meant to continue.
    """
    if not directory:
        if resume:
            raise CheckpointError("checkpoint.resume=true needs checkpoint.dir (the directory to resume from)")
        return
    reason = _writable_reason(directory)
    if reason:
        raise CheckpointError(f"checkpoint.dir={directory} cannot hold checkpoints: {reason}; pick a writable directory")
    if not resume:
        return
    tag = read_latest(directory)
    if tag is None:
        raise CheckpointError(f"checkpoint.resume=true but checkpoint.dir={directory} holds no checkpoint (no {LATEST} "
                              "file); drop checkpoint.resume to start from step 0")
    tag_dir = os.path.join(directory, tag)
    saved = CheckpointMeta.read(tag_dir)
    route = saved.load_route(tag_dir, expected) if expected is not None else "native"
    check_rank_files(directory, tag, saved, portable=route == "portable")
