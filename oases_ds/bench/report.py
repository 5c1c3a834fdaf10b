"""The JSON lines of ``oases-bench`` -> one dated Markdown report per study.

Each report states the machine, the configuration and whether (and how) the
link was emulated, then per measurement a table of medians with min-max spread
and ratios against Megatron.  Ratios are taken round by round (the variants of
one round ran back to back), so the spread of a ratio is the spread over rounds,
not the spread of two independent medians.  Plots (matplotlib, Agg): throughput
bars, scaling lines, and a compute/comm Gantt chart of one step per schedule
from rank 0's executor timeline.

Every number a report states is computed from the records it reads; the fixed
notes describe the method only.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Any

from oases_ds.bench.provenance import REPO_ROOT
from oases_ds.utils.io import write_text_atomic

BASELINE = "megatron"
MiB = 2**20

STUDY_TITLES = {
    "e2e": "End-to-end step time of every schedule (paper Fig. 6)",
    "ablation": "Ablation of Oases' optimisations (paper Table V)",
    "utilisation": "Compute-lane utilisation per schedule (paper Table IV)",
    "selective": "Selective recomputation vs Oases: time and activation memory (paper Fig. 8)",
    "batch_split": "Batch-split sensitivity: compute-only throughput at full vs half micro-batch (paper Fig. 5)",
    "weak_scaling": "Weak scaling over the DP degree (paper Fig. 10)",
    "cost_model": "Cost-model accuracy: predicted vs measured step time of different plans (paper Fig. 9)",
}

# Notes true by construction of the method (what is measured and how); they state no number.
# Everything numeric a report says about its data is computed from it: see study_notes().
STUDY_NOTES = {
    "ablation": "The planner ablation (Oases with the solver's plan vs every block at the full TMP degree) is "
                "measured by `oases-plan mode=accuracy`, which runs both plans interleaved under the same schedule "
                "and link: see benchmarks/README.md, study (f).",
    "utilisation": "Utilisation here is the fraction of the step during which rank 0's compute lane was busy "
                   "(executor timeline), not the GPU SM efficiency of the paper.",
    "selective": "Peak activation bytes: the largest total, sampled after every instruction of an extra untimed "
                 "step, of tensors the executor holds (its buffers and the autograd-saved tensors), parameters and "
                 "gradients excluded, shared storage counted once. Process RSS is reported separately and covers "
                 "all variants of the run together.",
    "e2e": "Why the gain depends on the link (how the schedules work, not a measurement): overlap hides only "
           "the communication there is; splitting a micro-batch into sub-batches lowers arithmetic density (study "
           "batch_split measures by how much); every collective has a fixed host cost (the gloo call and the "
           "emulator's issue-time exchange) and Oases issues one per sub-batch; `megatron_selective` recomputes "
           "only the attention core, so it skips most of the recompute that Megatron and Oases both pay, at the "
           "activation memory measured in study selective. LLaMA's SwiGLU MLP adds a GEMM per block, lowering "
           "its comm/compute ratio against GPT's at the same hidden size. Compare the paper's Fig. 6.",
}


# -- reading -------------------------------------------------------------------------------------
def load(path: str) -> list[dict[str, Any]]:
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"warning: {path}:{n} is not a JSON line; skipped", file=sys.stderr)
    return records


def record_label(r: dict) -> str:
    m = r["config"]["model"]
    cluster = r["link_emulation"]["cluster"]["name"] if r["link_emulation"]["enabled"] else "no link"
    parts = [f"{m['family']} h{m['hidden_size']} L{m['num_layers']}", cluster]
    if r["data_parallel_size"] > 1 or r["study"] == "weak_scaling":
        parts.append(f"DP{r['data_parallel_size']}")
    return " / ".join(parts)


def round_ratios(base: list[float], other: list[float]) -> list[float]:
    """Per-round speedup of ``other`` over ``base`` (rounds ran back to back)."""
    return [b / o for b, o in zip(base, other)]


def ratio_cell(r: dict, label: str) -> str:
    variants = r["variants"]
    if BASELINE not in variants:
        return "-"
    ratios = round_ratios(variants[BASELINE]["step_s"], variants[label]["step_s"])
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def emulation_line(r: dict) -> str:
    e = r["link_emulation"]
    if not e["enabled"]:
        return "no link emulation"
    c = e["cluster"]
    nominal = f"{c['link']['bandwidth_gbps']:g} Gbit/s, {c['link']['latency_us']:g} us"
    used = f"{e['emulated_bandwidth_gbps']:.4g} Gbit/s, {e['emulated_latency_us']:.3g} us"
    if e["mode"] == "scaled":
        return (f"**EMULATED, scaled** `{c['name']}` (real link {nominal}; device {c['device']['name']}): "
                f"target Megatron comm/compute ratio {e['target_comm_compute_ratio']:.3g} at reference TMP "
                f"{e['reference_tensor_parallel_size']} -> emulated link {used}")
    return f"**EMULATED, literal** `{c['name']}`: {used}"


def comm_mib(v: dict, phase: str) -> float:
    return sum(d["bytes"] for k, d in v["comm_bytes_rank0"].items() if k.startswith(phase + "/")) / MiB


def limit_cell(v: dict) -> str:
    """The median step against its limit max(compute, link time of its traffic) (``-``: a record from before
    the limit was measured)."""
    return f"{v['median_s'] / v['limit_s']:.3f}x" if v.get("limit_s") else "-"


def record_table(r: dict) -> list[str]:
    variants = r["variants"]
    has_mem = any("peak_activation_bytes_per_rank" in v for v in variants.values())
    head = ["variant", "median step s", "min-max s", "tokens/s", f"vs {BASELINE} (min-max)", "exposed comm",
            "compute util", "step / limit", "TMP MiB/step fwd/rec/bwd"]
    if r["data_parallel_size"] > 1:
        head.append("DP sync MiB")
    if has_mem:
        head.append("peak activations MiB/rank")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, v in variants.items():
        row = [f"`{label}`", f"{v['median_s']:.4f}", f"{v['min_s']:.4f}-{v['max_s']:.4f}", f"{v['tokens_per_s']:,.0f}",
               ratio_cell(r, label), f"{v['exposed_comm_frac']:.1%}", f"{v['compute_util']:.1%}", limit_cell(v),
               "/".join(f"{comm_mib(v, p):.2f}" for p in ("forward", "recompute", "backward"))]
        if r["data_parallel_size"] > 1:
            row.append(f"{comm_mib(v, 'grad_sync'):.2f}")
        if has_mem:
            mem = v.get("peak_activation_bytes_per_rank")
            row.append(f"{max(mem) / MiB:.2f}" if mem else "-")
        lines.append("| " + " | ".join(row) + " |")
    return lines


# -- plots -----------------------------------------------------------------------------------------
def _plt():
    # local: matplotlib is slow to import and only the plots need it (and its backend is set first)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(records: list[dict], path: str, title: str) -> None:
    """Grouped bars: tokens/s of each variant normalised to Megatron (or the first variant)."""
    plt = _plt()
    labels = list(dict.fromkeys(l for r in records for l in r["variants"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(records) + 2), 4.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for j, r in enumerate(records):
            if label in r["variants"]:
                base = r["variants"].get(BASELINE) or next(iter(r["variants"].values()))
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                ys.append(r["variants"][label]["tokens_per_s"] / base["tokens_per_s"])
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels([record_label(r).replace(" / ", "\n") for r in records], fontsize=8)
    ax.set_ylabel(f"throughput / {BASELINE}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=min(len(labels), 5), loc="upper left", bbox_to_anchor=(0, -0.22))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gantt(r: dict, path: str) -> bool:
    """One step per variant: compute, comm and wait lanes of rank 0, coloured by sub-batch."""
    variants = {l: v for l, v in r["variants"].items() if v.get("gantt_rank0")}
    if not variants:
        return False
    plt = _plt()
    fig, axes = plt.subplots(len(variants), 1, figsize=(10, 1.25 * len(variants) + 0.9), squeeze=False)
    lanes = {"compute": 2, "comm": 1, "wait": 0}
    colours = {0: "tab:blue", 1: "tab:orange"}
    longest = max(max(e[3] for e in v["gantt_rank0"]) for v in variants.values())
    for ax, (label, v) in zip(axes[:, 0], variants.items()):
        for lane, mb, start, end in v["gantt_rank0"]:
            colour = "tab:red" if lane == "wait" else colours.get(mb, "tab:green")
            ax.broken_barh([(start, max(end - start, 0.01))], (lanes[lane] - 0.4, 0.8), facecolors=colour,
                           alpha=0.55 if lane == "comm" else 0.9, linewidth=0)
        ax.set_yticks(list(lanes.values()))
        ax.set_yticklabels(list(lanes), fontsize=7)
        ax.set_xlim(0, longest * 1.01)
        ax.set_title(f"{label}: {max(e[3] for e in v['gantt_rank0']):.0f} ms, exposed comm {v['exposed_comm_frac']:.0%}",
                     fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ms since step start (rank 0, last timed step); blue/orange = sub-batch 0/1, red = blocked in Sync",
                           fontsize=8)
    fig.suptitle(f"One step per schedule: {record_label(r)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_weak_scaling(records: list[dict], path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    records = sorted(records, key=lambda r: r["data_parallel_size"])
    for label in dict.fromkeys(l for r in records for l in r["variants"]):
        pts = [(r["data_parallel_size"], r["variants"][label]["tokens_per_s"]) for r in records if label in r["variants"]]
        line, = ax.plot(*zip(*pts), marker="o", label=label)
        d0, base = pts[0]  # records are sorted by DP degree: ideal scaling starts at the smallest
        ax.plot([d for d, _ in pts], [base * d / d0 for d, _ in pts], ls=":", color=line.get_color(), label=f"{label} ideal")
    ax.set_xlabel("DP degree (TMP 2 each)")
    ax.set_ylabel("tokens/s (global)")
    ax.set_xticks(sorted({r["data_parallel_size"] for r in records}))
    ax.legend(fontsize=8)
    ax.set_title("Weak scaling (global batch grows with DP)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch_split_rows(records: list[dict]) -> list[tuple[int, float, float, list[float]]]:
    """(hidden, tokens/s at the larger batch, at the smaller, per-round ratios small/large)."""
    rows = []
    for r in sorted(records, key=lambda r: r["config"]["model"]["hidden_size"]):
        vs = sorted(r["variants"].values(), key=lambda v: -v["micro_batch"])
        if len(vs) < 2:
            continue
        full, half = vs[0], vs[-1]
        ratios = [(half["tokens_per_step"] / h) / (full["tokens_per_step"] / f) for f, h in zip(full["step_s"], half["step_s"])]
        rows.append((r["config"]["model"]["hidden_size"], full["tokens_per_s"], half["tokens_per_s"], ratios))
    return rows


def plot_batch_split(records: list[dict], path: str) -> None:
    plt = _plt()
    rows = batch_split_rows(records)
    fig, ax = plt.subplots(figsize=(6, 4))
    hs = [h for h, *_ in rows]
    med = [statistics.median(r) for *_, r in rows]
    ax.errorbar(hs, med, yerr=[[m - min(r) for m, (*_, r) in zip(med, rows)], [max(r) - m for m, (*_, r) in zip(med, rows)]],
                marker="o", capsize=3, label="half / full micro-batch throughput")
    ax.axhline(0.8, color="tab:red", ls=":", label="paper's bound: 20% loss")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(hs)
    ax.set_xticklabels([str(h) for h in hs])
    ax.set_xlabel("hidden size")
    ax.set_ylabel("tokens/s ratio (median, min-max over rounds)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Batch-split sensitivity, compute only (1 CPU thread)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(records: list[dict], path: str) -> None:
    plt = _plt()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.8))
    labels = list(dict.fromkeys(l for r in records for l in r["variants"]))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(records))]
        ax_t.bar(xs, [r["variants"][label]["median_s"] for r in records], width, label=label)
        ax_m.bar(xs, [max(r["variants"][label].get("peak_activation_bytes_per_rank", [0])) / MiB for r in records], width, label=label)
    for ax, ylabel in ((ax_t, "median step s"), (ax_m, "peak activations MiB / rank")):
        ax.set_xticks(range(len(records)))
        ax.set_xticklabels([record_label(r).replace(" / ", "\n") for r in records], fontsize=8)
        ax.set_ylabel(ylabel)
    ax_t.legend(fontsize=8, loc="lower left")
    fig.suptitle("Selective recomputation vs Oases", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the report -----------------------------------------------------------------------------------
def _load_validation(path: str) -> dict[str, Any]:
    """A validate_link result; files from before the ring model (``probed`` = fifo,
    ``verdict``/``verdict_fair``) are read in today's shape (``kinds``, ``verdicts``)."""
    with open(path) as f:
        v = json.load(f)
    if v.get("status") == "ok" and "kinds" not in v:
        rename = {"probed": "probed_fifo"}
        for row in v["schedules"].values():
            for suffix in ("s", "median_s", "min_s", "max_s", "ratio"):
                if f"probed_{suffix}" in row:
                    row[f"probed_fifo_{suffix}"] = row.pop(f"probed_{suffix}")
        v["kinds"] = [k for k in ("nominal", "probed_fifo", "probed_fair")
                      if f"{k}_ratio" in next(iter(v["schedules"].values()))]
        v["verdicts"] = {"probed_fifo": v["verdict"], **({"probed_fair": v["verdict_fair"]} if "verdict_fair" in v else {})}
        v["compute_busy_median_s"] = {rename.get(k, k): per for k, per in v.get("compute_busy_median_s", {}).items()}
    return v


