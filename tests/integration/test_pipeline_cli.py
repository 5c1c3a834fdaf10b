"""``oases-train pipeline_stages=...`` as a user runs it: a real subprocess launching its ranks,
and the bad settings refused in one ``error:`` line before any rank starts."""
from __future__ import annotations

import json
import os

import pytest

from oases_ds.cli import train
from support import refused, train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.distributed
def test_oases_train_with_two_stages_trains_and_reports_the_layout(tmp_path, capfd):
    stats = tmp_path / "stats.json"
    run = train_cli(capfd, "model=gpt_tiny", "data=synthetic", "nprocs=2", "tensor_parallel_size=1", "pipeline_stages=2",
                    "pipeline_schedule=gpipe", "grad_accum=2", "micro_batch=2", "steps=4", f"stats_out={stats}",
                    f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "2 ranks = PP 2 x TMP 1 x DP 1" in run.stdout
    summary = json.loads(stats.read_text())["summary"]
    assert summary["steps_run"] == 4 and summary["global_steps"] == 4
    history = json.loads(stats.read_text())["history"]
    assert all(h["pipeline_bytes"] > 0 for h in history)


@pytest.mark.parametrize("args,expected", [
    (("pipeline_stages=3", "nprocs=3", "tensor_parallel_size=1"), "oases.pipeline_stages=3 exceeds model.num_layers=2"),
    (("pipeline_stages=2", "nprocs=2", "tensor_parallel_size=2"),
     "pipeline_stages=2 x tensor_parallel_size=2 = 4 does not divide world size 2"),
    (("pipeline_stages=2", "nprocs=2", "tensor_parallel_size=1", "pipeline_layers=[2,1]"),
     "oases.pipeline_layers=[2, 1] sums to 3 but model.num_layers=2"),
    (("pipeline_stages=2", "nprocs=2", "tensor_parallel_size=1", "export_hf=out"), "export_hf=out: not supported with"),
])
def test_bad_pipeline_settings_are_refused_before_launch(capsys, monkeypatch, tmp_path, args, expected):
    line = refused(capsys, monkeypatch, tmp_path, train, "model=gpt_tiny", *args)
    assert expected in line, line
