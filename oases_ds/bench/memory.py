"""Predicted against measured per-rank memory of TMP plans, with real gloo ranks.

Why: the planner bounds a plan's memory with :mod:`oases_ds.planner.memory`; this
runs the plan (every rank builds its part with :meth:`OperatorModel.for_plan` and
runs one step through the executor under
:class:`~oases_ds.bench.measure.ActivationProbe`) and sets the measured peak
beside the prediction, per rank.  Model states are counted from the parameters
the rank really holds (x ``STATE_BYTES_PER_PARAM``); activations are measured.
``python -m oases_ds.bench.memory`` writes ``benchmarks/results/memory_validation.json``,
the file the README's planner section quotes.
"""
from __future__ import annotations

import datetime
import sys
from typing import Any

import torch

from oases_ds.bench.measure import ActivationProbe
from oases_ds.bench.provenance import git_commit, machine
from oases_ds.data.batches import synthetic_batch
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.random import RNGTracker
from oases_ds.planner.costs import STATE_BYTES_PER_PARAM
from oases_ds.planner.memory import estimate_memory
from oases_ds.planner.plan import Plan
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec, schedule_segments
from oases_ds.utils.io import write_json_atomic

DTYPE_BYTES = 4
"""The ranks run fp32 on CPU."""

DEFAULT_OUT = "benchmarks/results/memory_validation.json"

# The committed validation: GPT and LLaMA, TMP 2 and 4, uniform and mixed degrees, two schedules.
DEFAULT_CASES: tuple[dict[str, Any], ...] = tuple(
    {"family": family, "devices": devices, "attn": attn, "mlp": mlp, "schedule": schedule}
    for family, devices, attn, mlp, schedule in (
        ("gpt", 2, (2, 2), (2, 2), "oases"),
        ("gpt", 2, (2, 1), (1, 2), "oases"),
        ("gpt", 4, (4, 1), (2, 4), "megatron"),
        ("llama", 4, (4, 4), (4, 4), "oases"),
        ("llama", 2, (2, 1), (1, 2), "megatron"),
        ("llama", 4, (4, 1), (2, 4), "oases"),
    )
)


def _model(family: str, layers: int) -> ModelConfig:
    """Big enough that attention's s x s, the MLP and the logits all matter (h=256, s=128)."""
    return ModelConfig(family=family, vocab_size=1024, hidden_size=256, num_heads=4, num_layers=layers, seq_len=128)


def plan_memory_rank(case: dict[str, Any], micro_batch: int, timeout_s: float,
                     model_cfg: ModelConfig | None = None) -> dict[str, Any]:
    """One rank: build its part of the plan, run one probed step, return measured and predicted bytes.
    ``case`` may add ``stored`` / ``gathered`` (blocks of policy store / oases_gathered) and
    ``sequence_parallel``; ``model_cfg`` replaces :func:`_model`'s (its layers must be the plan's)."""
    devices = case["devices"]
    ctx = ParallelContext.build(tensor_parallel_size=devices, timeout_s=timeout_s)
    cfg = model_cfg or _model(case["family"], len(case["attn"]))
    sp = bool(case.get("sequence_parallel"))
    plan = Plan(attn_degrees=case["attn"], mlp_degrees=case["mlp"], devices=devices)
    model = OperatorModel.for_plan(cfg, ctx, plan, seed=0, sequence_parallel=sp)
    spec = ScheduleSpec(case["schedule"], stored_blocks=tuple(case.get("stored", ())),
                        gathered_blocks=tuple(case.get("gathered", ())))
    executor = Executor.for_schedule(model, spec, None, RNGTracker())
    batch = synthetic_batch(cfg.vocab_size, micro_batch, cfg.seq_len, seed=0)
    checkpoints = CheckpointProbe(executor, spec)
    measured = ActivationProbe(executor, model).run(batch)
    checkpoints.remove()
    predicted = estimate_memory(cfg, case["attn"], case["mlp"], devices, micro_batch, spec, DTYPE_BYTES, sp)
    held_params = sum(p.numel() for p in model.parameters())
    return {
        "rank": ctx.rank,
        "measured_checkpoint_bytes": checkpoints.peak,
        "predicted_checkpoint_bytes": predicted.checkpoint_peak_bytes,
        "measured_activation_bytes": measured,
        "predicted_activation_bytes": predicted.activation_bytes,
        "measured_state_bytes": held_params * STATE_BYTES_PER_PARAM,
        "predicted_state_bytes": predicted.state_bytes,
    }


