"""Host time per executor instruction: is a step of small kernels host-bound?

On a GPU the executor's Python runs ahead of the device; if it spends tens of
microseconds per instruction, a step of small kernels (high TMP degrees, small
micro-batches) waits on the host, not on the GPU.  This times ``Executor.run`` on a
model so small that the kernels cost next to nothing (GPT, h 64, 8 layers, seq 16,
micro-batch 4, dropout 0: on CPU each op is a few microseconds of torch dispatch, on a
GPU the same host work queues the kernels), divided by the schedule's instruction
count, with the timeline on and off.

Variants are source trees: ``--variant before=/path/to/old/checkout`` times another
commit's executor beside this one's, each measurement in a fresh process with that
tree first on ``sys.path``, rounds interleaved with a rotated start (so the machine's
load falls on every variant alike).  Quoted: the median over rounds of each process's
median, and the per-round ratio of each variant to the first.

    python benchmarks/host_overhead.py                                   # this tree only
    git worktree add /tmp/old 4fcca3b && python benchmarks/host_overhead.py --variant before=/tmp/old \
        --rounds 9 --out benchmarks/results/host_overhead-cpu-<date>.json --report --readme benchmarks/README.md
    python benchmarks/host_overhead.py --report-only benchmarks/results/host_overhead-cpu-2026-12-03.json --report
    python benchmarks/host_overhead.py --device cuda --rounds 3          # on a GPU (tests/gpu/smoke.sh)

The worker uses only APIs every commit since the executor has (``OperatorModel``,
``Executor.for_schedule``, ``ScheduleSpec``), so an older tree can be measured as it was.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCHEDULES = ("oases", "megatron")
SHAPE = dict(family="gpt", vocab_size=64, hidden_size=64, num_heads=4, num_layers=8, seq_len=16, dropout=0.0)
MICRO_BATCH = 4


def worker(device: str, runs: int, schedules: list[str]) -> dict:
    """In a fresh process, with the variant's tree on ``sys.path``: median microseconds per
    instruction of ``runs`` timed runs (after 3 warm-up runs), per schedule and timeline setting."""
    import torch

    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.runtime.executor import Executor
    from oases_ds.schedule.generators import ScheduleSpec

    torch.manual_seed(0)
    dev = torch.device(device)
    model = OperatorModel(ModelConfig(**SHAPE), seed=1).to(dev)
    seq = torch.randint(0, SHAPE["vocab_size"], (MICRO_BATCH, SHAPE["seq_len"] + 1))
    batch = {"tokens": seq[:, :-1].to(dev), "labels": seq[:, 1:].to(dev)}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for name in schedules:
        for record in (True, False):
            ex = Executor.for_schedule(model, ScheduleSpec(name), record=record)
            n = len(ex.schedule.instructions)
            for _ in range(3):
                ex.run(batch)
            sync()
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                ex.run(batch)
                sync()
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            out[f"{name}/{'timeline' if record else 'no timeline'}"] = {
                "instructions": n, "us_per_instruction": statistics.median(times) / n * 1e6}
    return out


def measure_in_process(src: str, device: str, runs: int, schedules: list[str]) -> dict:
    """One worker run in a fresh process on the tree ``src``."""
    # src first, so its oases_ds wins; the rest kept (a site dir on PYTHONPATH holds the dependencies)
    path = os.pathsep.join(p for p in [src, os.environ.get("PYTHONPATH", "")] if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--device", device, "--runs", str(runs),
           "--schedules", *schedules]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=src)
    if done.returncode:
        raise RuntimeError(f"worker on {src} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(variants: dict[str, str], rounds: int, device: str, runs: int, schedules: list[str]) -> dict:
    """Every variant once per round, rotated start; per-round values and their summary."""
    names = list(variants)
    per_round: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            per_round[name].append(measure_in_process(variants[name], device, runs, schedules))
    base = names[0]
    commits = {}
    for name, src in variants.items():
        done = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
        commits[name] = done.stdout.strip() or None
    summary = {}
    for name in names:
        cases = {}
        for case in per_round[name][0]:
            values = [rnd[case]["us_per_instruction"] for rnd in per_round[name]]
            ratios = [v / b[case]["us_per_instruction"] for v, b in zip(values, per_round[base])]
            cases[case] = {"instructions": per_round[name][0][case]["instructions"], "us_median": statistics.median(values),
                           "us_min": min(values), "us_max": max(values), "ratio_median": statistics.median(ratios),
                           "ratio_min": min(ratios), "ratio_max": max(ratios)}
        summary[name] = cases
    return {"variants": variants, "commits": commits, "per_round": per_round, "summary": summary}


def table(payload: dict) -> list[str]:
    names = list(payload["variants"])
    base = names[0]
    lines = [f"`python benchmarks/host_overhead.py` ({payload['date'][:10]}, {payload['device']}, {payload['machine']}, "
             f"load {payload['load_avg_1min']:.1f}, {payload['rounds']} interleaved rounds of {payload['runs']} runs, "
             f"GPT h{SHAPE['hidden_size']} L{SHAPE['num_layers']} s{SHAPE['seq_len']} b{MICRO_BATCH}, dropout 0). "
             f"Host microseconds per instruction, median over rounds (min-max); ratio to `{base}` per round. "
             + ", ".join(f"`{n}`: commit {payload['commits'].get(n) or '?'}" for n in names) + ".", "",
             "| schedule / timeline | instructions | " + " | ".join(f"{n} us" for n in names) + " | " +
             " | ".join(f"{n} / {base}" for n in names[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(names) - 1)]
    for case, first in payload["summary"][base].items():
        cells = [f"{payload['summary'][n][case]['us_median']:.1f} ({payload['summary'][n][case]['us_min']:.1f}-"
                 f"{payload['summary'][n][case]['us_max']:.1f})" for n in names]
        ratios = [f"{payload['summary'][n][case]['ratio_median']:.2f} ({payload['summary'][n][case]['ratio_min']:.2f}-"
                  f"{payload['summary'][n][case]['ratio_max']:.2f})" for n in names[1:]]
        lines.append(f"| {case} | {first['instructions']} | " + " | ".join(cells + ratios) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SRC",
                    help="another source tree to time beside this one (first given is the ratios' base)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=15, help="timed runs per schedule in each worker process")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    ap.add_argument("--out", default=None, help="JSON result (default: print it)")
    ap.add_argument("--readme", default=None, help="Markdown file whose host_overhead section gets the table")
    ap.add_argument("--report", action="store_true", help="write the table into the dated report of the result's day")
    ap.add_argument("--report-only", metavar="JSON", help="no measurement: the table of a stored result")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.device, args.runs, args.schedules)))
        return
    sys.path.insert(0, ROOT)
    from oases_ds.bench.provenance import dated_report, git_commit, machine
    from oases_ds.utils.io import replace_marked_section, write_json_atomic

    if args.report_only:
        with open(args.report_only) as f:
            payload = json.load(f)
    else:
        variants = dict(v.split("=", 1) for v in args.variant)
        variants["this"] = ROOT
        payload = run(variants, args.rounds, args.device, args.runs, args.schedules)
        payload.update(benchmark="host_overhead", date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), git_commit=git_commit(), machine=machine().get("processor", ""), device=args.device,
            load_avg_1min=os.getloadavg()[0], rounds=args.rounds, runs=args.runs)
    lines = table(payload)
    print("\n".join(lines))
    if args.out:
        write_json_atomic(args.out, payload)
    marks = ("<!-- host_overhead:begin -->", "<!-- host_overhead:end -->")
    if args.readme:
        replace_marked_section(args.readme, *marks, "\n".join(lines))
    if args.report:
        replace_marked_section(dated_report("host_overhead", payload["date"]), *marks, "\n".join(lines))


if __name__ == "__main__":
    main()
