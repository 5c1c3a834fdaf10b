"""Checkpoint bytes per layer and peak activation bytes, per schedule, measured.

Not a test: run ``python benchmarks/checkpoint_memory.py`` (``--report-only``
regenerates the report's table from the result file without measuring).

Why measured this way: :class:`~oases_ds.bench.measure.ActivationProbe` counts,
after every instruction, the storages of the executor's live buffers plus every
tensor autograd saved (parameters excluded), so a schedule is charged for what
it really keeps, not for what a formula says.  A step's peak is
``layers x per_layer + constant`` (embedding, head, one segment's transient
working set), so what one layer holds between forward and backward -- its
checkpoints -- is the difference of the peaks of an ``L``- and an ``L/2``-layer
model, divided by ``L/2``.  Units: one ``[b, s, h]`` tensor of the micro-batch.
One process, TMP 1 (nothing sharded), fp32, dropout on.

Writes ``benchmarks/results/checkpoint_memory.json`` (atomically) and the table
between the ``checkpoint_memory`` markers of the dated report
``benchmarks/reports/checkpoint_memory-<date measured>.md``; every number of the table
is read from the result file.
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json  # noqa: E402

import torch  # noqa: E402

from oases_ds.bench.measure import ActivationProbe  # noqa: E402
from oases_ds.bench.provenance import dated_report, git_commit, machine  # noqa: E402
from oases_ds.models.config import ModelConfig  # noqa: E402
from oases_ds.models.operator_model import OperatorModel  # noqa: E402
from oases_ds.parallel.random import RNGTracker  # noqa: E402
from oases_ds.runtime.executor import Executor  # noqa: E402
from oases_ds.schedule.generators import ScheduleSpec  # noqa: E402
from oases_ds.utils.io import replace_marked_section, write_json_atomic  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "checkpoint_memory.json"
BEGIN, END = "<!-- checkpoint_memory:begin -->", "<!-- checkpoint_memory:end -->"
SCHEDULES = ("megatron", "megatron_selective", "split_overlap", "oases")


def peak_bytes(cfg: ModelConfig, schedule: str, micro_batch: int) -> int:
    """Peak activation bytes of one training step of ``schedule`` (the second step: the first warms caches)."""
    model = OperatorModel(cfg, seed=0)
    executor = Executor.for_schedule(model, ScheduleSpec(schedule), rng=RNGTracker(seed=1), record=False)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    return ActivationProbe(executor, model).run({"tokens": tokens, "labels": tokens})


def measure(args: argparse.Namespace) -> dict:
    unit = args.micro_batch * args.seq_len * args.hidden * 4  # one fp32 [b, s, h] tensor
    half = args.layers // 2
    out: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine(),
        "config": {"family": args.family, "hidden_size": args.hidden, "num_heads": args.heads,
                   "num_layers": args.layers, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                   "vocab_size": args.vocab, "dtype": "fp32", "tensor_parallel_size": 1, "dropout": 0.1,
                   "sub_batches": ScheduleSpec().sub_batches},
        "unit_bytes": unit,
        "method": f"checkpoint/layer = (peak({args.layers} layers) - peak({half} layers)) / {args.layers - half} / unit",
        "schedules": {},
    }
    for name in SCHEDULES:
        peaks = {}
        for layers in (args.layers, half):
            cfg = ModelConfig(family=args.family, vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads,
                              num_layers=layers, seq_len=args.seq_len, dropout=0.1)
            t0 = time.perf_counter()
            peaks[layers] = peak_bytes(cfg, name, args.micro_batch)
            print(f"{name:20s} {layers} layers: peak {peaks[layers] / 2**20:8.1f} MiB ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        out["schedules"][name] = {
            "peak_bytes": {str(k): v for k, v in peaks.items()},
            "checkpoint_per_layer_bsh": (peaks[args.layers] - peaks[half]) / (args.layers - half) / unit,
            "peak_bsh": peaks[args.layers] / unit,
        }
    return out


def table(result: dict) -> str:
    """The README table: every number from ``result``."""
    cfg, runs = result["config"], result["schedules"]
    mega = runs["megatron"]
    lines = [
        f"GPT h{cfg['hidden_size']}, {cfg['num_layers']} layers, {cfg['num_heads']} heads, seq {cfg['seq_len']}, "
        f"micro-batch {cfg['micro_batch']}, vocab {cfg['vocab_size']}, {cfg['dtype']}, TMP {cfg['tensor_parallel_size']}, "
        f"{cfg['sub_batches']} sub-batches for split_overlap/oases; one [b,s,h] tensor = "
        f"{result['unit_bytes'] / 2**20:.0f} MiB. Measured {result['date']} at commit {result['git_commit'][:10]} "
        f"(`results/checkpoint_memory.json`).",
        "",
        "| schedule | checkpoints per layer (b·s·h) | / Megatron | peak activations (b·s·h) | peak MiB | / Megatron |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        peak = run["peak_bytes"][str(cfg["num_layers"])]
        lines.append(
            f"| {name} | {run['checkpoint_per_layer_bsh']:.2f} | "
            f"{run['checkpoint_per_layer_bsh'] / mega['checkpoint_per_layer_bsh']:.2f} | {run['peak_bsh']:.2f} | "
            f"{peak / 2**20:.1f} | {run['peak_bsh'] / mega['peak_bsh']:.2f} |"
        )
    return "\n".join(lines)


def update_report(result: dict, report: Path | None = None) -> Path:
    """Replace the table in ``report`` (default: the dated report of ``result``'s day)."""
    report = report or Path(dated_report("checkpoint_memory", result["date"]))
    replace_marked_section(report, BEGIN, END, table(result))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gpt", choices=("gpt", "bert", "llama"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report", type=Path, help="report whose table is replaced (default: the result's dated report)")
    parser.add_argument("--report-only", action="store_true", help="regenerate the report's table from --out")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error(f"--layers={args.layers}: need >= 2 (the per-layer bytes are a difference of two depths)")
    if args.report_only:
        result = json.loads(args.out.read_text())
    else:
        result = measure(args)
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")
    print(table(result))
    print(f"wrote the table in {update_report(result, args.report)}")


if __name__ == "__main__":
    main()
