"""The cost-model study's pooled scoring of stored runs (oases_ds/bench/cost_model.py), against hand-computed pools."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from oases_ds.bench.cost_model import (
    PRICED_PROFILE_VERSIONS,
    RUN_ARCHIVES,
    PooledScore,
    Setup,
    is_interleaved,
    pack_run,
    pooled_score,
    plan_of_row,
    pooled_steps,
    profile_version,
    repriced_spearman,
    scaled_compute,
    speed_matched_table,
    stored_files,
    stored_results,
    stored_tables,
    unversioned,
)
from oases_ds.planner.costs import COST_MODEL_VERSION, CostTable
from oases_ds.planner.replay import replayed_or_additive

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
RUN_E = FIXTURES / "study_runs" / "run_e_in_sample.json"
"""Run E of the study's ``in_sample`` setup (cost model 8): its result file and the profile it took."""
RUN_E_PROFILE = FIXTURES / "profiles" / "gpt_t2_cm8.json"
ALL = Setup("all", "every plan", ())
MIXED = Setup("mixed", "mixes only", (), mixed_only=True)


def run(steps: dict[tuple[int, int], float]) -> dict:
    """A result of one-layer plans (attn degree, mlp degree) -> measured ms."""
    return {"rows": [{"attn": [a], "mlp": [m], "measured_ms": ms} for (a, m), ms in steps.items()]}


def test_pooled_steps_are_geometric_means_of_each_runs_relative_steps():
    """Run 1: 100, 200, 400 ms (geometric mean 200: 0.5, 1, 2).  Run 2: 100, 400, 400 (geometric mean
    100^(1/3) 400^(2/3) = 251.98: 0.3969, 1.5874, 1.5874).  Pooled: sqrt(0.5 x 0.3969) = 0.4454,
    sqrt(1.5874) = 1.2599, sqrt(2 x 1.5874) = 1.7818.  Run 2 ties two plans the pool orders:
    Spearman of (1, 2.5, 2.5) against (1, 2, 3) is 0.866."""
    pool = pooled_steps(ALL, [run({(1, 1): 100, (2, 2): 200, (1, 2): 400}), run({(1, 1): 100, (2, 2): 400, (1, 2): 400})])
    assert pool.relative == pytest.approx([0.4454, 1.2599, 1.7818], abs=1e-4)
    assert pool.agreement == pytest.approx([1.0, math.sqrt(3) / 2])


def test_a_run_slower_throughout_changes_nothing():
    first = run({(1, 1): 120, (2, 2): 100, (1, 2): 130, (2, 1): 90})
    slower = run({k: 1.1 * v for k, v in {(1, 1): 120, (2, 2): 100, (1, 2): 130, (2, 1): 90}.items()})
    alone, both = pooled_steps(ALL, [first]), pooled_steps(ALL, [first, slower])
    assert both.relative == pytest.approx(alone.relative) and both.agreement == pytest.approx([1.0, 1.0])


def test_only_the_plans_every_run_measured_are_pooled():
    """Run 2 lacks plan (2, 1): it is left out of the pool; a mixes-only setup keeps the mixes only;
    under three shared plans a rank correlation means nothing and is refused."""
    one = run({(1, 1): 100, (2, 2): 110, (1, 2): 120, (2, 1): 130, (4, 1): 140, (1, 4): 150})
    two = run({(1, 1): 100, (2, 2): 110, (1, 2): 120, (4, 1): 140, (1, 4): 150})
    plans = [[1, 1], [2, 2], [1, 2], [4, 1], [1, 4]]
    assert [r["attn"] + r["mlp"] for r in pooled_steps(ALL, [one, two]).rows] == plans
    assert [r["attn"] + r["mlp"] for r in pooled_steps(MIXED, [one, two]).rows] == plans[2:]
    three = run({(1, 1): 100, (2, 2): 110, (1, 2): 120, (2, 1): 130})
    with pytest.raises(ValueError, match="share 2 scored plans; a rank correlation needs 3"):
        pooled_steps(MIXED, [one, three])
    with pytest.raises(ValueError, match="no runs to pool"):
        pooled_steps(ALL, [])


def test_one_run_pooled_scores_as_the_run_itself():
    """The committed run E of ``in_sample`` and the profile it took: pooled alone, the replayed score
    is the run's own re-priced Spearman (normalising a run by a constant keeps its ranks), and the
    additive one is the additive sum's."""
    result = json.loads(RUN_E.read_text())
    profile = RUN_E_PROFILE
    tables = [(profile, CostTable.from_json(profile))]
    setup = Setup("in_sample", "", ())
    score = pooled_score(setup, [("E", result)], [(str(p), t) for p, t in tables])
    table = dataclasses.replace(tables[0][1], layers=len(result["rows"][0]["attn"]))
    assert score.replayed == [pytest.approx(repriced_spearman(setup, result, table))]
    assert score.agreement == [pytest.approx(1.0)] and score.plans == len(result["rows"])


