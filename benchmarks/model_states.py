"""Model-state bytes per rank, measured on gloo ranks, against the planner's ``ModelStates``.

What is measured: every live tensor's storage bytes (each storage once) on a rank at the instant
the schedule has returned on the second optimizer step -- the step's gradients are whole in
``.grad`` (under ZeRO-2 too: DeepSpeed reduce-scatters them after the schedule), activations are
freed, and the optimizer's state exists (Adam creates it at the first step) -- less the bytes live
before the engine was built and the step's batch.  So it is weights + gradients + optimizer state
+ whatever buffers DeepSpeed holds then, which is what ``ModelStates.bytes_per_param`` prices.
The model: :func:`oases_ds.planner.memory.state_bytes` over the parameters this rank holds.

Setting (issue 41): LLaMA h1024, 4 layers (vocab 32000, seq 128), TMP 2 x DP 2 (4 ranks), Adam,
fp32 and bf16, ZeRO 0 / 1 / 2, and fp32 ZeRO 1 / 2 with ``offload_optimizer.device: cpu``, one
launch.  On a CPU host "device" and "host" are one memory, so for offload the host side is told
apart by the tensors DeepSpeed's offloading optimizer keeps there (:func:`host_bytes`: its fp32
partitions and their gradients, the Adam states, its CPU gradient accumulators); the rest is what
a GPU would hold.

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
    ("fp32", 0, False), ("fp32", 1, False),  # without the overlapped DP reduction: its in-flight flat copies apart
    ("fp32", 1, True, True), ("fp32", 2, True, True))  # optimizer offload (DeepSpeed's CPU Adam)
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


def host_bytes(engine) -> int:
    """Bytes of the tensors DeepSpeed's ZeRO optimizer keeps on the host under
    ``offload_optimizer`` (its fp32 partitions and their gradients, the inner optimizer's
    state, its CPU gradient accumulators, its host staging buffers for the updated weights and
    for gradients), each storage once; 0 without offload.  Its *device* staging buffer
    (``temp_grad_buffer_for_gpu_offload``) stays on the device side, as the model prices it."""
    import torch

    opt = engine.optimizer
    if not getattr(opt, "cpu_offload", False):
        return 0
    tensors = [t for part in opt.single_partition_of_fp32_groups for t in (part, part.grad) if t is not None]
    tensors += list(opt.param_buffer_of_bit16_for_cpu_offload_groups)  # the updated partition, staged back on the host
    tensors += [opt.temp_grad_buffer_for_cpu_offload]
    tensors += [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    tensors += [t for t in getattr(opt, "accumulated_grads_in_cpu", {}).values() if torch.is_tensor(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure_case(precision: str, zero: int, dp_overlap: bool, offload: bool = False) -> dict:
    """One engine on this rank: two steps, the live bytes after the second step's schedule
    (with ``offload``: less those DeepSpeed keeps on the host, :func:`host_bytes`)."""
    import oases_ds
    from oases_ds.data.batches import synthetic_batch
    from oases_ds.models.config import ModelConfig
    from oases_ds.planner.costs import ModelStates
    from oases_ds.planner.memory import state_bytes

    cfg = ModelConfig(**MODEL)
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": zero, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20,
                                **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
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
            seen.append(live_bytes() - host_bytes(engine))
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
    states = ModelStates(precision, zero, offload, ctx.dp_size)
    degrees = [TMP] * cfg.num_layers
    predicted = state_bytes(cfg, degrees, degrees, TMP, states.bytes_per_param())
    measured = seen[0] - before - batch_bytes
    out = {"precision": precision, "zero_stage": zero, "offload": offload, "dp_overlap": engine.dp_reducer is not None,
           "rank": ctx.rank, "params_held": held,
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
    """The memory model's buffers beside the states for ``row``'s run: the overlapped DP
    reduction's flat copies (:func:`oases_ds.planner.memory.dp_in_flight_bytes`; 0 where that
    run did not overlap) and offload's device staging buffer (``offload_staging_bytes``)."""
    from oases_ds.models.config import ModelConfig
    from oases_ds.planner.costs import ModelStates
    from oases_ds.planner.memory import dp_in_flight_bytes, offload_staging_bytes

    cfg = ModelConfig(**data["model"])
    states = ModelStates(row["precision"], row["zero_stage"], row.get("offload", False), data["dp"])
    in_flight = dp_in_flight_bytes(cfg, data["tmp"], states) if row["dp_overlap"] else 0.0
    return in_flight + offload_staging_bytes(cfg, data["tmp"], states)


def report(data: dict) -> str:
    lines = [f"Measured {data['date']} at {data['git_commit']} ({TMP * DP} gloo ranks, TMP {data['tmp']} x DP {data['dp']}, "
             f"LLaMA h{data['model']['hidden_size']}, {data['model']['num_layers']} layers, vocab {data['model']['vocab_size']}; "
             "live tensor bytes after the second step's schedule, less those before the engine and the batch, and "
             "with offload those DeepSpeed keeps on the host).  "
             "Model = `ModelStates` (states) + `dp_in_flight_bytes` (the overlapped DP reduction's flat copies) + "
             "`offload_staging_bytes` (offload's device staging buffer), computed from this run's setting by the "
             "current code.", "",
             "| precision | ZeRO | overlapped DP reduction | rank | params held | measured B | model: states B | "
             "model: DP in flight / offload staging B | measured / model | B/param measured | B/param model (states) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in data["rows"]:
        in_flight = in_flight_model(data, r)
        ratio = r["measured_bytes"] / (r["predicted_bytes"] + in_flight)
        worst = max(worst, abs(ratio - 1))
        zero = f"{r['zero_stage']}{' + offload' if r.get('offload') else ''}"
        lines.append(f"| {r['precision']} | {zero} | {'yes' if r['dp_overlap'] else 'no'} | {r['rank']} | "
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
