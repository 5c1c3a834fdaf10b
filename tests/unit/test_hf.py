"""Hugging Face import/export without processes or downloads (tiny models built here),
and the one-line errors of the model options and of ``oases_ds.hf``."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hf_workers
from oases_ds import hf
from oases_ds.hf import config_from_hf, load_hf, save_hf
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.layers import rotary_inverse_frequencies

KINDS = ["llama", "gpt2", "bert", "bert_untied", "qwen2", "qwen2_tied", "mistral"]
# The config fields of the classes on LLaMA's layout that say what the model computes
# (transformers' derived ones too: layer_types says which layers slide).
LLAMA_LAYOUT_FIELDS = ("architectures", "model_type", "tie_word_embeddings", "num_key_value_heads", "rope_parameters",
                       "rms_norm_eps", "max_position_embeddings", "sliding_window", "use_sliding_window", "layer_types",
                       "intermediate_size", "hidden_act")


def _saved(tmp_path, kind: str):
    model = hf_workers.tiny_hf_model(kind)
    model.save_pretrained(tmp_path / "src")
    return model, tmp_path / "src"


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_identical(tmp_path, kind):
    original, src = _saved(tmp_path, kind)
    save_hf(load_hf(src), tmp_path / "out")
    back = type(original).from_pretrained(tmp_path / "out")
    want, got = original.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert config_from_hf(back.config) == config_from_hf(original.config)
    # the export names the class it came from (what AutoModel builds), and states the same model
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [type(original).__name__]
    if kind in ("qwen2", "qwen2_tied", "mistral"):
        differ = [f for f in LLAMA_LAYOUT_FIELDS
                  if getattr(back.config, f, None) != getattr(original.config, f, None)]
        assert differ == []


@pytest.mark.parametrize("kind", KINDS)
def test_model_object_and_directory_load_the_same_weights(tmp_path, kind):
    original, src = _saved(tmp_path, kind)
    from_dir, from_obj = load_hf(src), load_hf(original)
    assert from_dir.cfg == from_obj.cfg
    for (name, a), (_, b) in zip(from_dir.named_parameters(), from_obj.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradients_match_transformers_in_process(tmp_path, kind):
    """TMP 1 eager forward; the gloo test covers TMP 2 and 4 and the schedules."""
    _, src = _saved(tmp_path, kind)
    model = load_hf(src)
    batch = hf_workers.batch_of(model.cfg, 2)
    ref_loss, ref_grads = hf_workers.hf_loss_and_grads(str(src), batch)
    loss = model(batch)
    loss.backward()
    grads = hf.hf_state_dict(model.cfg, {n: p.grad for n, p in model.named_parameters()})
    floor = 1e-4 * float(torch.cat([g.flatten() for g in ref_grads.values()]).norm())
    assert abs(float(loss.detach()) - ref_loss) <= 1e-5 * abs(ref_loss)
    errs = {n: hf_workers.rel_err(grads[n], g, floor) for n, g in ref_grads.items()}
    assert max(errs.values()) <= 1e-5, max(errs, key=errs.get)


def test_config_mapping_reads_every_option():
    llama = config_from_hf(hf_workers.tiny_hf_model("llama").config)
    assert (llama.family, llama.num_kv_heads, llama.rope_theta, llama.rope_scaling, llama.rope_factor,
            llama.rope_original_max_positions, llama.rotary, llama.norm_eps, llama.ffn) == (
        "llama", 2, 500000.0, "llama3", 8.0, 4, "half", 1e-6, 48)
    gpt = config_from_hf(hf_workers.tiny_hf_model("gpt2").config, seq_len=4)
    assert (gpt.family, gpt.tie_embeddings, gpt.mlp_act, gpt.vocab_size, gpt.seq_len) == ("gpt", True, "gelu_tanh", 63, 4)
    bert = config_from_hf(hf_workers.tiny_hf_model("bert").config)
    assert (bert.family, bert.tie_embeddings, bert.type_vocab_size, bert.pad_token_id, bert.eps, bert.mlp_act, bert.ffn,
            bert.seq_len, bert.dropout) == ("bert", True, 2, hf_workers.BERT_PAD, 1e-12, "gelu", 48, 8, 0.0)
    # a sparse config.json reads as transformers reads it: BertConfig's defaults
    sparse = config_from_hf({"architectures": ["BertForMaskedLM"], "vocab_size": 30522, "hidden_size": 64,
                             "num_attention_heads": 4, "num_hidden_layers": 2})
    assert (sparse.pad_token_id, sparse.type_vocab_size, sparse.tie_embeddings, sparse.seq_len, sparse.ffn) == (
        0, 2, True, 512, 3072)
    sparse.check_tp(4)  # 30522 rows are padded to 30524 at TMP 4, not refused
    assert sparse.padded_vocab(4) == 30524


def test_qwen2_and_mistral_configs_read_as_llama_with_their_options():
    qwen = config_from_hf(hf_workers.tiny_hf_model("qwen2").config)
    assert (qwen.family, qwen.qkv_bias, qwen.num_kv_heads, qwen.rope_theta, qwen.tie_embeddings, qwen.sliding_window,
            qwen.hf_architecture) == ("llama", True, 2, 1e6, False, None, "Qwen2ForCausalLM")
    tied = config_from_hf(hf_workers.tiny_hf_model("qwen2_tied").config)
    assert (tied.tie_embeddings, tied.num_kv_heads, tied.sliding_window, tied.full_attention_layers) == (True, 1, 8, 1)
    mistral = config_from_hf(hf_workers.tiny_hf_model("mistral").config)
    assert (mistral.qkv_bias, mistral.sliding_window, mistral.full_attention_layers, mistral.hf_architecture) == (
        False, 8, 0, "MistralForCausalLM")
    # config.json forms: no architectures (model_type names the class), and the classes' defaults:
    # Mistral's window is 4096 unless the file says null; Qwen2's applies only with use_sliding_window
    shape = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 48, "max_position_embeddings": 4096}
    assert config_from_hf({"model_type": "mistral", **shape}).sliding_window == 4096
    assert config_from_hf({"model_type": "mistral", "sliding_window": None, **shape}).sliding_window is None
    unused = config_from_hf({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False, **shape})
    assert (unused.sliding_window, unused.qkv_bias) == (None, True)
    # max_window_layers >= the layers: nothing slides (transformers' layer_types are all full)
    none_slide = config_from_hf({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                                 "max_window_layers": 2, **shape})
    assert none_slide.sliding_window is None
    # a v4 config.json: no layer_types, derived from max_window_layers as transformers does
    upper = config_from_hf({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True,
                            "max_window_layers": 1, **shape})
    assert (upper.sliding_window, upper.full_attention_layers) == (4096, 1)


def test_a_bert_of_our_own_exports_and_gives_the_same_loss_in_transformers(tmp_path):
    """No token types and an untied decoder (``bert_small``'s shape): the export adds a zero
    token-type row and writes ``cls.predictions.bias`` equal to the decoder's bias."""
    cfg = ModelConfig(family="bert", vocab_size=61, hidden_size=32, num_heads=4, num_layers=2, ffn_size=64, seq_len=8,
                      dropout=0.0, norm_eps=1e-12, activation="gelu")
    model = OperatorModel(cfg, seed=5)
    save_hf(model, tmp_path / "out")
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.tie_word_embeddings is False and back.config.type_vocab_size == 1
    batch = hf_workers.masked_lm_batch(61, 2, 8, pad=60)
    del batch["token_types"]
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(hf_workers.hf_logits(back, batch).flatten(0, 1),
                                                batch["labels"].flatten(), ignore_index=-100)
        loss = model.eval()(batch)
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref))
    assert config_from_hf(back.config, type_vocab_size=0) == cfg


