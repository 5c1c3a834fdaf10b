"""One measurement of several schedules, interleaved, as one JSON record.

Why interleaved in one measurement: this machine is shared and noisy, so two
schedules measured in separate runs differ by whatever else ran meanwhile.  The
rank processes build one executor per *variant* (schedule x micro-batch) and run
them round-robin, one step each, the starting variant rotating every repeat; a
ratio between variants then comes from one run.

Why the link is *scaled* by default: on CPU a transformer step is ~1000x slower
than on the GPUs of the paper, so a literal 10 Gbit/s link would make every
collective negligible and every schedule look alike.  A cluster profile states
the real link (bandwidth, latency) and the real device (throughput); the scaled
emulation keeps Megatron's *ratio* of communication time to compute time that a
reference layer (``emulation.reference``: hidden size, TMP degree, dtype) would
have on that hardware::

    r = dtype_bytes * (t - 1) * R_device / (8 * h * B_link)

(Megatron, full recomputation, per layer and step: 6 AllReduces of b*s*h
elements on a ring of t ranks vs 96*b*s*h^2/t GEMM flops; attention scores and
latency ignored.)  The measurement then calibrates: one unlinked Megatron step
gives this machine's compute time and TMP wire bytes, and the emulated bandwidth
is chosen so that those bytes take ``r`` times that compute time.  Latency keeps
its ratio to the reference layer's compute time.  ``emulation.mode=literal`` uses
the profile's numbers as they are; ``off`` emulates nothing.  Every record says
which was used and the resulting emulated bandwidth.

A run without ``out`` appends to a new dated file under ``runs/`` (git-ignored)
and says where; ``out=benchmarks/results/bench.jsonl`` is how a run joins the
committed results.  The entry point is ``oases-bench``.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from oases_ds.bench.provenance import git_commit, machine
from oases_ds.bench.spec import reference_tp, resolve
from oases_ds.data import DataConfig, TokenBatches
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.grads import all_reduce_grads
from oases_ds.parallel.link import LinkModel
from oases_ds.parallel.random import RNGTracker
from oases_ds.models.stages import split_stages
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.pipeline import PipelineExecutor, StageLinks
from oases_ds.runtime.timeline import Timeline, exposed_by_phase_of
from oases_ds.schedule.costed_merge import HopCosts
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.schedule.pipeline import OVERLAP
from oases_ds.utils.rounds import rotated

RUNS_DIR = "runs"  # git-ignored; relative to the directory oases-bench runs in


# -- the scaled emulation's target (see the module doc) ---------------------------------------------
def target_ratio(cluster: dict, reference: dict) -> float:
    """Megatron's comm/compute time ratio for the reference layer on the real hardware (see module doc)."""
    link, device = cluster["link"], cluster["device"]
    rate = device["peak_tflops"] * 1e12 * device["achieved_fraction"]
    t = reference_tp(cluster, reference)
    return reference["dtype_bytes"] * (t - 1) * rate / (8 * reference["hidden_size"] * link["bandwidth_gbps"] * 1e9 / 8)


def reference_layer_compute_s(cluster: dict, reference: dict) -> float:
    """Compute seconds of one reference layer's step (fwd + recompute + bwd) on the real device."""
    device = cluster["device"]
    rate = device["peak_tflops"] * 1e12 * device["achieved_fraction"]
    h, t = reference["hidden_size"], reference_tp(cluster, reference)
    return 96 * reference["tokens"] * h * h / t / rate


# -- the rank process ------------------------------------------------------------------------------
class ActivationProbe:
    """Peak bytes of activations an executor holds: its buffers plus autograd-saved tensors.

    Sampled after every instruction through the executor's public hook
    (:meth:`Executor.add_hook`), reading its :attr:`Executor.buffers` view; parameters
    and their gradients are not counted; tensors sharing storage count once.  The
    sampling costs time, so it runs only in a separate, untimed step.
    """

    def __init__(self, executor, model) -> None:
        self.executor = executor
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self.peak = 0

    def _storages(self, obj, out: dict[int, int]) -> None:
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in self.params:
                out[s.data_ptr()] = s.nbytes()
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                self._storages(item, out)

    def _sample(self, instruction, phase: str) -> None:
        if phase != "after":
            return
        live: dict[int, int] = {}
        for value in self.executor.buffers.values():
            self._storages(value, live)
        for t in list(self.saved.values()):
            self._storages(t, live)
        self.peak = max(self.peak, sum(live.values()))

    def run(self, batch) -> int:
        def pack(t):
            self.saved[id(t)] = t
            return t

        remove = self.executor.add_hook(self._sample)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self.executor.run(batch)
        finally:
            remove()
        return self.peak


