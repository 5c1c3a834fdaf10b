"""Helpers shared by several test tiers (unit, distributed, integration): synthetic cost
tables, a one-block operator sequence, the ``oases-plan`` CLI as a subprocess, and a guard
that makes any host synchronisation raise.

The rank-process workers (``dist_workers``, ``engine_workers``, ``lightning_workers``) and
the unsharded reference models live beside this module: ``conftest.py`` puts this folder
on ``sys.path`` so spawned rank processes import them by module path."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import subprocess
import sys
from typing import Iterator

import torch

from oases_ds.models.ops import CommOp, ComputeOp
from oases_ds.planner.costs import BlockCost, CostTable
from oases_ds.planner.objective import brute_force
from oases_ds.schedule.generators import ScheduleSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository checkout."""

DEGREES = (1, 2, 4)
# Ties between plans are fine (only objectives are compared); this covers solver tolerances.
REL_TOL = 1e-7


def random_table(seed: int, layers: int) -> CostTable:
    """Costs drawn independently per degree so the optimum is not always uniform."""
    rng = random.Random(seed)

    def block(degree: int) -> BlockCost:
        return BlockCost(
            fwd_ms=rng.uniform(1, 10),
            bwd_ms=rng.uniform(2, 20),
            comm_fwd_ms=rng.uniform(0, 5) * (degree > 1),
            comm_bwd_ms=rng.uniform(0, 5) * (degree > 1),
            state_bytes=rng.uniform(1e9, 8e9) / degree,
            act_bytes=rng.uniform(1e8, 1e9) * degree / max(DEGREES),
            grad_sync_ms=rng.uniform(0, 6) / degree,
        )

    return CostTable(
        model=f"random-{seed}",
        cluster="synthetic",
        schedule=ScheduleSpec("oases"),
        devices=4,
        degrees=DEGREES,
        blocks={kind: {t: block(t) for t in DEGREES} for kind in ("attn", "mlp")},
        layers=layers,
        reshard_bytes=rng.uniform(1e6, 5e8),
        bandwidth_gbps=rng.choice([10.0, 25.0, 100.0]),
        latency_us=rng.uniform(5, 50),
    )


def with_random_store(table: CostTable, seed: int) -> CostTable:
    """``table`` pricing policy ``store`` too: each block faster (no recompute, a random share of its
    backward) and holding more activations (a random multiple), as a stored block does."""
    rng = random.Random(seed)
    store = {kind: {t: dataclasses.replace(cost, bwd_ms=cost.bwd_ms * rng.uniform(0.5, 0.8),
                                           act_bytes=cost.act_bytes * rng.uniform(2, 6))
                    for t, cost in by_degree.items()} for kind, by_degree in table.blocks.items()}
    return dataclasses.replace(table, store_blocks=store)


def memory_extremes(table: CostTable) -> tuple[float, float]:
    """(leanest possible memory, memory of the unconstrained optimum)."""
    lean = sum(min(c.memory_bytes for c in table.blocks[kind].values()) for kind in table.block_kinds())
    return lean, brute_force(table, None).memory_bytes


def _fn(ctx, acts):
    return acts


def block_ops():
    """One TMP block as in the paper, (F_i, C_i, F_j), framed by a layer boundary:
    0 embed | 1 F_i (layer 0) | 2 C_i AllReduce | 3 F_j (layer 0) | 4 copy (bwd AllReduce) | 5 loss."""
    return [
        ComputeOp("embed", -1, "embed", _fn),
        ComputeOp("L0.fi", 0, "attn", _fn),
        CommOp("L0.reduce", 0, "attn", 0, "all_reduce", None, None),
        ComputeOp("L0.fj", 0, "attn", _fn),
        CommOp("head_copy", 1, "head", 0, None, "all_reduce", None),
        ComputeOp("loss", 1, "head", _fn, is_loss=True),
    ]



def plan_cli(*overrides: str, timeout: int = 120, cwd: "str | os.PathLike[str]" = ROOT) -> subprocess.CompletedProcess:
    """``oases-plan overrides`` from ``cwd`` (the repository root), through its ``entry()`` in this
    process (output captured; the same code a user's command runs, without a second
    interpreter importing torch).  An exception other than ``SystemExit`` (a traceback a user
    would see) fails the test.  ``timeout``: kept for the callers; the launches it makes have
    their own (``timeout_s``)."""
    from oases_ds.cli import plan

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_entry(plan.entry, "oases-plan", overrides, cwd)
    return subprocess.CompletedProcess(["oases-plan", *overrides], code, out.getvalue(), err.getvalue())


def run_entry(entry, name: str, args: "tuple[str, ...] | list[str]", cwd: "str | os.PathLike[str]") -> int:
    """Call a CLI's ``entry()`` as ``name args`` from ``cwd``; its exit status (``SystemExit``
    caught, any other exception raised); ``sys.argv`` and the working directory restored."""
    code, argv, here = 0, sys.argv, os.getcwd()
    try:
        os.chdir(cwd)
        sys.argv = [name, *args]
        entry()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
        os.chdir(here)
    return code


HOST_SYNCS = ("item", "__int__", "__float__", "__bool__", "tolist")
"""Tensor methods that turn device data into Python values: each makes the host wait for the device."""


class HostSyncError(AssertionError):
    """A tensor was read back to the host inside a guarded region."""


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Within the block, every method in :data:`HOST_SYNCS` raises :class:`HostSyncError`.

    Why on CPU: a CPU run cannot show a GPU stall, but the same Python calls that stall a
    GPU step (``int(t)``, ``t.item()``, ``if t:``) run on CPU too, so catching the call
    proves the code path is sync-free on any device."""
    own = {name: torch.Tensor.__dict__.get(name) for name in HOST_SYNCS}

    def refuse(name: str):
        def method(self, *args, **kwargs):
            raise HostSyncError(f"Tensor.{name} called in a region that must not synchronise the host with the device")
        return method

    for name in HOST_SYNCS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def refused(capsys, monkeypatch, tmp_path, module, *args: str) -> str:
    """Run the CLI ``module.entry()`` on ``args`` in this process, from ``tmp_path`` (Hydra's
    outputs land there); assert exit 2 and exactly one ``error:`` line; return it.
    ``capsys``: pytest's ``capsys`` or ``capfd``.  A traceback
    would surface as an exception other than ``SystemExit(2)``; in-process saves the second
    interpreter's torch and DeepSpeed imports (seconds per case)."""
    import pytest

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [module.__name__, *args])
    capsys.readouterr()  # what the test printed before is not the command's
    with pytest.raises(SystemExit) as exc:
        module.entry()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def train_cli(capfd, *overrides: str, cwd: "str | os.PathLike[str]" = ROOT) -> subprocess.CompletedProcess:
    """``oases-train overrides`` from ``cwd`` through its ``entry()`` in this process, as a
    CompletedProcess: the code a user's command runs, without a second interpreter importing
    torch and DeepSpeed and starting its own fork server (seconds per run).  Output is read
    at the fd level (``capfd``): the ranks write to this process's fds 1 and 2, which the
    launcher hands them.  What only a real process shows (exit status through the shell,
    prints at interpreter teardown) stays in the tests that run one."""
    from oases_ds.cli import train

    capfd.readouterr()
    code = run_entry(train.entry, "oases-train", overrides, cwd)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["oases-train", *overrides], code, out, err)

