"""Does the link emulator behave like a real slow link?  Emulated vs kernel-shaped step times.

The benchmark's emulator (``oases_ds.parallel.link.LinkModel``) holds each
collective to a deadline computed from bandwidth and latency.  Here the same
two-rank TMP job runs over a *real* slow link instead: each rank in its own
network namespace, joined by a veth pair whose both ends are shaped by the
kernel's token-bucket filter (``tc qdisc ... tbf``), gloo bound to the veth.
Runs alternate shaped / emulated (the emulated runs use the same namespaces with
the shaping removed), and per schedule the medians are compared: the emulator
is good enough if they agree within 10%.

The emulated runs:

* **nominal**: the tbf rate converted to payload rate (tbf counts Ethernet frame
  bytes; a TCP segment on a 9000-byte MTU carries 8948 payload bytes, timestamps
  on, in a 9014-byte frame: 0.993 x the tbf rate; 0.956 x at MTU 1500), latency 0.
* **probed_fifo / probed_fair / probed_ring**: bandwidth and per-collective
  latency fitted (least squares, ``t = latency + wire_bytes / bandwidth``) to
  timed AllReduces of 64 KiB-2 MiB over the shaped link -- what one would do on a
  real cluster with a collective microbenchmark -- under each of the emulator's
  models of how collectives in flight together share the link
  (``LinkModel.sharing``).

A sharing model is good enough if its step times agree with the shaped ones
within 10% for every schedule.

**Why jumbo frames and a two-frame bucket (the defaults).**  The veth has no
interrupt coalescing, so every packet tbf releases wakes the receiving gloo
thread, and tbf cuts a GSO packet larger than its bucket into MTU-sized
segments.  At MTU 1500 and a 32 KiB bucket a 2 MiB AllReduce over the shaped
link cost a rank 17 ms of CPU (2.5 ms unshaped), and a matmul loop running beside
it was 2.56x slower: on 2 cores that contention, not link timing, decided the
overlapped schedules' step times.  A real NIC coalesces interrupts and moves the
data by DMA, and cluster fabrics commonly run jumbo frames; MTU 9000 makes the
segments six times larger.  The bucket stays small (two frames), because a large
one lets every collective that follows idle time start with a free burst, which
the rate model (rightly) does not grant.  The probe records the host cost on the
shaped and the unshaped link (``host_cost``), so a run states how much CPU
contention it carried.

Needs root, ``ip`` and ``tc``; everything it creates (two namespaces
``oasesvl<pid>a/b``, one veth pair, addresses in 10.231.0.0/24 inside those
namespaces only) is removed at the end, also on error.  Where that is not
permitted the result file records why and nothing is compared.

    python benchmarks/validate_link.py                     # 200 Mbit/s, MTU 9000, megatron + oases, 5 rounds
    python benchmarks/validate_link.py --rate-mbit 100 --schedules megatron,split_overlap,oases --rounds 3
    python benchmarks/validate_link.py --mtu 1500 --burst-bytes 32768   # the CPU-bound case described above
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.bench.netns import Unavailable, VethPair, payload_fraction, run_ranks  # noqa: E402,F401
from oases_ds.utils.io import write_json_atomic  # noqa: E402
from oases_ds.utils.rounds import rotated  # noqa: E402


PROBE_SIZES = (64 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024, 2048 * 1024)


def probe_link(repeats: int = 8) -> dict:
    """Median seconds of a synchronous AllReduce per payload size over the current link, and its host CPU cost.

    The host cost is what a sleeping emulator cannot charge: the CPU seconds this process spends
    in one AllReduce of the largest size, and how much slower a matmul loop runs while that
    AllReduce is in flight (the situation of every overlapped schedule on a CPU machine).
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    times = {}
    for nbytes in PROBE_SIZES:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            samples.append(time.perf_counter() - t0)
        times[nbytes] = statistics.median(samples)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def matmuls() -> float:
        t0 = time.perf_counter()
        for _ in range(100):
            a @ b
        return time.perf_counter() - t0

    alone, beside, cpu = [], [], []
    for _ in range(repeats):
        dist.barrier()
        alone.append(matmuls())
        dist.barrier()
        c0 = time.process_time()
        dist.all_reduce(x)
        cpu.append(time.process_time() - c0)
        dist.barrier()
        work = dist.all_reduce(x, async_op=True)
        beside.append(matmuls())
        work.wait()
    host = {"allreduce_bytes": PROBE_SIZES[-1], "cpu_s_per_allreduce": statistics.median(cpu),
            "compute_slowdown_beside_allreduce": statistics.median(beside) / statistics.median(alone)}
    return {"probe_s": times, "host_cost": host}


def fit_link(probe_s: dict) -> tuple[float, float]:
    """(bandwidth Gbit/s, latency us) of ``t = latency + wire / bandwidth``; wire = payload for 2 ranks."""
    xs = [float(b) for b in probe_s]
    ys = [float(t) for t in probe_s.values()]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return 8 / slope / 1e9, max(intercept, 0.0) * 1e6


