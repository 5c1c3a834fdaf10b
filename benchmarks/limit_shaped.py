"""Issue 43 on a real link: the step against its limit on a ``tc tbf``-shaped veth pair, beside DeepSpeed AutoTP.

Not a test: ``python benchmarks/limit_shaped.py`` (root: network namespaces; ``--report-only``
rewrites the report's table from the result file; ``--quick`` runs tiny dims to check the path).

What: LLaMA h1024, 16 heads, 4 layers, seq 256, micro-batch 4, fp32, no dropout, rotary halves (as Hugging
Face's, which AutoTP trains), TMP 2, 4 micro-batches per step, two ranks each in its own network namespace, gloo over a veth pair (``oases_ds/bench/netns.py``,
as ``e2e_shaped.py``).  Variants: the Oases executor with every block recomputed (``oases``) and stored
(``store``), each with the micro-batches one after the other and overlapped (``-overlap``,
``overlap_micro_batches``), interleaved step by step in one rank pair; DeepSpeed AutoTP
(``tp_overlap_comm`` on) with Hugging Face's checkpointing (``autotp``) and without
(``autotp-no-ckpt``), the same 4 micro-batches per step, in their own pairs.  First every pair runs
unshaped (the veth at its own speed: the compute-only step, and the executor's TMP wire bytes), then
the link is shaped to the rate at which the ``oases`` step's traffic takes 0.9x its compute (the
issue's 85 Mbit/s case, on this machine: payload rate ``wire bytes / (0.9 x compute)``, the tbf rate
that payload rate over the frame overhead), and every pair runs again, pairs in rotated order.

Reported: each variant's step shaped and unshaped (medians of the slower rank's), and for the executor
its limit max(compute, link time of its traffic at the payload rate) and the ratio between them
(target <= 1.10x).  The link time uses the nominal payload rate; tbf delivered 0.956x nominal when this
machine's links were validated (``validate_link.py``), so the limits are up to ~4% low.  Every number
in the report is read from the result file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from exposed_phases import MODEL, rows_of  # noqa: E402
from micro_batch_overlap import MICRO_STEPS, VARIANTS  # noqa: E402
from sequence_parallel_step import MICRO_BATCH, QUICK, spec_of  # noqa: E402

from oases_ds.bench.provenance import git_commit, machine, publish_study, result_path, stored_or_measured  # noqa: E402
from oases_ds.utils.rounds import rotated  # noqa: E402

RATIO = 0.9
AUTOTP = (("autotp", True), ("autotp-no-ckpt", False))  # label, Hugging Face checkpointing
WORKER = os.path.join(ROOT, "benchmarks", "e2e_shaped.py")  # its --rank-worker runs either kind of spec
TARGET = 1.10


def shaped_rate_mbit(wire_bytes: float, compute_s: float, ratio: float, mtu: int) -> tuple[float, float]:
    """(payload Gbit/s at which ``wire_bytes`` take ``ratio x compute_s``, the tbf rate in Mbit/s that
    delivers it over ``mtu``-byte frames)."""
    from oases_ds.bench.netns import payload_fraction

    payload_gbps = wire_bytes * 8 / (ratio * compute_s) / 1e9
    return payload_gbps, payload_gbps * 1000 / payload_fraction(mtu)


def _autotp_spec(model: dict, label: str, checkpointing: bool, repeats: int, warmup: int, timeout_s: int) -> dict:
    return {"kind": "autotp", "label": label, "model": model, "micro_batch": MICRO_BATCH, "micro_steps": MICRO_STEPS,
            "checkpointing": checkpointing, "tp_overlap_comm": True, "warmup": warmup, "repeats": repeats,
            "seed": 0, "timeout_s": timeout_s}


def run(model: dict, repeats: int, warmup: int, mtu: int, burst: int, timeout_s: int) -> dict:
    from oases_ds.bench.netns import VethPair, run_ranks

    model = {**model, "rotary": "half"}  # Hugging Face LLaMA's rotation, so AutoTP trains the very same model
    executor = spec_of(model, None, repeats, warmup, VARIANTS, MICRO_STEPS)
    executor["timeout_s"] = timeout_s
    pairs = {"executor": executor, **{label: _autotp_spec(model, label, ckpt, repeats, warmup, timeout_s)
                                      for label, ckpt in AUTOTP}}
    out: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
                 "machine": machine(), "model": model, "tensor_parallel_size": 2, "micro_batch": MICRO_BATCH,
                 "micro_batches_per_step": MICRO_STEPS, "repeats": repeats, "warmup": warmup, "mtu": mtu,
                 "ratio": RATIO, "runs": {}}

    def measured(pair: VethPair, name: str, rnd: int) -> dict:
        order = rotated(list(pairs), rnd)
        rows: dict = {}
        for group in order:
            ranks = run_ranks(pair, WORKER, pairs[group], timeout_s + 60, ROOT)
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:  # AutoTP that does not run here: its exact error, its cells left out
                rows[group] = {"error": errors[0]}
                print(f"{name}: {group} failed: {errors[0]}", flush=True)
                continue
            if group == "executor":
                rows.update(rows_of(ranks, VARIANTS))
            else:
                rows[group] = {"step_s": [max(ts) for ts in zip(*(r["variants"][group]["step_s"] for r in ranks))]}
            print(f"{name}: " + ", ".join(f"{label} {statistics.median(r['step_s']):.3f} s"
                                          for label, r in rows.items() if "step_s" in r), flush=True)
        return {"order": order, "variants": rows}

    with VethPair(mtu) as pair:
        pair.unshape()
        out["runs"]["unshaped"] = measured(pair, "unshaped", 0)
        base = out["runs"]["unshaped"]["variants"]["oases"]
        payload_gbps, rate = shaped_rate_mbit(base["wire_bytes"], statistics.median(base["compute_s"]), RATIO, mtu)
        out.update(payload_gbps=payload_gbps, tbf_rate_mbit=rate)
        pair.shape(rate, burst or 2 * (mtu + 14))
        out["runs"]["shaped"] = measured(pair, f"shaped at {rate:.1f} Mbit/s", 1)
        pair.unshape()
    return out


def table(result: dict) -> str:
    shaped, alone = result["runs"]["shaped"]["variants"], result["runs"]["unshaped"]["variants"]
    gbps = result["payload_gbps"]
    lines = [f"Run of {result['date']} at commit {result['git_commit']} on {result['machine']['processor']} "
             f"({result['machine']['cpu_count']} CPUs), {result['repeats']} repeats after {result['warmup']} warm-up, "
             f"{result['micro_batches_per_step']} micro-batches per step; shaped: tbf {result['tbf_rate_mbit']:.1f} "
             f"Mbit/s, payload {gbps * 1000:.1f} Mbit/s nominal (medians):", "",
             "| variant | unshaped step (s) | shaped step (s) | compute (s) | link time (s) | limit (s) "
             f"| shaped step / limit (target <= {TARGET:.2f}x) | shaped step / oases's |", "|---|---|---|---|---|---|---|---|"]
    oases = statistics.median(shaped["oases"]["step_s"])
    for label in [v[0] for v in VARIANTS] + [a[0] for a in AUTOTP]:
        row, quiet = shaped.get(label, {}), alone.get(label, {})
        if "step_s" not in row or "step_s" not in quiet:
            lines.append(f"| {label} | - | - | - | - | - | - | failed: {(row or quiet).get('error', 'not run')} |")
            continue
        step = statistics.median(row["step_s"])
        cells = ["-", "-", "-", "-"]
        if "wire_bytes" in row:  # the executor's: its traffic and compute are measured
            compute = statistics.median(quiet["compute_s"])
            link = row["wire_bytes"] * 8 / (gbps * 1e9)
            limit = max(compute, link)
            cells = [f"{compute:.3f}", f"{link:.3f}", f"{limit:.3f}", f"{step / limit:.3f}x"]
        lines.append(f"| {label} | {statistics.median(quiet['step_s']):.3f} | {step:.3f} | " + " | ".join(cells)
                     + f" | {step / oases:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny dims, 1 repeat: the path only (give --out elsewhere)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--burst-bytes", type=int, default=0, help="tbf bucket; 0: two frames")
    parser.add_argument("--timeout-s", type=int, default=1800)
    parser.add_argument("--out", default=result_path("limit_shaped"))
    parser.add_argument("--report-only", action="store_true", help="re-render the report from --out")
    args = parser.parse_args()

    def measure() -> dict:
        quick = args.quick
        return run(QUICK if quick else MODEL, 1 if quick else args.repeats, 0 if quick else 1, args.mtu,
                   args.burst_bytes, args.timeout_s)

    if args.quick:
        print(table(stored_or_measured(False, args.out, measure)))
        return
    publish_study("limit_shaped", args.out, measure, table, "The step against its limit on a tbf-shaped link",
                  "\n\n".join(__doc__.split("\n\n")[2:4]), report_only=args.report_only)


if __name__ == "__main__":
    main()
