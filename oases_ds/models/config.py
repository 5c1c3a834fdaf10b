"""Model hyper-parameters, validated against the TMP degree they will be built for."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Sequence

Family = Literal["gpt", "bert", "llama"]
FAMILIES: tuple[str, ...] = ("gpt", "bert", "llama")
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_tanh", "silu")
ROTARY_MODES: tuple[str, ...] = ("interleaved", "half")
ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "llama3")
# The epsilon each family's Hugging Face reference uses, so an imported checkpoint
# normalises exactly as it was trained (GPT-2 1e-5, BERT 1e-12, LLaMA 1e-6).
DEFAULT_NORM_EPS: dict[str, float] = {"gpt": 1e-5, "bert": 1e-12, "llama": 1e-6}
DEFAULT_ACTIVATION: dict[str, str] = {"gpt": "gelu", "bert": "gelu", "llama": "silu"}
AT_LEAST: dict[str, tuple[int, str]] = {
    "vocab_size": (1, ""), "hidden_size": (1, ""), "num_heads": (1, ""), "num_layers": (1, ""), "seq_len": (1, ""),
    "ffn_size": (0, " (0: 4 x hidden_size)"), "num_kv_heads": (0, " (0: num_heads)"),
    "type_vocab_size": (0, " (0: no token types)"), "rope_original_max_positions": (1, ""),
    "full_attention_layers": (0, ""),
}
"""The smallest value of each whole-number field, and what its 0 means where 0 is allowed."""
POSITIVE: tuple[str, ...] = ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor")
"""Float fields that must be > 0 (``norm_eps`` too, once its family default is resolved)."""


@dataclass(frozen=True)
class ModelConfig:
    """One transformer, described once for every family and every TMP degree.

    Attributes:
        family: "gpt" (pre-LN, causal, GeLU, learned positions), "bert" (post-LN,
            bidirectional, masked-LM head) or "llama" (RMSNorm, SwiGLU, RoPE, no biases but
            ``qkv_bias``'s).
        vocab_size: tokens in the vocabulary (sharded over TMP ranks).
        hidden_size: model width.
        num_heads: attention heads (sharded over TMP ranks).
        num_layers: transformer blocks.
        ffn_size: MLP inner width (sharded over TMP ranks); 0 means 4 x hidden.
        seq_len: tokens per sample.
        dropout: probability for embedding, attention-probability and residual dropout.
        norm_eps: epsilon of LayerNorm / RMSNorm; ``None`` takes the family's Hugging Face
            default (:data:`DEFAULT_NORM_EPS`).
        num_kv_heads: key/value heads (grouped-query attention); 0 means ``num_heads``.
            Query head ``i`` reads key/value head ``i // (num_heads / num_kv_heads)`` as in
            Hugging Face's ``repeat_kv``.  Split over TMP ranks, so the TMP degree must
            divide it.
        rope_theta: RoPE base (LLaMA 2: 1e4, LLaMA 3: 5e5).
        rope_scaling: "none", "linear" (positions divided by ``rope_factor``) or "llama3"
            (low frequencies divided by ``rope_factor``, a smooth ramp between
            ``rope_low_freq_factor`` and ``rope_high_freq_factor`` of
            ``rope_original_max_positions``).
        rotary: which pairs RoPE rotates: "interleaved" (dims 2i, 2i+1; Meta's original
            layout) or "half" (dims i, i + d/2; Hugging Face's ``rotate_half``).  The two
            are the same model up to a permutation of the q/k rows, so a checkpoint must
            be run in the mode it was saved for.
        tie_embeddings: the output head reuses the vocab-parallel input embedding
            (GPT-2, and BERT's ``BertForMaskedLM``); there is then no ``head.decoder.weight``.
            A tied BERT head keeps its own vocab-parallel bias ``head.bias`` (Hugging Face's
            ``cls.predictions.bias``), as the untied one keeps ``head.decoder.bias``.
        activation: MLP non-linearity: "gelu" (erf), "gelu_tanh" (GPT-2's ``gelu_new``);
            LLaMA's gated MLP is always "silu" (SwiGLU).  Empty: the family default.
        type_vocab_size: BERT token types (segment ids, batch key ``token_types``);
            0: none.
        pad_token_id: the ``[PAD]`` token, whose embedding row gets no gradient from the
            lookup, as ``nn.Embedding(padding_idx=...)`` in Hugging Face's BERT and LLaMA
            (a tied head still trains the row through the decoder); ``None``: no such token.
        qkv_bias: llama only: biases on the q, k and v projections (not on o, not in the
            MLP), as Qwen2 has them; gpt and bert have every bias already.
        sliding_window: llama only: the checkpoint's attention window in tokens (Mistral,
            Qwen2's sliding layers), a query attending to itself and the ``window - 1``
            tokens before it.  Oases attends causally over the whole sequence, which is the
            same only while the window covers it, so it must be ``>= seq_len``; it is kept so
            that an export writes it back.  ``None``: no window.
        full_attention_layers: with ``sliding_window``, the first this many layers attend in
            full and the rest within the window (Qwen2's ``max_window_layers``; 0: every
            layer slides, as Mistral's); read by the export only.
        hf_architecture: the Hugging Face class an export writes, when it is not the
            family's own (``config_from_hf`` sets it, e.g. "Qwen2ForCausalLM" for a llama);
            "": GPT2LMHeadModel, BertForMaskedLM or LlamaForCausalLM.  Which classes are
            supported, and for which options, is ``oases_ds.hf``'s table.
    """

    family: Family = "gpt"
    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 2
    ffn_size: int = 0
    seq_len: int = 64
    dropout: float = 0.1
    norm_eps: float | None = None
    num_kv_heads: int = 0
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rotary: str = "interleaved"
    tie_embeddings: bool = False
    activation: str = ""
    type_vocab_size: int = 0
    pad_token_id: int | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    full_attention_layers: int = 0
    hf_architecture: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} unknown; choose one of {', '.join(FAMILIES)}")
        # The unset values (None, "", 0) stay as given and resolve in properties, so that
        # dataclasses.replace(cfg, family="llama") takes the new family's defaults.
        self._check_ranges()
        self._check_options()
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} does not divide model.hidden_size={self.hidden_size}"
            )
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"llama needs an even head dim for RoPE, got {self.head_dim}")

    def _check_ranges(self) -> None:
        """Each numeric field against its own range, before anything computes with one:
        ``num_heads=0`` must be refused by name, not surface as a ``ZeroDivisionError`` from
        ``num_heads % kv_heads``.  Written so that NaN fails too (``not nan > 0``)."""
        for name, (least, meaning) in AT_LEAST.items():
            if not getattr(self, name) >= least:
                raise ValueError(f"model.{name} must be >= {least}{meaning}, got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"model.norm_eps must be > 0, got {self.norm_eps}")
        for name in POSITIVE:
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"model.pad_token_id={self.pad_token_id} is not a token of model.vocab_size="
                             f"{self.vocab_size}; give an id below it, or null for no padding token")

    def _check_options(self) -> None:
        """One-line errors for the options real checkpoints need (GQA, RoPE, ties, activation)."""
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads} (0: num_heads)"
            )
        if self.kv_heads != self.num_heads and self.family == "bert":
            raise ValueError("model.num_kv_heads applies to gpt and llama; leave it 0 for bert")
        if self.mlp_act not in ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r} unknown; choose one of {', '.join(ACTIVATIONS)}")
        if (self.family == "llama") != (self.mlp_act == "silu"):
            want = "silu (SwiGLU)" if self.family == "llama" else "gelu or gelu_tanh"
            raise ValueError(f"model.activation={self.activation!r} does not fit family {self.family}; use {want}")
        if self.rotary not in ROTARY_MODES:
            raise ValueError(f"model.rotary={self.rotary!r} unknown; choose one of {', '.join(ROTARY_MODES)}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"model.rope_scaling={self.rope_scaling!r} unknown; choose one of {', '.join(ROPE_SCALINGS)}"
            )
        if self.rope_scaling != "none" and not self.rope_factor >= 1.0:
            raise ValueError(f"model.rope_factor must be >= 1 with rope_scaling={self.rope_scaling}, got {self.rope_factor}")
        if self.rope_scaling == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be > 0 and below "
                f"model.rope_high_freq_factor={self.rope_high_freq_factor}"
            )
        if self.type_vocab_size and self.family != "bert":
            raise ValueError(f"model.type_vocab_size={self.type_vocab_size} applies to bert only (>= 1), else 0")
        self._check_llama_attention()

    def _check_llama_attention(self) -> None:
        """The attention options that only the llama layout has (Qwen2's biases, Mistral's
        window).  A window shorter than the sequence would need a banded mask, which the
        attention core does not apply: refused, with the sequence length that fits."""
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"model.qkv_bias must be true or false, got {self.qkv_bias!r}")
        if self.qkv_bias and self.family != "llama":
            raise ValueError("model.qkv_bias applies to llama (gpt and bert have every bias already); leave it false")
        if self.sliding_window is None:
            return
        if not self.sliding_window >= 1:  # the range first, as for every numeric field
            raise ValueError(f"model.sliding_window must be >= 1 (null: no window), got {self.sliding_window}")
        if self.family != "llama":
            raise ValueError(f"model.sliding_window={self.sliding_window} applies to llama only; leave it null")
        if self.sliding_window < self.seq_len:
            raise ValueError(
                f"model.sliding_window={self.sliding_window} is shorter than model.seq_len={self.seq_len}: "
                f"sliding-window attention is not supported (Oases attends over the whole sequence); "
                f"train with model.seq_len=<= {self.sliding_window}")

    @property
    def ffn(self) -> int:
        return self.ffn_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def eps(self) -> float:
        """``norm_eps``, or the family's Hugging Face default when unset."""
        return DEFAULT_NORM_EPS[self.family] if self.norm_eps is None else self.norm_eps

    @property
    def mlp_act(self) -> str:
        """``activation``, or the family default when unset."""
        return self.activation or DEFAULT_ACTIVATION[self.family]

    @property
    def kv_heads(self) -> int:
        """``num_kv_heads``, or ``num_heads`` (no grouping) when unset."""
        return self.num_kv_heads or self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of ``tp`` (Megatron's padded vocab): the
        extra rows are zeros that never reach a softmax or a loss, so GPT-2's 50257
        tokens shard over any TMP degree; checkpoints keep the unpadded size."""
        return -(-self.vocab_size // tp) * tp

    def check_tp(self, tp: int) -> None:
        """Raise a one-line error if ``tp`` cannot shard this model evenly (every block at ``tp``)."""
        self.check_degrees(tp)

    def check_degrees(self, tensor_parallel_size: int, attn_degrees: Sequence[int] | None = None,
                      mlp_degrees: Sequence[int] | None = None) -> None:
        """Every TMP degree the model is built at, checked in one place, one line per failure.

        An attention block at degree ``t`` splits its query heads over ``t`` ranks (``t`` must
        divide ``num_heads``) and its key/value heads too, or replicates them when there are
        fewer than ``t`` (``t`` a multiple of ``num_kv_heads``: each rank's query heads then
        read one k/v head); an MLP block splits ``ffn_size``.  The vocabulary is padded to a
        multiple of the degree (:meth:`padded_vocab`), so it shards at any degree and the
        embedding and head need no check.  Without a plan every block runs at
        ``tensor_parallel_size``; with one (``attn_degrees`` / ``mlp_degrees``, per layer) each
        block at its own degree, and the error names the block."""
        if attn_degrees is None and mlp_degrees is None:
            blocks = [("attn", None, tensor_parallel_size), ("mlp", None, tensor_parallel_size)]
        else:
            blocks = [("attn", i, d) for i, d in enumerate(attn_degrees or ())] + \
                     [("mlp", i, d) for i, d in enumerate(mlp_degrees or ())]
        for kind, layer, degree in blocks:
            problem = self._block_problem(kind, degree)
            if problem is None:
                continue
            field, value, why, note = problem
            if layer is None:
                raise ValueError(f"tensor_parallel_size={degree} {why} model.{field}={value}{note}; "
                                 f"pick a TMP degree that divides it or change model.{field}")
            block = "attention" if kind == "attn" else "MLP"
            raise ValueError(f"plan: layer {layer}'s {block} block at TMP degree {degree} {why} model.{field}={value}"
                             f"{note}; plan that block at another degree or change model.{field}")

    def _block_problem(self, kind: str, degree: int) -> tuple[str, int, str, str] | None:
        """``(field, value, what is wrong, why)`` if a ``kind`` block cannot run at ``degree``, else ``None``."""
        if kind == "mlp":
            return ("ffn_size", self.ffn, "does not divide", "") if self.ffn % degree else None
        if self.num_heads % degree:
            return "num_heads", self.num_heads, "does not divide", ""
        if self.kv_heads >= degree and self.kv_heads % degree:
            return "num_kv_heads", self.kv_heads, "does not divide", ""
        if self.kv_heads < degree and degree % self.kv_heads:
            return ("num_kv_heads", self.kv_heads, "is neither a divisor nor a multiple of",
                    " (k/v heads are split over the ranks or replicated)")
        return None

    def to_dict(self) -> dict:
        return asdict(self)
