"""The cost-model study: does the planner's pricing rank plans the way this machine runs them?

The planner prices a plan by replaying it over a profile (:mod:`oases_ds.planner.replay`) and checks
one table against measured plans in ``oases-plan mode=accuracy`` (:mod:`oases_ds.planner.accuracy`).
This module is the study around that check (``benchmarks/cost_model_oos.py``, report index in
``benchmarks/README.md``), none of which the planner needs to plan:

* **setups** scored out of sample (:class:`Setup`, :data:`TARGET_SPEARMAN`) and the report over one
  run of them (:func:`summary_markdown`);
* **where a measured step goes**, lane by lane (:func:`step_breakdown`, :func:`measure_breakdown`),
  against the replay's waits;
* **stored runs pooled**.  One run ranks ~10 plans by their median step over 24-72 interleaved rounds.
  Where the plans sit within a few percent of one another, a second run of the *same* plans on the same
  machine ranks them differently, and runs hours apart agree less than the rounds of one run (its
  split-half check): a model cannot rank one run's plans better than the next run of them does, so one
  run's score below the target can be that run's moment of the machine, not the model's error.  Pooling
  gives a measurement with more rounds and more moments behind it:

  - only the plans every pooled run measured are kept (the setups are seeded, so every run of a setup
    measured the same plans);
  - each run's medians are divided by their geometric mean over those plans (a run on a machine a few
    percent slower shifts every plan alike), and the pooled step of a plan is the geometric mean of its
    relative steps over the runs;
  - each run's agreement with the pool (Spearman) is reported beside the score, so a reader sees how
    much one run alone could be trusted.

  The pooled steps are then priced by every stored profile of the setup that this cost model's profiler
  took (each run's own profile and the fresh and interleaved ones, :func:`stored_tables`): the replay the
  planner ranks with and, as a named baseline, the additive sum the solvers search.  Nothing here fits
  anything: the profiles are the inputs a user's planner would have had, the runs are the measurements.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import statistics
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from oases_ds.launcher import launch
from oases_ds.planner.accuracy import MIN_RANKED, AccuracySpec, is_mixed, measure_rank, spearman
from oases_ds.planner.costs import CostTable, DegreeProfile, PassTimes
from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.plan import Plan
from oases_ds.planner.profile import cache_path
from oases_ds.planner.replay import can_replay, replayed_or_additive
from oases_ds.runtime.executor import Executor


# -- setups and one run's score --------------------------------------------------------
TARGET_SPEARMAN = 0.9
"""What each out-of-sample setup should reach: above the paper's 0.844 / 0.876."""


@dataclass(frozen=True)
class Setup:
    """One setup the cost model is scored on without being tuned on it.

    Attributes:
        name: short label; names the result file ``planner_accuracy-<name>.json``.
        differs: what differs from the setup the cost model was first tuned on, for the report.
        overrides: ``oases-plan experiment=cost_model`` overrides that make the setup.
        mixed_only: score the plans that mix degrees only (:func:`mixed_spearman`).
    """

    name: str
    differs: str
    overrides: tuple[str, ...]
    mixed_only: bool = False


def setup_score(setup: Setup, result: dict[str, Any]) -> tuple[float | None, int]:
    """(rho, plans scored) of one setup's result, over the plans the setup scores."""
    if setup.mixed_only:
        return result.get("spearman_mixed"), result.get("mixed_plans", 0)
    return result["spearman"], len(result["rows"])


