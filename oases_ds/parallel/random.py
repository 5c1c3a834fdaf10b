"""Dropout whose randomness is a pure function of *where* an element is.

Why not Megatron's stateful CUDA RNG tracker?  Oases runs the same operator
several times (Forward, then Recompute) and interleaves two sub-batches, so a
stateful generator has to be captured and restored around every operator and
sub-batch, and the masks still change with the TMP degree and the batch split.
Here a mask element is ``hash(key, global index)``, where the global index is the
element's position in the *unsharded, unsplit* logical tensor.  Consequences:

* Recompute replays dropout exactly: same key, same coordinates, same mask.
* Sharded regions get rank-local masks (heads on TMP rank 1 have other global
  indices than those on rank 0), replicated regions get identical masks on every
  TMP rank -- what Megatron's "model-parallel RNG" and default RNG streams give.
* The masks do not depend on the TMP degree, the number of sub-batches or the
  DP size, so a single-process reference reproduces them bit for bit.
* It is plain integer tensor arithmetic: the same masks on CPU and GPU.

:class:`RNGTracker` holds the seed and the step counter that form the key; its
state is what checkpoints save and what the executor captures per
(operator, sub-batch) so that a Recompute sees the state its Forward saw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so (x < 2**31) * _MUL never overflows int64


def _mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """A small avalanche hash on 31-bit non-negative integers (tensor or int)."""
    for _ in range(2):
        x = ((x >> 16) ^ x) & _M31
        x = (x * _MUL) & _M31
    return ((x >> 16) ^ x) & _M31


def mix_key(*parts: int) -> int:
    """Combine integers into one 31-bit key."""
    key = 0x1234567
    for part in parts:
        key = int(_mix((key ^ int(_mix(part & _M31))) & _M31))
    return key


def keep_mask(
    key: int,
    local_shape: Sequence[int],
    offsets: Sequence[int],
    full_shape: Sequence[int],
    p: float,
    device: torch.device,
) -> torch.Tensor:
    """Boolean keep-mask for the slice ``[offsets : offsets + local_shape]`` of a
    logical tensor of ``full_shape``; element kept with probability ``1 - p``."""
    if len(local_shape) != len(full_shape) or len(offsets) != len(full_shape):
        raise ValueError("local_shape, offsets and full_shape must have the same rank")
    lin = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(full_shape))):
        idx = torch.arange(offsets[dim], offsets[dim] + local_shape[dim], dtype=torch.int64, device=device)
        view = [1] * len(full_shape)
        view[dim] = local_shape[dim]
        lin = lin + idx.view(view) * stride
        stride *= int(full_shape[dim])
    folded = (lin & _M31) ^ (lin >> 31)
    hashed = _mix(_mix(folded ^ key) ^ mix_key(key, 7))
    return hashed >= int(p * (_M31 + 1))


class _KeyedDropout(torch.autograd.Function):
    """Forward: ``x * mask / (1 - p)``; backward: ``grad * mask / (1 - p)``, the mask
    regenerated from its key.

    Why a Function: plain ``x * mask`` makes autograd save the mask as a tensor of
    ``x``'s size and dtype.  Here only the key, the coordinates and ``p`` are saved,
    so an operator ending in dropout (bias-dropout-add after a forward AllReduce)
    can keep its graph from forward at no activation memory -- what lets the Oases
    schedule hold one tensor per block.  Backward pays one more :func:`keep_mask`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, key: int, offsets: tuple[int, ...], full_shape: tuple[int, ...]):
        ctx.p, ctx.key, ctx.offsets, ctx.full_shape = p, key, offsets, full_shape
        mask = keep_mask(key, x.shape, offsets, full_shape, p, x.device)
        return x * mask.to(x.dtype) * (1.0 / (1.0 - p))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mask = keep_mask(ctx.key, grad.shape, ctx.offsets, ctx.full_shape, ctx.p, grad.device)
        return grad * mask.to(grad.dtype) * (1.0 / (1.0 - ctx.p)), None, None, None, None


def keyed_dropout(
    x: torch.Tensor,
    p: float,
    key: int,
    offsets: Sequence[int],
    full_shape: Sequence[int],
    training: bool = True,
) -> torch.Tensor:
    """Inverted dropout of ``x`` with a mask from :func:`keep_mask`; autograd saves no
    tensor for it (see :class:`_KeyedDropout`)."""
    if not training or p == 0.0:
        return x
    return _KeyedDropout.apply(x, p, key, tuple(offsets), tuple(full_shape))


@dataclass
class RNGTracker:
    """Seed and step counter from which every dropout key is derived.

    ``step`` advances once per optimizer step (not per sub-batch or pass), so every
    sub-batch and every recomputation within a step sees the same keys.
    """

    seed: int = 1234
    step: int = 0

    def key(self, site: int) -> int:
        """Key of one dropout site (a fixed integer per dropout call in the model)."""
        return mix_key(self.seed, self.step, site)

    def capture(self) -> tuple[int, int]:
        return (self.seed, self.step)

    def restore(self, state: tuple[int, int]) -> None:
        self.seed, self.step = state

    def advance(self) -> None:
        self.step += 1
