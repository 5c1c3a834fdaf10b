"""One GPU smoke run: every step under a timeout, every result in one JSON file.

What a first run on a GPU machine must learn, in at most 10 minutes on one H200
(``tests/gpu/smoke.sh`` wraps this under ``timeout``):

====================  ==========================================================
step                  what it runs, what it checks
====================  ==========================================================
``environment``       torch / CUDA / NCCL versions, the device, DeepSpeed's accelerator,
                      whether FusedAdam could build (nvcc, ninja)
``gpu_tests``         ``pytest tests/gpu -m gpu``: parity at TMP 1 and 2, bf16, the CUDA
                      event timeline, the reducer's wait without host sync, the profiler
``nccl_async``        ``tests/gpu/smoke_nccl.py``: the executor's collectives through NCCL
                      at world size 1, each behind a 256 MiB all-reduce, against the CPU
                      reference; the DP reducer; the timeline; flash attention (LLaMA bf16)
``train_bf16``        ``oases-train`` on CUDA in bf16, 30 steps with a checkpoint at 15, and
                      its resume to 40: the loss finite and falling, the resume from step 30
``train_zero1``       ``oases-train`` bf16 with ZeRO 1, 10 steps
``host_overhead``     ``benchmarks/host_overhead.py --device cuda``: host microseconds per
                      instruction with and without the timeline
``lightning``         ``Trainer(accelerator="gpu", devices=1, strategy="oases", precision=
                      "bf16-mixed")``, 5 steps
====================  ==========================================================

Without CUDA each CUDA step is skipped with its reason and the environment step still
runs, so the script is tested on CPU machines too (``tests/integration/test_gpu_smoke.py``).
Exit code 0 unless a step failed; the JSON says which and keeps the tail of its output. It is
rewritten after every step, and ``--budget-s`` cuts each step's timeout to the time left, so a
run stopped from outside (the device call's limit) still returns what the earlier steps found.

    python tests/gpu/smoke.py --out DIR        # writes DIR/gpu_smoke.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TAIL = 4000  # characters of a step's output kept in the JSON
MIN_STEP_S = 20.0  # a step given less than this is skipped rather than started


def _env(cuda: bool) -> dict[str, str]:
    """The steps' environment: CUDA steps get DeepSpeed's CUDA accelerator and NCCL, and
    ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (freed comm buffers reusable at once)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if cuda:
        env.update(DS_ACCELERATOR="cuda", TORCH_NCCL_AVOID_RECORD_STREAMS="1")
        env.pop("OASES_BACKEND", None)
    return env


def run_step(name: str, cmd: list[str], timeout_s: float, env: dict[str, str], check: Callable[[str], dict] | None = None,
             cwd: str = ROOT) -> dict:
    """Run ``cmd``; the step passes on exit code 0 and, if given, ``check(output)["ok"]``."""
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return {"step": name, "status": "failed", "reason": f"timed out after {timeout_s:g} s",
                "seconds": round(time.monotonic() - start, 1), "output_tail": output[-TAIL:]}
    result = {"step": name, "status": "passed" if code == 0 else "failed", "exit_code": code,
              "seconds": round(time.monotonic() - start, 1), "output_tail": output[-TAIL:]}
    if code == 0 and check is not None:
        try:
            data = check(output)
        except (ValueError, KeyError, IndexError) as err:
            data = {"ok": False, "error": f"could not read the step's output: {err}"}
        result["data"] = data
        if not data.get("ok", False):
            result["status"] = "failed"
    return result


def skipped(name: str, reason: str) -> dict:
    return {"step": name, "status": "skipped", "reason": reason}


def environment() -> dict:
    """Versions and capabilities, read in this process (no CUDA work)."""
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda, "nvcc": shutil.which("nvcc"), "ninja": shutil.which("ninja")}
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError as err:
        info["deepspeed"] = f"not importable: {err}"
    return {"step": "environment", "status": "passed", "data": info}


