"""Model hyper-parameters, validated against the TMP degree they will be built for."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Family = Literal["gpt", "bert", "llama"]
FAMILIES: tuple[str, ...] = ("gpt", "bert", "llama")


@dataclass(frozen=True)
class ModelConfig:
    """One transformer, described once for every family and every TMP degree.

    Attributes:
        family: "gpt" (pre-LN, causal, GeLU, learned positions), "bert" (post-LN,
            bidirectional, masked-LM head) or "llama" (RMSNorm, SwiGLU, RoPE, no biases).
        vocab_size: tokens in the vocabulary (sharded over TMP ranks).
        hidden_size: model width.
        num_heads: attention heads (sharded over TMP ranks).
        num_layers: transformer blocks.
        ffn_size: MLP inner width (sharded over TMP ranks); 0 means 4 x hidden.
        seq_len: tokens per sample.
        dropout: probability for embedding, attention-probability and residual dropout.
        norm_eps: epsilon of LayerNorm / RMSNorm.
    """

    family: Family = "gpt"
    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 2
    ffn_size: int = 0
    seq_len: int = 64
    dropout: float = 0.1
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} unknown; choose one of {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_heads", "num_layers", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} does not divide model.hidden_size={self.hidden_size}"
            )
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"llama needs an even head dim for RoPE, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn(self) -> int:
        return self.ffn_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def check_tp(self, tp: int) -> None:
        """Raise a one-line error if ``tp`` cannot shard this model evenly."""
        for name, value in (
            ("num_heads", self.num_heads),
            ("ffn_size", self.ffn),
            ("vocab_size", self.vocab_size),
        ):
            if value % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide model.{name}={value}; "
                    f"pick a TMP degree that divides it or change model.{name}"
                )

    def to_dict(self) -> dict:
        return asdict(self)