def test_leaving_one_run_out_shows_a_verdict_that_hangs_on_one_run():
    """Runs A and B measure exactly what run E's profile predicts; run C ranks the plans the other way
    round with three times the spread (log-relative steps -3l against A's l).  All three pooled:
    (l + l - 3l) / 3 = -l/3, reversed: -1.  Without A or without B: (l - 3l) / 2 = -l, reversed: -1.
    Without C: l, the prediction's order: +1.  With two runs nothing is left out."""
    result = json.loads(RUN_E.read_text())
    profile = RUN_E_PROFILE
    table = CostTable.from_json(profile)
    layered = dataclasses.replace(table, layers=len(result["rows"][0]["attn"]))
    predicted = replayed_or_additive(layered, [plan_of_row(r, table.devices) for r in result["rows"]])
    assert len(set(predicted)) == len(predicted)  # distinct: the ranks are strict
    mean = statistics.fmean(math.log(p) for p in predicted)

    def measured(power: float) -> dict:
        rows = [{**r, "measured_ms": 100 * math.exp(power * (math.log(p) - mean))} for r, p in zip(result["rows"], predicted)]
        return {**result, "rows": rows}

    runs = [("A", measured(1.0)), ("B", measured(1.0)), ("C", measured(-3.0))]
    score = pooled_score(Setup("in_sample", "", ()), runs, [("E", table)])
    assert score.replayed == [pytest.approx(-1.0)]
    assert score.leave_one_out == [pytest.approx(-1.0), pytest.approx(-1.0), pytest.approx(1.0)]
    assert score.summary()["leave_one_out"] == {"min": pytest.approx(-1.0), "median": pytest.approx(-1.0), "max": pytest.approx(1.0)}
    two = pooled_score(Setup("in_sample", "", ()), runs[:2], [("E", table)])
    assert two.leave_one_out == [] and two.summary()["leave_one_out"] is None and two.replayed == [pytest.approx(1.0)]


def test_speed_matching_scales_compute_only_and_hits_the_measured_step():
    """Run E's ``in_sample`` profile: doubling the compute doubles every per-op and per-block compute
    time and leaves the link, the collective overhead and the gradient sync alone; matched to a
    measured step 20% above its own replay of uniform degree 1, the replay of that plan lands on it."""
    profile = RUN_E_PROFILE
    table = dataclasses.replace(CostTable.from_json(profile), layers=4)
    doubled = scaled_compute(table, 2.0)
    one, two = table.op_profile[2], doubled.op_profile[2]
    assert {k: 2 * v for k, v in one.op_ms.forward_ms.items()} == pytest.approx(two.op_ms.forward_ms)
    assert {k: 2 * v for k, v in one.op_ms.recompute_ms.items()} == pytest.approx(two.op_ms.recompute_ms)
    assert two.block_ms["attn"].backward_ms == pytest.approx(2 * one.block_ms["attn"].backward_ms)
    assert two.payload_bytes == one.payload_bytes
    assert doubled.blocks["mlp"][1].fwd_ms == pytest.approx(2 * table.blocks["mlp"][1].fwd_ms)
    assert doubled.blocks["mlp"][1].grad_sync_ms == table.blocks["mlp"][1].grad_sync_ms
    assert (doubled.collective_overhead_ms, doubled.bandwidth_gbps) == (table.collective_overhead_ms, table.bandwidth_gbps)
    assert table.op_profile[2] == CostTable.from_json(profile).op_profile[2]  # the original is not touched
    uniform = plan_of_row({"attn": [1] * 4, "mlp": [1] * 4}, 2)
    own = replayed_or_additive(table, [uniform])[0]
    matched = speed_matched_table(table, uniform, 1.2 * own)
    assert replayed_or_additive(matched, [uniform])[0] == pytest.approx(1.2 * own, rel=1e-4)
    assert matched.blocks["attn"][1].fwd_ms > 1.2 * table.blocks["attn"][1].fwd_ms  # the sync did not grow: compute grew more
    no_compute = replayed_or_additive(scaled_compute(table, 0.0), [uniform])[0]
    assert 0 < no_compute < own and speed_matched_table(table, uniform, 0.9 * no_compute) is None


