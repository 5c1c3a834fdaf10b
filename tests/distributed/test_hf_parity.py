"""Hugging Face checkpoints imported at TMP 1, 2 and 4 (real gloo ranks) train like
``transformers``: loss and every gradient (mapped back to Hugging Face names) within
1e-5 relative, for the plain and the Oases schedule, and ``save_hf`` from the sharded
ranks writes back the very tensors that were read.

LLaMA: grouped-query attention, rope_theta 5e5, llama3 RoPE scaling; with one k/v head
at TMP 2 the head is replicated (each rank holds it whole; its gradient is summed over the group).
Qwen2: LLaMA's layout with q/k/v biases, untied with 2 k/v heads, and tied with one k/v head
at TMP 2 (replicated with its bias) and a sliding window on layer 1 equal to the sequence;
Mistral: a sliding window equal to the sequence (``transformers`` masks with it, Oases attends
causally: the same while the window covers the sequence).  GPT-2: tied
embeddings, tanh GELU and a 63-token vocabulary, which TMP 2 and 4 must pad (64).  BERT
(``BertForMaskedLM``): post-LN, token types, a batch with a padding mask and an attended
``[PAD]`` (whose row gets no lookup gradient), the decoder tied to the embedding with its
own bias, the masked-LM transform, and the same odd vocabulary padded at TMP 2 and 4.
Tolerance: fp32, the same as the reference-model parity tests; the zero-in-exact-
arithmetic key-bias gradient is measured against a norm floor (``hf_workers.rel_err``).
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_workers
from oases_ds.launcher import launch

TOL = 1e-5
RUNS = [("llama", 1), ("llama", 2), ("llama_kv1", 2), ("gpt2", 1), ("gpt2", 2), ("gpt2", 4), ("bert", 1), ("bert", 2), ("bert", 4),
        ("qwen2", 1), ("qwen2", 2), ("qwen2_tied", 2), ("mistral", 1), ("mistral", 2)]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """``(kind, tp) -> (per-rank results, source dir, export dir)``; the runs of one TMP degree share
    one launch (:func:`hf_workers.hf_parity_runs`: imports once), started when a test first asks."""
    by_tp: dict = {}

    def get(kind: str, tp: int):
        if tp not in by_tp:
            root, jobs = tmp_path_factory.mktemp(f"hf_tp{tp}"), {}
            for name in (k for k, t in RUNS if t == tp):
                source = root / name / "hf"
                hf_workers.tiny_hf_model(name).save_pretrained(source)
                jobs[name] = (str(source), tp, str(root / name / "export"))
            per_rank = launch(hf_workers.hf_parity_runs, tp, (list(jobs.values()),), timeout_s=600)
            by_tp[tp] = {name: ([rank[i] for rank in per_rank], Path(job[0]), Path(job[2]))
                         for i, (name, job) in enumerate(jobs.items())}
        return by_tp[tp][kind]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("kind,tp", RUNS)
def test_imported_model_matches_transformers_and_exports_what_it_read(parity, kind, tp):
    per_rank, source, out = parity(kind, tp)
    for rank, results in enumerate(per_rank):
        results = dict(results)
        counts = results.pop("layer_params")  # the planner's count is the model's, biases and replicated heads too
        assert counts["held"] == counts["counted"], f"rank {rank}: layer 0 holds {counts}"
        for schedule, r in results.items():
            assert r["name_mismatch"] == [], f"rank {rank} {schedule}: names differ {r['name_mismatch']}"
            assert r["loss_err"] <= TOL, f"rank {rank} {schedule}: loss rel err {r['loss_err']:.2e}"
            assert r["grad_err"] <= TOL, f"rank {rank} {schedule}: {r['worst']} grad rel err {r['grad_err']:.2e}"
    written, read = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert sorted(written) == sorted(read)
    unequal = [k for k in read if not torch.equal(written[k], read[k])]
    assert unequal == [], f"exported tensors differ from the imported ones: {unequal}"
