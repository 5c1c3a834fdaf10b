import torch

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
