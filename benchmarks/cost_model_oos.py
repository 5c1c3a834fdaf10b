"""Cost-model accuracy out of sample: score the cost model on setups it was not tuned on.

Not a test: run ``python benchmarks/cost_model_oos.py`` (all setups, 24 timed rounds per plan, ``mixed``
72, ~25 min on a quiet 2-core machine: in_sample 127 s, link_1g 82 s, link_500m 87 s, llama 126 s, bert
123 s, tmp4 304 s, mixed 487 s and 3 min of fresh profiles on 2026-12-01) or ``--setup link_1g`` (repeatable).  After the runs, each setup's measured
steps are priced again by ``--reprofile`` (2) fresh profiles (``planner_accuracy-<setup>.json
["reprofiled"]``; ``--reprofile-only`` does that for the result files already there): one profile
is seconds of steps, and the one a run took can sit apart from the others (``benchmarks/reports/cost_model_history-2026-12.md``).  The preset also steps a profile in the measurement's own rounds
(``accuracy.interleave_profile``; kept in ``profiles/interleaved`` beside the results, scored as the report's
*interleaved profile*): it saw the machine the plans ran on, where the planner's profile, taken before, can
catch a moment the minutes of measurement do not.  24 rounds, not the preset's 8: with 8 the
split-half check ranked the plans of three setups below 0.9 (``benchmarks/reports/cost_model_history-2026-12.md``).  Each setup is
``oases-plan experiment=cost_model`` plus the overrides in :data:`SETUPS`, writing
``planner_accuracy-<setup>.json`` into the run's folder (``--results-dir``, default
``benchmarks/results/cost_model_run-<date>``); then the summary report
``benchmarks/reports/cost_model_oos-<date>.md`` is generated from those files
(:func:`oases_ds.bench.cost_model.summary_markdown`).  ``--report-only`` regenerates
it from the files already there; ``--pack <run folder>`` archives the run where ``--pooled`` reads it.  ``--quick`` checks the harness in minutes (3 plans
reach no conclusion: its Spearman is noise by design), into ``--results-dir``.

``--pooled`` measures nothing: it pools every stored run of each setup under ``--results-dir`` (default
``benchmarks/results``; the
same seeded plans, measured at other times; :mod:`oases_ds.bench.cost_model`) and prices the pool with
every stored profile of this cost model, into ``cost_model_pooled.json`` there and the report
``cost_model_pooled-<date>.md``: one run of ~10 plans a few percent apart can rank them otherwise than
the next run does, and the pool is the steadier measurement.

The model is *not* retuned on these setups: a miss is reported, not fitted away (what v2 and v4
were built on: ``benchmarks/reports/cost_model_history-2026-12.md``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oases_ds.bench.cost_model import (  # noqa: E402
    PRICED_PROFILE_VERSIONS,
    RUN_ARCHIVES,
    PooledScore,
    Setup,
    kept_profile_path,
    pack_run,
    pooled_markdown,
    pooled_score,
    repriced_spearman,
    stored_results,
    stored_tables,
    summary_markdown,
    unversioned,
)
from oases_ds.planner.costs import COST_MODEL_VERSION, CostTable  # noqa: E402
from oases_ds.utils.io import write_json_atomic, write_text_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SETUPS: tuple[Setup, ...] = (
    Setup("in_sample", "nothing: gpt_small, T=2, 0.2 Gbit/s, 10 plans (the tuning setup, for reference)", ()),
    Setup("link_1g", "link 1 Gbit/s instead of 0.2 (comm 5x cheaper against the same compute)",
          ("cluster.name=cpu_1g", "cluster.link.bandwidth_gbps=1.0")),
    Setup("link_500m", "link 0.5 Gbit/s instead of 0.2 (comm 2.5x cheaper; at 1 Gbit/s the measurement cannot rank "
          "the plans, split-half 0.08-0.64 in three runs)", ("cluster.name=cpu_0_5g", "cluster.link.bandwidth_gbps=0.5")),
    Setup("llama", "family LLaMA (RMSNorm, SwiGLU MLP, rotary attention)", ("model=llama_small",)),
    Setup("bert", "family BERT (post-norm, masked-LM head)", ("model=bert_small",)),
    Setup("tmp4", "T=4: degrees 1, 2 and 4, 4 ranks, micro-batch 16", ("devices=4", "micro_batch=16")),
    Setup("mixed", "only the plans that mix degrees are ranked (14 plans, another seed, 72 rounds)",
          ("accuracy.plans=14", "accuracy.seed=1", "accuracy.repeats=72"), mixed_only=True),
)
"""``mixed`` runs 72 rounds: at 24 its split-half was 0.615 (the mixes sit within ~7% of one another),
at 72 0.965 in one run and 0.685 in the next (``benchmarks/reports/cost_model_history-2026-12.md``)."""

QUICK = ("accuracy.plans=4", "accuracy.warmup=0", "accuracy.repeats=1", "planner.warmup=0", "planner.repeats=1")
"""Harness check: every stage runs, nothing is concluded.  Placed before a setup's own
overrides, so ``mixed`` keeps its 14 plans (4 would leave too few mixes to rank)."""


def result_path(results_dir: Path, setup: Setup) -> Path:
    return results_dir / f"planner_accuracy-{setup.name}.json"


def plan_cli(*overrides: str, capture: bool = False) -> subprocess.CompletedProcess:
    """``oases-plan experiment=cost_model <overrides>`` from the repository root, the one command
    line every setup's run and re-profile goes through; its output streams through unless ``capture``."""
    cmd = [sys.executable, "-m", "oases_ds.cli.plan", "experiment=cost_model", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=capture, text=True)