def rank_worker(spec_path: str, out_path: str) -> None:
    """One rank, started inside its namespace with RANK/MASTER_ADDR/GLOO_SOCKET_IFNAME set."""
    import torch

    from oases_ds.bench.measure import measure_rank

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    result = probe_link() if spec.get("probe") else measure_rank(spec)
    write_json_atomic(out_path, result)
    torch.distributed.destroy_process_group()


def run_pair(pair: VethPair, spec: dict, timeout_s: float) -> dict:
    results = run_ranks(pair, __file__, spec, timeout_s, ROOT)
    if spec.get("probe"):  # the rank that paid more host CPU speaks for the pair
        return {"probe_s": results[0]["probe_s"],
                "host_cost": max((r["host_cost"] for r in results), key=lambda h: h["compute_slowdown_beside_allreduce"])}
    steps = {label: [max(ts) for ts in zip(*(r["variants"][label]["step_s"] for r in results))]
             for label in results[0]["variants"]}
    # compute-lane busy seconds per step (rank 0): shows whether the shaped link's kernel
    # network work slows the computation that overlaps it, which no sleeping emulator charges
    steps.update({f"{label}:compute_s": [s * u for s, u in zip(results[0]["variants"][label]["step_s"],
                                                               results[0]["variants"][label]["compute_util"])]
                  for label in results[0]["variants"]})
    return steps


