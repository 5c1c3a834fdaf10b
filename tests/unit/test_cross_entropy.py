"""The vocab-parallel cross-entropy on one rank against ``F.cross_entropy``.

One rank holds the whole vocabulary (the AllReduces are identities), optionally with
padding columns past the real vocabulary; values and logits gradients must match
PyTorch's to 1e-6 relative in fp32 (the distributed parity test covers TMP > 1).
"""
import pytest
import torch
import torch.nn.functional as F

from oases_ds.parallel.layers import vocab_parallel_cross_entropy


def _identity(t, op):
    return t


@pytest.mark.parametrize("pad", [0, 3])
def test_matches_torch_cross_entropy_values_and_gradients(pad):
    vocab = 11
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, vocab + pad, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    weights = torch.rand(2, 5, generator=gen)
    loss = vocab_parallel_cross_entropy(logits, labels, 0, _identity, vocab if pad else None)
    (loss * weights).sum().backward()
    ours = logits.grad.clone()
    ref_logits = logits.detach()[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(2, 5)
    (ref * weights).sum().backward()
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ours[..., :vocab], ref_logits.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., vocab:], torch.zeros_like(ours[..., vocab:]))  # padding: no gradient


def test_targets_outside_this_ranks_slice_get_no_one_hot():
    """A rank holding vocabulary columns [4, 8): a label outside it contributes no -1."""
    logits = torch.randn(1, 3, 4, requires_grad=True)
    labels = torch.tensor([[1, 5, 9]])
    vocab_parallel_cross_entropy(logits, labels, 4, _identity).sum().backward()
    softmax = logits.detach().softmax(-1)
    expected = softmax.clone()
    expected[0, 1, 1] -= 1.0  # label 5 is local column 1; labels 1 and 9 live on other ranks
    assert torch.allclose(logits.grad, expected, rtol=1e-6, atol=1e-6)
