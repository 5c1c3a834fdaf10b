import math

import pytest
import torch

from oases_ds.parallel import random as keyed_random
from oases_ds.parallel.random import RNGTracker, keep_mask, keyed_dropout


def test_mask_of_a_slice_equals_slice_of_full_mask():
    full = keep_mask(42, (4, 8, 6, 6), (0, 0, 0, 0), (4, 8, 6, 6), 0.3, torch.device("cpu"))
    part = keep_mask(42, (2, 4, 6, 6), (2, 4, 0, 0), (4, 8, 6, 6), 0.3, torch.device("cpu"))
    assert torch.equal(full[2:, 4:], part)


def test_mask_rate_and_key_dependence():
    a = keep_mask(1, (64, 64, 32), (0, 0, 0), (64, 64, 32), 0.25, torch.device("cpu"))
    b = keep_mask(2, (64, 64, 32), (0, 0, 0), (64, 64, 32), 0.25, torch.device("cpu"))
    assert abs(1 - a.float().mean().item() - 0.25) < 0.01
    assert (a != b).float().mean().item() > 0.3  # independent keys -> ~37.5% disagreement


def test_dropout_is_identity_in_eval_and_scaled_in_training():
    x = torch.ones(8, 16)
    assert keyed_dropout(x, 0.5, 3, (0, 0), (8, 16), training=False) is x
    y = keyed_dropout(x, 0.5, 3, (0, 0), (8, 16))
    assert set(y.unique().tolist()) <= {0.0, 2.0}


def test_tracker_keys_change_per_step_and_restore():
    rng = RNGTracker(seed=5)
    k0 = rng.key(3)
    state = rng.capture()
    rng.advance()
    assert rng.key(3) != k0 and rng.key(4) != rng.key(3)
    rng.restore(state)
    assert rng.key(3) == k0


# --- the 32-bit counter hash (issue 13 item 2) -------------------------------------
CPU = torch.device("cpu")


def _py_mix(x: int) -> int:
    for _ in range(2):
        x = ((x >> 16) ^ x) & 0x7FFFFFFF
        x = (x * 0x45D9F3B) & 0x7FFFFFFF
    return ((x >> 16) ^ x) & 0x7FFFFFFF


def _py_hash32(x: int, salt: int) -> int:
    h = _py_mix(_py_mix((x & 0x7FFFFFFF) ^ salt) ^ (x >> 31))
    return ((h << 1) ^ _py_mix(h ^ 0x2545F491)) & 0xFFFFFFFF


def _py_keep(key: int, row: int, col: int, p: float) -> bool:
    """The mask bit as unsigned mod-2**32 arithmetic in Python integers: what any
    device must reproduce (a device whose int32 multiply did not wrap would differ)."""
    w = (_py_hash32(row, keyed_random.mix_key(key, 7)) + _py_hash32(col, keyed_random.mix_key(key, 11))) & 0xFFFFFFFF
    shifted = (w >> 16) | (0xFFFF0000 if w >= 1 << 31 else 0)  # int32 >> is arithmetic
    w = ((w ^ shifted) * 0x846CA68B) & 0xFFFFFFFF
    signed = w - (1 << 32) if w >= 1 << 31 else w
    return signed >= round(p * (1 << 32)) - (1 << 31)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_equals_pure_python_mod_2_32_model(p):
    shape, offsets, full = (3, 5, 7), (1, 2, 3), (6, 9, 12)
    got = keep_mask(99, shape, offsets, full, p, CPU)
    want = torch.tensor([[[_py_keep(99, (a + 1) * 9 + (b + 2), c + 3, p) for c in range(7)] for b in range(5)] for a in range(3)])
    assert torch.equal(got, want)


def test_mask_uses_row_indices_beyond_2_31():
    """A GPT-39B attention-prob tensor has > 2**31 rows*cols; high index bits must matter."""
    full = (2, 1 << 31, 64)
    lo = keep_mask(3, (1, 4, 64), (0, 5, 0), full, 0.5, CPU)
    hi = keep_mask(3, (1, 4, 64), (1, 5, 0), full, 0.5, CPU)  # rows 2**31 + 5.. vs 5..
    assert not torch.equal(lo, hi)
    want = [_py_keep(3, (1 << 31) + 5, c, 0.5) for c in range(64)]
    assert hi[0, 0].tolist() == want


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_within_five_sigma(p):
    n = 4 * 16 * 128 * 128
    mask = keep_mask(17, (4, 16, 128, 128), (0, 0, 0, 0), (4, 16, 128, 128), p, CPU)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(mask.float().mean().item() - (1 - p)) < 5 * sigma


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_neighbouring_elements_rows_keys_and_samples_are_uncorrelated():
    m = keep_mask(23, (8, 8, 128, 128), (0, 0, 0, 0), (8, 8, 128, 128), 0.3, CPU)
    n = m.numel()
    bound = 5 / math.sqrt(n / 2)  # 5 sigma of a correlation estimate over >= n/2 pairs
    assert abs(_corr(m[..., 1:], m[..., :-1])) < bound  # neighbouring keys j, j+1
    assert abs(_corr(m[..., 1:, :], m[..., :-1, :])) < bound  # neighbouring query rows i, i+1
    assert abs(_corr(m[:, 1:], m[:, :-1])) < bound  # neighbouring heads
    assert abs(_corr(m[1:], m[:-1])) < bound  # neighbouring samples
    other = keep_mask(24, (8, 8, 128, 128), (0, 0, 0, 0), (8, 8, 128, 128), 0.3, CPU)
    assert abs(_corr(m, other)) < 5 / math.sqrt(n)  # neighbouring keys (sites / steps)


