"""What ``oases.check_batch`` costs a training step, measured inside real steps.

Two gloo ranks (TMP 2) train one engine.  The check (a hash of the step's batch on the
host, one 8-byte all-gather over the TMP group, a read-back) is timed on its own inside
every step where it runs, and whole steps (``train_batch``: schedule, DeepSpeed's
reduction and update) are timed with it on and off in rotated rounds
(:func:`~oases_ds.utils.rounds.rotated`), each step starting at a barrier.  The quoted
cost is the check's own median time over the median step: a difference of two step
medians cannot resolve 1% on a shared machine (the report gives that difference and its
split-half agreement too, to show it).

Used by ``benchmarks/batch_check.py``.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from oases_ds.utils.rounds import rotated

VARIANTS = ("on", "off")


def batch_check_worker(model: dict[str, Any], micro_batch: int, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """One rank: ``warmup`` steps, then ``rounds`` x ``steps`` steps per variant; returns the
    check's time per call and each variant's step times (seconds)."""
    import oases_ds

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "oases": {"enabled": True, "tensor_parallel_size": 2}}
    cfg = oases_ds.ModelConfig(**model)
    engine, *_ = oases_ds.initialize(model=cfg, config=config)
    gen = torch.Generator().manual_seed(engine.parallel_context.dp_rank)
    check, check_s = engine._check_tmp_batch, []

    def timed(micro_batches: list[dict[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        check(micro_batches)
        check_s.append(time.perf_counter() - start)

    engine._check_tmp_batch = timed

    def step() -> float:
        seq = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        engine.train_batch({"tokens": seq[:, :-1], "labels": seq[:, 1:]})
        return time.perf_counter() - start

    for _ in range(warmup):
        step()
    check_s.clear()
    step_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rnd in range(rounds):
        for variant in rotated(VARIANTS, rnd):
            engine.oases.check_batch = variant == "on"
            step_s[variant].extend(step() for _ in range(steps))
    dist.destroy_process_group()
    return {"check_s": check_s, "step_s": step_s}


def summarize(per_rank: list[dict[str, Any]], rounds: int, steps: int) -> dict[str, Any]:
    """Per step the slowest rank (what the step waits for); medians and ratios over them."""
    check = [max(ts) for ts in zip(*(r["check_s"] for r in per_rank))]
    step = {v: [max(ts) for ts in zip(*(r["step_s"][v] for r in per_rank))] for v in VARIANTS}
    per_round = {v: [statistics.median(step[v][i * steps:(i + 1) * steps]) for i in range(rounds)] for v in VARIANTS}
    ratios = [on / off for on, off in zip(per_round["on"], per_round["off"])]
    half = rounds // 2
    return {
        "check_ms": 1e3 * statistics.median(check),
        "check_ms_p90": 1e3 * statistics.quantiles(check, n=10)[-1] if len(check) > 1 else 1e3 * check[0],
        "step_ms": {v: 1e3 * statistics.median(step[v]) for v in VARIANTS},
        "check_share": statistics.median(check) / statistics.median(step["off"]),
        "on_off_ratio": statistics.median(ratios),
        "on_off_ratio_halves": [statistics.median(ratios[:half]), statistics.median(ratios[half:])] if half else [],
        "on_off_ratio_quartiles": [q for i, q in enumerate(statistics.quantiles(ratios, n=4)) if i != 1]
        if len(ratios) > 1 else [],
    }
