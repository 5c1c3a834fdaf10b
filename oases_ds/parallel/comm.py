"""Every collective the executor issues goes through a :class:`Communicator`.

It does four things a raw process group does not:

* **Accounting.**  Calls and payload bytes per (phase, kind), so tests can check
  that Megatron's schedule sends three AllReduces' worth of bytes per TMP block
  and Oases' fine-grained recomputation sends two.  Metrics reductions (the step's
  loss, evaluation) are recorded but not counted: they are not the schedule's traffic.
* **Link emulation** (optional, for benchmarks).  With a
  :class:`~oases_ds.parallel.link.LinkModel`, a collective's handle completes no
  earlier than a real link of that bandwidth and latency would allow (see
  :class:`~oases_ds.parallel.link.LinkEmulator`).
* **Flight records.**  Each collective and transfer is first appended to the rank's
  :class:`~oases_ds.parallel.flight.FlightRecorder` (group, index, op, label, shape, dtype),
  and a failed wait dumps them: a hang then names the first collective the ranks
  disagree on.
* **Guard mode** (optional: ``check_collectives``).  A :class:`~oases_ds.parallel.guard.CollectiveGuard`
  agrees on each collective before it is issued and bounds every wait, so a divergence
  fails in seconds with one line instead of a timeout.

It sits in ``parallel`` (below the models) because operators issue collectives
through it too -- the loss's vocab-parallel reductions, evaluation's eager forward --
so the models, the executor and the engine all share one.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from oases_ds.parallel.collectives import (Group, Pending, start_all_gather, start_all_reduce, start_broadcast,
                                           start_recv, start_reduce_scatter, start_send)
from oases_ds.parallel.flight import (DEFAULT_RECORDS, RUN_DIR_ENV, RUN_ID_ENV, FlightRecorder, Record, dtype_name,
                                      group_key, link_key, members)
from oases_ds.parallel.guard import CollectiveGuard, CollectiveMismatchError, batch_signature
from oases_ds.parallel.link import LinkEmulator, LinkModel, P2PEmulator

PHASES = ("forward", "recompute", "backward", "loss", "reshard", "grad_sync", "pipeline", "eval", "metrics")
UNCOUNTED = ("metrics",)
"""Phases recorded but not counted in :class:`CommStats` (not the schedule's traffic)."""
_REDUCE_OPS = {dist.ReduceOp.SUM: "all_reduce.sum", dist.ReduceOp.MAX: "all_reduce.max", dist.ReduceOp.MIN: "all_reduce.min",
               dist.ReduceOp.PRODUCT: "all_reduce.product", dist.ReduceOp.AVG: "all_reduce.avg"}


@dataclass
class CommStats:
    """Calls and payload bytes per (phase, kind) of collective, and on an emulated link the
    seconds each phase's traffic occupies it (:meth:`LinkModel.seconds`, one after another)."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    link_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, phase: str, kind: str, nbytes: int, link_s: float = 0.0) -> None:
        self.calls[(phase, kind)] += 1
        self.bytes[(phase, kind)] += nbytes
        if link_s:
            self.link_s[phase] += link_s

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
        self.link_s.clear()


class Communicator:
    """Starts collectives, records and counts them, and (optionally) guards them or holds
    them to a link model.

    Args:
        link: emulated link (benchmarks), or ``None``.
        recorder: this rank's flight recorder (default: an in-memory one of
            :data:`~oases_ds.parallel.flight.DEFAULT_RECORDS` records).
        guard: guard mode's checks, or ``None`` (off).
    """

    def __init__(self, link: LinkModel | None = None, recorder: FlightRecorder | None = None,
                 guard: CollectiveGuard | None = None) -> None:
        self.link = link
        self.stats = CommStats()
        self.recorder = recorder if recorder is not None else FlightRecorder()
        self.guard = guard
        self._waiter = guard if guard is not None else self.recorder
        self._emulator = LinkEmulator(link) if link is not None else None
        self._p2p = P2PEmulator(link) if link is not None else None
        self._groups: dict[int, tuple[dist.ProcessGroup, str, int]] = {}
        self._rank: int | None = None
        self._batch_step: int | None = None

    @classmethod
    def for_run(cls, link: LinkModel | None = None, records: int = DEFAULT_RECORDS, check: bool = False,
                env: Mapping[str, str] = os.environ) -> "Communicator":
        """The communicator of a training run on this rank (the process group is up): records
        kept in memory and, where the launcher names a run directory (``OASES_RUN_DIR``), in
        a ring file there; ``check`` turns guard mode on."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        recorder = FlightRecorder(records, rank, env.get(RUN_DIR_ENV) or None, digest=check, run_id=env.get(RUN_ID_ENV, ""))
        return cls(link, recorder, CollectiveGuard(recorder) if check else None)

    @property
    def emulated(self) -> bool:
        return self.link is not None

    @property
    def step(self) -> int:
        """The step number records carry (the engine sets it, 1-based, at each step's start)."""
        return self.recorder.step

    @step.setter
    def step(self, value: int) -> None:
        self.recorder.step = value

    # -- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group: Group, phase: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   label: str = "") -> Pending:
        size = self._size(group)
        if size == 1:
            return start_all_reduce(tensor, group, op)
        record = self._record(group, _REDUCE_OPS.get(op, "all_reduce"), label or phase, tensor)
        return self._wrap("all_reduce", tensor, group, phase, size, start_all_reduce(tensor, group, op).watched(self._waiter, record))

    def all_gather(self, tensor: torch.Tensor, group: Group, dim: int, phase: str, label: str = "") -> Pending:
        """Concatenate every rank's ``tensor`` along ``dim``; counted by the size of the result."""
        return self._along(dim, "all_gather", start_all_gather, tensor, group, phase, label)

    def reduce_scatter(self, tensor: torch.Tensor, group: Group, dim: int, phase: str, label: str = "") -> Pending:
        """Sum over ``group`` and keep this rank's slice along ``dim`` (sequence parallelism's
        half of an AllReduce); counted by the size of its input."""
        return self._along(dim, "reduce_scatter", start_reduce_scatter, tensor, group, phase, label)

    def _along(self, dim: int, kind: str, start, tensor: torch.Tensor, group: Group, phase: str, label: str) -> Pending:
        size = self._size(group)
        if size == 1:
            return start(tensor, group, dim)
        record = self._record(group, kind, label or phase, tensor)
        return self._wrap(kind, tensor, group, phase, size, start(tensor, group, dim).watched(self._waiter, record))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, phase: str, label: str = "") -> Pending:
        """Broadcast ``tensor`` in place from global rank ``src`` (the pipeline's loss)."""
        size = self._size(group)
        if size == 1:
            return start_broadcast(tensor, src, group)
        record = self._record(group, "broadcast", label or phase, tensor)
        return self._wrap("broadcast", tensor, group, phase, size, start_broadcast(tensor, src, group).watched(self._waiter, record))

    def send(self, tensor: torch.Tensor, dst: int, group: Group, label: str = "") -> Pending:
        """Point-to-point send to the neighbouring pipeline stage ``dst``, counted under
        phase ``pipeline`` and, with a link, held to it (:class:`P2PEmulator`).  ``label``
        names the message the same way on both ends (``act mb0 sb1``)."""
        me = self._me()
        record = self.recorder.record(link_key(me, dst, self._info(group)[0].group_name), "p2p", label or "p2p",
                                      tuple(tensor.shape), dtype_name(tensor.dtype))
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.add("pipeline", "send", nbytes)
        guard = self.guard
        if guard is not None:
            start = lambda: guard.send(record, tensor, dst, group)  # noqa: E731
        else:
            start = lambda: start_send(tensor, dst, group).watched(self._waiter, record)  # noqa: E731
        if self._p2p is None:
            return start()
        return self._p2p.send(nbytes, me, dst, group, start)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, group: Group,
             label: str = "") -> Pending:
        """Post the receive from the neighbouring pipeline stage ``src`` (see :meth:`send`)."""
        me = self._me()
        record = self.recorder.record(link_key(src, me, self._info(group)[0].group_name), "p2p", label or "p2p", tuple(shape),
                                      dtype_name(dtype))
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.stats.add("pipeline", "recv", nbytes)
        guard = self.guard
        if guard is not None:
            start = lambda: guard.recv(record, shape, dtype, device, src, group)  # noqa: E731
        else:
            start = lambda: start_recv(shape, dtype, device, src, group).watched(self._waiter, record)  # noqa: E731
        if self._p2p is None:
            return start()
        return self._p2p.recv(nbytes, src, me, group, start)

    # -- guard mode's checks (no-ops when it is off) -------------------------------------
    def check_batch(self, batch: Mapping[str, torch.Tensor], group: Group) -> None:
        """Guard mode, first call of each step: every rank of ``group`` (the TMP group) holds
        the same batch, or each raises one line naming the ranks and what they hold."""
        guard = self.guard
        if guard is None or self._batch_step == self.step or self._size(group) == 1:
            return
        self._batch_step = self.step
        text = batch_signature(batch)
        record = self.recorder.record(self._info(group)[1], "all_gather", "guard.batch", (len(text),), "uint8")
        device = next(iter(batch.values())).device
        seen = guard.exchange(text, group, record, device)
        ranks = dist.get_process_group_ranks(group)
        differ = [i for i, (digest, _) in enumerate(seen) if digest != seen[0][0]]
        if differ:
            i = differ[0]
            raise CollectiveMismatchError(
                f"the batch differs across the TMP group {record.group} at step {record.step}: rank {ranks[0]} holds "
                f"{seen[0][1]}, rank {ranks[i]} holds {seen[i][1]}; every rank of a TMP group must get the same batch "
                f"(the samples of its DP rank: check the data loader's rank and seed)")

    def check_step(self) -> None:
        """Guard mode, end of a schedule run: each group's count and rolling hash of records,
        compared over the world group; a mismatch raises one line on every rank."""
        guard = self.guard
        if guard is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        world = dist.group.WORLD
        last = {r.group: r for r in self.recorder.records}
        mine = json.dumps({g: [n, guard.recorder.hashes.get(g, b"").hex(),
                               f"index {last[g].index}: {last[g].describe()}" if g in last else "not kept"]
                           for g, n in sorted(self.recorder.counts.items())})
        record = self.recorder.record(self._info(world)[1], "all_gather", f"guard.step {self.step}", (len(mine),), "uint8")
        views = [json.loads(text) for text in _exchange_text(guard, mine, world, record)]
        for group in sorted({g for view in views for g in view}):
            states = {r: views[r].get(group, [0, "", "none"]) for r in members(group) if r < len(views)}
            if len({(n, h) for n, h, _ in states.values()}) > 1:
                raise CollectiveMismatchError(_step_mismatch(group, self.step, states))

    # -- internals -----------------------------------------------------------------------
    def _info(self, group: Group) -> tuple[dist.ProcessGroup, str, int]:
        """``(group, record key, size)``, looked up once per process group (its ranks and
        name do not change)."""
        info = self._groups.get(id(group))
        if info is None:
            ranks = dist.get_process_group_ranks(group)
            info = (group, group_key(ranks, group.group_name), len(ranks))
            self._groups[id(group)] = info
        return info

    def _size(self, group: Group) -> int:
        return 1 if group is None else self._info(group)[2]

    def _me(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank()
        return self._rank

    def _record(self, group: Group, op: str, label: str, tensor: torch.Tensor) -> Record:
        record = self.recorder.record(self._info(group)[1], op, label, tuple(tensor.shape), dtype_name(tensor.dtype))
        if self.guard is not None:
            self.guard.agree(record, group, tensor.device)
        return record

    def _wrap(self, kind: str, tensor: torch.Tensor, group: Group, phase: str, ranks: int, pending: Pending) -> Pending:
        if phase in UNCOUNTED:
            return pending
        nbytes = tensor.numel() * tensor.element_size()
        if kind == "all_gather":
            nbytes *= ranks  # size of the gathered result
        if self._emulator is None:
            self.stats.add(phase, kind, nbytes)
            return pending
        self.stats.add(phase, kind, nbytes, self.link.seconds(kind, nbytes, ranks))  # type: ignore[union-attr]
        return self._emulator.hold(kind, nbytes, ranks, group, pending)


def _exchange_text(guard: CollectiveGuard, text: str, group: Group, record: Record) -> list[str]:
    """Every rank's ``text`` of any length: its length in one fixed-size all-gather, then the
    bytes padded to the longest, both waited on with the guard's bounded wait."""
    data = text.encode()
    size = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(size)]
    guard.wait(dist.all_gather(lengths, length, group=group, async_op=True), record)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(size)]
    guard.wait(dist.all_gather(parts, mine, group=group, async_op=True), record)
    return [bytes(p[: int(n)].tolist()).decode() for p, n in zip(parts, lengths)]


def _step_mismatch(group: str, step: int, states: dict[int, list]) -> str:
    """One line for a group whose ranks' counts or hashes (``[count, hash, last record]``
    per rank) differ at a step's end."""
    where = f"{'link' if '->' in group else 'group'} {group}"
    most = max(states, key=lambda r: (states[r][0], -r))
    least = min(states, key=lambda r: (states[r][0], r))
    (na, _, last_a), (nb, _, last_b) = states[most], states[least]
    if na != nb:
        return (f"collectives diverged in {where} by step {step}: rank {most} issued {na} there (the last {last_a}), "
                f"rank {least} {nb} (the last {last_b}), so rank {most}'s index {nb} has no partner on rank {least}: "
                f"one of them left a collective out or issued one more")
    ranks = sorted(states)
    return (f"collectives diverged in {where} by step {step}: ranks {ranks} issued {na} each, in different orders or "
            f"sizes (last: {', '.join(f'rank {r} {states[r][2]}' for r in ranks)})")
