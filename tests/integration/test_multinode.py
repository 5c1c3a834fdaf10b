"""Launching across nodes, exercised on ONE machine over LOOPBACK (labelled so): two launcher
invocations, each a "node" with its own node rank, meeting at one rendezvous endpoint --
the commands of README "Two nodes" with 127.0.0.1 as the first node's address and ``lo`` as
the NIC.  A TMP 2 ``oases-train`` job runs one rank per "node" and must report the losses
the single-launcher run reports (same seed and data; fp32 re-association across the two
launches' thread counts is the only allowed difference, hence 1e-5 relative).

Not exercised here: a second host, a real NIC, a real inter-node link (network namespaces
on a shaped link are ``benchmarks/multinode_netns.py``)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from oases_ds.launcher import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = ["model=gpt_tiny", "tensor_parallel_size=2", "steps=3", "log_every=1", "micro_batch=4"]


def env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a "node" that does not end is sent SIGABRT, and every process of it
    # prints where each of its threads stood (see run_nodes).
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                PYTHONFAULTHANDLER="1")


def run_nodes(commands: list[list[str]], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Start every "node" at once (they wait for each other at the rendezvous), then collect them.

    Each node is its own process group: past ``timeout`` every process of every node gets
    SIGABRT (Python tracebacks of all threads on stderr, from the faulthandler) and the test
    fails with each node's last output, so a hang says where it was."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd in commands]
    outputs: dict[int, tuple[str, str]] = {}
    readers = [threading.Thread(target=lambda i=i, p=p: outputs.__setitem__(i, p.communicate()), daemon=True)
               for i, p in enumerate(procs)]  # read while waiting: a full pipe would stall a node
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for signum, grace in ((signal.SIGABRT, 5.0), (signal.SIGKILL, 30.0)):
        for i, p in enumerate(procs):
            if readers[i].is_alive():  # the node, or a rank of it holding its pipes, is still there
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signum)
        for reader in readers:
            reader.join(grace)
    done = [subprocess.CompletedProcess(p.args, p.wait(), *outputs.get(i, ("", ""))) for i, p in enumerate(procs)]
    if hung:
        pytest.fail(f"nodes {hung} did not end within {timeout} s:\n" + "\n".join(
            f"--- node {i} stdout:\n{d.stdout[-2000:]}\n--- node {i} stderr:\n{d.stderr[-6000:]}"
            for i, d in enumerate(done)))
    return done


def losses(stats: str) -> list[float]:
    with open(stats) as f:
        return [row["loss"] for row in json.load(f)["history"]]


@pytest.mark.distributed
def test_torchrun_two_nodes_on_loopback_match_one_launcher(tmp_path) -> None:
    port = free_port()
    nodes = run_nodes([
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "oases_ds.cli.train", *JOB,
         f"stats_out={tmp_path / 'two_nodes.json'}"]
        for node in (0, 1)])
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, f"node {node}: {proc.stderr[-3000:]}"
    # rank 0 lives on node 0: it reports the job it ran and wrote the stats
    assert "2 ranks = TMP 2 x DP 1" in nodes[0].stdout and "done: 3 steps" in nodes[0].stdout
    single = subprocess.run([sys.executable, "-m", "oases_ds.cli.train", *JOB, "nprocs=2",
                             f"stats_out={tmp_path / 'one_launcher.json'}"], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    assert losses(str(tmp_path / "two_nodes.json")) == pytest.approx(losses(str(tmp_path / "one_launcher.json")), rel=1e-5)


@pytest.mark.distributed
def test_deepspeed_hostfile_two_nodes_without_ssh_on_loopback(tmp_path) -> None:
    """The DeepSpeed launcher with a hostfile, each "node" started by hand with ``--no_ssh
    --node_rank`` (what pdsh would do over ssh on a real cluster)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = free_port()
    nodes = run_nodes([
        [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
         str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), "--module", "oases_ds.cli.train", *JOB,
         f"stats_out={tmp_path / 'ds.json'}"]
        for node in (0, 1)])
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, f"node {node}: {proc.stderr[-3000:]}"
    assert "2 ranks = TMP 2 x DP 1" in nodes[0].stdout and "done: 3 steps" in nodes[0].stdout
    assert len(losses(str(tmp_path / "ds.json"))) == 3
