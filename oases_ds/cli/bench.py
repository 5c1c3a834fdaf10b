"""``oases-bench``: one measurement of several schedules, interleaved, as one JSON line.

This module parses and dispatches only: the typed Hydra schema, the one-line
refusals before any rank starts, and the call into :mod:`oases_ds.bench` (why
the variants run interleaved and how the link emulation is scaled:
:mod:`oases_ds.bench.measure`).

    oases-bench experiment=e2e                 # one measurement (first point of the preset)
    oases-bench --multirun experiment=e2e      # the preset's sweep
    oases-bench report                         # JSON lines -> benchmarks/reports/*.md + PNG

Without ``out=`` a run appends to a new dated file under ``runs/`` (git-ignored) and says
where; ``out=benchmarks/results/bench.jsonl`` is how a run joins the committed results.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from oases_ds.bench.measure import run_measurement, summary_lines
from oases_ds.bench.spec import resolve
from oases_ds.cli import schema
from oases_ds.cli.bench_report import main as report_main
from oases_ds.cli.common import CONFIG_DIR, PLAN_PRESETS, fail, fail_launch, stop
from oases_ds.cli.schema import ClusterSchema, ModelSchema
from oases_ds.launcher import LaunchError, LaunchInterrupted


# -- typed schema: Hydra rejects an unknown key or a wrongly typed value before anything runs ----
@dataclass
class ReferenceSchema:
    """The layer whose comm/compute ratio the scaled emulation reproduces."""

    hidden_size: int = 4096
    tensor_parallel_size: int = 4
    dtype_bytes: int = 2
    tokens: int = 8192  # tokens per micro-batch (for the latency term)


@dataclass
class EmulationSchema:
    mode: str = "scaled"
    sharing: str = "ring"  # see LinkModel.sharing: ring = gloo over TCP (validated), fair, fifo = NCCL-like
    reference: ReferenceSchema = field(default_factory=ReferenceSchema)


@dataclass
class BenchSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    cluster: ClusterSchema = field(default_factory=ClusterSchema)
    emulation: EmulationSchema = field(default_factory=EmulationSchema)
    study: str = "adhoc"
    schedules: list[str] = field(default_factory=lambda: ["megatron", "split_overlap", "oases"])
    micro_batches: list[int] = field(default_factory=list)  # empty: [micro_batch]
    micro_batch: int = 8
    tensor_parallel_size: int = 2
    data_parallel_size: int = 1
    pipeline_stages: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_micro_batches: int = 1
    warmup: int = 1
    repeats: int = 5
    threads_per_rank: int = 1
    memory_probe: bool = False
    gantt: bool = True
    seed: int = 0
    timeout_s: int = 900
    out: str = ""  # empty: default_out(), a new dated file; committing a run is an explicit out=benchmarks/results/...
    note: str = ""


ConfigStore.instance().store(name="bench_schema", node=BenchSchema)


def print_record(record: dict) -> None:
    for line in summary_lines(record):
        print(line)
    sys.stdout.flush()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="bench")
def main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_container(dcfg, resolve=True, throw_on_missing=True)
    cfg.pop("hydra", None)
    try:
        resolve(cfg)
    except ValueError as err:
        fail(str(err))
    try:
        record = run_measurement(cfg)
    except LaunchInterrupted as err:
        stop(err)
    except LaunchError as err:  # one line; the rank's traceback in Hydra's run dir
        fail_launch(err, HydraConfig.get().runtime.output_dir)
    print_record(record)


def precheck(args: list[str]) -> None:
    """Compose the (first point of the) config before Hydra runs: a typo is one line, exit 2."""
    schema.check_experiment(args, [p for p in schema.presets() if p not in PLAN_PRESETS], "oases-bench",
                            lambda name: f"experiment={name} is a planner study: run `oases-plan experiment={name}`, "
                                         f"then `oases-bench report`")
    schema.precheck("bench", BenchSchema, args, resolve)


def entry() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        report_main(sys.argv[2:])
        return
    precheck(sys.argv[1:])
    main()


if __name__ == "__main__":
    entry()
