"""What happened when, per rank: the evidence behind every overlap claim.

Each instruction is recorded on a lane: ``compute`` (Forward/Recompute/
Backward), ``comm`` (a collective, from its StartAsync to the end of its Sync)
and ``wait`` (time the compute lane sat blocked in a Sync -- the *exposed*
communication).  Exported as Chrome/Perfetto trace JSON: one process per rank,
one named thread per lane, each event named by operator, phase and sub-batch
(``L1.attn.qkv fwd sb0``) with the schedule token (``F17.0``) in its args, so a
trace reads without the operator table at hand.

How intervals are timed depends on where the tensors live (:func:`clock_for`):

* CPU (:class:`HostClock`): ``perf_counter``.  Exact for gloo on CPU, where compute
  runs on the calling thread and a Sync blocks until the data is there.
* CUDA (:class:`CudaClock`): CUDA events recorded on the device's current stream.
  Host timers would only see kernel launches.  A compute interval is an event pair
  around the operator's kernels.  A ``wait`` interval is the pair around
  ``work.wait()``: once the collective's stream joins the compute stream, the second
  event fires only when the collective is done, so the pair measures how long the
  compute stream stalled, which is the exposed communication.  A ``comm`` interval
  runs from an event recorded just before the collective is issued (its stream
  cannot start earlier) to that same post-wait event.  So it is an upper bound that
  is exact whenever the collective was exposed.
  Events are read only when the timeline is (:attr:`Timeline.events`), so recording
  never synchronises the host with the device inside a step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from oases_ds.utils.io import write_json_atomic

LANES = ("compute", "comm", "wait")  # Chrome trace thread ids 0, 1, 2 in this order
EXPOSURE_PHASES = ("forward", "recompute", "backward", "embedding/head")
"""Where :meth:`Timeline.exposed_by_phase` puts a wait; the engine adds the optimizer boundary's
(the DP reduction's wait after the schedule)."""
_PASS_NAMES = {"fwd": "forward", "rec": "recompute", "bwd": "backward"}


def op_label(name: str, layer: int, block: str) -> str:
    """``L1.attn.qkv`` for op ``L1.qkv`` of layer 1's attention block, ``head.loss`` for the
    loss: the layer and planner block are visible even where the op's own name omits them."""
    prefix = f"L{layer}."
    if name.startswith(prefix):
        return f"{prefix}{block}.{name[len(prefix):]}"
    return name if name == block else f"{block}.{name}"


@dataclass(frozen=True)
class Event:
    """One interval on one lane.

    Attributes:
        name: the schedule token (``F3.0``, ``W3.1``, ``C3.1:backward``): what
            tests and the profiler parse.
        sub: the sub-batch the interval belongs to.
        op: the operator's label (:func:`op_label`), "" if unknown.
        phase: "fwd", "rec" or "bwd" (for a collective: the pass it belongs to).
    """

    name: str
    lane: str  # "compute" | "comm" | "wait"
    sub: int
    start: float  # seconds: perf_counter on CPU, since the timeline's first event on CUDA
    end: float
    op: str = ""
    phase: str = ""

    @property
    def title(self) -> str:
        """What a trace viewer shows: ``L1.attn.qkv fwd sb0`` (the token when the op is unknown)."""
        if not self.op:
            return f"{self.name} sb{self.sub}"
        return f"{self.op} {self.phase} sb{self.sub}"


class Clock(Protocol):
    """Takes time marks now and turns them into seconds later.

    Why two steps: on a GPU a mark is an event the device records when it gets there.
    Reading it waits for the device, so marks are taken in the hot loop and read
    once, afterwards.
    """

    def mark(self) -> Any: ...

    def resolve(self, marks: list[Any]) -> list[float]:
        """Seconds of each mark on one common origin, in order (may wait for the device)."""
        ...


class HostClock:
    """``perf_counter``: for CPU tensors, whose work is done when the call returns."""

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self, marks: list[float]) -> list[float]:
        return list(marks)