def _flat_grad_sync(model, comm, dp_group) -> None:
    """DP gradient mean as one bucket through the (emulated) communicator, like DeepSpeed's bucket."""
    all_reduce_grads(list(model.parameters()), comm, dp_group, mean=True)


def _step_summary(timelines: list[Timeline]) -> dict[str, Any]:
    """:meth:`Timeline.summary` and :meth:`Timeline.exposed_by_phase` of a step that ran as several
    executor runs (a micro-batch each): busy and waiting seconds summed, fractions of the summed spans."""
    parts = [t.summary() for t in timelines]
    summed = {key: sum(p[key] for p in parts) for key in ("span_s", "compute_s", "exposed_comm_s", "compute_fwd_s",
                                                           "compute_rec_s", "compute_bwd_s")}
    span = summed["span_s"]
    return {**summed, "compute_util": summed["compute_s"] / span if span else 0.0,
            "exposed_comm_frac": summed["exposed_comm_s"] / span if span else 0.0,
            "exposed_by_phase_s": exposed_by_phase_of(timelines)}


def measure_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Everything one rank does: calibrate the link, then run the variants interleaved."""
    import resource  # local: Unix only, and only a measuring rank reads its peak RSS

    ctx = ParallelContext.build(tensor_parallel_size=spec["tp"], timeout_s=spec["timeout_s"],
                                pipeline_stages=spec["pp"])
    cfg = ModelConfig(**spec["model"])
    data = TokenBatches(DataConfig(source="synthetic", seed=spec["seed"]), cfg.vocab_size, cfg.seq_len,
                        masked_lm=cfg.family == "bert")
    dp, micro_steps = ctx.dp_size, spec["micro_steps"]
    # Micro-batch a of DP rank r is slot a * dp + r of the step (as the engine lays them out);
    # every stage and TMP rank of a pipeline reads the same ones.
    batches = {v["micro_batch"]: [data.batch(0, dp * micro_steps, a * dp + ctx.dp_rank, v["micro_batch"])
                                  for a in range(micro_steps)] for v in spec["variants"]}
    stage = split_stages(cfg.num_layers, spec["pp"])[ctx.pp_rank] if spec["pp"] > 1 else None

    def build(variant: dict, link) -> tuple[Executor, OperatorModel]:
        """A variant's executor; besides the schedule keys it may name ``stored_blocks`` /
        ``gathered_blocks`` (per-block policies), ``hop_costs`` (per-op times the sequence-parallel merge
        orders its hops by, as a plan file holds them), ``sequence_parallel`` and ``overlap_micro_batches``."""
        hop_costs = variant.get("hop_costs")
        schedule = ScheduleSpec(variant["schedule"], variant["sub_batches"], variant["cross_pass"],
                                variant["fine_grained_recompute"], tuple(variant.get("stored_blocks", ())),
                                tuple(variant.get("gathered_blocks", ())),
                                HopCosts.from_value(hop_costs) if hop_costs is not None else None)
        sp = bool(variant.get("sequence_parallel"))
        if variant.get("overlap_micro_batches"):  # one stage, the step's micro-batches as one merge
            if stage is not None:
                raise ValueError("overlap_micro_batches runs one stage; set pipeline_stages=1")
            model = OperatorModel(cfg, group=ctx.tp_group, seed=spec["seed"], sequence_parallel=sp)
            return PipelineExecutor.for_pipeline(model, schedule, OVERLAP, micro_steps, StageLinks.of(ctx), link,
                                                 RNGTracker()), model
        if stage is not None:
            model = OperatorModel(cfg, group=ctx.tp_group, seed=spec["seed"], stage=stage, sequence_parallel=sp)
            return PipelineExecutor.for_pipeline(model, schedule, spec["pipeline_schedule"], micro_steps,
                                                 StageLinks.of(ctx), link, RNGTracker()), model
        model = OperatorModel(cfg, group=ctx.tp_group, seed=spec["seed"], sequence_parallel=sp)
        return Executor.for_schedule(model, schedule, link, RNGTracker()), model

    def step(executor: Executor, micro: int) -> list[Timeline]:
        """Forward and backward of the step's micro-batches (accumulated), without the DP sync; the
        timelines of the step (one per executor run: a run per micro-batch without a step schedule)."""
        mbs = batches[micro]
        if len(mbs) == 1 and stage is None and not isinstance(executor, PipelineExecutor):
            executor.run(mbs[0])  # one micro-batch: the plain call, as before pipeline_micro_batches
            return [executor.timeline]
        offsets = [(a * dp + ctx.dp_rank) * micro for a in range(len(mbs))]
        global_batch = micro * len(mbs) * dp
        if isinstance(executor, PipelineExecutor):
            executor.run_step(mbs, offsets, global_batch)
            return [executor.timeline]
        timelines = []
        for mb, offset in zip(mbs, offsets):
            executor.run(mb, offset, global_batch)
            timelines.append(executor.timeline)  # each run starts a fresh one
        return timelines

    mode, emulation = spec["emulation"]["mode"], {"mode": spec["emulation"]["mode"]}
    link = None
    cluster_link = spec["cluster"].get("link") or {}
    sharing = cluster_link.get("sharing") or spec["emulation"].get("sharing", "ring")  # the profile's, else the bench's
    if mode == "literal":
        link = LinkModel(**{**cluster_link, "sharing": sharing})
    elif mode == "scaled":
        calib_variant = {"schedule": "megatron", "sub_batches": 1, "cross_pass": True, "fine_grained_recompute": True}
        probe, _ = build(calib_variant, None)
        batch = batches[spec["variants"][0]["micro_batch"]][0]
        computes = []
        for _ in range(3):
            probe.comm.stats.reset()
            probe.run(batch)
            computes.append(probe.timeline.busy("compute"))
        compute_s = torch.tensor([min(computes[1:])], dtype=torch.float64)
        dist.all_reduce(compute_s, op=dist.ReduceOp.MAX)  # every rank must emulate the same link
        wire = sum(LinkModel(1.0).wire_bytes(kind, b, spec["tp"]) for (_, kind), b in probe.comm.stats.bytes.items())
        ref = spec["emulation"]["reference"]
        ratio = target_ratio(spec["cluster"], ref)
        bandwidth = wire * 8 / (ratio * float(compute_s)) / 1e9
        tau = (float(compute_s) / cfg.num_layers) / reference_layer_compute_s(spec["cluster"], ref)
        latency = spec["cluster"]["link"]["latency_us"] * tau
        link = LinkModel(bandwidth_gbps=bandwidth, latency_us=latency, sharing=sharing)
        emulation.update(target_comm_compute_ratio=ratio, reference_tensor_parallel_size=reference_tp(spec["cluster"], ref), calibration_compute_s=float(compute_s),
                         calibration_wire_bytes=wire, time_dilation=tau)
        del probe
    if link is not None:
        emulation.update(emulated_bandwidth_gbps=link.bandwidth_gbps, emulated_latency_us=link.latency_us,
                         sharing=link.sharing)

    runners = {v["label"]: build(v, link) for v in spec["variants"]}
    labels = [v["label"] for v in spec["variants"]]
    mb_of = {v["label"]: v["micro_batch"] for v in spec["variants"]}
    out: dict[str, dict[str, Any]] = {l: {"step_s": [], "exposed_comm_frac": [], "compute_util": [], "compute_phase_s": [],
                                          "compute_s": [], "exposed_by_phase_s": [], "link_s": []} for l in labels}
    world_group = None
    for rep in range(spec["warmup"] + spec["repeats"]):
        for label in rotated(labels, rep):
            executor, model = runners[label]
            executor.comm.stats.reset()
            dist.barrier(world_group)
            t0 = time.perf_counter()
            timelines = step(executor, mb_of[label])
            _flat_grad_sync(model, executor.comm, ctx.dp_group)
            if ctx.device.type == "cuda":  # the step's kernels, not only their launches (the limit is CUDA-event time)
                torch.cuda.synchronize(ctx.device)
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            if rep >= spec["warmup"]:
                summary = _step_summary(timelines)
                out[label]["step_s"].append(dt)
                out[label]["exposed_comm_frac"].append(summary["exposed_comm_frac"])
                out[label]["compute_util"].append(summary["compute_util"])
                out[label]["compute_phase_s"].append({p: summary[f"compute_{p}_s"] for p in ("fwd", "rec", "bwd")})
                out[label]["compute_s"].append(summary["compute_s"])
                out[label]["exposed_by_phase_s"].append(summary["exposed_by_phase_s"])
                out[label]["link_s"].append(sum(executor.comm.stats.link_s.values()))  # 0 without an emulated link
                out[label]["comm_bytes"] = executor.comm.stats.as_dict()
    for label in labels:
        executor, model = runners[label]
        if spec["gantt"] and ctx.rank == 0:
            t0 = min((e.start for e in executor.timeline.events), default=0.0)
            out[label]["gantt"] = [[e.lane, e.sub, round((e.start - t0) * 1e3, 3), round((e.end - t0) * 1e3, 3)]
                                   for e in executor.timeline.events]
        if spec["memory_probe"]:  # one extra, untimed step per variant
            out[label]["peak_activation_bytes"] = ActivationProbe(executor, model).run(batches[mb_of[label]][0])
            model.zero_grad(set_to_none=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"rank": ctx.rank, "variants": out, "emulation": emulation, "peak_rss_bytes": rss}


# -- the parent: launch, assemble, append ---------------------------------------------------------
@functools.lru_cache(maxsize=None)
def default_out() -> str:
    """Where a run without ``out=`` appends: ``runs/oases-bench-<date>-<time>.jsonl`` under the
    working directory, one file per invocation (every point of a ``--multirun`` sweep lands in it).

    Why not the committed ``benchmarks/results/bench.jsonl``: the committed reports are generated
    from it, so a trial run would silently change them; committing a run is a deliberate ``out=``.
    """
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    return os.path.join(RUNS_DIR, f"oases-bench-{stamp}.jsonl")


def assemble(spec: dict, config: dict, ranks: list[dict], wall_s: float) -> dict[str, Any]:
    """The JSON line: everything needed to reproduce and to read the measurement."""
    model = spec["model"]
    rank0 = ranks[0]
    variants = {}
    for v in spec["variants"]:
        label = v["label"]
        per_rank = [r["variants"][label] for r in ranks]
        steps = [max(ts) for ts in zip(*(p["step_s"] for p in per_rank))]  # a step ends when its last rank does
        med = statistics.median(steps)
        tokens = v["micro_batch"] * spec["micro_steps"] * model["seq_len"] * spec["dp"]
        # the step's physical limit (issue 43): max(its compute, the link time of its traffic), the
        # compute a step's slowest rank spent computing (its waits left out), medians over the repeats
        compute = statistics.median(max(cs) for cs in zip(*(p["compute_s"] for p in per_rank)))
        link_time = statistics.median(rank0["variants"][label]["link_s"])
        entry = {
            **{k: v[k] for k in ("schedule", "sub_batches", "cross_pass", "fine_grained_recompute", "micro_batch")},
            "step_s": steps, "median_s": med, "min_s": min(steps), "max_s": max(steps),
            "tokens_per_step": tokens, "tokens_per_s": tokens / med,
            "exposed_comm_frac": statistics.median(rank0["variants"][label]["exposed_comm_frac"]),
            "compute_util": statistics.median(rank0["variants"][label]["compute_util"]),
            "compute_s": compute, "link_s": link_time, "limit_s": max(compute, link_time),
            "comm_bytes_rank0": rank0["variants"][label].get("comm_bytes", {}),
        }
        if "gantt" in rank0["variants"][label]:
            entry["gantt_rank0"] = rank0["variants"][label]["gantt"]
        if "peak_activation_bytes" in rank0["variants"][label]:
            entry["peak_activation_bytes_per_rank"] = [p["peak_activation_bytes"] for p in per_rank]
        variants[label] = entry
    return {
        "study": config["study"], "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "machine": machine(), "torch": torch.__version__,
        "config": config, "tensor_parallel_size": spec["tp"], "data_parallel_size": spec["dp"],
        "pipeline_stages": spec["pp"], "pipeline_schedule": spec["pipeline_schedule"] if spec["pp"] > 1 else None,
        "pipeline_micro_batches": spec["micro_steps"],
        "link_emulation": {"enabled": spec["emulation"]["mode"] != "off", "cluster": spec["cluster"],
                           **rank0["emulation"]},
        "variants": variants,
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_rss_note": "process peak RSS (ru_maxrss) over the whole run, all variants together",
        "wall_s": wall_s,
        "step_note": (f"step = forward + backward of {spec['micro_steps']} micro-batch(es) per DP rank"
                      + (f" through {spec['pp']} pipeline stages ({spec['pipeline_schedule']}), stage messages on the "
                         f"same emulated link" if spec["pp"] > 1 else "")
                      + " + DP gradient mean; no optimizer"),
    }


def append_jsonl(path: str, record: dict) -> None:
    """One ``write`` on an O_APPEND descriptor: concurrent appenders never interleave a line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def run_measurement(config: dict) -> dict[str, Any]:
    """Validate, launch ``tp x dp x pp`` rank processes, assemble and append the record; return it."""
    spec = resolve(config)
    config = {**config, "out": config["out"] or default_out()}  # the record says where it went
    started = time.perf_counter()
    ranks = launch(measure_rank, spec["tp"] * spec["dp"] * spec["pp"], (spec,), timeout_s=spec["timeout_s"],
                   threads_per_rank=config["threads_per_rank"])
    record = assemble(spec, config, ranks, time.perf_counter() - started)
    append_jsonl(config["out"], record)
    return record


