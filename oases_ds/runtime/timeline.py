"""What happened when, per rank: the evidence behind every overlap claim.

Each instruction is recorded on a lane: ``compute`` (Forward/Recompute/
Backward), ``comm`` (a collective, from its StartAsync to the end of its Sync)
and ``wait`` (time the compute lane sat blocked in a Sync -- the *exposed*
communication).  Exported as Chrome/Perfetto trace JSON.

Times are host-side (``perf_counter``): exact for gloo on CPU, where compute runs on
the calling thread and ``wait`` blocks until the data is there; on CUDA they time
kernel launches and stream waits, so use a profiler there.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    name: str
    lane: str  # "compute" | "comm" | "wait"
    mb: int
    start: float  # seconds, perf_counter
    end: float


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    def add(self, name: str, lane: str, mb: int, start: float, end: float) -> None:
        self.events.append(Event(name, lane, mb, start, end))

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
        t0 = min((e.start for e in self.events), default=0.0)
        lanes = {"compute": 0, "comm": 1, "wait": 2}
        return {
            "traceEvents": [
                {
                    "name": e.name,
                    "ph": "X",
                    "ts": (e.start - t0) * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "pid": rank,
                    "tid": lanes.get(e.lane, 3),
                    "args": {"sub_batch": e.mb, "lane": e.lane},
                }
                for e in self.events
            ]
        }

    def save_chrome_trace(self, path: str, rank: int = 0) -> None:
        """Write atomically: a crash mid-write never leaves a truncated trace."""
        write_json_atomic(path, self.chrome_trace(rank))


def write_json_atomic(path: str, obj: object) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
