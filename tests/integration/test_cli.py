"""oases-train as a user runs it: its ``entry()`` with the user's arguments, in this process
(``support.train_cli``: its own rank processes, their output read at the fd level; refusals,
which start no rank: ``support.refused``), and as a real subprocess where only one shows the
behaviour (a clean run's output, teardown included)."""
import json
import os
import re
import subprocess
import sys

import pytest

from oases_ds.cli import train
from support import refused, train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*overrides: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, **env_vars)
    return subprocess.run([sys.executable, "-m", "oases_ds.cli.train", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule, precision", [("oases", "fp32"), ("oases", "fp16")])
def test_train_loss_falls_on_embedded_text(tmp_path, schedule, precision, capfd):
    """25 steps of the default schedule.  The other schedules compute the same gradients
    (``distributed/test_parity.py``, against the unsharded reference) and each trains from
    this CLI in ``test_examples.py``'s sweep, so one schedule shows the loss falls; in fp16
    too (``fp16=true``: DeepSpeed's dynamic loss scale, shown per logged step)."""
    out = tmp_path / "stats.json"
    proc = train_cli(capfd, f"schedule={schedule}", "steps=25", "log_every=5", "model.num_layers=2", f"stats_out={out}",
                     *(["fp16=true"] if precision == "fp16" else []), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 25 steps" in proc.stdout and f"schedule {schedule}" in proc.stdout
    assert ("| loss scale 65536" in proc.stdout) == (precision == "fp16")  # DeepSpeed's initial 2^16
    summary = json.loads(out.read_text())["summary"]
    assert summary["final_loss"] < summary["first_loss"] - 1.0  # bytes: ~5.5 -> below 4.5


@pytest.mark.distributed
def test_train_on_an_emulated_link_reports_each_step_against_its_limit(tmp_path, capfd):
    """With a cluster whose link is emulated, every logged step and the summary say how far the
    step is from max(its work without waits, its traffic's link time); the stats carry both."""
    out = tmp_path / "stats.json"
    proc = train_cli(capfd, "model=gpt_tiny", "steps=2", "log_every=1", "cluster=cpu_0_2g", f"stats_out={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"^step .*\| (\d+\.\d\d)x the limit \(work (\d+\.\d\d) s, link (\d+\.\d\d) s\)$", proc.stdout, re.M)
    assert len(steps) == 2, proc.stdout
    assert re.search(r"^done: 2 steps .* \| median \d+\.\d\dx the limit$", proc.stdout, re.M), proc.stdout
    for h in json.loads(out.read_text())["history"]:
        assert h["link_s"] > 0 and h["limit_s"] == max(h["compute_only_s"], h["link_s"])
        assert h["step_s"] >= 0.95 * h["limit_s"]  # the emulated link holds each collective to it


@pytest.mark.distributed
def test_checkpoint_resume_from_the_cli(tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    common = ["model=gpt_tiny", "log_every=1", f"checkpoint.dir={ckpt}"]
    full = train_cli(capfd, *common[:2], "steps=4", f"stats_out={tmp_path / 'full.json'}", cwd=tmp_path)
    first = train_cli(capfd, *common, "steps=2", cwd=tmp_path)
    resumed = train_cli(capfd, *common, "steps=4", "checkpoint.resume=true", f"stats_out={tmp_path / 'resumed.json'}",
                        cwd=tmp_path)
    for proc in (full, first, resumed):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from step 2" in resumed.stdout
    whole = [h["loss"] for h in json.loads((tmp_path / "full.json").read_text())["history"]]
    tail = [h["loss"] for h in json.loads((tmp_path / "resumed.json").read_text())["history"]]
    assert tail == whole[2:]


@pytest.mark.parametrize(
    "override, message",
    [
        ("tensor_parallel_size=3", "error: tensor_parallel_size=3 does not divide world size 2"),
        ("model.num_heads=3", "error: model.num_heads=3 does not divide model.hidden_size=128"),
        ("micro_batch=7", "error: micro_batch=7 is not divisible by schedule.sub_batches=2"),
        ("schedule.name=gpipe", "error: oases.schedule: Input should be"),
        ("zero_stage=3", "error: zero_optimization.stage=3 is not supported with oases (stage 3 gathers"),
        ("offload=true", "error: zero_optimization.offload_optimizer.device=cpu needs zero_optimization.stage 1 or 2"),
        ("bf16=true fp16=true", "error: fp16.enabled=true and bf16.enabled=true: choose one precision"),
    ],
)
def test_bad_config_is_one_clear_line(override, message, capsys, monkeypatch, tmp_path):
    assert refused(capsys, monkeypatch, tmp_path, train, *override.split()).startswith(message)


@pytest.mark.distributed
def test_train_offloads_the_optimizer_with_deepspeeds_cpu_adam(tmp_path, capfd):
    """ZeRO-2 over DP 2 with ``offload=true``: DeepSpeed's CPU Adam (a C++ op built at its
    first use on this host, about a minute, then cached) steps the host partition.  Its
    update is AdamW's, so the losses equal torch's AdamW without offload (1e-5 relative:
    the same formula in another order; measured equal)."""
    runs = {}
    for offload in ("true", "false"):
        out = tmp_path / f"stats-{offload}.json"
        proc = train_cli(capfd, "model=gpt_tiny", "steps=3", "tensor_parallel_size=1", "zero_stage=2",
                         f"offload={offload}", f"stats_out={out}", f"hydra.run.dir={tmp_path / offload}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[offload] = proc.stdout, [h["loss"] for h in json.loads(out.read_text())["history"]]
        # torch's deprecation of the gather DeepSpeed's ZeRO-2 calls is not the user's to act on
        assert "FutureWarning" not in proc.stderr, proc.stderr[-2000:]
    assert "TMP 1 x DP 2 | schedule oases | ZeRO-2, DeepSpeedCPUAdam in host memory |" in runs["true"][0]
    assert "| ZeRO-2, AdamW |" in runs["false"][0]
    assert len(runs["true"][1]) == 3 and runs["true"][1] == pytest.approx(runs["false"][1], rel=1e-5)


@pytest.mark.distributed
def test_train_with_a_plan_file(tmp_path, capfd, monkeypatch):
    from oases_ds.planner.plan import Plan

    path = tmp_path / "plan.json"
    Plan((2, 1), (1, 2), devices=2).to_json(path)
    proc = train_cli(capfd, "model=gpt_tiny", "steps=3", f"plan={path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout
    wrong = refused(capfd, monkeypatch, tmp_path, train, "model=gpt_small", "steps=3", f"plan={path}")
    assert wrong.startswith(f"error: plan={path} is for 2 layers on 2 devices")


@pytest.mark.distributed
def test_train_with_a_plan_that_stores_blocks(tmp_path, capfd, monkeypatch):
    """A plan from ``oases-plan planner.recompute=auto`` (attn0 and mlp1 stored) trains as any plan;
    under a schedule that cannot store blocks it is one line before any rank starts."""
    from oases_ds.planner.plan import Plan

    path = tmp_path / "plan.json"
    Plan((2, 1), (1, 2), devices=2, attn_policies=("store", "oases"), mlp_policies=("oases", "store")).to_json(path)
    proc = train_cli(capfd, "model=gpt_tiny", "steps=3", f"plan={path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout
    wrong = refused(capfd, monkeypatch, tmp_path, train, "model=gpt_tiny", "steps=3", f"plan={path}", "schedule=megatron")
    assert wrong == (
        f"error: plan={path} stores 2 blocks' activations (policy store), which only schedule=oases with "
        f"fine_grained_recompute=true runs; this run has schedule=megatron, fine_grained_recompute=true: use that "
        f"schedule or a plan without store policies")


@pytest.mark.distributed
def test_plan_auto_profiles_plans_within_the_limit_and_trains_with_that_plan(tmp_path, capfd):
    """``plan=auto memory_limit=X``: the layer is profiled here at TMP 1 and 2 (cached in the working
    directory's ``.oases/profiles``), the planner chooses each block's degree and policy within X,
    the plan lands in the run dir and the run trains with it (its config names that file).  A limit
    below what any plan needs is one line, after the (cached) profile, before any training rank."""
    from oases_ds.planner.plan import Plan

    def train(*overrides: str) -> subprocess.CompletedProcess:
        return train_cli(capfd, "model=gpt_tiny", "plan=auto", *overrides, cwd=tmp_path)

    run_dir, stats = tmp_path / "run", tmp_path / "stats.json"
    proc = train("memory_limit=64MiB", "steps=2", f"hydra.run.dir={run_dir}", f"stats_out={stats}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = Plan.from_json(run_dir / "plan.json")
    assert plan.devices == 2 and plan.layers == 2 and plan.memory_bytes <= 64 * 2**20
    assert json.loads(stats.read_text())["config"]["plan"] == str(run_dir / "plan.json")
    lines = proc.stdout.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("plan (")))
    assert lines[table + 1].strip() == plan.as_table().splitlines()[0]  # the plan it printed is the one it trained
    assert "done: 2 steps" in proc.stdout and len(list((tmp_path / ".oases" / "profiles").iterdir())) == 1
    tight = train("memory_limit=1KiB", "steps=2", f"hydra.run.dir={tmp_path / 'tight'}")
    assert tight.returncode == 2, tight.stderr[-3000:]
    assert tight.stderr.strip().splitlines()[-1].startswith("error: memory_limit=1KiB: no plan fits")
    assert "oases-train: gpt" not in tight.stdout  # no training rank started


@pytest.mark.distributed
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_clean_run_prints_only_its_own_lines(tmp_path, start_method):
    # DeepSpeed's WarmupLR warned "Attempting to get learning rate from scheduler before it has
    # started" once per rank at every start; a rank's teardown could print "terminate called
    # without an active exception".  A run that succeeds prints its header, steps, eval and summary.
    # Under spawn too, the start method of every CUDA build (CI has none): its ranks once closed
    # their own stdout and failed at their first line.
    proc = run("steps=3", "log_every=1", f"hydra.run.dir={tmp_path}/hydra", OASES_START_METHOD=start_method)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    ours = ("oases-train: ", "step ", "eval ", "done: ")
    assert lines and all(line.startswith(ours) for line in lines), [l for l in lines if not l.startswith(ours)]


@pytest.mark.distributed
def test_train_with_check_collectives_gives_the_same_losses_and_keeps_records_in_the_run_dir(tmp_path, capfd):
    """``check_collectives=true`` runs guard mode in every rank (its checks are in the records)
    and changes no loss; either way each rank's ring file sits in Hydra's output directory."""
    from oases_ds.parallel.flight import RingFile

    runs = {}
    for check in ("false", "true"):
        out, run_dir = tmp_path / f"stats-{check}.json", tmp_path / f"run-{check}"
        proc = train_cli(capfd, "model=gpt_tiny", "steps=3", f"check_collectives={check}", f"stats_out={out}",
                         f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rings = [RingFile.read(str(run_dir / f"collectives-rank{r}.ring")) for r in (0, 1)]
        runs[check] = ([h["loss"] for h in json.loads(out.read_text())["history"]],
                       {rec["label"] for ring in rings for rec in ring["records"]})
    assert runs["true"][0] == runs["false"][0]
    assert "guard.step 3" in runs["true"][1] and not any(label.startswith("guard.") for label in runs["false"][1])
    assert "L0.attn_reduce eval" in runs["false"][1]  # evaluation's eager forward is recorded too

