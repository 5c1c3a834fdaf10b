"""Model-state bytes per rank, measured on gloo ranks, against the planner's ``ModelStates``.

What is measured: every live tensor's storage bytes (each storage once) on a rank at the instant
the schedule has returned on the second optimizer step -- the step's gradients are whole in
``.grad`` (under ZeRO-2 too: DeepSpeed reduce-scatters them after the schedule), activations are
freed, and the optimizer's state exists (Adam creates it at the first step) -- less the bytes live
before the engine was built and the step's batch.  So it is weights + gradients + optimizer state
+ whatever buffers DeepSpeed holds then, which is what ``ModelStates.bytes_per_param`` prices.
The model: :func:`oases_ds.planner.memory.state_bytes` over the parameters this rank holds.

Setting (issue 41): LLaMA h1024, 4 layers (vocab 32000, seq 128), TMP 2 x DP 2 (4 ranks), Adam,
fp32 and bf16, ZeRO 0 / 1 / 2, one launch.  Offload is not measured: on a CPU host, "device" and
"host" memory are one, so the bytes it moves off the device cannot be told apart here.

    python benchmarks/model_states.py                # writes results/model_states.json + report
    python benchmarks/model_states.py --report-only  # the report from the stored JSON
"""
from __future__ import annotations

import gc
import os
import sys
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from oases_ds.bench.provenance import git_commit, machine, publish_study, study_arguments  # noqa: E402

RESULT = os.path.join(ROOT, "benchmarks", "results", "model_states.json")
MODEL = dict(family="llama", vocab_size=32000, hidden_size=1024, num_heads=16, num_layers=4, seq_len=128)
TMP, DP, MICRO = 2, 2, 2
CASES = tuple((precision, zero, True) for precision in ("fp32", "bf16") for zero in (0, 1, 2)) + (
    ("fp32", 0, False), ("fp32", 1, False))  # without the overlapped DP reduction: its in-flight flat copies apart
TOLERANCE = 0.05  # the bar: measured within 5% of the model


def live_bytes() -> int:
    """Bytes of every live tensor storage in this process, each storage once.

    Tensors are found as Python objects (``gc``), and each parameter's ``.grad`` besides: a
    gradient autograd wrote in C++ has no Python object until someone reads it, so ``gc`` alone
    misses the gradients of a step whose code never touched them (ZeRO-2's, here)."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add(obj)
            if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
                add(obj.grad)
    return total


def measure_case(precision: str, zero: int, dp_overlap: bool) -> dict:
    """One engine on this rank: two steps, the live bytes after the second step's schedule."""
    import oases_ds
    from oases_ds.data.batches import synthetic_batch
    from oases_ds.models.config import ModelConfig
    from oases_ds.planner.costs import ModelStates
    from oases_ds.planner.memory import state_bytes

    cfg = ModelConfig(**MODEL)
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": zero, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20},
          "bf16": {"enabled": precision == "bf16"},
          "oases": {"enabled": True, "tensor_parallel_size": TMP, "seed": 7, "check_batch": False,
                    "dp_overlap": dp_overlap}}
    gc.collect()
    before = live_bytes()
    engine, *_ = oases_ds.initialize(model=cfg, config=ds)
    ctx = engine.parallel_context
    seen: list[int] = []
    run = engine.executor.run

    def measured_run(*args, **kwargs):
        loss = run(*args, **kwargs)
        if engine.global_steps == 1:  # the second step: optimizer state exists
            gc.collect()
            seen.append(live_bytes())
        return loss

    engine.executor.run = measured_run
    batch_bytes = 0
    for step in range(2):
        batch = synthetic_batch(cfg.vocab_size, MICRO * DP, cfg.seq_len, seed=step)
        mine = {k: v[ctx.dp_rank * MICRO:(ctx.dp_rank + 1) * MICRO] for k, v in batch.items()}
        batch_bytes = sum(v.untyped_storage().nbytes() for v in batch.values())
        engine.train_batch(mine)
        del batch, mine
    held = sum(p.numel() for p in engine.module.parameters())
    states = ModelStates(precision, zero, False, ctx.dp_size)
    degrees = [TMP] * cfg.num_layers
    predicted = state_bytes(cfg, degrees, degrees, TMP, states.bytes_per_param())
    measured = seen[0] - before - batch_bytes
    out = {"precision": precision, "zero_stage": zero, "dp_overlap": engine.dp_reducer is not None, "rank": ctx.rank, "params_held": held,
           "measured_bytes": measured, "predicted_bytes": predicted, "model_params": predicted / states.bytes_per_param(),
           "bytes_per_param_model": states.bytes_per_param(), "bytes_per_param_measured": measured / held,
           "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__}
    engine.destroy()
    del engine
    gc.collect()
    return out


def measure_all(cases: tuple) -> list[dict]:
    return [measure_case(*case) for case in cases]


def run() -> dict:
    from oases_ds.launcher import launch

    per_rank = launch(measure_all, TMP * DP, (CASES,), timeout_s=1200)
    rows = [row for rank in per_rank for row in rank]
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "machine": machine(), "model": MODEL, "tmp": TMP, "dp": DP, "micro_batch": MICRO, "rows": rows}


