"""``oases-plan``: build a :class:`~oases_ds.planner.planning.PlanRequest` from the config, plan, print, write.

The planning itself is :func:`oases_ds.planner.make_plan` (table -> solver -> replay -> memory, or
stages).  This module prints the plan in the shape of the paper's Table II (runs of equal layers
collapsed), its predicted step, the solver time, and the best uniform-degree plan beside it -- the
baseline a plan must beat; ``mode=accuracy`` measures plans for real (:mod:`oases_ds.planner.accuracy`).
Hydra lives here and in ``configs/``; the planner library takes typed objects.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from oases_ds.bench.cost_model import kept_profile_path
from oases_ds.bench.provenance import git_commit, machine
from oases_ds.cli import schema
from oases_ds.cli.common import CONFIG_DIR, PLAN_PRESETS, fail, fail_launch, stop
from oases_ds.cli.schema import ClusterSchema, ModelSchema, ScheduleSchema, parse_bytes
from oases_ds.launcher import LaunchError, LaunchInterrupted
from oases_ds.planner.accuracy import AccuracySpec, candidate_plans, check_lines, check_plans
from oases_ds.planner.analytic import DeviceModel
from oases_ds.planner.costs import ModelStates
from oases_ds.planner.plan import PlanInfeasibleError
from oases_ds.planner.planning import (SOLVERS, LoadedTable, PipelineRequest, PlanRequest, PlanResult, check_source,
                                       choose_sub_batches, load_table, make_plan, result_lines)
from oases_ds.planner.profile import ProfileSpec, profile_rows
from oases_ds.utils.io import write_json_atomic


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
    recompute: str = "oases"
    sub_batches: Optional[List[int]] = None


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
    """configs/plan.yaml, typed: Hydra converts or rejects every value by type before anything runs;
    the comments there say what each key means."""

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
    sequence_parallel: bool = False
    precision: str = "bf16"
    zero_stage: int = 0
    offload: bool = False
    data_parallel_size: int = 1
    table: Optional[str] = None
    out: str = "plan.json"
    timeout_s: float = 1800.0


ConfigStore.instance().store(name="plan_schema", node=PlanSchema)

RANGES: dict[str, float] = {"devices": 1, "micro_batch": 1, "planner.warmup": 0, "planner.repeats": 1,
                            "accuracy.plans": 1, "accuracy.warmup": 0, "accuracy.repeats": 1,
                            "pipeline_stages": 1, "planner.min_degree": 1}
"""Smallest value of each numeric key (``layers`` >= 1 when set; ``timeout_s`` and
``planner.time_limit_s`` must be > 0)."""


def check_solver(cfg: dict) -> None:
    """Reject an unknown ``planner.solver`` before any profiling, which can take minutes."""
    if cfg["planner"]["solver"] not in SOLVERS:
        raise ValueError(f"planner.solver={cfg['planner']['solver']!r} unknown; choose one of {', '.join(SOLVERS)}")


def check_ranges(cfg: dict) -> None:
    schema.check_ranges(cfg, RANGES, positive=("timeout_s", "planner.time_limit_s"))
    if cfg["layers"] is not None and cfg["layers"] < 1:
        raise ValueError(f"layers must be >= 1, got {cfg['layers']}; leave it null to plan every layer")
    PipelineRequest(cfg["pipeline_stages"], cfg["micro_batches"], cfg["pipeline_link_gbps"])
    if cfg["pipeline_stages"] > 1 and cfg["mode"] == "accuracy":
        raise ValueError("mode=accuracy measures plans of one TMP group; it takes pipeline_stages=1")


def request_of(cfg: dict) -> PlanRequest:
    """The typed request a config describes (the workload only where no ``table=`` file gives the table)."""
    check_source(cfg["cost"], cfg["table"])
    analytic, planner = cfg["cost"] == "analytic", cfg["planner"]
    device = DeviceModel.from_cluster(cfg["cluster"]) if analytic and planner["exposed"] == "model" else None
    stages = cfg["pipeline_stages"]
    return PlanRequest(
        profile=None if cfg["table"] else ProfileSpec.from_config(cfg), cost=cfg["cost"], table_path=cfg["table"],
        device=device, layers=cfg["layers"], cache_dir=planner["cache_dir"], timeout_s=cfg["timeout_s"],
        solver=planner["solver"], backend=planner["backend"], time_limit_s=planner["time_limit_s"],
        memory_limit_bytes=parse_bytes("memory_limit", cfg["memory_limit"]),
        pipeline=PipelineRequest(stages, cfg["micro_batches"], cfg["pipeline_link_gbps"]) if stages > 1 else None,
        recompute=planner["recompute"],
        model_states=ModelStates(cfg["precision"], cfg["zero_stage"], cfg["offload"], cfg["data_parallel_size"]))


def check_sub_batch_candidates(cfg: dict) -> tuple[int, ...]:
    """``planner.sub_batches`` as candidates (empty: the schedule's own), refused in one line where no
    choice among them can be made: with another mode, or analytic costs, which price no density loss
    and would always take the most sub-batches."""
    candidates = tuple(cfg["planner"].get("sub_batches") or ())
    if not candidates:
        return ()
    if cfg["mode"] != "plan":
        raise ValueError(f"planner.sub_batches chooses a plan's sub-batches (mode=plan), not with mode={cfg['mode']}; "
                         f"set schedule.sub_batches instead")
    if cfg["cost"] == "analytic" and len(set(candidates)) > 1:
        raise ValueError("planner.sub_batches with cost=analytic: the analytic model has no arithmetic-density term "
                         "and always prefers more sub-batches; profile the candidates (cost=profile) or give one")
    return candidates


def run(cfg: dict) -> None:
    check_ranges(cfg)
    check_solver(cfg)
    if cfg["mode"] not in ("plan", "profile", "accuracy"):
        raise ValueError(f"mode={cfg['mode']!r} unknown; choose plan, profile or accuracy")
    if cfg["mode"] == "accuracy" and cfg["cost"] == "analytic":
        raise ValueError("mode=accuracy measures plans on this machine against its profile; use cost=profile")
    candidates = check_sub_batch_candidates(cfg)
    if candidates:
        request = request_of(cfg)
        try:
            choice = choose_sub_batches(request, candidates)
        except PlanInfeasibleError as err:
            raise ValueError(f"memory_limit: {err}") from None
        result = choice.result
        print(f"oases-plan: {result.loaded.table.key()} | {result.loaded.table.layers} layers | {result.loaded.source}")
        print(choice.line())
        print("\n".join(result_lines(result, request)))
        result.plan.to_json(cfg["out"])
        print(f"wrote {cfg['out']}")
        return
    request = request_of(cfg)
    loaded = load_table(request)
    print(f"oases-plan: {loaded.table.key()} | {loaded.table.layers} layers | {loaded.source}", flush=True)
    print("\n".join(profile_rows(loaded.table)))
    if cfg["mode"] == "profile":
        return
    try:
        result = make_plan(request, loaded)
    except PlanInfeasibleError as err:
        raise ValueError(f"memory_limit: {err}") from None
    print("\n".join(result_lines(result, request)))
    if cfg["mode"] == "accuracy":
        check_accuracy(cfg, loaded, result)
        return
    result.plan.to_json(cfg["out"])
    print(f"wrote {cfg['out']}")


def check_accuracy(cfg: dict, loaded: LoadedTable, solved: PlanResult) -> None:
    """Measure >= ``accuracy.plans`` plans for real, rank-correlate with the cost model, write the result."""
    acc, link, table = cfg["accuracy"], cfg["cluster"].get("link"), loaded.table
    plans = candidate_plans(table, acc["plans"], [solved.plan], seed=acc["seed"])
    spec = AccuracySpec.from_config(cfg, table.layers, table.devices, acc["warmup"], acc["repeats"])
    label = f"EMULATED link {link['bandwidth_gbps']} Gbit/s" if link else "no link emulation"
    print(f"measuring {len(plans)} plans x {spec.repeats} interleaved steps on {spec.devices} ranks ({label}) ...", flush=True)
    checked = check_plans(table, solved.plan, plans, spec, ProfileSpec.from_config(cfg) if acc["interleave_profile"] else None,
                          timeout_s=cfg["timeout_s"])
    result, out = checked.result, Path(acc["out"])
    if checked.interleaved is not None:  # kept beside the result, where the cost-model study finds it
        path = kept_profile_path(out.parent, "interleaved", checked.interleaved)
        path.parent.mkdir(parents=True, exist_ok=True)
        checked.interleaved.to_json(path)
        result["interleaved"] = {"table": os.path.relpath(path, out.parent), **result["interleaved"]}
    print("\n".join(check_lines(checked)))
    result.update({"emulated_link": bool(link), "link": link, "table_key": table.key(), "config": cfg,
                   "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "git_commit": git_commit(), "machine": machine()})
    write_json_atomic(out, result)
    print(f"wrote {acc['out']}")


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
