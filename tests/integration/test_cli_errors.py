"""Every bad command line of oases-train / oases-plan / oases-bench is one ``error:`` line naming
the key, exit 2, before any rank process starts.

Most cases run the real entry point in this process (``entry()`` with ``sys.argv`` set): a
traceback would surface here as an exception other than ``SystemExit(2)``, and nothing is
launched because every case fails first.  A few run as a real subprocess, as a user would,
to check the exit status and that no traceback reaches the terminal.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from oases_ds.cli import bench, plan, train
from oases_ds.data import DataConfig, check_data
from oases_ds.planner.plan import Plan
from support import random_table, refused

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def files(tmp_path):
    """Broken inputs: token files, plans and cost tables."""
    f = tmp_path / "in"
    f.mkdir()
    (f / "empty.bin").write_bytes(b"")
    (f / "odd.bin").write_bytes(b"abc")
    np.arange(50, dtype=np.uint16).tofile(f / "short.bin")
    np.arange(2000, dtype=np.uint16).tofile(f / "wide.bin")
    Plan((2, 1), (1, 2), devices=2).to_json(f / "plan.json")
    good = (f / "plan.json").read_text()
    (f / "truncated_plan.json").write_text(good[: len(good) // 2])
    payload = json.loads(good)
    (f / "typed_plan.json").write_text(json.dumps(dict(payload, devices="2")))
    (f / "renamed_plan.json").write_text(json.dumps({("mlp_degree" if k == "mlp_degrees" else k): v for k, v in payload.items()}))
    random_table(7, 4).to_json(f / "table.json")
    good = (f / "table.json").read_text()
    (f / "truncated_table.json").write_text(good[:300])
    table = json.loads(good)
    table["blocks"]["attn"]["1"]["fwd_mss"] = table["blocks"]["attn"]["1"].pop("fwd_ms")
    (f / "renamed_table.json").write_text(json.dumps(table))
    table = json.loads(good)
    table["blocks"]["mlp"]["2"]["bwd_ms"] = "slow"
    (f / "typed_table.json").write_text(json.dumps(table))
    return f


# -- oases-train: types, unknown keys, ranges ---------------------------------------------------------
@pytest.mark.parametrize("override, start, fix", [
    ("steps=abc", "error: steps: Value 'abc'", "give a whole number"),
    ("micro_batch=abc", "error: micro_batch: Value 'abc'", "give a whole number"),
    ("model.hidden_size=abc", "error: model.hidden_size: Value 'abc'", "give a whole number"),
    ("+model.hiden_size=64", "error: model.hiden_size: not a known key", "did you mean model.hidden_size?"),
    ("model.hiden_size=64", "error: model.hiden_size: not a known key", "did you mean model.hidden_size?"),
    ("+checkpoint.kep=2", "error: checkpoint.kep: not a known key", "did you mean checkpoint.keep?"),
    ("lr=abc", "error: lr: Value 'abc'", "give a number"),
    ("lr=-1", "error: lr must be a finite number > 0, got -1.0", ""),
    ("lr=0", "error: lr must be a finite number > 0, got 0.0", ""),
    ("warmup_steps=-3", "error: warmup_steps must be >= 0, got -3", ""),
    ("steps=0", "error: steps must be >= 1, got 0", ""),
    ("bf16=maybe", "error: bf16: Value 'maybe' is not a valid bool", "give true or false"),
    ("nprocs=abc", "error: nprocs: Value 'abc'", "give a whole number"),
    ("nprocs=0", "error: nprocs must be >= 1, got 0", ""),
    ("checkpoint.every=-1", "error: checkpoint.every must be >= 0, got -1", ""),
    ("checkpoint.keep=-1", "error: checkpoint.keep must be >= 0, got -1", ""),
    ("timeout_s=0", "error: timeout_s must be a finite number > 0", ""),
    ("model.num_heads=0", "error: model.num_heads must be >= 1, got 0", ""),
    ("model.num_kv_heads=-1", "error: model.num_kv_heads must be >= 0 (0: num_heads), got -1", ""),
    ("model.ffn_size=-4", "error: model.ffn_size must be >= 0 (0: 4 x hidden_size), got -4", ""),
    ("model.rope_theta=0", "error: model.rope_theta must be > 0, got 0.0", ""),
    ("model=gpt_huge", "error: model=gpt_huge is not a preset in configs/model; choose from", "gpt_small"),
    ("cluster.link.bandwidth_gbps=3", "error: cluster.link.bandwidth_gbps=3: a key below a null node", "cluster=eth_25g"),
    ("experiment=e2e", "error: experiment=e2e: Could not override 'experiment'", ""),
])
def test_train_refuses_a_bad_value_naming_its_key(capsys, monkeypatch, tmp_path, override, start, fix):
    line = refused(capsys, monkeypatch, tmp_path, train, override)
    assert line.startswith(start) and fix in line


def test_train_refuses_a_link_too_slow_for_its_timeout_before_launching(capsys, monkeypatch, tmp_path):
    """One TMP AllReduce of gpt_small's sub-batch (4 x 128 x 128 fp32 = 0.25 MiB, 2 ranks: 0.25 MiB on
    the wire) at 1e-9 Gbit/s takes 2.1e6 s; the ranks used to start, warn, then wait out timeout_s."""
    line = refused(capsys, monkeypatch, tmp_path, train, "cluster=eth_25g", "cluster.link.bandwidth_gbps=1e-9",
                   "timeout_s=15")
    assert line == ("error: cluster.link: the TMP activation AllReduce (0.25 MiB over 2 ranks) needs 2.1e+06 s at "
                    "cluster.link.bandwidth_gbps=1e-09, longer than timeout_s=15: ranks waiting on it would time out; "
                    "raise timeout_s above 2097153 or cluster.link.bandwidth_gbps"), line


# -- oases-train: data problems found before any rank reads the data --------------------------------
@pytest.mark.parametrize("args, start", [
    (["data=mmap"], "error: data.path is not set; data.source=mmap needs a token file"),
    (["data=mmap", "data.path={in}/missing.bin"], "error: data.path='{in}/missing.bin' does not exist"),
    (["data=mmap", "data.path={in}"], "error: data.path='{in}' is not a file"),
    (["data=mmap", "data.path={in}/empty.bin"], "error: data.path='{in}/empty.bin' is empty"),
    (["data=mmap", "data.path={in}/odd.bin"], "error: data.path='{in}/odd.bin' has 3 bytes, not a whole number of 2-byte"),
    (["data=mmap", "data.path={in}/short.bin"],
     "error: data.path='{in}/short.bin' has 50 tokens, fewer than one window of model.seq_len+1=129"),
    (["data=mmap", "data.path={in}/wide.bin"],
     "error: model.vocab_size=256 is smaller than token id 1999 in data.path='{in}/wide.bin'; set model.vocab_size=2000"),
    (["data=text", "model.vocab_size=64"], "error: model.vocab_size=64 is smaller than token id"),
    (["model=bert_small", "model.vocab_size=2000", "data=mmap", "data.path={in}/wide.bin"],
     "error: data.path='{in}/wide.bin' has no sidecar {in}/wide.bin.json, so its [MASK] id is unknown"),
])
def test_train_refuses_bad_data_before_launching(capsys, monkeypatch, tmp_path, files, args, start):
    line = refused(capsys, monkeypatch, tmp_path, train, *(a.format(**{"in": files}) for a in args))
    assert line.startswith(start.format(**{"in": files}))


def test_check_data_passes_a_good_token_file(files):
    check_data(DataConfig("mmap", str(files / "wide.bin")), vocab_size=2000, seq_len=128)  # raises on failure


# -- plan and cost-table files: one line naming the file ----------------------------------------------
@pytest.mark.parametrize("name, says", [
    ("truncated_plan.json", "error: plan={path}: not valid JSON ("),
    ("typed_plan.json", "error: plan={path}: Plan.devices must be a whole number, got '2'"),
    ("renamed_plan.json", "error: plan={path}: unknown Plan field(s) ['mlp_degree']"),
    # the "oases" section (oases_ds/config.py) checks that the file exists
    ("missing.json", "error: oases.plan: Value error, plan file '{path}' not found"),
    ("", "error: oases.plan: Value error, plan file '{path}' not found"),
])
def test_train_names_a_bad_plan_file(capsys, monkeypatch, tmp_path, files, name, says):
    path = files / name if name else files
    line = refused(capsys, monkeypatch, tmp_path, train, "model=gpt_tiny", f"plan={path}")
    assert line.startswith(says.format(path=path)), line


def test_train_refuses_what_sequence_parallelism_cannot_split_before_launching(capsys, monkeypatch, tmp_path, files):
    """A sequence the TMP degree does not divide, and a plan of mixed degrees: one line each."""
    line = refused(capsys, monkeypatch, tmp_path, train, "sequence_parallel=true", "model.seq_len=63")
    assert line == ("error: sequence_parallel splits the sequence over the 2 TMP ranks but model.seq_len=63 is not "
                    "divisible by 2; use a multiple of 2 or sequence_parallel=false"), line
    line = refused(capsys, monkeypatch, tmp_path, train, "sequence_parallel=true", "model=gpt_tiny",
                   f"plan={files / 'plan.json'}")
    assert line == ("error: sequence_parallel needs every block at the full TMP degree 2, but the plan puts blocks at "
                    "degree 1; plan with planner.min_degree=2 or set sequence_parallel=false"), line


def test_train_refuses_a_plan_made_for_other_pipeline_stages(capsys, monkeypatch, tmp_path):
    """A plan with stages (oases-plan pipeline_stages=2) is not silently run as one stage."""
    from oases_ds.planner.plan import Plan
    path = tmp_path / "staged.json"
    Plan((2, 2), (2, 2), 2, stage_layers=(1, 1)).to_json(path)
    line = refused(capsys, monkeypatch, tmp_path, train, "model=gpt_tiny", f"plan={path}")
    assert line == (f"error: plan={path} was planned for 2 pipeline stages; this run has pipeline_stages=1: "
                    f"plan again with pipeline_stages=1 or run with pipeline_stages=2"), line


@pytest.mark.parametrize("name, says", [
    ("truncated_table.json", "not valid JSON ("),
    ("renamed_table.json", "blocks.attn.1: unknown BlockCost field(s) ['fwd_mss']"),
    ("typed_table.json", "blocks.mlp.2: BlockCost.bwd_ms must be a number, got 'slow'"),
    ("plan.json", "unknown CostTable field(s)"),
    ("missing.json", "No such file or directory"),
    ("", "Is a directory"),
])
def test_plan_names_a_bad_table_file(capsys, monkeypatch, tmp_path, files, name, says):
    path = files / name if name else files
    line = refused(capsys, monkeypatch, tmp_path, plan, f"table={path}", f"out={tmp_path / 'p.json'}")
    assert line.startswith(f"error: table={path}: ") and says in line, line
    assert not (tmp_path / "p.json").exists()


# -- oases-plan: sizes and presets --------------------------------------------------------------------
@pytest.mark.parametrize("override, start", [
    ("layers=0", "error: layers must be >= 1, got 0; leave it null to plan every layer"),
    ("micro_batch=0", "error: micro_batch must be >= 1, got 0"),
    ("micro_batch=-16", "error: micro_batch must be >= 1, got -16"),
    ("devices=abc", "error: devices: Value 'abc'"),
    ("+planner.solvr=dp", "error: planner.solvr: not a known key; did you mean planner.solver?"),
    ("experiment=foo", "error: experiment=foo is not a preset in configs/experiment; oases-plan takes cost_model"),
    ("offload=true", "error: offload=true needs zero_stage 1 or 2 (DeepSpeed offloads the optimizer's partition)"),
    ("precision=fp8", "error: precision='fp8'; choose one of fp32, bf16, fp16"),
    ("data_parallel_size=0", "error: data_parallel_size=0; give an integer >= 1"),
])
def test_plan_refuses_a_bad_value_naming_its_key(capsys, monkeypatch, tmp_path, override, start):
    line = refused(capsys, monkeypatch, tmp_path, plan, "cost=analytic", "cluster=pcie_3090", override,
                   f"out={tmp_path / 'p.json'}")
    assert line.startswith(start)
    assert not (tmp_path / "p.json").exists()


def test_plan_names_the_out_path_it_cannot_write_not_a_temporary(capsys, monkeypatch, tmp_path):
    """``out=/proc/plan.json`` (no file can be created there): the line names the path the user gave."""
    line = refused(capsys, monkeypatch, tmp_path, plan, "cost=analytic", "cluster=pcie_3090", "out=/proc/plan.json")
    assert line == "error: [Errno 2] No such file or directory: '/proc/plan.json'", line


def test_plan_layers_null_still_means_all_layers(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["oases-plan", "cost=analytic", "cluster=pcie_3090", "layers=null", "out=p.json"])
    plan.entry()
    assert Plan.from_json(tmp_path / "p.json").layers == 4  # gpt_small's num_layers
    assert "| 4 layers |" in capsys.readouterr().out


# -- oases-bench: presets -------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["experiment=foo"], ["--multirun", "experiment=e2e,foo"]])
def test_bench_refuses_an_unknown_preset_naming_the_known_ones(capsys, monkeypatch, tmp_path, args):
    line = refused(capsys, monkeypatch, tmp_path, bench, *args)
    assert line.startswith("error: experiment=foo is not a preset in configs/experiment; oases-bench takes ")
    assert "e2e" in line and "cost_model" not in line


# -- as a user runs them: exit 2, the last line names the key, no traceback -------------------------
@pytest.mark.parametrize("module, args, start", [
    ("train", ["steps=abc"], "error: steps: "),
    ("train", ["+model.hiden_size=64"], "error: model.hiden_size: "),
    ("train", ["data=mmap"], "error: data.path "),
    ("train", ["model.num_heads=0"], "error: model.num_heads must be >= 1, got 0"),
    ("train", ["cluster=eth_25g", "cluster.link.bandwidth_gbps=1e-9", "timeout_s=30"], "error: cluster.link: the TMP "),
    ("plan", ["micro_batch=-16", "cost=analytic", "cluster=pcie_3090"], "error: micro_batch "),
    ("bench", ["experiment=foo"], "error: experiment=foo "),
])
def test_subprocess_exits_2_with_one_line_and_no_traceback(tmp_path, module, args, start):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([sys.executable, "-m", f"oases_ds.cli.{module}", *args, f"out={tmp_path / 'o'}"]
                          if module != "train" else [sys.executable, "-m", "oases_ds.cli.train", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(start), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize(
    "args, message",
    [
        (["memory_limit=2GiB"], "error: memory_limit=2GiB is read only by plan=auto"),
        (["plan=auto"], "error: plan=auto needs memory_limit"),
        (["plan=auto", "memory_limit=2GiB", "schedule=megatron"], "error: plan=auto chooses between storing and"),
        (["plan=auto", "memory_limit=2GiB", "nprocs=4", "pipeline_stages=2"],
         "error: plan=auto plans one TMP group, not pipeline_stages=2"),
        (["plan=auto", "memory_limit=lots"], "error: memory_limit='lots' is not a size"),
        (["plan=auto", "memory_limit=2GiB", "grad_accum=2", "overlap_micro_batches=true"],
         "error: plan=auto fits one micro-batch's activations to memory_limit, but overlap_micro_batches=true keeps "
         "two in flight"),
    ],
)
def test_plan_auto_refuses_what_it_cannot_plan_in_one_line_before_profiling(capsys, monkeypatch, tmp_path, args,
                                                                            message):
    assert refused(capsys, monkeypatch, tmp_path, train, *args).startswith(message)
    assert "planning degrees" not in capsys.readouterr().out and not (tmp_path / ".oases").exists()


def test_plan_auto_under_torchrun_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(capsys, monkeypatch, tmp_path, train, "plan=auto", "memory_limit=2GiB")
    assert line.startswith("error: plan=auto profiles with ranks of its own, so it cannot run under torchrun")


def test_plan_auto_on_a_cuda_host_with_too_few_gpus_is_one_line_before_profiling(capsys, monkeypatch, tmp_path):
    """The profiling ranks take a GPU each, as the training ranks do: the GPU count is checked
    before they start, not (as before) only after the plan, by a LaunchError from every rank."""
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    line = refused(capsys, monkeypatch, tmp_path, train, "plan=auto", "memory_limit=2GiB")
    assert line.startswith("error: 2 ranks on this host need 2 GPUs (NCCL takes one per rank) but it has 1")
    assert "planning degrees" not in capsys.readouterr().out and not (tmp_path / ".oases").exists()


def test_a_bad_start_method_is_one_line(capsys, monkeypatch, tmp_path):
    """``OASES_START_METHOD`` is read as the fork server starts early, which came before the
    refusals' ``try``: a typo printed Hydra's traceback."""
    monkeypatch.setenv("OASES_START_METHOD", "fork")
    line = refused(capsys, monkeypatch, tmp_path, train)
    assert line == "error: OASES_START_METHOD='fork' is not a start method; set it to forkserver or spawn, or unset it"
