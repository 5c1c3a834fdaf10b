"""``oases-ckpt`` on checkpoints ``oases-train`` saved, as a user runs both: ``oases-train`` as
a subprocess, ``oases-ckpt`` through its ``main`` in this process (once as a subprocess too)."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from oases_ds.cli import ckpt as ckpt_cli
from support import train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)


def ckpt(*args: str) -> subprocess.CompletedProcess:
    """``oases-ckpt args`` in this process (its ``main``, output captured): the same code a
    user's command runs, without a second interpreter importing torch and DeepSpeed.  An
    exception other than ``SystemExit`` (a traceback a user would see) fails the test here.
    ``test_info_reports_what_the_run_saved`` runs it once as a real subprocess too."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ckpt_cli.main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["oases-ckpt", *args], code, out.getvalue(), err.getvalue())


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
    proc = subprocess.run([sys.executable, "-m", "oases_ds.cli.ckpt", "info", saved, "--json"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)  # once as a user runs it
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert json.loads(ckpt("info", saved, "--json").stdout) == info
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


# -- the portable state: info and offline conversion to and from Hugging Face ----------
def train(capfd, stats: str, *args: str) -> dict:
    """One ``oases-train`` run (``support.train_cli``, from ``stats``' directory); its summary,
    from its ``stats_out`` file ``stats``."""
    proc = train_cli(capfd, *args, f"stats_out={stats}", cwd=os.path.dirname(stats))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(stats))["summary"]


def one_line_error(capsys, *args: str) -> str:
    """``oases-ckpt ARGS`` in this process: exit 2 with one ``error:`` line and no output."""
    from oases_ds.cli import ckpt as cli

    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert exited.value.code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_llama_dirs(tmp_path_factory):
    """Two Hugging Face LLaMA directories of one tiny config (``hf_config`` of a ModelConfig),
    random weights of seeds 0 and 1, saved as safetensors."""
    transformers = pytest.importorskip("transformers")
    import torch

    from oases_ds.hf import hf_config
    from oases_ds.models.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2,
                      ffn_size=48, seq_len=16, rotary="half", dropout=0.0)
    root = tmp_path_factory.mktemp("hf")
    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(hf_config(cfg))
        model.save_pretrained(root / f"seed{seed}", safe_serialization=True)
        dirs.append(str(root / f"seed{seed}"))
    return dirs


