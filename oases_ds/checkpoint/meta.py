"""What a checkpoint says about itself: ``oases_meta.json`` (:class:`CheckpointMeta`).

Why a file of our own next to DeepSpeed's: DeepSpeed reads a checkpoint of another model,
precision or layout deep inside its load and fails there (a shape error on one rank, an
``AssertionError`` about the checkpoint count).  Each checkpoint therefore carries the
facts its tensors depend on (model, TMP degree and per-block degrees, precision, ZeRO
stage, DP size, pipeline split), and a run that differs is refused in one line naming
both sides, before DeepSpeed reads anything -- or, when only the layout differs and the
checkpoint holds its portable state, loads it through that state instead
(:meth:`CheckpointMeta.load_route`).  The meta also says which rank files DeepSpeed wrote
(:meth:`CheckpointMeta.rank_files`), which :mod:`oases_ds.checkpoint.safe_load` checks.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from oases_ds.models.config import ModelConfig
from oases_ds.utils.io import write_json_atomic

_MODEL_DEFAULTS = {name: f.default for name, f in ModelConfig.__dataclass_fields__.items()}
"""What a run had for a ModelConfig field its checkpoint predates (every field has a default)."""

META_FILE = "oases_meta.json"
META_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or a checkpoint directory that cannot be; one line."""


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
        precision: "bf16", "fp16" or "fp32" (the weights' dtype, master weights and optimizer
            state layout; fp16 also carries its loss scaler).
        zero_stage: 0 or 1 (whether optimizer state is partitioned).
        data_parallel_size: DP ranks; compared only when ``zero_stage`` partitions
            the optimizer state across them.
        pipeline_layers: layers of each pipeline stage (``(num_layers,)``: one stage).
            Each stage saves its own layers (its own mp-rank files), so a different
            split cannot read them.
        portable: the checkpoint also holds its state layout-free (:mod:`oases_ds.checkpoint.portable`),
            so a run with another layout (any fact in :data:`LAYOUT_FACTS`) can load it.
            Not a fact a run must match; ``False`` in checkpoints saved before it existed.
        global_steps: the step it was saved at (0 in a run's own meta, which describes a
            layout, not a save; 0 where a meta file has none).  Not a fact a run must match:
            :meth:`differences` never compares it, since a resume continues from another step.

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
    global_steps: int = 0

    @classmethod
    def build(cls, model: ModelConfig, tensor_parallel_size: int, block_degrees: Sequence[int] | None, precision: str,
              zero_stage: int, data_parallel_size: int, pipeline_layers: Sequence[int] | None = None) -> CheckpointMeta:
        """The one constructor the engine (from itself) and ``oases-train`` (from its config) share."""
        degrees = tuple(block_degrees) if block_degrees else (tensor_parallel_size,) * (2 * model.num_layers)
        layers = tuple(int(n) for n in pipeline_layers) if pipeline_layers else (model.num_layers,)
        return cls(model.to_dict(), tensor_parallel_size, tuple(int(d) for d in degrees), precision,
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
            defaulted = ("pipeline_layers", "portable", "global_steps")  # absent from some meta files
            fields = {k: raw[k] for k in cls.__dataclass_fields__ if k not in defaulted}
            fields["portable"] = bool(raw.get("portable", False))  # saved before portable state existed: none
            fields["global_steps"] = int(raw.get("global_steps", 0))  # not written: step 0
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

    def write(self, tag_dir: str) -> None:
        """Atomically, into a staged checkpoint; ``saved_at`` orders tags for pruning."""
        write_json_atomic(os.path.join(tag_dir, META_FILE), {"format": META_FORMAT, **asdict(self), "saved_at": time.time()})

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


