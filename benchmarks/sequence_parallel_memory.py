"""Sequence parallelism: per-rank activation and checkpoint bytes, measured on ranks and predicted.

Not a test: ``python benchmarks/sequence_parallel_memory.py`` (``--report-only`` rewrites the
report's table from the result file without measuring).

What (issue 40): LLaMA h1024, 16 heads, 4 layers, seq 512, micro-batch 4, vocabulary 32000,
fp32, no dropout (LLaMA's setting), TMP 2 and 4 on real gloo ranks, one step of the Oases
schedule per case, with and without ``sequence_parallel``, under three per-block policies
for every block: ``oases`` (fine-grained recomputation; under sequence parallelism the
checkpoint is the 1/t slice and the recomputation re-gathers it), ``oases_gathered``
(the gathered input is kept as well) and ``store`` (nothing recomputed).

How: :func:`oases_ds.bench.memory.plan_memory_rank` -- :class:`~oases_ds.bench.measure.ActivationProbe`
(every storage the executor's buffers and autograd hold, after every instruction; parameters
excluded) for the peak, :class:`~oases_ds.bench.memory.CheckpointProbe` for the checkpoints
(the recomputed segments' inputs), beside :func:`~oases_ds.planner.memory.estimate_memory`'s
prediction of both.  Bytes, worst rank.  Writes ``benchmarks/results/sequence_parallel_memory.json``
and the table of ``benchmarks/reports/sequence_parallel_memory-<date>.md``; every number there
is read from the result file.
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from oases_ds.bench.memory import plan_memory_rank  # noqa: E402
from oases_ds.bench.provenance import git_commit, machine, publish_study, study_arguments  # noqa: E402
from oases_ds.launcher import launch  # noqa: E402
from oases_ds.models.config import ModelConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "sequence_parallel_memory.json"
LAYERS, MICRO_BATCH = 4, 4
POLICIES = ("oases", "oases_gathered", "store")


def model() -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=32000, hidden_size=1024, num_heads=16, num_layers=LAYERS,
                       seq_len=512, dropout=0.0)


def case(tp: int, policy: str, sp: bool) -> dict:
    every = list(range(2 * LAYERS))
    return {"family": "llama", "devices": tp, "attn": [tp] * LAYERS, "mlp": [tp] * LAYERS, "schedule": "oases",
            "policy": policy, "sequence_parallel": sp, "stored": every if policy == "store" else [],
            "gathered": every if policy == "oases_gathered" else []}


def measure(degrees: list[int]) -> dict:
    rows = []
    for tp in degrees:
        for policy in POLICIES:
            for sp in (False, True):
                c = case(tp, policy, sp)
                ranks = launch(plan_memory_rank, tp, (c, MICRO_BATCH, 600.0, model()), timeout_s=900, threads_per_rank=1)
                worst = max(ranks, key=lambda r: r["measured_activation_bytes"])
                rows.append({**c, "per_rank": ranks, **{k: worst[k] for k in worst if k != "rank"}})
                print(f"TMP {tp} {policy:15s} sp={int(sp)}: activations {worst['measured_activation_bytes'] / 2**20:7.1f} MiB "
                      f"(predicted {worst['predicted_activation_bytes'] / 2**20:7.1f}), checkpoints "
                      f"{worst['measured_checkpoint_bytes'] / 2**20:6.1f} MiB (predicted "
                      f"{worst['predicted_checkpoint_bytes'] / 2**20:6.1f})", flush=True)
    cfg = model()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "machine": machine(), "torch": torch.__version__,
            "config": {"family": cfg.family, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                       "num_layers": LAYERS, "seq_len": cfg.seq_len, "micro_batch": MICRO_BATCH,
                       "vocab_size": cfg.vocab_size, "dtype": "fp32", "dropout": 0.0, "schedule": "oases",
                       "sub_batches": 2},
            "rows": rows}


def table(result: dict) -> str:
    mib = 2**20
    lines = ["| TMP | policy | sequence parallel | peak activations, measured (bytes) | predicted | error "
             "| checkpoints, measured (bytes) | predicted | checkpoints vs. without SP |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["devices"], r["policy"], r["sequence_parallel"]): r for r in result["rows"]}
    for (tp, policy, sp), r in by_key.items():
        measured, predicted = r["measured_activation_bytes"], r["predicted_activation_bytes"]
        base = by_key.get((tp, policy, False))
        ratio = (f"{r['measured_checkpoint_bytes'] / base['measured_checkpoint_bytes']:.3f}"
                 if sp and base and base["measured_checkpoint_bytes"] else "")
        lines.append(f"| {tp} | {policy} | {'on' if sp else 'off'} | {measured:,} ({measured / mib:.1f} MiB) "
                     f"| {predicted:,.0f} | {predicted / measured - 1:+.1%} | {r['measured_checkpoint_bytes']:,} "
                     f"| {r['predicted_checkpoint_bytes']:,.0f} | {ratio} |")
    worst = max(abs(r["predicted_activation_bytes"] / r["measured_activation_bytes"] - 1) for r in result["rows"])
    lines.append("")
    lines.append(f"Largest prediction error of the peak: {worst:.1%} (bound of the issue: 10%).")
    return "\n".join(lines)


def main() -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    publish_study("sequence_parallel_memory", str(RESULTS), lambda: measure(args.degrees), table,
                  "Sequence parallelism: activation memory per rank", "\n\n".join(__doc__.split("\n\n")[2:4]),
                  report_only=args.report_only)


if __name__ == "__main__":
    main()
