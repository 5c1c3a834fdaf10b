"""The planner's front door: a typed request in, the chosen plan and what it was chosen against out.

One pipeline, in this order::

    cost table   profiled on this machine (cached), read from a file, or computed (cost=analytic)
      -> solver  the label DP (default, proven optimal) or the ILP search the additive node + edge costs
      -> replay  the solver's plan and every uniform plan that fits, each replayed over the table's
                 per-op profile (:func:`~oases_ds.planner.replay.rank_by_replay`); the fastest is kept
      -> memory  the chosen plan's per-rank peak, replayed over its own operator sequence

or, with pipeline stages, the 1F1B stage split and each stage's degrees
(:func:`~oases_ds.planner.stages.plan_stages`) with Megatron's even split beside it.  Why one function:
``oases-plan`` and any script that plans (a sweep, a notebook) then make the same plan from the same
request; the CLI only builds the request from its config and prints the result.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

from oases_ds.planner.analytic import ACTIVATION_BYTES, DeviceModel, analytic_table, head_ms
from oases_ds.planner.costs import COST_MODEL_VERSION, CostTable, ModelStates
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.memory import MemoryEstimate, estimate_memory, memory_lines, with_model_states
from oases_ds.planner.objective import predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError
from oases_ds.planner.policies import RECOMPUTE_CHOICES, with_store_costs
from oases_ds.planner.profile import PROFILE_DTYPE_BYTES, ProfileSpec, cache_path, profile
from oases_ds.planner.replay import can_replay, rank_by_replay
from oases_ds.planner.stages import PipelineSpec, StagePlan, even_split, p2p_ms, plan_split, plan_stages
from oases_ds.utils.io import read_json_input

COSTS: tuple[str, ...] = ("profile", "analytic")
"""Where the cost table comes from: measured on this machine, or computed for the cluster."""

SOLVERS: tuple[str, ...] = ("dp", "ilp")
"""``dp`` the exact label DP (the default: proven optimal and the fastest), ``ilp`` the OR-Tools model."""


@dataclass(frozen=True)
class PipelineRequest:
    """Pipeline stages to plan: ``stages`` contiguous stages (1: none, one TMP group), 1F1B over
    ``micro_batches`` (default ``4 x stages``, where the bubble (P - 1) / m stays under 1/4), stage
    messages over a link of ``link_gbps`` (default the table's own link)."""

    stages: int
    micro_batches: int | None = None
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline_stages must be >= 1, got {self.stages}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}; leave it null for 4 x pipeline_stages")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"pipeline_link_gbps must be > 0, got {self.link_gbps}; leave it null for the cluster's link")