def _kind_label(kind: str) -> str:
    return "nominal rate" if kind == "nominal" else f"probed, {kind.split('_', 1)[1]}"


def validation_section(path: str, sharing: str = "ring") -> list[str]:
    """The emulator-vs-shaped-link comparison for the e2e report, and a line per other saved run."""
    if not os.path.exists(path):
        return ["## Link emulator vs kernel-shaped link", "",
                f"Not run yet (`python benchmarks/validate_link.py` writes `{os.path.relpath(path, REPO_ROOT)}`).", ""]
    v = _load_validation(path)
    out = ["## Link emulator vs kernel-shaped link (`benchmarks/validate_link.py`)", ""]
    if v.get("status") != "ok":
        return out + [f"Not measured: {v.get('reason', 'unknown reason')}", ""]
    kinds = v["kinds"]
    out += [f"{v['description']}", "",
            "| schedule | shaped (tbf) median s (min-max) | "
            + " | ".join(f"{_kind_label(k)}: median s (min-max) | / shaped" for k in kinds) + " |",
            "|---|---|" + "---|---|" * len(kinds)]

    def cell(row: dict, kind: str) -> str:
        return f"{row[kind + '_median_s']:.3f} ({row[kind + '_min_s']:.3f}-{row[kind + '_max_s']:.3f})"

    for name, row in v["schedules"].items():
        out.append(f"| `{name}` | {cell(row, 'shaped')} | "
                   + " | ".join(f"{cell(row, k)} | {row[k + '_ratio']:.3f}" for k in kinds) + " |")
    probe = v["probed_link"]
    names = list(v["schedules"])
    if len(names) >= 2:
        a, b = v["schedules"][names[0]], v["schedules"][names[-1]]
        out += ["", f"Speedup `{names[-1]}` over `{names[0]}` (ratio of medians): " + ", ".join(
            f"{kind} {a[kind + '_median_s'] / b[kind + '_median_s']:.2f}x" for kind in ["shaped"] + kinds)]
    out += ["", "AllReduce probe over the shaped link (median per size): "
            + ", ".join(f"{int(b) // 1024} KiB {t * 1e3:.1f} ms" for b, t in v["probe_s"].items())
            + f" -> fitted {probe['bandwidth_gbps'] * 1000:.1f} Mbit/s, {probe['latency_us']:.0f} us."]
    if "tbf_mean_packet_bytes" in v:
        out[-1] += (f" Mean frame through the two tbf qdiscs during the probe: {v['tbf_mean_packet_bytes']:.0f} bytes "
                    f"(both directions, acknowledgements included).")
    if "host_cost" in v:
        out += ["", "Host CPU cost of the link (what a sleeping emulator does not charge): " + "; ".join(
            f"{kind} {h['cpu_s_per_allreduce'] * 1e3:.1f} ms CPU per {h['allreduce_bytes'] // 1024} KiB AllReduce, "
            f"a matmul loop beside it {h['compute_slowdown_beside_allreduce']:.2f}x slower"
            for kind, h in v["host_cost"].items()) + "."]
    if v.get("compute_busy_median_s"):
        busy = v["compute_busy_median_s"]
        out += ["", "Compute-lane busy seconds per step (rank 0, median):", "",
                "| schedule | " + " | ".join(busy) + " |", "|---|" + "---|" * len(busy)]
        out += [f"| `{name}` | " + " | ".join(f"{busy[k].get(name, float('nan')):.3f}" for k in busy) + " |"
                for name in names]
    out += [""] + [f"Verdict: {text}  " for text in v["verdicts"].values()]
    out += ["", f"The measurements in this report use `emulation.sharing={sharing}` (recorded per measurement).", ""]
    others = sorted(p for p in glob.glob(os.path.join(os.path.dirname(path), "validate_link-*.json"))
                    if os.path.abspath(p) != os.path.abspath(path))
    rows = []
    for other in others:
        o = _load_validation(other)
        if o.get("status") == "ok":
            rows.append(f"| `{os.path.basename(other)}` | {o['rate_mbit']:g} | {o.get('mtu', 1500)} | {o['burst_bytes']} "
                        f"| {', '.join(o['schedules'])} | "
                        + "; ".join(f"{k.split('_', 1)[1]} " + ", ".join(
                            f"{n} {r[k + '_ratio']:.3f}" for n, r in o["schedules"].items())
                            for k in o["kinds"] if k != "nominal") + " |")
    if rows:
        out += ["Other validation runs kept in `benchmarks/results/` (emulated / shaped median step per schedule):", "",
                "| file | tbf Mbit/s | MTU | bucket B | schedules | probed sharing: ratio per schedule |",
                "|---|---|---|---|---|---|"] + rows + [""]
    return out


