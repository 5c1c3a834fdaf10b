"""Measured recompute-aware planning: planned vs uniform ``oases`` vs ``none`` at three memory limits.

One TMP group of two gloo ranks on this machine, collectives paced by the in-process link emulator
(``LinkModel(sharing="ring")``, so every row is EMULATED).  In order:

1. the planner's profile of one layer (``planner.recompute=auto``: the ``store`` costs come from it);
2. one launch measuring the per-rank peak (``ActivationProbe`` activations + 16 bytes per held
   parameter, as :mod:`oases_ds.bench.memory` counts them) of the uniform degree-2 plan with every
   block stored and with every block recomputed: the limits are those two peaks (the larger rank's),
   their midpoint, and the planner's own bound of the all-recompute plan (the bound lies above the
   measured peak, so at the measured all-recompute peak the planner may find no plan);
3. a plan per limit (:func:`~oases_ds.planner.planning.make_plan`);
4. one launch stepping ``none``, uniform ``oases``, uniform ``oases`` with every block stored and
   every distinct planned plan interleaved (the starting variant rotating each round), each first
   run once under the probe for its peak.

The result JSON holds every timed step; medians and ratios are computed from it.
"""
from __future__ import annotations

import datetime
import statistics
import time
from typing import Any

import torch

from oases_ds.bench.measure import ActivationProbe
from oases_ds.data.batches import synthetic_batch
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.link import LinkModel
from oases_ds.parallel.random import RNGTracker
from oases_ds.planner.costs import STATE_BYTES_PER_PARAM
from oases_ds.planner.memory import estimate_memory
from oases_ds.planner.objective import predict_memory_bytes
from oases_ds.planner.plan import Plan, PlanInfeasibleError
from oases_ds.planner.planning import PlanRequest, load_table, make_plan
from oases_ds.planner.profile import PROFILE_DTYPE_BYTES, ProfileSpec
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.utils.rounds import rotated

DEVICES = 2


def _variant(model: ModelConfig, ctx: ParallelContext, plan: Plan, schedule: str, gbps: float) -> tuple:
    built = OperatorModel.for_plan(model, ctx, plan, seed=0).to(ctx.device)
    spec = ScheduleSpec(schedule, stored_blocks=plan.stored_blocks() if schedule == "oases" else ())
    return built, Executor.for_schedule(built, spec, LinkModel(gbps, sharing="ring"), RNGTracker(), record=False)


def _allocator_peak(executor: Executor, model: OperatorModel, batch: dict, device: torch.device) -> float | None:
    """On CUDA: the most the caching allocator held during one step beyond what it held before,
    with every gradient allocated beforehand (so the increase is activations, transients and
    workspaces, not the gradients): the allocator's view of what ActivationProbe counts."""
    if device.type != "cuda":
        return None
    executor.run(batch)  # allocates every .grad; zero_grad(set_to_none=False) keeps them
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    executor.run(batch)
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - before)


def rank_worker(model_fields: dict, variants: list[tuple[str, dict, str]], micro_batch: int, gbps: float,
                warmup: int, repeats: int, timeout_s: float, devices: int = DEVICES) -> dict[str, Any]:
    """One rank: each (label, plan fields, schedule) variant's probed peak (and on CUDA the
    allocator's), then interleaved timed steps."""
    torch.manual_seed(0)
    ctx = ParallelContext.build(tensor_parallel_size=devices, timeout_s=timeout_s)
    model = ModelConfig(**model_fields)
    batch = synthetic_batch(model.vocab_size, micro_batch, model.seq_len, seed=0, device=ctx.device)
    built = {label: _variant(model, ctx, Plan(**fields), schedule, gbps) for label, fields, schedule in variants}
    peaks = {}
    for label, (m, executor) in built.items():
        activations = ActivationProbe(executor, m).run(batch)
        m.zero_grad(set_to_none=True)
        allocator = _allocator_peak(executor, m, batch, ctx.device)
        m.zero_grad(set_to_none=True)
        peaks[label] = {"activation_bytes": activations, "allocator_bytes": allocator,
                        "state_bytes": sum(p.numel() for p in m.parameters()) * STATE_BYTES_PER_PARAM}
    steps: dict[str, list[float]] = {label: [] for label in built}
    labels = list(built)
    for rep in range(warmup + repeats):
        for i in rotated(range(len(labels)), rep):
            m, executor = built[labels[i]]
            torch.distributed.barrier(group=ctx.tp_group)
            started = time.perf_counter()
            executor.run(batch)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            torch.distributed.barrier(group=ctx.tp_group)
            if rep >= warmup:
                steps[labels[i]].append((time.perf_counter() - started) * 1e3)
            m.zero_grad(set_to_none=True)
    hardware = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "this machine's CPUs"
    return {"rank": ctx.rank, "device": str(ctx.device), "hardware": hardware, "peaks": peaks, "step_ms": steps}


