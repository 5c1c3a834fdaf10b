"""``oases-ckpt info`` on checkpoints ``oases-train`` saved, as a user runs both (subprocesses)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)


def ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oases_ds.cli.ckpt", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """Two steps of TMP 2 with ZeRO 1, a checkpoint after each (tags global_step1, global_step2)."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    proc = subprocess.run([sys.executable, "-m", "oases_ds.cli.train", "model=gpt_tiny", "steps=2", "zero_stage=1",
                           f"checkpoint.dir={directory}", "checkpoint.every=1"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory


@pytest.mark.distributed
def test_info_reports_what_the_run_saved(saved: str) -> None:
    latest = open(os.path.join(saved, "latest")).read().strip()
    meta = json.load(open(os.path.join(saved, latest, "oases_meta.json")))
    proc = ckpt("info", saved, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["tag"] == latest and info["global_steps"] == 2 == meta["global_steps"]
    for key in ("tensor_parallel_size", "block_degrees", "pipeline_layers", "zero_stage", "data_parallel_size",
                "precision", "model"):
        assert info[key] == meta[key], key
    assert info["tensor_parallel_size"] == 2 and info["zero_stage"] == 1 and info["precision"] == "fp32"
    # TMP 2 x DP 1: two model-state files and two ZeRO partitions, sizes as on disk
    assert sorted(info["files"]) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                     "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    assert info["bytes"] == sum(os.path.getsize(os.path.join(saved, latest, f)) for f in info["files"])
    assert len(info["tags"]) == 2 and info["tags"][-1] == latest

    text = ckpt("info", saved)
    assert text.returncode == 0, text.stderr
    assert f"step 2 | fp32" in text.stdout and "layout: TMP 2 (every block) | ZeRO 1 over DP 1" in text.stdout
    older = ckpt("info", saved, "--tag", info["tags"][0], "--json")
    assert older.returncode == 0 and json.loads(older.stdout)["global_steps"] == 1


@pytest.mark.distributed
def test_bad_directories_and_damaged_files_are_one_line(saved: str, tmp_path) -> None:
    def error(*args: str) -> str:
        proc = ckpt("info", *args)
        assert proc.returncode == 2 and proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        return lines[0]

    assert "is not a directory" in error(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    assert "no `latest` file, and no saved checkpoint" in error(str(tmp_path / "empty"))
    assert "does not exist" in error(saved, "--tag", "global_step9")
    assert "not a plain checkpoint tag" in error(saved, "--tag", "../run")

    # a copy of the run with one rank file cut short, as by an interrupted copy
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", saved, str(copy)], check=True)
    latest = (copy / "latest").read_text().strip()
    victim = copy / latest / "mp_rank_01_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    line = error(str(copy))
    assert str(victim) in line and "is damaged" in line
