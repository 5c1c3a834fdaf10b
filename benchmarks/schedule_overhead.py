"""Where ``oases`` spends compute beyond ``none``: schedules interleaved in one 2-rank run.

Two rank processes (TMP 2, gloo on loopback, no link emulation), one executor per
schedule on the same weights and batch, one step each round-robin; per step the
executor timeline gives compute per phase and per operator kind, the exposed wait
and the time outside instructions (``oases_ds/bench/overhead.py``).  Prints the
table and writes the JSON (``--out``).  Ratios are per step, slowest rank, against
the first schedule; the load average is printed with them.

    python benchmarks/schedule_overhead.py                         # the end-to-end study's dims, none vs oases
    python benchmarks/schedule_overhead.py --schedules none,oases,megatron --hidden 512
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.bench import overhead  # noqa: E402
from oases_ds.bench.e2e import FULL_MODEL  # noqa: E402
from oases_ds.bench.provenance import git_commit, machine  # noqa: E402
from oases_ds.launcher import launch  # noqa: E402
from oases_ds.utils.io import write_json_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="none,oases", help="comma-separated; the first is the ratio's base")
    parser.add_argument("--hidden", type=int, default=FULL_MODEL["hidden_size"])
    parser.add_argument("--ffn", type=int, default=None, help="default: issue dims' FFN scaled with --hidden")
    parser.add_argument("--heads", type=int, default=FULL_MODEL["num_heads"])
    parser.add_argument("--layers", type=int, default=FULL_MODEL["num_layers"])
    parser.add_argument("--seq", type=int, default=FULL_MODEL["seq_len"])
    parser.add_argument("--vocab", type=int, default=FULL_MODEL["vocab_size"])
    parser.add_argument("--dropout", type=float, default=FULL_MODEL["dropout"])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--out", default=None, help="result JSON (default: none written)")
    args = parser.parse_args(argv)
    ffn = args.ffn or FULL_MODEL["ffn_size"] * args.hidden // FULL_MODEL["hidden_size"]
    model = {**FULL_MODEL, "hidden_size": args.hidden, "ffn_size": ffn, "num_heads": args.heads,
             "num_layers": args.layers, "seq_len": args.seq, "vocab_size": args.vocab, "dropout": args.dropout}
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    spec = {"model": model, "schedules": schedules, "micro_batch": args.micro_batch, "tp": 2, "warmup": args.warmup,
            "repeats": args.repeats, "threads": args.threads, "timeout_s": args.timeout_s}
    load0 = os.getloadavg()[0]
    started = time.perf_counter()
    ranks = launch(overhead.overhead_rank, 2, (spec,), timeout_s=args.timeout_s, threads_per_rank=args.threads)
    summary = overhead.summarize(ranks, schedules[0])
    print(f"model {model}, micro-batch {args.micro_batch}, TMP 2, {args.threads} thread(s)/rank, "
          f"load average {load0:.1f} at start, {time.perf_counter() - started:.0f} s")
    print("\n".join(overhead.table(summary, schedules[0])))
    if args.out:
        write_json_atomic(args.out, {"spec": spec, "summary": summary, "ranks": ranks, "load_average_start": load0,
                                     "load_average_end": os.getloadavg()[0], "git_commit": git_commit(),
                                     "machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
