"""``oases-plan``: profile (or reuse) a layer's cost table, solve for per-block TMP degrees, write the plan.

``cost=analytic`` computes the table from FLOPs, the cluster's device and its
link instead (:mod:`oases_ds.planner.analytic`): paper-size models, no processes.

Prints the plan in the shape of the paper's Table II (runs of equal layers
collapsed), its predicted step time, the solver time, and the best uniform-degree
plan next to it -- the baseline a plan must beat.  Hydra lives here and in
``configs/``; the planner library takes typed objects.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from oases_ds.bench.provenance import git_commit, machine
from oases_ds.cli import schema
from oases_ds.cli.common import CONFIG_DIR, PLAN_PRESETS, fail, fail_launch, stop
from oases_ds.cli.schema import ClusterSchema, ModelSchema, ScheduleSchema
from oases_ds.launcher import LaunchError, LaunchInterrupted
from oases_ds.models.config import ModelConfig
from oases_ds.planner.accuracy import AccuracySpec, candidate_plans, measure, measure_with_profile, report
from oases_ds.planner.analytic import ACTIVATION_BYTES, DeviceModel, analytic_table, head_ms
from oases_ds.planner.costs import COST_MODEL_VERSION, CostTable
from oases_ds.planner.dp import solve_dp
from oases_ds.planner.ilp import solve
from oases_ds.planner.objective import predict_memory_bytes, predict_step_ms
from oases_ds.planner.plan import Plan, PlanInfeasibleError
from oases_ds.planner.pooled import kept_profile_path
from oases_ds.planner.memory import estimate_memory, memory_lines
from oases_ds.planner.profile import PROFILE_DTYPE_BYTES, ProfileSpec, cache_path, profile, profile_rows
from oases_ds.planner.replay import can_replay, rank_by_replay
from oases_ds.planner.stages import PipelineSpec, even_split, p2p_ms, plan_split, plan_stages
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.utils.io import write_json_atomic

COSTS = ("profile", "analytic")
"""Where the cost table comes from: measured on this machine, or computed for the cluster."""



# -- typed schema: Hydra converts or rejects every value by type before anything runs -------------
@dataclass
class PlannerSchema:
    cache_dir: str = ".oases/profiles"
    warmup: int = 2
    repeats: int = 5
    exposed: str = "model"
    solver: str = "dp"
    backend: str = "SCIP"
    time_limit_s: float = 60.0
    seed: int = 0
    min_degree: int = 1


@dataclass
class AccuracySchema:
    plans: int = 10
    warmup: int = 2
    repeats: int = 5
    seed: int = 0
    out: str = "benchmarks/results/planner_accuracy.json"
    interleave_profile: bool = False


@dataclass
class PlanSchema:
    """configs/plan.yaml, typed; the comments there say what each key means."""

    model: ModelSchema = field(default_factory=ModelSchema)
    schedule: ScheduleSchema = field(default_factory=ScheduleSchema)
    cluster: ClusterSchema = field(default_factory=ClusterSchema)
    planner: PlannerSchema = field(default_factory=PlannerSchema)
    accuracy: AccuracySchema = field(default_factory=AccuracySchema)
    study: Optional[str] = None
    mode: str = "plan"
    cost: str = "profile"
    devices: int = 2
    micro_batch: int = 8
    layers: Optional[int] = None
    memory_limit: Any = None  # bytes or a string such as 2GiB (parse_bytes)
    pipeline_stages: int = 1
    micro_batches: Optional[int] = None
    pipeline_link_gbps: Optional[float] = None
    table: Optional[str] = None
    out: str = "plan.json"
    timeout_s: float = 1800.0


ConfigStore.instance().store(name="plan_schema", node=PlanSchema)

RANGES: dict[str, float] = {"devices": 1, "micro_batch": 1, "planner.warmup": 0, "planner.repeats": 1,
                            "accuracy.plans": 1, "accuracy.warmup": 0, "accuracy.repeats": 1,
                            "pipeline_stages": 1, "planner.min_degree": 1}
"""Smallest value of each numeric key (``layers`` >= 1 when set; ``timeout_s`` and
``planner.time_limit_s`` must be > 0)."""


SOLVERS: tuple[str, ...] = ("dp", "ilp")
"""``planner.solver`` choices: ``dp`` the exact label DP (default: proven optimal and the
fastest, benchmarks/README.md), ``ilp`` the OR-Tools model (``planner.backend``)."""


def check_solver(cfg: dict) -> None:
    """Reject an unknown ``planner.solver`` before any profiling, which can take minutes."""
    if cfg["planner"]["solver"] not in SOLVERS:
        raise ValueError(f"planner.solver={cfg['planner']['solver']!r} unknown; choose one of {', '.join(SOLVERS)}")


def check_ranges(cfg: dict) -> None:
    schema.check_ranges(cfg, RANGES, positive=("timeout_s", "planner.time_limit_s"))
    if cfg["layers"] is not None and cfg["layers"] < 1:
        raise ValueError(f"layers must be >= 1, got {cfg['layers']}; leave it null to plan every layer")
    if cfg["micro_batches"] is not None and cfg["micro_batches"] < 1:
        raise ValueError(f"micro_batches must be >= 1, got {cfg['micro_batches']}; leave it null for 4 x pipeline_stages")
    if cfg["pipeline_link_gbps"] is not None and not cfg["pipeline_link_gbps"] > 0:
        raise ValueError(f"pipeline_link_gbps must be > 0, got {cfg['pipeline_link_gbps']}; "
                         f"leave it null for the cluster's link")
    if cfg["pipeline_stages"] > 1 and cfg["mode"] == "accuracy":
        raise ValueError("mode=accuracy measures plans of one TMP group; it takes pipeline_stages=1")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(field: str, value: Any) -> float | None:
    """``None``, a number of bytes, or a string such as ``"2GiB"`` / ``"300 MB"``."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}={value!r} is not a size; use bytes or e.g. 2GiB, 300MB")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number <= 0:
        raise ValueError(f"{field} must be > 0, got {value!r}")
    return number * _UNITS[unit]


