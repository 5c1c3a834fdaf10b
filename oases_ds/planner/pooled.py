"""Score the cost model against several runs of the same plans, pooled.

One run of the accuracy study (:mod:`oases_ds.planner.accuracy`) ranks ~10 plans
by their median step over 24-72 interleaved rounds.  Where the plans sit within a
few percent of one another, a second run of the *same* plans on the same machine
ranks them differently: over the five stored runs of 2026-12-01 (A-E), one run's
medians against another's gave Spearman 0.83-0.99 for ``tmp4`` and 0.72-0.98 for
``mixed``, while for ``tmp4`` each run's own split-half check (its odd rounds
against its even ones, minutes apart) stayed at 0.90-1.00: runs hours apart agree
less than the rounds of one run.  A model cannot rank one run's plans better than
the next run of them does, so one run's score below the target can be that run's
moment of the machine, not the model's error.

Pooling the runs gives a measurement with more rounds and more moments of the
machine behind it:

* only the plans every pooled run measured are kept (the setups are seeded, so
  every run of a setup measured the same plans);
* each run's medians are divided by their geometric mean over those plans (a run
  on a machine a few percent slower shifts every plan alike), and the pooled step
  of a plan is the geometric mean of its relative steps over the runs;
* each run's agreement with the pool (Spearman) is reported beside the score, so
  a reader sees how much one run alone could be trusted.

The pooled steps are then priced by every stored profile of the setup that this
cost model's profiler took (each run's own profile and the fresh ones,
``benchmarks/results/**/profiles``, :func:`stored_tables`): the
replay the planner ranks with (:func:`~oases_ds.planner.replay.replay_plan`) and
the additive sum the solvers search.  Nothing here fits anything: the profiles are
the inputs a user's planner would have had, the runs are the measurements.
"""
from __future__ import annotations

import dataclasses
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from oases_ds.planner.accuracy import MIN_RANKED, TARGET_SPEARMAN, Setup, plan_of_row, scored_rows, spearman
from oases_ds.planner.costs import COST_MODEL_VERSION, CostTable
from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.replay import can_replay, replay_inputs, replayed_or_additive


def unversioned(key: str) -> str:
    """A table key without its ``|cm<version>`` suffix: a profile is the same measurement whichever
    cost model later prices it."""
    return key.rsplit("|cm", 1)[0]


