"""oases-bench: every study preset runs (1 untimed step, tiny model), configs fail in one line,
and the report generator turns JSON lines into Markdown tables and PNG plots.

Nothing here compares times: the machine is shared, so a timing bar would be a flaky test.
"""
import difflib
import json
import os
import re
import statistics
import subprocess
import sys
import zlib

import pytest

from oases_ds.bench import measure, report
from oases_ds.bench import spec as bench_spec
from oases_ds.bench.provenance import REPO_ROOT
from oases_ds.cli import bench, bench_report, schema  # the entry points, run as a user would
from oases_ds.cli import plan as plan_cli
from oases_ds.cli.common import PLAN_PRESETS
from support import refused

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bench_lines.jsonl")
ALL_PRESETS = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", "experiment")) if f.endswith(".yaml"))
PRESETS = [p for p in ALL_PRESETS if p not in PLAN_PRESETS]  # oases-bench's; the planner's are run below
SMOKE = ["model=gpt_tiny", "repeats=1", "warmup=0", "timeout_s=120"]


def compose(overrides: list[str]) -> dict:
    """The config ``oases-bench`` composes for ``overrides`` (importing ``cli.bench`` registered its schema)."""
    return schema.compose_config("bench", overrides)


def phase_bytes(variant: dict, phase: str) -> int:
    return sum(d["bytes"] for k, d in variant["comm_bytes_rank0"].items() if k.startswith(phase + "/"))


@pytest.mark.distributed
@pytest.mark.parametrize("preset", PRESETS)
def test_every_study_preset_runs_one_step(tmp_path, preset):
    out = tmp_path / "lines.jsonl"
    cfg = compose([f"experiment={preset}", *SMOKE, f"out={out}"])
    record = measure.run_measurement(cfg)
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["variants"].keys() == record["variants"].keys()
    assert record["study"] == preset and record["git_commit"] and record["machine"]["cpu_count"]
    assert set(record["variants"]) == {v["label"] for v in bench_spec.resolve(cfg)["variants"]}
    for v in record["variants"].values():
        assert len(v["step_s"]) == 1 and v["tokens_per_s"] > 0 and 0 < v["compute_util"] <= 1
        # the limit: the larger of the step's compute and its traffic's link time, neither above the step
        assert v["limit_s"] == max(v["compute_s"], v["link_s"]) and 0 < v["limit_s"] <= v["median_s"]
    if record["tensor_parallel_size"] > 1:
        emu = record["link_emulation"]
        assert emu["enabled"] and emu["emulated_bandwidth_gbps"] > 0
        assert all(v["link_s"] > 0 for v in record["variants"].values())  # the emulated link timed the traffic
        # what the schedules promise, visible in the accounting: oases never re-runs a forward
        # AllReduce in its recomputation, megatron does
        if {"megatron", "oases"} <= record["variants"].keys():
            assert phase_bytes(record["variants"]["megatron"], "recompute") > 0
            assert phase_bytes(record["variants"]["oases"], "recompute") == 0
    if cfg["memory_probe"]:
        mem = {l: max(v["peak_activation_bytes_per_rank"]) for l, v in record["variants"].items()}
        assert mem["megatron_selective"] > mem["megatron"] > 0  # keeps more than full recomputation


@pytest.mark.distributed
def test_a_run_without_out_leaves_the_committed_results_alone(tmp_path, monkeypatch, capsys):
    """No ``out=``: a new dated file under ./runs, said where; benchmarks/results/bench.jsonl byte-identical."""
    committed = os.path.join(ROOT, "benchmarks", "results", "bench.jsonl")
    before = open(committed, "rb").read()
    monkeypatch.chdir(tmp_path)
    measure.default_out.cache_clear()
    cfg = compose(["experiment=batch_split", "micro_batches=[2]", *SMOKE])
    assert cfg["out"] == ""
    record = measure.run_measurement(cfg)
    bench.print_record(record)
    (written,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"oases-bench-\d{4}-\d{2}-\d{2}-\d{6}\.jsonl", written.name)
    assert json.loads(written.read_text())["config"]["out"] == os.path.join("runs", written.name)
    assert f"appended to {written}" in capsys.readouterr().out
    assert open(committed, "rb").read() == before


def test_overlap_script_defaults_to_a_new_file_outside_the_results():
    import importlib.util

    spec = importlib.util.spec_from_file_location("overlap", os.path.join(ROOT, "benchmarks", "overlap.py"))
    overlap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlap)
    out = overlap.build_parser().get_default("out")
    assert re.fullmatch(r"runs/overlap-\d{4}-\d{2}-\d{2}-\d{6}\.json", out)