def _device(cfg: dict) -> Any:
    """The cluster's device for ``cost=analytic``; one line naming what is missing."""

    cluster = cfg["cluster"]
    missing = [f"cluster.{key}" for key in ("link", "device") if not cluster.get(key)]
    if missing:
        raise ValueError(f"cost=analytic needs cluster.link and cluster.device; cluster={cluster['name']} has no "
                         f"{' and no '.join(missing)}: pick a cluster that states both (e.g. cluster=pcie_3090) "
                         f"or use cost=profile")
    try:
        return DeviceModel(**cluster["device"])
    except TypeError as err:
        raise ValueError(f"cluster.device: {err}; give name, peak_tflops and achieved_fraction") from None


def _analytic(cfg: dict) -> tuple[Any, str]:
    if cfg["planner"]["exposed"] != "model":
        raise ValueError(f"planner.exposed={cfg['planner']['exposed']!r} needs a measured timeline; "
                         f"cost=analytic models the exposed comm: use planner.exposed=model or cost=profile")
    device = _device(cfg)
    started = time.perf_counter()
    table = analytic_table(ProfileSpec.from_config(cfg), device, cfg["layers"] if cfg["layers"] is not None else cfg["model"]["num_layers"])
    link = cfg["cluster"]["link"]
    return table, (f"analytic: {device.name} at {device.peak_tflops:g} TFLOP/s x {device.achieved_fraction:g}, "
                   f"link {link['bandwidth_gbps']:g} Gbit/s + {link['latency_us']:g} us; "
                   f"computed in {(time.perf_counter() - started) * 1e3:.1f} ms, nothing launched")


def _load_table(cfg: dict) -> tuple[Any, str]:
    """The cost table and a line saying where it came from."""

    if cfg["cost"] not in COSTS:
        raise ValueError(f"cost={cfg['cost']!r} unknown; choose one of {', '.join(COSTS)}")
    if cfg["table"] and cfg["cost"] == "analytic":
        raise ValueError("table= and cost=analytic both supply the cost table; drop one of them")
    if cfg["cost"] == "analytic":
        return _analytic(cfg)
    if cfg["table"]:
        try:
            table = CostTable.from_json(cfg["table"])
        except OSError as err:
            raise ValueError(f"table={cfg['table']}: {err.strerror}; give a cost-table JSON written by oases-plan") from None
        except ValueError as err:
            raise ValueError(f"table={err}") from None
        if cfg["layers"] is not None:
            table = dataclasses.replace(table, layers=cfg["layers"])
        return table, f"from {cfg['table']}"
    spec = ProfileSpec.from_config(cfg)
    layers = cfg["layers"] if cfg["layers"] is not None else cfg["model"]["num_layers"]
    started = time.perf_counter()
    table, reused = profile(spec, layers, cfg["planner"]["cache_dir"], timeout_s=cfg["timeout_s"])
    where = cache_path(cfg["planner"]["cache_dir"], spec.key())
    if reused:
        return table, f"reused {where}"
    return table, f"profiled in {time.perf_counter() - started:.1f} s, saved {where}"


