"""The README's three ways in, run as a user runs them: the DeepSpeed script under torchrun,
the Lightning script (real processes), and an ``oases-train --multirun`` sweep (its entry
point in this process, ``support.train_cli``)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from oases_ds.cli import ckpt
from oases_ds.planner.plan import Plan
from support import plan_cli, train_cli

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
def test_the_deepspeed_script_with_one_sampler_per_process_stops_at_its_first_step(tmp_path):
    """The common mistake: the sampler seeded by the global rank, so the two TMP ranks get
    different samples.  ``oases.check_batch`` (on by default) stops it with one line, before
    any update; the unchanged script above trains, and so does this one with the check off."""
    script = open(os.path.join(ROOT, "examples", "deepspeed_train.py")).read()
    right = "manual_seed(ctx.dp_rank)"
    assert script.count(right) == 1
    wrong = tmp_path / "deepspeed_train.py"
    wrong.write_text(script.replace(right, "manual_seed(torch.distributed.get_rank())"))
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = _run([torchrun, "--nproc_per_node", "2", str(wrong)])
    assert done.returncode != 0 and "step 5" not in done.stdout, done.stdout[-2000:]
    lines = [line for line in done.stderr.splitlines() if "were handed different batches" in line]
    assert lines and all(line.endswith("BatchMismatchError: the ranks of TMP group [0, 1] were handed different batches "
                                       "at optimizer step 1 (1-based): rank 1 holds another batch than rank 0; every "
                                       "rank of a TMP group must get the samples of its DP rank: seed or shard the data "
                                       "loader by engine.parallel_context.dp_rank, not the global rank "
                                       "(oases.check_batch=false turns this check off)") for line in lines), done.stderr[-3000:]
    off = '"sub_batches": 2}'
    assert script.count(off) == 1
    wrong.write_text(wrong.read_text().replace(off, '"sub_batches": 2, "check_batch": False}'))
    done = _run([torchrun, "--nproc_per_node", "2", str(wrong)])  # the switch off: it trains on, as it did before
    assert done.returncode == 0 and len(re.findall(r"^step \d+: loss", done.stdout, re.M)) == 4, done.stderr[-3000:]


@pytest.mark.distributed
def test_the_lightning_script_trains():
    done = _run([sys.executable, "examples/lightning_train.py"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^trained 20 steps, loss [\d.]+$", done.stdout, re.M), done.stdout[-2000:]


@pytest.mark.distributed
def test_a_hydra_multirun_sweep_runs_each_schedule(tmp_path, capfd):
    done = train_cli(capfd, "--multirun", "schedule=oases,megatron", "steps=3", "log_every=3", "model=gpt_tiny",
                     f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"^done: 3 steps .* schedule (\w+)$", done.stdout, re.M) == ["oases", "megatron"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]


@pytest.mark.distributed
def test_the_planning_script_writes_a_plan_oases_train_takes(tmp_path, capfd):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plan.py"), "plan.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from oases_ds.planner.plan import Plan

    plan = Plan.from_json(str(tmp_path / "plan.json"))
    assert plan.devices == 2 and plan.layers == 4 and plan.predicted_step_ms > 0
    train = train_cli(capfd, f"plan={tmp_path / 'plan.json'}", "model.hidden_size=128", "model.num_layers=4",
                      "model.seq_len=64", "model.vocab_size=256", "steps=2", "log_every=1", f"hydra.run.dir={tmp_path}/hydra",
                      cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]


def _readme_block(heading: str, index: int = 0) -> list[str]:
    """The command lines of ``bash`` block ``index`` (0: the first) under README heading ``heading``."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n")[1 + index].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _run_readme_commands(capfd, cwd, commands: list[str]) -> list:
    """Each ``oases-train`` / ``oases-plan`` command line in ``cwd``, in order, each required to succeed."""
    outputs = []
    for command in commands:
        tool, *args = command.split()
        done = train_cli(capfd, *args, cwd=cwd) if tool == "oases-train" else plan_cli(*args, cwd=cwd)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        outputs.append(done)
    return outputs


