"""What a block costs under a given schedule, and a step simulator for "what if" links.

Two levels, because the planner and the user ask different questions:

* :func:`exposed_comm_ms` is the closed form the planner's node cost uses (each
  schedule registers its own, :mod:`oases_ds.schedule.closed_forms`): from a block's
  compute and raw TMP communication it predicts the communication the schedule
  leaves *exposed*.  Overlap is the whole point of Oases, so a plain
  ``compute + comm`` sum would rank degrees wrongly: under ``oases`` the
  collective of one sub-batch runs while the other sub-batches compute, so only
  ``max(0, comm - other sub-batches' compute)`` shows; under ``megatron``
  every collective blocks and the per-layer recompute repeats the forward
  AllReduce.
* :func:`simulate_step` replays a schedule's real instruction stream (from
  :func:`~oases_ds.schedule.generators.build_schedule`, no processes) on a
  compute lane and one shared link, with per-op compute times and collective
  sizes given, so a profile taken on one link predicts a step on another::

      compute  F0 F1 |....| F0' F1' ...      a Sync blocks the compute lane until
      link        [C0  ][C1  ]               its collective has left the link

  A StartAsync puts its collective on the link once it is issued *and* the
  previous message has left (messages share the link, as in
  :class:`~oases_ds.parallel.link.LinkModel` emulation); a Sync waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from oases_ds.models.ops import CommOp, Op, moves_bytes
from oases_ds.parallel.link import LinkModel
from oases_ds.planner.costs import OpTimes
from oases_ds.schedule.closed_forms import BlockTiming
from oases_ds.schedule.generators import Schedule, ScheduleSpec, closed_form_of
from oases_ds.schedule.instructions import Backward, Forward, Instruction, Recompute, StartAsync, Sync


def exposed_comm_ms(timing: BlockTiming, spec: ScheduleSpec) -> tuple[float, float]:
    """(forward, backward) communication ``spec``'s schedule leaves exposed for one block: the closed
    form the schedule registered (:mod:`oases_ds.schedule.closed_forms` says what each hides and why)."""
    form = closed_form_of(spec.name)
    if form is None:
        raise ValueError(f"schedule.name={spec.name!r} has no closed form in the cost model; add one: "
                         f"register_schedule(..., closed_form=ClosedForm(...)) (oases_ds/schedule/closed_forms.py)")
    return form.whole(timing, spec.effective_sub_batches)


def pipelined_comm_ms(timing: BlockTiming, spec: ScheduleSpec) -> tuple[float, float, float, float]:
    """(forward, backward) exposed comm of a block *inside a sequence of blocks*, split
    into the node part and the last sub-batch's collective (forward, backward) that
    :func:`~oases_ds.planner.costs.edge_ms` prices against the neighbouring block.

    :func:`exposed_comm_ms` hides all ``s`` collectives of a pass behind
    ``(s-1)/s`` of the block's own compute, as if the block ended the pass.  In
    a sequence an overlapped schedule does better: collective ``j < s-1`` hides
    behind the later sub-batches of this block, and the last one behind sub-batch 0
    of the next block, which only the edge knows.  Measured on gpt_small at 0.2 Gbit/s
    (T=2, uniform degree 2, 4 layers) the Sync waits were ~29 ms per layer, the
    whole-block form said 54 ms, this split ~30 ms.

    A schedule whose closed form has no ``pipelined`` part, and one sub-batch, keep
    :func:`exposed_comm_ms` with nothing left to the edge.
    """
    whole = exposed_comm_ms(timing, spec)
    form, sub_batches = closed_form_of(spec.name), spec.effective_sub_batches
    if sub_batches < 2 or form is None or form.pipelined is None:  # a blocking schedule, or one run whole
        return whole[0], whole[1], 0.0, 0.0
    return form.pipelined(timing, sub_batches, whole)


# -- step simulator ---------------------------------------------------------------
@dataclass(frozen=True)
class OpCosts:
    """Inputs of the simulator, per operator index, for one sub-batch of the schedule.

    Attributes:
        forward_ms: Forward (and Recompute) time of each compute op; missing: 0.
        backward_ms: Backward time of each compute op; missing: 0.
        comm_bytes: payload of each communication op's collective (the tensor
            reduced, or the gathered result); missing: no traffic.
        ranks: ranks in each communication op's group; missing: ``default_ranks``.
        default_ranks: group size for ops not in ``ranks``.
        kind: collective kind per op ("all_reduce" or "all_gather"); missing: all_reduce.
        recompute_ms: Recompute time of each compute op where it was measured apart
            from its Forward; missing: the op's ``forward_ms``.
    """

    forward_ms: Mapping[int, float]
    backward_ms: Mapping[int, float]
    comm_bytes: Mapping[int, int]
    default_ranks: int = 2
    ranks: Mapping[int, int] = field(default_factory=dict)
    kind: Mapping[int, str] = field(default_factory=dict)
    recompute_ms: Mapping[int, float] = field(default_factory=dict)

    @classmethod
    def from_profile(cls, ops: Sequence[Op], times: OpTimes, payload_bytes: int, degree: int) -> OpCosts:
        """Simulator inputs of the profiler's one-layer model at ``degree`` from its per-op times
        (ms per sub-batch) and the payload of every collective it issues."""
        comm = [i for i, op in enumerate(ops) if isinstance(op, CommOp)]
        return cls(forward_ms=dict(times.forward_ms), backward_ms=dict(times.backward_ms),
                   recompute_ms=dict(times.recompute_ms), comm_bytes={i: payload_bytes for i in comm},
                   kind={i: "all_gather" for i in comm if ops[i].dim == 1},  # sequence parallelism's halves
                   default_ranks=degree)

    def compute_ms(self, ins: Instruction) -> float:
        """Compute time of a Forward, Recompute or Backward instruction."""
        if isinstance(ins, Backward):
            return self.backward_ms.get(ins.op, 0.0)
        if isinstance(ins, Recompute) and ins.op in self.recompute_ms:
            return self.recompute_ms[ins.op]
        return self.forward_ms.get(ins.op, 0.0)


@dataclass(frozen=True)
class SimEvent:
    name: str
    lane: str
    """"compute", "comm" (the message on the link), "wait" (compute lane blocked in a Sync) or "issue"
    (compute lane busy issuing a collective: ``issue_ms`` of :func:`simulate_step`)."""
    start_ms: float
    end_ms: float


@dataclass
class SimResult:
    step_ms: float
    compute_ms: float
    comm_ms: float
    """Link busy time: every collective's transfer, hidden or not."""
    exposed_comm_ms: float
    """Time the compute lane sat in a Sync: the communication overlap did not hide."""
    events: list[SimEvent]
    issue_ms: float = 0.0
    """Time the compute lane spent issuing collectives (``issue_ms`` of :func:`simulate_step`)."""

    def lane(self, lane: str) -> list[SimEvent]:
        return [e for e in self.events if e.lane == lane]


