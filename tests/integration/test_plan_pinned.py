"""``oases-plan`` on the README's planner examples, its printed lines and chosen plans pinned.

Why: the planner's front door (:func:`oases_ds.planner.make_plan`) and the typed cost table were
refactored out of the CLI; this holds every line it prints and every plan it writes to what the
code printed before, on inputs that do not depend on this machine's speed: stored profiles
(copied under ``tests/fixtures/profiles``, the cm9 ones from cost-model run M, one cm8 one for
the older table format) put in the profile cache or given as ``table=``, and analytic tables.
Only the solver's and the analytic table's own run times are masked.  No process is launched
besides the CLI.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from oases_ds.planner.costs import CostTable
from oases_ds.planner.profile import cache_path
from support import ROOT, plan_cli

FIXTURES = Path(ROOT) / "tests" / "fixtures"
PROFILES = FIXTURES / "profiles"
GPT_T2, GPT_T4, GPT_T2_CM8 = "gpt_t2_cm9.json", "gpt_t4_cm9.json", "gpt_t2_cm8.json"
"""Stored profiles (run M: ``gpt_small`` on an EMULATED 0.2 Gbit/s link, T=2 micro-batch 8 and T=4
micro-batch 16; the cm8 one run E's, from ``benchmarks/results/cost_model_runs``), renamed: Hydra reads a comma in
an override as a list."""
SMALL = ("model=gpt_small", "cluster=cpu_0_2g")

CASES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    # README "oases-plan model=gpt_small devices=2 micro_batch=8", the profile reused from the cache
    "readme_profile": (GPT_T2, (*SMALL, "devices=2", "micro_batch=8")),
    # the same profile as table=, 6 layers, the ILP
    "table_ilp": (None, (*SMALL, "devices=2", "micro_batch=8", f"table={PROFILES / GPT_T2}", "layers=6",
                         "planner.solver=ilp")),
    # a cost model 8 table file (the older format) as table=
    "table_cm8": (None, (*SMALL, "devices=2", "micro_batch=8", f"table={PROFILES / GPT_T2_CM8}")),
    # T=4 under a memory limit: the replay ranks three uniform plans
    "tmp4": (GPT_T4, (*SMALL, "devices=4", "micro_batch=16", "memory_limit=24MiB")),
    # an analytic table whose limit makes the solver mix degrees
    "analytic_mix": (None, ("cost=analytic", "model=gpt_7_5b", "cluster=eth_10g", "devices=8", "micro_batch=16",
                            "layers=4", "memory_limit=10.5GiB")),
    # README "Pipeline stages": GPT-39.1B in 8 stages
    "readme_stages": (None, ("cost=analytic", "model=gpt_39_1b", "cluster=eth_25g", "devices=8", "micro_batch=4",
                             "planner.min_degree=4", "pipeline_stages=8", "memory_limit=22GiB")),
}

STAGE_ATTN = [4, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 4, 4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
              4, 4, 4, 8, 4, 4, 4, 4, 4, 4]
STAGE_MLP = [4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 8, 4, 4, 4, 4, 8, 8, 4, 4, 4, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
             4, 4, 8, 8, 4, 4, 4, 4, 4, 4]
PLANS: dict[str, dict] = {
    "readme_profile": {"attn": [1] * 4, "mlp": [1] * 4, "ms": 381.622300497237, "solver": "pareto-dp"},
    "table_ilp": {"attn": [1] * 6, "mlp": [1] * 6, "ms": 526.1269546020579, "solver": "ortools-SCIP"},
    "table_cm8": {"attn": [1] * 4, "mlp": [1] * 4, "ms": 405.49075800813466, "solver": "pareto-dp"},
    "tmp4": {"attn": [2] * 4, "mlp": [2] * 4, "ms": 740.5216446234084, "solver": "pareto-dp"},
    "analytic_mix": {"attn": [2, 2, 2, 2], "mlp": [2, 2, 2, 4], "ms": 3367.7586983256324, "solver": "pareto-dp"},
    "readme_stages": {"attn": STAGE_ATTN, "mlp": STAGE_MLP, "ms": 80301.13008924451, "solver": "stage-dp",
                      "stage_layers": [5, 6, 6, 6, 6, 6, 7, 6]},
}
"""What each case wrote: per-block degrees, the predicted step, the solver's name and the stage split."""


def normalised(text: str, tmp: Path) -> str:
    """``text`` with the run-dependent parts masked: solver and table-building times, the paths."""
    text = re.sub(r"solved in [0-9.]+ ms", "solved in <ms> ms", text)
    text = re.sub(r"computed in [0-9.]+ ms", "computed in <ms> ms", text)
    return text.replace(str(tmp), "<tmp>").replace(str(PROFILES), "<profiles>")


@pytest.mark.parametrize("case", sorted(CASES))
def test_printed_lines_and_plan_are_unchanged(tmp_path: Path, case: str) -> None:
    cached, overrides = CASES[case]
    cache = tmp_path / "cache"
    cache.mkdir()
    if cached is not None:  # under the name the cache looks it up by
        key = CostTable.from_json(PROFILES / cached).key()
        shutil.copy(PROFILES / cached, cache_path(cache, key))
    out = tmp_path / "plan.json"
    proc = plan_cli(*overrides, f"planner.cache_dir={cache}", f"out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = (FIXTURES / "plan_cli" / f"{case}.txt").read_text()
    assert normalised(proc.stdout, tmp_path) == expected
    plan, want = json.loads(out.read_text()), PLANS[case]
    assert (plan["attn_degrees"], plan["mlp_degrees"]) == (want["attn"], want["mlp"])
    assert plan["predicted_step_ms"] == pytest.approx(want["ms"], rel=1e-12)
    assert plan["solver_name"] == want["solver"]
    assert plan["stage_layers"] == want.get("stage_layers")