@pytest.mark.distributed
def test_overlap_script_tiny_run_writes_under_runs(tmp_path):
    committed = os.path.join(ROOT, "benchmarks", "results", "overlap.json")
    before = open(committed, "rb").read()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "overlap.py"), "--hidden", "16", "--layers", "1",
                           "--seq", "8", "--batch", "2", "--warmup", "0", "--repeats", "1"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (written,) = (tmp_path / "runs").iterdir()
    assert f"wrote {written}" in proc.stdout and set(json.loads(written.read_text())["median_s"]) == {"megatron", "split_overlap", "oases"}
    assert open(committed, "rb").read() == before


@pytest.mark.distributed
def test_weak_scaling_at_dp2_runs_four_ranks(tmp_path):
    out = tmp_path / "lines.jsonl"
    record = measure.run_measurement(compose(["experiment=weak_scaling", "data_parallel_size=2", *SMOKE, f"out={out}"]))
    assert record["data_parallel_size"] == 2 and len(record["peak_rss_bytes_per_rank"]) == 4
    assert all(phase_bytes(v, "grad_sync") > 0 for v in record["variants"].values())


@pytest.mark.distributed
def test_weak_scaling_with_pipeline_stages_runs_pp2_tmp2(tmp_path):
    """PP 2 x TMP 2 (4 ranks), 1F1B over 2 micro-batches: the record says its stages and m,
    counts its tokens over every micro-batch, and the stage messages were sent (rank 0 is a
    first-stage rank) on the emulated link the record names."""
    out = tmp_path / "lines.jsonl"
    record = measure.run_measurement(compose(
        ["experiment=weak_scaling_stages", "pipeline_stages=2", "pipeline_micro_batches=2", "model.num_layers=2",
         *SMOKE, f"out={out}"]))
    assert record["pipeline_stages"] == 2 and record["pipeline_schedule"] == "1f1b"
    assert record["pipeline_micro_batches"] == 2 and len(record["peak_rss_bytes_per_rank"]) == 4
    assert record["link_emulation"]["enabled"] and record["link_emulation"]["mode"] == "literal"
    for v in record["variants"].values():
        assert v["tokens_per_step"] == v["micro_batch"] * 2 * record["config"]["model"]["seq_len"]
        assert phase_bytes(v, "pipeline") > 0 and phase_bytes(v, "forward") > 0


@pytest.mark.parametrize("override, message", [
    ({"pipeline_stages": 2, "emulation": {"mode": "scaled"}}, "emulation.mode=scaled calibrates on a model without stages"),
    ({"pipeline_stages": 2, "pipeline_schedule": "zigzag"}, "pipeline_schedule='zigzag' unknown"),
    ({"pipeline_stages": 9}, "pipeline_stages=9 exceeds model.num_layers=8"),
    ({"pipeline_micro_batches": 2, "memory_probe": True}, "memory_probe measures one micro-batch without stages"),
])
def test_pipeline_bench_settings_are_refused_in_one_line(override, message):
    cfg = compose(["experiment=weak_scaling_stages"])
    for key, value in override.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=re.escape(message)):
        bench_spec.resolve(cfg)


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.hidden_sizee=3"], "error: model.hidden_sizee: not a known key; did you mean model.hidden_size?"),
        (["+model.hidden_sizee=3"], "error: model.hidden_sizee: not a known key; did you mean model.hidden_size?"),
        (["cluster.link.bandwidth_gbps=fast"], "error: cluster.link.bandwidth_gbps: Value 'fast' of type 'str' could not be converted to Float; give a number"),
        (["schedules=[gpipe]"], "error: schedules: 'gpipe' is not a preset in configs/schedule"),
        (["cluster=local"], "error: emulation.mode=scaled needs a cluster with a link"),
        (["--multirun", "experiment=e2e", "model.num_heads=5"], "error: model.num_heads=5 does not divide"),
        (["emulation.mode=loud"], "error: emulation.mode='loud' unknown"),
    ],
)
def test_bad_config_fails_in_one_line_before_launching(args, message, capsys, monkeypatch, tmp_path):
    assert refused(capsys, monkeypatch, tmp_path, bench, *args).startswith(message)


def test_scaled_emulation_ratio_follows_the_stated_formula():
    cfg = compose(["cluster=pcie_3090"])
    ref = cfg["emulation"]["reference"]
    # 2 bytes * (4 - 1) * 71e12 * 0.4 / (8 * 4096 * 12e9 B/s)
    assert measure.target_ratio(cfg["cluster"], ref) == pytest.approx(2 * 3 * 71e12 * 0.4 / (8 * 4096 * 12e9))
    nvlink = compose(["cluster=nvlink_pair_3090"])["cluster"]
    assert bench_spec.reference_tp(nvlink, ref) == 2


