"""Kernel micro-benchmarks on a shared, loaded machine: interleaved timing and ratios.

Why interleaved: other developers' jobs come and go on the same two cores, so a
variant timed in one block and its baseline in another would compare two machine
states.  Each round runs every variant once, back to back, starting with a
different one each round; per-round ratios then compare like with like, and the
median over rounds is what the kernels report quotes (min-max beside it).
Used by ``benchmarks/micro_dropout.py`` and ``benchmarks/micro_attention.py``.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Any, Callable

import torch

from oases_ds.bench.provenance import dated_report, git_commit, machine
from oases_ds.utils.io import replace_marked_section, write_json_atomic
from oases_ds.utils.rounds import rotated


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant, one call per variant per round, start rotated."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_summary(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """Median seconds and per-round ratio to ``base`` (median, min, max) of each variant."""
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[base])]
        out[name] = {"median_ms": statistics.median(ts) * 1e3, "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out


def record(name: str, rounds: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON payload: what ran, where, on which commit, with the load it ran under."""
    return {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "machine": machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_avg_1min": os.getloadavg()[0], "rounds": rounds, "cases": cases}


def write_results(json_path: str, payload: dict[str, Any], report_path: str | None, table: list[str]) -> str:
    """Write the JSON record and replace the benchmark's generated table in ``report_path`` (default:
    the kernels report of the payload's day, :func:`~oases_ds.bench.provenance.dated_report`), between
    ``<!-- <name>:begin -->`` and ``<!-- <name>:end -->``, appended if absent; returns the report."""
    write_json_atomic(json_path, payload)
    name = payload["benchmark"]
    report_path = report_path or dated_report("kernels", payload["date"])
    replace_marked_section(report_path, f"<!-- {name}:begin -->", f"<!-- {name}:end -->", "\n".join(table))
    return report_path


def fmt_ratio(s: dict[str, float]) -> str:
    return f"{s['ratio_median']:.2f}x ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"