def summary_lines(record: dict) -> list[str]:
    """The record as the few lines ``oases-bench`` prints: the setup, one row per variant
    with its speedup over the first, and where the record went."""
    emu = record["link_emulation"]
    if emu["enabled"]:
        link = (f"EMULATED {emu['mode']} link for {emu['cluster']['name']}: {emu['emulated_bandwidth_gbps']:.4g} Gbit/s, "
                f"{emu['emulated_latency_us']:.3g} us")
        if emu["mode"] == "scaled":
            link += f" (target Megatron comm/compute {emu['target_comm_compute_ratio']:.3g})"
    else:
        link = "no link emulation"
    m = record["config"]["model"]
    lines = [f"oases-bench {record['study']}: {m['family']} h={m['hidden_size']} L={m['num_layers']} s={m['seq_len']} | "
             f"PP {record.get('pipeline_stages', 1)} x TMP {record['tensor_parallel_size']} x DP "
             f"{record['data_parallel_size']} | {link}"]
    variants = record["variants"]
    base = next(iter(variants.values()))["median_s"]
    lines.append(f"{'variant':<24}{'median s':>10}{'min':>8}{'max':>8}{'speedup':>9}{'tok/s':>9}{'exposed':>9}{'util':>7}"
                 f"{'limit s':>9}{'x limit':>9}")
    for label, v in variants.items():
        lines.append(f"{label:<24}{v['median_s']:>10.4f}{v['min_s']:>8.4f}{v['max_s']:>8.4f}{base / v['median_s']:>8.2f}x"
                     f"{v['tokens_per_s']:>9.0f}{v['exposed_comm_frac']:>9.1%}{v['compute_util']:>7.1%}"
                     f"{v['limit_s']:>9.4f}{v['median_s'] / v['limit_s']:>8.3f}x")
    lines.append("limit: max(compute, link time of the step's traffic); x limit: the median step against it")
    lines.append(f"appended to {os.path.abspath(record['config']['out'])} ({record['wall_s']:.1f}s)")
    return lines
