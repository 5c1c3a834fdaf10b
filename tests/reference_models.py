"""Plain single-process PyTorch GPT / BERT / LLaMA: the ground truth for parity tests.

Written against the model *definition* (ModelConfig docs), not against the TMP
code: standard ``nn.Linear``/``nn.Embedding`` modules, full heads, no operator
sequence, no collectives.  Shared with the library are only the two things that
*define* the model's numbers rather than compute them: the deterministic
initial weights (``init_full_parameter``) and the keyed dropout masks
(``keyed_dropout`` with the same site numbers), so that gradients can be
compared element by element.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import IGNORE_INDEX, SITE_EMBED, dropout_site
from oases_ds.models.sharding import init_full_parameter
from oases_ds.parallel.random import RNGTracker, keyed_dropout


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.eps))


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, bias = cfg.hidden_size, cfg.family != "llama"
        make_norm = (lambda: _RMSNorm(H, cfg.eps)) if cfg.family == "llama" else (
            lambda: nn.LayerNorm(H, eps=cfg.eps)
        )
        self.attn_norm, self.mlp_norm = make_norm(), make_norm()
        kv = cfg.kv_heads * cfg.head_dim
        qkv_bias = bias or cfg.qkv_bias  # LLaMA: only Qwen2's q/k/v biases, never o's
        self.attn = nn.ModuleDict({n: nn.Linear(H, kv if n in "kv" else H, bias=qkv_bias if n in "qkv" else bias)
                                   for n in ("q", "k", "v", "o")})
        if cfg.family == "llama":
            self.mlp = nn.ModuleDict(
                {"gate": nn.Linear(H, cfg.ffn, bias=False), "up": nn.Linear(H, cfg.ffn, bias=False),
                 "down": nn.Linear(cfg.ffn, H, bias=False)}
            )
        else:
            self.mlp = nn.ModuleDict({"fc1": nn.Linear(H, cfg.ffn), "fc2": nn.Linear(cfg.ffn, H)})


class ReferenceModel(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed = nn.Module()
        self.embed.word = nn.Embedding(cfg.vocab_size, H, padding_idx=cfg.pad_token_id)
        if cfg.family != "llama":
            self.embed.pos = nn.Parameter(torch.zeros(cfg.seq_len, H))
        if cfg.type_vocab_size:
            self.embed.types = nn.Parameter(torch.zeros(cfg.type_vocab_size, H))
        if cfg.family == "bert":
            self.embed.norm = nn.LayerNorm(H, eps=cfg.eps)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.head = nn.Module()
        if cfg.family == "bert":
            self.head.dense = nn.Linear(H, H)
            self.head.norm = nn.LayerNorm(H, eps=cfg.eps)
        else:
            self.head.norm = _RMSNorm(H, cfg.eps) if cfg.family == "llama" else nn.LayerNorm(H, eps=cfg.eps)
        if not cfg.tie_embeddings:
            self.head.decoder = nn.Linear(H, cfg.vocab_size, bias=cfg.family == "bert")
        elif cfg.family == "bert":  # tied decoder weight, its own bias (BertForMaskedLM)
            self.head.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(init_full_parameter(name, tuple(p.shape), seed))

    def _frequencies(self, d: int) -> torch.Tensor:
        """RoPE frequencies, one at a time, straight from the scaling rules in ModelConfig's docs."""
        cfg = self.cfg
        out = []
        for i in range(0, d, 2):
            f = 1.0 / (cfg.rope_theta ** (i / d))
            if cfg.rope_scaling == "linear":
                f = f / cfg.rope_factor
            elif cfg.rope_scaling == "llama3":
                wavelength = 2 * math.pi / f
                long_edge = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
                short_edge = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
                if wavelength > long_edge:
                    f = f / cfg.rope_factor
                elif wavelength >= short_edge:
                    t = (cfg.rope_original_max_positions / wavelength - cfg.rope_low_freq_factor) / (
                        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
                    f = t * f + (1 - t) * f / cfg.rope_factor
            out.append(f)
        return torch.tensor(out, dtype=torch.float32)

    def _drop(self, x, rng: RNGTracker, site: int, training: bool, sample_offset: int, global_batch: int):
        offsets = (sample_offset,) + (0,) * (x.dim() - 1)
        full = (global_batch,) + tuple(x.shape[1:])
        return keyed_dropout(x, self.cfg.dropout, rng.key(site), offsets, full, training)

    def _rope(self, x):  # x: (b, heads, s, d)
        d, s = x.shape[-1], x.shape[-2]
        ang = torch.arange(s, dtype=torch.float32)[:, None] * self._frequencies(d)[None, :]
        if self.cfg.rotary == "half":  # pairs (i, i + d/2)
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], dim=-1)
        x1, x2 = x[..., ::2], x[..., 1::2]
        rot1 = x1 * ang.cos() - x2 * ang.sin()
        rot2 = x1 * ang.sin() + x2 * ang.cos()
        return torch.stack([rot1, rot2], dim=-1).reshape(x.shape)

    def _attention(self, blk, h, i, rng, training, off, gb):
        cfg = self.cfg
        b, s, H = h.shape
        nh, d = cfg.num_heads, cfg.head_dim
        q = blk.attn["q"](h).reshape(b, s, nh, d).permute(0, 2, 1, 3)
        nkv = cfg.kv_heads
        k = blk.attn["k"](h).reshape(b, s, nkv, d).permute(0, 2, 1, 3)
        v = blk.attn["v"](h).reshape(b, s, nkv, d).permute(0, 2, 1, 3)
        if cfg.family == "llama":
            q, k = self._rope(q), self._rope(k)
        # query head j reads k/v head j // (nh / nkv)
        k = torch.stack([k[:, j // (nh // nkv)] for j in range(nh)], dim=1)
        v = torch.stack([v[:, j // (nh // nkv)] for j in range(nh)], dim=1)
        att = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
        if cfg.family != "bert":
            causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
            att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self._drop(att, rng, dropout_site(i, "attn_probs"), training, off, gb)
        out = torch.einsum("bhqk,bhkd->bhqd", att, v).permute(0, 2, 1, 3).reshape(b, s, H)
        return blk.attn["o"](out)

    def _mlp(self, blk, h):
        if self.cfg.family == "llama":
            return blk.mlp["down"](F.silu(blk.mlp["gate"](h)) * blk.mlp["up"](h))
        a = blk.mlp["fc1"](h)
        if self.cfg.mlp_act == "gelu_tanh":
            a = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
        else:
            a = F.gelu(a)
        return blk.mlp["fc2"](a)

    def forward(self, tokens, labels, rng: RNGTracker, training: bool = True, sample_offset: int = 0,
                global_batch: int | None = None, token_types=None):
        """Mean token loss (labels == -100 ignored)."""
        cfg = self.cfg
        gb = global_batch or tokens.shape[0]
        args = (rng, training, sample_offset, gb)
        x = self.embed.word(tokens)
        if cfg.family != "llama":
            x = x + self.embed.pos[: tokens.shape[1]]
        if cfg.type_vocab_size:
            x = x + F.embedding(torch.zeros_like(tokens) if token_types is None else token_types, self.embed.types)
        if cfg.family == "bert":
            x = self.embed.norm(x)
        x = self._drop(x, rng, SITE_EMBED, training, sample_offset, gb)
        for i, blk in enumerate(self.layers):
            if cfg.family == "bert":  # post-LN
                x = blk.attn_norm(x + self._drop(self._attention(blk, x, i, *args), rng, dropout_site(i, "attn_out"), training, sample_offset, gb))
                x = blk.mlp_norm(x + self._drop(self._mlp(blk, x), rng, dropout_site(i, "mlp_out"), training, sample_offset, gb))
            else:  # pre-LN
                x = x + self._drop(self._attention(blk, blk.attn_norm(x), i, *args), rng, dropout_site(i, "attn_out"), training, sample_offset, gb)
                x = x + self._drop(self._mlp(blk, blk.mlp_norm(x)), rng, dropout_site(i, "mlp_out"), training, sample_offset, gb)
        if cfg.family == "bert":
            x = self.head.norm(F.gelu(self.head.dense(x), approximate="tanh" if cfg.mlp_act == "gelu_tanh" else "none"))
        else:
            x = self.head.norm(x)
        logits = x @ self.embed.word.weight.T if cfg.tie_embeddings else self.head.decoder(x)
        if cfg.tie_embeddings and cfg.family == "bert":
            logits = logits + self.head.bias
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), ignore_index=IGNORE_INDEX)