def test_the_library_reads_the_presets_as_hydra_composes_them():
    """``benchmarks/validate_link.py`` builds its config without Hydra (bench.yaml's own values plus a
    model preset); it must equal what ``oases-bench`` composes, types included."""
    composed = compose(["model=llama_small"])
    defaults = bench_spec.bench_defaults()
    assert {"schedules", "micro_batch", "emulation", "seed", "timeout_s"} <= defaults.keys()
    assert "defaults" not in defaults and "hydra" not in defaults
    plain = {**defaults, "model": bench_spec.load_preset("model", "llama_small")}
    assert {k: composed[k] for k in plain} == plain
    assert {k: type(v) for k, v in plain["model"].items()} == {k: type(composed["model"][k]) for k in plain["model"]}
    assert bench_spec.resolve({**plain, "cluster": composed["cluster"]}) == bench_spec.resolve(composed)


def test_an_unknown_preset_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"^model: 'gpt_huge' is not a preset in configs/model; choose from .*gpt_small"):
        bench_spec.load_preset("model", "gpt_huge")
    with pytest.raises(ValueError, match=r"^schedules: 'gpipe' is not a preset in configs/schedule; choose from "):
        bench_spec.load_schedule_variant("gpipe")


def test_activation_probe_uses_the_public_hook_and_ranks_recomputation():
    """One process, no link: the probe samples through ``Executor.add_hook``; full recomputation holds less than selective, which holds less than none."""
    import torch

    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.runtime.executor import Executor
    from oases_ds.schedule.generators import ScheduleSpec

    cfg = ModelConfig(family="gpt", hidden_size=32, num_heads=4, num_layers=2, seq_len=16, vocab_size=64)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for name in ("megatron", "megatron_selective", "none"):
        model = OperatorModel(cfg, seed=0)
        executor = Executor.for_schedule(model, ScheduleSpec(name))
        peaks[name] = measure.ActivationProbe(executor, model).run({"tokens": tokens, "labels": tokens})
    assert 0 < peaks["megatron"] < peaks["megatron_selective"] < peaks["none"]


def test_append_jsonl_writes_whole_lines(tmp_path):
    path = tmp_path / "r" / "x.jsonl"
    for i in range(3):
        measure.append_jsonl(str(path), {"i": i, "pad": "x" * 10000})
    assert [json.loads(l)["i"] for l in path.read_text().splitlines()] == [0, 1, 2]