def test_the_summary_spans_the_interleaved_profiles_apart():
    """Of four profiles, the two under ``profiles/interleaved`` (scores 0.9 and 0.7) make the interleaved
    span; the in-run and fresh ones (0.5, 0.3) count only in the span over all; none interleaved: no span."""
    names = ["r/profiles/a_cm8.json", "r/profiles/fresh/b_cm8-x.json", "r/profiles/interleaved/c_cm8-x.json",
             "s/profiles/interleaved/d_cm8-y.json"]
    score = PooledScore("s", ["r", "s"], 5, [1.0, 1.0], names, [0.5, 0.3, 0.9, 0.7], [0.1] * 4)
    assert [is_interleaved(n) for n in names] == [False, False, True, True]
    assert score.summary()["interleaved"] == {"min": 0.7, "median": pytest.approx(0.8), "max": 0.9}
    assert score.summary()["replayed"] == {"min": 0.3, "median": pytest.approx(0.6), "max": 0.9}
    assert dataclasses.replace(score, profiles=names[:2] * 2).summary()["interleaved"] is None


def test_stored_tables_are_this_cost_models_profiles_of_the_setup(tmp_path):
    """A result measured under cost model 5 is priced with the profiles this commit's profiler took
    (file name ``_cm<n>``, as the cache and ``--reprofile`` name them): a cost model 5 profile, one of
    another setup (here T=4) and one without per-op times (it cannot be replayed) are left out."""
    source = RUN_E_PROFILE
    table = CostTable.from_json(source)
    (tmp_path / "a" / "profiles").mkdir(parents=True)
    fresh = tmp_path / "b" / "profiles" / "fresh"
    fresh.mkdir(parents=True)
    v = COST_MODEL_VERSION
    shutil.copy(source, tmp_path / "a" / "profiles" / f"run_cm{v}.json")
    shutil.copy(source, tmp_path / "a" / "profiles" / "old_cm5.json")
    shutil.copy(source, tmp_path / "a" / "profiles" / "same_profiler_cm8.json")  # cost model 9 prices 8's profiles
    shutil.copy(source, fresh / f"kept_cm{v}-2026-12-01T221753.json")
    dataclasses.replace(table, op_profile={}).to_json(fresh / f"no_ops_cm{v}-2026-12-01T221801.json")
    dataclasses.replace(table, devices=4).to_json(fresh / f"t4_cm{v}-2026-12-01T221809.json")
    found = stored_tables(tmp_path, table.key().rsplit("|cm", 1)[0] + "|cm5")
    assert sorted(p.name for p, _ in found) == [f"kept_cm{v}-2026-12-01T221753.json", f"run_cm{v}.json",
                                                 "same_profiler_cm8.json"]
    assert [profile_version(Path(n)) for n in ("x_cm12.json", "x_cm8-2026-12-01T221753.json", "x.json")] == [12, 8, None]


def test_the_runner_pools_the_stored_runs(tmp_path):
    """``--pooled`` over two copies of run E's ``in_sample`` (one 10% slower) and its profile: both runs
    agree with the pool, and the report's replayed score is the one-run score.  A setup with runs but no
    stored profile is reported as not scored, not a crash."""
    results = tmp_path / "results"
    for name, factor in (("run1", 1.0), ("run2", 1.1)):
        result = json.loads(RUN_E.read_text())
        for r in result["rows"]:
            r["measured_ms"] *= factor
        (results / name).mkdir(parents=True)
        (results / name / "planner_accuracy-in_sample.json").write_text(json.dumps(result))
    unprofiled = json.loads((results / "run1" / "planner_accuracy-in_sample.json").read_text())
    unprofiled["table_key"] = unprofiled["table_key"].replace("mb8", "mb4")  # a setup no stored profile was taken for
    (results / "run1" / "planner_accuracy-llama.json").write_text(json.dumps(unprofiled))
    (results / "run1" / "profiles").mkdir()
    profile = RUN_E_PROFILE
    shutil.copy(profile, results / "run1" / "profiles" / f"in_sample_cm{COST_MODEL_VERSION}.json")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost_model_oos.py"), "--pooled", "--setup", "in_sample",
                           "--setup", "tmp4", "--setup", "llama", "--results-dir", str(results), "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads((results / "cost_model_pooled.json").read_text())
    score = payload["pools"]["all"]["in_sample"]
    assert score["summary"]["agreement"] == {"min": pytest.approx(1.0), "median": pytest.approx(1.0), "max": pytest.approx(1.0)}
    one = pooled_score(Setup("in_sample", "", ()), [("E", json.loads((results / "run1" / "planner_accuracy-in_sample.json").read_text()))],
                       [("p", CostTable.from_json(profile))])
    assert score["replayed"] == [pytest.approx(one.replayed[0])] and score["summary"]["replayed"]["median"] == score["replayed"][0]
    assert "tmp4" not in payload["pools"]["all"]  # no run of it there: no row
    assert "llama" not in payload["pools"]["all"] and "no stored profile" in payload["skipped"]["all/llama"]
    (report,) = tmp_path.glob("cost_model_pooled-*.md")
    assert f"| in_sample | 2 | 10 | 1.000 / 1.000 / 1.000 | 1 | {one.replayed[0]:.3f} / " in report.read_text()


