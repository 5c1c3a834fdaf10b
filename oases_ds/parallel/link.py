"""A slow link between ranks, as a model (for the planner) and as an emulator (for benchmarks).

On one box the "link" between ranks is shared memory, far faster than the PCIe /
Ethernet links Oases is for.  :class:`LinkModel` says how long a ring collective
takes on a link of given bandwidth and latency; the planner's cost model and the
configuration read only that, which is why it lives here and not next to the
:class:`~oases_ds.parallel.comm.Communicator`.

:class:`LinkEmulator` holds real collectives to such a link: the collective still
runs (its result is what is used) and its handle's ``wait`` then sleeps --
without burning CPU -- until the link's deadline.  How collectives in flight
together share the link is the model's ``sharing`` (fifo, fair, ring).  Results
produced under emulation must say so (``Communicator.emulated``).

:class:`P2PEmulator` holds the point-to-point messages between pipeline stages to
the same link model: a stage boundary that crosses the slow link pays for it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from oases_ds.parallel.collectives import Group, Pending

SHARING: tuple[str, ...] = ("fifo", "fair", "ring")
"""How collectives in flight together share an emulated link (see ``LinkModel.sharing``)."""


def link_kwargs(link: Mapping[str, Any]) -> dict[str, Any]:
    """A config's link node as :class:`LinkModel` keyword arguments: a field left null (``sharing``
    in the CLI schema) takes the library's default instead of arriving as None."""
    return {key: value for key, value in link.items() if value is not None}


def link_from_config(link: Mapping[str, Any] | None) -> LinkModel | None:
    """The emulated link a config's ``cluster.link`` node names, ``None`` where it names none (the
    machine's own link): the planner's profile and its accuracy study read it alike."""
    return LinkModel(**link_kwargs(link)) if link else None


