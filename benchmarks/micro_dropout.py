"""Is keyed dropout as cheap as ``F.dropout``?

Keyed dropout draws its mask from a hash of each element's global index (so that
recompute, TMP degrees and sub-batches see the same mask, see
``oases_ds/parallel/random.py``); ``F.dropout`` draws from torch's generator.  This
times, interleaved (``oases_ds/bench/micro.py``), on activation shapes and
attention-probability shapes:

* ``F.dropout`` forward, ``keep_mask`` alone, ``keyed_dropout`` forward,
* ``F.dropout`` and ``keyed_dropout`` forward + backward,

and quotes per-round ratios to ``F.dropout`` (forward, or forward + backward).

    python benchmarks/micro_dropout.py                 # writes results + the kernels report's table
    python benchmarks/micro_dropout.py --rounds 3 --sizes 4,512,1024
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oases_ds.bench.micro import fmt_ratio, interleaved, ratio_summary, record, write_results  # noqa: E402
from oases_ds.parallel.random import keep_mask, keyed_dropout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = ((4, 512, 1024), (4, 512, 4096), (4, 16, 128, 128), (4, 16, 512, 512))
"""Activations (b, s, h) at h 1024 and 4096; attention probabilities (b, heads, s, s) at s 128 and 512."""


def measure(shape: tuple[int, ...], p: float, rounds: int) -> dict:
    x = torch.randn(shape)
    xg = x.clone().requires_grad_()
    grad = torch.randn(shape)
    zeros = (0,) * len(shape)

    def fwd_bwd(fn):
        def run() -> None:
            xg.grad = None
            fn(xg).backward(grad)
        return run

    fwd = {"F.dropout": lambda: F.dropout(x, p, True),
           "keep_mask": lambda: keep_mask(5, shape, zeros, shape, p, x.device),
           "keyed_dropout": lambda: keyed_dropout(x, p, 5, zeros, shape)}
    both = {"F.dropout fwd+bwd": fwd_bwd(lambda t: F.dropout(t, p, True)),
            "keyed_dropout fwd+bwd": fwd_bwd(lambda t: keyed_dropout(t, p, 5, zeros, shape))}
    return {"shape": list(shape), "p": p,
            "forward": ratio_summary(interleaved(fwd, rounds), "F.dropout"),
            "forward_backward": ratio_summary(interleaved(both, rounds), "F.dropout fwd+bwd")}


def table(payload: dict) -> list[str]:
    lines = [f"`python benchmarks/micro_dropout.py` ({payload['date'][:10]}, {payload['machine']['processor']}, "
             f"{payload['threads']} threads, load {payload['load_avg_1min']:.1f}, {payload['rounds']} interleaved rounds, "
             f"p={payload['cases'][0]['p']}). Ratio to `F.dropout`: median (min-max over rounds).", "",
             "| shape | F.dropout fwd ms | keep_mask | keyed_dropout fwd | F.dropout fwd+bwd ms | keyed_dropout fwd+bwd |",
             "|---|---|---|---|---|---|"]
    for c in payload["cases"]:
        f, fb = c["forward"], c["forward_backward"]
        lines.append(f"| {tuple(c['shape'])} | {f['F.dropout']['median_ms']:.1f} | {fmt_ratio(f['keep_mask'])} | "
                     f"{fmt_ratio(f['keyed_dropout'])} | {fb['F.dropout fwd+bwd']['median_ms']:.1f} | "
                     f"{fmt_ratio(fb['keyed_dropout fwd+bwd'])} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--sizes", nargs="*", help="shapes as comma lists, e.g. 4,512,1024 (default: the four in SIZES)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "micro_dropout.json"))
    ap.add_argument("--report", help="report whose table is replaced (default: benchmarks/reports/kernels-<today>.md)")
    args = ap.parse_args(argv)
    sizes = [tuple(int(n) for n in s.split(",")) for s in args.sizes] if args.sizes else SIZES
    cases = []
    for shape in sizes:
        cases.append(measure(shape, args.p, args.rounds))
        print(table(record("micro_dropout", args.rounds, cases))[-1], flush=True)
    payload = record("micro_dropout", args.rounds, cases)
    report = write_results(args.out, payload, args.report, table(payload))
    print(f"wrote {args.out} and the table in {report}")


if __name__ == "__main__":
    main()
