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

# Element finalizer constants (odd, so each multiply is a bijection mod 2**32), as
# signed int32 values: the per-element hash runs in int32 with wrap-around.
_FIN_MUL1 = 0x7FEB352D
_FIN_MUL2 = 0x846CA68B - (1 << 32)
_CHUNK_ELEMS = 1 << 18
"""Elements per chunk of the CPU mask loop: two int32 work buffers of 1 MiB each stay
in a 1 MiB L2 plus L3; measured fastest of 2**14..2**20 on this machine (2-core EPYC)."""


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


def _hash32(x: torch.Tensor, salt: int) -> torch.Tensor:
    """Full-strength 32-bit hash of non-negative int64 values < 2**62 (int64 arithmetic).

    Used on the row and column indices only (a row is all dims but the last), so its
    ~40 int64 passes touch ``rows + cols`` elements, not ``rows * cols``."""
    lo, hi = x & _M31, x >> 31
    h = _mix(_mix(lo ^ salt) ^ hi)
    return _to_int32((h << 1) ^ _mix(h ^ 0x2545F491))


def _finalize_(w: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """In-place int32 finalizer (multiply, logical xorshift, multiply; wrap-around).

    ``x >> s`` on int32 is an arithmetic shift, so ``& (2**(32-s) - 1)`` makes it the
    logical one that keeps each step a bijection.  Int32 multiply wraps modulo 2**32
    in torch's CPU and CUDA kernels alike (two's complement); the golden values in
    tests/unit/test_random.py pin the result to a pure-Python mod-2**32 model."""
    w.mul_(_FIN_MUL1)
    torch.bitwise_right_shift(w, 16, out=tmp)
    tmp.bitwise_and_(0xFFFF)
    w.bitwise_xor_(tmp)
    w.mul_(_FIN_MUL2)
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
    ``finalize(rowhash(row) ^ colhash(col))`` compared with a threshold.  The two
    index hashes are strong but run on ``rows + cols`` values; per element there are
    only 6 int32 passes (xor, mul, shift, and, xor, mul) and the compare that writes
    the bool mask, done in L2-sized chunks on CPU.  The old 31-bit int64 hash of
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
    if p >= 1.0:
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
    row_h = _hash32(row.reshape(-1), mix_key(key, 7))
    col_h = _hash32(torch.arange(offsets[-1], offsets[-1] + cols, dtype=torch.int64, device=device), mix_key(key, 11))
    threshold = round(p * (1 << 32)) - (1 << 31)  # finalized values are uniform over int32
    flat = out.view(-1, cols)
    rows = flat.shape[0]
    step = max(1, _CHUNK_ELEMS // cols) if device.type == "cpu" else rows
    work = torch.empty((min(step, rows), cols), dtype=torch.int32, device=device)
    tmp = torch.empty_like(work)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w, t = work[: r1 - r0], tmp[: r1 - r0]
        torch.bitwise_xor(row_h[r0:r1, None], col_h[None, :], out=w)
        torch.ge(_finalize_(w, t), threshold, out=flat[r0:r1])
    return out


def keyed_dropout(
    x: torch.Tensor,
    p: float,
    key: int,
    offsets: Sequence[int],
    full_shape: Sequence[int],
    training: bool = True,
) -> torch.Tensor:
    """Inverted dropout of ``x`` with a mask from :func:`keep_mask`."""
    if not training or p == 0.0:
        return x
    mask = keep_mask(key, x.shape, offsets, full_shape, p, x.device)
    return x * mask.to(x.dtype) * (1.0 / (1.0 - p))


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
