"""What happened when, per rank: the evidence behind every overlap claim.

Each instruction is recorded on a lane: ``compute`` (Forward/Recompute/
Backward), ``comm`` (a collective, from its StartAsync to the end of its Sync)
and ``wait`` (time the compute lane sat blocked in a Sync -- the *exposed*
communication).  Exported as Chrome/Perfetto trace JSON: one process per rank,
one named thread per lane, each event named by operator, phase and sub-batch
(``L1.attn.qkv fwd sb0``) with the schedule token (``F17.0``) in its args, so a
trace reads without the operator table at hand.

Times are host-side (``perf_counter``): exact for gloo on CPU, where compute runs on
the calling thread and ``wait`` blocks until the data is there; on CUDA they time
kernel launches and stream waits, so use a profiler there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from oases_ds.utils.io import write_json_atomic

LANES = ("compute", "comm", "wait")  # Chrome trace thread ids 0, 1, 2 in this order


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
    start: float  # seconds, perf_counter
    end: float
    op: str = ""
    phase: str = ""

    @property
    def title(self) -> str:
        """What a trace viewer shows: ``L1.attn.qkv fwd sb0`` (the token when the op is unknown)."""
        if not self.op:
            return f"{self.name} sb{self.sub}"
        return f"{self.op} {self.phase} sb{self.sub}"


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    def add(self, name: str, lane: str, sub: int, start: float, end: float, op: str = "", phase: str = "") -> None:
        self.events.append(Event(name, lane, sub, start, end, op, phase))

    def clear(self) -> None:
        self.events.clear()

    @property
    def span(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, lane: str) -> float:
        return sum(e.end - e.start for e in self.events if e.lane == lane)

    def summary(self) -> dict[str, float]:
        """Step span, compute busy time, exposed (blocking) comm time, and their fractions."""
        span = self.span
        compute, exposed = self.busy("compute"), self.busy("wait")
        return {
            "span_s": span,
            "compute_s": compute,
            "exposed_comm_s": exposed,
            "compute_util": compute / span if span else 0.0,
            "exposed_comm_frac": exposed / span if span else 0.0,
        }

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
