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

_FIN_MUL = 0x846CA68B - (1 << 32)
"""Odd, so multiplying by it is a bijection mod 2**32; as a signed int32 because the
per-element hash runs in int32 with wrap-around."""
_CHUNK_ELEMS = 1 << 22
"""Elements per chunk of the CPU mask loop: bounds the two int32 work buffers to 16 MiB
each (they live in a 32 MiB L3) however large the tensor.  Measured interleaved on this
2-core EPYC under load: 2**22 took 0.43x F.dropout's time on a (4,16,512,512) mask,
2**20 0.84x, 2**18 1.85x, 2**16 10x -- each chunk is 5 op launches, and with other
jobs on the cores every launch's thread hand-off costs more than the cache saves."""


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


def _to_int32(h: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same 32 bits (explicit, because
    an out-of-range int64 -> int32 cast is not defined behaviour in C++)."""
    return (h - ((h >> 31) << 32)).to(torch.int32)


def _hash32(x: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """Full-strength 32-bit hash of non-negative int64 values < 2**62 (int64 arithmetic); ``salt``
    (31-bit) is one for all or one per value.

    Used on the row and column indices only (a row is all dims but the last), so its
    ~40 int64 passes touch ``rows + cols`` elements, not ``rows * cols``."""
    lo, hi = x & _M31, x >> 31
    h = _mix(_mix(lo ^ salt) ^ hi)
    return _to_int32((h << 1) ^ _mix(h ^ 0x2545F491))


def _finalize_(w: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """In-place int32 finalizer: ``w ^= w >> 16; w *= _FIN_MUL`` with wrap-around.

    ``w`` is ``rowhash + colhash``; the xorshift breaks the additive structure that
    four corners (r,c),(r,c'),(r',c),(r',c') share, the multiply spreads every bit
    into the top bits that the threshold reads.  The shift is arithmetic (int32), so
    bit 31 of ``w ^ (w >> 16)`` is always 0: 2**31 distinct inputs, mapped one-to-one
    by the odd multiply -- a masking ``& 0xFFFF`` would make it 2**32 at one more pass,
    for no measurable change in keep rate or correlation (tests/unit/test_random.py).
    Int32 add and multiply wrap modulo 2**32 in torch's CPU and CUDA kernels alike (two's
    complement); the golden test pins the bits to a pure-Python mod-2**32 model."""
    torch.bitwise_right_shift(w, 16, out=tmp)
    w.bitwise_xor_(tmp)
    w.mul_(_FIN_MUL)
    return w


def keep_mask(
    key: int,
    local_shape: Sequence[int],
    offsets: Sequence[int],
    full_shape: Sequence[int],
    p: float,
    device: torch.device,
) -> torch.Tensor:
    """Boolean keep-mask for the slice ``[offsets : offsets + local_shape]`` of a
    logical tensor of ``full_shape``; element kept with probability ``1 - p``.

    Why this shape of hash: the element at global (row, col) -- row the linear index
    of all dims but the last, col the last-dim index -- gets
    ``finalize(rowhash(row) + colhash(col))`` compared with a threshold.  The two
    index hashes are strong but run on ``rows + cols`` values; per element there are
    only 4 int32 passes (add, shift, xor, multiply) and the compare that writes the
    bool mask, in bounded chunks on CPU.  The old 31-bit int64 hash of
    the full linear index made ~35 full-size int64 passes (5.4x ``F.dropout``).
    The mask is still a function of global coordinates only, so slices, TMP
    degrees, sub-batches and recomputes all see the same bits."""
    ndim = len(full_shape)
    if len(local_shape) != ndim or len(offsets) != ndim:
        raise ValueError("local_shape, offsets and full_shape must have the same rank")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"keep_mask: p={p} is not a probability; dropout p must be in [0, 1]")
    for dim in range(ndim):
        if offsets[dim] < 0 or offsets[dim] + local_shape[dim] > full_shape[dim]:
            raise ValueError(f"keep_mask: dim {dim} slice [{offsets[dim]}, {offsets[dim] + local_shape[dim]}) "
                             f"is outside full_shape {tuple(full_shape)}; offsets + local_shape must fit in full_shape")
    shape = tuple(int(n) for n in local_shape)
    device = torch.device(device)
    threshold = round(p * (1 << 32)) - (1 << 31)  # finalized values are uniform over int32
    if threshold >= 1 << 31:  # p within 2**-33 of 1: no int32 value is kept (the scalar would wrap)
        return torch.zeros(shape, dtype=torch.bool, device=device)
    if ndim == 0:  # a scalar is the one element (row 0, col 0) of a 1x1 tensor
        return keep_mask(key, (1, 1), (0, 0), (1, 1), p, device).reshape(())
    cols = shape[-1]
    out = torch.empty(shape, dtype=torch.bool, device=device)
    if out.numel() == 0:
        return out
    row = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(ndim - 1)):
        idx = torch.arange(offsets[dim], offsets[dim] + shape[dim], dtype=torch.int64, device=device)
        view = [1] * (ndim - 1)
        view[dim] = shape[dim]
        row = row + idx.view(view) * stride
        stride *= int(full_shape[dim])
    # Rows and columns hashed in one pass, each with its own salt: the same bits as two passes at
    # half the op launches, which is most of a small mask's time (some 40 launches per pass).
    row = row.reshape(-1)
    col = torch.arange(offsets[-1], offsets[-1] + cols, dtype=torch.int64, device=device)
    salts = torch.cat([torch.full_like(row, mix_key(key, 7)), torch.full_like(col, mix_key(key, 11))])
    row_h, col_h = _hash32(torch.cat([row, col]), salts).split([row.numel(), cols])
    flat = out.view(-1, cols)
    rows = flat.shape[0]
    step = max(1, _CHUNK_ELEMS // cols) if device.type == "cpu" else rows
    work = torch.empty((min(step, rows), cols), dtype=torch.int32, device=device)
    tmp = torch.empty_like(work)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w, t = work[: r1 - r0], tmp[: r1 - r0]
        torch.add(row_h[r0:r1, None], col_h[None, :], out=w)
        torch.ge(_finalize_(w, t), threshold, out=flat[r0:r1])
    return out


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
        return x.mul(mask).mul_(1.0 / (1.0 - p))  # two passes: no float copy of the mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mask = keep_mask(ctx.key, grad.shape, ctx.offsets, ctx.full_shape, ctx.p, grad.device)
        return grad.mul(mask).mul_(1.0 / (1.0 - ctx.p)), None, None, None, None


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
