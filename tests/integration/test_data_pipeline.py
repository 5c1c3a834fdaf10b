"""oases-data -> oases-train data=mmap as a user runs them: subprocesses, real rank processes (gloo)."""
import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from oases_ds.cli import train
from support import refused, train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = "the cat sat on a mat while one dog ran past and every bird sang loud songs".split()


def cli(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def token_file(tmp_path):
    """A WordLevel tokenizer (trained here, no download) and a 200-document jsonl corpus, tokenized
    by oases-data with every 10th document held out."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 30)))) for _ in range(200)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "tokens.bin"
    proc = cli("oases_ds.cli.data", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(out),
               "--eval-fraction", "0.1", str(tmp_path / "corpus.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "180 docs" in proc.stdout and "held out 20 docs" in proc.stdout
    return out, tok.get_vocab_size()


@pytest.mark.distributed
def test_train_on_the_produced_file_evaluates_every_n_steps_and_logs_csv(tmp_path, token_file, capfd):
    out, vocab = token_file
    stats, metrics = tmp_path / "stats.json", tmp_path / "metrics.csv"
    padded = vocab + vocab % 2  # the vocabulary parallel embedding needs a multiple of tensor_parallel_size=2
    proc = train_cli(capfd, "data=mmap", f"data.path={out}", "model=gpt_tiny", f"model.vocab_size={padded}", "steps=4",
                     "eval_every=2", "log_every=1", f"metrics.csv={metrics}", f"stats_out={stats}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval     2/4 | held-out loss" in proc.stdout and "eval     4/4 | held-out loss" in proc.stdout
    summary = json.loads(stats.read_text())["summary"]
    assert [e["step"] for e in summary["evals"]] == [2, 4]
    assert all(math.isfinite(e["eval_loss"]) for e in summary["evals"]) and math.isfinite(summary["final_loss"])
    assert summary["eval_loss"] == summary["evals"][-1]["eval_loss"]
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert [r["eval_loss"] != "" for r in rows] == [False, True, False, True]
    assert float(rows[3]["eval_loss"]) == pytest.approx(summary["eval_loss"])
    assert [float(r["loss"]) for r in rows] == pytest.approx([h["loss"] for h in json.loads(stats.read_text())["history"]])
    assert all(float(r["lr"]) > 0 and float(r["tokens_per_s"]) > 0 for r in rows[1:])


def test_a_model_vocabulary_below_the_files_is_one_line_before_launching(tmp_path, token_file, capsys, monkeypatch):
    out, vocab = token_file
    line = refused(capsys, monkeypatch, tmp_path, train, "data=mmap", f"data.path={out}", "model=gpt_tiny",
                   f"model.vocab_size={vocab - 1}")
    assert line == (
        f"error: data.path='{out}' was tokenized with a vocabulary of {vocab} (tokenizer {out.parent / 'tokenizer.json'}) "
        f"but model.vocab_size={vocab - 1}; set model.vocab_size={vocab} or more")


@pytest.mark.parametrize("override, says", [
    ("metrics.tensorboard=runs/tb", "error: metrics.tensorboard=runs/tb needs the tensorboard package, which is not installed"),
    ("metrics.csv={tmp}/other.csv", "error: metrics.csv={tmp}/other.csv exists and is not an oases-train metrics file"),
    ("eval_every=-1", "error: eval_every must be >= 0, got -1"),
    ("data.eval_fraction=1.5", "error: data.eval_fraction=1.5 must be > 0 and < 1"),
])
def test_bad_metrics_and_eval_settings_are_one_line_before_launching(tmp_path, monkeypatch, capsys, override, says):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were absent
    (tmp_path / "other.csv").write_text("a,b\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["oases-train", "model=gpt_tiny", override.format(tmp=tmp_path)])
    with pytest.raises(SystemExit) as exc:
        train.entry()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and lines[0].startswith(says.format(tmp=tmp_path)), lines