@pytest.mark.distributed
def test_the_readme_fits_a_larger_model_as_written(tmp_path, capfd):
    """The commands of "Fit a larger model", in a fresh directory, as written: oases-train with
    sequence parallelism, oases-plan choosing per-block policies for it, and oases-train running
    that plan with sequence parallelism (its blocks stored, re-gathering or keeping the gather, its
    hops in the order of the per-op times the plan carries)."""
    commands = _readme_block("Fit a larger model")
    assert [c.split()[0] for c in commands] == ["oases-train", "oases-plan", "oases-train"]
    outputs = [done.stdout for done in _run_readme_commands(capfd, tmp_path, commands)]
    assert all(re.search(r"^done: 20 steps", out, re.M) for out in (outputs[0], outputs[2]))
    plan = Plan.from_json(tmp_path / "plan.json")
    assert "-sp2|" in outputs[1] and {"store", "oases_gathered"} <= set(plan.block_policies())
    assert plan.hop_costs is not None  # the times it was priced with, which the last run orders its hops by
    assert "sequence parallelism: the plan carries its per-op times (hop_costs)" in outputs[1]


@pytest.mark.distributed
def test_the_readme_shrinks_the_model_states_as_written(tmp_path, capfd):
    """The second block of "Fit a larger model", as written: ZeRO-2 with the optimizer in host
    memory (DeepSpeed's CPU Adam) in fp16 at TMP 2 x DP 2, then oases-plan pricing those states."""
    commands = _readme_block("Fit a larger model", 1)
    assert [c.split()[0] for c in commands] == ["oases-train", "oases-plan"]
    train, plan = (train_cli(capfd, *c.split()[1:], cwd=tmp_path) if c.startswith("oases-train")
                   else plan_cli(*c.split()[1:], cwd=tmp_path) for c in commands)
    for command, done in zip(commands, (train, plan)):
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    assert "TMP 2 x DP 2" in train.stdout and "ZeRO-2, DeepSpeedCPUAdam in host memory" in train.stdout
    assert "| loss scale 65536" in train.stdout and re.search(r"^done: 10 steps", train.stdout, re.M)
    assert "states fp16, ZeRO 2 over DP 2, optimizer in host memory: 4 B" in plan.stdout, plan.stdout


@pytest.mark.distributed
def test_the_readme_overlaps_micro_batches_and_chooses_sub_batches_as_written(tmp_path, capfd):
    """The block of "Slow links": oases-train with its 4 micro-batches overlapped on an emulated
    0.2 Gbit/s link (each step logged against its limit), oases-plan profiling 2 and 4 sub-batches
    and keeping the faster, and oases-train running that plan at its sub-batches."""
    commands = _readme_block("Slow links: overlap micro-batches, choose sub-batches")
    assert [c.split()[0] for c in commands] == ["oases-train", "oases-plan", "oases-train"]
    outputs = _run_readme_commands(capfd, tmp_path, commands)
    assert re.search(r"x the limit \(work ", outputs[0].stdout) and re.search(r"^done: 10 steps", outputs[0].stdout, re.M)
    chosen = Plan.from_json(tmp_path / "plan.json").sub_batches
    assert re.search(r"^sub-batches: 2 -> [\d.]+ ms; 4 -> [\d.]+ ms; chose [24]$", outputs[1].stdout, re.M), outputs[1].stdout
    assert chosen in (2, 4) and outputs[1].stdout.rstrip().endswith("wrote plan.json")
    assert re.search(r"^done: 10 steps", outputs[2].stdout, re.M)
    assert ("running it so" in outputs[2].stderr) == (chosen != 2)  # the configured schedule has 2


@pytest.mark.distributed
def test_the_readme_changes_the_layout_of_a_run_as_written(tmp_path, capfd, monkeypatch):
    """Every command of "Change the layout of a run", in a fresh directory, as written: each
    resumed run starts where the previous one stopped, at its new layout.  Each runs its
    entry point with the command's arguments in this process (``support.train_cli``;
    ``oases-ckpt``'s ``main``), which starts the ranks as the command does."""
    commands = _readme_block("Change the layout of a run")
    assert [c.split()[0] for c in commands] == ["oases-train"] * 3 + ["oases-ckpt"]
    outputs = []
    for command in commands:
        tool, *args = command.split()
        if tool == "oases-train":
            done = train_cli(capfd, *args, cwd=tmp_path)
        else:
            monkeypatch.chdir(tmp_path)
            ckpt.main(args)
            out, err = capfd.readouterr()
            done = subprocess.CompletedProcess(command, 0, out, err)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    layouts = [re.search(r"ranks = (.*?) \| .* from step (\d+)", out).groups() for out in outputs[:3]]
    assert layouts == [("PP 2 x TMP 2 x DP 1", "0"), ("TMP 4 x DP 1", "20"), ("TMP 1 x DP 2", "30")]
    assert all(re.search(rf"^done: {n} steps", out, re.M) for n, out in zip((20, 10, 10), outputs))
    assert "step 40" in outputs[3] and "TMP 1" in outputs[3]