def validation_caution(path: str, sharing: str = "ring") -> list[str]:
    """One line under the summary: how far the emulator, with the sharing model this
    report's measurements used, was from the kernel-shaped link."""
    if not os.path.exists(path):
        return ["> The link emulator has not been checked against a shaped link on this machine yet.", ""]
    v = _load_validation(path)
    if v.get("status") != "ok":
        return [f"> The link emulator could not be checked against a shaped link here: {v.get('reason')}", ""]
    kind = f"probed_{sharing}"
    if kind not in v["kinds"]:
        return [f"> The link emulator's `{sharing}` sharing model was not part of the shaped-link check "
                f"(section at the end).", ""]
    key = kind + "_ratio"
    worst = max(v["schedules"].items(), key=lambda kv: abs(kv[1][key] - 1))
    scope = (f"{v.get('rate_mbit', 0):g} Mbit/s tbf, MTU {v.get('mtu', 1500)}, literal emulation, "
             f"{', '.join(v['schedules'])}")
    if v["verdicts"][kind].startswith("PASS"):
        return [f"> The link emulator ({sharing} sharing) was checked against a kernel-shaped link ({scope}; section "
                f"at the end): step times within {abs(worst[1][key] - 1):.1%} (worst: `{worst[0]}`). The "
                f"rows above use scaled emulation at other rates, which that check does not cover directly.", ""]
    return [f"> **Caution**: against a kernel-shaped link ({scope}; section at the end) the emulator "
            f"({sharing} sharing) ran `{worst[0]}` at {worst[1][key]:.2f}x the shaped step time (FAIL); speedups of "
            f"overlapped schedules in this report may be off by that much.", ""]


