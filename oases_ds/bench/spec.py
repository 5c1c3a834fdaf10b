"""A plain config dict -> the validated spec the rank processes of a measurement run.

Why apart from the CLI: ``oases-bench`` composes the dict with Hydra, but
``benchmarks/validate_link.py`` and the tests build it too, and every one of them
must be refused the same way.  :func:`resolve` checks everything against the
library's own types (``ModelConfig``, ``Topology``, ``LinkModel``,
``ScheduleSpec``) and raises ``ValueError`` with one line naming the key and
the fix; it starts no process.

Schedule names are presets in ``configs/schedule/`` (ablations included), read
here as plain YAML: the library does not need Hydra to know what ``oases`` means.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from oases_ds.models.config import ModelConfig
from oases_ds.parallel.link import LinkModel
from oases_ds.parallel.topology import Topology
from oases_ds.schedule.generators import ScheduleSpec
from oases_ds.schedule.pipeline import registered_pipelines

# The Hydra configs ship inside the package (``oases_ds/configs``; the repository's
# top-level ``configs`` is a link to it), so the CLIs work from a wheel as well as a clone.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
EMULATION_MODES = ("scaled", "literal", "off")


def load_preset(group: str, name: str, key: str | None = None) -> dict[str, Any]:
    """``configs/<group>/<name>.yaml`` as plain data.  An unknown name is a ``ValueError``
    naming ``key`` (the config field that chose it; default ``group``) and the presets there."""
    path = os.path.join(CONFIG_DIR, group, f"{name}.yaml")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(os.path.dirname(path)) if f.endswith(".yaml"))
        raise ValueError(f"{key or group}: {name!r} is not a preset in configs/{group}; choose from {', '.join(known)}")
    with open(path) as f:
        preset = yaml.safe_load(f)
    if group == "model":  # what the Hydra schema (fields of ModelConfig) fills in for keys a preset leaves out
        preset = {**{f.name: f.default for f in dataclasses.fields(ModelConfig)
                     if f.default is not dataclasses.MISSING}, **preset}
    return preset


def bench_defaults() -> dict[str, Any]:
    """``configs/bench.yaml``'s own values (not its Hydra defaults list and ``hydra`` node).

    Why: a script that measures without Hydra (``benchmarks/validate_link.py``) adds a
    model and a cluster to these and gets what ``oases-bench`` would compose, so the
    two cannot drift apart (a test compares them)."""
    with open(os.path.join(CONFIG_DIR, "bench.yaml")) as f:
        raw = yaml.safe_load(f)
    return {k: v for k, v in raw.items() if k not in ("defaults", "hydra")}


def load_schedule_variant(name: str) -> dict[str, Any]:
    """A schedule preset from ``configs/schedule/<name>.yaml`` (ablations included)."""
    raw = load_preset("schedule", name, key="schedules")
    return {"label": name, "schedule": raw["name"], "sub_batches": int(raw["sub_batches"]),
            "cross_pass": bool(raw["cross_pass"]), "fine_grained_recompute": bool(raw["fine_grained_recompute"])}


def reference_tp(cluster: dict, reference: dict) -> int:
    """The TMP degree the emulated link carries: the cluster profile's own (e.g. 2 for an
    NVLink pair), else the reference layer's."""
    return cluster.get("tensor_parallel_size") or reference["tensor_parallel_size"]


