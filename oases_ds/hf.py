"""Hugging Face checkpoints in and out of an Oases model: LLaMA and the two classes built on
its layout (Qwen2, Mistral), GPT-2 and BERT (masked LM).

Why a mapping and not a conversion script: an Oases model is sharded, so a rank
that loads a 65B LLaMA must read only its own rows of each tensor, straight from
the safetensors file (``safe_open(...).get_slice``), never the whole checkpoint.
Each Oases parameter therefore names its Hugging Face source (:class:`Source`:
the tensor, whether it is stored transposed -- GPT-2's ``Conv1D`` keeps
``[in, out]`` -- and which part of a fused tensor it is -- GPT-2's ``c_attn`` is
q, k and v side by side), and the same table, run backwards, writes the full
tensors a ``from_pretrained`` call reads.

Numbers match ``transformers`` because the model options say what the Hugging Face
code does: LLaMA rotates halves (``rotary="half"``), GPT-2 uses tanh GELU and ties
its head to the embedding, BERT is post-LN with token types, ties its decoder weight
to the embedding but keeps its own decoder bias (``cls.predictions.bias``) after the
masked-LM transform (dense + activation + LayerNorm), and its ``[PAD]`` row gets no
lookup gradient (``pad_token_id``, as LLaMA's); the epsilon, RoPE base and scaling, and
the number of key/value heads come from the checkpoint's config.  Qwen2 is LLaMA with biases
on q, k and v (``qkv_bias``); Mistral is LLaMA with a sliding attention window, which the
Oases model reproduces only while it covers the sequence (``sliding_window >= seq_len``: then
it is plain causal attention); both are kept in the :class:`ModelConfig`, with the class
(``hf_architecture``), so that an export writes the same model back.

Only ``transformers``' config classes are used (never its model code), and only
inside these functions: the library does not need the ``[hf]`` extra otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch
import torch.distributed as dist

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.collectives import Group, group_rank
from oases_ds.parallel.context import ParallelContext
from oases_ds.utils.io import fsync_directory

@dataclass(frozen=True)
class Architecture:
    """A Hugging Face class this module converts, and what sets it apart within its family.

    Attributes:
        family: the Oases family whose modules hold its weights.
        model_type: its ``config.json`` ``model_type`` (names it when ``architectures`` is absent).
        config_class: the ``transformers`` config class an export writes.
        own: the family's own class, written when ``ModelConfig.hf_architecture`` is "".
        qkv_bias: its q, k and v projections have biases (Qwen2); ``ModelConfig.qkv_bias``.
        window: how its config states a sliding window: "" none, "every_layer" (Mistral's
            ``sliding_window``), "upper_layers" (Qwen2's ``use_sliding_window``, ``sliding_window``,
            ``max_window_layers``: the layers from that index on slide).
    """

    family: str
    model_type: str
    config_class: str
    own: bool = False
    qkv_bias: bool = False
    window: str = ""


ARCHITECTURES: dict[str, Architecture] = {
    "BertForMaskedLM": Architecture("bert", "bert", "BertConfig", own=True),
    "GPT2LMHeadModel": Architecture("gpt", "gpt2", "GPT2Config", own=True),
    "LlamaForCausalLM": Architecture("llama", "llama", "LlamaConfig", own=True),
    "MistralForCausalLM": Architecture("llama", "mistral", "MistralConfig", window="every_layer"),
    "Qwen2ForCausalLM": Architecture("llama", "qwen2", "Qwen2Config", qkv_bias=True, window="upper_layers"),
}
"""The one table of the Hugging Face classes this module converts."""
SUPPORTED: dict[str, str] = {name: arch.family for name, arch in ARCHITECTURES.items()}
"""Hugging Face architecture -> Oases family this module converts."""
_NAMED = [f"{name} ({arch.model_type})" for name, arch in ARCHITECTURES.items()]
_SUPPORTED_LINE = f"supported: {', '.join(_NAMED[:-1])} and {_NAMED[-1]}"
_MODEL_TYPES = {arch.model_type: name for name, arch in ARCHITECTURES.items()}
_OWN = {arch.family: name for name, arch in ARCHITECTURES.items() if arch.own}
_PREFIX = {"bert": "bert.", "gpt": "transformer.", "llama": "model."}
_GELU = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class Source:
    """Where an Oases parameter lives in a Hugging Face state dict.

    Attributes:
        name: the tensor's key, without the model prefix (``transformer.``/``model.``/``bert.``).
        transposed: stored as ``[in, out]`` (GPT-2 ``Conv1D``) rather than ``[out, in]``.
        part, parts: this parameter is part ``part`` of ``parts`` equal pieces along the
            output dimension of a fused tensor (GPT-2 ``c_attn`` = q | k | v).
        prefixed: the key carries the model prefix (``lm_head`` and BERT's ``cls.`` do not).
    """

    name: str
    transposed: bool = False
    part: int = 0
    parts: int = 1
    prefixed: bool = True


def _sources(cfg: ModelConfig) -> dict[str, Source]:
    """Oases parameter name -> its Hugging Face source, for every parameter of ``cfg``."""
    out: dict[str, Source] = {}
    if cfg.family == "gpt":
        out["embed.word.weight"] = Source("wte.weight")
        out["embed.pos"] = Source("wpe.weight")
        for i in range(cfg.num_layers):
            hf, ox = f"h.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                out[ox + f"attn_norm.{kind}"] = Source(hf + f"ln_1.{kind}")
                out[ox + f"mlp_norm.{kind}"] = Source(hf + f"ln_2.{kind}")
                for part, proj in enumerate("qkv"):
                    out[ox + f"attn.{proj}.{kind}"] = Source(hf + f"attn.c_attn.{kind}", kind == "weight", part, 3)
                out[ox + f"attn.o.{kind}"] = Source(hf + f"attn.c_proj.{kind}", kind == "weight")
                out[ox + f"mlp.fc1.{kind}"] = Source(hf + f"mlp.c_fc.{kind}", kind == "weight")
                out[ox + f"mlp.fc2.{kind}"] = Source(hf + f"mlp.c_proj.{kind}", kind == "weight")
        out["head.norm.weight"], out["head.norm.bias"] = Source("ln_f.weight"), Source("ln_f.bias")
    elif cfg.family == "bert":
        return _bert_sources(cfg)
    else:
        out["embed.word.weight"] = Source("embed_tokens.weight")
        for i in range(cfg.num_layers):
            hf, ox = f"layers.{i}.", f"layers.{i}."
            for proj in "qkvo":
                out[ox + f"attn.{proj}.weight"] = Source(hf + f"self_attn.{proj}_proj.weight")
                if cfg.qkv_bias and proj != "o":
                    out[ox + f"attn.{proj}.bias"] = Source(hf + f"self_attn.{proj}_proj.bias")
            for proj in ("gate", "up", "down"):
                out[ox + f"mlp.{proj}.weight"] = Source(hf + f"mlp.{proj}_proj.weight")
            out[ox + "attn_norm.weight"] = Source(hf + "input_layernorm.weight")
            out[ox + "mlp_norm.weight"] = Source(hf + "post_attention_layernorm.weight")
        out["head.norm.weight"] = Source("norm.weight")
    if not cfg.tie_embeddings:
        out["head.decoder.weight"] = Source("lm_head.weight", prefixed=False)
    return out


def _bert_sources(cfg: ModelConfig) -> dict[str, Source]:
    """BERT's table: post-LN, so a block's norm is the ``LayerNorm`` of its output
    (``attention.output`` / ``output``); the head is ``cls.predictions`` (unprefixed).
    Untied, Hugging Face's decoder has its own ``decoder.bias`` (``cls.predictions.bias``
    is then unused by its forward; :func:`hf_state_dict` writes it equal)."""
    out = {"embed.word.weight": Source("embeddings.word_embeddings.weight"),
           "embed.pos": Source("embeddings.position_embeddings.weight")}
    if cfg.type_vocab_size:
        out["embed.types"] = Source("embeddings.token_type_embeddings.weight")
    for kind in ("weight", "bias"):
        out[f"embed.norm.{kind}"] = Source(f"embeddings.LayerNorm.{kind}")
        for i in range(cfg.num_layers):
            hf, ox = f"encoder.layer.{i}.", f"layers.{i}."
            for proj, name in (("q", "query"), ("k", "key"), ("v", "value")):
                out[ox + f"attn.{proj}.{kind}"] = Source(hf + f"attention.self.{name}.{kind}")
            out[ox + f"attn.o.{kind}"] = Source(hf + f"attention.output.dense.{kind}")
            out[ox + f"attn_norm.{kind}"] = Source(hf + f"attention.output.LayerNorm.{kind}")
            out[ox + f"mlp.fc1.{kind}"] = Source(hf + f"intermediate.dense.{kind}")
            out[ox + f"mlp.fc2.{kind}"] = Source(hf + f"output.dense.{kind}")
            out[ox + f"mlp_norm.{kind}"] = Source(hf + f"output.LayerNorm.{kind}")
        out[f"head.dense.{kind}"] = Source(f"cls.predictions.transform.dense.{kind}", prefixed=False)
        out[f"head.norm.{kind}"] = Source(f"cls.predictions.transform.LayerNorm.{kind}", prefixed=False)
    if cfg.tie_embeddings:
        out["head.bias"] = Source("cls.predictions.bias", prefixed=False)
    else:
        out["head.decoder.weight"] = Source("cls.predictions.decoder.weight", prefixed=False)
        out["head.decoder.bias"] = Source("cls.predictions.decoder.bias", prefixed=False)
    return out


def _key(cfg: ModelConfig, src: Source) -> str:
    return (_PREFIX[cfg.family] if src.prefixed else "") + src.name


# -- config ------------------------------------------------------------------------
def _rope_options(hf: Any) -> dict[str, Any]:
    """RoPE fields from either config style: ``rope_parameters`` (transformers >= 5) or
    ``rope_theta`` + ``rope_scaling`` (before)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", 10000.0))}
    if kind == "linear":
        out.update(rope_scaling="linear", rope_factor=float(params["factor"]))
    elif kind == "llama3":
        out.update(
            rope_scaling="llama3", rope_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_positions=int(params["original_max_position_embeddings"]),
        )
    elif kind != "default":
        raise ValueError(f"config_from_hf: rope type {kind!r} is not supported; supported: default, linear, llama3")
    return out


