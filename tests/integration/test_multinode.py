"""Launching across nodes, exercised on ONE machine over LOOPBACK (labelled so): two launcher
invocations, each a "node" with its own node rank, meeting at one rendezvous endpoint --
the commands of README "Two nodes" with 127.0.0.1 as the first node's address and ``lo`` as
the NIC.  A TMP 2 ``oases-train`` job runs one rank per "node" and must report the losses
the single-launcher run reports (same seed and data; fp32 re-association across the two
launches' thread counts is the only allowed difference, hence 1e-5 relative).

Not exercised here: a second host, a real NIC, a real inter-node link (network namespaces
on a shaped link are ``benchmarks/multinode_netns.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oases_ds.launcher import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = ["model=gpt_tiny", "tensor_parallel_size=2", "steps=3", "log_every=1", "micro_batch=4"]


def env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def run_nodes(commands: list[list[str]], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Start every "node" at once (they wait for each other at the rendezvous), then collect them."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
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