def check_source(cost: str, table_path: str | None) -> None:
    """Refuse an unknown ``cost`` or two sources of one table, before anything is built or profiled."""
    if cost not in COSTS:
        raise ValueError(f"cost={cost!r} unknown; choose one of {', '.join(COSTS)}")
    if table_path and cost == "analytic":
        raise ValueError("table= and cost=analytic both supply the cost table; drop one of them")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for and how.

    Attributes:
        profile: the workload (model, TMP devices, micro-batch, schedule, link, cluster label) and the
            profiler's settings; ``None`` only when ``table_path`` gives the table.
        cost: ``"profile"`` (measure the layer here, or reuse the cache) or ``"analytic"`` (FLOPs on
            ``device``, collectives on ``profile.link``; launches nothing).
        table_path: a cost-table file to plan from instead (``table=``).
        device: the cluster's device, for ``cost="analytic"``.
        layers: transformer layers to plan (default ``profile.model.num_layers``; with ``table_path``,
            the file's own unless given).
        cache_dir: the profile cache (``None``: profile every time, keep nothing).
        timeout_s: how long profiling may take.
        solver / backend / time_limit_s: the solver (:data:`SOLVERS`) and, for the ILP, OR-Tools'.
        memory_limit_bytes: per-device bound (``None``: unbounded).
        pipeline: pipeline stages to plan (``None`` or one stage: one TMP group).
        recompute: ``oases`` (every block recomputed, the paper's schedule) or ``auto`` (the solver
            chooses each block's policy, ``store`` or ``oases``, with its degree: what the memory
            limit leaves room to store is stored; :mod:`oases_ds.planner.policies`).
        model_states: precision, ZeRO stage, offload and DP size the model states are priced at
            (:meth:`ModelStates.bytes_per_param`); the default is what every table is priced at.
    """

    profile: ProfileSpec | None
    cost: Literal["profile", "analytic"] = "profile"
    table_path: str | None = None
    device: DeviceModel | None = None
    layers: int | None = None
    cache_dir: str | None = ".oases/profiles"
    timeout_s: float = 1800.0
    solver: str = "dp"
    backend: str = "SCIP"
    time_limit_s: float = 60.0
    memory_limit_bytes: float | None = None
    pipeline: PipelineRequest | None = None
    recompute: str = "oases"
    model_states: ModelStates = ModelStates()

    def __post_init__(self) -> None:
        check_source(self.cost, self.table_path)
        if self.table_path and self.model_states != ModelStates():
            raise ValueError(f"table={self.table_path} with zero_stage / offload / precision / data_parallel_size set: "
                             "re-pricing model states needs the model; plan from the model (drop table=)")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"planner.recompute={self.recompute!r} unknown; choose one of {', '.join(RECOMPUTE_CHOICES)}")
        if self.solver not in SOLVERS:
            raise ValueError(f"planner.solver={self.solver!r} unknown; choose one of {', '.join(SOLVERS)}")
        if self.profile is None and not self.table_path:
            raise ValueError("a plan needs a workload (PlanRequest.profile) or a cost-table file (table_path)")
        if self.cost == "analytic" and self.profile is not None:
            if self.profile.exposed != "model":
                raise ValueError(f"planner.exposed={self.profile.exposed!r} needs a measured timeline; cost=analytic "
                                 f"models the exposed comm: use planner.exposed=model or cost=profile")
            if self.device is None or self.profile.link is None:
                raise ValueError("cost=analytic needs the cluster's link and device")

    def layer_count(self) -> int:
        """The layers a profiled or analytic table is labelled for."""
        assert self.profile is not None
        return self.layers if self.layers is not None else self.profile.model.num_layers


@dataclass(frozen=True)
class LoadedTable:
    """A cost table and one line saying where it came from (for the user: reused, profiled, computed)."""

    table: CostTable
    source: str


@dataclass(frozen=True)
class StagesResult:
    """A pipeline's stage split, the pipeline it was planned for, and Megatron's even split beside it
    (``even_plan`` ``None`` with the reason in ``even_error`` when that split does not fit)."""

    pipeline: PipelineSpec
    staged: StagePlan
    even: list[int]
    even_plan: StagePlan | None
    even_error: str | None


@dataclass(frozen=True)
class PlanResult:
    """What :func:`make_plan` chose and what it was chosen against.

    Attributes:
        loaded: the cost table and where it came from.
        plan: the plan to train with (with stages: all stages' layers, ``stage_layers`` set).
        replayed: every plan the replay priced, fastest first (``None``: the table has no per-op
            profile, so the additive objective priced the plan).
        best_uniform: (degree, predicted ms) of the fastest same-degree plan that fits, or ``None``.
        memory: the chosen plan's per-rank peak, replayed (``None`` for a table file, whose model the
            request does not describe, and for stages).
        stages: the stage split (``None`` without stages).
    """

    loaded: LoadedTable
    plan: Plan
    replayed: list[tuple[Plan, float]] | None = None
    best_uniform: tuple[int, float] | None = None
    memory: MemoryEstimate | None = None
    stages: StagesResult | None = None


def load_table(request: PlanRequest) -> LoadedTable:
    """The cost table the request names: read from ``table_path``, computed (``cost="analytic"``), or
    profiled (reused from ``cache_dir`` when a table of the same key is there); with
    ``recompute="auto"``, with its ``store`` costs (:func:`~oases_ds.planner.policies.with_store_costs`)."""
    loaded = _load_oases_table(request)
    if request.recompute != "auto" or loaded.table.store_blocks:
        return _priced_states(request, loaded)
    if request.profile is None:
        raise ValueError(f"planner.recompute=auto: the table {request.table_path} prices no policy store and "
                         f"table= describes no model to derive it for; plan from the model (drop table=) or "
                         f"with planner.recompute=oases")
    spec = request.profile
    dtype = ACTIVATION_BYTES if request.cost == "analytic" else PROFILE_DTYPE_BYTES
    table = with_store_costs(loaded.table, spec.model, spec.micro_batch, dtype)
    priced = "policies store and oases_gathered" if table.sequence_parallel else "policy store"
    return _priced_states(request, LoadedTable(table, f"{loaded.source}; {priced} priced from it"))


def _priced_states(request: PlanRequest, loaded: LoadedTable) -> LoadedTable:
    """``loaded`` with its model states at ``request.model_states`` (unchanged at the default)."""
    if request.model_states == ModelStates():
        return loaded
    assert request.profile is not None  # PlanRequest refuses table= with other states
    table = with_model_states(loaded.table, request.model_states, request.profile.model)
    return LoadedTable(table, f"{loaded.source}; states {request.model_states.label()}")


def _load_oases_table(request: PlanRequest) -> LoadedTable:
    if request.table_path:
        table = read_json_input("table", request.table_path, CostTable.from_json,
                                "give a cost-table JSON written by oases-plan")
        if request.layers is not None:
            table = dataclasses.replace(table, layers=request.layers)
        return LoadedTable(table, f"from {request.table_path}")
    spec = request.profile
    assert spec is not None  # PlanRequest checks it
    started = time.perf_counter()
    if request.cost == "analytic":
        assert request.device is not None and spec.link is not None
        device, link = request.device, spec.link
        table = analytic_table(spec, device, request.layer_count())
        return LoadedTable(table, f"analytic: {device.name} at {device.peak_tflops:g} TFLOP/s x {device.achieved_fraction:g}, "
                                  f"link {link.bandwidth_gbps:g} Gbit/s + {link.latency_us:g} us; computed in "
                                  f"{(time.perf_counter() - started) * 1e3:.1f} ms, nothing launched")
    table, reused = profile(spec, request.layer_count(), request.cache_dir, timeout_s=request.timeout_s)
    if request.cache_dir is None:
        return LoadedTable(table, f"profiled in {time.perf_counter() - started:.1f} s, not cached")
    where = cache_path(request.cache_dir, spec.key())
    return LoadedTable(table, f"reused {where}" if reused else f"profiled in {time.perf_counter() - started:.1f} s, saved {where}")


def solve(table: CostTable, request: PlanRequest) -> Plan:
    """The request's solver on ``table`` (raises :class:`PlanInfeasibleError` when nothing fits)."""
    if request.solver == "dp":
        return solve_dp(table, request.memory_limit_bytes)
    from oases_ds.planner.ilp import solve as solve_ilp  # OR-Tools loads only when the ILP is asked for

    return solve_ilp(table, request.memory_limit_bytes, time_limit_s=request.time_limit_s, backend=request.backend)


def best_uniform(table: CostTable, limit: float | None,
                 replayed: list[tuple[Plan, float]] | None = None) -> tuple[int, float] | None:
    """(degree, predicted ms) of the fastest same-degree-everywhere plan that fits, or None;
    from ``replayed`` (:func:`~oases_ds.planner.replay.rank_by_replay` priced every uniform plan
    that fits, as the plan it is compared with) where given, else the additive objective."""
    if replayed is not None:  # the paper's baseline: one degree, every block recomputed
        options = [(ms, plan.attn_degrees[0]) for plan, ms in replayed
                   if len(set(plan.block_degrees())) == 1 and not plan.stored_blocks()]
    else:
        options = []
        for degree in table.degrees:
            plan = Plan.uniform(table.devices, table.layers, degree)
            if limit is None or predict_memory_bytes(table, plan) <= limit:
                options.append((predict_step_ms(table, plan), degree))
    if not options:
        return None
    ms, degree = min(options)
    return degree, ms


def make_plan(request: PlanRequest, loaded: LoadedTable | None = None) -> PlanResult:
    """Plan as the module doc says, from ``loaded`` where the caller has the table already
    (:func:`load_table`), else loading it.  Raises :class:`PlanInfeasibleError` when no plan fits
    the memory limit."""
    loaded = loaded if loaded is not None else load_table(request)
    table, limit = loaded.table, request.memory_limit_bytes
    if request.pipeline is not None and request.pipeline.stages > 1:
        stages = _plan_stages(request, table)
        return PlanResult(loaded, stages.staged.to_plan(table), stages=stages)
    plan = solve(table, request)
    replayed = None
    if can_replay(table):  # the solvers search the additive costs; the replay picks among their plan and the uniform ones
        plan, replayed = rank_by_replay(table, plan, limit)
    memory = None
    if not request.table_path and request.profile is not None:  # a table file's model is not the request's
        spec = request.profile
        dtype = ACTIVATION_BYTES if request.cost == "analytic" else PROFILE_DTYPE_BYTES
        schedule = dataclasses.replace(spec.schedule, stored_blocks=plan.stored_blocks(),
                                       gathered_blocks=plan.gathered_blocks(), hop_costs=plan.hop_costs)
        memory = estimate_memory(dataclasses.replace(spec.model, num_layers=table.layers), plan.attn_degrees,
                                 plan.mlp_degrees, plan.devices, spec.micro_batch, schedule, dtype, table.sequence_parallel,
                                 request.model_states.bytes_per_param())
    return PlanResult(loaded, plan, replayed, best_uniform(table, limit, replayed), memory)


@dataclass(frozen=True)
class SubBatchChoice:
    """What :func:`choose_sub_batches` chose and what it was chosen against.

    Attributes:
        result: the plan at the chosen ``k`` (its :attr:`Plan.sub_batches` set) and its table.
        tried: per candidate ``k``, the plan's predicted step in ms, or the one line why none was made
            (the micro-batch has no whole sub-batches, nothing fits the memory limit).
    """

    result: PlanResult
    tried: tuple[tuple[int, float | str], ...]

    def line(self) -> str:
        """``sub-batches: 2 -> 1234.5 ms; 4 -> 1300.1 ms; chose 2``."""
        cells = [f"{k} -> {ms:.3f} ms" if isinstance(ms, float) else f"{k} -> none ({ms})" for k, ms in self.tried]
        return f"sub-batches: {'; '.join(cells)}; chose {self.result.plan.sub_batches}"


def at_sub_batches(request: PlanRequest, sub_batches: int) -> PlanRequest:
    """``request`` with its schedule split into ``sub_batches`` sub-batches (a table of its own)."""
    assert request.profile is not None
    schedule = dataclasses.replace(request.profile.schedule, sub_batches=sub_batches)
    return dataclasses.replace(request, profile=dataclasses.replace(request.profile, schedule=schedule))


def choose_sub_batches(request: PlanRequest, candidates: tuple[int, ...]) -> SubBatchChoice:
    """Plan at each candidate number of sub-batches and keep the plan with the fastest predicted step.

    Why per plan: more sub-batches hide more of the first and last collective of each pass
    (the exposed-phases study), but each sub-batch is a smaller product, less dense work (on
    2 CPU cores 4 sub-batches of one 256-token sample computed 1.10x longer than 2); which wins depends on
    the model, the micro-batch and the link.  Each ``k`` is its own cost table (profiled at ``k``, so the
    density is measured; :func:`load_table`) and its replay runs the schedule at ``k``.  The analytic
    table has no density term and so always prefers the most sub-batches: ``oases-plan`` refuses it with
    several candidates.  A ``k`` the micro-batch cannot split, or at which nothing fits, is reported, not
    chosen; none left is a :class:`PlanInfeasibleError`.
    """
    if request.profile is None or request.table_path:
        raise ValueError("planner.sub_batches: a cost-table file holds one sub-batch count; plan from the model "
                         "(drop table=) or leave planner.sub_batches unset")
    if request.pipeline is not None and request.pipeline.stages > 1:
        raise ValueError("planner.sub_batches chooses among plans of one TMP group; with pipeline_stages > 1 set "
                         "schedule.sub_batches instead")
    if not candidates or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in candidates):
        raise ValueError(f"planner.sub_batches must list sub-batch counts >= 1, got {list(candidates)}")
    tried: list[tuple[int, float | str]] = []
    best: PlanResult | None = None
    unsplit = 0
    for k in sorted(set(candidates)):
        try:
            at_k = at_sub_batches(request, k)
        except ValueError as err:  # the micro-batch has no k whole sub-batches: ProfileSpec names the fix
            tried.append((k, str(err)))
            unsplit += 1
            continue
        try:
            result = make_plan(at_k)
        except PlanInfeasibleError as err:
            tried.append((k, f"nothing fits: {err}"))
            continue
        ms = result.plan.predicted_step_ms
        assert ms is not None
        tried.append((k, float(ms)))
        if best is None or ms < best.plan.predicted_step_ms:  # type: ignore[operator]
            best = dataclasses.replace(result, plan=dataclasses.replace(result.plan, sub_batches=k))
    if best is None:
        reasons = "; ".join(f"{k}: {why}" for k, why in tried)
        if unsplit == len(tried):
            raise ValueError(f"planner.sub_batches={sorted(set(candidates))}: the micro-batch splits into none of them: "
                             f"{reasons}")
        raise PlanInfeasibleError(f"no candidate of planner.sub_batches gives a plan that fits: {reasons}")
    return SubBatchChoice(best, tuple(tried))