def simulate_step(
    schedule: Schedule,
    ops: Sequence[Op],
    costs: OpCosts,
    link: LinkModel,
    compute_scale: Callable[[Instruction], float] | None = None,
    issue_ms: Mapping[int, float] | None = None,
) -> SimResult:
    """Replay ``schedule`` over ``ops`` with a compute lane and one link; times in ms.

    ``compute_scale`` optionally multiplies an instruction's compute time (a
    what-if knob, e.g. a faster device); the default is 1.  ``issue_ms[k]`` is
    the host time a collective among ``k`` ranks takes on the compute lane
    before its message can leave (:func:`issue_ms_hiding`); missing: 0.
    """
    now = 0.0
    link_free = 0.0
    compute = exposed = comm = issued = 0.0
    in_flight: dict[tuple[int, int, str], float] = {}
    events: list[SimEvent] = []
    for ins in schedule.instructions:
        op = ops[ins.op]
        if isinstance(ins, (Forward, Recompute, Backward)):
            if isinstance(op, CommOp):  # identity in this direction: no work
                continue
            duration = costs.compute_ms(ins) * (compute_scale(ins) if compute_scale else 1.0)
            events.append(SimEvent(str(ins), "compute", now, now + duration))
            now += duration
            compute += duration
        elif isinstance(ins, StartAsync):
            nbytes = costs.comm_bytes.get(ins.op, 0) if moves_bytes(op, ins.phase) else 0
            ranks = costs.ranks.get(ins.op, costs.default_ranks)
            seconds = link.seconds(costs.kind.get(ins.op, "all_reduce"), nbytes, ranks) if nbytes else 0.0
            host = (issue_ms or {}).get(ranks, 0.0) if nbytes else 0.0
            if host > 0:
                events.append(SimEvent(f"I{ins.op}.{ins.sub}:{ins.phase}", "issue", now, now + host))
                now += host
                issued += host
            start = max(now, link_free)
            end = start + seconds * 1e3
            link_free = end
            comm += end - start
            in_flight[(ins.op, ins.sub, ins.phase)] = end
            events.append(SimEvent(f"C{ins.op}.{ins.sub}:{ins.phase}", "comm", start, end))
        elif isinstance(ins, Sync):
            done = in_flight.pop((ins.op, ins.sub, ins.phase))
            if done > now:
                events.append(SimEvent(str(ins), "wait", now, done))
                exposed += done - now
                now = done
        else:  # pragma: no cover - the instruction set is closed
            raise TypeError(f"unknown instruction {ins!r}")
    if in_flight:
        raise ValueError(f"schedule {schedule.name} left collectives unsynced: {sorted(in_flight)[:4]}")
    return SimResult(step_ms=now, compute_ms=compute, comm_ms=comm, exposed_comm_ms=exposed, events=events,
                     issue_ms=issued)