def test_pad_row_gets_no_lookup_gradient_but_its_decoder_gradient():
    """``pad_token_id``: the lookup leaves the [PAD] row alone (HF's ``padding_idx``); with a
    tied head the decoder still trains it."""
    batch = hf_workers.masked_lm_batch(63, 2, 8, pad=61)
    for tied in (False, True):
        cfg = ModelConfig(family="bert", vocab_size=63, hidden_size=32, num_heads=4, num_layers=1, seq_len=8,
                          dropout=0.0, pad_token_id=61, type_vocab_size=2, tie_embeddings=tied)
        model = OperatorModel(cfg, seed=1)
        model(batch).backward()
        row = model.embed.word.weight.grad[61]
        assert (float(row.abs().max()) > 0) == tied
        unpadded = OperatorModel(dataclasses.replace(cfg, pad_token_id=None), seed=1)
        unpadded(batch).backward()
        assert float(unpadded.embed.word.weight.grad[61].abs().max()) > 0  # attended [PAD]: a lookup gradient


def test_rope_scaling_frequencies_match_transformers():
    """Our llama3 and linear frequency rules against transformers' own init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope, ours in (
        ({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, dict(scaling="linear", factor=4.0)),
        ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64},
         dict(theta=5e5, scaling="llama3", factor=8.0, original_max_positions=64)),
    ):
        cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope)
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
        got = rotary_inverse_frequencies(64, **{"theta": rope["rope_theta"], **ours})
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_save_replaces_an_existing_export_and_leaves_no_temporaries(tmp_path):
    _, src = _saved(tmp_path, "gpt2")
    model = load_hf(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    save_hf(model, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_failed_save_keeps_the_previous_export(tmp_path, monkeypatch):
    _, src = _saved(tmp_path, "gpt2")
    model = load_hf(src)
    out = tmp_path / "out"
    save_hf(model, out)
    before = load_file(out / "model.safetensors")

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(OSError, match="No space left"):
        save_hf(model, out)
    after = load_file(out / "model.safetensors")
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


# -- one-line errors ---------------------------------------------------------------
def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


SUPPORTED_LINE = ("supported: BertForMaskedLM (bert), GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), "
                  "MistralForCausalLM (mistral) and Qwen2ForCausalLM (qwen2)")


def test_unsupported_architecture_says_what_is_supported(tmp_path):
    classifier = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError) as e:
        load_hf(classifier)
    assert f"BertForSequenceClassification is not supported; {SUPPORTED_LINE}" in _one_line(e)
    classifier.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path / "bert")
    assert f"'BertForSequenceClassification' is not supported; {SUPPORTED_LINE}" in _one_line(e)


def test_directory_errors(tmp_path):
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path / "missing")
    assert "is not a directory with a config.json" in _one_line(e)
    model, src = _saved(tmp_path, "gpt2")
    os.remove(src / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_hf(src)
    assert "has no model.safetensors" in _one_line(e)


@pytest.mark.parametrize("kind,field,value,words", [
    ("llama", "hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ("llama", "attention_bias", True, "attention_bias or mlp_bias is not supported"),
    ("bert", "hidden_act", "relu", "BERT hidden_act='relu' is not supported"),
    ("bert", "is_decoder", True, "BERT with is_decoder=True (causal attention) is not supported"),
    ("bert", "attention_probs_dropout_prob", 0.2, "differs from attention_probs_dropout_prob=0.2; Oases has one "
                                                  "dropout probability: pass model.dropout=P"),
])
def test_features_we_cannot_reproduce_are_refused(kind, field, value, words):
    cfg = hf_workers.tiny_hf_model(kind).config
    setattr(cfg, field, value)
    with pytest.raises(ValueError) as e:
        config_from_hf(cfg)
    assert words in _one_line(e)
    if field == "attention_probs_dropout_prob":  # a chosen dropout resolves it
        assert config_from_hf(cfg, dropout=0.1).dropout == 0.1


@pytest.mark.parametrize("kind,window", [
    ("mistral", dict(sliding_window=4)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None)),
])
def test_a_window_shorter_than_the_sequence_is_refused_with_the_length_that_fits(kind, window):
    """Sliding-window attention is not implemented: a window below model.seq_len (8 here,
    from max_position_embeddings) is refused in one line; a seq_len the window covers is
    plain causal attention and imports."""
    config = type(hf_workers.tiny_hf_model(kind).config)(**{
        **hf_workers.tiny_hf_model(kind).config.to_dict(), **window})
    with pytest.raises(ValueError) as e:
        config_from_hf(config)
    assert ("model.sliding_window=4 is shorter than model.seq_len=8: sliding-window attention is not supported "
            "(Oases attends over the whole sequence); train with model.seq_len=<= 4") in _one_line(e)
    assert config_from_hf(config, seq_len=4).sliding_window == 4
    with pytest.raises(ValueError) as e:
        load_hf(hf_workers.tiny_hf_model(kind).__class__(config))
    assert _one_line(e).startswith("model.sliding_window=4 is shorter than model.seq_len=8")


def test_qwen2_layer_types_an_export_cannot_write_back_are_refused():
    config = hf_workers.tiny_hf_model("qwen2").config.to_dict()
    config.update(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError) as e:
        config_from_hf(config)
    assert ("Qwen2ForCausalLM layer_types=['sliding_attention', 'full_attention'] has a full-attention layer after "
            "a sliding one") in _one_line(e)


def test_unknown_rope_type_and_gpt2_activation_are_refused():
    cfg = hf_workers.tiny_hf_model("llama").config
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError) as e:
        config_from_hf(cfg)
    assert "rope type 'yarn' is not supported; supported: default, linear, llama3" in _one_line(e)
    gpt = hf_workers.tiny_hf_model("gpt2").config
    gpt.activation_function = "relu"
    with pytest.raises(ValueError) as e:
        config_from_hf(gpt)
    assert "activation_function='relu' is not supported" in _one_line(e)


@pytest.mark.parametrize("cfg,words", [
    (ModelConfig(family="llama"), "train with model.rotary='half' to export"),
    (ModelConfig(family="gpt", num_kv_heads=2), "model.num_kv_heads must equal num_heads"),
    (ModelConfig(family="llama", rotary="half", qkv_bias=True),
     "save_hf: LlamaForCausalLM has no q/k/v biases and the model has them (model.qkv_bias=True); "
     "export with model.hf_architecture=Qwen2ForCausalLM"),
    (ModelConfig(family="llama", rotary="half", hf_architecture="Qwen2ForCausalLM"),
     "save_hf: Qwen2ForCausalLM has q/k/v biases and the model has none (model.qkv_bias=False)"),
    (ModelConfig(family="llama", rotary="half", sliding_window=64),
     "save_hf: LlamaForCausalLM has no sliding window (model.sliding_window=64); set model.sliding_window=null or "
     "export with model.hf_architecture=MistralForCausalLM"),
    (ModelConfig(family="llama", rotary="half", sliding_window=64, full_attention_layers=1,
                 hf_architecture="MistralForCausalLM"),
     "save_hf: MistralForCausalLM slides every layer; model.full_attention_layers=1 must be 0"),
    (ModelConfig(family="gpt", hf_architecture="Qwen2ForCausalLM"),
     f"save_hf: model.hf_architecture='Qwen2ForCausalLM' is not a class of family gpt; {SUPPORTED_LINE}"),
    (ModelConfig(family="llama", rotary="half", hf_architecture="Qwen3ForCausalLM"),
     "save_hf: model.hf_architecture='Qwen3ForCausalLM' is not a class of family llama"),
])
def test_save_refuses_models_transformers_cannot_represent(tmp_path, cfg, words):
    with pytest.raises(ValueError) as e:
        save_hf(OperatorModel(cfg), tmp_path / "out")
    assert words in _one_line(e)
    assert not (tmp_path / "out").exists()


def test_save_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(ValueError) as e:
        save_hf(torch.nn.Linear(2, 2), tmp_path / "out")
    assert "expected an OperatorModel or an engine holding one, got Linear" in _one_line(e)


@pytest.mark.parametrize("fields,words", [
    (dict(num_kv_heads=3), "model.num_kv_heads=3 must divide model.num_heads=4 (0: num_heads)"),
    (dict(num_kv_heads=-1), "model.num_kv_heads must be >= 0 (0: num_heads), got -1"),
    (dict(family="bert", num_kv_heads=2), "leave it 0 for bert"),
    (dict(activation="relu"), "model.activation='relu' unknown"),
    (dict(family="llama", activation="gelu"), "does not fit family llama; use silu"),
    (dict(activation="silu"), "does not fit family gpt; use gelu or gelu_tanh"),
    (dict(family="llama", rotary="sideways"), "model.rotary='sideways' unknown"),
    (dict(family="llama", rope_scaling="yarn"), "model.rope_scaling='yarn' unknown"),
    (dict(family="llama", rope_theta=0.0), "model.rope_theta must be > 0"),
    (dict(family="llama", rope_scaling="linear", rope_factor=0.5), "model.rope_factor must be >= 1"),
    (dict(family="llama", rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
     "must be > 0 and below model.rope_high_freq_factor"),
    (dict(type_vocab_size=2), "model.type_vocab_size=2 applies to bert only"),
    (dict(pad_token_id=256), "model.pad_token_id=256 is not a token of model.vocab_size=256"),
    (dict(pad_token_id=-1), "model.pad_token_id=-1 is not a token"),
    (dict(norm_eps=0.0), "model.norm_eps must be > 0"),
    (dict(qkv_bias=True), "model.qkv_bias applies to llama (gpt and bert have every bias already); leave it false"),
    (dict(family="llama", qkv_bias="yes"), "model.qkv_bias must be true or false, got 'yes'"),
    (dict(sliding_window=64), "model.sliding_window=64 applies to llama only; leave it null"),
    (dict(family="llama", sliding_window=0), "model.sliding_window must be >= 1 (null: no window), got 0"),
    (dict(family="llama", sliding_window=32, seq_len=64), "model.sliding_window=32 is shorter than model.seq_len=64"),
    (dict(family="llama", full_attention_layers=-1), "model.full_attention_layers must be >= 0, got -1"),
])
def test_model_option_errors_name_the_field(fields, words):
    with pytest.raises(ValueError) as e:
        ModelConfig(**fields)
    assert words in _one_line(e)


def test_kv_heads_the_tmp_degree_can_neither_split_nor_replicate_are_refused():
    ModelConfig(family="llama", num_kv_heads=1).check_tp(2)  # fewer k/v heads than ranks: replicated
    ModelConfig(family="llama", num_kv_heads=2).check_tp(4)
    with pytest.raises(ValueError) as e:
        ModelConfig(family="llama", hidden_size=96, num_heads=12, num_kv_heads=3).check_tp(4)
    assert "tensor_parallel_size=4 is neither a divisor nor a multiple of model.num_kv_heads=3" in _one_line(e)
    with pytest.raises(ValueError) as e:
        ModelConfig(family="llama", hidden_size=96, num_heads=12, num_kv_heads=6).check_tp(4)
    assert "tensor_parallel_size=4 does not divide model.num_kv_heads=6" in _one_line(e)


def test_family_defaults_match_hugging_face_and_vocab_pads_to_the_degree():
    assert [ModelConfig(family=f).eps for f in ("gpt", "bert", "llama")] == [1e-5, 1e-12, 1e-6]
    assert ModelConfig(family="gpt", norm_eps=1e-3).eps == 1e-3
    assert [ModelConfig(family=f).mlp_act for f in ("gpt", "llama")] == ["gelu", "silu"]
    llama = dataclasses.replace(ModelConfig(family="gpt"), family="llama")  # takes llama's defaults
    assert (llama.mlp_act, llama.eps, llama.kv_heads) == ("silu", 1e-6, 4)
    gpt2 = ModelConfig(vocab_size=50257)
    gpt2.check_tp(4)  # a vocabulary the degree does not divide is padded, not refused
    assert [gpt2.padded_vocab(t) for t in (1, 2, 4)] == [50257, 50258, 50260]
    assert gpt2.to_dict()["norm_eps"] is None  # unset stays unset: the family decides


def test_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    from safetensors.torch import save_file

    _, src = _saved(tmp_path, "llama")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        load_hf(src)
    assert "tensor 'model.layers.1.mlp.up_proj.weight' is missing from the checkpoint" in _one_line(e)


def test_rmsnorm_in_bf16_matches_hugging_faces_bit_for_bit():
    # HF LLaMA normalises in fp32 and casts back before the weight; in bf16 the old
    # x * rsqrt(mean(x^2)) differed from it, so imported LLaMA drifted in bf16.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from oases_ds.parallel.layers import RMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(512, 1e-5), LlamaRMSNorm(512, eps=1e-5)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.1 * torch.randn(512))
        ours.weight.copy_(theirs.weight)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    x = (3 * torch.randn(4, 16, 512)).to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours.float()(x.float()), theirs.float()(x.float()))
