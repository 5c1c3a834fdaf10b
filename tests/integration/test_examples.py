"""The README's three ways in, run as a user runs them: the DeepSpeed script under torchrun,
the Lightning script, and an ``oases-train --multirun`` sweep."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_the_deepspeed_script_trains_under_torchrun():
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = _run([torchrun, "--nproc_per_node", "2", "examples/deepspeed_train.py"])
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 4 and losses[-1] < 5.0  # bytes: ln 256 = 5.5 at the start


@pytest.mark.distributed
def test_the_lightning_script_trains():
    done = _run([sys.executable, "examples/lightning_train.py"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^trained 20 steps, loss [\d.]+$", done.stdout, re.M), done.stdout[-2000:]


@pytest.mark.distributed
def test_a_hydra_multirun_sweep_runs_each_schedule(tmp_path):
    done = _run([sys.executable, "-m", "oases_ds.cli.train", "--multirun", "schedule=oases,megatron", "steps=3",
                 "log_every=3", "model=gpt_tiny", f"hydra.sweep.dir={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"^done: 3 steps .* schedule (\w+)$", done.stdout, re.M) == ["oases", "megatron"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]