def _solve(table: Any, limit: float | None, planner: dict) -> Any:
    """The solver ``planner.solver`` names (checked by :func:`check_solver` at start-up)."""
    if planner["solver"] == "dp":
        return solve_dp(table, limit)
    return solve(table, limit, time_limit_s=planner["time_limit_s"], backend=planner["backend"])


def best_uniform(table: Any, limit: float | None,
                 replayed: list[tuple[Plan, float]] | None = None) -> tuple[int, float] | None:
    """(degree, predicted ms) of the fastest same-degree-everywhere plan that fits, or None;
    from ``replayed`` (:func:`~oases_ds.planner.replay.rank_by_replay` priced every uniform plan
    that fits, as the plan it is compared with) where given, else the additive objective."""

    if replayed is not None:
        options = [(ms, plan.attn_degrees[0]) for plan, ms in replayed if len(set(plan.block_degrees())) == 1]
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


def run(cfg: dict) -> None:
    check_ranges(cfg)
    check_solver(cfg)
    if cfg["mode"] not in ("plan", "profile", "accuracy"):
        raise ValueError(f"mode={cfg['mode']!r} unknown; choose plan, profile or accuracy")
    if cfg["mode"] == "accuracy" and cfg["cost"] == "analytic":
        raise ValueError("mode=accuracy measures plans on this machine against its profile; use cost=profile")
    limit = parse_bytes("memory_limit", cfg["memory_limit"])
    table, source = _load_table(cfg)
    print(f"oases-plan: {table.key()} | {table.layers} layers | {source}", flush=True)
    print("\n".join(profile_rows(table)))
    if cfg["mode"] == "profile":
        return
    if cfg["pipeline_stages"] > 1:
        plan = plan_pipeline(cfg, table, limit)
        plan.to_json(cfg["out"])
        print(f"wrote {cfg['out']}")
        return
    try:
        plan = _solve(table, limit, cfg["planner"])
    except PlanInfeasibleError as err:
        raise ValueError(f"memory_limit: {err}") from None
    priced = None
    if can_replay(table):  # the solvers search the additive costs; the replay picks among their plan and the uniform ones
        plan, priced = rank_by_replay(table, plan, limit)
        print(f"replayed steps (cost model {COST_MODEL_VERSION}), attn / mlp degrees: " + "; ".join(
            f"{_describe(p.attn_degrees)} / {_describe(p.mlp_degrees)} {ms:.3f} ms" for p, ms in priced))
    limit_text = "unbounded" if limit is None else f"limit {limit / 2**20:.3f} MiB"
    print(f"plan ({plan.solver_name}, solved in {plan.solver_ms:.1f} ms):")
    print("\n".join(f"  {row}" for row in plan.as_table().splitlines()))
    print(f"predicted step {plan.predicted_step_ms:.3f} ms | memory {plan.memory_bytes / 2**20:.3f} MiB per device ({limit_text})")
    if not cfg["table"]:  # a table= file's model is not the config's: only its bound is known
        print("\n".join(memory_lines(_plan_memory(cfg, table, plan))))
    uniform = best_uniform(table, limit, priced)
    if uniform is None:
        print("best uniform: none fits the memory limit")
    else:
        degree, ms = uniform
        print(f"best uniform: degree {degree} everywhere, {ms:.3f} ms (plan is {ms / plan.predicted_step_ms:.3f}x faster)")
    if cfg["mode"] == "accuracy":
        check_accuracy(cfg, table, plan)
        return
    plan.to_json(cfg["out"])
    print(f"wrote {cfg['out']}")