def sharing_of(records: list[dict]) -> str:
    """The emulated link's sharing model the measurements used (the commonest, if mixed)."""
    found = [r["link_emulation"]["sharing"] for r in records if r.get("link_emulation", {}).get("sharing")]
    return max(set(found), key=found.count) if found else "ring"


def summary_table(records: list[dict]) -> list[str]:
    """One line per measurement: Oases vs Megatron and vs the best other baseline."""
    if not all(BASELINE in r["variants"] and "oases" in r["variants"] for r in records):
        return []
    lines = ["| measurement | oases vs megatron | oases vs best baseline (which) | exposed comm megatron -> oases |",
             "|---|---|---|---|"]
    for r in records:
        v = r["variants"]
        baselines = [l for l in v if l not in ("oases", "none") and not l.startswith("oases_")]
        best = min(baselines, key=lambda l: v[l]["median_s"])
        lines.append(f"| {record_label(r)} | {ratio_cell(r, 'oases')} | "
                     f"{statistics.median(round_ratios(v[best]['step_s'], v['oases']['step_s'])):.2f}x (`{best}`) | "
                     f"{v[BASELINE]['exposed_comm_frac']:.0%} -> {v['oases']['exposed_comm_frac']:.0%} |")
    return lines + [""]


def _listing(values) -> str:
    return ", ".join(str(v) for v in sorted(set(values)))