SHARINGS = ("fifo", "fair", "ring")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="tbf rate on each veth end")
    parser.add_argument("--mtu", type=int, default=9000, help="veth MTU (9000: jumbo frames; 1500: standard)")
    parser.add_argument("--burst-bytes", type=int, default=None, help="tbf bucket (>= one frame; default two frames)")
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--schedules", default="megatron,oases")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of (shaped, nominal, probed x fifo/fair/ring) runs, order rotating")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "validate_link.json"))
    parser.add_argument("--rank-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(*args.rank_worker)
        return
    if not 576 <= args.mtu <= 65535:
        sys.exit(f"error: --mtu must be between 576 and 65535 bytes, got {args.mtu}")
    if args.burst_bytes is None:
        args.burst_bytes = 2 * (args.mtu + 14)
    if args.burst_bytes < args.mtu + 14:
        sys.exit(f"error: --burst-bytes must be >= one frame (--mtu + 14 = {args.mtu + 14} bytes)")
    if args.rounds < 1 or args.repeats < 1:
        sys.exit("error: --rounds and --repeats must be >= 1")

    from oases_ds.bench.spec import bench_defaults, load_preset, resolve

    fraction = payload_fraction(args.mtu)
    nominal_gbps = args.rate_mbit * fraction / 1000
    defaults = bench_defaults()  # oases-bench's configuration, without Hydra: this script is no Hydra app
    cfg = {**defaults, "model": load_preset("model", args.model),
           "schedules": [name.strip() for name in args.schedules.split(",")], "repeats": args.repeats,
           "warmup": 1, "gantt": False, "emulation": {**defaults["emulation"], "mode": "literal"}}

    def spec(mode: str, gbps: float = 1.0, latency_us: float = 0.0, sharing: str = "fifo") -> dict:
        cluster = {"name": "veth_tbf", "link": {"bandwidth_gbps": gbps, "latency_us": latency_us, "sharing": sharing},
                   "device": None, "tensor_parallel_size": None}
        return resolve({**cfg, "cluster": cluster, "emulation": {**cfg["emulation"], "mode": mode}})

    result: dict = {"rate_mbit": args.rate_mbit, "burst_bytes": args.burst_bytes, "mtu": args.mtu,
                    "payload_fraction": fraction, "rounds": args.rounds, "repeats": args.repeats,
                    "nominal_link": {"bandwidth_gbps": nominal_gbps, "latency_us": 0.0}}
    started = time.perf_counter()
    try:
        with VethPair(args.mtu) as pair:
            pair.shape(args.rate_mbit, args.burst_bytes)
            probe = run_pair(pair, {"probe": True}, timeout_s=300)
            sent = pair.sent()
            gbps, latency_us = fit_link(probe["probe_s"])
            pair.unshape()
            unshaped = run_pair(pair, {"probe": True}, timeout_s=300)
            result.update(probe_s=probe["probe_s"], probed_link={"bandwidth_gbps": gbps, "latency_us": latency_us},
                          host_cost={"shaped": probe["host_cost"], "unshaped": unshaped["host_cost"]},
                          tbf_mean_packet_bytes=sent["bytes"] / max(sent["packets"], 1))
            print(f"probe over tbf {args.rate_mbit:g} Mbit/s: fitted {gbps * 1000:.1f} Mbit/s, {latency_us:.0f} us per "
                  f"AllReduce (nominal payload rate {nominal_gbps * 1000:.1f} Mbit/s); mean frame through tbf "
                  f"{result['tbf_mean_packet_bytes']:.0f} bytes (both directions)", flush=True)
            for kind, host in result["host_cost"].items():
                print(f"host cost, {kind} link: {host['cpu_s_per_allreduce'] * 1e3:.1f} ms CPU per "
                      f"{host['allreduce_bytes'] // 1024} KiB AllReduce, compute beside it "
                      f"{host['compute_slowdown_beside_allreduce']:.2f}x slower", flush=True)
            specs = {"shaped": spec("off"), "nominal": spec("literal", nominal_gbps),
                     **{f"probed_{sh_}": spec("literal", gbps, latency_us, sh_) for sh_ in SHARINGS}}
            runs: dict[str, dict[str, list[float]]] = {k: {} for k in specs}
            kinds = list(specs)
            for rnd in range(args.rounds):
                for kind in rotated(kinds, rnd):
                    if kind == "shaped":
                        pair.shape(args.rate_mbit, args.burst_bytes)
                    else:
                        pair.unshape()
                    steps = run_pair(pair, specs[kind], timeout_s=900)
                    for label, ts in steps.items():
                        runs[kind].setdefault(label, []).extend(ts)
                    print(f"round {rnd}: {kind:<12} " + "  ".join(f"{l} {statistics.median(t):.3f}s" for l, t in steps.items()
                                                                   if not l.endswith(":compute_s")), flush=True)
            pair.unshape()
    except Unavailable as err:
        print(f"link validation not run: {err}", file=sys.stderr)
        previous = None
        try:
            with open(args.out) as f:
                previous = json.load(f).get("status")
        except (OSError, ValueError):  # absent or unreadable: nothing worth keeping
            previous = None
        if previous == "ok":  # never replace a measured comparison by a record that nothing was measured
            print(f"kept the earlier measurement in {args.out}", file=sys.stderr)
        else:
            result.update(status="unavailable", reason=str(err))
            write_json_atomic(args.out, result)
        sys.exit(3)
    compute = {kind: {label.split(":")[0]: statistics.median(ts) for label, ts in per.items() if label.endswith(":compute_s")}
               for kind, per in runs.items()}
    for kind in runs:
        runs[kind] = {label: ts for label, ts in runs[kind].items() if not label.endswith(":compute_s")}
    emulated = [k for k in kinds if k != "shaped"]
    rows = {}
    for label, shaped in runs["shaped"].items():
        row = {"shaped_s": shaped, "shaped_median_s": statistics.median(shaped),
               "shaped_min_s": min(shaped), "shaped_max_s": max(shaped)}
        for kind in emulated:
            ts = runs[kind][label]
            row.update({f"{kind}_s": ts, f"{kind}_median_s": statistics.median(ts), f"{kind}_min_s": min(ts),
                        f"{kind}_max_s": max(ts), f"{kind}_ratio": statistics.median(ts) / statistics.median(shaped)})
        rows[label] = row
    verdicts = {}
    for sharing in SHARINGS:
        worst = max(abs(row[f"probed_{sharing}_ratio"] - 1) for row in rows.values())
        verdicts[f"probed_{sharing}"] = (f"{'PASS' if worst <= 0.10 else 'FAIL'}: probed emulation (sharing={sharing}) "
                                         f"vs shaped link, largest median difference {worst:.1%} (bar: 10%)")
    result["description"] = (
        f"{args.model}, TMP 2 (one rank per network namespace, gloo over a veth pair), schedules {args.schedules}, "
        f"micro-batch {cfg['micro_batch']}; {args.rounds} rounds of ({', '.join(kinds)}) runs in rotating order, "
        f"each 1 warm-up + {args.repeats} timed steps per schedule. Shaped: tbf {args.rate_mbit:g} Mbit/s, burst "
        f"{args.burst_bytes} B, MTU {args.mtu} on both veth ends, no emulation. Emulated runs: same namespaces, "
        f"shaping removed; nominal = {nominal_gbps * 1000:.1f} Mbit/s (tbf rate x {fraction:.3f}), latency 0, fifo; "
        f"probed = {gbps * 1000:.1f} Mbit/s, {latency_us:.0f} us per collective, fitted to AllReduces of "
        f"{PROBE_SIZES[0] // 1024}-{PROBE_SIZES[-1] // 1024} KiB over the shaped link, with each sharing model.")
    result.update(status="ok", kinds=emulated, schedules=rows, compute_busy_median_s=compute, verdicts=verdicts,
                  wall_s=time.perf_counter() - started,
                  machine={"platform": __import__("platform").platform(), "cpu_count": os.cpu_count()})
    write_json_atomic(args.out, result)
    for label, row in rows.items():
        print(f"{label:<14} shaped {row['shaped_median_s']:.3f}s  " + "  ".join(
            f"{kind} {row[kind + '_median_s']:.3f}s ({row[kind + '_ratio']:.3f})" for kind in emulated))
    print("compute-lane busy s per step (rank 0, median): " + "; ".join(
        f"{kind}: " + ", ".join(f"{label} {sec:.3f}" for label, sec in per.items()) for kind, per in compute.items()))
    print("\n".join(verdicts.values()))


if __name__ == "__main__":
    main()
