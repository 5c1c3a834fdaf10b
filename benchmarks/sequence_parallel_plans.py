"""Sequence parallelism, planned: what fits on 24 GB cards and the planned step, with and without it.

Not a measurement: the planner's prediction (``cost=analytic``: FLOPs / device throughput, the
link model, the replayed memory model; fp16 activations, mixed-precision Adam at 16 bytes per
parameter) for clusters this machine is not.  Each case is planned as ``oases-plan
planner.recompute=auto`` plans it, with ``sequence_parallel`` off and on at the same memory limit;
the planner picks each block's policy (``store`` / ``oases`` / under sequence parallelism also
``oases_gathered``) and, without sequence parallelism, its degree (``planner.min_degree`` = the
TMP group, as the issue's measurement).  A case that does not fit is reported with the planner's
one-line reason.

Cases (issue 40): LLaMA-7B at seq 4096 and LLaMA-13B at seq 4096 on one 8 x RTX 3090 server
(TMP 8 over PCIe, 22 GiB per card), and GPT-39.1B on the paper's 32 x 3090 (4 pipeline stages of
TMP 8, stages over 25 Gbit/s Ethernet).  The 7B case is also planned without sequence parallelism
at 40 GiB: the step with every block stored, the ceiling the issue names.

    python benchmarks/sequence_parallel_plans.py                # writes results/sequence_parallel_plans.json + report
    python benchmarks/sequence_parallel_plans.py --report-only  # the report from the stored JSON
"""
from __future__ import annotations

import os
import sys
from datetime import datetime, timezone

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.bench.provenance import git_commit, study_main  # noqa: E402
from oases_ds.models.config import ModelConfig  # noqa: E402
from oases_ds.parallel.link import link_from_config  # noqa: E402
from oases_ds.planner.analytic import DeviceModel  # noqa: E402
from oases_ds.planner.costs import ModelStates  # noqa: E402
from oases_ds.planner.plan import PlanInfeasibleError  # noqa: E402
from oases_ds.planner.planning import PipelineRequest, PlanRequest, make_plan  # noqa: E402
from oases_ds.planner.profile import ProfileSpec  # noqa: E402

CONFIGS = os.path.join(ROOT, "oases_ds", "configs")
GiB = 2**30

LLAMA_7B = dict(family="llama", vocab_size=32000, hidden_size=4096, num_heads=32, num_layers=32, ffn_size=11008,
                seq_len=4096, dropout=0.0)
LLAMA_13B = dict(family="llama", vocab_size=32000, hidden_size=5120, num_heads=40, num_layers=40, ffn_size=13824,
                 seq_len=4096, dropout=0.0)
CASES = (  # name, model, cluster, devices (TMP), micro_batch, pipeline stages, stage link Gbit/s, limit GiB
    ("llama_7b_s4096_8x3090", LLAMA_7B, "pcie_3090", 8, 2, 1, None, 22),
    ("llama_13b_s4096_8x3090", LLAMA_13B, "pcie_3090", 8, 2, 1, None, 22),
    ("gpt_39_1b_32x3090_pp4", "gpt_39_1b", "pcie_3090", 8, 4, 4, 25.0, 22),
)
CEILING = ("llama_7b_s4096_8x3090", 40)  # without sequence parallelism at 40 GiB: every block stored