def _plan_stages(request: PlanRequest, table: CostTable) -> StagesResult:
    """The stage split and the even split beside it; the head's time only where the table is
    analytic (a profile has none: 0)."""
    wanted = request.pipeline
    assert wanted is not None
    micro_batches = wanted.micro_batches if wanted.micro_batches is not None else 4 * wanted.stages
    head = 0.0
    if request.cost == "analytic" and request.profile is not None and request.device is not None:
        head = head_ms(request.profile, request.device)
    pipeline = PipelineSpec(wanted.stages, micro_batches, p2p_ms(table, wanted.link_gbps), head_ms=head)
    staged = plan_stages(table, pipeline, request.memory_limit_bytes)
    even = even_split(table.layers, pipeline.stages)
    try:
        return StagesResult(pipeline, staged, even, plan_split(table, pipeline, request.memory_limit_bytes, even), None)
    except PlanInfeasibleError as err:
        return StagesResult(pipeline, staged, even, None, str(err))


# -- the result as text ---------------------------------------------------------------
def _limit_text(limit: float | None, digits: int) -> str:
    return "unbounded" if limit is None else f"limit {limit / 2**20:.{digits}f} MiB"


POLICY_MARKS = {"oases": "", "store": "s", "oases_gathered": "g"}
"""How a block's policy shows after its degree in ``oases-plan``'s lines (``2s``: stored; ``8g``: keeps its
gathered input under sequence parallelism)."""