def _median_speedup(r: dict, base: str, other: str) -> float:
    v = r["variants"]
    return statistics.median(round_ratios(v[base]["step_s"], v[other]["step_s"]))


def e2e_findings(records: list[dict]) -> list[str]:
    """What the e2e tables show, computed from them: Oases' speedup per link, where it
    trails selective recomputation, where its exposed share is higher, how many
    collectives it issues."""
    both = [r for r in records if {BASELINE, "oases"} <= r["variants"].keys()]
    if not both:
        return []
    out = []
    by_link: dict[str, list[dict]] = defaultdict(list)
    for r in both:
        by_link[r["link_emulation"]["cluster"]["name"] if r["link_emulation"]["enabled"] else "no link"].append(r)

    def link_key(item):
        ratio = item[1][0]["link_emulation"].get("target_comm_compute_ratio")
        return (ratio is None, ratio or 0.0, item[0])

    parts = []
    for name, rs in sorted(by_link.items(), key=link_key):
        speedups = [_median_speedup(r, BASELINE, "oases") for r in rs]
        ratio = rs[0]["link_emulation"].get("target_comm_compute_ratio")
        spread = f"{min(speedups):.2f}x" if len(speedups) == 1 else f"{min(speedups):.2f}-{max(speedups):.2f}x"
        parts.append(f"`{name}`" + (f" (r = {ratio:.3g})" if ratio is not None else "") + f": {spread}")
    out.append("Oases over Megatron, median per-round speedup (range over the measurements of a link), by link and "
               "its emulated Megatron comm/compute ratio r: " + "; ".join(parts) + ".")
    with_selective = [r for r in both if "megatron_selective" in r["variants"]]
    trails = [r for r in with_selective if _median_speedup(r, "megatron_selective", "oases") < 1]
    if with_selective:
        out.append("Oases trails `megatron_selective` in: "
                   + (", ".join(f"{record_label(r)} ({_median_speedup(r, 'megatron_selective', 'oases'):.2f}x)"
                                for r in trails) if trails else "none of these measurements") + ".")
    higher = [r for r in both
              if r["variants"]["oases"]["exposed_comm_frac"] > r["variants"][BASELINE]["exposed_comm_frac"]]
    if higher:
        out.append("Oases' exposed-communication share is higher than Megatron's in: " + ", ".join(
            f"{record_label(r)} ({r['variants'][BASELINE]['exposed_comm_frac']:.0%} -> "
            f"{r['variants']['oases']['exposed_comm_frac']:.0%})" for r in higher) + ".")
    counts, seen = [], set()
    for r in both:
        m = r["config"]["model"]
        model = f"{m['family']} h{m['hidden_size']} L{m['num_layers']}"
        if model in seen:
            continue
        seen.add(model)
        calls = {k: sum(d["calls"] for d in r["variants"][k]["comm_bytes_rank0"].values()) for k in (BASELINE, "oases")}
        nbytes = {k: sum(d["bytes"] for d in r["variants"][k]["comm_bytes_rank0"].values()) for k in (BASELINE, "oases")}
        if calls[BASELINE] and nbytes[BASELINE]:
            counts.append(f"{model}: {calls['oases']} against {calls[BASELINE]} "
                          f"({nbytes['oases'] / nbytes[BASELINE]:.2f} of the bytes)")
    if counts:
        out.append("Collectives per step on rank 0, Oases against Megatron (all phases): " + "; ".join(counts) + ".")
    spread = max(both, key=lambda r: (lambda x: max(x) - min(x))(
        round_ratios(r["variants"][BASELINE]["step_s"], r["variants"]["oases"]["step_s"])))
    ratios = round_ratios(spread["variants"][BASELINE]["step_s"], spread["variants"]["oases"]["step_s"])
    out.append(f"Widest spread of that speedup over rounds: {record_label(spread)} "
               f"({min(ratios):.2f}-{max(ratios):.2f}x).")
    return out