@dataclass(frozen=True)
class LinkModel:
    """A point-to-point link: ``bandwidth_gbps`` (gigabits/s per direction) and latency.

    Ring collectives are modelled as in the NCCL docs: an AllReduce of ``S``
    bytes over ``n`` ranks puts ``2 (n-1)/n * S`` bytes on each rank's link, an
    AllGather of a result of ``S`` bytes ``(n-1)/n * S``.
    """

    bandwidth_gbps: float
    latency_us: float = 0.0
    sharing: str = "fifo"
    """How collectives in flight together share the link.  ``fifo``: one after the
    other in issue order, as NCCL runs the collectives of one communicator.
    ``fair``: all in flight progress at once at an equal share of the bandwidth
    (processor sharing).  ``ring``: a collective is its ring's sequence of steps
    (``2 (n-1)`` for an AllReduce, ``n-1`` for an AllGather, each carrying an equal
    share of the bytes); the link serves steps first come first served, and a
    collective's next step joins the queue only when its previous step has
    arrived, so concurrent collectives interleave step by step -- as gloo's ring
    algorithms do over one TCP connection.  Two concurrent 1 MiB AllReduces on
    two ranks then finish at 1.5x and 2x one's time, which is what a tbf-shaped
    veth link measured (fifo: 1x and 2x, fair: 2x and 2x)."""

    def __post_init__(self) -> None:
        if not 0 < self.bandwidth_gbps < math.inf:  # nan fails both comparisons
            raise ValueError(f"link.bandwidth_gbps must be a finite number > 0, got {self.bandwidth_gbps}")
        if self.sharing not in SHARING:
            raise ValueError(f"link.sharing must be one of {', '.join(SHARING)}, got {self.sharing!r}")
        if not 0 <= self.latency_us < math.inf:
            raise ValueError(f"link.latency_us must be a finite number >= 0, got {self.latency_us}")

    def wire_bytes(self, kind: str, nbytes: int, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        if kind == "p2p":  # one message from one rank to its neighbour: every byte crosses once
            return float(nbytes)
        factor = 2.0 * (ranks - 1) / ranks if kind == "all_reduce" else (ranks - 1) / ranks
        return factor * nbytes

    def ring_steps(self, kind: str, ranks: int) -> int:
        """Sequential steps of the ring algorithm for ``kind`` over ``ranks`` ranks."""
        if kind == "p2p":
            return 1
        return 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1

    def seconds(self, kind: str, nbytes: int, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.latency_us * 1e-6 + self.wire_bytes(kind, nbytes, ranks) * 8 / (self.bandwidth_gbps * 1e9)


class _LinkMessage:
    """One collective on the emulated link; its start time is known only once every
    rank of the group has issued it (a MAX AllReduce of the issue times)."""

    def __init__(self, seconds: float, issued: torch.Tensor, work: dist.Work, steps: int = 1) -> None:
        self.seconds = seconds
        self.steps = steps
        self.issued = issued
        self.work = work
        self.deadline: float | None = None
        self.start: float | None = None
        self.ready: float = 0.0  # ring sharing: when this collective's next step may take the link
        self.remaining = seconds


class _HeldPending(Pending):
    """A transfer held to an emulated link: ``wait`` returns the real result no sooner
    than ``deadline()`` (computed at wait time, when every earlier message is settled)."""

    def __init__(self, inner: Pending, deadline: Callable[[], float]) -> None:
        super().__init__(None, inner.wait)
        self._deadline = deadline

    def wait(self) -> torch.Tensor:
        result = super().wait()
        delay = self._deadline() - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return result


class LinkEmulator:
    """Holds the collectives of one communicator to a :class:`LinkModel`.

    Every rank issues a group's collectives in the same order, so each rank runs
    the same simulation of the shared link and reaches the same deadlines.
    """

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._link_free_at = 0.0
        self._unresolved: list[_LinkMessage] = []
        self._active: list[_LinkMessage] = []  # fair / ring sharing: on the link at simulated time _clock
        self._clock = 0.0

    def hold(self, kind: str, nbytes: int, ranks: int, group: Group, pending: Pending) -> Pending:
        """``pending`` (a ``kind`` collective of ``nbytes`` over ``ranks`` ranks), completing
        no earlier than the link allows."""
        _require_gloo(group)
        # A real transfer starts when the *last* rank has issued it, not this one:
        # ranks of an overlapped schedule drift apart, and counting from the local
        # issue time made overlapped schedules look up to ~25% faster than on a
        # shaped link.  The issue times are exchanged with a small MAX AllReduce
        # (perf_counter is CLOCK_MONOTONIC, shared by processes on one machine --
        # the emulator's scope).
        issued = torch.tensor([time.perf_counter()], dtype=torch.float64)
        work = dist.all_reduce(issued, op=dist.ReduceOp.MAX, group=group, async_op=True)
        message = _LinkMessage(self.link.seconds(kind, nbytes, ranks), issued, work, self.link.ring_steps(kind, ranks))
        self._unresolved.append(message)
        return _HeldPending(pending, lambda: self.deadline(message))

    def deadline(self, message: _LinkMessage) -> float:
        """When ``message`` has crossed the link.  Every rank issues a group's collectives
        in the same order, so the issue times of everything this rank issued so far are
        known (or about to be) by the time it waits for one of them."""
        if message.deadline is not None:  # settled while simulating an earlier wait: block on nobody
            return message.deadline
        if self.link.sharing == "fair":
            return self._resolve_fair(message)
        if self.link.sharing == "ring":
            return self._resolve_ring(message)
        while message.deadline is None:
            head = self._unresolved.pop(0)
            head.work.wait()
            head.deadline = self.reserve(head.seconds, now=float(head.issued[0]))
        return message.deadline

    def _learn_starts(self) -> None:
        """Wait for the issue-time exchange of everything issued so far: a message starts
        when its last rank issued it (and its first ring step is ready then)."""
        for m in self._unresolved:
            if m.start is None:
                m.work.wait()
                m.start = m.ready = float(m.issued[0])

    def _resolve_fair(self, message: _LinkMessage) -> float:
        """Processor sharing: simulate the link from ``_clock`` -- messages join when
        issued (by their last rank) and every message on the link progresses at
        ``1/len(active)`` of the bandwidth -- until ``message`` has crossed it."""
        self._learn_starts()
        waiting = sorted(self._unresolved, key=lambda m: m.start)
        self._unresolved = []
        t = self._clock
        while message.deadline is None:
            while waiting and waiting[0].start <= t:
                self._active.append(waiting.pop(0))
            arrival = waiting[0].start if waiting else float("inf")
            if not self._active:
                t = arrival
                continue
            share = len(self._active)
            finish = t + min(m.remaining for m in self._active) * share
            step_to = min(arrival, finish)
            for m in self._active:
                m.remaining -= (step_to - t) / share
            t = step_to
            for m in [m for m in self._active if m.remaining <= 1e-12]:
                m.deadline = t
                self._active.remove(m)
        self._unresolved = waiting
        self._clock = t
        return message.deadline

    def _resolve_ring(self, message: _LinkMessage) -> float:
        """Ring steps served first come first served: simulate the link from ``_clock``
        until ``message``'s last step has crossed it.  A step is ready when its
        collective was issued (first step; it also carries the latency) or when the
        collective's previous step arrived; ties go to the earlier-issued collective."""
        self._learn_starts()
        self._active.extend(self._unresolved)
        self._unresolved = []
        latency = self.link.latency_us * 1e-6
        t = self._clock
        while message.deadline is None:
            m = min(self._active, key=lambda m: m.ready)  # min keeps the first (earliest issued) of equals
            step = (m.seconds - latency) / m.steps + (latency if m.remaining == m.seconds else 0.0)
            t = max(t, m.ready) + step
            m.remaining -= step
            m.ready = t
            if m.remaining <= 1e-12 * max(m.seconds, 1.0):
                m.deadline = t
                self._active.remove(m)
        self._clock = t
        return message.deadline

    def reserve(self, seconds: float, now: float | None = None) -> float:
        """Book the link for a message of ``seconds`` issued (by its last rank) at
        ``now`` and return when it has crossed it: it starts when it was issued and
        the previous message has left the link."""
        start = max(time.perf_counter() if now is None else now, self._link_free_at)
        self._link_free_at = start + seconds
        return self._link_free_at


class _P2PMessage:
    """One point-to-point message in one direction; ``sent_at`` is the sender's issue
    time, known to the receiver only once the stamp sent ahead of the payload arrived."""

    def __init__(self, seconds: float, stamp: torch.Tensor, stamp_work: dist.Work | None) -> None:
        self.seconds = seconds
        self.stamp = stamp
        self.stamp_work = stamp_work
        self.arrival: float | None = None


class P2PEmulator:
    """Holds the pipeline's point-to-point messages to a :class:`LinkModel`.

    Each direction between two ranks is its own link, served first come first
    served: a message starts when its *sender* issued it (or when the previous
    message of that direction has left the link) and arrives ``latency + bytes /
    bandwidth`` later.  Both ends run this same simulation -- messages of one
    direction are matched in issue order -- so the send's ``wait`` (the data has
    left) and the receive's ``wait`` (it has arrived) end at the same deadline.
    The receiver learns the sender's issue time from an 8-byte stamp sent just ahead
    of the payload (``perf_counter`` is CLOCK_MONOTONIC, shared by the processes of
    one machine -- the emulator's scope).  Why not :class:`LinkEmulator`: its
    issue-time exchange is a collective over a group, but a middle stage talks to
    two neighbours in an order neither shares.  Simplification: a receive posted
    after the message was sent finds it arrived (as an eager transport would); the
    stage links do not share bandwidth with the TMP collectives (other ranks' links).
    """

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._free_at: dict[tuple[int, int], float] = {}
        self._queued: dict[tuple[int, int], list[_P2PMessage]] = {}

    def send(self, nbytes: int, src: int, dst: int, group: Group, start_payload: Callable[[], Pending]) -> Pending:
        """Send the issue-time stamp to ``dst``, then the payload (``start_payload``)."""
        _require_gloo(group)
        stamp = torch.tensor([time.perf_counter()], dtype=torch.float64)
        stamp_work = dist.isend(stamp, dst, group=group)
        message = _P2PMessage(self.link.seconds("p2p", nbytes, 2), stamp, stamp_work)
        return self._enqueue((src, dst), message, start_payload())

    def recv(self, nbytes: int, src: int, dst: int, group: Group, start_payload: Callable[[], Pending]) -> Pending:
        """Post the receive of ``src``'s stamp, then of the payload (``start_payload``)."""
        _require_gloo(group)
        stamp = torch.empty(1, dtype=torch.float64)
        stamp_work = dist.irecv(stamp, src, group=group)
        message = _P2PMessage(self.link.seconds("p2p", nbytes, 2), stamp, stamp_work)
        return self._enqueue((src, dst), message, start_payload())

    def _enqueue(self, direction: tuple[int, int], message: _P2PMessage, pending: Pending) -> Pending:
        self._queued.setdefault(direction, []).append(message)
        return _HeldPending(pending, lambda: self.arrival(direction, message))

    def arrival(self, direction: tuple[int, int], message: _P2PMessage) -> float:
        """When ``message`` has crossed its direction's link: settle every earlier
        message of that direction first (FIFO), whatever order they are waited in."""
        queue = self._queued.setdefault(direction, [])
        while message.arrival is None:
            head = queue.pop(0)
            if head.stamp_work is not None:
                head.stamp_work.wait()
            start = max(float(head.stamp[0]), self._free_at.get(direction, 0.0))
            head.arrival = self._free_at[direction] = start + head.seconds
        return message.arrival


def _require_gloo(group: Group) -> None:
    if dist.get_backend(group) != "gloo":
        raise ValueError("oases.link (link emulation) needs the gloo backend: on NCCL a handle's wait() does not "
                         "block the host, so there is nothing to hold to a deadline; remove oases.link")
