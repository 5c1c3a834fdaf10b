"""The sub-batch merge ordered by per-op times, for sequence-parallel steps whose times are known.

:func:`~oases_ds.schedule.generators.merge` switches sub-batch at every collective and, under
sequence parallelism, lets a sub-batch *hop in* between two heavy operators of the other one to
start its next collective (a block's ReduceScatter and the next block's AllGather have only a
norm between them).  Its rule -- hop once the collective has had one heavy operator's time -- is
blind to time.  Priced on LLaMA-7B at seq 4096 on an 8 x 3090 server (``cost=analytic``), it hops
after the attention projection's backward, shorter than the collective it covers, so the
compute lane waits, and in the link-bound forward it sometimes holds back a hop the link needed.

Given every op's time (:class:`HopCosts`: what the planner priced the plan with, carried in the
plan), this merge makes each hop choice that matters -- the collective is not done yet and the
link would go idle after it -- by a small beam search over the step, replayed on one compute lane
and one link as the planner's replay does (:func:`~oases_ds.planner.costmodel.simulate_step`):
states at the same number of emitted stream items compete on when both lanes are free, the best
few go on.  The step it returns is the faster, so replayed, of that order and the time-blind
one: it is never slower by the model that chose it.  The order is a function of the op sequence
and the times only, so every rank of a TMP group, reading the same plan, builds the same one.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from oases_ds.models.ops import CommOp, Op, moves_bytes, short_name
from oases_ds.schedule.instructions import Backward, Forward, Instruction, Recompute, StartAsync, Sync

BEAM_WIDTH = 4
"""States kept per level of the search.  On LLaMA-7B (seq 4096, 8 x 3090, every block stored)
planned analytically, widths 1 to 64 found the same step to 0.1 ms; 4 leaves room."""

def _finite(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a finite number >= 0 (ms), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class HopCosts:
    """Per-op times (ms per sub-batch) a sequence-parallel merge orders its hops by, each op named by
    :func:`~oases_ds.models.ops.short_name`: under sequence parallelism every block runs at the one TMP
    degree, so every layer's copy of an op costs the same.

    Attributes:
        compute_ms: per compute op: its Forward, Recompute and Backward time.
        link_ms: per communication op: the link's time for one of its collectives
            that moves bytes (under sequence parallelism an AllGather or a ReduceScatter of the
            block's activation, the same bytes either way).
        issue_ms: the compute lane's host time to issue one such collective
            (:func:`~oases_ds.planner.replay.collective_issue_ms`).
    """

    compute_ms: tuple[tuple[str, float, float, float], ...] = ()
    link_ms: tuple[tuple[str, float], ...] = ()
    issue_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "issue_ms", _finite("hop_costs.issue_ms", self.issue_ms))
        rows = []
        for i, row in enumerate(self._rows("compute_ms", 4)):
            rows.append((self._name("compute_ms", i, row[0]),
                         *(_finite(f"hop_costs.compute_ms[{i}][{k}]", v) for k, v in enumerate(row[1:], 1))))
        object.__setattr__(self, "compute_ms", tuple(rows))
        links = []
        for i, row in enumerate(self._rows("link_ms", 2)):
            links.append((self._name("link_ms", i, row[0]), _finite(f"hop_costs.link_ms[{i}][1]", row[1])))
        object.__setattr__(self, "link_ms", tuple(links))

    def _rows(self, field: str, width: int) -> list[Sequence[Any]]:
        value = getattr(self, field)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or any(
                isinstance(row, (str, bytes)) or not isinstance(row, (list, tuple)) or len(row) != width for row in value):
            raise ValueError(f"hop_costs.{field} must be a list of [name, {', '.join(['ms'] * (width - 1))}] rows, "
                             f"got {value!r}")
        return list(value)

    @staticmethod
    def _name(field: str, i: int, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise ValueError(f"hop_costs.{field}[{i}][0] must be an op name, got {name!r}")
        return name

    @classmethod
    def from_value(cls, value: Any) -> HopCosts:
        """From a plan file's JSON object (``{"compute_ms": [...], "link_ms": [...]}``); one line naming
        the field when it is not one."""
        if isinstance(value, HopCosts):
            return value
        if not isinstance(value, dict) or set(value) - {"compute_ms", "link_ms", "issue_ms"}:
            raise ValueError(f"hop_costs must be an object with compute_ms, link_ms and issue_ms, got {value!r}")
        rows = {}
        for field in ("compute_ms", "link_ms"):
            table = value.get(field, [])
            if not isinstance(table, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in table):
                raise ValueError(f"hop_costs.{field} must be a list of rows, got {table!r}")
            rows[field] = tuple(tuple(row) for row in table)
        return cls(rows["compute_ms"], rows["link_ms"], value.get("issue_ms", 0.0))

    def per_op(self, ops: Sequence[Op]) -> tuple[list[tuple[float, float, float]], list[float]] | None:
        """Per op index of ``ops``: (F, R, B) ms and the link ms of a collective; ``None`` when an op has
        no time here (its merge then stays time-blind)."""
        compute = {name: (f, r, b) for name, f, r, b in self.compute_ms}
        link = dict(self.link_ms)
        times, links = [], []
        for op in ops:
            key = short_name(op)
            if isinstance(op, CommOp):
                if key not in link:
                    return None
                times.append((0.0, 0.0, 0.0))
                links.append(link[key])
            else:
                if key not in compute:
                    return None
                times.append(compute[key])
                links.append(0.0)
        return times, links


class _State:
    """One partial merge: the streams' positions, each sub-batch's collective in flight, and the
    replayed clock (compute lane ``now``, link free at ``link_free``, each collective's end)."""

    __slots__ = ("pos", "pending", "active", "cur", "started", "now", "link_free", "ends", "out", "forced", "emitted")

    def clone(self) -> _State:
        new = _State.__new__(_State)
        new.pos, new.pending, new.active = list(self.pos), list(self.pending), list(self.active)
        new.cur, new.started, new.now, new.link_free = self.cur, self.started, self.now, self.link_free
        new.ends, new.out, new.forced, new.emitted = dict(self.ends), self.out, dict(self.forced), self.emitted
        return new


class _Decide(Exception):
    """A hop choice the search must make: the other sub-batch ``sub``."""

    def __init__(self, sub: int) -> None:
        super().__init__(sub)
        self.sub = sub


class _Merge:
    """The merge of :func:`~oases_ds.schedule.generators.merge` (same switches, same hops) as a state
    machine that can be copied at a hop choice and replays its own time."""

    def __init__(self, streams: Sequence[Sequence[Any]], light: Callable[[int], bool], ops: Sequence[Op],
                 times: list[tuple[float, float, float]], links: list[float], issue_ms: float) -> None:
        self.streams, self.light, self.ops, self.times, self.links = streams, light, ops, times, links
        self.issue_ms = issue_ms

    def start(self) -> _State:
        s = _State()
        s.pos, s.pending = [0] * len(self.streams), [None] * len(self.streams)
        s.active = [sub for sub, stream in enumerate(self.streams) if stream]
        s.cur, s.started = (s.active[0] if s.active else None), False
        s.now = s.link_free = 0.0
        s.ends, s.out, s.forced, s.emitted = {}, None, {}, 0
        return s

    def duration(self, item: Instruction) -> float:
        f, r, b = self.times[item.op]
        return b if isinstance(item, Backward) else r if isinstance(item, Recompute) else f

    def put(self, s: _State, ins: Instruction) -> None:
        """Emit ``ins`` (the output is a linked list shared between copies) and advance the clock."""
        s.out, s.emitted = (ins, s.out), s.emitted + 1
        if isinstance(ins, StartAsync):
            seconds = self.links[ins.op] if moves_bytes(self.ops[ins.op], ins.phase) else 0.0
            if seconds > 0:
                s.now += self.issue_ms
            s.link_free = max(s.now, s.link_free) + seconds
            s.ends[(ins.op, ins.sub, ins.phase)] = s.link_free
        elif isinstance(ins, Sync):
            s.now = max(s.now, s.ends.pop((ins.op, ins.sub, ins.phase)))
        elif not isinstance(self.ops[ins.op], CommOp):
            s.now += self.duration(ins)

    def hop_end(self, s: _State, sub: int) -> int | None:
        """As the time-blind merge's ``hop_run``: the index of ``sub``'s next collective if only light
        ops come before it."""
        stream, end = self.streams[sub], s.pos[sub]
        while end < len(stream) and isinstance(stream[end], (Forward, Recompute, Backward)):
            if not self.light(stream[end].op):
                return None
            end += 1
        return end if end < len(stream) else None

    def hop(self, s: _State, sub: int, end: int) -> None:
        c = s.pending[sub]
        self.put(s, Sync(c.op, c.sub, c.phase))
        for item in self.streams[sub][s.pos[sub]:end]:
            self.put(s, item)
        nxt = self.streams[sub][end]
        self.put(s, StartAsync(nxt.op, nxt.sub, nxt.phase))
        s.pending[sub], s.pos[sub] = nxt, end + 1

    def wants_hop(self, s: _State, sub: int) -> bool:
        """Hop now when the collective is done (nothing to lose); not while the link is busy past it
        (hopping would only wait); else the search decides (``s.forced`` holds its choice)."""
        c = s.pending[sub]
        end = s.ends[(c.op, c.sub, c.phase)]
        if end <= s.now:
            return True
        if s.link_free > end:
            return False
        if sub in s.forced:
            return s.forced[sub]
        raise _Decide(sub)

    def step(self, s: _State) -> None:
        """One move of the merge: a sync at a sub-batch's turn, one item, or the switch to the next."""
        sub = s.cur
        if not s.started:
            s.started = True
            if s.pending[sub] is not None:
                c = s.pending[sub]
                self.put(s, Sync(c.op, c.sub, c.phase))
                s.pending[sub] = None
            return
        stream = self.streams[sub]
        if s.pos[sub] >= len(stream):
            self.next_turn(s)
            return
        item = stream[s.pos[sub]]
        if not isinstance(item, (Forward, Recompute, Backward)):  # a collective: start it and yield
            s.pos[sub] += 1
            self.put(s, StartAsync(item.op, item.sub, item.phase))
            s.pending[sub] = item
            self.next_turn(s)
            return
        if not self.light(item.op):
            for other in [a for a in s.active if a != sub and s.pending[a] is not None]:
                end = self.hop_end(s, other)
                if end is not None and self.wants_hop(s, other):
                    self.hop(s, other, end)
        s.pos[sub] += 1
        self.put(s, item)
        s.forced = {}

    def next_turn(self, s: _State) -> None:
        sub = s.cur
        if s.pos[sub] >= len(self.streams[sub]) and s.pending[sub] is None:
            s.active.remove(sub)
        if not s.active:
            s.cur = None
            return
        later = [a for a in s.active if a > sub]
        s.cur, s.started = (later[0] if later else s.active[0]), False

    def run_to_choice(self, s: _State) -> list[_State] | None:
        """Run ``s`` on until a hop choice (returns the two states that take it either way, each still
        to run that move) or the end (``None``)."""
        while s.cur is not None:
            before = s.clone()
            try:
                self.step(s)
            except _Decide as choice:
                options = []
                for take in (True, False):
                    option = before.clone()
                    option.forced[choice.sub] = take
                    options.append(option)
                return options
        return None

    def search(self, width: int) -> _State:
        """The beam search of the module doc; the finished state that ends earliest."""
        counter = itertools.count()
        heap = [(0, 0.0, next(counter), self.start())]
        expanded: dict[int, int] = {}
        best: _State | None = None
        while heap:
            level, _, _, s = heapq.heappop(heap)
            if expanded.get(level, 0) >= width:
                continue
            expanded[level] = expanded.get(level, 0) + 1
            options = self.run_to_choice(s)
            if options is None:
                if best is None or s.now < best.now:
                    best = s
                continue
            for option in options:
                option = self.settle(option)
                heapq.heappush(heap, (sum(option.pos), max(option.now, option.link_free), next(counter), option))
        assert best is not None
        return best

    def settle(self, s: _State) -> _State:
        """The state after the move a choice was taken for; a second choice in the same move (three or
        more sub-batches) is not to hop.  Each try starts from ``s`` as it was."""
        while True:
            trial = s.clone()
            try:
                self.step(trial)
                return trial
            except _Decide as choice:
                s.forced[choice.sub] = False

    def replayed_ms(self, instructions: Sequence[Instruction]) -> float:
        """When ``instructions`` (any merge of these streams) end, replayed on this merge's clock."""
        s = self.start()
        for ins in instructions:
            self.put(s, ins)
        return s.now


def costed_merge(streams: Sequence[Sequence[Any]], light: Callable[[int], bool], ops: Sequence[Op],
                 costs: HopCosts, time_blind: Callable[[], list[Instruction]],
                 width: int = BEAM_WIDTH) -> list[Instruction]:
    """The merge of ``streams`` ordered by ``costs`` (module doc), or ``time_blind()``'s when that one
    replays as fast or faster, or when ``costs`` lack an op of ``ops``."""
    blind = time_blind()
    per_op = costs.per_op(ops)
    if per_op is None:
        return blind
    merge = _Merge(streams, light, ops, *per_op, costs.issue_ms)
    best = merge.search(width)
    out: list[Instruction] = []
    node = best.out
    while node is not None:
        out.append(node[0])
        node = node[1]
    out.reverse()
    return out if merge.replayed_ms(out) < merge.replayed_ms(blind) else blind


def hop_costs_from(ops: Sequence[Op], forward_ms: Mapping[int, float], recompute_ms: Mapping[int, float],
                   backward_ms: Mapping[int, float], link_ms: Mapping[int, float], issue_ms: float = 0.0) -> HopCosts:
    """:class:`HopCosts` from per-op-index times over ``ops`` (a recompute time missing: the forward's,
    as the replay takes it); the first op of each short name gives its times."""
    compute: dict[str, tuple[str, float, float, float]] = {}
    links: dict[str, tuple[str, float]] = {}
    for i, op in enumerate(ops):
        key = short_name(op)
        if isinstance(op, CommOp):
            links.setdefault(key, (key, float(link_ms.get(i, 0.0))))
        else:
            forward = float(forward_ms.get(i, 0.0))
            compute.setdefault(key, (key, forward, float(recompute_ms.get(i, forward)), float(backward_ms.get(i, 0.0))))
    return HopCosts(tuple(compute.values()), tuple(links.values()), issue_ms)