def _describe(degrees: Any, policies: Any = None) -> str:
    """Degrees as ``2,4,2``; a stored block's with ``s`` (``2s``), a gathered one's with ``g``."""
    policies = policies if policies is not None else ["oases"] * len(degrees)
    return ",".join(f"{d}{POLICY_MARKS[p]}" for d, p in zip(degrees, policies))


def _blocks(plan: Plan) -> str:
    policies = plan.block_policies()
    return f"{_describe(plan.attn_degrees, policies[0::2])} / {_describe(plan.mlp_degrees, policies[1::2])}"


def result_lines(result: PlanResult, request: PlanRequest) -> list[str]:
    """What ``oases-plan`` prints of a result: :func:`plan_lines`, or :func:`stage_lines` with stages."""
    return stage_lines(result, request) if result.stages is not None else plan_lines(result, request)


def plan_lines(result: PlanResult, request: PlanRequest) -> list[str]:
    """The replayed candidates, the plan as the paper's Table II, its step and memory, the best uniform plan."""
    plan, lines = result.plan, []
    if result.replayed is not None:
        stored = " (s: block stored)" if any(p.stored_blocks() for p, _ in result.replayed) else ""
        if any(p.gathered_blocks() for p, _ in result.replayed):
            stored = stored[:-1] + ", g: gathered input kept)" if stored else " (g: gathered input kept)"
        lines.append(f"replayed steps (cost model {COST_MODEL_VERSION}), attn / mlp degrees{stored}: " + "; ".join(
            f"{_blocks(p)} {ms:.3f} ms" for p, ms in result.replayed))
    limit = request.memory_limit_bytes
    unused = "" if limit is None else f", {(limit - plan.memory_bytes) / 2**20:.3f} MiB of it unused"
    lines += [f"plan ({plan.solver_name}, solved in {plan.solver_ms:.1f} ms):",
              *(f"  {row}" for row in plan.as_table().splitlines()),
              f"predicted step {plan.predicted_step_ms:.3f} ms | memory {plan.memory_bytes / 2**20:.3f} MiB per device "
              f"({_limit_text(limit, 3)}{unused})"]
    if plan.hop_costs is not None:
        lines.append("sequence parallelism: the plan carries its per-op times (hop_costs); a run with it orders the "
                     "sub-batches' collectives by them, as this step was priced (overlap_micro_batches keeps the "
                     "time-blind order)")
    if result.memory is not None:
        lines += memory_lines(result.memory)
    if result.best_uniform is None:
        return lines + ["best uniform: none fits the memory limit"]
    degree, ms = result.best_uniform
    return lines + [f"best uniform: degree {degree} everywhere, {ms:.3f} ms (plan is {ms / plan.predicted_step_ms:.3f}x faster)"]


