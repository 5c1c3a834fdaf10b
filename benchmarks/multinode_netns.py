"""Two "nodes" on one machine: each a network namespace, joined by a tbf-shaped veth link.

Why: ``tests/integration/test_multinode.py`` proves the two-node launch on loopback; this
runs the same commands (``torchrun --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT``,
one per "node") where the nodes really are apart: separate network stacks, gloo bound to
the veth end (``GLOO_SOCKET_IFNAME``), the link shaped to the given rates.  Every
collective of the job crosses that link -- with TMP 2 across the two nodes, the TMP
AllReduces do, which is the case pipeline stages exist for (once the pipeline runtime
runs, ``--job`` takes ``pipeline_stages=2 tensor_parallel_size=1`` and only the stage
boundary crosses the link).  Needs root, ``ip`` and ``tc`` (:mod:`oases_ds.bench.netns`);
prints what it cannot do and exits 2 otherwise.  Both CPUs are shared by the two nodes: the
step times are this machine's, labelled SHAPED LINK, not a cluster's.

    python benchmarks/multinode_netns.py --rates 100,1000 --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import date

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oases_ds.bench.netns import Unavailable, VethPair  # noqa: E402
from oases_ds.bench.provenance import git_commit, machine  # noqa: E402
from oases_ds.utils.io import write_json_atomic  # noqa: E402

JOB = "model=gpt_tiny tensor_parallel_size=2 micro_batch=8 log_every=1"


def run_two_nodes(pair: VethPair, job: list[str], steps: int, timeout_s: float) -> dict:
    """One torchrun per namespace; rank 0's stats (node 0).  A node that fails or a pair that
    runs past ``timeout_s`` raises ``RuntimeError`` quoting its last stderr line; both end either way."""
    port = 29400 + os.getpid() % 500
    with tempfile.TemporaryDirectory(prefix="oases-nodes-") as tmp:
        stats = os.path.join(tmp, "stats.json")
        procs = []
        for node, (ns, dev) in enumerate(zip(pair.ns, pair.dev)):
            env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev)
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-endpoint", f"{pair.addr[0]}:{port}",
                   "-m", "oases_ds.cli.train", *job, f"steps={steps}", f"stats_out={stats}"]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        deadline = time.monotonic() + timeout_s
        try:
            for node, proc in enumerate(procs):
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode:
                    last = (err.strip().splitlines() or ["(no stderr)"])[-1]
                    raise RuntimeError(f"node {node} exited with {proc.returncode}: {last}")
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the two nodes ran past {timeout_s:.0f}s") from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        with open(stats) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--job", default=JOB, help="oases-train overrides (space-separated)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "multinode_netns.json"))
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+(,\d+)*", args.rates):
        sys.exit(f"error: --rates={args.rates!r}: give Mbit/s as whole numbers separated by commas, e.g. 100,1000")
    rows = []
    try:
        with VethPair(args.mtu) as pair:
            for rate in (int(r) for r in args.rates.split(",")):
                pair.shape(rate, max(args.mtu * 4, rate * 1000 // 8 // 100))  # ~10 ms of burst at the rate
                stats = run_two_nodes(pair, args.job.split(), args.steps, args.timeout_s)
                history = stats["history"][1:] or stats["history"]  # the first step warms up
                steps = sorted(h["step_s"] for h in history)
                median = steps[len(steps) // 2]
                rows.append({"rate_mbit": rate, "median_step_s": median, "steps_timed": len(steps),
                             "final_loss": stats["summary"]["final_loss"]})
                print(f"SHAPED LINK {rate} Mbit/s (namespaces on one machine): median step {median:.3f} s over "
                      f"{len(steps)} steps, loss {stats['summary']['final_loss']:.4f}", flush=True)
    except Unavailable as err:
        print(f"error: network namespaces unavailable here: {err}; run the loopback test instead "
              f"(tests/integration/test_multinode.py)", file=sys.stderr)
        sys.exit(2)
    write_json_atomic(args.out, {"label": "two network namespaces on one machine, tbf-shaped veth (SHAPED LINK)",
                                 "date": date.today().isoformat(), "git_commit": git_commit(), "machine": machine(),
                                 "load_avg": os.getloadavg(), "args": vars(args), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