def _yaml(group: str, name: str) -> dict:
    with open(os.path.join(CONFIGS, group, f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def plan_case(name: str, model: dict | str, cluster_name: str, devices: int, micro_batch: int, stages: int,
              stage_gbps: float | None, limit_gib: float, sp: bool, states: ModelStates = ModelStates()) -> dict:
    """One case planned as ``oases-plan planner.recompute=auto`` plans it, model states priced at ``states``."""
    cfg = ModelConfig(**(_yaml("model", model) if isinstance(model, str) else model))
    cluster = _yaml("cluster", cluster_name)
    spec = ProfileSpec(model=cfg, devices=devices, micro_batch=micro_batch, link=link_from_config(cluster["link"]),
                       cluster=cluster["name"], min_degree=devices, sequence_parallel=sp)
    request = PlanRequest(profile=spec, cost="analytic", device=DeviceModel.from_cluster(cluster), cache_dir=None,
                          memory_limit_bytes=limit_gib * GiB, recompute="auto",
                          pipeline=PipelineRequest(stages, None, stage_gbps) if stages > 1 else None,
                          model_states=states)
    row = {"case": name, "sequence_parallel": sp, "limit_bytes": limit_gib * GiB, "devices": devices,
           "micro_batch": micro_batch, "pipeline_stages": stages, "layers": cfg.num_layers}
    try:
        result = make_plan(request)
    except PlanInfeasibleError as err:
        return {**row, "fits": False, "reason": str(err)}
    plan = result.plan
    policies = plan.block_policies()
    row.update(fits=True, step_ms=plan.predicted_step_ms, memory_bytes=plan.memory_bytes,
               blocks=len(policies), stored=policies.count("store"), gathered=policies.count("oases_gathered"),
               recomputed=policies.count("oases"))
    if result.stages is not None:
        row["step_ms"] = result.stages.staged.step_ms
        row["memory_bytes"] = max(s.memory_bytes for s in result.stages.staged.stages)
    if result.memory is not None:
        row["peak_terms_bytes"] = {"states": result.memory.state_bytes, **result.memory.terms}
    return row


def run() -> dict:
    rows = []
    for case in CASES:
        for sp in (False, True):
            rows.append(plan_case(*case, sp=sp))
            print(_line(rows[-1]), flush=True)
    name, limit = CEILING
    ceiling = next(c for c in CASES if c[0] == name)
    rows.append(plan_case(*ceiling[:-1], limit, sp=False))
    print(_line(rows[-1]), flush=True)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "source": "oases_ds.planner (cost=analytic, planner.recompute=auto, replayed steps); nothing measured",
            "rows": rows}


def _line(r: dict) -> str:
    head = f"{r['case']:24s} sp={int(r['sequence_parallel'])} {r['limit_bytes'] / GiB:.0f} GiB:"
    if not r["fits"]:
        return f"{head} does not fit ({r['reason']})"
    return (f"{head} step {r['step_ms']:.0f} ms, {r['memory_bytes'] / GiB:.2f} GiB, stored {r['stored']}/{r['blocks']}, "
            f"gathered {r['gathered']}, recomputed {r['recomputed']}")


def table(result: dict) -> str:
    rows = result["rows"]
    base = {r["case"]: r for r in rows if not r["sequence_parallel"] and r["limit_bytes"] == 22 * GiB}
    lines = ["| case | limit (bytes) | sequence parallel | fits | planned step (ms) | speed vs. the 22 GiB plan without SP | per-rank bound (bytes) "
             "| blocks stored / gathered / re-gathered or recomputed | peak terms (bytes) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        limit = f"{r['limit_bytes']:,.0f}"
        sp = "on" if r["sequence_parallel"] else "off"
        if not r["fits"]:
            lines.append(f"| {r['case']} | {limit} | {sp} | no: {r['reason']} | | | | | |")
            continue
        b = base.get(r["case"])
        speed = f"{b['step_ms'] / r['step_ms']:.3f}x" if b and b.get("fits") and b is not r else ""
        terms = ", ".join(f"{k} {v:,.0f}" for k, v in r.get("peak_terms_bytes", {}).items())
        lines.append(f"| {r['case']} | {limit} | {sp} | yes | {r['step_ms']:.1f} | {speed} | {r['memory_bytes']:,.0f} "
                     f"| {r['stored']} / {r['gathered']} / {r['recomputed']} of {r['blocks']} | {terms} |")
    return "\n".join(lines)


if __name__ == "__main__":
    study_main("sequence_parallel_plans", __doc__, run, table, "Sequence parallelism, planned (analytic)", slice(1, 4))