# -- what the link model and the compute leave out ----------------------------------
def collective_overhead_ms(residual_ms: Mapping[int, float], collectives: Mapping[int, int]) -> dict[int, float]:
    """Per degree, the step time each collective costs beyond its link time and the compute, in ms.

    Why: a TMP collective is more than bytes on a link.  Both ranks must reach it (it is
    a barrier, so one rank's late compute is the other's wait), the host issues and
    completes it (gloo's threads share the cores with compute on a CPU), and the
    emulator adds an exchange of issue times.  None of that is in :func:`simulate_step`,
    which replays one rank's measured compute against the link model.  Seen on the
    accuracy setups (gpt_small, T=2): uniform degree 2 ran ~25% over its prediction and
    degree 1 ~8%, and at 1 Gbit/s, where the link time nearly vanishes, that gap decided
    the order of the plans.

    ``residual_ms[t]`` is what the profiler measured for the one-layer step at degree t
    less what the simulator replays from the same step's per-op compute on the link
    model.  At degree 1 no collective crosses a rank: its residual is the executor's own
    per-step overhead, present at every degree, so it is subtracted.  What is left, over
    the ``collectives[t]`` the degree-t step issued, is the overhead of one collective
    (never below 0; 0 for a degree that issued none)::

        overhead[t] = max(0, residual[t] - residual[1]) / collectives[t]
    """
    if 1 not in residual_ms:
        raise ValueError("collective_overhead_ms needs the degree-1 residual (no collectives) as its reference")
    out: dict[int, float] = {}
    for degree, residual in residual_ms.items():
        count = collectives.get(degree, 0)
        if count < 0:
            raise ValueError(f"collectives[{degree}] must be >= 0, got {count}")
        out[degree] = max(0.0, residual - residual_ms[1]) / count if count else 0.0
    return out


def issue_ms_hiding(schedule: Schedule, ops: Sequence[Op], costs: OpCosts, link: LinkModel, ranks: int,
                    flat_ms: float, tolerance_ms: float = 1e-7) -> float:
    """The host time per collective among ``ranks`` that, spent on the compute lane as each is issued,
    makes :func:`simulate_step` of ``schedule`` as much longer as ``flat_ms`` per collective charged in
    full after it would (``flat_ms x`` the collectives among ``ranks``).

    Why: :func:`collective_overhead_ms` measures what a collective costs beyond the link and the
    compute as a share of a profiled step; added once per collective after the simulation, as if
    nothing could hide it, it over-prices link-bound plans.  Most of it is host time (gloo's threads
    and the emulator's exchange share the cores with compute), and host time spent while the compute
    lane would wait for the link anyway costs nothing: uniform TMP 4, a step that is almost all link,
    ran below a prediction that charged every one of its collectives in full.  So the overhead is
    placed where it happens, on the compute lane before the message leaves, and its size per
    collective is the one that reproduces the profiled step: the step the share was measured on.

    The step grows monotonically with the host time (max-plus), so a bisection finds it; under a
    blocking schedule, where nothing hides it, the answer is ``flat_ms``.
    """
    if flat_ms <= 0:
        return 0.0
    base = simulate_step(schedule, ops, costs, link)
    count = sum(1 for ins in schedule.instructions if isinstance(ins, StartAsync)
                and moves_bytes(ops[ins.op], ins.phase) and costs.comm_bytes.get(ins.op, 0)
                and costs.ranks.get(ins.op, costs.default_ranks) == ranks)
    if count == 0:
        raise ValueError(f"issue_ms_hiding: the schedule issues no collective among {ranks} ranks to carry "
                         f"{flat_ms:.3f} ms each")
    added_ms = flat_ms * count

    def added(host: float) -> float:
        return simulate_step(schedule, ops, costs, link, issue_ms={ranks: host}).step_ms - base.step_ms

    low, high = 0.0, (added_ms + base.exposed_comm_ms) / count  # at high, even hiding every wait leaves added_ms
    while high - low > tolerance_ms:
        middle = (low + high) / 2
        low, high = (middle, high) if added(middle) < added_ms else (low, middle)
    return high
