"""``tests/gpu/smoke.sh`` on a machine without CUDA, and the pieces of it that run on CPU.

The smoke script is what the first GPU run executes, with minutes of device time and no
second chance to fix a typo: here it must exit 0 with every CUDA step skipped and its
reason in the JSON, and the step scripts that can also run over gloo on CPU
(``smoke_nccl.py --device cpu``, ``smoke_lightning.py --accelerator cpu``) and the check of
``oases-train``'s log are run for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = os.path.join(ROOT, "tests", "gpu")
sys.path.insert(0, GPU)

import smoke  # noqa: E402
from support import train_cli  # noqa: E402


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OASES_BACKEND="gloo", PYTHONPATH=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the smoke script runs its CUDA steps")
def test_the_smoke_script_runs_here_skipping_the_cuda_steps_with_their_reason(tmp_path):
    done = subprocess.run(["bash", os.path.join(GPU, "smoke.sh")], cwd=ROOT, capture_output=True, text=True,
                          env=dict(_env(), OUT=str(tmp_path), PYTHON=sys.executable), timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    payload = json.loads((tmp_path / "gpu_smoke.json").read_text())
    steps = {s["step"]: s for s in payload["steps"]}
    assert steps["environment"]["status"] == "passed" and steps["environment"]["data"]["torch"] == torch.__version__
    cuda_steps = set(steps) - {"environment"}
    assert cuda_steps == {"gpu_tests", "nccl_async", "train_bf16", "train_bf16_resume", "train_zero1", "host_overhead",
                          "lightning"}
    assert all(steps[s]["status"] == "skipped" and "no CUDA device" in steps[s]["reason"] for s in cuda_steps)
    assert payload["failed"] == []


def test_a_step_fails_on_its_exit_code_its_check_or_its_timeout():
    env = _env()
    assert smoke.run_step("ok", [sys.executable, "-c", "print('{\"ok\": true}')"], 30, env, smoke._last_json)["status"] == "passed"
    bad = smoke.run_step("bad", [sys.executable, "-c", "print('{\"ok\": false}')"], 30, env, smoke._last_json)
    assert bad["status"] == "failed" and bad["data"] == {"ok": False}
    crashed = smoke.run_step("crash", [sys.executable, "-c", "raise SystemExit(3)"], 30, env)
    assert crashed["status"] == "failed" and crashed["exit_code"] == 3
    slow = smoke.run_step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1, env)
    assert slow["status"] == "failed" and slow["reason"] == "timed out after 1 s"


def test_the_budget_cuts_the_steps_and_the_json_is_written_after_each(tmp_path, monkeypatch):
    """Step one sleeps past the budget's share: it is cut at the budget, the next is skipped with
    the reason, and the JSON on disk already held step one when step two began."""
    path = str(tmp_path / "gpu_smoke.json")
    seen = "import json, sys; print(json.dumps({'ok': True, 'steps': [s['step'] for s in json.load(open(sys.argv[1]))['steps']]}))"
    plan = [("first", 60, [sys.executable, "-c", "print('{\"ok\": true}')"], smoke._last_json),
            ("reads_json", 60, [sys.executable, "-c", seen, path], smoke._last_json),
            ("slow", 60, [sys.executable, "-c", "import time; time.sleep(60)"], None),
            ("late", 60, [sys.executable, "-c", "pass"], None)]
    steps: list[dict] = []
    monkeypatch.setattr(smoke, "MIN_STEP_S", 1.0)
    smoke.run_plan(plan, steps, _env(), None, 6.0, path)
    by = {s["step"]: s for s in steps}
    assert by["first"]["status"] == "passed" and by["reads_json"]["data"]["steps"] == ["first"]
    assert by["slow"]["status"] == "failed" and by["slow"]["reason"].startswith("timed out after")
    assert by["late"]["status"] == "skipped" and "budget" in by["late"]["reason"]
    assert json.loads((tmp_path / "gpu_smoke.json").read_text())["failed"] == ["slow"]


def test_the_nccl_step_script_runs_over_gloo_against_the_reference():
    done = subprocess.run([sys.executable, os.path.join(GPU, "smoke_nccl.py"), "--device", "cpu"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["backend"] == "gloo"
    assert len(result["parity"]) == 12 and all(r["nccl_collectives"] > 0 for r in result["parity"].values())
    assert result["timeline"]["lanes"] == ["comm", "compute", "wait"] and result["dp_reducer"]["nccl_collectives"] > 0


@pytest.mark.distributed
def test_the_lightning_step_script_trains_five_steps_on_cpu():
    done = subprocess.run([sys.executable, os.path.join(GPU, "smoke_lightning.py"), "--accelerator", "cpu"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["global_step"] == 5 and result["step_devices"] == ["cpu"]


@pytest.mark.distributed
def test_the_train_check_reads_oases_trains_log(tmp_path, capfd):
    # the smoke's train steps judge oases-train by its printed log: read a real one
    done = train_cli(capfd, "model=gpt_tiny", "steps=6", "log_every=2", "lr=0.01", f"hydra.run.dir={tmp_path}/hydra",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    read = smoke._train_check(0)(done.stdout)
    assert len(read["losses"]) == 4 and read["started_from"] == 0  # steps 1, 2, 4, 6
    assert read["ok"] == (read["losses"][-1] < read["losses"][0])
    assert not smoke._train_check(30)(done.stdout)["ok"]  # not a resume from step 30