class CheckpointProbe:
    """Peak bytes of the checkpoints an executor holds: the live input buffers of its recomputed
    segments (what a recomputation restarts from), each storage once, sampled after every
    instruction.  Where :class:`ActivationProbe` measures everything, this isolates the term
    sequence parallelism divides by ``t`` (policy ``oases``) or not (``oases_gathered``)."""

    def __init__(self, executor: Executor, spec: ScheduleSpec) -> None:
        segments = schedule_segments(spec, executor.ops)
        self._starts = {seg.start for seg in segments if seg.recompute and seg.recompute_end > seg.start}
        self._executor = executor
        self.peak = 0
        self.remove = executor.add_hook(self._sample)

    def _sample(self, instruction, phase: str) -> None:
        if phase != "after":
            return
        live: dict[int, int] = {}
        for key, value in self._executor.buffers.items():
            if key[0] == "act" and key[1] in self._starts:
                for t in value:
                    if isinstance(t, torch.Tensor):
                        live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(live.values()))


def validate(cases: tuple[dict[str, Any], ...] = DEFAULT_CASES, micro_batch: int = 8,
             timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every case on its own ``devices`` gloo ranks; one row per case with the worst rank's error.

    ``peak_error`` compares ``states + activations`` predicted with measured, per rank
    (collectives in flight are left out of both: the probe cannot see them)."""
    rows = []
    for case in cases:
        ranks = launch(plan_memory_rank, case["devices"], (case, micro_batch, timeout_s), timeout_s=timeout_s,
                       threads_per_rank=1)
        worst = max(ranks, key=lambda r: abs(_peak_error(r)))
        rows.append({**case, "attn": list(case["attn"]), "mlp": list(case["mlp"]), "micro_batch": micro_batch,
                     "per_rank": ranks, "activation_error": _activation_error(worst), "peak_error": _peak_error(worst)})
    return rows


def _activation_error(rank: dict[str, Any]) -> float:
    return rank["predicted_activation_bytes"] / rank["measured_activation_bytes"] - 1


def _peak_error(rank: dict[str, Any]) -> float:
    predicted = rank["predicted_activation_bytes"] + rank["predicted_state_bytes"]
    measured = rank["measured_activation_bytes"] + rank["measured_state_bytes"]
    return predicted / measured - 1


def main(argv: list[str]) -> None:
    """``python -m oases_ds.bench.memory [OUT]``: run :data:`DEFAULT_CASES`, write the result file."""
    out = argv[0] if argv else DEFAULT_OUT
    rows = validate()
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "torch": torch.__version__,
        "note": "per-rank peak = model states + activations; predicted by oases_ds.planner.memory.estimate_memory, "
                "measured by ActivationProbe on real gloo ranks; error = predicted / measured - 1, worst rank",
        "cases": rows,
        "max_abs_peak_error": max(abs(r["peak_error"]) for r in rows),
        "max_abs_activation_error": max(abs(r["activation_error"]) for r in rows),
    }
    write_json_atomic(out, record, indent=2)
    for r in rows:
        print(f"{r['family']:6} T={r['devices']} attn={r['attn']} mlp={r['mlp']} {r['schedule']:9} "
              f"activations {r['activation_error']:+.1%} peak {r['peak_error']:+.1%}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
