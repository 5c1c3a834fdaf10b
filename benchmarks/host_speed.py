"""How fast is this host?  The compute-only training step of one fixed model, so that test-suite
and CI times from different hosts can be compared.

Why: the hosts that run CI differ by up to about 3x in speed, and a suite time alone cannot
say whether the suite grew or the host was slow.  ``.ci/run`` runs this before the tests and
prints the line; a later run divides its own pytest time by its own step time to compare.

The step: LLaMA h1024, 2 layers, 16 heads, FFN 2816, seq 512, micro-batch 2, fp32, dropout
0, one process at TMP 1 (no communication), schedule ``none`` (forward and backward,
nothing recomputed), one CPU thread (each test rank runs on one), 2 warm-up steps, then
the median of ``--steps`` timed steps.  About 10-20 s on a 2-core CPU host.

    python benchmarks/host_speed.py                 # one line
    python benchmarks/host_speed.py --json out.json # and the numbers as JSON
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

SHAPE = dict(family="llama", vocab_size=1024, hidden_size=1024, num_heads=16, num_layers=2, ffn_size=2816,
             seq_len=512, dropout=0.0)
MICRO_BATCH = 2


def measure(steps: int, threads: int = 1) -> dict:
    """Median, min and max seconds of ``steps`` compute-only steps of :data:`SHAPE`."""
    import torch

    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.runtime.executor import Executor
    from oases_ds.schedule.generators import ScheduleSpec

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = OperatorModel(ModelConfig(**SHAPE), seed=1)
    seq = torch.randint(0, SHAPE["vocab_size"], (MICRO_BATCH, SHAPE["seq_len"] + 1))
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:]}
    executor = Executor.for_schedule(model, ScheduleSpec("none"), record=False)
    for _ in range(2):
        executor.run(batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        executor.run(batch)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
            "steps": steps, "threads": threads}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median quoted)")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    found = measure(args.steps)
    shape = (f"LLaMA h{SHAPE['hidden_size']} L{SHAPE['num_layers']} seq {SHAPE['seq_len']} mb {MICRO_BATCH} fp32, "
             f"TMP 1, schedule none, {found['threads']} thread")
    print(f"host speed: compute-only step of {shape}: median {found['step_s_median'] * 1e3:.0f} ms "
          f"(min {found['step_s_min'] * 1e3:.0f}, max {found['step_s_max'] * 1e3:.0f}, {args.steps} steps); "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    if args.json:
        from oases_ds.utils.io import write_json_atomic

        write_json_atomic(args.json, {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                      "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                      "load_avg_1min": os.getloadavg()[0], "shape": SHAPE, "micro_batch": MICRO_BATCH,
                                      **found}, indent=1)


if __name__ == "__main__":
    main()
