"""Is the overlap real?  Step time of megatron, split_overlap and oases side by side.

Two rank processes (TMP=2) on this machine, a GPT, and an *emulated* link whose
bandwidth is chosen so that one step's TMP communication takes about as long as
its computation (``--bandwidth-gbps auto``; the regime the paper targets).  The
schedules are run interleaved -- round-robin, one step each, repeated -- so
machine noise hits them alike; medians and ratios are reported, with the
exposed-communication fraction (time the compute lane sat blocked in a Sync)
from the executor's timeline.

    python benchmarks/overlap.py                      # auto link, default model
    python benchmarks/overlap.py --bandwidth-gbps 2   # a fixed emulated link

The result goes to a new dated ``runs/overlap-<date>-<time>.json`` (git-ignored) unless
``--out`` names a file; ``--out benchmarks/results/overlap.json`` replaces the committed one.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oases_ds.launcher import launch  # noqa: E402
from oases_ds.utils.io import write_json_atomic  # noqa: E402

SCHEDULES = ("megatron", "split_overlap", "oases")


def _worker(args: dict) -> dict:
    import torch

    from oases_ds.data.batches import synthetic_batch
    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.parallel.context import ParallelContext
    from oases_ds.parallel.link import LinkModel
    from oases_ds.parallel.random import RNGTracker
    from oases_ds.runtime.executor import Executor
    from oases_ds.schedule.generators import ScheduleSpec

    ctx = ParallelContext.build(tensor_parallel_size=2, timeout_s=300)
    cfg = ModelConfig(family="gpt", vocab_size=512, hidden_size=args["hidden"], num_heads=8,
                      num_layers=args["layers"], seq_len=args["seq"], dropout=0.1)
    batch = synthetic_batch(cfg.vocab_size, args["batch"], cfg.seq_len, seed=0)

    def executor(name: str, link: LinkModel | None) -> Executor:
        model = OperatorModel(cfg, group=ctx.tp_group, seed=0)
        return Executor.for_schedule(model, ScheduleSpec(name), link, RNGTracker())

    # Calibrate: compute time and TMP bytes of one Megatron step with no link model.
    probe = executor("megatron", None)
    for _ in range(2):
        probe.run(batch)
    compute_s = probe.timeline.busy("compute")
    tmp_bytes = sum(b for (phase, _), b in probe.comm.stats.bytes.items() if phase != "loss") / 2
    bw = args["bandwidth_gbps"]
    if bw == "auto":  # link time of one step == compute time of one step (ring AllReduce, 2 ranks)
        bw = tmp_bytes * 8 / compute_s / 1e9
    link = LinkModel(bandwidth_gbps=float(bw), latency_us=args["latency_us"], sharing=args["sharing"])
    runners = {name: executor(name, link) for name in SCHEDULES}
    times: dict[str, list[float]] = {n: [] for n in SCHEDULES}
    exposed: dict[str, list[float]] = {n: [] for n in SCHEDULES}
    util: dict[str, list[float]] = {n: [] for n in SCHEDULES}
    for rep in range(args["warmup"] + args["repeats"]):
        for name in SCHEDULES:
            torch.distributed.barrier(ctx.tp_group)
            t0 = time.perf_counter()
            runners[name].run(batch)
            dt = time.perf_counter() - t0
            if rep >= args["warmup"]:
                summary = runners[name].timeline.summary()
                times[name].append(dt)
                exposed[name].append(summary["exposed_comm_frac"])
                util[name].append(summary["compute_util"])
    if args.get("trace_dir") and ctx.rank == 0:
        for name in SCHEDULES:
            runners[name].timeline.save_chrome_trace(os.path.join(args["trace_dir"], f"trace_{name}.json"), ctx.rank)
    return {"bandwidth_gbps": float(bw), "compute_s_megatron_unlinked": compute_s, "times": times,
            "exposed": exposed, "util": util}


def default_out() -> str:
    """A new file per run, outside the committed results: a trial run never replaces them."""
    return os.path.join("runs", f"overlap-{datetime.datetime.now():%Y-%m-%d-%H%M%S}.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bandwidth-gbps", default="auto")
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--sharing", default="ring", choices=["ring", "fair", "fifo"],
                        help="how concurrent collectives share the emulated link: ring steps interleaved (as gloo "
                             "over TCP, validated by validate_link.py), equal shares, or queued (NCCL-like)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=default_out(),
                        help="result JSON (default: a new runs/overlap-<date>-<time>.json under the working directory)")
    parser.add_argument("--trace-dir", default="")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = vars(build_parser().parse_args(argv))
    rank0 = launch(_worker, 2, (args,), timeout_s=1200, threads_per_rank=1)[0]
    med = {n: statistics.median(rank0["times"][n]) for n in SCHEDULES}
    print(f"EMULATED link: {rank0['bandwidth_gbps']:.3f} Gbit/s, latency {args['latency_us']} us, sharing {args['sharing']} "
          f"(auto = comm time ~ compute time); GPT h={args['hidden']} L={args['layers']} s={args['seq']} b={args['batch']}, TMP=2")
    print(f"{'schedule':<15}{'median step s':>14}{'min':>8}{'max':>8}{'vs megatron':>13}{'exposed comm':>14}{'compute util':>14}")
    for n in SCHEDULES:
        t = rank0["times"][n]
        print(f"{n:<15}{med[n]:>14.4f}{min(t):>8.4f}{max(t):>8.4f}{med['megatron'] / med[n]:>12.2f}x"
              f"{statistics.median(rank0['exposed'][n]):>14.1%}{statistics.median(rank0['util'][n]):>14.1%}")
    write_json_atomic(args["out"], {"emulated_link": True, "machine": platform.platform(), "cpus": os.cpu_count(),
                                    "args": args, "rank0": rank0, "median_s": med})
    print(f"wrote {os.path.abspath(args['out'])}")


if __name__ == "__main__":
    main()