def test_report_from_fixture_writes_tables_and_plots(tmp_path):
    written = bench_report.main(["--results", FIXTURE, "--out-dir", str(tmp_path),
                                 "--validation", str(tmp_path / "absent.json"), "--accuracy", str(tmp_path / "no.json")])
    studies = {os.path.basename(p).rsplit("-", 3)[0] for p in written}
    assert {"e2e", "batch_split", "weak_scaling", "selective"} <= studies
    e2e = next(p for p in written if os.path.basename(p).startswith("e2e-"))
    text = open(e2e).read()
    assert "| variant | median step s | min-max s |" in text and "EMULATED" in text
    assert "vs megatron" in text and "Link emulator vs kernel-shaped link" in text
    pngs = sorted(f for f in os.listdir(tmp_path) if f.endswith(".png"))
    assert any("gantt" in p for p in pngs) and any("scaling" in p for p in pngs) and any("ratio" in p for p in pngs)
    for p in pngs:
        with open(tmp_path / p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"]({p})" in "".join(open(x).read() for x in written)


def test_report_numbers_are_per_round_ratios_of_the_fixture(tmp_path):
    """The summary and batch-split tables quote the median of per-round ratios, computed here by hand."""
    lines = [json.loads(l) for l in open(FIXTURE)]
    written = bench_report.main(["--results", FIXTURE, "--out-dir", str(tmp_path),
                                 "--validation", str(tmp_path / "absent.json"), "--accuracy", str(tmp_path / "no.json")])
    text = {os.path.basename(p).rsplit("-", 3)[0]: open(p).read() for p in written}
    e2e = next(r for r in lines if r["study"] == "e2e" and r["config"]["cluster"]["name"] == "eth_25g")
    ratios = sorted(m / o for m, o in zip(e2e["variants"]["megatron"]["step_s"], e2e["variants"]["oases"]["step_s"]))
    cell = f"{sum(ratios) / 2:.2f}x ({ratios[0]:.2f}-{ratios[1]:.2f})"  # two rounds: the median is the mean
    row = next(l for l in text["e2e"].splitlines() if l.startswith("| gpt") and "eth_25g" in l)
    assert row.split(" | ")[1] == cell
    split = next(r for r in lines if r["study"] == "batch_split")
    full, half = split["variants"]["none@b8"]["step_s"], split["variants"]["none@b4"]["step_s"]
    per_round = sorted((4 / h) / (8 / f) for f, h in zip(full, half))
    h = split["config"]["model"]["hidden_size"]
    expected = f"| {h} | {8 * split['config']['model']['seq_len'] / statistics.median(full):,.0f} |"
    assert any(l.startswith(expected) and f"({per_round[0]:.3f}-{per_round[1]:.3f})" in l
               for l in text["batch_split"].splitlines())


def test_weak_scaling_simulation_from_fixture(tmp_path):
    """DP > 1 rows are marked simulated and add the same reduction time to every schedule."""
    import importlib.util
    import json as _json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("weak_scaling_sim", os.path.join(root, "benchmarks", "weak_scaling_sim.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    out = tmp_path / "sim.json"
    sim.main(["--results", os.path.join(root, "tests", "fixtures", "bench_lines.jsonl"), "--out-dir", str(tmp_path),
              "--json-out", str(out), "--dp", "1,2,8"])
    rows = _json.loads(out.read_text())["rows"]
    assert [r["dp"] for r in rows] == [1, 2, 8] and [r["simulated"] for r in rows] == [False, True, True]
    assert rows[0]["reduce_s"] == 0 and rows[1]["reduce_s"] < rows[2]["reduce_s"]
    base = {k: v["step_s"] for k, v in rows[0].items() if isinstance(v, dict)}
    for row in rows[1:]:
        for name, step in base.items():
            assert row[name]["step_s"] == pytest.approx(step + row["reduce_s"])
    assert any(p.name.startswith("weak_scaling_simulated-") for p in tmp_path.iterdir())


def test_weak_scaling_with_stages_rows_and_the_measured_hook(tmp_path):
    """--stages: each PP's row is plan_stages' 1F1B step (+ the DP reduction from DP 2 on), and a
    bench record with pipeline_stages (what the pipeline runtime will write) lands in its row."""
    import importlib.util
    import json as _json

    from support import random_table

    from oases_ds.parallel.link import LinkModel
    from oases_ds.planner.stages import PipelineSpec, p2p_ms, plan_stages

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("weak_scaling_sim", os.path.join(root, "benchmarks", "weak_scaling_sim.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    results = tmp_path / "bench.jsonl"
    results.write_text(_json.dumps({"study": "weak_scaling", "pipeline_stages": 2, "data_parallel_size": 1,
                                    "variants": {"oases": {"median_s": 1.25}}}) + "\n" + _json.dumps({"study": "x"}) + "\n")
    measured = sim.measured_pipeline_steps(str(results))
    assert measured == {("oases", 2, 1): 1.25}
    staged = {"study": "weak_scaling_stages", "pipeline_stages": 1, "data_parallel_size": 2, "tensor_parallel_size": 2,
              "pipeline_micro_batches": 4, "config": {"model": {"family": "gpt", "hidden_size": 128, "num_layers": 8,
                                                               "seq_len": 128}},
              "variants": {"megatron": {"median_s": 2.5, "micro_batch": 4}}}
    other = {**staged, "pipeline_micro_batches": 8, "variants": {"megatron": {"median_s": 9.0, "micro_batch": 4}}}
    results.write_text("\n".join(_json.dumps(r) for r in (staged, other)) + "\n")
    dims = {"num_layers": 8, "tmp": 2, "micro_batch": 4, "micro_batches": 4}
    assert sim.measured_pipeline_steps(str(results), dims) == {("megatron", 1, 2): 2.5}  # m = 8 ran other dims
    assert sim.measured_pipeline_steps(str(results), {**dims, "micro_batch": 8}) == {}
    table = random_table(3, 4)
    link = LinkModel(1.0, 10.0)
    uniform = sim.uniform_table(table)  # what the measured runs train: every block at T
    assert uniform.degrees == (table.devices,) and uniform.blocks["attn"][4] == table.blocks["attn"][4]
    for degrees, planned in (("learnt", table), ("uniform", uniform)):
        rows = sim.stage_rows({"oases": table}, [1, 2], [1, 4], 6, 8, 16, link, measured, degrees)
        by = {(r["pp"], r["dp"]): r for r in rows}
        for pp in (1, 2):
            expected = plan_stages(planned, PipelineSpec(pp, 6, p2p_ms(table)), None)
            assert by[pp, 1]["pipeline_ms"] == pytest.approx(expected.step_ms) and by[pp, 1]["reduce_s"] == 0
            assert by[pp, 1]["split"] == expected.layer_counts() and by[pp, 4]["reduce_s"] > 0
            assert by[pp, 4]["step_s"] == pytest.approx(expected.step_ms / 1e3 + by[pp, 4]["reduce_s"])
        assert by[2, 1]["measured_step_s"] == 1.25 and by[1, 1]["measured_step_s"] is None


NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")  # 3,757 is one number
# numbers a report states by construction, not about its data: where to look in the paper, which rank
# a lane was recorded on, the baseline's speedup over itself
BY_CONSTRUCTION = re.compile(r"\b(?:Fig\.|Table) [0-9IVX]+|\brank 0\b|1\.00x \(1\.00-1\.00\)")
DIGITS = str.maketrans("0123456789", "5678901234")  # no digit maps to itself


def _perturb(obj, salt: int, path: str = ""):
    """Every number of ``obj`` scaled by its own factor in [1.3, 2.9) (ints: also + 1, so 0 and 1 move),
    every digit in every string and data label shifted by 5; study names kept (the report branches on them)."""
    if isinstance(obj, bool) or obj is None:
        return obj
    factor = 1.3 + zlib.crc32(f"{salt}:{path}".encode()) % 1600 / 1000
    if isinstance(obj, int):
        return round(obj * factor) + 1
    if isinstance(obj, float):
        return obj * factor + factor / 100
    if isinstance(obj, str):
        return obj.translate(DIGITS)
    if isinstance(obj, list):
        return [_perturb(x, salt, f"{path}/{i}") for i, x in enumerate(obj)]
    return {(k if k.isidentifier() else k.translate(DIGITS)): v if k == "study" else _perturb(v, salt, f"{path}/{k}")
            for k, v in obj.items()}  # labels ("none@b8", "65536") change, schema keys ("gantt_rank0") do not


def _consistent(record: dict) -> dict:
    """Re-derive what oases-bench derives from the per-round step times (median, min, max, tokens/s)."""
    for v in record["variants"].values():
        steps = v["step_s"]
        v.update(median_s=statistics.median(steps), min_s=min(steps), max_s=max(steps))
        v["tokens_per_s"] = v["tokens_per_step"] / v["median_s"]
    return record


def _consistent_accuracy(acc: dict) -> dict:
    for row in acc["rows"]:
        row["min_ms"], row["measured_ms"], row["max_ms"] = sorted((row["min_ms"], row["measured_ms"], row["max_ms"]))
    return acc


def _report_lines(text: str, hide: list[str]) -> list[str]:
    """Prose and table rows (not table headers) with the test's own paths and the study names hidden."""
    lines = text.splitlines()
    kept = []
    for i, line in enumerate(lines):
        if line.startswith("|") and (line.startswith("|---") or (i + 1 < len(lines) and lines[i + 1].startswith("|---"))):
            continue
        for h in hide:
            line = line.replace(h, "<hidden>")
        kept.append(BY_CONSTRUCTION.sub("<constant>", line))
    return kept


def _aligned_numbers(line: str, other: str) -> list[tuple[str, str]]:
    """Pairs (number of ``line``, number of ``other``) that stand in the same text context: the two lines
    are split into text and numbers and aligned on the text, so an added column or list item shifts nothing."""
    split = re.compile(f"({NUMBER.pattern})").split
    mine, theirs = split(line), split(other)  # text, number, text, number, ..., text
    mask = lambda parts: [p if i % 2 == 0 else "#" for i, p in enumerate(parts)]
    pairs = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, mask(mine), mask(theirs), autojunk=False).get_opcodes():
        if tag == "equal":
            pairs += [(mine[i], theirs[j]) for i, j in zip(range(i1, i2), range(j1, j2)) if i % 2 == 1]
    return pairs


def _surviving_numbers(before: list[str], after: list[str]) -> tuple[list[tuple[str, str]], int]:
    """Numbers of ``before`` found unchanged at the same place in ``after``.  Lines are paired by their
    text with numbers masked (a line whose text changed too is paired with the most similar one), numbers
    within a pair by :func:`_aligned_numbers`.  A zero may stay (a perturbed tiny value still rounds to it).
    Returns (survivors as (number, line), how many numbers were compared)."""
    mask = lambda line: NUMBER.sub("#", line)
    a, b = [mask(l) for l in before], [mask(l) for l in after]
    survivors, compared = [], 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag not in ("equal", "replace"):
            continue
        for k, i in enumerate(range(i1, i2)):
            j = j1 + k if tag == "equal" else max(range(j1, j2), key=lambda j: difflib.SequenceMatcher(None, a[i], b[j]).ratio())
            pairs = _aligned_numbers(before[i], after[j])
            compared += len(pairs)
            survivors += [(x, before[i]) for x, y in pairs if x == y and float(x.replace(",", "")) != 0]
    return survivors, compared


def _accuracy_result() -> dict:
    rows = [{"attn": [2, 2], "mlp": [2, 2], "predicted_ms": 41.5, "measured_ms": 44.0, "min_ms": 43.1, "max_ms": 47.9},
            {"attn": [1, 2], "mlp": [2, 1], "predicted_ms": 52.25, "measured_ms": 50.5, "min_ms": 49.0, "max_ms": 53.3,
             "is_solver_plan": True},
            {"attn": [1, 1], "mlp": [1, 1], "predicted_ms": 61.0, "measured_ms": 66.75, "min_ms": 64.2, "max_ms": 70.1}]
    return {"time": "2026-11-29T13:40:10+00:00", "git_commit": "97a26c7be9aa", "spearman": 0.5, "p_value": 0.667,
            "table_key": "gpt-v256-h128|cpu_0_2g@0.2Gbps", "rows": rows,
            "link": {"bandwidth_gbps": 0.2, "latency_us": 50.0, "sharing": "ring"},
            "machine": {"platform": "Linux-6.18", "cpu_count": 2, "python": "3.11.7"},
            "config": {"model": {"family": "gpt", "hidden_size": 128, "num_layers": 4, "seq_len": 128}, "devices": 2,
                       "micro_batch": 8, "schedule": {"name": "oases"}, "accuracy": {"warmup": 2, "repeats": 5}}}


def test_every_number_in_a_report_follows_its_data(tmp_path, monkeypatch):
    """Perturb every number (and digit) of the results, write each record and plan twice (so counts change
    too), regenerate: no number of the first reports may survive where it stands.  A hand-written number in a
    note (e.g. "r = 1.66", "0-4% at h128") stays put and fails this."""
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **k: None)  # text only: skip rendering
    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout", lambda *a, **k: None)
    records = [json.loads(l) for l in open(FIXTURE)]
    original, perturbed = tmp_path / "a", tmp_path / "b"
    for d in (original, perturbed):
        d.mkdir()
    validation = json.loads(open(_validation(tmp_path, 0.989, "PASS: fair, 1.1% (bar: 10%)")).read())
    inputs = {original: (records, validation, _accuracy_result()),
              perturbed: ([_consistent(_perturb(r, 1)) for r in records for _ in range(2)],
                          _perturb(validation, 1), _consistent_accuracy(_perturb(_accuracy_result(), 1)))}
    inputs[perturbed][2]["rows"] *= 2
    reports = {}
    for d, (lines, val, acc) in inputs.items():
        (d / "lines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (d / "validation.json").write_text(json.dumps(val))
        (d / "acc.json").write_text(json.dumps(acc))
        written = bench_report.main(["--results", str(d / "lines.jsonl"), "--out-dir", str(d / "rep"),
                                     "--validation", str(d / "validation.json"), "--accuracy", str(d / "acc.json")])
        reports[d] = {os.path.basename(p).split("-")[0]: open(p).read() for p in written}
    assert reports[original].keys() == reports[perturbed].keys() and "e2e" in reports[original]
    hide = [os.path.relpath(str(tmp_path), REPO_ROOT), str(tmp_path)] + sorted({r["study"] for r in records})
    failures, compared = [], 0
    for study, text in reports[original].items():
        before = _report_lines(text, hide)
        after = _report_lines(reports[perturbed][study].replace(f"{perturbed.name}/", f"{original.name}/"), hide)
        survivors, n = _surviving_numbers(before, after)
        compared += n
        failures += [f"{study}: {x!r} in {line[:160]!r}" for x, line in survivors]
    assert compared > 500  # the check looked at the reports' numbers, not at an empty diff
    assert not failures, "numbers that did not follow the data:\n" + "\n".join(failures)


def _validation(tmp_path, oases_fair_ratio: float, verdict_fair: str) -> str:
    kinds = ("nominal", "probed_fifo", "probed_fair", "probed_ring")
    row = lambda fair: {**{f"{k}_{s}": v for k in ("shaped",) + kinds
                          for s, v in (("median_s", 0.5), ("min_s", 0.4), ("max_s", 0.6))},
                        "nominal_ratio": 0.9, "probed_fifo_ratio": 0.95, "probed_fair_ratio": fair,
                        "probed_ring_ratio": 0.97}
    v = {"status": "ok", "description": "fixture", "probe_s": {"65536": 0.003}, "rate_mbit": 200, "mtu": 9000,
         "burst_bytes": 18028, "kinds": list(kinds[:-1]) + ["probed_ring"],
         "verdicts": {"probed_fifo": "PASS: fifo", "probed_fair": verdict_fair, "probed_ring": "PASS: ring"},
         "probed_link": {"bandwidth_gbps": 0.19, "latency_us": 0.0},
         "schedules": {"megatron": row(1.01), "oases": row(oases_fair_ratio)},
         "host_cost": {"shaped": {"allreduce_bytes": 2 << 20, "cpu_s_per_allreduce": 0.005,
                                  "compute_slowdown_beside_allreduce": 1.33}},
         "compute_busy_median_s": {"shaped": {"megatron": 0.33, "oases": 0.328}}}
    path = tmp_path / f"validation-{oases_fair_ratio}.json"
    path.write_text(json.dumps(v))
    return str(path)


def test_validation_section_states_host_cost_and_the_verdict(tmp_path):
    passed = _validation(tmp_path, 0.989, "PASS: fair, 1.1%")
    text = "\n".join(report.validation_section(passed, "fair"))
    assert "5.0 ms CPU per 2048 KiB AllReduce" in text and "1.33x slower" in text
    assert "| `oases` | 0.328 |" in text and "Verdict: PASS: fair, 1.1%" in text and "Verdict: PASS: ring" in text
    assert "probed, ring: median s (min-max)" in text
    assert "within 1.1%" in report.validation_caution(passed, "fair")[0]
    assert "within 3.0%" in report.validation_caution(passed, "ring")[0]  # worst ring ratio 0.97
    failed = _validation(tmp_path, 0.83, "FAIL: fair, 17.0%")
    caution = report.validation_caution(failed, "fair")[0]
    assert "Caution" in caution and "`oases` at 0.83x" in caution


def test_validation_files_from_before_the_ring_model_still_read(tmp_path):
    old_row = {f"{k}_{s}": 0.5 for k in ("shaped", "nominal", "probed", "probed_fair") for s in ("median_s", "min_s", "max_s")}
    old_row.update(nominal_ratio=0.9, probed_ratio=0.8, probed_fair_ratio=0.85)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"status": "ok", "schedules": {"oases": old_row}, "verdict": "FAIL: fifo 20%",
                                "verdict_fair": "FAIL: fair 15%", "rate_mbit": 200, "burst_bytes": 32768}))
    v = report._load_validation(str(path))
    assert v["kinds"] == ["nominal", "probed_fifo", "probed_fair"]
    assert v["schedules"]["oases"]["probed_fifo_ratio"] == 0.8 and "probed_ratio" not in v["schedules"]["oases"]
    assert "`oases` at 0.85x" in report.validation_caution(str(path), "fair")[0]


def _load_validate_link():
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_link", os.path.join(ROOT, "benchmarks", "validate_link.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_link_probe_fit_recovers_bandwidth_and_latency():
    vl = _load_validate_link()
    probe = {b: 80e-6 + 8 * b / 0.2e9 for b in vl.PROBE_SIZES}
    gbps, latency_us = vl.fit_link(probe)
    assert gbps == pytest.approx(0.2, rel=1e-9) and latency_us == pytest.approx(80, rel=1e-6)
    assert vl.payload_fraction(1500) == pytest.approx(1448 / 1514) and vl.payload_fraction(9000) == pytest.approx(8948 / 9014)


@pytest.mark.parametrize("args,message", [(["--mtu", "100"], "--mtu must be between"),
                                          (["--mtu", "9000", "--burst-bytes", "4000"], "--burst-bytes must be >= one frame")])
def test_validate_link_rejects_bad_shaping_in_one_line(args, message, monkeypatch):
    """Its ``main`` in this process: it exits with the one line (``sys.exit(text)``) before any shaping."""
    vl = _load_validate_link()
    monkeypatch.setattr(sys, "argv", ["validate_link.py", *args])
    with pytest.raises(SystemExit) as exc:
        vl.main()
    line = str(exc.value.code)
    assert message in line and len(line.splitlines()) == 1 and line.startswith("error: ")


@pytest.mark.distributed
@pytest.mark.parametrize("preset", PLAN_PRESETS)
def test_every_planner_preset_runs_and_reports(tmp_path, preset):
    """`oases-plan experiment=cost_model` on the tiny model (3 plans, 1 untimed-warm-up-free round each),
    then its report: the study a user runs, shrunk, nothing timed."""
    acc = tmp_path / "acc.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "oases_ds.cli.plan", f"experiment={preset}", "model=gpt_tiny",
                           "accuracy.plans=3", "accuracy.warmup=0", "accuracy.repeats=1", f"accuracy.out={acc}",
                           f"out={tmp_path / 'plan.json'}", f"planner.cache_dir={tmp_path / 'cache'}", "timeout_s=300"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(acc.read_text())
    assert len(result["rows"]) == 3 and result["config"]["study"] == preset and result["link"]["bandwidth_gbps"] == 0.2
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in result["rows"])
    written = bench_report.main(["--results", FIXTURE, "--out-dir", str(tmp_path / "rep"), "--study", preset,
                                 "--accuracy", str(acc)])
    text = open(written[-1]).read()
    assert f"**Spearman rank correlation, predicted vs measured: {result['spearman']:.3f}**" in text
    plan_rows = [l for l in text.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert len(plan_rows) == 3 and (tmp_path / "rep" / (os.path.basename(written[-1])[:-3] + "-scatter.png")).exists()


@pytest.mark.parametrize("args", [["experiment=cost_model"], ["--multirun", "experiment=e2e,cost_model"]])
def test_oases_bench_points_planner_presets_to_oases_plan(args, capsys, monkeypatch, tmp_path):
    assert "run `oases-plan experiment=cost_model`" in refused(capsys, monkeypatch, tmp_path, bench, *args)


def test_oases_plan_points_bench_presets_to_oases_bench(tmp_path, capsys, monkeypatch):
    line = refused(capsys, monkeypatch, tmp_path, plan_cli, "experiment=e2e", f"out={tmp_path / 'p.json'}")
    assert "run `oases-bench --multirun experiment=e2e`" in line
    assert not (tmp_path / "p.json").exists() and not (tmp_path / ".oases").exists()  # refused before profiling


@pytest.mark.distributed
@pytest.mark.parametrize("devices", [2, 1])
def test_the_recompute_policies_benchmark_runs_its_path_on_tiny_dims(tmp_path, devices):
    """``benchmarks/recompute_policies.py --measure --quick``'s path: profile, the two uniform peaks,
    a plan per limit, the interleaved steps.  Only structure and memory are checked (no timing bar):
    storing every block holds more than recomputing every block, a plan under a higher limit is
    predicted no slower than one under a lower limit, each plan keeps to its limit by its own bound,
    and each plan's replayed peak is within 10% of its measured one."""
    from oases_ds.bench.e2e import QUICK_MODEL
    from oases_ds.bench.policies import measure as measure_policies

    result = measure_policies(QUICK_MODEL, repeats=1, cache_dir=None, timeout_s=300, devices=devices)
    assert result["devices"] == devices and result["device"] == "cpu"
    assert result["limits_from"]["all-store"] > result["limits_from"]["all-oases"]
    planned = [row for row in result["rows"] if "variant" in row]
    assert planned, result["rows"]
    assert [row["limit_bytes"] for row in result["rows"]] == sorted((row["limit_bytes"] for row in result["rows"]),
                                                                    reverse=True)
    # a higher limit only widens the plans to choose from, so the optimum's predicted step cannot grow
    # (how many blocks it stores may: on tiny dims the profile can rank a stored block slower)
    predicted = [row["predicted_step_ms"] for row in planned]
    assert all(hi <= lo * (1 + 1e-6) for hi, lo in zip(predicted, predicted[1:])), planned
    for row in planned:
        assert row["predicted_bound_bytes"] <= row["limit_bytes"] * (1 + 1e-6), row
    # at the planner's own bound of the all-recompute plan that plan fits, so some plan is found
    assert any(row["limit"] == "recompute-everything-bound" for row in planned), result["rows"]
    assert len(result["step_ms"]["all-store"][0]) == 1 and all(row["all_store_ms"] > 0 for row in planned)
    for row in planned:
        assert row["measured_peak_bytes"] <= row["limit_bytes"] * 1.10
        assert abs(row["replay_error"]) <= 0.10, row
        assert len(result["step_ms"][row["variant"]][0]) == 1  # one timed step per rank


def test_the_recompute_policies_report_is_the_render_of_the_stored_json(tmp_path):
    """The committed report is what ``--report-only`` renders from the committed JSONs (nothing in it
    hand-written), and its cells are the JSON's: the midpoint's gap closed and the slower rank's median
    step, recomputed here from the per-rank steps."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import recompute_policies as bench_policies
    finally:
        sys.path.pop(0)
    measured = os.path.join(ROOT, "benchmarks", "results", "recompute_policies_measured.json")
    with open(measured) as f:
        result = json.load(f)
    committed = os.path.join(ROOT, "benchmarks", "reports", f"recompute_policies-{result['time'][:10]}.md")
    out = bench_policies.write_report(measured, bench_policies.ANALYTIC_OUTS, str(tmp_path / "r.md"))
    with open(out) as f, open(committed) as g:
        text = f.read()
        assert text == g.read(), "rerun `python benchmarks/recompute_policies.py --report-only`"
    mid = next(r for r in result["rows"] if r["limit"] == "midpoint")
    steps = [max(ranks) for ranks in zip(*result["step_ms"][mid["variant"]])]
    assert statistics.median(steps) == pytest.approx(mid["planned_ms"])
    row = next(line for line in text.splitlines() if line.startswith("| midpoint |"))
    assert f"| {mid['gap_closed_vs_all_store']:.2f} |" in row and f"| {mid['planned_ms']:.0f} |" in row
    assert "| recompute-everything | " in text and "no plan" in text  # the infeasible limit is shown, not dropped


@pytest.mark.distributed
def test_the_micro_batch_overlap_study_runs_its_path_on_tiny_dims(tmp_path):
    """``benchmarks/micro_batch_overlap.py --quick``: a step of 4 micro-batches one after the other and
    overlapped, each policy, at every ratio; the overlapped step moves exactly the sequential one's
    bytes, and every step's compute and link time (summed over its micro-batches) are measured."""
    out = tmp_path / "mbo.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "micro_batch_overlap.py"), "--quick",
                           "--out", str(out)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["micro_batches_per_step"] == 4 and set(result["ratios"]) == {"0.5", "0.9", "2.0"}
    for data in result["ratios"].values():
        rows = data["variants"]
        assert set(rows) == {"oases", "oases-overlap", "store", "store-overlap"}
        for policy in ("oases", "store"):
            assert rows[f"{policy}-overlap"]["wire_bytes"] == rows[policy]["wire_bytes"] > 0
        for row in rows.values():
            assert len(row["step_s"]) == 1 and row["compute_s"][0] > 0 and row["link_s"][0] > 0
    assert "| 0.9 | oases | " in proc.stdout and "overlapped / sequential" in proc.stdout
