"""The one rotation every interleaved measurement uses.

Why: things measured side by side (schedules, plans, profiled degrees, links) run round
robin, and each round starts one item later, so over ``n`` rounds every item takes every
position once.  Without it the first always ran right after the barrier that ends a round
and the last at its end, so whatever varies along a round stayed with the same items.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], rnd: int) -> list[T]:
    """``items`` rotated by ``rnd``: round ``r`` starts with item ``r mod n``."""
    k = rnd % len(items) if items else 0
    return list(items[k:]) + list(items[:k])