def weak_scaling_findings(records: list[dict]) -> list[str]:
    """How many processes each DP degree ran on how many CPUs: whether the runs competed for cores."""
    dps = [r["data_parallel_size"] for r in records]
    procs = [r["tensor_parallel_size"] * r["data_parallel_size"] for r in records]
    cpus = min(r["machine"]["cpu_count"] for r in records)
    out = [f"DP {_listing(dps)} with TMP {_listing(r['tensor_parallel_size'] for r in records)} ran "
           f"{_listing(procs)} rank processes on a {cpus}-CPU machine."]
    if max(procs) > cpus:
        out.append("The runs with more processes than CPUs compete for cores, so the scaling efficiency says more "
                   "about this machine than about Oases; the Oases/Megatron ratio inside each run is the meaningful "
                   "number.")
    out.append(f"DP degrees beyond {max(dps)} are not measured here; `python benchmarks/weak_scaling_sim.py` extends "
               "the study to larger DP degrees, SIMULATED from the measurement without data parallelism (its own "
               "report, weak_scaling_simulated-<date>.md).")
    return out


def batch_split_findings(records: list[dict]) -> list[str]:
    """What the batch-split numbers are a property of: this CPU, these processes and threads."""
    procs = [r["tensor_parallel_size"] * r["data_parallel_size"] for r in records]
    links = "no link" if not any(r["link_emulation"]["enabled"] for r in records) else "an emulated link"
    return [f"Compute-only comparison on this CPU: {_listing(procs)} process(es) per measurement, TMP "
            f"{_listing(r['tensor_parallel_size'] for r in records)}, "
            f"{_listing(r['config']['threads_per_rank'] for r in records)} torch thread(s) per process, {links}. "
            "It measures arithmetic density on this CPU, not on a GPU; the paper's bound (Fig. 5) is a GPU "
            "statement."]


FINDINGS = {"e2e": e2e_findings, "weak_scaling": weak_scaling_findings, "batch_split": batch_split_findings}