def plan_key(row: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A result row's plan, as a key that is equal across runs."""
    return tuple(row["attn"]), tuple(row["mlp"])


@dataclass(frozen=True)
class PooledSteps:
    """The plans every pooled run measured and their pooled relative steps."""

    rows: list[dict[str, Any]]
    """The plans' rows, from the first run (their ``attn`` / ``mlp`` name the plan)."""
    relative: list[float]
    """Per plan, the geometric mean over the runs of its median step over its run's geometric mean."""
    agreement: list[float]
    """Per run, the Spearman of its own medians against ``relative``."""


def pooled_steps(setup: Setup, results: Sequence[dict[str, Any]]) -> PooledSteps:
    """Pool ``results`` (runs of ``setup``) over the scored plans that every run measured."""
    if not results:
        raise ValueError(f"{setup.name}: no runs to pool")
    per_run = [{plan_key(r): r["measured_ms"] for r in scored_rows(setup, result)} for result in results]
    rows = [r for r in scored_rows(setup, results[0]) if all(plan_key(r) in run for run in per_run)]
    if len(rows) < MIN_RANKED:
        raise ValueError(f"{setup.name}: the runs share {len(rows)} scored plans; a rank correlation needs {MIN_RANKED}")
    keys = [plan_key(r) for r in rows]
    logs = []
    for run in per_run:
        values = [math.log(run[k]) for k in keys]
        mean = statistics.fmean(values)
        logs.append([v - mean for v in values])
    relative = [math.exp(statistics.fmean(column)) for column in zip(*logs)]
    agreement = [spearman([run[k] for k in keys], relative)[0] for run in per_run]
    return PooledSteps(rows, relative, agreement)


_PROFILE_VERSION = re.compile(r"_cm(\d+)(?:-[^/]*)?\.json$")
"""A stored profile's cost model version, from its file name: ``<key>_cm<n>.json`` as the profile cache
names it, ``<key>_cm<n>-<profiled at>.json`` as ``cost_model_oos.py --reprofile`` keeps it."""


def profile_version(path: Path) -> int | None:
    """The cost model version a stored profile was taken under (``None``: the name does not say)."""
    match = _PROFILE_VERSION.search(path.name)
    return int(match.group(1)) if match else None


def stored_tables(root: Path, table_key: str, version: int = COST_MODEL_VERSION) -> list[tuple[Path, CostTable]]:
    """Every profile under ``root``'s ``profiles`` folders measured for ``table_key`` (a result's key,
    of any cost model version) by the profiler of cost model ``version``, with per-op times, oldest
    first.  One version's only: the profiler changed with the cost model (what it measures per op,
    how it interleaves degrees), and a user's planner prices with this commit's profiler."""
    found = []
    for path in sorted(root.glob("**/profiles/**/*.json")):
        if profile_version(path) != version:
            continue
        table = CostTable.from_json(path)
        if unversioned(table.key()) == unversioned(table_key) and can_replay(table):
            found.append((path, table))
    return sorted(found, key=lambda item: str(item[1].measurements.get("profiled_at", "")))


@dataclass(frozen=True)
class PooledScore:
    """One setup's pooled score: per profile, the Spearman of its prediction against the pool."""

    setup: str
    runs: list[str]
    plans: int
    agreement: list[float]
    profiles: list[str]
    replayed: list[float]
    additive: list[float]

    def summary(self) -> dict[str, Any]:
        """Min / median / max of the scores, and whether the median reaches the target."""
        def span(values: list[float]) -> dict[str, float]:
            return {"min": min(values), "median": statistics.median(values), "max": max(values)}
        return {"replayed": span(self.replayed), "additive": span(self.additive), "agreement": span(self.agreement),
                "target_met": statistics.median(self.replayed) >= TARGET_SPEARMAN}


def pooled_score(setup: Setup, runs: Sequence[tuple[str, dict[str, Any]]],
                 tables: Sequence[tuple[str, CostTable]]) -> PooledScore:
    """Score ``setup``: ``runs`` (name, result) pooled (:func:`pooled_steps`), priced by each of
    ``tables`` (name, profile) as the run's own report would (replayed from the model and schedule in
    its ``config``), and by the additive sum."""
    if not tables:
        raise ValueError(f"{setup.name}: no stored profile with per-op times to price the pooled runs")
    pool = pooled_steps(setup, [result for _, result in runs])
    family, schedule = replay_inputs(runs[0][1])
    layers = len(pool.rows[0]["attn"])
    replayed, additive = [], []
    for _, table in tables:
        table = dataclasses.replace(table, layers=layers)
        plans = [plan_of_row(r, table.devices) for r in pool.rows]
        replayed.append(spearman(replayed_or_additive(table, family, schedule, plans), pool.relative)[0])
        additive.append(spearman([predict_step_ms(table, p) for p in plans], pool.relative)[0])
    return PooledScore(setup.name, [name for name, _ in runs], len(pool.rows), pool.agreement,
                       [name for name, _ in tables], replayed, additive)


def pooled_markdown(pools: Sequence[tuple[str, Sequence[PooledScore]]], note: str) -> str:
    """The pooled report: per pool (title, scores), one row per setup."""
    md = ["# Cost-model accuracy, runs pooled", "",
          "Each setup's stored runs of the same plans are pooled (`oases_ds/planner/pooled.py`: per run, medians",
          "over the run's geometric mean; per plan, the geometric mean over the runs) and every stored profile of the",
          "setup prices them. *Replayed*: the prediction the planner ranks with (cost model of this commit);",
          "*additive*: the per-block sum the solvers search, from the same profiles. Min / median / max over the",
          f"profiles. *One run vs pool*: each run's own medians against the pool. Target: Spearman >= {TARGET_SPEARMAN}",
          "(met: the median over profiles reaches it).", "", note]
    for title, scores in pools:
        md += ["", f"## {title}", "",
               "| setup | runs | plans | one run vs pool | profiles | replayed | met | additive |",
               "|---|---|---|---|---|---|---|---|"]
        for s in scores:
            summary = s.summary()

            def text(part: str) -> str:
                return "{min:.3f} / {median:.3f} / {max:.3f}".format(**summary[part])
            met = "yes" if summary["target_met"] else "**no**"
            md.append(f"| {s.setup} | {len(s.runs)} | {s.plans} | {text('agreement')} | {len(s.profiles)} "
                      f"| {text('replayed')} | {met} | {text('additive')} |")
        md += ["", "Runs: " + "; ".join(f"{s.setup}: " + ", ".join(f"`{r}`" for r in s.runs) for s in scores) + "."]
    return "\n".join(md) + "\n"