def scored_rows(setup: Setup, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result rows ``setup`` ranks: the mixed-degree plans for a ``mixed_only`` setup, else all."""
    return [r for r in result["rows"] if is_mixed(r)] if setup.mixed_only else list(result["rows"])


def plan_of_row(row: dict[str, Any], devices: int) -> Plan:
    """The plan a result row measured (its per-layer attention and MLP degrees)."""
    return Plan(attn_degrees=tuple(row["attn"]), mlp_degrees=tuple(row["mlp"]), devices=devices)


def repriced_spearman(setup: Setup, result: dict[str, Any], table: CostTable) -> float | None:
    """Spearman of ``setup``'s scored rows, their measured steps against ``table``'s predictions
    (replayed as the run's own :func:`report` would, from the model and schedule in its ``config``).

    Why: a setup's score depends on two measurements, the plans' steps and the profile that
    priced them.  The profile is a few seconds of steps, so one taken in a bad moment moves
    every prediction at once; pricing the same measured steps with profiles taken at other
    times separates the model's error from that profile's (``benchmarks/cost_model_oos.py
    --reprofile``).  ``None`` under :data:`MIN_RANKED` plans."""
    rows = scored_rows(setup, result)
    if len(rows) < MIN_RANKED:
        return None
    predicted = replayed_or_additive(table, [plan_of_row(r, table.devices) for r in rows])
    return spearman(predicted, [r["measured_ms"] for r in rows])[0]


def reprofiled_range(result: dict[str, Any]) -> dict[int, tuple[float, float, float, int]]:
    """Per cost model version, (min, median, max, count) of the Spearmans a result was
    re-scored with from fresh profiles (``result["reprofiled"]``); empty when it has none.
    By version: a run measured once can be priced again by a later model, and the two
    must not be pooled."""
    scores: dict[int, list[float]] = {}
    for entry in result.get("reprofiled", []):
        if entry.get("spearman") is not None:
            scores.setdefault(int(entry.get("cost_model", 0)), []).append(entry["spearman"])
    return {version: (min(v), statistics.median(v), max(v), len(v)) for version, v in sorted(scores.items())}


def top_pick_regret(rows: list[dict[str, Any]]) -> float | None:
    """Measured step of the plan the model ranks first over the best measured step among ``rows``
    (1.0: the model's pick is the fastest plan measured).  What a planner's choice costs, where a
    rank correlation over near-tied plans says little; ``None`` without plans."""
    if not rows:
        return None
    pick = min(rows, key=lambda r: r["predicted_ms"])
    return pick["measured_ms"] / min(r["measured_ms"] for r in rows)


def summary_markdown(entries: list[tuple[Setup, str, dict[str, Any] | None]], note: str) -> str:
    """The out-of-sample report: per setup its Spearman against :data:`TARGET_SPEARMAN`,
    computed from each ``(setup, result path, result or None when missing)``."""
    md = ["# Cost-model accuracy out of sample", "",
          "The cost model's ranking of plans, scored on setups it was not tuned on (the tuning setup, `in_sample`, is",
          "the first row, for reference): each setup changes one thing (link, model family, T, plans ranked) and was",
          "not looked at to build the model; the table key below names the cost model version each result was priced",
          f"with. Target: Spearman >= {TARGET_SPEARMAN} in each. *Without overhead* scores the same measured steps",
          "against the predictions without the per-collective overhead; *additive*, against the per-block sum the",
          "solvers search, from the same profile. *Measurement* is the Spearman of the plans' medians over the even",
          "rounds against the odd rounds: how well the measurement ranks the plans by itself. *Top pick*: the measured",
          "step of the plan the model ranks first over the fastest measured step among the scored plans (1.000: the",
          "planner would have chosen the fastest). *Fresh profiles*: the same measured steps priced by profiles taken",
          "again after the run (per cost model version, min / median / max over them, count in brackets; `--reprofile`):",
          "how much of the score is the one profile the run took. *Interleaved profile*: the same measured steps priced",
          "by a profile whose one-layer steps ran in the measurement's own rounds (`accuracy.interleave_profile`): it",
          "saw the machine the plans ran on.", "",
          note, "",
          "| setup | differs from the tuning setup | plans scored | Spearman | p | target met | without overhead "
          "| additive | measurement | top pick | fresh profiles | interleaved profile | result |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setup, path, result in entries:
        if result is None:
            md.append(f"| {setup.name} | {setup.differs} | - | not run | - | - | - | - | - | - | - | - | `{path}` missing |")
            continue
        regret = top_pick_regret(scored_rows(setup, result))
        rho, scored = setup_score(setup, result)
        p = "-" if setup.mixed_only else f"{result['p_value']:.2g}"
        which = f"{scored} mixed of {len(result['rows'])}" if setup.mixed_only else str(scored)
        met = "-" if rho is None else ("yes" if rho >= TARGET_SPEARMAN else "**no**")
        rho_text = "too few plans" if rho is None else f"{rho:.3f}"
        suffix = "_mixed" if setup.mixed_only else ""
        half, plain = result.get("split_half_spearman" + suffix), result.get("spearman_without_overhead" + suffix)
        additive = result.get("spearman_additive" + suffix) if result.get("pricing") == "replay" else None
        half_text, plain_text, additive_text = ("-" if v is None else f"{v:.3f}" for v in (half, plain, additive))
        regret_text = "-" if regret is None else f"{regret:.3f}"
        fresh_text = "; ".join(f"v{version}: {lo:.3f} / {mid:.3f} / {hi:.3f} ({n})"
                               for version, (lo, mid, hi, n) in reprofiled_range(result).items()) or "-"
        interleaved = result.get("interleaved", {}).get("spearman" + suffix)
        interleaved_text = "-" if interleaved is None else f"{interleaved:.3f}"
        md.append(f"| {setup.name} | {setup.differs} | {which} | {rho_text} | {p} | {met} | {plain_text} | {additive_text} | {half_text} "
                  f"| {regret_text} | {fresh_text} | {interleaved_text} | `{path}` |")
    md += ["", "Per setup: `oases-plan experiment=cost_model <overrides>`; overrides, machine, git commit and",
           "settings are in each result file (`config`, `machine`, `git_commit`)."]
    for setup, path, result in entries:
        if result is None:
            continue
        m, acc = result.get("machine", {}), result.get("config", {}).get("accuracy", {})
        md += ["", f"## {setup.name}", "",
               f"- overrides: `{' '.join(setup.overrides) or '(none)'}`; table `{result.get('table_key')}`",
               f"- measured {result.get('time')} on {m.get('cpu_count')} CPUs, git {str(result.get('git_commit'))[:10]}; "
               f"{acc.get('warmup')} warm-up + {acc.get('repeats')} timed rounds",
               "", "| attn | mlp | predicted ms | measured ms | measured / predicted |", "|---|---|---|---|---|"]
        for r in sorted(result["rows"], key=lambda r: r["predicted_ms"]):
            md.append(f"| {','.join(map(str, r['attn']))} | {','.join(map(str, r['mlp']))} | {r['predicted_ms']:.1f} | "
                      f"{r['measured_ms']:.1f} | {r['measured_ms'] / r['predicted_ms']:.3f} |")
    return "\n".join(md) + "\n"


# -- where a measured step goes -----------------------------------------------------------
def step_breakdown(events: list[Any], own_ms: float) -> dict[str, Any]:
    """One rank's step from its timeline: ``compute_ms`` (compute lane), ``waits_ms`` per Sync
    (``W<op>.<sub>``, ``Wb...``: time blocked on a collective) and ``rest_ms``, the rank's own
    wall time outside both (gradient sync after the schedule, issuing collectives, the host)."""
    compute = sum(e.end - e.start for e in events if e.lane == "compute") * 1e3
    waits: dict[str, float] = {}
    for e in events:
        if e.lane == "wait":
            waits[e.name] = waits.get(e.name, 0.0) + (e.end - e.start) * 1e3
    return {"own_ms": own_ms, "compute_ms": compute, "waits_ms": waits,
            "rest_ms": own_ms - compute - sum(waits.values())}



def _kept_breakdown(executor: Executor, own_ms: float, step_ms: float) -> dict[str, Any]:
    """What :func:`measure_breakdown` keeps of each timed step (runs in the rank processes)."""
    return {**step_breakdown(executor.timeline.events, own_ms), "step_ms": step_ms}


def measure_breakdown(spec: AccuracySpec, plans: list[Plan], timeout_s: float = 1800) -> list[list[list[dict[str, Any]]]]:
    """Per rank, per plan, each timed step's :func:`step_breakdown` with the step as ``step_ms`` (the
    accuracy check's interleaved rounds, with timelines kept): where a measured step and its replay
    part (``benchmarks/replay_breakdown.py``)."""
    return launch(measure_rank, spec.devices, (spec, plans, None, _kept_breakdown), timeout_s=timeout_s)


# -- stored runs and their profiles --------------------------------------------------------
PRICED_PROFILE_VERSIONS: tuple[int, ...] = (8, 9, 10)
"""The cost model versions whose stored profiles this cost model prices: 9 changed how the replay
uses a profile, not what the profiler measures; 10 changed the memory rows and the operator sequence
under sequence parallelism, not the per-op times of a profile without it (the ones stored here)."""


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


def kept_profile_path(results_dir: Path, kind: str, table: CostTable) -> Path:
    """Where a profile taken for a run is kept beside its results: ``<results_dir>/profiles/<kind>/<cache
    file name>-<profiled at>.json`` (``kind``: ``fresh`` after the run, ``interleaved`` in its rounds),
    the name :func:`profile_version` reads and :func:`stored_tables` finds."""
    stamp = str(table.measurements.get("profiled_at", "")).replace(":", "")
    return Path(results_dir) / "profiles" / kind / f"{cache_path('.', table.key()).stem}-{stamp}.json"


RUN_ARCHIVES = "cost_model_runs"
"""The folder under a results root that holds the stored runs, one ``<run>.tar.gz`` each (the run's
folder as ``cost_model_oos.py`` wrote it: result files, ``profiles/``, its notes), read in place."""


def pack_run(folder: Path, archives: Path) -> Path:
    """Pack a run's folder into ``<archives>/<folder name>.tar.gz`` (members under ``<folder name>/``,
    sorted, with no owner or time, so the same files give the same archive) and return the archive;
    :func:`stored_files` reads it where it lies.  The caller removes the folder."""
    archives.mkdir(parents=True, exist_ok=True)
    out = archives / f"{folder.name}.tar.gz"
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w") as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(f"{folder.name}/{path.relative_to(folder).as_posix()}")
            info.size, info.mode = path.stat().st_size, 0o644
            with open(path, "rb") as stream:
                tar.addfile(info, stream)
    return out


def stored_files(root: Path, wanted: Callable[[Path], bool]) -> list[tuple[Path, bytes]]:
    """(path, content) of every stored file under ``root`` that ``wanted`` keeps, in path order: the loose
    files of a run just measured, and every member of the run archives under ``root``, named as if the
    archive were unpacked where it lies (``<root>/cost_model_runs/<run>/profiles/...``).  Why archives:
    a run is some forty files, and a study kept as loose files buries the few reports a reader wants."""
    found = [(path, path.read_bytes()) for path in root.glob("**/*")
             if path.is_file() and not path.name.endswith(".tar.gz") and wanted(path.relative_to(root))]
    for archive in sorted(root.glob("**/*.tar.gz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = archive.parent / member.name
                if member.isfile() and wanted(name.relative_to(root)):
                    stream = tar.extractfile(member)
                    assert stream is not None
                    found.append((name, stream.read()))
    return sorted(found, key=lambda item: item[0])


def stored_results(root: Path, setup: Setup) -> list[tuple[Path, dict[str, Any]]]:
    """(run folder, result) of every stored run of ``setup`` under ``root`` (:func:`stored_files`;
    ``--quick`` harness checks left out), in path order."""
    def wanted(path: Path) -> bool:
        return path.name == f"planner_accuracy-{setup.name}.json" and "quick" not in str(path)
    return [(path.parent, json.loads(raw)) for path, raw in stored_files(root, wanted)]


def stored_tables(root: Path, table_key: str,
                  versions: tuple[int, ...] = PRICED_PROFILE_VERSIONS) -> list[tuple[Path, CostTable]]:
    """Every profile under ``root``'s ``profiles`` folders (loose or archived, :func:`stored_files`)
    measured for ``table_key`` (a result's key, of any cost model version) by the profiler of a cost
    model in ``versions``, with per-op times, oldest first.  Those versions' only: the profiler changed
    with the cost model (what it measures per op, how it interleaves degrees), and a user's planner
    prices with this commit's profiler."""
    def wanted(path: Path) -> bool:
        return "profiles" in path.parts[:-1] and path.suffix == ".json" and profile_version(path) in versions
    found = []
    for path, raw in stored_files(root, wanted):
        table = CostTable.from_bytes(raw, str(path))
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
    profiled_at: list[str] = dataclasses.field(default_factory=list)
    """Per profile, when it was taken (its ``measurements.profiled_at``)."""
    profile_step_ms: list[float | None] = dataclasses.field(default_factory=list)
    """Per profile, :func:`lowest_degree_step_ms`: how fast the machine ran while it was taken."""
    speed_matched: list[float | None] = dataclasses.field(default_factory=list)
    """Per profile, a *diagnostic*, not a score: the replayed Spearman once the profile's compute is
    scaled so that its replay of the uniform lowest-degree plan equals that plan's measured step
    (geometric mean over the runs; :func:`speed_matched_table`).  It uses a measured step, so it
    says where a miss comes from (the profile's speed or the model), never whether the model meets
    the target.  ``None`` where the runs did not all measure that plan."""
    leave_one_out: list[float] = dataclasses.field(default_factory=list)
    """Per run, the median replayed score over the profiles against the pool of the *other* runs
    (only with >= 3 runs): whether the verdict hangs on one run's moment of the machine."""

    def summary(self) -> dict[str, Any]:
        """Min / median / max of the scores, and whether the median reaches the target."""
        def span(values: list[float]) -> dict[str, float] | None:
            return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None
        return {"replayed": span(self.replayed), "additive": span(self.additive), "agreement": span(self.agreement),
                "leave_one_out": span(self.leave_one_out),
                "speed_matched": span([v for v in self.speed_matched if v is not None]),
                "interleaved": span([v for name, v in zip(self.profiles, self.replayed) if is_interleaved(name)]),
                "target_met": statistics.median(self.replayed) >= TARGET_SPEARMAN}


def is_interleaved(profile: str | Path) -> bool:
    """Whether a stored profile was stepped in an accuracy run's own rounds (``accuracy.interleave_profile``
    keeps it under ``profiles/interleaved``): it saw the machine the plans ran on."""
    return "interleaved" in Path(profile).parts


def lowest_degree_step_ms(table: CostTable) -> float | None:
    """The profiled one-layer step at the table's lowest degree (ms; ``None`` if not recorded): all
    compute, no TMP collective, so it shows the machine's speed while the profile was taken.  The
    emulated link's time does not change with that speed, so a profile taken at a fast moment prices
    low degrees cheap against high ones (``benchmarks/reports/cost_model_history-2026-12.md``)."""
    evidence = table.measurements.get("collective_overhead", {}).get(str(min(table.degrees)), {})
    return evidence.get("measured_step_ms")


def scaled_compute(table: CostTable, factor: float) -> CostTable:
    """``table`` with every compute time (per-op and per-block, forward, recompute, backward) times
    ``factor``; link, collective overhead and gradient sync unchanged."""
    profiles = {degree: DegreeProfile(profile.op_ms.scaled(factor), profile.payload_bytes,
                                      {kind: PassTimes(t.forward_ms * factor, t.recompute_ms * factor, t.backward_ms * factor)
                                       for kind, t in profile.block_ms.items()})
                for degree, profile in table.op_profile.items()}
    blocks = {kind: {d: dataclasses.replace(c, fwd_ms=c.fwd_ms * factor, bwd_ms=c.bwd_ms * factor)
                     for d, c in per.items()} for kind, per in table.blocks.items()}
    return dataclasses.replace(table, op_profile=profiles, blocks=blocks)


def speed_matched_table(table: CostTable, plan: Plan, measured_ms: float, iterations: int = 12) -> CostTable | None:
    """``table`` with its compute scaled (:func:`scaled_compute`) until its replay of ``plan`` takes
    ``measured_ms`` (to 1e-6): what the profile would have priced on the machine as fast as during
    the measurement.  Secant steps on the factor: the replay is close to affine in it (compute
    scales, the link does not).  ``None`` when no positive factor can: the measured step is shorter
    than the replay's non-compute part alone."""
    def replay(factor: float) -> float:
        return replayed_or_additive(scaled_compute(table, factor), [plan])[0]

    if replay(0.0) >= measured_ms:
        return None
    low, at_low = 1.0, replay(1.0)
    high = measured_ms / at_low
    for _ in range(iterations):
        at_high = replay(high)
        if abs(at_high - measured_ms) <= 1e-6 * measured_ms or at_high == at_low:
            break
        step = high + (measured_ms - at_high) * (high - low) / (at_high - at_low)
        low, at_low, high = high, at_high, step if step > 0 else high / 2
    return scaled_compute(table, high)


def _lowest_uniform_ms(results: Sequence[dict[str, Any]], devices: int, lowest: int) -> tuple[Plan, float] | None:
    """The uniform plan at degree ``lowest`` and its measured step's geometric mean over ``results``,
    if every run measured it."""
    steps = []
    for result in results:
        row = next((r for r in result["rows"] if set(r["attn"]) | set(r["mlp"]) == {lowest}), None)
        if row is None:
            return None
        steps.append(row["measured_ms"])
    return plan_of_row(row, devices), math.exp(statistics.fmean(math.log(ms) for ms in steps))


def _priced(pool: PooledSteps, tables: Sequence[tuple[str, CostTable]]) -> tuple[list[float], list[float]]:
    """Per table, the Spearman of its replayed and of its additive prediction against ``pool``."""
    layers = len(pool.rows[0]["attn"])
    replayed, additive = [], []
    for _, table in tables:
        table = dataclasses.replace(table, layers=layers)
        plans = [plan_of_row(r, table.devices) for r in pool.rows]
        replayed.append(spearman(replayed_or_additive(table, plans), pool.relative)[0])
        additive.append(spearman([predict_step_ms(table, p) for p in plans], pool.relative)[0])
    return replayed, additive


def pooled_score(setup: Setup, runs: Sequence[tuple[str, dict[str, Any]]],
                 tables: Sequence[tuple[str, CostTable]]) -> PooledScore:
    """Score ``setup``: ``runs`` (name, result) pooled (:func:`pooled_steps`), priced by each of
    ``tables`` (name, profile) as the run's own report would (replayed over the table's own model
    family and schedule), and by the additive sum; with >= 3 runs, also against each pool that leaves
    one run out."""
    if not tables:
        raise ValueError(f"{setup.name}: no stored profile with per-op times to price the pooled runs")
    results = [result for _, result in runs]
    pool = pooled_steps(setup, results)
    replayed, additive = _priced(pool, tables)
    speed_matched: list[float | None] = []
    references: dict[tuple[int, int], tuple[Plan, float] | None] = {}  # the same for every profile of the setup
    for _, table in tables:
        table = dataclasses.replace(table, layers=len(pool.rows[0]["attn"]))
        shape = (table.devices, min(table.degrees))
        if shape not in references:
            references[shape] = _lowest_uniform_ms(results, *shape)
        reference = references[shape]
        if reference is None:
            speed_matched.append(None)
            continue
        matched = speed_matched_table(table, *reference)
        speed_matched.append(None if matched is None else _priced(pool, [("", matched)])[0][0])
    leave_one_out = []
    if len(results) >= 3:
        for left in range(len(results)):
            others = pooled_steps(setup, results[:left] + results[left + 1:])
            leave_one_out.append(statistics.median(_priced(others, tables)[0]))
    return PooledScore(setup.name, [name for name, _ in runs], len(pool.rows), pool.agreement,
                       [name for name, _ in tables], replayed, additive,
                       [str(table.measurements.get("profiled_at", "")) for _, table in tables],
                       [lowest_degree_step_ms(table) for _, table in tables], speed_matched, leave_one_out)


def _step_vs_score(score: PooledScore) -> str:
    """Spearman of each profile's lowest-degree step against its replayed score, for the report ("-"
    under :data:`MIN_RANKED` profiles or when every score is equal): positive, the fast profiles miss."""
    pairs = [(step, rep) for step, rep in zip(score.profile_step_ms, score.replayed) if step is not None]
    if len(pairs) < MIN_RANKED or len({rep for _, rep in pairs}) < 2:
        return "-"
    return f"{spearman([p[0] for p in pairs], [p[1] for p in pairs])[0]:.2f}"


def pooled_markdown(pools: Sequence[tuple[str, Sequence[PooledScore]]], note: str) -> str:
    """The pooled report: per pool (title, scores), one row per setup."""
    md = ["# Cost-model accuracy, runs pooled", "",
          "Each setup's stored runs of the same plans are pooled (`oases_ds/bench/cost_model.py`: per run, medians",
          "over the run's geometric mean; per plan, the geometric mean over the runs) and every stored profile of the",
          "setup prices them. *Replayed*: the prediction the planner ranks with (cost model of this commit);",
          "*additive*: the per-block sum the solvers search, from the same profiles. Min / median / max over the",
          f"profiles. *One run vs pool*: each run's own medians against the pool. *Leave one run out*: min / median /",
          "max over the runs of the replayed median against the pool of the other runs (with >= 3 runs).",
          "*Interleaved profiles*: the replayed scores of the profiles stepped in an accuracy run's own rounds",
          "(`accuracy.interleave_profile`, kept in `profiles/interleaved`), which saw the machine the plans ran on. Target:",
          f"Spearman >= {TARGET_SPEARMAN} (met: the median over profiles reaches it).", "", note]
    for title, scores in pools:
        md += ["", f"## {title}", "",
               "| setup | runs | plans | one run vs pool | profiles | replayed | met | additive | leave one run out "
               "| speed-matched (diagnostic) | interleaved profiles |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in scores:
            summary = s.summary()

            def text(part: str) -> str:
                return "{min:.3f} / {median:.3f} / {max:.3f}".format(**summary[part]) if summary[part] else "-"
            met = "yes" if summary["target_met"] else "**no**"
            md.append(f"| {s.setup} | {len(s.runs)} | {s.plans} | {text('agreement')} | {len(s.profiles)} "
                      f"| {text('replayed')} | {met} | {text('additive')} | {text('leave_one_out')} "
                      f"| {text('speed_matched')} | {text('interleaved')} |")
        md += ["", "Runs: " + "; ".join(f"{s.setup}: " + ", ".join(f"`{r}`" for r in s.runs) for s in scores) + "."]
    if pools:
        title, scores = pools[-1]
        md += ["", "## Per profile", "",
               f"Each profile's replayed / additive score against the pool of *{title}*, with its one-layer step at the",
               "lowest degree (ms, all compute: the machine's speed while it was taken), in the order they were taken.",
               "*Step vs score*: Spearman of that step against the replayed score over the setup's profiles (positive:",
               "the profiles taken while the machine ran fast score lower).", "",
               "*Speed-matched* is a diagnostic, not a score: the replayed Spearman once the profile's compute is scaled",
               "so that it replays the uniform lowest-degree plan at that plan's measured step (it uses a measured step).",
               "Where it reaches the target and the replayed score does not, the miss is the profile's speed, not the model.", "",
               "| setup | run | profile | taken at | lowest-degree step ms | replayed | additive | speed-matched |",
               "|---|---|---|---|---|---|---|---|"]
        for s in scores:
            for name, at, step, rep, add, fit in zip(s.profiles, s.profiled_at, s.profile_step_ms, s.replayed, s.additive,
                                                     s.speed_matched):
                parts = Path(name).parts
                run = parts[parts.index("profiles") - 1] if "profiles" in parts else "-"
                kind = "interleaved" if is_interleaved(name) else "fresh" if "fresh" in parts else "in-run"
                md.append(f"| {s.setup} | `{run}` | {kind} | {at} | "
                          f"{'-' if step is None else f'{step:.1f}'} | {rep:.3f} | {add:.3f} | "
                          f"{'-' if fit is None else f'{fit:.3f}'} |")
        md += ["", "Step vs score: " + ", ".join(f"{s.setup} {_step_vs_score(s)}" for s in scores) + "."]
    return "\n".join(md) + "\n"