def in_flight_model(data: dict, row: dict) -> float:
    """The memory model's bound on the overlapped DP reduction's flat copies for ``row``'s run
    (:func:`oases_ds.planner.memory.dp_in_flight_bytes`; 0 where that run did not overlap)."""
    from oases_ds.models.config import ModelConfig
    from oases_ds.planner.costs import ModelStates
    from oases_ds.planner.memory import dp_in_flight_bytes

    if not row["dp_overlap"]:
        return 0.0
    return dp_in_flight_bytes(ModelConfig(**data["model"]), data["tmp"],
                              ModelStates(row["precision"], row["zero_stage"], False, data["dp"]))


def report(data: dict) -> str:
    lines = [f"Measured {data['date']} at {data['git_commit']} ({TMP * DP} gloo ranks, TMP {data['tmp']} x DP {data['dp']}, "
             f"LLaMA h{data['model']['hidden_size']}, {data['model']['num_layers']} layers, vocab {data['model']['vocab_size']}; "
             "live tensor bytes after the second step's schedule, less those before the engine and the batch).  "
             "Model = `ModelStates` (states) + `dp_in_flight_bytes` (the overlapped DP reduction's flat copies, "
             "computed from this run's setting by the current code).", "",
             "| precision | ZeRO | overlapped DP reduction | rank | params held | measured B | model: states B | "
             "model: DP in flight B | measured / model | B/param measured | B/param model (states) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in data["rows"]:
        in_flight = in_flight_model(data, r)
        ratio = r["measured_bytes"] / (r["predicted_bytes"] + in_flight)
        worst = max(worst, abs(ratio - 1))
        lines.append(f"| {r['precision']} | {r['zero_stage']} | {'yes' if r['dp_overlap'] else 'no'} | {r['rank']} | "
                     f"{r['params_held']:,} | {r['measured_bytes']:,} | {r['predicted_bytes']:,.0f} | {in_flight:,.0f} | "
                     f"{ratio:.3f} | {r['bytes_per_param_measured']:.2f} | {r['bytes_per_param_model']:g} |")
    verdict = "within" if worst <= TOLERANCE else "NOT within"
    lines += ["", f"Worst |measured / model - 1| = {worst:.3f}: {verdict} the {TOLERANCE:.0%} bar."]
    return "\n".join(lines)


def main() -> None:
    args = study_arguments(__doc__).parse_args()
    publish_study("model_states", RESULT, run, report, "Model-state bytes per rank (issue 41)",
                  "Generated by `benchmarks/model_states.py` from `benchmarks/results/model_states.json`; "
                  "the reading below the table is hand-written.", report_only=args.report_only)


if __name__ == "__main__":
    main()