@pytest.mark.distributed
def test_info_reports_the_portable_state_as_on_disk(saved: str) -> None:
    latest = open(os.path.join(saved, "latest")).read().strip()
    directory = os.path.join(saved, latest, "portable")
    index = json.load(open(os.path.join(directory, "index.json")))["params"]
    proc = ckpt("info", saved, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["portable"] == {
        "parameters": len(index), "optimizer_state": ["exp_avg", "exp_avg_sq"],
        "bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))}
    text = ckpt("info", saved)
    assert f"portable state: {len(index)} parameters, " in text.stdout
    assert "MiB (exp_avg, exp_avg_sq): resumable under any layout" in text.stdout


@pytest.mark.distributed
def test_convert_to_hf_writes_the_portable_masters(saved: str, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from oases_ds.checkpoint import portable
    from oases_ds.hf import hf_state_dict
    from oases_ds.models.config import ModelConfig

    out = tmp_path / "hf"
    proc = ckpt("convert", saved, "--to-hf", str(out))
    assert proc.returncode == 0, proc.stderr
    tag_dir = os.path.join(saved, open(os.path.join(saved, "latest")).read().strip())
    meta = json.load(open(os.path.join(tag_dir, "oases_meta.json")))
    masters = {name: portable.read_full(tag_dir, name)["master"] for name in portable.read_index(tag_dir)}
    want = hf_state_dict(ModelConfig(**meta["model"]), masters)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    got = model.state_dict()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    logits = model(torch.randint(0, 256, (2, 16))).logits
    assert logits.shape == (2, 16, 256) and bool(torch.isfinite(logits).all())


def test_convert_round_trips_a_hugging_face_model(tiny_llama_dirs, tmp_path) -> None:
    """--from-hf then --to-hf: the same tensors in fp32; rounded to bf16 with --bf16."""
    import torch
    from safetensors.torch import load_file

    from oases_ds.checkpoint.info import describe
    from oases_ds.cli import ckpt as cli

    original = load_file(os.path.join(tiny_llama_dirs[0], "model.safetensors"))
    for flags, dtype in (([], torch.float32), (["--bf16"], torch.bfloat16)):
        name = "bf16" if flags else "fp32"
        cli.main(["convert", "--from-hf", tiny_llama_dirs[0], str(tmp_path / f"ckpt_{name}"), *flags])
        info = describe(str(tmp_path / f"ckpt_{name}"))
        assert (info["tag"], info["global_steps"], info["tensor_parallel_size"], info["files"]) == ("hf", 0, 0, {})
        assert info["portable"]["optimizer_state"] == [] and info["precision"] == name
        cli.main(["convert", str(tmp_path / f"ckpt_{name}"), "--to-hf", str(tmp_path / f"hf_{name}")])
        back = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
        assert sorted(back) == sorted(original)
        assert [k for k in original if not torch.equal(back[k], original[k].to(dtype))] == []


@pytest.mark.distributed
def test_a_run_resumed_from_a_converted_hf_model_starts_from_its_weights(tiny_llama_dirs, tmp_path, capfd) -> None:
    """The converted checkpoint (tag ``hf``, no layout) resumes at TMP 2; the run's model
    directory holds other weights (seed 1), so only the portable load can give it seed 0's
    loss: that of a fresh run from seed 0."""
    a, b = tiny_llama_dirs
    out = str(tmp_path / "ckpt")
    proc = ckpt("convert", "--from-hf", a, out)
    assert proc.returncode == 0, proc.stderr
    common = ["steps=1", "tensor_parallel_size=2", "nprocs=2", "model=hf"]
    resumed = train(capfd, str(tmp_path / "resumed.json"), *common, f"model.path={b}", f"checkpoint.dir={out}",
                    "checkpoint.resume=true")
    fresh = train(capfd, str(tmp_path / "fresh.json"), *common, f"model.path={a}")
    assert resumed["steps_run"] == fresh["steps_run"] == 1
    assert abs(resumed["first_loss"] - fresh["first_loss"]) <= 1e-6 * abs(fresh["first_loss"])


@pytest.mark.distributed
def test_convert_errors_are_one_line(saved: str, tiny_llama_dirs, tmp_path, capsys) -> None:
    # a copy of the run saved without portable state (as with oases.portable_checkpoint=false)
    old = tmp_path / "old"
    subprocess.run(["cp", "-r", saved, str(old)], check=True)
    latest = (old / "latest").read_text().strip()
    meta_file = old / latest / "oases_meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "portable": False}))
    line = one_line_error(capsys, "convert", str(old), "--to-hf", str(tmp_path / "out"))
    assert "holds no portable state" in line and "checkpoint.resume=true steps=2 export_hf=" in line
    assert not (tmp_path / "out").exists()

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a model")
    line = one_line_error(capsys, "convert", "--from-hf", str(tmp_path / "plain"), str(tmp_path / "ckpt"))
    assert "is not a directory with a config.json" in line and not (tmp_path / "ckpt").exists()

    taken = str(tmp_path / "plain")  # exists, not empty: never written over
    assert "exists and is not an empty directory" in one_line_error(capsys, "convert", saved, "--to-hf", taken)
    assert "exists and is not an empty directory" in one_line_error(
        capsys, "convert", "--from-hf", tiny_llama_dirs[0], taken)
    assert os.listdir(taken) == ["notes.txt"]


# -- reshard: a checkpoint of another layout, written by that layout's ranks -----------------
@pytest.mark.distributed
def test_reshard_gives_an_old_checkpoint_another_layout_that_resumes_as_its_own(tmp_path, capfd) -> None:
    """A TMP 2 checkpoint saved without portable state (``checkpoint.portable=false``, as before
    it existed) resharded to TMP 1 x DP 2 with ZeRO 1: the output holds exactly that layout's rank
    files and a portable state, and a run at that layout resumes from it (DeepSpeed's own files)
    to the same first loss, within 1e-5 relative (TMP 1 sums in another order), as a run
    resumed from the original at its own layout.  The global batch stays 8 (micro_batch 4 on each
    of the 2 DP ranks), so both read the same samples."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    train(capfd, str(tmp_path / "s0.json"), "model=gpt_tiny", "steps=2", f"checkpoint.dir={old}", "checkpoint.portable=false")
    proc = ckpt("reshard", old, new, "--tensor-parallel-size", "1", "--data-parallel-size", "2", "--zero-stage", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == (f"wrote {new}/global_step2 (step 2, TMP 1 x DP 2, ZeRO 1) from {old}/global_step2 "
                                   "(TMP 2 x DP 1, ZeRO 0), 2 ranks on this machine")
    info = json.loads(ckpt("info", new, "--json").stdout)
    assert (info["tensor_parallel_size"], info["data_parallel_size"], info["zero_stage"], info["global_steps"]) == (1, 2, 1, 2)
    assert sorted(info["files"]) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert info["portable"] is not None and info["portable"]["optimizer_state"] == ["exp_avg", "exp_avg_sq"]
    assert json.loads(ckpt("info", old, "--json").stdout)["portable"] is None  # the source is left as it was

    resumed = train(capfd, str(tmp_path / "s1.json"), "model=gpt_tiny", "steps=3", f"checkpoint.dir={new}",
                    "checkpoint.resume=true", "tensor_parallel_size=1", "zero_stage=1", "micro_batch=4")
    at_own = train(capfd, str(tmp_path / "s2.json"), "model=gpt_tiny", "steps=3", f"checkpoint.dir={old}",
                   "checkpoint.resume=true")
    assert resumed["steps_run"] == at_own["steps_run"] == 1
    assert resumed["first_loss"] == pytest.approx(at_own["first_loss"], rel=1e-5)

    again = ckpt("reshard", old, new)  # the output is not empty now
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: {new} exists and is not an empty directory; give a new or empty directory to write into")