def _last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def _train_check(first_step: int, falling: bool = True) -> Callable[[str], dict]:
    """``oases-train``'s log: losses finite (and the last below the first logged, if ``falling``),
    the run started at ``first_step``."""
    def check(output: str) -> dict:
        losses = [float(line.split("loss")[1].split("|")[0]) for line in output.splitlines() if line.startswith("step ")]
        started = f"from step {first_step}" in output
        ok = bool(losses) and all(math.isfinite(x) for x in losses) and started
        return {"losses": losses, "started_from": first_step if started else None,
                "ok": ok and (not falling or losses[-1] < losses[0])}
    return check


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir())
    ap.add_argument("--budget-s", type=float, default=560.0,
                    help="wall-clock seconds for all steps: each step's timeout is cut to what is left, and a step "
                         f"that would get under {MIN_STEP_S:g} s is skipped, so the JSON is complete before an outer kill")
    ap.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps (a rerun after a fix)")
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    env = _env(cuda)
    py = sys.executable
    steps = [environment()]
    no_cuda = "no CUDA device (torch.cuda.is_available() is False): this step needs one GPU"
    work = tempfile.mkdtemp(prefix="oases-smoke-")
    train = [py, "-m", "oases_ds.cli.train", "nprocs=1", "tensor_parallel_size=1", "model=llama_small", "bf16=true",
             "log_every=5", f"hydra.run.dir={work}/hydra"]
    plan = [
        ("nccl_async", 120, [py, "tests/gpu/smoke_nccl.py"], _last_json),
        ("gpu_tests", 240, [py, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"], None),
        ("train_bf16", 150, train + ["steps=30", f"checkpoint.dir={work}/ck", "checkpoint.every=15",
                                     f"trace={work}/trace.json"], _train_check(0)),
        ("train_bf16_resume", 90, train + ["steps=40", f"checkpoint.dir={work}/ck", "checkpoint.resume=true"],
         _train_check(30, falling=False)),
        ("train_zero1", 90, train + ["steps=10", "zero_stage=1"], _train_check(0)),
        ("lightning", 90, [py, os.path.join(HERE, "smoke_lightning.py")], _last_json),
        ("host_overhead", 90, [py, "benchmarks/host_overhead.py", "--device", "cuda", "--rounds", "3", "--runs", "10",
                               "--out", os.path.join(args.out, "host_overhead_cuda.json")], None),
    ]
    if args.only:
        unknown = set(args.only) - {name for name, *_ in plan}
        if unknown:
            ap.error(f"--only: no step named {sorted(unknown)}; the steps are {[name for name, *_ in plan]}")
        plan = [step for step in plan if step[0] in args.only]
    path = os.path.join(args.out, "gpu_smoke.json")
    run_plan(plan, steps, env, no_cuda if not cuda else None, args.budget_s, path)
    shutil.rmtree(work, ignore_errors=True)
    failed = _write(path, steps)
    print(f"smoke: wrote {path}; failed: {failed or 'none'}")
    return 1 if failed else 0


def run_plan(plan: list[tuple], steps: list[dict], env: dict[str, str], skip_reason: str | None, budget_s: float,
             path: str) -> None:
    """Run ``plan``'s ``(name, timeout_s, cmd, check)`` steps in order into ``steps`` (all skipped
    with ``skip_reason`` if given), each under ``min(timeout_s, time left of budget_s)``; a step
    that would get under ``MIN_STEP_S`` is skipped. The JSON at ``path`` is rewritten after each."""
    deadline = time.monotonic() + budget_s
    for name, timeout_s, cmd, check in plan:
        left = deadline - time.monotonic()
        if skip_reason is not None:
            steps.append(skipped(name, skip_reason))
        elif left < MIN_STEP_S:
            steps.append(skipped(name, f"the smoke run's budget (--budget-s {budget_s:g}) was spent"))
        else:
            steps.append(run_step(name, cmd, min(timeout_s, left), env, check))
        print(f"smoke: {name}: {steps[-1]['status']}", flush=True)
        _write(path, steps)  # after every step: a run killed from outside still leaves what it learnt


def _write(path: str, steps: list[dict]) -> list[str]:
    """Write the JSON atomically; return the failed steps' names."""
    failed = [s["step"] for s in steps if s["status"] == "failed"]
    payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_commit": _git_commit(), "steps": steps, "failed": failed}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)
    return failed


def _git_commit() -> str | None:
    """HEAD here, or ``OASES_GIT_COMMIT`` where the tree travelled without its ``.git``."""
    if os.environ.get("OASES_GIT_COMMIT"):
        return os.environ["OASES_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
