"""The end-to-end table: step times on loopback, 1 Gbit/s and 200 Mbit/s links, against DeepSpeed AutoTP.

Two ranks (TMP 2), each in its own network namespace, gloo over a veth pair whose
ends are shaped by ``tc tbf`` (``oases_ds/bench/netns.py``, as ``validate_link.py``
does).  Per link: the Oases executor with schedules ``none``, ``megatron`` and
``oases`` interleaved step by step in one rank pair, and -- where ``transformers``
is importable -- DeepSpeed AutoTP + Hugging Face gradient checkpointing on the same
dims in another (``oases_ds/bench/autotp.py``).  Rounds visit every link, the order
of links and of the two pairs rotating each round; cells are medians of all timed
steps.  The result JSON goes to ``benchmarks/results/``, and the table plus the
target checks are generated from it into the dated report ``benchmarks/reports/e2e_shaped-<date>.md``
(``oases_ds/bench/e2e.py``; ``--report-only`` regenerates from the JSON).

Where namespaces cannot be made (not root, no ``ip``/``tc``), or with ``--emulate``,
both ranks run on loopback and the 1 Gbit/s and 200 Mbit/s rows use the in-process
emulator ``LinkModel(sharing="ring")`` at the tbf rates' payload rate; those rows are
labelled EMULATED and have no AutoTP cell (the emulator paces Oases' collectives only).

Every namespace and qdisc is removed on every exit path (``with VethPair``; SIGTERM
is turned into SystemExit so it unwinds too), and namespaces left by a killed run
(``oasesvl<dead pid>``) are removed at start.

    python benchmarks/e2e_shaped.py --quick            # h128, seq 64, 1 round: the path end to end in ~2 min
    python benchmarks/e2e_shaped.py                    # the table's dims: 1 round, 1 warm-up + 2 timed steps
    python benchmarks/e2e_shaped.py --report-only      # the report's table again from the JSON

RUN TIME.  Each rank pair costs its start-up (~15 s executor, ~25 s AutoTP with
DeepSpeed's initialisation) plus (warmup + repeats) steps of each of its variants.
With the issue's step times (loopback/1G/200M: executor none+megatron+oases 31, 32,
40 s per step each; AutoTP 11.6, 12.7, 22.3 s) one round costs
3 x 15 + 3 x 25 + (1 + repeats) x (103 + 47) s: 9.5 min at the defaults
(repeats 2), 14 min at --rounds 2 --repeats 1 (a second round re-pays start-up and
warm-up), so the default keeps the run under 12 minutes with 1 round and 2 timed
steps per cell; the variants of a pair still alternate step by step, starting
variant rotating.  Under load (average ~6 on 2 cores) steps were 1.4-2x slower.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.bench import e2e  # noqa: E402
from oases_ds.bench.netns import Unavailable, VethPair, payload_fraction, run_ranks  # noqa: E402
from oases_ds.utils.io import write_json_atomic, write_text_atomic  # noqa: E402
from oases_ds.utils.rounds import rotated  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
MICRO_BATCH = 4
SEED = 0


def rank_worker(spec_path: str, out_path: str) -> None:
    """One rank inside its namespace (RANK/MASTER_ADDR/GLOO_SOCKET_IFNAME set by run_ranks)."""
    import torch

    from oases_ds.bench.autotp import autotp_rank_reporting
    from oases_ds.bench.measure import measure_rank

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    result = autotp_rank_reporting(spec) if spec.get("kind") == "autotp" else measure_rank(spec)
    write_json_atomic(out_path, result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def executor_spec(model: dict, opts: e2e.E2EOptions, gbps: float | None) -> dict[str, Any]:
    """The validated measure_rank spec: none/megatron/oases interleaved; ``gbps`` set: emulated link."""
    from oases_ds.bench.spec import bench_defaults, resolve

    defaults = bench_defaults()
    cluster = {"name": "veth_tbf", "link": None, "device": None, "tensor_parallel_size": None}
    mode = "off"
    if gbps is not None:
        cluster["link"] = {"bandwidth_gbps": gbps, "latency_us": 0.0, "sharing": "ring"}
        mode = "literal"
    return resolve({**defaults, "model": model, "schedules": list(e2e.SCHEDULES), "micro_batch": MICRO_BATCH,
                    "micro_batches": [], "tensor_parallel_size": 2, "data_parallel_size": 1,
                    "warmup": opts.warmup, "repeats": opts.repeats, "gantt": False, "memory_probe": False,
                    "seed": SEED, "timeout_s": int(opts.timeout_s), "cluster": cluster,
                    "emulation": {**defaults["emulation"], "mode": mode}})


def autotp_spec(model: dict, opts: e2e.E2EOptions) -> dict[str, Any]:
    return {"kind": "autotp", "model": model, "micro_batch": MICRO_BATCH, "warmup": opts.warmup,
            "repeats": opts.repeats, "seed": SEED, "timeout_s": int(opts.timeout_s)}


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def measure(opts: e2e.E2EOptions, model: dict, emulate: bool, want_autotp: bool, result: dict) -> None:
    """Fill ``result["steps"]``, ``["exposed_comm_frac"]``, ``["autotp"]`` round by round."""
    from oases_ds.bench.autotp import autotp_rank_reporting
    from oases_ds.bench.measure import measure_rank
    from oases_ds.launcher import launch

    steps: dict[str, dict[str, list[float]]] = {link: {} for link in opts.links}
    exposed: dict[str, list[float]] = {link: [] for link in opts.links}
    phases: dict[str, dict[str, list[dict[str, float]]]] = {link: {} for link in opts.links}
    comm_bytes: dict[str, dict[str, dict]] = {link: {} for link in opts.links}
    result.update(steps=steps, exposed_comm_frac=exposed, compute_phase_s=phases, comm_bytes=comm_bytes)
    nominal = {link: (rate * payload_fraction(opts.mtu) / 1000 if rate else None) for link, rate in e2e.LINKS.items()}
    specs = {link: executor_spec(model, opts, nominal[link] if emulate else None) for link in opts.links}

    def collect(link: str, ranks: list[dict]) -> None:
        for label in ranks[0]["variants"]:
            per_step = [max(ts) for ts in zip(*(r["variants"][label]["step_s"] for r in ranks))]
            steps[link].setdefault(label, []).extend(per_step)
            variant = ranks[0]["variants"][label]
            if "compute_phase_s" in variant:  # the executor's compute per pass, slowest rank per step
                per_rank = [r["variants"][label]["compute_phase_s"] for r in ranks]
                phases[link].setdefault(label, []).extend(
                    {p: max(d[p] for d in step) for p in step[0]} for step in zip(*per_rank))
            if "comm_bytes" in variant:  # payload bytes of one step per (pass/kind), rank 0
                comm_bytes[link][label] = variant["comm_bytes"]
        if "oases" in ranks[0]["variants"]:
            exposed[link].extend(ranks[0]["variants"]["oases"]["exposed_comm_frac"])

    def autotp_failed(ranks: list[dict]) -> str | None:
        errors = [r["error"] for r in ranks if "error" in r]
        return errors[0] if errors else None

    with VethPair(opts.mtu) if not emulate else _NoPair() as pair:
        for rnd in range(opts.rounds):
            for link in rotated(list(opts.links), rnd):
                rate = e2e.LINKS[link]
                if not emulate:
                    if rate:
                        pair.shape(rate, opts.bucket)
                    else:
                        pair.unshape()
                groups = ["executor"] + (["autotp"] if want_autotp and result["autotp"]["status"] == "ok"
                                         and (not emulate or rate is None) else [])
                for group in rotated(groups, rnd):
                    t0 = time.perf_counter()
                    spec = specs[link] if group == "executor" else autotp_spec(model, opts)
                    try:
                        if emulate:
                            fn = measure_rank if group == "executor" else autotp_rank_reporting
                            ranks = launch(fn, 2, (spec,), timeout_s=opts.timeout_s, threads_per_rank=1)
                        else:
                            ranks = run_ranks(pair, __file__, spec, opts.timeout_s, ROOT)
                    except RuntimeError as err:  # a rank died or the pair timed out (LaunchError is one too)
                        if group == "executor":
                            raise RuntimeError(f"round {rnd}, {link}, executor pair: {err}") from err
                        ranks = [{"error": f"AutoTP rank pair: {err}".splitlines()[0]}]
                    error = autotp_failed(ranks) if group == "autotp" else None
                    if error:
                        result["autotp"] = {"status": "failed", "detail": error}
                        print(f"AutoTP failed, its column is left out: {error}", file=sys.stderr, flush=True)
                        continue
                    collect(link, ranks)
                    if group == "autotp":
                        result["autotp"]["sharded_module_types"] = ranks[0].get("sharded_module_types", [])
                    cells = "  ".join(f"{label} {steps[link][label][-1]:.3f}s" for label in ranks[0]["variants"])
                    print(f"round {rnd} {link:<9} {group:<8} {cells}  ({time.perf_counter() - t0:.0f}s with start-up)",
                          flush=True)
            if not emulate:
                pair.unshape()


class _NoPair:
    """Stands in for VethPair in emulated mode: nothing to create, nothing to remove."""

    def __enter__(self) -> "_NoPair":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def write_report(result: dict, report: str | None) -> str:
    """Replace the generated section of ``report`` (default: the dated report of the result's day)."""
    from oases_ds.bench.provenance import dated_report

    report = report or dated_report("e2e_shaped", str(result.get("time", "")) or None)
    text = ""
    if os.path.exists(report):
        with open(report) as f:
            text = f.read()
    write_text_atomic(report, e2e.update_readme(text, e2e.render(result)))
    return report


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, e2e.E2EOptions]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny dims (h128, seq 64), 1 round: checks the path, measures nothing")
    parser.add_argument("--rounds", type=int, default=1, help="passes over all links, order rotating (see RUN TIME)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant per rank pair")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per variant per rank pair (default 2; 1 with --quick)")
    parser.add_argument("--links", default=",".join(e2e.LINKS), help=f"comma-separated from {','.join(e2e.LINKS)}")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--burst-bytes", type=int, default=0, help="tbf bucket; 0: two frames")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit for one rank pair")
    parser.add_argument("--emulate", action="store_true", help="skip namespaces: loopback + EMULATED ring links")
    parser.add_argument("--no-autotp", action="store_true", help="leave the AutoTP column out")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/e2e_shaped.json; --quick: runs/e2e_shaped-quick.json)")
    parser.add_argument("--report", default=None, help="report whose generated section is replaced "
                                                      "(default: benchmarks/reports/e2e_shaped-<date measured>.md)")
    parser.add_argument("--report-only", action="store_true", help="regenerate the report's section from --out")
    parser.add_argument("--rank-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        return args, e2e.E2EOptions()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    links = tuple(name.strip() for name in args.links.split(",") if name.strip())
    try:
        opts = e2e.E2EOptions(rounds=args.rounds, warmup=args.warmup, repeats=repeats, links=links, mtu=args.mtu,
                              burst_bytes=args.burst_bytes, timeout_s=args.timeout_s)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    if args.out is None:
        args.out = (os.path.join(ROOT, "runs", "e2e_shaped-quick.json") if args.quick  # a harness check: git-ignored
                    else os.path.join(RESULTS, "e2e_shaped.json"))
    return args, opts


def main(argv: list[str] | None = None) -> int:
    args, opts = parse(argv)
    if args.rank_worker:
        rank_worker(*args.rank_worker)
        return 0
    if args.report_only:
        try:
            with open(args.out) as f:
                result = json.load(f)
        except (OSError, ValueError) as err:
            print(f"error: --report-only needs a result JSON at --out ({args.out}): {err}", file=sys.stderr)
            return 2
        print(f"regenerated the e2e section of {write_report(result, args.report)} from {args.out}")
        return 0
    from oases_ds.bench.provenance import git_commit, machine

    model = dict(e2e.QUICK_MODEL if args.quick else e2e.FULL_MODEL)
    emulate, reason = args.emulate, "--emulate" if args.emulate else None
    if not emulate:
        try:
            with VethPair(opts.mtu):
                pass
        except Unavailable as err:
            emulate, reason = True, str(err)
            print(f"network namespaces unavailable ({err}); links are EMULATED", file=sys.stderr, flush=True)
    want_autotp = not args.no_autotp and importlib.util.find_spec("transformers") is not None
    autotp = ({"status": "ok", "detail": ""} if want_autotp else
              {"status": "unavailable", "detail": "--no-autotp" if args.no_autotp else "transformers is not importable"})
    result: dict[str, Any] = {
        "mode": "emulated" if emulate else "netns", "emulation_reason": reason, "quick": args.quick, "model": model,
        "micro_batch": MICRO_BATCH, "rounds": opts.rounds, "warmup": opts.warmup, "repeats": opts.repeats,
        "mtu": opts.mtu, "burst_bytes": opts.bucket,
        "links": [{"name": link, "rate_mbit": e2e.LINKS[link], "emulated": emulate} for link in opts.links],
        "autotp": autotp, "git_commit": git_commit(), "machine": machine(),
        "command": "python benchmarks/e2e_shaped.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()[0],
    }
    previous = signal.signal(signal.SIGTERM, _raise_exit)  # unwind (and remove the namespaces) on kill
    started = time.perf_counter()
    try:
        measure(opts, model, emulate, want_autotp, result)
    except RuntimeError as err:  # namespaces are gone by now (VethPair's exit); nothing half-written
        print(f"error: {str(err).splitlines()[0]} (a slow machine: raise --timeout-s; nothing was written)", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    result["wall_s"] = time.perf_counter() - started
    write_json_atomic(args.out, result)
    report = write_report(result, args.report)
    rows = e2e.summarize(result)
    for c in e2e.checks(rows):
        verdict = "not measured" if c["met"] is None else "met" if c["met"] else "NOT met"
        print(f"{verdict:<12} {c['statement']}" + ("" if c["value"] is None else f" ({c['value']:.3f})"))
    print(f"wrote {args.out} and the e2e section of {report} ({result['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
