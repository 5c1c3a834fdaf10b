"""Every collective the executor issues goes through a :class:`Communicator`.

It does two things a raw process group does not:

* **Accounting.**  Calls and payload bytes per (phase, kind), so tests can check
  that Megatron's schedule sends three AllReduces' worth of bytes per TMP block
  and Oases' fine-grained recomputation sends two.
* **Link emulation** (optional, for benchmarks).  With a
  :class:`~oases_ds.parallel.link.LinkModel`, a collective's handle completes no
  earlier than a real link of that bandwidth and latency would allow (see
  :class:`~oases_ds.parallel.link.LinkEmulator`).

It sits in ``parallel`` (below the models) because operators issue collectives
through it too -- the loss's vocab-parallel reductions -- so the models, the
executor and the engine all share one.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from oases_ds.parallel.collectives import (Group, Pending, group_size, start_all_gather, start_all_reduce, start_recv,
                                           start_send)
from oases_ds.parallel.link import LinkEmulator, LinkModel, P2PEmulator

PHASES = ("forward", "recompute", "backward", "loss", "reshard", "grad_sync", "pipeline")


@dataclass
class CommStats:
    """Calls and payload bytes per (phase, kind) of collective."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, phase: str, kind: str, nbytes: int) -> None:
        self.calls[(phase, kind)] += 1
        self.bytes[(phase, kind)] += nbytes

    def bytes_in(self, phase: str, kind: str | None = None) -> int:
        return sum(v for (p, k), v in self.bytes.items() if p == phase and (kind is None or k == kind))

    def calls_in(self, phase: str, kind: str | None = None) -> int:
        return sum(v for (p, k), v in self.calls.items() if p == phase and (kind is None or k == kind))

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {f"{p}/{k}": {"calls": self.calls[(p, k)], "bytes": b} for (p, k), b in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class Communicator:
    """Starts collectives, counts them, and (optionally) holds them to a link model."""

    def __init__(self, link: LinkModel | None = None) -> None:
        self.link = link
        self.stats = CommStats()
        self._emulator = LinkEmulator(link) if link is not None else None
        self._p2p = P2PEmulator(link) if link is not None else None

    @property
    def emulated(self) -> bool:
        return self.link is not None

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, phase: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> Pending:
        return self._wrap("all_reduce", tensor, group, phase, start_all_reduce(tensor, group, op))

    def all_gather(self, tensor: torch.Tensor, group: Group, dim: int, phase: str) -> Pending:
        return self._wrap("all_gather", tensor, group, phase, start_all_gather(tensor, group, dim))

    def send(self, tensor: torch.Tensor, dst: int, group: Group) -> Pending:
        """Point-to-point send to the neighbouring pipeline stage ``dst``, counted under
        phase ``pipeline`` and, with a link, held to it (:class:`P2PEmulator`)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.add("pipeline", "send", nbytes)
        if self._p2p is None:
            return start_send(tensor, dst, group)
        return self._p2p.send(nbytes, dist.get_rank(), dst, group, lambda: start_send(tensor, dst, group))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, group: Group) -> Pending:
        """Post the receive from the neighbouring pipeline stage ``src`` (see :meth:`send`)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.stats.add("pipeline", "recv", nbytes)
        if self._p2p is None:
            return start_recv(shape, dtype, device, src, group)
        return self._p2p.recv(nbytes, src, dist.get_rank(), group, lambda: start_recv(shape, dtype, device, src, group))

    def _wrap(self, kind: str, tensor: torch.Tensor, group: Group, phase: str, pending: Pending) -> Pending:
        ranks = group_size(group)
        if ranks == 1:
            return pending
        nbytes = tensor.numel() * tensor.element_size()
        if kind == "all_gather":
            nbytes *= ranks  # size of the gathered result
        self.stats.add(phase, kind, nbytes)
        if self._emulator is None:
            return pending
        return self._emulator.hold(kind, nbytes, ranks, group, pending)
