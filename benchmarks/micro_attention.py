"""Which attention route is fastest?

``attention_core`` (``oases_ds/parallel/layers.py``) uses
``scaled_dot_product_attention`` when there is no attention dropout, and a lean
materialised route when keyed dropout is on (SDPA cannot take an external mask).
This times both against the previous plain route (scores / sqrt(d), out-of-place
causal fill, softmax, dropout, matmul), causal, hidden 1024 = 16 heads x 64,
interleaved (``oases_ds/bench/micro.py``), forward and forward + backward:

* dropout 0: plain vs SDPA;
* dropout > 0: plain + keyed dropout vs lean + keyed dropout.

    python benchmarks/micro_attention.py               # writes results + the kernels report's table
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oases_ds.bench.micro import fmt_ratio, interleaved, ratio_summary, record, write_results  # noqa: E402
from oases_ds.parallel.layers import attention_core  # noqa: E402
from oases_ds.parallel.random import keyed_dropout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def plain_attention(q, k, v, dropout):
    """The route attention_core took before SDPA: the baseline every ratio is against."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[-2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (dropout(scores.softmax(dim=-1)) @ v).transpose(1, 2).flatten(2)


def measure(batch: int, heads: int, seq: int, head_dim: int, p: float, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, seq, heads * head_dim, generator=gen)
    full = (batch, heads, seq, seq)

    def drop(t: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(t, p, 5, (0, 0, 0, 0), full)

    if p == 0.0:
        routes = {"plain": lambda: plain_attention(q, k, v, lambda t: t), "sdpa": lambda: attention_core(q, k, v, True)}
    else:
        routes = {"plain": lambda: plain_attention(q, k, v, drop), "lean": lambda: attention_core(q, k, v, True, dropout=drop)}

    def fwd(fn):
        def run() -> None:
            with torch.no_grad():
                fn()
        return run

    def fwd_bwd(fn):
        def run() -> None:
            q.grad = k.grad = v.grad = None
            fn().backward(grad)
        return run

    return {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "p": p, "causal": True,
            "forward": ratio_summary(interleaved({n: fwd(f) for n, f in routes.items()}, rounds), "plain"),
            "forward_backward": ratio_summary(interleaved({n: fwd_bwd(f) for n, f in routes.items()}, rounds), "plain")}


def table(payload: dict) -> list[str]:
    lines = [f"`python benchmarks/micro_attention.py` ({payload['date'][:10]}, {payload['machine']['processor']}, "
             f"{payload['threads']} threads, load {payload['load_avg_1min']:.1f}, {payload['rounds']} interleaved rounds). "
             "Causal; ratio = route time / plain time in the same round: median (min-max).", "",
             "| b x heads x seq x d | dropout | route | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio |",
             "|---|---|---|---|---|---|---|"]
    for c in payload["cases"]:
        for route in c["forward"]:
            f, fb = c["forward"][route], c["forward_backward"][route]
            lines.append(f"| {c['batch']}x{c['heads']}x{c['seq']}x{c['head_dim']} | {c['p']} | {route} | {f['median_ms']:.1f} | "
                         f"{fmt_ratio(f)} | {fb['median_ms']:.1f} | {fmt_ratio(fb)} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--p", type=float, default=0.1, help="attention dropout of the dropout > 0 case")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "micro_attention.json"))
    ap.add_argument("--report", help="report whose table is replaced (default: benchmarks/reports/kernels-<today>.md)")
    args = ap.parse_args(argv)
    cases = []
    for p in (0.0, args.p):
        cases.append(measure(args.batch, 16, args.seq, 64, p, args.rounds))
        print("\n".join(table(record("micro_attention", args.rounds, cases))[-len(cases[-1]["forward"]):]), flush=True)
    payload = record("micro_attention", args.rounds, cases)
    report = write_results(args.out, payload, args.report, table(payload))
    print(f"wrote {args.out} and the table in {report}")


if __name__ == "__main__":
    main()