def slower_rank_steps(per_rank: list[list[float]]) -> list[float]:
    """Each timed step's time as the slower rank's (a TMP step ends when its last rank does)."""
    return [max(ranks) for ranks in zip(*per_rank)]


def _peak(rank_results: list[dict], label: str, term: str = "activation_bytes") -> float | None:
    """The larger rank's peak: ``term`` (the probe's activations, or ``allocator_bytes`` on CUDA)
    plus 16 B per held parameter; None where ``term`` was not measured."""
    if any(r["peaks"][label][term] is None for r in rank_results):
        return None
    return max(r["peaks"][label][term] + r["peaks"][label]["state_bytes"] for r in rank_results)


def measure(model_fields: dict, micro_batch: int = 4, gbps: float = 1.0, warmup: int = 1, repeats: int = 2,
            profile_repeats: int = 2, timeout_s: float = 1800.0, cache_dir: str | None = ".oases/profiles",
            devices: int = DEVICES) -> dict:
    """Steps 1-4 of the module doc; returns the result record."""
    model = ModelConfig(**model_fields)
    link = LinkModel(gbps, sharing="ring")
    spec = ProfileSpec(model=model, devices=devices, micro_batch=micro_batch, link=link, cluster=f"emulated-{gbps:g}g",
                       warmup=1, repeats=profile_repeats)
    started = time.perf_counter()
    loaded = load_table(PlanRequest(profile=spec, cache_dir=cache_dir, timeout_s=timeout_s, recompute="auto"))
    layers, blocks = model.num_layers, 2 * model.num_layers
    uniform = {"all-store": Plan.from_block_degrees([devices] * blocks, devices, ["store"] * blocks),
               "all-oases": Plan.uniform(devices, layers, devices)}

    def fields(plan: Plan) -> dict:
        return {"attn_degrees": plan.attn_degrees, "mlp_degrees": plan.mlp_degrees, "devices": plan.devices,
                "attn_policies": plan.attn_policies, "mlp_policies": plan.mlp_policies}

    peaks = launch(rank_worker, devices, (model_fields, [(k, fields(p), "oases") for k, p in uniform.items()],
                                          micro_batch, gbps, 0, 0, timeout_s, devices), timeout_s=timeout_s)
    high, low = _peak(peaks, "all-store"), _peak(peaks, "all-oases")
    # the planner holds plans to its own bound, which lies above the measured peak (conservative); at
    # the measured all-oases peak it may find nothing, so the bound of that plan is a fourth limit
    low_bound = predict_memory_bytes(loaded.table, uniform["all-oases"])
    limits = [("store-everything", high), ("midpoint", (high + low) / 2), ("recompute-everything", low),
              ("recompute-everything-bound", low_bound)]
    plans, rows = {}, []
    uniform_keys = {(tuple(p.block_degrees()), tuple(p.block_policies())): "oases" if name == "all-oases" else name
                    for name, p in uniform.items()}
    for name, limit in sorted(limits, key=lambda item: -item[1]):
        request = PlanRequest(profile=spec, cache_dir=cache_dir, memory_limit_bytes=limit, recompute="auto")
        try:
            plan = make_plan(request, loaded).plan
        except PlanInfeasibleError as err:
            rows.append({"limit": name, "limit_bytes": limit, "infeasible": str(err)})
            continue
        key = (tuple(plan.block_degrees()), tuple(plan.block_policies()))
        if key in uniform_keys:  # the plan is a uniform variant: timed once, under that variant's name
            label = uniform_keys[key]
        else:
            label = plans.setdefault(key, (f"planned-{len(plans)}", plan))[0]
        schedule = ScheduleSpec("oases", stored_blocks=plan.stored_blocks())
        replayed = estimate_memory(model, plan.attn_degrees, plan.mlp_degrees, devices, micro_batch, schedule,
                                   PROFILE_DTYPE_BYTES).peak_bytes
        rows.append({"limit": name, "limit_bytes": limit, "variant": label, "plan": plan.as_table().splitlines(),
                     "stored_blocks": len(plan.stored_blocks()), "blocks": blocks,
                     "predicted_bound_bytes": plan.memory_bytes, "predicted_replay_bytes": replayed,
                     "predicted_step_ms": plan.predicted_step_ms})
    variants = [("none", fields(uniform["all-oases"]), "none"), ("oases", fields(uniform["all-oases"]), "oases"),
                ("all-store", fields(uniform["all-store"]), "oases")]
    variants += [(label, fields(plan), "oases") for label, plan in plans.values()]
    timed = launch(rank_worker, devices, (model_fields, variants, micro_batch, gbps, warmup, repeats, timeout_s,
                                          devices), timeout_s=timeout_s)
    slower = {label: slower_rank_steps([r["step_ms"][label] for r in timed]) for label, _, _ in variants}
    median = {label: statistics.median(steps) for label, steps in slower.items()}
    for row in rows:
        if "variant" not in row:
            continue
        planned, oases, none, store = median[row["variant"]], median["oases"], median["none"], median["all-store"]
        measured = _peak(timed, row["variant"])
        row.update({"planned_ms": planned, "oases_ms": oases, "none_ms": none, "all_store_ms": store,
                    "planned_over_none": planned / none, "planned_over_all_store": planned / store,
                    "gap_closed": (oases - planned) / (oases - none) if oases > none else None,
                    "gap_closed_vs_all_store": (oases - planned) / (oases - store) if oases > store else None,
                    "measured_peak_bytes": measured,
                    "bound_error": row["predicted_bound_bytes"] / measured - 1,
                    "replay_error": row["predicted_replay_bytes"] / measured - 1})
        allocator = _peak(timed, row["variant"], "allocator_bytes")
        if allocator is not None:  # CUDA: the caching allocator's peak as well
            row.update({"allocator_peak_bytes": allocator,
                        "allocator_bound_error": row["predicted_bound_bytes"] / allocator - 1,
                        "allocator_replay_error": row["predicted_replay_bytes"] / allocator - 1})
    device, hardware = timed[0]["device"], timed[0]["hardware"]
    link = "no TMP communication" if devices == 1 else f"link EMULATED (ring, {gbps:g} Gbit/s)"
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "what": f"measured, TMP {devices}, {hardware}, {link}", "devices": devices, "device": device,
            "model": model_fields, "micro_batch": micro_batch, "table": loaded.table.key(), "table_source": loaded.source,
            "limits_from": {"all-store": high, "all-oases": low}, "uniform_peaks": peaks, "rows": rows,
            "step_ms": {label: [r["step_ms"][label] for r in timed] for label, _, _ in variants},
            "median_ms": median, "spread": {label: (max(v) - min(v)) / median[label] for label, v in slower.items()},
            "wall_s": time.perf_counter() - started,
            "note": "peak = ActivationProbe activations + 16 B per held parameter, the larger rank (on CUDA also "
                    "allocator_peak_bytes: the allocator's most during a step beyond what it held before, with the "
                    "gradients allocated beforehand, + 16 B per parameter); steps: the slower "
                    "rank's per timed step, median over steps; gap_closed = (oases - planned) / (oases - none), null "
                    "where none is not faster; gap_closed_vs_all_store likewise against uniform oases with every "
                    "block stored (the fastest a plan can be, none's blocking collectives aside); the limit "
                    "recompute-everything-bound is the planner's own bound of the all-oases plan; a plan equal to a uniform "
                    "variant is named and timed as it; spread = (max - min) / median of a variant's steps",
            "repeats": repeats, "warmup": warmup}