def study_notes(study: str, records: list[dict]) -> list[str]:
    """The notes under a study's configuration: computed findings, then the fixed note on method."""
    paragraphs = FINDINGS[study](records) if study in FINDINGS else []
    if study in STUDY_NOTES:
        paragraphs.append(STUDY_NOTES[study])
    return [line for text in paragraphs for line in (f"> {text}", ">")][:-1] + ([""] if paragraphs else [])


def write_study(study: str, records: list[dict], out_dir: str, validation: str) -> str:
    date = max(r["time"] for r in records)[:10]
    stem = f"{study}-{date}"
    os.makedirs(out_dir, exist_ok=True)
    first = records[0]
    machines = {json.dumps(r["machine"], sort_keys=True) for r in records}
    commits = sorted({r["git_commit"][:10] for r in records})
    cfg = first["config"]
    md = [f"# {STUDY_TITLES.get(study, study)}", "",
          f"Generated by `oases-bench report` from {len(records)} measurement(s) of study `{study}`, "
          f"last one {max(r['time'] for r in records)}.", "",
          "## Machine and configuration", ""]
    for m in machines:
        m = json.loads(m)
        md.append(f"- machine: {m['platform']}, {m['cpu_count']} CPUs, Python {m['python']}, torch {first['torch']}")
    md += [f"- code: git {', '.join(commits)}",
           f"- TMP {first['tensor_parallel_size']}; DP {sorted({r['data_parallel_size'] for r in records})}; "
           f"micro-batch(es) per DP rank {sorted({v['micro_batch'] for r in records for v in r['variants'].values()})}; "
           f"{cfg['warmup']} warm-up + {cfg['repeats']} timed rounds; {cfg['threads_per_rank']} torch thread(s) per rank",
           f"- {first['step_note']}",
           "- variants of one measurement ran interleaved (round-robin, starting variant rotated each round); "
           "step time = slowest rank; ratios are per round, median (min-max)",
           "- link emulation (per measurement below): the real collective runs and its wait is held to the "
           "emulated link's deadline; see `oases_ds/bench/measure.py` for the scaled mode", ""]
    md += study_notes(study, records)
    summary = summary_table(records)
    if summary:
        md += ["## Summary", ""] + summary
    if study == "e2e":
        md += validation_caution(validation, sharing_of(records))
    plots = []
    if study == "batch_split":
        plot_batch_split(records, os.path.join(out_dir, f"{stem}-ratio.png"))
        plots.append((f"{stem}-ratio.png", "half / full micro-batch throughput per hidden size"))
        md += ["## Throughput at full vs half micro-batch", "",
               "Tokens/s are from each variant's median step; the ratio and the loss are the median over rounds of "
               "the per-round ratio (half and full ran back to back in a round), so the two need not agree.", "",
               "| hidden | tokens/s full | tokens/s half | half/full per round, median (min-max) | loss (1 - median) |",
               "|---|---|---|---|---|"]
        for h, full, half, ratios in batch_split_rows(records):
            med = statistics.median(ratios)
            md.append(f"| {h} | {full:,.0f} | {half:,.0f} | {med:.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | {1 - med:.1%} |")
        md.append("")
    else:
        plot_throughput(records, os.path.join(out_dir, f"{stem}-throughput.png"), STUDY_TITLES.get(study, study))
        plots.append((f"{stem}-throughput.png", "throughput normalised to Megatron"))
    if study == "weak_scaling":
        plot_weak_scaling(records, os.path.join(out_dir, f"{stem}-scaling.png"))
        plots.append((f"{stem}-scaling.png", "tokens/s vs DP degree with ideal linear scaling from DP "
                                             f"{min(r['data_parallel_size'] for r in records)}"))
    if study == "selective":
        plot_memory(records, os.path.join(out_dir, f"{stem}-memory.png"))
        plots.append((f"{stem}-memory.png", "step time and peak activation memory"))
    gantt_record = next((r for r in reversed(records) if any(v.get("gantt_rank0") for v in r["variants"].values())), None)
    if gantt_record is not None and plot_gantt(gantt_record, os.path.join(out_dir, f"{stem}-gantt.png")):
        plots.append((f"{stem}-gantt.png", f"one step per schedule, {record_label(gantt_record)}"))
    md += ["## Measurements", ""]
    for r in records:
        md += [f"### {record_label(r)}", "",
               f"{emulation_line(r)}. Wall time of the measurement {r['wall_s']:.0f}s; process peak RSS per rank "
               f"{', '.join(f'{b / MiB:.0f}' for b in r['peak_rss_bytes_per_rank'])} MiB (whole run, all variants).", ""]
        md += record_table(r) + [""]
    md += ["## Plots", ""] + [f"![{caption}]({name})  \n*{caption}*\n" for name, caption in plots]
    if study == "e2e":
        md += validation_section(validation, sharing_of(records))
    path = os.path.join(out_dir, f"{stem}.md")
    write_text_atomic(path, "\n".join(md) + "\n")
    return path