def run_setup(setup: Setup, results_dir: Path, quick: bool, cache_dir: str, rounds: int | None = None) -> float:
    """Run one setup through ``oases-plan``; returns its wall seconds.  Its output streams through.
    ``rounds``: timed rounds per plan instead of the preset's ``accuracy.repeats``, unless the
    setup sets its own."""
    own = any(o.startswith("accuracy.repeats=") for o in setup.overrides)
    more = (f"accuracy.repeats={rounds}",) if rounds is not None and not own else ()
    overrides = [*(QUICK if quick else ()), *setup.overrides, *more, f"accuracy.out={result_path(results_dir, setup)}",
                 f"planner.cache_dir={cache_dir}"]
    print(f"== {setup.name}: oases_ds.cli.plan experiment=cost_model {' '.join(overrides)}", flush=True)
    started = time.perf_counter()
    proc = plan_cli(*overrides)
    if proc.returncode:
        raise SystemExit(f"error: setup {setup.name} failed (exit {proc.returncode}); its output is above")
    return time.perf_counter() - started


def reprofile(setup: Setup, path: Path, count: int) -> list[float | None]:
    """Profile ``setup`` afresh ``count`` times (same preset and overrides as its run, each into
    an empty cache) and add each profile's Spearman over the stored measured steps to the result
    file's ``reprofiled`` list; returns those Spearmans.  Each profile is kept under
    ``profiles/fresh`` beside the result (its path in the entry's ``table``): ``--pooled`` prices
    every stored run with every stored profile."""
    result = json.loads(path.read_text())
    overrides = [o for o in setup.overrides if not o.startswith("accuracy.")]
    scores: list[float | None] = []
    for _ in range(count):
        with tempfile.TemporaryDirectory(prefix="oases-reprofile-") as tmp:
            proc = plan_cli("mode=profile", *overrides, f"planner.cache_dir={tmp}", capture=True)
            if proc.returncode:
                raise SystemExit(f"error: re-profiling {setup.name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            (table_path,) = Path(tmp).glob("*.json")
            table = CostTable.from_json(table_path)
            kept = kept_profile_path(path.parent, "fresh", table)
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(table_path, kept)
        if unversioned(table.key()) != unversioned(result["table_key"]):
            raise SystemExit(f"error: {path}: measured with table {result['table_key']!r}, re-profiled {table.key()!r}")
        table = dataclasses.replace(table, layers=len(result["rows"][0]["attn"]))
        rho = repriced_spearman(setup, result, table)
        scores.append(rho)
        result.setdefault("reprofiled", []).append({
            "profiled_at": table.measurements.get("profiled_at"), "cost_model": COST_MODEL_VERSION,
            "table_key": table.key(), "spearman": rho, "table": os.path.relpath(kept, path.parent)})
        print(f"== {setup.name}: fresh profile {len(result['reprofiled'])}: Spearman "
              f"{'-' if rho is None else f'{rho:.3f}'}", flush=True)
    write_json_atomic(path, result)
    return scores


def pooled(chosen: list[Setup], results_root: Path, report_dir: Path) -> Path:
    """Score every setup against its stored runs pooled (:mod:`oases_ds.bench.cost_model`), priced by
    every stored profile: once over all runs, once over the runs of each earlier cost model whose
    profiles this one prices (:data:`PRICED_PROFILE_VERSIONS`: what the change was chosen on), once
    over the runs measured under this cost model (out of sample for it).  Writes ``<results_root>/cost_model_pooled.json`` and the report."""
    earlier = [v for v in PRICED_PROFILE_VERSIONS if v != COST_MODEL_VERSION]
    pools: dict[str, list[PooledScore]] = {"all": [], **{f"cm{v}": [] for v in earlier}, "current": []}
    payload: dict[str, Any] = {"cost_model": COST_MODEL_VERSION, "time": datetime.datetime.now().isoformat(timespec="seconds"),
                               "pools": {}}
    for setup in chosen:
        runs = [(os.path.relpath(folder, results_root.parent), result) for folder, result in stored_results(results_root, setup)]
        if not runs:
            continue
        tables = [(os.path.relpath(p, results_root.parent), t) for p, t in stored_tables(results_root, runs[0][1]["table_key"])]
        by_version = {"current" if v == COST_MODEL_VERSION else f"cm{v}":
                      [run for run in runs if run[1]["table_key"].endswith(f"|cm{v}")] for v in PRICED_PROFILE_VERSIONS}
        for pool, members in (("all", runs), *by_version.items()):
            if members:
                try:
                    score = pooled_score(setup, members, tables)
                except ValueError as err:  # no profile of this cost model, or too few plans shared
                    payload.setdefault("skipped", {})[f"{pool}/{setup.name}"] = str(err)
                    print(f"== pooled ({pool}) {setup.name}: skipped: {err} (profiles: --reprofile-only)", flush=True)
                    continue
                pools[pool].append(score)
                summary = score.summary()
                payload["pools"].setdefault(pool, {})[setup.name] = {**dataclasses.asdict(score), "summary": summary}
                print(f"== pooled ({pool}) {setup.name}: {len(members)} runs, {score.plans} plans, {len(tables)} profiles: "
                      f"replayed median {summary['replayed']['median']:.3f}", flush=True)
    write_json_atomic(results_root / "cost_model_pooled.json", payload)
    titles = {"all": "All stored runs",
              **{f"cm{v}": f"The runs measured under cost model {v} (same profiler; in sample for what {COST_MODEL_VERSION} changed)"
                 for v in earlier},
              "current": f"The runs measured under cost model {COST_MODEL_VERSION}, the current one"}
    note = ("Generated by `python benchmarks/cost_model_oos.py --pooled` from the result files and profiles under "
            f"`{os.path.relpath(results_root, ROOT)}`; every number is in `cost_model_pooled.json` there.")
    out = report_dir / f"cost_model_pooled-{datetime.date.today().isoformat()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    if payload.get("skipped"):
        note += " Not scored: " + "; ".join(f"{k}: {v}" for k, v in payload["skipped"].items()) + "."
    write_text_atomic(out, pooled_markdown([(titles[k], v) for k, v in pools.items() if v], note))
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [s.name for s in SETUPS]
    parser.add_argument("--setup", action="append", choices=names, help="only these setups (repeatable)")
    parser.add_argument("--quick", action="store_true", help="harness check: 4 plans, 1 round, no warm-up")
    parser.add_argument("--rounds", type=int, default=24,
                        help="timed rounds per plan (default 24; the preset's own is 8): the split-half check grows with them")
    parser.add_argument("--report-only", action="store_true", help="no measuring: report the result files there")
    parser.add_argument("--reprofile", type=int, default=2,
                        help="fresh profiles that price each setup's measured steps again after its run (default 2)")
    parser.add_argument("--reprofile-only", action="store_true",
                        help="no measuring: price the result files there with --reprofile fresh profiles each, then report")
    parser.add_argument("--results-dir", help="the run's folder (default benchmarks/results/cost_model_run-<today>); "
                                              "with --pooled or --pack, the results root (default benchmarks/results)")
    parser.add_argument("--report-dir", default=str(ROOT / "benchmarks" / "reports"))
    parser.add_argument("--cache-dir", default=".oases/profiles", help="profile cache (planner.cache_dir)")
    parser.add_argument("--pack", type=Path, metavar="RUN_FOLDER",
                        help="no measuring: pack a measured run's folder (results, profiles, notes) into "
                             "<results-dir>/cost_model_runs/<folder>.tar.gz, where --pooled reads it, and remove the folder")
    parser.add_argument("--pooled", action="store_true",
                        help="no measuring: score each setup against all its stored runs under --results-dir pooled, "
                             "priced by every stored profile there")
    args = parser.parse_args(argv)
    root = ROOT / "benchmarks" / "results"
    results_dir = Path(args.results_dir) if args.results_dir else (
        root if args.pooled or args.pack else root / f"cost_model_run-{datetime.date.today().isoformat()}")
    chosen = [s for s in SETUPS if not args.setup or s.name in args.setup]
    if args.pack:
        archive = pack_run(args.pack, results_dir / RUN_ARCHIVES)
        shutil.rmtree(args.pack)
        print(f"wrote {archive}")
        return archive
    if args.pooled:
        return pooled(chosen, results_dir, Path(args.report_dir))
    walls: dict[str, float] = {}
    if args.reprofile < 0:
        parser.error(f"--reprofile must be >= 0, got {args.reprofile}")
    if not (args.report_only or args.reprofile_only):
        for setup in chosen:
            walls[setup.name] = run_setup(setup, results_dir, args.quick, args.cache_dir, None if args.quick else args.rounds)
            print(f"== {setup.name}: {walls[setup.name]:.0f} s", flush=True)
    if not args.report_only and not args.quick:
        for setup in chosen:
            if args.reprofile_only and not result_path(results_dir, setup).exists():
                continue
            reprofile(setup, result_path(results_dir, setup), args.reprofile)
    entries = []
    for setup in chosen:
        path = result_path(results_dir, setup)
        shown = os.path.relpath(path, ROOT)
        entries.append((setup, shown, json.loads(path.read_text()) if path.exists() else None))
    note = ("**Harness check (`--quick`: 4 plans, 1 round): these numbers are noise, not a measurement.**"
            if args.quick else "Measured by `python benchmarks/cost_model_oos.py`.")
    if walls:
        note += " Wall time per setup: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + "."
    today = datetime.date.today().isoformat()
    out = Path(args.report_dir) / f"cost_model_oos-{today}{'-quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, summary_markdown(entries, note))
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return out


if __name__ == "__main__":
    main()