def stage_lines(result: PlanResult, request: PlanRequest) -> list[str]:
    """The pipeline, each stage (layers, ms per micro-batch, peak, degrees), the 1F1B step, Megatron's even split."""
    stages = result.stages
    assert stages is not None and request.pipeline is not None
    pipeline, staged, link_gbps = stages.pipeline, stages.staged, request.pipeline.link_gbps
    link = "the cluster's link" if link_gbps is None else f"{link_gbps:g} Gbit/s"
    head = f"{pipeline.head_ms:.3f} ms (analytic)" if request.cost == "analytic" else "not in a profile (0)"
    times = [stage.step_ms for stage in staged.stages]
    lines = [f"pipeline: {pipeline.stages} stages x TMP {result.loaded.table.devices}, {pipeline.micro_batches} micro-batches "
             f"per step (1F1B); p2p {pipeline.p2p_ms:.3f} ms per micro-batch one way over {link}; head {head}",
             f"stage split ({staged.solver_name}, solved in {staged.solver_ms:.1f} ms):",
             *(f"  {line}" for line in staged.as_lines()),
             f"predicted 1F1B step {staged.step_ms:.3f} ms = sum {sum(times):.3f} + ({pipeline.micro_batches} - 1) x "
             f"slowest {max(times):.3f} ms | peak {max(s.memory_bytes for s in staged.stages) / 2**20:.1f} MiB per device "
             f"({_limit_text(request.memory_limit_bytes, 1)}; the planner's bound)"]
    if stages.even_plan is None:
        return lines + [f"even split {stages.even}: does not fit ({stages.even_error})"]
    return lines + [f"even split {stages.even}: {stages.even_plan.step_ms:.3f} ms "
                    f"(the split is {stages.even_plan.step_ms / staged.step_ms:.3f}x faster)"]
