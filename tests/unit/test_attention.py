"""attention_core's two routes against plain math (issue 13 item 1).

The SDPA route (no dropout) and the materialised route (keyed dropout) must both
equal ``softmax(q k^T / sqrt(d)) [dropout] v`` -- values and gradients of q, k, v --
to 1e-5 relative in fp32, the tolerance the distributed parity test holds the whole
model to; and the keyed mask must stay a function of global (sample, head, i, j).
"""
import math

import pytest
import torch

from oases_ds.parallel.layers import attention_core
from oases_ds.parallel.random import keyed_dropout

B, H, S, D = 2, 4, 12, 8


def _qkv(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=gen, dtype=torch.float64).float().requires_grad_() for _ in range(3)]


def _plain(q, k, v, causal, drop=None):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
    if causal:
        scores = scores.masked_fill(~torch.tril(torch.ones(S, S, dtype=torch.bool)), float("-inf"))
    probs = scores.softmax(-1)
    if drop is not None:
        probs = drop(probs)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v).transpose(1, 2).reshape(B, S, H * D)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _check_same(fn_a, fn_b) -> None:
    qa, qb = _qkv(), _qkv()
    out_a, out_b = fn_a(*qa), fn_b(*qb)
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    assert _rel(out_a, out_b) <= 1e-5
    for ta, tb in zip(qa, qb):
        assert _rel(ta.grad, tb.grad) <= 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_route_matches_plain_math(causal):
    _check_same(lambda q, k, v: attention_core(q, k, v, causal), lambda q, k, v: _plain(q, k, v, causal))


@pytest.mark.parametrize("causal", [True, False])
def test_keyed_dropout_route_matches_plain_math(causal):
    def drop(p: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(p, 0.2, 31, (0, 0, 0, 0), tuple(p.shape))

    _check_same(lambda q, k, v: attention_core(q, k, v, causal, dropout=drop), lambda q, k, v: _plain(q, k, v, causal, drop))


def test_identity_dropout_route_equals_sdpa_route():
    q, k, v = _qkv(3)
    assert _rel(attention_core(q, k, v, True, dropout=lambda p: p), attention_core(q, k, v, True)) <= 1e-5


def test_dropout_route_drops_probabilities():
    q, k, v = _qkv(4)
    dropped = attention_core(q, k, v, True, dropout=lambda p: keyed_dropout(p, 0.5, 2, (0, 0, 0, 0), tuple(p.shape)))
    assert _rel(dropped, attention_core(q, k, v, True)) > 0.1


def test_head_shard_and_sub_batch_see_the_full_tensor_masks():
    """A TMP rank holding heads 2..3 of samples 1.. computes the slice of the full output."""
    q, k, v = _qkv(5)
    full_shape = (B, H, S, S)

    def drop_at(b0: int, h0: int):
        return lambda p: keyed_dropout(p, 0.3, 9, (b0, h0, 0, 0), full_shape)

    full = attention_core(q, k, v, True, dropout=drop_at(0, 0)).view(B, S, H, D)
    part = attention_core(q[1:, 2:], k[1:, 2:], v[1:, 2:], True, dropout=drop_at(1, 2)).view(1, S, 2, D)
    torch.testing.assert_close(part, full[1:, :, 2:], rtol=1e-6, atol=1e-6)  # same masks; matmul shapes differ


# -- key (padding) mask ------------------------------------------------------------
KEY_MASK = torch.ones(B, S, dtype=torch.bool)
KEY_MASK[0, 9:] = False  # right padding (BERT)
KEY_MASK[1, :3] = False  # left padding: with a causal mask, queries 0-2 have no key at all


def _plain_masked(q, k, v, causal, drop=None):
    """Per-sample loop over the unpadded keys only (no -inf tricks); a query with no key: zeros."""
    out = torch.zeros(B, H, S, D)
    for b in range(B):
        for i in range(S):
            keys = KEY_MASK[b].clone()
            if causal:
                keys[i + 1:] = False
            if not keys.any():
                continue
            scores = torch.einsum("hd,hnd->hn", q[b, :, i], k[b][:, keys]) / math.sqrt(D)
            probs = scores.softmax(-1)
            if drop is not None:
                full = torch.zeros(H, S)
                full[:, keys] = probs
                probs = drop(full, b, i)[:, keys]
            out[b, :, i] = torch.einsum("hn,hnd->hd", probs, v[b][:, keys])
    return out.transpose(1, 2).reshape(B, S, H * D)


@pytest.mark.parametrize("causal", [True, False])
def test_key_mask_sdpa_route_matches_attention_over_unpadded_keys(causal):
    _check_same(lambda q, k, v: attention_core(q, k, v, causal, key_mask=KEY_MASK),
                lambda q, k, v: _plain_masked(q, k, v, causal))


@pytest.mark.parametrize("causal", [True, False])
def test_key_mask_dropout_route_matches_attention_over_unpadded_keys(causal):
    shape = (B, H, S, S)

    def drop(p: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(p, 0.2, 31, (0, 0, 0, 0), shape)

    def drop_row(row: torch.Tensor, b: int, i: int) -> torch.Tensor:  # the same keyed mask, one (sample, query) row
        full = torch.zeros(shape)
        full[b, :, i] = row
        return drop(full)[b, :, i]

    _check_same(lambda q, k, v: attention_core(q, k, v, causal, dropout=drop, key_mask=KEY_MASK),
                lambda q, k, v: _plain_masked(q, k, v, causal, drop_row))


def test_key_mask_keeps_gradients_finite_for_queries_without_keys():
    q, k, v = _qkv()
    out = attention_core(q, k, v, True, key_mask=KEY_MASK)
    out.sum().backward()
    assert torch.equal(out[1, :3], torch.zeros_like(out[1, :3]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