def _pipeline(cfg: dict, table: Any) -> PipelineSpec:
    """The pipeline the config describes: ``micro_batches`` (default 4 x stages, where 1F1B's
    bubble is (P - 1) / m < 1/4), p2p over ``pipeline_link_gbps`` (default the table's link),
    the head's time where the table is analytic (a profile has none: 0)."""
    stages = cfg["pipeline_stages"]
    micro_batches = cfg["micro_batches"] if cfg["micro_batches"] is not None else 4 * stages
    head = head_ms(ProfileSpec.from_config(cfg), _device(cfg)) if cfg["cost"] == "analytic" else 0.0
    return PipelineSpec(stages, micro_batches, p2p_ms(table, cfg["pipeline_link_gbps"]), head_ms=head)


def plan_pipeline(cfg: dict, table: Any, limit: float | None) -> Plan:
    """Split the layers into ``pipeline_stages`` stages with their degrees, print the split
    next to Megatron's even one, and return the plan to write."""
    pipeline = _pipeline(cfg, table)
    try:
        staged = plan_stages(table, pipeline, limit)
    except PlanInfeasibleError as err:
        raise ValueError(f"memory_limit: {err}") from None
    link = "the cluster's link" if cfg["pipeline_link_gbps"] is None else f"{cfg['pipeline_link_gbps']:g} Gbit/s"
    print(f"pipeline: {pipeline.stages} stages x TMP {table.devices}, {pipeline.micro_batches} micro-batches per step "
          f"(1F1B); p2p {pipeline.p2p_ms:.3f} ms per micro-batch one way over {link}; head "
          + (f"{pipeline.head_ms:.3f} ms (analytic)" if cfg["cost"] == "analytic" else "not in a profile (0)"))
    print(f"stage split ({staged.solver_name}, solved in {staged.solver_ms:.1f} ms):")
    print("\n".join(f"  {line}" for line in staged.as_lines()))
    times = [stage.step_ms for stage in staged.stages]
    print(f"predicted 1F1B step {staged.step_ms:.3f} ms = sum {sum(times):.3f} + ({pipeline.micro_batches} - 1) x "
          f"slowest {max(times):.3f} ms | peak {max(s.memory_bytes for s in staged.stages) / 2**20:.1f} MiB per device "
          f"({'unbounded' if limit is None else f'limit {limit / 2**20:.1f} MiB'}; the planner's bound)")
    even = even_split(table.layers, pipeline.stages)
    try:
        baseline = plan_split(table, pipeline, limit, even)
        print(f"even split {even}: {baseline.step_ms:.3f} ms (the split is {baseline.step_ms / staged.step_ms:.3f}x faster)")
    except PlanInfeasibleError as err:
        print(f"even split {even}: does not fit ({err})")
    return staged.to_plan(table)


def _plan_memory(cfg: dict, table: Any, plan: Any) -> Any:
    """The chosen plan's per-rank peak, replayed over its own operator sequence (the
    table's rows bound it; this is the number to compare with a device's memory)."""
    model = ModelConfig(**{**cfg["model"], "num_layers": table.layers})
    dtype = ACTIVATION_BYTES if cfg["cost"] == "analytic" else PROFILE_DTYPE_BYTES
    return estimate_memory(model, plan.attn_degrees, plan.mlp_degrees, plan.devices, cfg["micro_batch"],
                           ScheduleSpec.from_mapping(cfg["schedule"]), dtype)


def _describe(degrees: list[int]) -> str:
    return ",".join(str(d) for d in degrees)


