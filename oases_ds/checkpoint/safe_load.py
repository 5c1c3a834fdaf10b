"""Reading a checkpoint without surprises: no code runs, and every file is there first.

Why this exists:

* **No code from a checkpoint.**  DeepSpeed 0.19.8 reads every checkpoint file with
  ``torch.load(weights_only=False)``: a file whose pickle carries a ``__reduce__`` payload
  runs it on every rank.  :class:`SafeCheckpointEngine` reads with ``weights_only=True`` and
  allowlists only the DeepSpeed classes that fp32, bf16 and ZeRO-1 checkpoints really
  contain (found by saving one in each mode and loading it back:
  ``tests/distributed/test_checkpoint.py`` repeats that).
* **Every file its layout needs, checked first.**  The meta says which rank files DeepSpeed
  wrote (:meth:`~oases_ds.checkpoint.meta.CheckpointMeta.rank_files`); :func:`check_rank_files`
  names a missing, empty, unreadable or cut-short one before any rank starts.  DeepSpeed
  itself would find it only inside the ranks, as an ``EOFError`` on one of them or an
  ``AssertionError`` about the checkpoint count.
* **A run that cannot save or resume fails before it starts** (:func:`preflight`): an
  unwritable directory, or ``resume`` with nothing to resume, found after the ranks trained
  would cost the whole run.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from oases_ds.checkpoint import portable as portable_state
from oases_ds.checkpoint.meta import CheckpointError, CheckpointMeta
from oases_ds.checkpoint.tags import LATEST, read_latest
from oases_ds.models.config import ModelConfig

SAFE_GLOBALS: tuple[type, ...] = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
"""Beyond tensors and plain containers, what DeepSpeed 0.19.8 pickles into fp32/bf16/fp16
checkpoints with ZeRO 0, 1 or 2: the ZeRO optimizer state's loss scaler (static, or fp16's
dynamic one: numbers and a dtype), its stage enum and its parameter-fragment addresses.
Nothing else is unpickled."""


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


def check_rank_files(directory: str, tag: str, saved: CheckpointMeta, optimizer_states: bool = True,
                     portable: bool = False) -> None:
    """Every file ``saved``'s layout needs (``portable``: every file of its portable state) is
    in ``directory/tag``, a non-empty file, readable, and a complete torch file
    (``torch.save`` writes a zip archive; its directory is at the end, so a file cut short by
    a crash or an interrupted copy has none).  For the portable state, also every tensor's
    keys, dtype and shape (:func:`oases_ds.checkpoint.portable.check`), against the model
    ``saved`` names.  Reads each file's zip directory and pickle, never the tensors' data."""
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
    if portable:  # every tensor's keys, dtype and shape against the index and the saved model, no data read
        try:
            portable_state.check(tag_dir, portable_state.model_shapes(ModelConfig(**saved.model)))
        except portable_state.PortableStateError as err:
            raise CheckpointError(str(err)) from None


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