def resolve(cfg: dict) -> dict[str, Any]:
    """Validate everything against the library's own types; raise ValueError with one line."""
    model = ModelConfig(**cfg["model"])
    tp, dp = cfg["tensor_parallel_size"], cfg["data_parallel_size"]
    pp, micro_steps = cfg.get("pipeline_stages", 1), cfg.get("pipeline_micro_batches", 1)
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got {tp} and {dp}")
    if pp < 1 or micro_steps < 1:
        raise ValueError(f"pipeline_stages and pipeline_micro_batches must be >= 1, got {pp} and {micro_steps}")
    if pp > model.num_layers:
        raise ValueError(f"pipeline_stages={pp} exceeds model.num_layers={model.num_layers}: every stage needs a "
                         f"layer; lower pipeline_stages")
    pipeline = cfg.get("pipeline_schedule", "1f1b")
    if pp > 1 and pipeline not in registered_pipelines():
        raise ValueError(f"pipeline_schedule={pipeline!r} unknown; choose one of {', '.join(registered_pipelines())}")
    if pp > 1 and cfg["emulation"]["mode"] == "scaled":
        raise ValueError("emulation.mode=scaled calibrates on a model without stages; with pipeline_stages > 1 use "
                         "emulation.mode=literal (a fixed link, e.g. cluster=cpu_fixed_link) or off")
    if cfg["memory_probe"] and (pp > 1 or micro_steps > 1):
        raise ValueError("memory_probe measures one micro-batch without stages; set memory_probe=false with "
                         "pipeline_stages or pipeline_micro_batches > 1")
    Topology(tp * dp * pp, tp, pp)
    model.check_tp(tp)
    mode = cfg["emulation"]["mode"]
    if mode not in EMULATION_MODES:
        raise ValueError(f"emulation.mode={mode!r} unknown; choose one of {', '.join(EMULATION_MODES)}")
    cluster = cfg["cluster"]
    if mode != "off" and not cluster.get("link"):
        raise ValueError(f"emulation.mode={mode} needs a cluster with a link; cluster={cluster['name']} has none "
                         f"(use emulation.mode=off or e.g. cluster=pcie_3090)")
    if cluster.get("link"):
        LinkModel(**{**cluster["link"], "sharing": cluster["link"].get("sharing") or cfg["emulation"].get("sharing", "ring")})
    if mode == "scaled":
        if not cluster.get("device"):
            raise ValueError(f"emulation.mode=scaled needs cluster.device; cluster={cluster['name']} has none")
        if not 0 < cluster["device"]["achieved_fraction"] <= 1:
            raise ValueError(f"cluster.device.achieved_fraction must be in (0, 1], got {cluster['device']['achieved_fraction']}")
        ref = cfg["emulation"]["reference"]
        for key in ("hidden_size", "tensor_parallel_size", "dtype_bytes", "tokens"):
            if ref[key] < 1:
                raise ValueError(f"emulation.reference.{key} must be >= 1, got {ref[key]}")
        if reference_tp(cluster, ref) < 2:
            raise ValueError("the reference TMP degree (cluster.tensor_parallel_size or "
                             "emulation.reference.tensor_parallel_size) must be >= 2: no TMP, nothing to emulate")
    if mode != "off" and tp * dp * pp == 1:
        raise ValueError("link emulation needs at least 2 ranks; use emulation.mode=off for one process")
    if not cfg["schedules"]:
        raise ValueError("schedules is empty; name at least one preset from configs/schedule")
    micro_batches = list(cfg["micro_batches"]) or [cfg["micro_batch"]]
    variants = []
    for name in cfg["schedules"]:
        base = load_schedule_variant(name)
        schedule = ScheduleSpec(base["schedule"], base["sub_batches"], base["cross_pass"], base["fine_grained_recompute"])
        parts = schedule.effective_sub_batches
        for mb in micro_batches:
            if mb < 1 or mb % parts:
                raise ValueError(f"micro_batch={mb} is not divisible by the {parts} sub-batches of schedule {name}")
            label = base["label"] if len(micro_batches) == 1 else f"{base['label']}@b{mb}"
            variants.append(dict(base, label=label, micro_batch=mb))
    if len({v["label"] for v in variants}) != len(variants):
        raise ValueError(f"schedules lists a preset twice: {list(cfg['schedules'])}")
    for key in ("repeats", "threads_per_rank", "timeout_s"):
        if cfg[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg["warmup"] < 0:
        raise ValueError(f"warmup must be >= 0, got {cfg['warmup']}")
    return {
        "model": model.to_dict(), "tp": tp, "dp": dp, "pp": pp, "pipeline_schedule": pipeline,
        "micro_steps": micro_steps, "variants": variants, "cluster": cluster,
        "emulation": cfg["emulation"], "warmup": cfg["warmup"], "repeats": cfg["repeats"],
        "memory_probe": cfg["memory_probe"], "gantt": cfg["gantt"], "seed": cfg["seed"], "timeout_s": cfg["timeout_s"],
    }