def check_accuracy(cfg: dict, table: Any, solved: Any) -> None:
    """Measure >= ``accuracy.plans`` plans for real and rank-correlate with the cost model."""

    acc, link = cfg["accuracy"], cfg["cluster"].get("link")
    plans = candidate_plans(table, acc["plans"], [solved], seed=acc["seed"])
    spec = AccuracySpec.from_config(cfg, table.layers, table.devices, acc["warmup"], acc["repeats"])
    label = f"EMULATED link {link['bandwidth_gbps']} Gbit/s" if link else "no link emulation"
    print(f"measuring {len(plans)} plans x {spec.repeats} interleaved steps on {spec.devices} ranks ({label}) ...", flush=True)
    interleaved = None
    if acc["interleave_profile"]:
        if not can_replay(table):
            raise ValueError("accuracy.interleave_profile=true needs a profiled table (cost=profile, no table=); "
                             "set it false to score this table alone")
        times, interleaved = measure_with_profile(spec, plans, ProfileSpec.from_config(cfg), timeout_s=cfg["timeout_s"])
    else:
        times = measure(spec, plans, timeout_s=cfg["timeout_s"])
    result = report(table, plans, times)
    if interleaved is not None:
        result["interleaved"] = _interleaved_entry(cfg, interleaved, plans, times)
    for r in result["rows"]:
        r["is_solver_plan"] = r["attn"] == list(solved.attn_degrees) and r["mlp"] == list(solved.mlp_degrees)
    print(f"{'attn degrees':<16}{'mlp degrees':<16}{'predicted ms':>13}{'measured ms':>13}{'min-max':>18}")
    for r in result["rows"]:
        tag = "  <- solver's plan" if r["is_solver_plan"] else ""
        print(f"{_describe(r['attn']):<16}{_describe(r['mlp']):<16}{r['predicted_ms']:>13.2f}{r['measured_ms']:>13.2f}"
              f"{r['min_ms']:>9.1f}-{r['max_ms']:<8.1f}{tag}")
    uniform = [r for r in result["rows"] if len(set(r["attn"] + r["mlp"])) == 1]
    best = min(uniform, key=lambda r: r["measured_ms"])
    mine = next(r for r in result["rows"] if r["is_solver_plan"])
    print(f"Spearman rank correlation predicted vs measured: {result['spearman']:.3f} (p={result['p_value']:.3g}, "
          f"{len(plans)} plans; paper: 0.844 / 0.876)")
    print(f"measured: solver plan {mine['measured_ms']:.1f} ms vs best uniform (degree {best['attn'][0]}) "
          f"{best['measured_ms']:.1f} ms -> {best['measured_ms'] / mine['measured_ms']:.3f}x")
    if interleaved is not None:
        entry = result["interleaved"]
        print(f"with the profile interleaved in the same rounds ({entry['table']}): Spearman {entry['spearman']:.3f}"
              + (f", mixes only {entry['spearman_mixed']:.3f}" if entry["spearman_mixed"] is not None else ""))
    result.update({"emulated_link": bool(link), "link": link, "table_key": table.key(), "config": cfg,
                   "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "git_commit": git_commit(), "machine": machine()})
    write_json_atomic(acc["out"], result)
    print(f"wrote {acc['out']}")


def _interleaved_entry(cfg: dict, table: CostTable, plans: list, times: list) -> dict:
    """Keep the interleaved profile beside the result (``profiles/interleaved/<key>-<profiled at>.json``,
    where ``--pooled`` finds it) and score the same measured steps with it."""
    out = Path(cfg["accuracy"]["out"])
    path = kept_profile_path(out.parent, "interleaved", table)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_json(path)
    scored = report(table, plans, times)
    return {"table": os.path.relpath(path, out.parent), "table_key": table.key(), "profiled_at": table.measurements.get("profiled_at"),
            **{k: scored[k] for k in ("spearman", "spearman_mixed", "spearman_additive", "spearman_additive_mixed")}}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="plan")
def main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_container(dcfg, resolve=True, throw_on_missing=True)
    try:
        run(cfg)
    except (ValueError, OSError) as err:
        fail(str(err))
    except LaunchInterrupted as err:
        stop(err)
    except LaunchError as err:  # a failed profiling launch: one line, the traceback in Hydra's run dir
        fail_launch(err, HydraConfig.get().runtime.output_dir)


def precheck(args: list[str]) -> None:
    """Refuse a bad command line in one line before Hydra runs (and before any profiling)."""
    schema.check_experiment(args, PLAN_PRESETS, "oases-plan",
                            lambda name: f"experiment={name} is an oases-bench study: run `oases-bench --multirun "
                                         f"experiment={name}`; oases-plan takes {', '.join(PLAN_PRESETS)}")
    schema.precheck("plan", PlanSchema, args, check_ranges)


def entry() -> None:
    precheck(sys.argv[1:])
    main()


if __name__ == "__main__":
    entry()
