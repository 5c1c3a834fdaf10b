"""oases-plan as a user runs it: a subprocess on a saved cost table (no profiling)."""
from __future__ import annotations

import json

import pytest

from oases_ds.planner.objective import predict_step_ms
from oases_ds.planner.plan import Plan
from support import plan_cli, random_table

@pytest.fixture
def table_file(tmp_path):
    table = random_table(7, 12)
    path = tmp_path / "costs.json"
    table.to_json(path)
    return table, path


def lean_bytes(table) -> float:
    return sum(min(c.memory_bytes for c in table.blocks[kind].values()) for kind in table.block_kinds())


@pytest.mark.parametrize("solver", ["ilp", "dp"])
def test_plan_from_a_table_end_to_end(tmp_path, table_file, solver):
    table, path = table_file
    out = tmp_path / "plan.json"
    limit = lean_bytes(table) * 1.1
    proc = plan_cli(f"table={path}", f"memory_limit={limit:.0f}", f"planner.solver={solver}", f"out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = Plan.from_json(out)
    assert plan.layers == 12 and plan.memory_bytes <= limit
    assert predict_step_ms(table, plan) == pytest.approx(plan.predicted_step_ms, rel=1e-9)
    text = proc.stdout
    assert f"{table.key()} | 12 layers | from {path}" in text
    assert "layers 0" in text and "predicted step" in text and "solved in" in text
    assert "best uniform:" in text and f"wrote {out}" in text
    assert json.loads(out.read_text())["table_key"] == table.key()


def test_layers_override_and_memory_units(tmp_path, table_file):
    _, path = table_file
    proc = plan_cli(f"table={path}", "layers=3", "memory_limit=100GiB", "planner.solver=dp", f"out={tmp_path / 'p.json'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| 3 layers |" in proc.stdout and "limit 102400.000 MiB" in proc.stdout


def test_infeasible_memory_is_one_line_with_the_minimum(tmp_path, table_file):
    table, path = table_file
    proc = plan_cli(f"table={path}", "memory_limit=1MB", f"out={tmp_path / 'p.json'}")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: memory_limit: no plan fits: the minimum memory any plan needs is ")
    assert f"{lean_bytes(table):.6g} bytes per device" in last
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("override, message", [
    ("memory_limit=lots", "error: memory_limit='lots' is not a size"),
    ("planner.solver=gurobi", "error: planner.solver='gurobi' unknown"),
    ("mode=tune", "error: mode='tune' unknown"),
])
def test_bad_options_name_the_field(tmp_path, table_file, override, message):
    _, path = table_file
    proc = plan_cli(f"table={path}", override, f"out={tmp_path / 'p.json'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message)


@pytest.mark.distributed
def test_profile_then_plan_with_a_real_profile(tmp_path):
    common = ["model=gpt_tiny", "model.vocab_size=64", "model.seq_len=8", "micro_batch=4", "planner=fast",
              f"planner.cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'plan.json'}"]
    first = plan_cli(*common, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "profiled in" in first.stdout and "attn    2" in first.stdout
    second = plan_cli(*common, "memory_limit=64MiB", timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "| reused " in second.stdout
    assert Plan.from_json(tmp_path / "plan.json").devices == 2


def test_oases_plan_with_auto_recompute_prints_and_writes_each_blocks_policy(tmp_path):
    """``planner.recompute=auto`` on an analytic table (nothing launched): a limit between the
    all-recompute and the all-store plan's memory gives a mix, printed per block and written into
    the plan JSON that oases-train reads; ``planner.recompute`` unknown is one line."""
    from oases_ds.planner.plan import Plan

    out = tmp_path / "plan.json"
    args = ("cost=analytic", "model=gpt_39_1b", "cluster=eth_25g", "devices=8", "micro_batch=4", "layers=4",
            "planner.min_degree=4", "planner.recompute=auto", f"out={out}")
    done = plan_cli(*args, "memory_limit=11GiB")  # oases-plan prints: leanest plan 10.26 GiB, every MLP stored 11.26 GiB
    assert done.returncode == 0, done.stderr
    plan = Plan.from_json(out)
    assert "store" in plan.block_policies() and "oases" in plan.block_policies(), done.stdout
    assert any(line.strip().startswith("layers") and "store" in line for line in done.stdout.splitlines())
    assert "MiB of it unused" in done.stdout
    bad = plan_cli(*args, "planner.recompute=always")
    assert bad.returncode != 0
    assert "planner.recompute='always' unknown; choose one of oases, auto" in bad.stderr.strip().splitlines()[-1]