def write_cost_model(path: str, out_dir: str) -> str:
    """Study (f) from ``oases-plan experiment=cost_model``'s result: the plans' table and a scatter plot."""
    with open(path) as f:
        acc = json.load(f)
    when = acc.get("time") or datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc).isoformat()
    stem = f"cost_model-{when[:10]}"
    os.makedirs(out_dir, exist_ok=True)
    rows, cfg = acc["rows"], acc.get("config", {})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for r in rows:
        mark = "*" if r.get("is_solver_plan") else ("s" if len(set(r["attn"] + r["mlp"])) == 1 else "o")
        ax.errorbar(r["predicted_ms"], r["measured_ms"], yerr=[[r["measured_ms"] - r["min_ms"]], [r["max_ms"] - r["measured_ms"]]],
                    fmt=mark, ms=11 if mark == "*" else 6, color="tab:red" if mark == "*" else "tab:blue", capsize=2)
    ax.set_xlabel("predicted step ms (cost model)")
    ax.set_ylabel("measured step ms (median, min-max)")
    ax.set_title(f"Spearman {acc['spearman']:.3f} over {len(rows)} plans (star: solver's, square: uniform)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{stem}-scatter.png"), dpi=110)
    plt.close(fig)
    model = cfg.get("model", {})
    link = acc.get("link")
    m = acc.get("machine", {})
    md = [f"# {STUDY_TITLES['cost_model']}", "",
          f"Generated by `oases-bench report` from `{os.path.relpath(path, REPO_ROOT)}` "
          f"(`oases-plan experiment=cost_model`), measured {when}.", "",
          "## Machine and configuration", ""]
    if m:
        md.append(f"- machine: {m.get('platform')}, {m.get('cpu_count')} CPUs, Python {m.get('python')}")
    md += [f"- code: git {acc.get('git_commit', 'unknown')[:10]}",
           f"- model {model.get('family')} h{model.get('hidden_size')} L{model.get('num_layers')} seq "
           f"{model.get('seq_len')}; {cfg.get('devices')} ranks; micro-batch {cfg.get('micro_batch')}; schedule "
           f"{cfg.get('schedule', {}).get('name')}; cost table `{acc.get('table_key')}`",
           "- link: " + (f"EMULATED {link['bandwidth_gbps']} Gbit/s, {link.get('latency_us', 0)} us, sharing "
                          f"{link.get('sharing', 'fifo')}" if link else "no emulation"),
           f"- plans measured interleaved (one step each, round robin), {cfg.get('accuracy', {}).get('warmup')} warm-up "
           f"+ {cfg.get('accuracy', {}).get('repeats')} timed rounds; median step, slowest rank", "",
           f"**Spearman rank correlation, predicted vs measured: {acc['spearman']:.3f}** (p = {acc['p_value']:.3g}, "
           f"{len(rows)} plans; compare the paper's Fig. 9).", "",
           "| attn degrees | mlp degrees | predicted ms | measured ms (min-max) | measured / predicted |",
           "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["predicted_ms"]):
        tag = " (solver's)" if r.get("is_solver_plan") else ""
        md.append(f"| {','.join(map(str, r['attn']))}{tag} | {','.join(map(str, r['mlp']))} | {r['predicted_ms']:.1f} | "
                  f"{r['measured_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f}) | {r['measured_ms'] / r['predicted_ms']:.3f} |")
    md += ["", f"![predicted vs measured]({stem}-scatter.png)", ""]
    out = os.path.join(out_dir, f"{stem}.md")
    write_text_atomic(out, "\n".join(md) + "\n")
    return out


def write_reports(results: str, out_dir: str, validation: str, accuracy: str,
                  studies: list[str] | None = None) -> list[str]:
    """One report per study found in ``results`` (only ``studies`` if given), plus the
    cost-model report when ``accuracy`` exists; returns the paths written."""
    by_study: dict[str, list[dict]] = defaultdict(list)
    for r in load(results):
        if not studies or r["study"] in studies:
            by_study[r["study"]].append(r)
    written = [write_study(s, rs, out_dir, validation) for s, rs in sorted(by_study.items())]
    if (not studies or "cost_model" in studies) and os.path.exists(accuracy):
        written.append(write_cost_model(accuracy, out_dir))
    return written