class CudaClock:
    """CUDA events on ``device``'s current stream; seconds since the first mark it resolved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._origin: torch.cuda.Event | None = None

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolve(self, marks: list[torch.cuda.Event]) -> list[float]:
        if not marks:
            return []
        torch.cuda.synchronize(self.device)  # once: every mark is then complete (a wait per event cost µs each)
        if self._origin is None:  # one origin for every later resolve, so batches line up
            self._origin = marks[0]
        return [self._origin.elapsed_time(event) / 1e3 for event in marks]


def clock_for(device: torch.device | str) -> Clock:
    """The clock that times work on ``device``: events on CUDA, ``perf_counter`` elsewhere."""
    return CudaClock(torch.device(device)) if torch.device(device).type == "cuda" else HostClock()


class Timeline:
    """The intervals of one run, timed by ``clock`` (default: host time).

    Intervals are added as raw clock marks.  They are read as :class:`Event` in seconds
    the first time :attr:`events` (or anything computed from it) is asked for.
    On CUDA that read is the only point that waits for the device.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or HostClock()
        self._pending: list[tuple[object, str, int, Any, Any, str, str]] = []
        self._events: list[Event] = []

    def add(self, name: object, lane: str, sub: int, start: Any, end: Any, op: str = "", phase: str = "") -> None:
        """One interval from mark ``start`` to mark ``end`` (``clock.mark()`` values; floats for host time).
        ``name`` is anything whose ``str`` is the event's name (an instruction): formatted only
        when :attr:`events` is read, not once per instruction on the executor's hot path."""
        self._pending.append((name, lane, sub, start, end, op, phase))

    @property
    def events(self) -> list[Event]:
        if self._pending:
            pending, self._pending = self._pending, []
            marks = [m for p in pending for m in (p[3], p[4])]
            seconds = self.clock.resolve(marks)
            self._events.extend(
                Event(str(name), lane, sub, seconds[2 * i], seconds[2 * i + 1], op, phase)
                for i, (name, lane, sub, _, _, op, phase) in enumerate(pending)
            )
        return self._events

    def clear(self) -> None:
        self._pending.clear()
        self._events.clear()

    @property
    def span(self) -> float:
        events = self.events
        if not events:
            return 0.0
        return max(e.end for e in events) - min(e.start for e in events)

    def busy(self, lane: str) -> float:
        return sum(e.end - e.start for e in self.events if e.lane == lane)

    def summary(self) -> dict[str, float]:
        """Step span, compute busy time (also per pass: ``compute_fwd_s``/``_rec_s``/``_bwd_s``),
        exposed (blocking) comm time, and their fractions.  The per-pass split is what bounds a
        step on a slow link: the forward cannot end before its collectives have crossed it."""
        span = self.span
        busy: dict[tuple[str, str], float] = {}  # (lane, phase) -> seconds, one pass over the events
        for e in self.events:
            busy[(e.lane, e.phase)] = busy.get((e.lane, e.phase), 0.0) + (e.end - e.start)
        compute = sum(s for (lane, _), s in busy.items() if lane == "compute")
        exposed = sum(s for (lane, _), s in busy.items() if lane == "wait")
        by_phase = {phase: busy.get(("compute", phase), 0.0) for phase in ("fwd", "rec", "bwd")}
        return {
            "span_s": span,
            "compute_s": compute,
            **{f"compute_{phase}_s": seconds for phase, seconds in by_phase.items()},
            "exposed_comm_s": exposed,
            "compute_util": compute / span if span else 0.0,
            "exposed_comm_frac": exposed / span if span else 0.0,
        }

    def exposed_by_phase(self) -> dict[str, float]:
        """Exposed (blocking) communication seconds by where the schedule waited
        (:data:`EXPOSURE_PHASES`): the embedding's and the head's collectives apart -- the first
        and last of each pass, which two sub-batches have the least work to cover -- and the
        blocks' by pass: forward, recomputation (the cross-pass phase of the Oases schedule),
        backward."""
        out = dict.fromkeys(EXPOSURE_PHASES, 0.0)
        for e in self.events:
            if e.lane == "wait":
                where = "embedding/head" if e.op.startswith(("embed", "head")) else _PASS_NAMES.get(e.phase, "backward")
                out[where] += e.end - e.start
        return out

    def chrome_trace(self, rank: int = 0) -> dict:
        """Chrome trace-event JSON: metadata events (``"ph": "M"``) name the process
        ``rank <r>`` and its threads after the lanes; complete events (``"X"``) carry
        the op label as name, microseconds since the first event."""
        t0 = min((e.start for e in self.events), default=0.0)
        tid = {lane: i for i, lane in enumerate(LANES)}
        meta = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
        for lane, i in tid.items():
            meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": i, "args": {"name": lane}},
                     {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": i, "args": {"sort_index": i}}]
        spans = [
            {
                "name": e.title,
                "cat": e.lane,
                "ph": "X",
                "ts": (e.start - t0) * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "pid": rank,
                "tid": tid.get(e.lane, len(LANES)),
                "args": {"token": e.name, "op": e.op, "phase": e.phase, "sub_batch": e.sub, "lane": e.lane},
            }
            for e in self.events
        ]
        return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str, rank: int = 0) -> None:
        """Write atomically: a crash mid-write never leaves a truncated trace."""
        write_json_atomic(path, self.chrome_trace(rank))


def exposed_by_phase_of(timelines: Sequence[Timeline]) -> dict[str, float]:
    """:meth:`Timeline.exposed_by_phase` of a step that ran as several executor runs (one per
    micro-batch without a step schedule), summed phase by phase."""
    out = dict.fromkeys(EXPOSURE_PHASES, 0.0)
    for timeline in timelines:
        for where, seconds in timeline.exposed_by_phase().items():
            out[where] += seconds
    return out
