"""Launch N local rank processes and collect what each *reports*.

Why judge a rank by its report and not by its exit code: with gloo a process
sometimes aborts at interpreter exit (SIGABRT) after its work finished and its
process group was destroyed.  So each rank writes its result (or its traceback)
to a file atomically before exiting; the launcher returns the results when every
rank reported success, raises with the first failing rank's traceback
otherwise, and never waits longer than ``timeout_s`` (a rank that hangs or dies
without a report makes the whole launch fail, and the others are killed).
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A rank failed, died without reporting, or the launch timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_atomic(path: str, payload: tuple[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, path)


def _child(rank: int, world: int, port: int, threads: int, env: dict[str, str], fn, args, report: str) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        payload: tuple[str, Any] = ("ok", fn(*args))
    except BaseException:  # reported to the parent, which raises it
        payload = ("error", traceback.format_exc())
    try:
        _write_atomic(report, payload)
    except Exception:  # unpicklable result: report that instead
        _write_atomic(report, ("error", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes with torchrun-style env vars.

    ``fn`` must be importable by module path (spawn).  Returns the per-rank results.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    spawn = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="oases-launch-") as tmp:
        reports = [os.path.join(tmp, f"rank{r}.pkl") for r in range(nprocs)]
        procs = [
            spawn.Process(target=_child, args=(r, nprocs, port, threads, dict(env or {}), fn, args, reports[r]), daemon=False)
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        results: dict[int, tuple[str, Any]] = {}
        try:
            while len(results) < nprocs:
                for r in range(nprocs):
                    if r not in results and os.path.exists(reports[r]):
                        with open(reports[r], "rb") as f:
                            results[r] = pickle.load(f)
                        if results[r][0] == "error":
                            raise LaunchError(f"rank {r} failed:\n{results[r][1]}")
                    elif r not in results and not procs[r].is_alive() and not os.path.exists(reports[r]):
                        raise LaunchError(f"rank {r} exited with code {procs[r].exitcode} without reporting a result")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(nprocs)) - set(results))
                    raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for ranks {missing}")
                time.sleep(0.02)
        finally:
            for p in procs:
                p.join(timeout=10 if len(results) == nprocs else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r][1] for r in range(nprocs)]
