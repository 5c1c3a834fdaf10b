"""Checkpoints: nothing runs from a file, ``latest`` stays inside, publication survives a
crash at any step, mismatched resumes and unusable directories are one line.

Pure logic (tags, meta, publish, prune, preflight) runs in this process; the engine
runs in one real rank; ``oases-train`` as a subprocess, as users run it.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import engine_workers as ew
from oases_ds.checkpoint import (LATEST, META_FILE, CheckpointError, CheckpointMeta, check_tag, preflight, prune,
                                 publish, read_latest, saved_tags)
from oases_ds.checkpoint.portable import PORTABLE_DIR
from oases_ds.checkpoint.portable import files as portable_files
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from support import train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def meta(**overrides) -> CheckpointMeta:
    args = dict(model=ModelConfig(), tensor_parallel_size=2, block_degrees=None, precision="fp32", zero_stage=0,
                data_parallel_size=1)
    args.update(overrides)
    return CheckpointMeta.build(**args)


def fake_checkpoint(directory, tag: str, payload: str, saved_at: float = 0.0, latest: bool = False) -> None:
    """A complete checkpoint as publish() leaves it: a data file and oases_meta.json."""
    path = os.path.join(directory, tag)
    os.makedirs(path)
    with open(os.path.join(path, "mp_rank_00_model_states.pt"), "w") as f:
        f.write(payload)
    meta().write(path)
    if saved_at:
        data = json.load(open(os.path.join(path, META_FILE)))
        json.dump(dict(data, saved_at=saved_at), open(os.path.join(path, META_FILE), "w"))
    if latest:
        with open(os.path.join(directory, LATEST), "w") as f:
            f.write(tag)


def resumes_to(directory) -> str:
    """What a resume would read: the data of the checkpoint ``latest`` names (complete or raise)."""
    tag = read_latest(str(directory))
    with open(os.path.join(directory, tag, "mp_rank_00_model_states.pt")) as f:
        return f.read()


# -- tags and latest -----------------------------------------------------------------
@pytest.mark.parametrize("tag", ["../outside/x", "/etc/passwd", "a/b", "..", ".", "", " global_step2"])
def test_a_tag_that_is_a_path_is_refused(tag):
    with pytest.raises(CheckpointError, match="not a plain checkpoint tag"):
        check_tag(tag)


def test_latest_must_name_a_completed_tag_inside_the_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    fake_checkpoint(tmp_path, "outside", "x")
    fake_checkpoint(ckpt.parent, "ckpt_real", "y")
    os.makedirs(ckpt)
    (ckpt / LATEST).write_text("../outside")  # the target exists and is complete: still refused
    with pytest.raises(CheckpointError, match=r"latest names '\.\./outside', which is not a plain checkpoint tag"):
        read_latest(str(ckpt))
    (ckpt / LATEST).write_text(str(tmp_path / "outside"))
    with pytest.raises(CheckpointError, match="not a plain checkpoint tag"):
        read_latest(str(ckpt))
    (ckpt / LATEST).write_text("global_step9\n")
    with pytest.raises(CheckpointError) as err:
        read_latest(str(ckpt))
    assert str(err.value) == f"{ckpt / LATEST} names tag 'global_step9', but {ckpt / 'global_step9'} does not exist"
    os.makedirs(ckpt / "global_step9")  # a DeepSpeed-only or interrupted checkpoint: no meta
    with pytest.raises(CheckpointError, match=f"has no {META_FILE}"):
        read_latest(str(ckpt))
    os.remove(ckpt / LATEST)
    assert read_latest(str(ckpt)) is None


# -- meta ----------------------------------------------------------------------------
def test_meta_mismatch_is_one_line_naming_both_values(tmp_path):
    saved = replace(meta(tensor_parallel_size=2), global_steps=4)
    saved.write(str(tmp_path))
    assert CheckpointMeta.read(str(tmp_path)) == saved
    assert saved.differences(meta(tensor_parallel_size=2)) == []  # the step is no fact a run must match
    with pytest.raises(CheckpointError) as err:
        saved.refuse_mismatch("runs/ckpt/global_step4", meta(tensor_parallel_size=1))
    assert str(err.value) == ("checkpoint runs/ckpt/global_step4 was saved with tensor_parallel_size=2, "
                              "this run has tensor_parallel_size=1")
    cases = {
        "model.num_layers=2, precision=fp32": meta(model=ModelConfig(num_layers=3), precision="bf16"),
        "plan block degrees=[2, 2, 2, 2]": meta(block_degrees=[2, 1, 2, 2]),
        "zero_stage=0": meta(zero_stage=1),
    }
    for expected, run in cases.items():
        diffs = saved.differences(run)
        assert ", ".join(f"{n}={s}" for n, s, _ in diffs) == expected
    # ZeRO-1 partitions optimizer state by DP rank; without ZeRO the DP size may change.
    assert meta(zero_stage=1, data_parallel_size=2).differences(meta(zero_stage=1, data_parallel_size=1))
    assert not meta(data_parallel_size=2).differences(meta(data_parallel_size=1))
    assert not meta(zero_stage=1).differences(meta(zero_stage=0), optimizer_states=False)  # module-only load
    assert meta(block_degrees=None) == meta(block_degrees=[2] * 4)  # no plan = uniform plan


def test_a_meta_saved_before_a_model_field_existed_reads_as_its_default(tmp_path):
    """A field added to ModelConfig later (e.g. qkv_bias) is absent from older checkpoints: the
    run that saved one had its default, so resuming it is no mismatch."""
    saved = replace(meta(), global_steps=4)
    saved.write(str(tmp_path))
    data = json.load(open(tmp_path / META_FILE))
    for name in ("qkv_bias", "sliding_window", "full_attention_layers", "hf_architecture"):
        del data["model"][name]
    del data["global_steps"]  # a meta file without the step: step 0
    json.dump(data, open(tmp_path / META_FILE, "w"))
    assert CheckpointMeta.read(str(tmp_path)).differences(saved) == []
    assert CheckpointMeta.read(str(tmp_path)).global_steps == 0


# -- crash-safe publication ----------------------------------------------------------
class Crash(Exception):
    pass


def fs_ops(monkeypatch, crash_at: int) -> list:
    """Make the ``crash_at``-th filesystem mutation raise instead of happening."""
    done = []

    def wrap(name, fn):
        def op(*args, **kwargs):
            if len(done) == crash_at:
                raise Crash(f"{name}{args}")
            done.append(name)
            return fn(*args, **kwargs)
        return op

    for mod, name in ((os, "replace"), (os, "rename"), (os, "unlink"), (os, "remove"), (shutil, "rmtree")):
        monkeypatch.setattr(mod, name, wrap(name, getattr(mod, name)))
    return done


@pytest.mark.parametrize("situation", ["resave_latest", "resave_again", "new_tag", "leftovers"])
def test_publish_leaves_a_complete_checkpoint_after_a_crash_at_every_step(tmp_path, monkeypatch, situation):
    """Crash before each rename/remove publish() does: ``latest`` must still name a
    complete checkpoint (old or new), and the next save must succeed."""
    steps = None
    crash_at = 0
    while steps is None or crash_at <= steps:
        d = tmp_path / f"{situation}{crash_at}"
        os.makedirs(d)
        if situation == "resave_again":  # the previous re-save lives in global_step4.resaved
            fake_checkpoint(d, "global_step4.resaved", "old", latest=True)
        else:
            fake_checkpoint(d, "global_step4" if situation != "new_tag" else "global_step2", "old", latest=True)
        if situation == "leftovers":  # an earlier crash left a stale copy and a stale staging dir
            fake_checkpoint(d, "global_step4.resaved", "stale")
        fake_checkpoint(d, "global_step4.partial", "new")
        with monkeypatch.context() as m:
            done = fs_ops(m, crash_at)
            try:
                publish(str(d), "global_step4", str(d / "global_step4.partial"))
                steps = len(done)  # no crash: every step ran
            except Crash:
                pass
        assert resumes_to(d) in ("old", "new")
        if steps is not None and crash_at == steps:
            assert resumes_to(d) == "new"
            assert [n for n in os.listdir(d) if n.startswith("global_step4")] == [read_latest(str(d))]
        shutil.rmtree(d / "global_step4.partial", ignore_errors=True)  # what the engine does before staging
        fake_checkpoint(d, "global_step4.partial", "newer")
        publish(str(d), "global_step4", str(d / "global_step4.partial"))
        assert resumes_to(d) == "newer"
        assert len([n for n in os.listdir(d) if n.startswith("global_step4")]) == 1
        crash_at += 1
    assert steps >= 3  # rename, switch latest (tmp write + replace), remove the superseded copy


def test_the_old_in_place_resave_had_a_window_without_a_checkpoint(tmp_path):
    """The sequence this module replaces (move <tag> aside, move <tag>.partial in):
    a crash between the two renames leaves ``latest`` naming nothing."""
    fake_checkpoint(tmp_path, "global_step4", "old", latest=True)
    os.replace(tmp_path / "global_step4", tmp_path / "global_step4.old")
    with pytest.raises(CheckpointError, match="does not exist"):
        resumes_to(tmp_path)


def test_prune_keeps_the_newest_and_the_one_latest_names(tmp_path):
    for i, tag in enumerate(["global_step1", "global_step2", "global_step3", "global_step4"]):
        fake_checkpoint(tmp_path, tag, tag, saved_at=100.0 + i, latest=(tag == "global_step1"))
    os.makedirs(tmp_path / "not_a_checkpoint")
    assert prune(str(tmp_path), 0) == []
    assert prune(str(tmp_path), 2) == ["global_step2"]
    assert saved_tags(str(tmp_path)) == ["global_step1", "global_step3", "global_step4"]
    assert os.path.isdir(tmp_path / "not_a_checkpoint")  # only oases checkpoints are ever removed
    with pytest.raises(CheckpointError, match=r"^checkpoint.keep must be >= 0"):
        prune(str(tmp_path), -1)


# -- preflight -----------------------------------------------------------------------
def test_preflight_names_checkpoint_dir_when_it_cannot_be_used(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match=rf"^checkpoint.dir={afile}/ckpt cannot hold checkpoints: {afile} is a file"):
        preflight(str(afile / "ckpt"), resume=False)
    with pytest.raises(CheckpointError, match=rf"^checkpoint.dir={afile} cannot hold checkpoints: it is a file"):
        preflight(str(afile), resume=False)
    preflight(str(tmp_path / "new" / "nested"), resume=False)  # created on the first save
    assert not os.path.exists(tmp_path / "new")
    preflight(None, resume=False)


# What DeepSpeed 0.19.8 writes into a tag directory (seen in checkpoints it saved; the engine and
# oases-train tests below compare real ones): one model-states file per model-parallel rank (TMP
# rank x pipeline stage, saved by DP rank 0) and, with ZeRO 1, one optimizer-states file per DP rank
# and model-parallel rank ("bf16_" in front in bf16).
LAYOUTS = {
    "tmp2": (meta(), ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]),
    "tmp2_dp2_zero1_bf16": (meta(zero_stage=1, data_parallel_size=2, precision="bf16"), [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"]),
    "tmp1_dp1_zero1": (meta(tensor_parallel_size=1, zero_stage=1), [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
    "two_stages": (meta(tensor_parallel_size=1, pipeline_layers=[1, 1]),
                   ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]),
}


def complete_checkpoint(directory, saved: CheckpointMeta, files: list[str], tag: str = "global_step2") -> str:
    """A published checkpoint holding ``files`` as small torch files (zip archives, as
    ``torch.save`` writes them), ``saved`` as its meta and ``latest`` naming it; returns its directory."""
    tag_dir = os.path.join(directory, tag)
    os.makedirs(tag_dir)
    for name in files:
        torch.save({"name": name, "weight": torch.zeros(16)}, os.path.join(tag_dir, name))
    replace(saved, global_steps=2).write(tag_dir)
    (Path(directory) / LATEST).write_text(tag)
    return tag_dir


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_layout_lists_the_files_deepspeed_writes(layout):
    saved, files = LAYOUTS[layout]
    assert sorted(name for name, _ in saved.rank_files()) == sorted(files)
    assert [name for name, _ in saved.rank_files(optimizer_states=False)] == [f for f in files if "_model_states" in f]


@pytest.mark.parametrize("layout, damage, name, problem, role", [
    ("tmp2", "remove", "mp_rank_01_model_states.pt", "is missing", "model states of model-parallel rank 1 of 2"),
    ("tmp2", "empty", "mp_rank_00_model_states.pt", "is empty", "model states of model-parallel rank 0 of 2"),
    ("tmp2", "directory", "mp_rank_01_model_states.pt", "is not a file", "model states of model-parallel rank 1 of 2"),
    ("tmp2_dp2_zero1_bf16", "truncate", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
     "is damaged (not a complete torch file: File is not a zip file)",
     "ZeRO optimizer states of data-parallel rank 1 of 2, model-parallel rank 0 of 2"),
    ("tmp1_dp1_zero1", "remove", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "is missing",
     "ZeRO optimizer states of data-parallel rank 0 of 1, model-parallel rank 0 of 1"),
])
def test_preflight_names_a_missing_empty_or_damaged_rank_file(tmp_path, layout, damage, name, problem, role):
    """Before: DeepSpeed's ``checkpoint count 1 is different from saved mp_world_size 2`` for a missing
    file, ``EOFError`` on one rank for an empty one, both after every rank had started."""
    saved, files = LAYOUTS[layout]
    tag_dir = complete_checkpoint(tmp_path, saved, files)
    preflight(str(tmp_path), resume=True, expected=saved)  # complete: passes
    path = Path(tag_dir) / name
    if damage == "remove":
        path.unlink()
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "directory":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as err:
        preflight(str(tmp_path), resume=True, expected=saved)
    assert str(err.value) == (f"checkpoint file {path} {problem}: it holds the {role}; copy the whole checkpoint "
                              f"{tag_dir} again, or write an older tag into {tmp_path / LATEST}")


@pytest.fixture
def world_readable_tmp():
    """pytest's tmp_path sits under a 0700 directory an unprivileged user cannot enter."""
    import tempfile

    path = tempfile.mkdtemp(prefix="oases-ckpt-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def test_preflight_refuses_a_read_only_directory(world_readable_tmp):
    """Checked in a forked child that drops to an unprivileged user: root writes
    through a read-only mode (and cannot exec the venv's Python as another user)."""
    ro = os.path.join(world_readable_tmp, "ro")
    os.makedirs(ro)
    os.chmod(ro, 0o555)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery past this point, always os._exit
        code = 1
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            preflight(str(ro), resume=False)
            code = 0
        except CheckpointError as err:
            os.write(write_end, str(err).encode())
            code = 3
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        message = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert message.startswith(f"checkpoint.dir={ro} cannot hold checkpoints: cannot create files in {ro}")


def test_preflight_resume_needs_a_checkpoint_that_matches(tmp_path):
    with pytest.raises(CheckpointError, match=r"^checkpoint.resume=true needs checkpoint.dir"):
        preflight(None, resume=True)
    with pytest.raises(CheckpointError, match=rf"^checkpoint.resume=true but checkpoint.dir={tmp_path} holds no checkpoint"):
        preflight(str(tmp_path), resume=True)
    complete_checkpoint(tmp_path, meta(), ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"])
    preflight(str(tmp_path), resume=True, expected=meta())
    with pytest.raises(CheckpointError, match=r"was saved with precision=fp32, this run has precision=bf16$"):
        preflight(str(tmp_path), resume=True, expected=meta(precision="bf16"))


# -- the engine, one real rank -------------------------------------------------------
def test_a_planted_payload_is_proven_live():
    """Guard for the engine test below: the payload it plants does run under DeepSpeed's
    own ``torch.load(weights_only=False)``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "ran")
        ew.plant_payload(os.path.join(tmp, "f.pt"), marker)
        torch.load(os.path.join(tmp, "f.pt"), weights_only=False)
        assert os.path.exists(marker)


@pytest.mark.distributed
def test_engine_loads_every_mode_safely_and_refuses_bad_checkpoints(tmp_path):
    out = launch(ew.checkpoint_safety_run, 1, (str(tmp_path),), timeout_s=600)[0]
    assert set(out["roundtrip"]) == {f"{p}_zero{z}" for p in ("fp32", "bf16") for z in (0, 1, 2)} | {"fp16_zero0",
                                                                                                    "fp16_zero2"}
    for mode, got in out["roundtrip"].items():  # the allowlist covers what DeepSpeed saves (fp16 ZeRO: its scaler)
        assert got["path"] and got["same_params"] and got["global_steps"] == 1 and got["lr"], mode
        assert got["loss_scale"] == (128.0 if mode.startswith("fp16") else 1.0), mode  # DeepSpeed's own files keep it
    assert out["mismatch"] == (f"checkpoint {tmp_path / 'bf16_zero0' / 'global_step1'} was saved with "
                               "precision=bf16, this run has precision=fp32")
    assert re.match(rf"refusing to load checkpoint file {re.escape(out['evil_file'])}: it holds a pickled (io|builtins)\.open,",
                    out["payload"])
    assert not out["marker_exists"]
    assert "not a plain checkpoint tag" in out["traversal"]
    damaged = tmp_path / "damaged" / "global_step1"
    assert out["damaged"] == (f"checkpoint file {damaged / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'} is empty: it "
                              f"holds the ZeRO optimizer states of data-parallel rank 0 of 1, model-parallel rank 0 of 1; "
                              f"copy the whole checkpoint {damaged} again, or write an older tag into "
                              f"{tmp_path / 'damaged' / LATEST}")
    for msg in (out["mismatch"], out["payload"], out["traversal"], out["damaged"]):
        assert "\n" not in msg
    for mode in out["roundtrip"]:  # the layout names exactly what DeepSpeed wrote, in every mode
        tag_dir = tmp_path / mode / "global_step1"
        assert sorted(os.listdir(tag_dir)) == sorted([n for n, _ in CheckpointMeta.read(str(tag_dir)).rank_files()]
                                                     + [META_FILE, PORTABLE_DIR]), mode
        assert sorted(f"{PORTABLE_DIR}/{n}" for n in os.listdir(tag_dir / PORTABLE_DIR)) == sorted(
            [n for n, _ in portable_files(str(tag_dir))] + [f"{PORTABLE_DIR}/index.json"]), mode


# -- oases-train ---------------------------------------------------------------------
def train(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``oases-train model=gpt_tiny overrides`` as a real process (the module's saved run)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "oases_ds.cli.train", "model=gpt_tiny", *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def train_here(capfd, cwd, *overrides: str) -> subprocess.CompletedProcess:
    """The same through its entry point in this process (``support.train_cli``), from ``cwd``."""
    return train_cli(capfd, "model=gpt_tiny", *overrides, cwd=cwd)


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank TMP-2 run saving every step and keeping 1."""
    ckpt = tmp_path_factory.mktemp("run") / "ckpt"
    proc = train("steps=2", f"checkpoint.dir={ckpt}", "checkpoint.every=1", "checkpoint.keep=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


@pytest.mark.distributed
def test_train_keeps_the_newest_checkpoint_only(saved):
    assert sorted(os.listdir(saved)) == ["global_step2", LATEST]  # global_step1 pruned; no .partial left
    assert (saved / LATEST).read_text() == "global_step2"


@pytest.mark.distributed
@pytest.mark.parametrize("override, saved_with, has", [
    ("bf16=true", "precision=fp32", "precision=bf16"),
    ("model.num_layers=3", "model.num_layers=2", "model.num_layers=3"),
])
def test_train_refuses_a_mismatched_resume_before_launching(saved, override, saved_with, has, capfd, tmp_path):
    proc = train_here(capfd, tmp_path, "steps=3", f"checkpoint.dir={saved}", "checkpoint.resume=true", override)
    assert proc.returncode == 2
    assert last_line(proc) == f"error: checkpoint {saved / 'global_step2'} was saved with {saved_with}, this run has {has}"
    assert "oases-train:" not in proc.stdout  # no rank started


@pytest.mark.distributed
def test_train_resumes_under_another_tensor_parallel_size(saved, tmp_path, capfd):
    """Saved at TMP 2, resumed at TMP 1 (through the portable state): it goes on from step 2
    and saves a checkpoint of the new layout."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)  # the fixture's directory stays as saved
    proc = train_here(capfd, tmp_path, "steps=3", f"checkpoint.dir={ckpt}", "checkpoint.resume=true",
                      "tensor_parallel_size=1", "nprocs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TMP 1 x DP 1" in proc.stdout and "from step 2" in proc.stdout and "step     3/3" in proc.stdout
    assert CheckpointMeta.read(str(ckpt / "global_step3")).tensor_parallel_size == 1


@pytest.mark.distributed
def test_train_saves_exactly_the_files_its_layout_lists(saved):
    tag_dir = saved / "global_step2"
    names = [name for name, _ in CheckpointMeta.read(str(tag_dir)).rank_files()]
    assert sorted(os.listdir(tag_dir)) == sorted(names + [META_FILE, PORTABLE_DIR])


@pytest.mark.distributed
@pytest.mark.parametrize("damage, problem", [("remove", "is missing"), ("empty", "is empty")])
def test_train_names_a_missing_or_empty_rank_file_before_launching(saved, tmp_path, damage, problem, capfd):
    """Was ``error: rank 0: AssertionError: checkpoint count 1 is different from saved mp_world_size 2``
    (missing) and ``error: rank 1: EOFError`` (empty), after both ranks had started."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    path = ckpt / "global_step2" / "mp_rank_01_model_states.pt"
    path.unlink() if damage == "remove" else path.write_bytes(b"")
    proc = train_here(capfd, tmp_path, "steps=3", f"checkpoint.dir={ckpt}", "checkpoint.resume=true", "timeout_s=120")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last_line(proc) == (f"error: checkpoint file {path} {problem}: it holds the model states of model-parallel "
                               f"rank 1 of 2; copy the whole checkpoint {ckpt / 'global_step2'} again, or write an "
                               f"older tag into {ckpt / LATEST}")
    assert "oases-train:" not in proc.stdout and "Traceback" not in proc.stderr  # no rank started


@pytest.mark.distributed
def test_train_resume_runs_no_code_from_a_checkpoint(saved, tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    evil, marker = ckpt / "global_step2" / "mp_rank_01_model_states.pt", tmp_path / "payload_ran"
    ew.plant_payload(str(evil), str(marker))  # rank 1's shard only: rank 0 must fail too, not wait
    proc = train_here(capfd, tmp_path, "steps=3", f"checkpoint.dir={ckpt}", "checkpoint.resume=true", "timeout_s=120")
    assert proc.returncode == 1  # found inside the ranks: the launcher's exit code for a failed rank
    assert not marker.exists()
    assert last_line(proc).startswith("error: rank ")
    assert re.search(rf"refusing to load checkpoint file {re.escape(str(evil))}: it holds a pickled (io|builtins)\.open,",
                     last_line(proc))


@pytest.mark.parametrize("setting, message", [
    ("checkpoint.dir={afile}/ckpt", "error: checkpoint.dir={afile}/ckpt cannot hold checkpoints: {afile} is a file"),
    ("checkpoint.dir={empty}", "error: checkpoint.resume=true but checkpoint.dir={empty} holds no checkpoint"),
])
def test_train_checks_the_checkpoint_dir_before_launching(tmp_path, setting, message, capfd):
    (tmp_path / "afile").write_text("x")
    os.makedirs(tmp_path / "empty")
    names = {"afile": tmp_path / "afile", "empty": tmp_path / "empty"}
    proc = train_here(capfd, tmp_path, setting.format(**names), "checkpoint.resume=true" if "empty" in setting else "steps=1")
    assert proc.returncode == 2
    assert last_line(proc).startswith(message.format(**names))
