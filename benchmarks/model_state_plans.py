"""Model states, planned: what fits on 24 GB cards with ZeRO, optimizer offload and sequence parallelism.

Not a measurement: the planner's prediction (``cost=analytic``: FLOPs / device throughput, the
link model, the replayed memory model with the model states priced by
:class:`~oases_ds.planner.costs.ModelStates`) for clusters this machine is not.  Each case is
planned as ``oases-plan planner.recompute=auto precision=bf16 zero_stage=Z offload=O
data_parallel_size=D sequence_parallel=S memory_limit=22GiB`` plans it: one TMP-8 group of RTX
3090s over PCIe (``cluster=pcie_3090``), micro-batch 2, seq 4096; the planner picks each block's
policy (store / recompute / under sequence parallelism also keep-the-gather).

Configurations (issue 41): LLaMA-7B and LLaMA-13B on one 8 x 24 GB server (DP 1: ZeRO has
nothing to split; offload needs ZeRO 1 or 2, which at DP 1 only moves the optimizer to the
host) and on two such servers (DP 2: ZeRO-1, ZeRO-2, ZeRO-2 with offload), each without and
with sequence parallelism.  bf16 and fp16 hold the same bytes (fp16 adds only the loss scale),
so one precision stands for both.

What the planned step leaves out, so read it as the TMP group's step only: the optimizer's own
time (under offload it runs on the host CPUs, DeepSpeed's CPU Adam, and the gradients and
updated weights cross PCIe each step), and the DP gradient reduction between the two servers.
Both grow with offload and with DP; the table cannot show that cost.

    python benchmarks/model_state_plans.py                # writes results/model_state_plans.json + report
    python benchmarks/model_state_plans.py --report-only  # the report from the stored JSON
"""
from __future__ import annotations

import os
import sys
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sequence_parallel_plans import LLAMA_7B, LLAMA_13B, plan_case  # noqa: E402

from oases_ds.bench.provenance import git_commit, study_main  # noqa: E402
from oases_ds.planner.costs import ModelStates  # noqa: E402

GiB = 2**30
LIMIT_GIB = 22
MODELS = (("llama_7b", LLAMA_7B), ("llama_13b", LLAMA_13B))
CONFIGURATIONS = (  # servers (= DP size), ZeRO stage, offload
    (1, 0, False), (1, 1, True),
    (2, 0, False), (2, 1, False), (2, 2, False), (2, 2, True),
)
BASELINE = ("llama_7b", 1, 0, False, False)
"""Today's plan the issue names: LLaMA-7B on one server, ZeRO 0, no offload, no sequence parallelism."""


def run() -> dict:
    rows = []
    for name, model in MODELS:
        for servers, zero, offload in CONFIGURATIONS:
            states = ModelStates("bf16", zero, offload, servers)
            for sp in (False, True):
                row = plan_case(f"{name}_s4096_{servers}x8x3090", model, "pcie_3090", 8, 2, 1, None, LIMIT_GIB, sp, states)
                rows.append({**row, "model": name, "servers": servers, "zero_stage": zero, "offload": offload,
                             "bytes_per_param": states.bytes_per_param()})
                print(_line(rows[-1]), flush=True)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "source": "oases_ds.planner (cost=analytic, planner.recompute=auto, replayed steps, ModelStates); "
                      "nothing measured", "rows": rows}


def _key(r: dict) -> tuple:
    return (r["model"], r["servers"], r["zero_stage"], r["offload"], r["sequence_parallel"])


def _line(r: dict) -> str:
    head = (f"{r['model']:9s} {r['servers']} server(s) ZeRO {r['zero_stage']}{' +offload' if r['offload'] else ''} "
            f"sp={int(r['sequence_parallel'])}:")
    if not r["fits"]:
        return f"{head} does not fit ({r['reason']})"
    return f"{head} step {r['step_ms']:.0f} ms, {r['memory_bytes'] / GiB:.2f} GiB, stored {r['stored']}/{r['blocks']}"


def table(result: dict) -> str:
    rows = result["rows"]
    base = next((r for r in rows if _key(r) == BASELINE and r["fits"]), None)
    lines = [f"Planned {result['date']} at {result['git_commit']}: {result['source']}.  Limit {LIMIT_GIB} GiB "
             f"({LIMIT_GIB * GiB:,} bytes) per card; one TMP-8 group per server; the step excludes the optimizer's "
             "time and the DP reduction between servers (see above).", "",
             "| model | servers (DP) | ZeRO | optimizer | sequence parallel | model states (B/param) | fits | "
             "per-rank bound (bytes) | model states (bytes) | blocks stored / gathered / recomputed | planned step (ms) "
             "| vs. 1 server, ZeRO 0, no SP |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = "host (offload)" if r["offload"] else "device"
        head = (f"| {r['model']} | {r['servers']} | {r['zero_stage']} | {where} | {'on' if r['sequence_parallel'] else 'off'} "
                f"| {r['bytes_per_param']:g} |")
        if not r["fits"]:
            lines.append(f"{head} no: {r['reason']} | | | | | |")
            continue
        speed = f"{base['step_ms'] / r['step_ms']:.3f}x" if base is not None and r["model"] == base["model"] else ""
        states = r.get("peak_terms_bytes", {}).get("states")
        lines.append(f"{head} yes | {r['memory_bytes']:,.0f} | {'' if states is None else f'{states:,.0f}'} "
                     f"| {r['stored']} / {r['gathered']} / {r['recomputed']} of {r['blocks']} | {r['step_ms']:.1f} | {speed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    study_main("model_state_plans", __doc__, run, table, "Model states, planned (analytic)", slice(1, 4))