def _architecture(hf: Any) -> str:
    archs = list(getattr(hf, "architectures", None) or [])
    arch = archs[0] if archs else _MODEL_TYPES.get(getattr(hf, "model_type", ""), "")
    if arch not in SUPPORTED:
        found = arch or getattr(hf, "model_type", type(hf).__name__)
        raise ValueError(f"Hugging Face architecture {found!r} is not supported; {_SUPPORTED_LINE}")
    return arch


def config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face config (a config of :data:`ARCHITECTURES`
    or the dict of a ``config.json``); ``overrides`` replace fields (e.g. a shorter
    ``seq_len`` or ``dropout=0``).  Features the Oases model cannot reproduce raise; a
    sliding window shorter than the (overridden) ``seq_len`` is one, refused by ModelConfig."""
    if isinstance(hf_config, dict):
        hf_config = _ConfigJson(hf_config)
    arch = _architecture(hf_config)
    family = SUPPORTED[arch]
    g = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    if family == "gpt":
        act = g("activation_function", "gelu_new")
        if act not in _GELU:
            raise ValueError(f"config_from_hf: GPT-2 activation_function={act!r} is not supported; use one of {sorted(_GELU)}")
        if g("scale_attn_by_inverse_layer_idx", False) or not g("scale_attn_weights", True):
            raise ValueError("config_from_hf: GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
        fields: dict[str, Any] = dict(
            family="gpt", vocab_size=g("vocab_size"), hidden_size=g("n_embd"), num_heads=g("n_head"),
            num_layers=g("n_layer"), ffn_size=g("n_inner") or 0, seq_len=g("n_positions"),
            dropout=float(g("resid_pdrop", 0.0)), norm_eps=float(g("layer_norm_epsilon", 1e-5)),
            activation=_GELU[act], tie_embeddings=bool(g("tie_word_embeddings", True)),
        )
    elif family == "bert":
        fields = _bert_fields(g, overrides)
    else:
        if g("hidden_act", "silu") != "silu":
            raise ValueError(f"config_from_hf: LLaMA hidden_act={g('hidden_act')!r} is not supported; only silu")
        if g("attention_bias", False) or g("mlp_bias", False):  # LlamaConfig's; Qwen2's biases are fixed by its class
            raise ValueError("config_from_hf: LLaMA with attention_bias or mlp_bias is not supported")
        heads, hidden = g("num_attention_heads"), g("hidden_size")
        if (g("head_dim") or hidden // heads) * heads != hidden:
            raise ValueError(f"config_from_hf: head_dim={g('head_dim')} x heads != hidden_size={hidden} is not supported")
        fields = dict(
            family="llama", vocab_size=g("vocab_size"), hidden_size=hidden, num_heads=heads,
            num_layers=g("num_hidden_layers"), ffn_size=g("intermediate_size"), seq_len=g("max_position_embeddings"),
            dropout=float(g("attention_dropout", 0.0)), norm_eps=float(g("rms_norm_eps", 1e-6)),
            num_kv_heads=g("num_key_value_heads") or heads, rotary="half", pad_token_id=g("pad_token_id"),
            tie_embeddings=bool(g("tie_word_embeddings", False)), **_rope_options(hf_config),
            **_llama_variant_fields(arch, g),
        )
    return ModelConfig(**{**fields, **overrides})


def _llama_variant_fields(name: str, g: Callable[..., Any]) -> dict[str, Any]:
    """What a class on LLaMA's layout adds to it: the class itself (for the export), Qwen2's
    q/k/v biases and the sliding window of Mistral (every layer) or Qwen2 (the layers from
    ``max_window_layers`` on, when ``use_sliding_window``; ``layer_types`` when the config
    lists them).  Defaults are the config classes', so a sparse ``config.json`` reads as
    ``transformers`` reads it (Mistral's window is 4096 unless the file says null)."""
    arch = ARCHITECTURES[name]
    out: dict[str, Any] = {"qkv_bias": arch.qkv_bias, "hf_architecture": "" if arch.own else name}
    if arch.window == "every_layer":
        out["sliding_window"] = g("sliding_window", 4096)
    elif arch.window == "upper_layers" and g("use_sliding_window", False) and g("sliding_window", 4096) is not None:
        layers = g("num_hidden_layers")
        types = g("layer_types") or ["sliding_attention" if i >= g("max_window_layers", 28) else "full_attention"
                                     for i in range(layers)]
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        if sliding and sliding != list(range(sliding[0], layers)):
            raise ValueError(f"config_from_hf: {name} layer_types={list(types)} has a full-attention layer after a "
                             f"sliding one, which an export could not write back; only the first layers may attend in full")
        if sliding:
            out.update(sliding_window=g("sliding_window", 4096), full_attention_layers=sliding[0])
    return out


def _bert_fields(g: Callable[..., Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """:func:`config_from_hf` for ``BertConfig``: defaults are ``BertConfig``'s, so a sparse
    ``config.json`` reads as ``transformers`` would read it."""
    act = g("hidden_act", "gelu")
    if act not in _GELU:
        raise ValueError(f"config_from_hf: BERT hidden_act={act!r} is not supported; use one of {sorted(_GELU)}")
    if g("is_decoder", False):
        raise ValueError("config_from_hf: BERT with is_decoder=True (causal attention) is not supported; "
                         "BertForMaskedLM reads both directions")
    if g("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"config_from_hf: BERT position_embedding_type={g('position_embedding_type')!r} is not "
                         f"supported; only absolute")
    hidden_p, attn_p = float(g("hidden_dropout_prob", 0.1)), float(g("attention_probs_dropout_prob", 0.1))
    if hidden_p != attn_p and "dropout" not in overrides:
        raise ValueError(f"config_from_hf: BERT hidden_dropout_prob={hidden_p} differs from attention_probs_dropout_prob="
                         f"{attn_p}; Oases has one dropout probability: pass model.dropout=P")
    return dict(
        family="bert", vocab_size=g("vocab_size", 30522), hidden_size=g("hidden_size", 768),
        num_heads=g("num_attention_heads", 12), num_layers=g("num_hidden_layers", 12),
        ffn_size=g("intermediate_size", 3072), seq_len=g("max_position_embeddings", 512), dropout=hidden_p,
        norm_eps=float(g("layer_norm_eps", 1e-12)), activation=_GELU[act], type_vocab_size=g("type_vocab_size", 2),
        pad_token_id=g("pad_token_id", 0), tie_embeddings=bool(g("tie_word_embeddings", True)),
    )


class HFExtraMissing(ImportError, ValueError):
    """``transformers`` or ``safetensors`` is not installed: one line naming the extra.  A
    ``ValueError`` too, so every caller that turns bad input into one line does so here."""


def require_hf(module: str = "transformers") -> Any:
    """Import ``module`` of the ``[hf]`` extra, or raise :class:`HFExtraMissing` saying how
    to install it (a bare ``ModuleNotFoundError`` traceback names neither the extra nor the fix)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise HFExtraMissing(f"Hugging Face import and export need {module.split('.')[0]}, which is not installed; "
                             "install the [hf] extra: pip install 'oases-ds[hf]'") from None


_GPT2_END = 50256  # GPT2Config's bos/eos default: GPT-2's <|endoftext|>; set here so a smaller vocab warns nowhere
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")


def hf_config(cfg: ModelConfig) -> Any:
    """The ``transformers`` config that describes ``cfg`` (for :func:`save_hf`): of its
    ``hf_architecture``, or the family's own class.  A special token id the config class
    defaults to outside this vocabulary (GPT-2's 50256 for a 256-token model) is left unset:
    ``transformers`` warns about such a config on load, and no token of this model has it."""
    config = _hf_config(cfg, require_hf())
    for field in _TOKEN_ID_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not 0 <= value < cfg.vocab_size:
            setattr(config, field, None)
    return config


def _hf_config(cfg: ModelConfig, transformers: Any) -> Any:
    name = cfg.hf_architecture or _OWN.get(cfg.family, "")
    if name not in ARCHITECTURES or ARCHITECTURES[name].family != cfg.family:
        raise ValueError(f"save_hf: model.hf_architecture={cfg.hf_architecture!r} is not a class of family "
                         f"{cfg.family}; {_SUPPORTED_LINE}")
    if cfg.family == "gpt":
        if cfg.kv_heads != cfg.num_heads:
            raise ValueError("save_hf: GPT-2 has no grouped-query attention; model.num_kv_heads must equal num_heads")
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_heads, n_inner=cfg.ffn_size or None, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout, layer_norm_epsilon=cfg.eps,
            activation_function="gelu_new" if cfg.mlp_act == "gelu_tanh" else "gelu",
            tie_word_embeddings=cfg.tie_embeddings, architectures=["GPT2LMHeadModel"],
            **{k: (_GPT2_END if cfg.vocab_size > _GPT2_END else None) for k in ("bos_token_id", "eos_token_id")},
        )
    if cfg.family == "bert":
        return transformers.BertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, intermediate_size=cfg.ffn,
            hidden_act="gelu_new" if cfg.mlp_act == "gelu_tanh" else "gelu", hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout, max_position_embeddings=cfg.seq_len,
            type_vocab_size=cfg.type_vocab_size or 1,  # none: one all-zero row, which adds nothing
            layer_norm_eps=cfg.eps, pad_token_id=cfg.pad_token_id, tie_word_embeddings=cfg.tie_embeddings,
            architectures=["BertForMaskedLM"],
        )
    if cfg.family == "llama":
        if cfg.rotary != "half":
            raise ValueError("save_hf: Hugging Face LLaMA rotates halves; train with model.rotary='half' to export")
        rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
        if cfg.rope_scaling == "linear":
            rope.update(rope_type="linear", factor=cfg.rope_factor)
        elif cfg.rope_scaling == "llama3":
            rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                        high_freq_factor=cfg.rope_high_freq_factor,
                        original_max_position_embeddings=cfg.rope_original_max_positions)
        kw: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.eps, attention_dropout=cfg.dropout,
            pad_token_id=cfg.pad_token_id, tie_word_embeddings=cfg.tie_embeddings, architectures=[name],
            **_llama_variant_options(name, cfg),
        )
        if "rope_parameters" in transformers.LlamaConfig().to_dict():
            kw["rope_parameters"] = rope
        else:  # transformers < 5
            kw["rope_theta"] = rope.pop("rope_theta")
            kw["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        return getattr(transformers, ARCHITECTURES[name].config_class)(**kw)
    raise ValueError(f"save_hf: family {cfg.family!r} cannot be exported; {_SUPPORTED_LINE}")


def _llama_variant_options(name: str, cfg: ModelConfig) -> dict[str, Any]:
    """The config options of class ``name`` that write back ``cfg``'s q/k/v biases and
    window (the inverse of :func:`_llama_variant_fields`); what the class cannot state is
    refused: its q/k/v biases are fixed by the class, and only Mistral and Qwen2 have a window."""
    arch = ARCHITECTURES[name]
    if cfg.qkv_bias != arch.qkv_bias:
        fix = "model.hf_architecture=Qwen2ForCausalLM" if cfg.qkv_bias else "model.hf_architecture=LlamaForCausalLM"
        raise ValueError(f"save_hf: {name} {'has' if arch.qkv_bias else 'has no'} q/k/v biases and the model has "
                         f"{'them' if cfg.qkv_bias else 'none'} (model.qkv_bias={cfg.qkv_bias}); export with {fix}")
    window = cfg.sliding_window
    if window is not None and not arch.window:
        raise ValueError(f"save_hf: {name} has no sliding window (model.sliding_window={window}); set "
                         f"model.sliding_window=null or export with model.hf_architecture=MistralForCausalLM")
    if arch.window == "every_layer":
        if window is not None and cfg.full_attention_layers:
            raise ValueError(f"save_hf: {name} slides every layer; model.full_attention_layers="
                             f"{cfg.full_attention_layers} must be 0")
        return {"sliding_window": window}
    if arch.window == "upper_layers":
        if window is None:
            return {"use_sliding_window": False, "sliding_window": None}
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": cfg.full_attention_layers}
    return {}


class _ConfigJson:
    """Attribute access to a ``config.json`` dict, so both config forms read alike."""

    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)


# -- reading -----------------------------------------------------------------------
Slices = tuple[slice, ...]


class _Tensors:
    """Read-only view of a checkpoint that hands out slices: safetensors files (only the
    requested rows are read) or an in-memory state dict."""

    def __init__(self, keys: set[str], read: Callable[[str, Slices], torch.Tensor]) -> None:
        self.keys, self._read = keys, read

    def read(self, key: str, slices: Slices) -> torch.Tensor:
        if key not in self.keys:
            raise ValueError(f"load_hf: tensor {key!r} is missing from the checkpoint; is it a complete save of the model?")
        return self._read(key, slices)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{path} has no model.safetensors (or index); save the model with safe_serialization=True")


class _SafetensorsDir:
    """Open handles on every shard file of a checkpoint directory, for one load."""

    def __init__(self, path: Path) -> None:
        safe_open = require_hf("safetensors").safe_open

        self.handles = [safe_open(str(f), framework="pt") for f in _safetensors_files(path)]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def tensors(self) -> _Tensors:
        return _Tensors(set(self.where), lambda key, slices: self.where[key].get_slice(key)[slices])


def _key_resolver(tensors: _Tensors, cfg: ModelConfig) -> Callable[[Source], str]:
    """Key of a source in this checkpoint: GPT-2 files saved from ``GPT2Model`` lack the
    ``transformer.`` prefix."""

    def key(src: Source) -> str:
        full = _key(cfg, src)
        return full if full in tensors.keys or src.name not in tensors.keys else src.name

    return key


def _read_block(cfg: ModelConfig, tensors: _Tensors, key: str, src: Source, name: str,
                ranges: list[tuple[int, int]], full_rows: int) -> torch.Tensor:
    """The block ``ranges`` (per dimension, in the Oases orientation) of parameter ``name``
    stored as ``src`` under ``key``: only those elements are read.  ``full_rows``: the
    parameter's full first dimension (where its part of a fused tensor starts)."""
    ranges = list(ranges)
    if name == "embed.pos":  # a checkpoint may hold more positions than the model uses
        ranges[0] = (0, cfg.seq_len)
    offset = src.part * full_rows
    ranges[0] = (ranges[0][0] + offset, ranges[0][1] + offset)
    if src.transposed:
        ranges.reverse()
    value = tensors.read(key, tuple(slice(lo, hi) for lo, hi in ranges))
    return value.t() if src.transposed else value


@torch.no_grad()
def _load_into(model: OperatorModel, tensors: _Tensors) -> None:
    """Copy this rank's slice of every parameter; only those rows are read."""
    cfg, sources = model.cfg, _sources(model.cfg)
    key_of = _key_resolver(tensors, cfg)
    for name, param in model.named_parameters():
        full_shape = model.sharding.full_shape(name, param)
        ranges = [(0, n) for n in full_shape]
        dim = getattr(param, "tp_dim", None)
        if dim is not None:
            start = group_rank(model.sharding.group_of(name)) * param.shape[dim]
            ranges[dim] = (min(start, full_shape[dim]), min(start + param.shape[dim], full_shape[dim]))
        value = _read_block(cfg, tensors, key_of(sources[name]), sources[name], name, ranges, full_shape[0])
        if dim is not None and value.shape[dim] < param.shape[dim]:  # vocabulary padding rows
            pad = list(value.shape)
            pad[dim] = param.shape[dim] - value.shape[dim]
            value = torch.cat((value, value.new_zeros(pad)), dim=dim)
        param.copy_(value)


def _full_values(cfg: ModelConfig, tensors: _Tensors,
                 shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's full (unsharded, unpadded) value, one at a time, so that a
    conversion holds one tensor in memory, not the model."""
    sources, key_of = _sources(cfg), _key_resolver(tensors, cfg)
    for name, shape in shapes.items():
        yield name, _read_block(cfg, tensors, key_of(sources[name]), sources[name], name,
                                [(0, n) for n in shape], shape[0])


def _group_of(group_or_ctx: Union[Group, ParallelContext]) -> Group:
    return group_or_ctx.tp_group if isinstance(group_or_ctx, ParallelContext) else group_or_ctx


def is_hf_model(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers`` model object (any class; :data:`SUPPORTED`
    says which convert), told by its module so that ``transformers`` need not be imported."""
    return type(obj).__module__.split(".")[0] == "transformers" and hasattr(obj, "config")


@dataclass(frozen=True)
class HFCheckpoint:
    """A Hugging Face model to start training from, for the entry points that build the
    model themselves (``oases_ds.initialize``, ``oases-train model=hf``, the Lightning
    module): they need its :class:`ModelConfig` first (to build this rank's shard, for a
    plan too), and its weights loaded into that shard before the engine copies them
    into optimizer state.

    Attributes:
        source: a local directory (``config.json`` + safetensors) or a ``transformers`` model.
        overrides: :class:`ModelConfig` fields that replace the checkpoint's (``seq_len``, ``dropout``).
    """

    source: Any
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.source, (str, os.PathLike)):
            path = Path(self.source)
            if not (path / "config.json").is_file():
                raise ValueError(f"{path} is not a directory with a config.json; pass a saved Hugging Face model directory")
            _safetensors_files(path)
        elif not is_hf_model(self.source) or type(self.source).__name__ not in SUPPORTED:
            raise ValueError(f"{type(self.source).__name__} is not supported; {_SUPPORTED_LINE}")

    def config(self) -> ModelConfig:
        """The checkpoint's :class:`ModelConfig` with the overrides applied."""
        if isinstance(self.source, (str, os.PathLike)):
            return config_from_hf(json.loads((Path(self.source) / "config.json").read_text()), **self.overrides)
        return config_from_hf(self.source.config, **self.overrides)

    def _tensors(self) -> _Tensors:
        if isinstance(self.source, (str, os.PathLike)):
            return _SafetensorsDir(Path(self.source)).tensors()
        state = self.source.state_dict()
        return _Tensors(set(state), lambda key, slices: state[key][slices])

    def load_into(self, model: OperatorModel) -> None:
        """Copy this rank's slices of the checkpoint into ``model`` (built from :meth:`config`)."""
        _load_into(model, self._tensors())

    def full_values(self, cfg: ModelConfig,
                    shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full value)`` of each parameter in ``shapes`` (name -> full shape, of a
        model of ``cfg``, i.e. :meth:`config`), read one at a time: what an offline
        conversion (``oases-ckpt convert --from-hf``) writes without building the model."""
        return _full_values(cfg, self._tensors(), shapes)


def load_hf(source: Union[str, os.PathLike, Any], group: Union[Group, ParallelContext] = None,
            **overrides: Any) -> OperatorModel:
    """An :class:`OperatorModel` holding this rank's shards of a Hugging Face model.

    Args:
        source: a local directory with ``config.json`` and safetensors weights (each
            rank reads only its slices), or a ``transformers`` model object.
        group: the TMP group, or a :class:`ParallelContext` (its TMP group); ``None``: one rank.
        overrides: :class:`ModelConfig` fields to replace (e.g. ``dropout=0.0``).
    """
    try:
        checkpoint = HFCheckpoint(source, overrides)
    except ValueError as err:
        raise ValueError(f"load_hf: {err}, or a directory" if not isinstance(source, (str, os.PathLike))
                         else f"load_hf: {err}") from None
    model = OperatorModel(checkpoint.config(), _group_of(group))
    checkpoint.load_into(model)
    return model


# -- writing -----------------------------------------------------------------------
def hf_state_dict(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face state dict (contiguous tensors) of unsharded Oases values ``full``:
    the inverse of the :class:`Source` table (fused parts concatenated, ``Conv1D``
    weights transposed back).  Also maps gradients, for comparisons.

    BERT adds what ``BertForMaskedLM`` holds and the Oases model does not: a token-type
    table of one zero row when the model has no token types (adding it changes nothing),
    and, untied, ``cls.predictions.bias`` equal to the decoder's bias (its forward reads
    only the latter)."""
    groups: dict[str, list[tuple[int, torch.Tensor, bool]]] = {}
    for name, src in _sources(cfg).items():
        value = full[name].t() if src.transposed else full[name]
        groups.setdefault(_key(cfg, src), []).append((src.part, value, src.transposed))
    out = {}
    for key, pieces in groups.items():
        pieces.sort(key=lambda p: p[0])
        dim = 1 if pieces[0][2] else 0
        out[key] = torch.cat([p[1] for p in pieces], dim=dim).contiguous() if len(pieces) > 1 else pieces[0][1].contiguous()
    if cfg.family == "bert":
        if not cfg.type_vocab_size:
            word = full["embed.word.weight"]
            out["bert.embeddings.token_type_embeddings.weight"] = word.new_zeros(1, word.shape[1])
        if not cfg.tie_embeddings:
            out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"].clone()
    return out


def _publish(tmp: Path, final: Path) -> None:
    """Replace ``final`` by the finished directory ``tmp``: a reader sees the old or the
    new model, never a half-written one."""
    fsync_directory(tmp)
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_hf(cfg: ModelConfig, full: dict[str, torch.Tensor], path: Union[str, os.PathLike],
             config: Any = None) -> None:
    """Write the directory ``path`` that ``from_pretrained`` loads (``config.json`` and
    ``model.safetensors``) from the unsharded Oases values ``full`` of a model of ``cfg``,
    on this process alone; ``config``: :func:`hf_config` of ``cfg``, when the caller made it
    already (to refuse an unexportable model before any work).

    Written into a temporary sibling and renamed into place (:func:`_publish`), so a
    reader never sees a half-written model.  The one writer of :func:`save_hf` (a running
    model, gathered) and of ``oases-ckpt convert --to-hf`` (a checkpoint's portable state)."""
    save_file = require_hf("safetensors.torch").save_file

    config = hf_config(cfg) if config is None else config
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        config.save_pretrained(str(tmp))
        save_file(hf_state_dict(cfg, full), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_hf(model_or_engine: Any, path: Union[str, os.PathLike]) -> None:
    """Write a directory ``transformers`` loads with ``from_pretrained``.

    Collective: every rank calls it (each sharded parameter is gathered over its
    group); global rank 0 writes it (:func:`write_hf`), then all ranks meet at a barrier,
    so no rank reads the directory before it is complete.
    """
    model = getattr(model_or_engine, "module", model_or_engine)
    if not isinstance(model, OperatorModel):
        raise ValueError(f"save_hf: expected an OperatorModel or an engine holding one, got {type(model).__name__}")
    config = hf_config(model.cfg)  # refuse an unexportable model before any collective
    full = {name: model.sharding.gather_full(name, p, p.data) for name, p in model.named_parameters()}
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        write_hf(model.cfg, full, path, config)
    if distributed:
        dist.barrier()
