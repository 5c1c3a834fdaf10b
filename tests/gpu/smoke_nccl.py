"""The executor's async path through NCCL on one GPU (a step of ``tests/gpu/smoke.sh``).

One GPU cannot hold two NCCL ranks, but a world of one still runs NCCL's stream path:
every TMP collective here is issued on the world group (a one-rank sum is the identity),
each behind a 256 MiB all-reduce queued on the same communicator, so its result arrives
late.  A missing stream wait (a Sync that lets the compute stream read before NCCL wrote)
would then read stale data and the gradients would miss the fp32 CPU reference.

Checks, printed as one JSON line:

* every family x schedule against the unsharded CPU reference (``GPU_TOL``), with the
  number of collectives that really went through NCCL;
* the DP reducer with its buckets on the world group, under ``set_sync_debug_mode("error")``;
* the timeline: compute / comm / wait lanes, events ordered, exposed fraction in [0, 1);
* a bf16 LLaMA (dropout 0, head_dim 64, seq 1024) under ``sdpa_kernel(FLASH_ATTENTION)``,
  which raises where flash attention cannot run.

    python tests/gpu/smoke_nccl.py                 # needs CUDA; sets up a world of one itself
    python tests/gpu/smoke_nccl.py --device cpu    # the same over gloo, without flash (tests this script)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import gpu_workers as gw  # noqa: E402
import oases_ds.parallel.comm as comm_module  # noqa: E402
from oases_ds.parallel.collectives import Pending  # noqa: E402

DELAY_BYTES = 256 * 2**20
FAMILIES = ("gpt", "llama", "bert")
SCHEDULES = ("oases", "megatron", "split_overlap", "none")


class DelayedWorld:
    """Stand-ins for ``start_all_reduce`` / ``start_all_gather`` that always use NCCL: on the
    world group, each after a large all-reduce on the same stream (counted in ``issued``)."""

    def __init__(self, device: torch.device) -> None:
        self.delay = torch.ones((DELAY_BYTES if device.type == "cuda" else 2**20) // 4, device=device)
        self.issued = 0

    def _behind_delay(self) -> None:
        dist.all_reduce(self.delay, group=dist.group.WORLD, async_op=True)
        self.issued += 1

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> Pending:
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        self._behind_delay()
        return Pending(dist.all_reduce(out, op=op, group=dist.group.WORLD, async_op=True), lambda: out)

    def all_gather(self, tensor: torch.Tensor, group, dim: int) -> Pending:
        src = tensor.detach().contiguous()
        parts = [torch.empty_like(src)]
        self._behind_delay()
        work = dist.all_gather(parts, src, group=dist.group.WORLD, async_op=True)
        return Pending(work, lambda: torch.cat(parts, dim=dim))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(device: torch.device) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from oases_ds.parallel.context import init_distributed

    init_distributed(timeout_s=120, backend="nccl" if device.type == "cuda" else "gloo")
    world = DelayedWorld(device)
    comm_module.start_all_reduce, comm_module.start_all_gather = world.all_reduce, world.all_gather
    out: dict = {"backend": dist.get_backend(), "parity": {}}
    for family in FAMILIES:
        ref_loss, ref_grads = gw.reference(family)
        for schedule in SCHEDULES:
            before = world.issued
            model, executor, loss = gw.run_schedule(family, schedule, device)
            err, name = gw.worst_shard_error(model, ref_grads)
            out["parity"][f"{family}/{schedule}"] = {
                "grad_err": err, "worst": name, "loss_err": abs(float(loss) - ref_loss) / abs(ref_loss),
                "nccl_collectives": world.issued - before}
    out["parity_ok"] = all(r["grad_err"] <= gw.GPU_TOL and r["loss_err"] <= gw.GPU_TOL and r["nccl_collectives"] > 0
                           for r in out["parity"].values())
    out["timeline"] = _timeline(device)
    out["dp_reducer"] = _dp_reducer(device, world)
    out["flash_attention"] = _flash(device) if device.type == "cuda" else {"ok": True, "skipped": "flash needs CUDA"}
    dist.destroy_process_group()
    return out


def _timeline(device: torch.device) -> dict:
    _, executor, _ = gw.run_schedule("gpt", "oases", device)
    events = executor.timeline.events
    summary = executor.timeline.summary()
    lanes = sorted({e.lane for e in events})
    ordered = all(e.end >= e.start >= 0 for e in events)
    frac = summary["exposed_comm_frac"]
    return {"lanes": lanes, "ordered": ordered, "exposed_comm_frac": frac,
            "ok": set(lanes) >= {"compute", "comm", "wait"} and ordered and 0 <= frac < 1}


def _dp_reducer(device: torch.device, world: DelayedWorld) -> dict:
    from oases_ds.runtime.dp_overlap import DPGradReducer

    model, executor, batch = gw.build("gpt", "oases", device)
    executor.run(batch)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    reducer = DPGradReducer(model, executor.schedule, executor.comm, dist.group.WORLD)
    executor.add_hook(reducer)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    before = world.issued
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")  # CUDA raises on any synchronising call in the step
    try:
        reducer.arm([(p, None) for p in model.parameters()], 1.0)
        executor.run(batch)
        reducer.finish()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
    worst = max(float((p.grad - w).norm() / w.norm().clamp_min(1e-12)) for p, w in zip(model.parameters(), want))
    return {"grad_err_vs_no_reducer": worst, "nccl_collectives": world.issued - before,
            "ok": worst <= gw.GPU_TOL and world.issued > before}


def _flash(device: torch.device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dist_workers import make_batch, tiny_config
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.runtime.executor import Executor
    from oases_ds.schedule.generators import ScheduleSpec

    cfg = tiny_config("llama", dropout=0.0, hidden_size=256, num_heads=4, seq_len=1024, vocab_size=512)
    model = OperatorModel(cfg, seed=3).to(device=device, dtype=torch.bfloat16)
    executor = Executor.for_schedule(model, ScheduleSpec("oases"))
    batch = {k: v.to(device) for k, v in make_batch(cfg, 2, 0).items()}
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            loss = float(executor.run(batch))
    except RuntimeError as err:  # "No available kernel": the route did not meet flash's conditions
        return {"ok": False, "error": str(err).splitlines()[0][:300]}
    return {"ok": bool(torch.isfinite(torch.tensor(loss))), "loss": loss}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    result = main(torch.device(ap.parse_args().device))
    result["ok"] = bool(result["parity_ok"] and result["timeline"]["ok"] and result["dp_reducer"]["ok"]
                        and result["flash_attention"]["ok"])
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
