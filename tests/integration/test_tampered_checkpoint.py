"""A checkpoint is data, not trusted: each tampering of its portable state is refused in one
line before any rank starts, both by a resume under another layout (the portable route)
and by ``oases-ckpt convert --to-hf``; nothing is written, and no code in it runs.

One real checkpoint (``oases-train model=gpt_tiny steps=2``, TMP 2) is made once per module
and copied for each case.  Resume and convert run their real entry points in this process
(``entry()`` with ``sys.argv`` / ``main(argv)``) with the launcher replaced by one that fails
the test if called, so "before any rank starts" is checked, not assumed; one case of each
also runs as a real subprocess for the exit status and the absence of a traceback.
"""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from oases_ds.cli import ckpt, train
from support import train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "global_step2"
PARAM = "layers.0.mlp.fc1.weight"  # a 2-D weight with Adam moments: transposable
SAVE = ["model=gpt_tiny", "steps=2", "log_every=1"]
RESUME = ["model=gpt_tiny", "steps=3", "tensor_parallel_size=1", "checkpoint.resume=true"]


class Payload:
    """Unpickling it creates a marker file: evidence that code in a checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    done = subprocess.run([sys.executable, "-m", "oases_ds.cli.train", *SAVE, "checkpoint.dir=CK"], cwd=root,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "CK"


def portable(ck: Path) -> Path:
    return ck / TAG / "portable"


def edit_index(ck: Path, change: Callable[[dict], None]) -> None:
    path = portable(ck) / "index.json"
    index = json.loads(path.read_text())
    change(index["params"])
    path.write_text(json.dumps(index))


def rewrite(ck: Path, change: Callable[[dict], dict], file: str = f"{PARAM}.pt") -> None:
    path = portable(ck) / file
    held = torch.load(path, weights_only=True)
    torch.save(change(held), path)


def outside_file(ck: Path, marker: Path) -> None:
    shutil.copy(portable(ck) / f"{PARAM}.pt", ck / "x.pt")  # right shape and dtype, outside the checkpoint
    edit_index(ck, lambda p: p[PARAM].update(file="../../x.pt"))


def absolute_path(ck: Path, marker: Path) -> None:
    edit_index(ck, lambda p: p[PARAM].update(file=str(portable(ck) / f"{PARAM}.pt")))


def link_out(ck: Path, marker: Path) -> None:
    target = ck / "x.pt"
    shutil.copy(portable(ck) / f"{PARAM}.pt", target)
    os.remove(portable(ck) / f"{PARAM}.pt")
    os.symlink(target, portable(ck) / f"{PARAM}.pt")


def pickled_object(ck: Path, marker: Path) -> None:
    rewrite(ck, lambda held: {**held, "extra": Payload(str(marker))})


def pickled_common(ck: Path, marker: Path) -> None:
    rewrite(ck, lambda held: {**held, "client_state": {"x": Payload(str(marker))}}, file="common.pt")


def int_master(ck: Path, marker: Path) -> None:
    rewrite(ck, lambda held: {**held, "master": held["master"].long()})


def moment_of_another_shape(ck: Path, marker: Path) -> None:
    rewrite(ck, lambda held: {**held, "exp_avg": held["exp_avg"][:1]})


def no_master(ck: Path, marker: Path) -> None:
    rewrite(ck, lambda held: {k: v for k, v in held.items() if k != "master"})


def transposed(ck: Path, marker: Path) -> None:
    rewrite(ck, lambda held: {k: v.t().contiguous() for k, v in held.items()})


def transposed_in_index_too(ck: Path, marker: Path) -> None:
    transposed(ck, marker)
    edit_index(ck, lambda p: p[PARAM].update(shape=p[PARAM]["shape"][::-1]))


def entry_is_a_string(ck: Path, marker: Path) -> None:
    edit_index(ck, lambda p: p.update({PARAM: f"{PARAM}.pt"}))


def file_name_is_dot(ck: Path, marker: Path) -> None:
    edit_index(ck, lambda p: p[PARAM].update(file="."))


# (tampering, what the one line must contain)
CASES = {
    "outside_file": (outside_file, "names file '../../x.pt', which is not a plain file name inside portable/"),
    "absolute_path": (absolute_path, "which is not a plain file name inside portable/"),
    "link_out": (link_out, f"{PARAM}.pt of parameter {PARAM} is a link out of portable/"),
    "pickled_object": (pickled_object, f"{PARAM}.pt holds objects other than tensors; refused"),
    "pickled_common": (pickled_common, "common.pt holds objects other than tensors; refused"),
    "int_master": (int_master, f"of parameter {PARAM} holds master as int64, not floating point"),
    "moment_of_another_shape": (moment_of_another_shape, f"of parameter {PARAM} holds exp_avg with shape [1, 32]"),
    "no_master": (no_master, f"of parameter {PARAM} lacks master"),
    "transposed": (transposed, f"of parameter {PARAM} holds master with shape [32, 128], but index.json says [128, 32]"),
    "transposed_in_index_too": (transposed_in_index_too, f"of parameter {PARAM} is listed in index.json with shape "
                                                         "[32, 128], but this model's is [128, 32]"),
    "entry_is_a_string": (entry_is_a_string, f"the entry of parameter '{PARAM}' is '{PARAM}.pt', not an object"),
    "file_name_is_dot": (file_name_is_dot, f"parameter '{PARAM}' names file '.', which is not a plain file name"),
}


@pytest.fixture
def tampered(saved, tmp_path, request) -> tuple[Path, Path, str]:
    """(checkpoint dir, marker path, expected text) of a copy tampered as the case says."""
    change, expected = CASES[request.param]
    ck = tmp_path / "CK"
    shutil.copytree(saved, ck)
    marker = tmp_path / "code-ran"
    change(ck, marker)
    return ck, marker, expected


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was launched for a checkpoint that should have been refused first")
    monkeypatch.setattr(train, "launch", refuse)


def one_error_line(capsys, run: Callable[[], None]) -> str:
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_the_untampered_checkpoint_resumes_and_converts(saved, tmp_path, capfd):
    """The baseline every case below differs from by one tampering: the same commands succeed."""
    ck = tmp_path / "CK"
    shutil.copytree(saved, ck)
    done = train_cli(capfd, *RESUME, f"checkpoint.dir={ck}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "from step 2" in done.stdout and "done: 1 steps" in done.stdout
    ckpt.main(["convert", str(ck), "--to-hf", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("tampered", list(CASES), indirect=True)
def test_a_resume_under_another_layout_refuses_it_before_any_rank_starts(tampered, capsys, monkeypatch, no_launch):
    ck, marker, expected = tampered
    monkeypatch.chdir(ck.parent)
    monkeypatch.setattr(sys, "argv", ["oases-train", *RESUME, f"checkpoint.dir={ck}"])
    line = one_error_line(capsys, train.entry)
    assert expected in line, line
    assert "weights_only=False" not in line and not marker.exists()


@pytest.mark.parametrize("tampered", list(CASES), indirect=True)
def test_convert_to_hf_refuses_it_and_writes_nothing(tampered, capsys, tmp_path):
    ck, marker, expected = tampered
    out = tmp_path / "hf"
    line = one_error_line(capsys, lambda: ckpt.main(["convert", str(ck), "--to-hf", str(out)]))
    assert expected in line, line
    assert not out.exists() and not marker.exists()


@pytest.mark.parametrize("tampered", ["pickled_object"], indirect=True)
@pytest.mark.parametrize("command", ["train", "convert"])
def test_as_subprocesses_the_refusal_exits_2_without_a_traceback(tampered, command, tmp_path):
    ck, marker, expected = tampered
    args = ([*RESUME, f"checkpoint.dir={ck}"] if command == "train"
            else ["convert", str(ck), "--to-hf", str(tmp_path / "hf")])
    done = subprocess.run([sys.executable, "-m", f"oases_ds.cli.{'train' if command == 'train' else 'ckpt'}", *args],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert expected in done.stderr and not marker.exists()


def rank_file(ck: Path) -> Path:
    return ck / TAG / "mp_rank_00_model_states.pt"


def pickled_rank_file(ck: Path, marker: Path) -> None:
    held = torch.load(rank_file(ck), weights_only=False)  # our own file, written above
    torch.save({**held, "extra": Payload(str(marker))}, rank_file(ck))


def transposed_rank_file(ck: Path, marker: Path) -> None:
    held = torch.load(rank_file(ck), weights_only=False)
    held["module"][PARAM] = held["module"][PARAM].t().contiguous()
    torch.save(held, rank_file(ck))


@pytest.mark.parametrize("change, expected", [
    (pickled_rank_file, "holds a pickled io.open, which is not a tensor"),
    (transposed_rank_file, f"size mismatch for {PARAM}"),
], ids=["pickled", "transposed"])
def test_a_same_layout_resume_refuses_a_tampered_rank_file_in_one_line(saved, tmp_path, change, expected, capfd):
    """The same layout reads the DeepSpeed rank files, not portable/: inside the ranks, but
    still one line (the launcher's), a non-zero exit, no step, and no code from the file run."""
    ck = tmp_path / "CK"
    shutil.copytree(saved, ck)
    marker = tmp_path / "code-ran"
    change(ck, marker)
    done = train_cli(capfd, *SAVE[:1], "steps=3", "checkpoint.resume=true", f"checkpoint.dir={ck}", cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert re.match(r"error: rank [01]: ", line) and expected in line, done.stderr[-3000:]
    assert "step 3" not in done.stdout and not marker.exists()


def test_reshard_refuses_a_size_of_0_and_writes_nothing(saved, tmp_path, capsys):
    """0 once read as "keep the saved value" and wrote a TMP 2 checkpoint with rc 0."""
    out = tmp_path / "out"
    line = one_error_line(capsys, lambda: ckpt.main(["reshard", str(saved), str(out), "--tensor-parallel-size", "0"]))
    assert "--tensor-parallel-size must be >= 1, got 0; leave it out to keep the saved value" in line, line
    assert not out.exists()


@pytest.mark.parametrize("module", ["transformers", "safetensors"])
def test_convert_without_the_hf_extra_names_it(saved, tmp_path, capsys, monkeypatch, module):
    """A ``None`` entry in sys.modules makes ``import module`` raise ImportError, as on a
    machine without the ``[hf]`` extra."""
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "hf"
    line = one_error_line(capsys, lambda: ckpt.main(["convert", str(saved), "--to-hf", str(out)]))
    assert f"need {module}, which is not installed" in line and "pip install 'oases-ds[hf]'" in line, line
    assert not out.exists()


def test_the_exported_config_keeps_token_ids_inside_the_vocabulary(saved, tmp_path):
    """GPT-2's config class defaults eos/bos to 50256; gpt_tiny has 256 tokens."""
    ckpt.main(["convert", str(saved), "--to-hf", str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert config["vocab_size"] == 256 and all(v is None or 0 <= v < 256 for v in ids.values()), ids