def test_row_and_column_hashes_do_not_cancel_in_quartets():
    """Element hash is f(rowhash + colhash): the four corners (r,c),(r,c'),(r',c),(r',c')
    have inputs with h1 + h4 = h2 + h3; a weak finalizer would make the 4th bit predictable."""
    m = keep_mask(5, (256, 256), (0, 0), (256, 256), 0.5, CPU).to(torch.int64)
    parity = m[:-1, :-1] ^ m[:-1, 1:] ^ m[1:, :-1] ^ m[1:, 1:]
    n = parity.numel()
    assert abs(parity.double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / n)


@pytest.mark.parametrize("chunk", [1, 100, 1 << 12])
def test_mask_is_independent_of_chunking_and_repeatable(monkeypatch, chunk):
    shape = (3, 4, 40, 50)
    want = keep_mask(8, shape, (0, 0, 0, 0), shape, 0.2, CPU)
    monkeypatch.setattr(keyed_random, "_CHUNK_ELEMS", chunk)
    assert torch.equal(keep_mask(8, shape, (0, 0, 0, 0), shape, 0.2, CPU), want)
    assert torch.equal(keep_mask(8, shape, (0, 0, 0, 0), shape, 0.2, CPU), want)


def test_every_slice_kind_matches_the_full_mask(monkeypatch):
    """TMP head shards, sub-batches, query / key ranges, and slices crossing chunk edges."""
    full = (4, 8, 24, 20)
    ref = keep_mask(77, full, (0, 0, 0, 0), full, 0.4, CPU)
    monkeypatch.setattr(keyed_random, "_CHUNK_ELEMS", 50)
    for offs, shape in [((0, 2, 0, 0), (4, 2, 24, 20)), ((3, 0, 0, 0), (1, 8, 24, 20)),
                        ((1, 1, 5, 0), (2, 3, 7, 20)), ((0, 0, 0, 7), (4, 8, 24, 9)), ((2, 5, 11, 3), (1, 1, 1, 1))]:
        sl = tuple(slice(o, o + s) for o, s in zip(offs, shape))
        assert torch.equal(keep_mask(77, shape, offs, full, 0.4, CPU), ref[sl]), offs


def test_extreme_probabilities_and_degenerate_shapes():
    assert keep_mask(1, (4, 5), (0, 0), (4, 5), 0.0, CPU).all()
    assert not keep_mask(1, (4, 5), (0, 0), (4, 5), 1.0, CPU).any()
    assert not keep_mask(1, (4, 5), (0, 0), (4, 5), 1 - 1e-12, CPU).any()  # threshold 2**31 must not wrap
    assert keep_mask(1, (0, 5), (0, 0), (4, 5), 0.5, CPU).shape == (0, 5)
    assert keep_mask(1, (), (), (), 0.5, CPU).shape == ()
    assert keep_mask(1, (7,), (3,), (10,), 0.5, CPU).tolist() == keep_mask(1, (10,), (0,), (10,), 0.5, CPU)[3:].tolist()


def test_bad_probability_or_slice_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"p=1.5 .*must be in \[0, 1\]"):
        keep_mask(1, (4,), (0,), (4,), 1.5, CPU)
    with pytest.raises(ValueError, match=r"dim 1 slice \[2, 6\) is outside full_shape \(4, 5\)"):
        keep_mask(1, (4, 4), (0, 2), (4, 5), 0.5, CPU)
    with pytest.raises(ValueError, match="dim 0"):
        keep_mask(1, (4, 5), (-1, 0), (4, 5), 0.5, CPU)


def test_dropout_backward_regenerates_the_mask_and_saves_no_tensor():
    x = torch.randn(4, 8, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = keyed_dropout(x, 0.3, 9, (2, 0, 0), (8, 8, 16))
    assert saved == []  # nothing of x's size kept alive between forward and backward
    g = torch.randn_like(y)
    y.backward(g)
    mask = keep_mask(9, (4, 8, 16), (2, 0, 0), (8, 8, 16), 0.3, torch.device("cpu"))
    assert torch.equal(x.grad, g * mask.float() * (1.0 / 0.7))
    assert torch.equal(y, x.detach() * mask.float() * (1.0 / 0.7))