def test_a_steps_breakdown_splits_the_ranks_wall_time_by_lane():
    """Compute 3 + 2 ms, waits 4 ms at W3.0 (twice: 1 + 3) and 5 ms at Wb7.1, on a rank whose own step took
    20 ms: rest 20 - 5 - 9 = 6 ms.  Comm lane intervals (the link) are not the rank's time."""
    from oases_ds.bench.cost_model import step_breakdown
    from oases_ds.runtime.timeline import Event

    events = [Event("F0.0", "compute", 0, 0.000, 0.003), Event("W3.0", "wait", 0, 0.003, 0.004),
              Event("C3.0:forward", "comm", 0, 0.003, 0.010), Event("B0.0", "compute", 0, 0.004, 0.006),
              Event("W3.0", "wait", 0, 0.006, 0.009), Event("Wb7.1", "wait", 1, 0.009, 0.014)]
    out = step_breakdown(events, 20.0)
    assert out["compute_ms"] == pytest.approx(5.0) and out["rest_ms"] == pytest.approx(6.0)
    assert out["waits_ms"] == {"W3.0": pytest.approx(4.0), "Wb7.1": pytest.approx(5.0)}


@pytest.mark.parametrize("setup", ["tmp4", "llama", "link_500m"])
def test_a_stored_results_config_rebuilds_the_profile_it_was_priced_with(setup):
    """``ProfileSpec.from_config`` (what the planner and ``benchmarks/interleave_check.py`` build) names the
    profile the stored run's planner recorded: devices, model family, link and schedule all reach the key."""
    from oases_ds.planner.profile import ProfileSpec

    result = json.loads((FIXTURES / "study_runs" / f"run_j_{setup}_config.json").read_text())  # run J's config and key
    spec = ProfileSpec.from_config(result["config"])
    assert unversioned(spec.key()) == unversioned(result["table_key"])
    assert spec.devices == result["config"]["devices"] and spec.repeats == result["config"]["planner"]["repeats"]


def test_a_packed_run_is_read_where_it_lies(tmp_path):
    """A run folder packed into ``cost_model_runs/<run>.tar.gz`` gives the same results and profiles, under
    the names they had unpacked; the same files pack to the same bytes."""
    run = tmp_path / "work" / "run_x"
    (run / "profiles" / "fresh").mkdir(parents=True)
    shutil.copy(RUN_E, run / "planner_accuracy-in_sample.json")
    shutil.copy(RUN_E_PROFILE, run / "profiles" / "fresh" / f"in_sample_cm{COST_MODEL_VERSION}-2026-12-01T221753.json")
    (run / "notes.py").write_text("print('not a table')\n")
    results = tmp_path / "results"
    archive = pack_run(run, results / RUN_ARCHIVES)
    assert pack_run(run, tmp_path / "again").read_bytes() == archive.read_bytes()
    table = CostTable.from_json(RUN_E_PROFILE)
    ((folder, result),) = stored_results(results, Setup("in_sample", "", ()))
    assert folder == results / RUN_ARCHIVES / "run_x" and result == json.loads(RUN_E.read_text())
    ((path, found),) = stored_tables(results, table.key())
    assert path == results / RUN_ARCHIVES / "run_x" / "profiles" / "fresh" / f"in_sample_cm{COST_MODEL_VERSION}-2026-12-01T221753.json"
    assert found == table and is_interleaved(path) is False


def test_every_stored_profile_of_the_study_loads():
    """The cost-model study's archived profiles (cost models 4-9, the older table layout) all load; the
    ones this cost model prices (8 and 9) into typed profiles at every degree."""
    root = ROOT / "benchmarks" / "results"
    profiles = stored_files(root, lambda path: "profiles" in path.parts[:-1] and path.suffix == ".json")
    assert len(profiles) > 200
    priced = 0
    for path, raw in profiles:
        table = CostTable.from_bytes(raw, str(path))
        if profile_version(path) in PRICED_PROFILE_VERSIONS:
            priced += 1
            assert table.family in ("gpt", "bert", "llama") and sorted(table.op_profile) == list(table.degrees), path
    assert priced > 150
