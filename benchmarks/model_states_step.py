"""Step time of ZeRO-2 and optimizer offload against ZeRO-1, interleaved on gloo ranks.

What is measured: the wall time of ``engine.train_batch`` (schedule, DP reduction, clipping and
the optimizer's step) on rank 0, for four engines built side by side in one launch and stepped in
rotation, round after round, so each sees the same host load: ZeRO-1 (the engine's overlapped DP
reduction hands DeepSpeed the reduced partition), ZeRO-2 (DeepSpeed's reducer after the schedule:
reduce-scatter, not overlapped), and each with ``offload_optimizer.device: cpu`` (DeepSpeed's CPU
Adam; without offload torch's AdamW).  Reported: the median step of each and its ratio to ZeRO-1,
with the two halves of the rounds apart, so the ratio's repeatability is on the page.

Setting (issue 41): LLaMA h1024, 4 layers, vocab 8000, seq 256, micro-batch 2, fp32, TMP 2 x DP 2
(4 ranks), AdamW.  On a CPU host, device and host memory are one: offload here costs the CPU Adam
step and its copies between the fp32 partition and the weights, not a PCIe transfer; on a GPU
server the transfers come on top, and the device's optimizer step goes away.

    python benchmarks/model_states_step.py                # writes results/model_states_step.json + report
    python benchmarks/model_states_step.py --report-only  # the report from the stored JSON
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from oases_ds.bench.provenance import git_commit, machine, study_main  # noqa: E402

MODEL = dict(family="llama", vocab_size=8000, hidden_size=1024, num_heads=16, num_layers=4, seq_len=256, dropout=0.0)
TMP, DP, MICRO = 2, 2, 2
CASES = (("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-1 + offload", 1, True), ("ZeRO-2 + offload", 2, True))
ROUNDS, WARMUP = 8, 1


def measure(rounds: int) -> dict:
    """On each rank: build every case's engine, then step them in rotation; rank 0's times."""
    import torch

    import oases_ds
    from oases_ds.data.batches import synthetic_batch
    from oases_ds.models.config import ModelConfig

    cfg = ModelConfig(**MODEL)
    engines = {}
    for label, zero, offload in CASES:
        ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": zero, **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
              "oases": {"enabled": True, "tensor_parallel_size": TMP, "seed": 7, "check_batch": False}}
        engines[label], *_ = oases_ds.initialize(model=cfg, config=ds)
    ctx = next(iter(engines.values())).parallel_context
    times: dict[str, list[float]] = {label: [] for label in engines}
    optimizers = {label: type(getattr(e.optimizer, "optimizer", e.optimizer)).__name__ for label, e in engines.items()}
    for step in range(WARMUP + rounds):
        batch = synthetic_batch(cfg.vocab_size, MICRO * DP, cfg.seq_len, seed=step)
        mine = {k: v[ctx.dp_rank * MICRO:(ctx.dp_rank + 1) * MICRO] for k, v in batch.items()}
        order = list(engines) if step % 2 == 0 else list(reversed(engines))  # no case always first after the batch
        for label in order:
            torch.distributed.barrier()
            start = time.perf_counter()
            engines[label].train_batch(mine)
            if step >= WARMUP:
                times[label].append(time.perf_counter() - start)
    return {"rank": ctx.rank, "times_s": times, "optimizers": optimizers}


def run() -> dict:
    from oases_ds.launcher import launch

    per_rank = launch(measure, TMP * DP, (ROUNDS,), timeout_s=1800)
    mine = per_rank[0]
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "machine": machine(), "model": MODEL, "tmp": TMP, "dp": DP, "micro_batch": MICRO, "rounds": ROUNDS,
            "warmup": WARMUP, "times_s": mine["times_s"], "optimizers": mine["optimizers"]}


def table(data: dict) -> str:
    times = data["times_s"]
    base = "ZeRO-1"
    half = len(times[base]) // 2

    def ratio(label: str, part: slice) -> float:
        return statistics.median(times[label][part]) / statistics.median(times[base][part])

    lines = [f"Measured {data['date']} at {data['git_commit']} on {data['machine']['processor']} "
             f"({data['machine']['cpu_count']} CPUs): {TMP * DP} gloo ranks, TMP {data['tmp']} x DP {data['dp']}, "
             f"LLaMA h{data['model']['hidden_size']}, {data['model']['num_layers']} layers, seq {data['model']['seq_len']}, "
             f"micro-batch {data['micro_batch']}, fp32; {data['rounds']} rounds after {data['warmup']} warm-up, "
             "engines in rotation (order reversed every other round); rank 0's `train_batch` wall time.", "",
             "| case | optimizer | median step (s) | vs. ZeRO-1 | first half of the rounds | second half |",
             "|---|---|---|---|---|---|"]
    for label in times:
        lines.append(f"| {label} | {data['optimizers'][label]} | {statistics.median(times[label]):.3f} "
                     f"| {ratio(label, slice(None)):.3f}x | {ratio(label, slice(0, half)):.3f}x "
                     f"| {ratio(label, slice(half, None)):.3f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    study_main("model_states_step", __doc__, run, table, "ZeRO-2 and optimizer offload: step time (issue 41)", slice(1, 3))
