"""Rank-process side of the Hugging Face parity tests (``tests/distributed/test_hf_parity.py``)
and the tiny ``transformers`` models both test tiers build (nothing is downloaded).

The reference is ``transformers``' own model code, loaded with ``from_pretrained``
from the directory the test wrote; the Oases side is ``load_hf`` of the same
directory, each rank reading only its slices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from oases_ds.hf import hf_state_dict, load_hf, save_hf
from oases_ds.models.blocks import layer_parameter_counts
from oases_ds.models.operator_model import IGNORE_INDEX
from oases_ds.parallel.collectives import start_all_reduce
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec


BERT_PAD = 61
"""``[PAD]`` of the tiny BERT."""


def tiny_hf_model(kind: str, seed: int = 0):
    """A small ``transformers`` model of ``kind`` with random weights:

    - "llama": grouped-query attention (4 query, 2 k/v heads), rope_theta 5e5, llama3 RoPE scaling;
    - "llama_kv1": the same with one k/v head (replicated over TMP ranks above 1);
    - "qwen2": ``Qwen2ForCausalLM`` (q/k/v biases, o without), untied, 4 query and 2 k/v heads,
      rope_theta 1e6, no sliding window;
    - "qwen2_tied": the same tied, with one k/v head (replicated, with its bias, over TMP 2),
      and ``use_sliding_window`` on layer 1 only (``max_window_layers=1``) with a window of 8,
      the whole sequence: ``transformers`` applies its sliding mask, which then masks nothing more;
    - "mistral": ``MistralForCausalLM``, 4 query and 2 k/v heads, ``sliding_window`` 8 (= the sequence);
    - "gpt2": tied embeddings, tanh GELU (``gelu_new``) and an odd vocabulary (63);
    - "bert": ``BertForMaskedLM`` with token types, the decoder tied to the embedding (its
      own bias kept), an odd vocabulary (63: TMP 2 and 4 pad it) and ``[PAD]`` = 61, a row
      that TMP 2 and 4 hold on their last rank (so the local padding index is exercised);
    - "bert_untied": the same with its own decoder weight and bias (``cls.predictions.bias``,
      which its forward then never reads, equal to the decoder's as the export writes it).
    """
    import transformers

    torch.manual_seed(seed)
    if kind in ("llama", "llama_kv1"):
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 4}
        cfg = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1 if kind == "llama_kv1" else 2, max_position_embeddings=8, rms_norm_eps=1e-6, rope_parameters=rope,
            attn_implementation="eager",
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind in ("qwen2", "qwen2_tied", "mistral"):
        shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1 if kind == "qwen2_tied" else 2, max_position_embeddings=8,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     attn_implementation="eager")
        if kind == "mistral":
            model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=8, **shape))
        else:
            window = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1) if kind == "qwen2_tied" else {}
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
                tie_word_embeddings=kind == "qwen2_tied", **window, **shape))
    elif kind in ("bert", "bert_untied"):
        cfg = transformers.BertConfig(
            vocab_size=63, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=8, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=BERT_PAD, tie_word_embeddings=kind == "bert", attn_implementation="eager",
        )
        model = transformers.BertForMaskedLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=63, n_positions=8, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # biases and norms start at 0/1; perturb them so every gradient path counts
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn_like(p))
        if kind == "bert_untied":
            model.cls.predictions.bias.copy_(model.cls.predictions.decoder.bias)
    return model


def batch_for(vocab: int, size: int, seq: int, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :2] = IGNORE_INDEX  # ignored positions must not count
    return {"tokens": tokens[:, :-1].contiguous(), "labels": labels}


def masked_lm_batch(vocab: int, size: int, seq: int, pad: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """A BERT batch that exercises token types, the padding mask and ``[PAD]``'s row: two
    segments per sample, sample 1 right-padded (keys masked, labels ignored), and in sample 0
    a ``[PAD]`` token that *is* attended -- the only way its embedding row could get a
    lookup gradient, which Hugging Face's ``padding_idx`` withholds."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab - 3, (size, seq), generator=gen)  # below the [PAD] of the tiny BERT
    labels = torch.full_like(tokens, IGNORE_INDEX)
    picked = torch.rand(tokens.shape, generator=gen) < 0.4
    picked[:, 1] = True
    labels[picked] = tokens[picked]
    mask = torch.ones_like(tokens)
    tokens[1, -3:], mask[1, -3:], labels[1, -3:] = pad, 0, IGNORE_INDEX
    tokens[0, 2], labels[0, 2] = pad, IGNORE_INDEX
    types = (torch.arange(seq) >= seq // 2).long().expand(size, seq).contiguous()
    return {"tokens": tokens, "labels": labels, "attention_mask": mask, "token_types": types}


def batch_of(cfg, size: int) -> dict[str, torch.Tensor]:
    """The test batch of ``size`` samples for a model of ModelConfig ``cfg``."""
    if cfg.family == "bert":
        return masked_lm_batch(cfg.vocab_size, size, cfg.seq_len, cfg.pad_token_id)
    return batch_for(cfg.vocab_size, size, cfg.seq_len)


def hf_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``transformers``' logits for an Oases batch (BERT: token types and padding mask too)."""
    if model.config.model_type == "bert":
        return model(input_ids=batch["tokens"], attention_mask=batch.get("attention_mask"),
                     token_type_ids=batch.get("token_types")).logits
    return model(input_ids=batch["tokens"]).logits


def hf_loss_and_grads(path: str, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean token loss and parameter gradients of ``transformers``' model saved at ``path``."""
    import transformers

    bert = transformers.AutoConfig.from_pretrained(path).model_type == "bert"
    auto = transformers.AutoModelForMaskedLM if bert else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    model.eval()  # no dropout; gradients are unaffected by eval mode
    logits = hf_logits(model, batch)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    # an untied BertForMaskedLM never reads cls.predictions.bias: no gradient to compare
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """As ``dist_workers.rel_err``: ||a - ref|| / max(||ref||, floor)."""
    return float((a - ref).norm() / max(float(ref.norm()), floor))


def hf_parity_worker(path: str, tp: int, out_dir: str) -> dict:
    """Load ``path`` at TMP ``tp``, compare loss and gradients with ``transformers`` for the
    plain and the Oases schedule, then export with ``save_hf`` to ``out_dir``.  Also the
    parameters this rank holds of layer 0 and the planner's count of them (``"layer_params"``)."""
    ctx = ParallelContext.build(tensor_parallel_size=tp, timeout_s=120)
    model = load_hf(path, ctx)
    cfg = model.cfg
    batch = batch_of(cfg, 4)
    ref_loss, ref_grads = hf_loss_and_grads(path, batch)
    floor = 1e-4 * float(torch.cat([g.flatten() for g in ref_grads.values()]).norm())
    results = {}
    for schedule in ("none", "oases"):
        model.zero_grad(set_to_none=True)
        ex = Executor.for_schedule(model, ScheduleSpec(schedule), rng=RNGTracker(seed=1))
        loss = float(start_all_reduce(ex.run(dict(batch)), ctx.dp_group).wait()) / ctx.dp_size
        full = {n: model.sharding.gather_full(n, p, p.grad) for n, p in model.named_parameters()}
        grads = hf_state_dict(cfg, full)
        missing = sorted(set(ref_grads) ^ set(grads))
        errs = {n: rel_err(grads[n], g, floor) for n, g in ref_grads.items() if n in grads}
        worst = max(errs, key=errs.get)
        results[schedule] = {"loss_err": abs(loss - ref_loss) / abs(ref_loss), "grad_err": errs[worst],
                             "worst": worst, "name_mismatch": missing}
    save_hf(model, out_dir)
    held = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0."))
    results["layer_params"] = {"held": held, "counted": sum(layer_parameter_counts(cfg, tp).values())}
    return results


def hf_parity_runs(jobs: list[tuple[str, int, str]]) -> list[dict]:
    """:func:`hf_parity_worker` of each ``(path, tp, out_dir)`` in turn, in one launch (the ranks
    import torch and transformers once); each builds its own groups and model."""
    return [hf_parity_worker(*job) for job in jobs]


def initialize_from_transformers_worker(kind: str) -> dict:
    """``oases_ds.initialize(model=<transformers model>)`` at TMP 2: the engine's eval loss
    against ``transformers``' own, and the line an unsupported ``nn.Module`` gets."""
    import oases_ds
    from engine_workers import ds_config

    hf_model = tiny_hf_model(kind)  # same seed on every rank: the same weights
    oases = {"enabled": True, "tensor_parallel_size": 2, "process_group_timeout_s": 120}
    cfg = dict(ds_config(4, 1, oases=oases), optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    engine, *_ = oases_ds.initialize(model=hf_model, config=cfg)
    batch = batch_of(engine.module.cfg, 4)
    hf_model.eval()
    logits = hf_logits(hf_model, batch)
    ref = float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX))
    loss = float(engine.eval_batch(batch))
    try:
        oases_ds.initialize(model=torch.nn.Linear(2, 2), config=cfg)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    return {"loss_err": abs(loss - ref) / abs(ref), "refused": refused}
