"""What the GPU tests run, in process or in rank processes (spawned ranks find this module
because the test process had this folder on ``sys.path``).

The reference is the unsharded :class:`reference_models.ReferenceModel` in fp32 on CPU (it
builds its masks and rotary tables on CPU), so every GPU result is compared with the same
numbers the CPU parity tests use.  Dropout is keyed by sample index, so the masks are the
same on both devices.
"""
from __future__ import annotations

import torch

from dist_workers import make_batch, rel_err, tiny_config
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext, init_distributed
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec
from reference_models import ReferenceModel

SEED, DROPOUT_SEED, MICRO_BATCH = 7, 11, 4
# fp32 on GPU vs fp32 on CPU: the same math with other reduction orders (and TF32 switched
# off), so gradients agree to ~1e-6 relative; 1e-4 leaves room for the deepest sums.
GPU_TOL = 1e-4


def reference(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsharded fp32 CPU reference's loss and full gradients on micro-batch 0."""
    cfg = tiny_config(family)
    ref = ReferenceModel(cfg, seed=SEED)
    batch = make_batch(cfg, MICRO_BATCH, 0)
    loss = ref(batch["tokens"], batch["labels"], RNGTracker(seed=DROPOUT_SEED))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in ref.named_parameters()}


def build(family: str, schedule: str, device: torch.device, dtype: torch.dtype = torch.float32,
          ctx: ParallelContext | None = None) -> tuple[OperatorModel, Executor, dict[str, torch.Tensor]]:
    """Model, executor and micro-batch 0, all on ``device`` (copies done here, outside any timed run)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = tiny_config(family)
    model = OperatorModel(cfg, group=ctx.tp_group if ctx else None, seed=SEED).to(device=device, dtype=dtype)
    executor = Executor.for_schedule(model, ScheduleSpec(schedule), rng=RNGTracker(seed=DROPOUT_SEED))
    batch = {k: v.to(device) for k, v in make_batch(cfg, MICRO_BATCH, 0).items()}
    return model, executor, batch


def run_schedule(family: str, schedule: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 ctx: ParallelContext | None = None) -> tuple[OperatorModel, Executor, torch.Tensor]:
    """One micro-batch through ``schedule`` on ``device``; the model's ``.grad`` holds its gradients."""
    model, executor, batch = build(family, schedule, device, dtype, ctx)
    return model, executor, executor.run(batch)


def worst_shard_error(model: OperatorModel, full_grads: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative error of this rank's gradient shards against the reference's (same norm floor
    as the CPU parity tests)."""
    floor = 1e-4 * float(torch.cat([g.flatten() for g in full_grads.values()]).norm())
    worst, name_of = 0.0, ""
    for name, param in model.named_parameters():
        want = model.sharding.shard_of(name, param, full_grads[name])
        err = rel_err(param.grad.detach().float().cpu(), want, floor)
        if err > worst:
            worst, name_of = err, name
    return worst, name_of


def tmp2_one_device_worker(family: str, schedule: str, device: str = "cuda:0") -> dict:
    """TMP 2 as two ranks sharing one ``device``: gloo, because NCCL refuses two ranks on one device."""
    init_distributed(timeout_s=120, backend="gloo")
    ctx = ParallelContext.build(tensor_parallel_size=2, timeout_s=120, device=torch.device(device))
    ref_loss, ref_grads = reference(family)
    model, executor, loss = run_schedule(family, schedule, ctx.device, ctx=ctx)
    err, name = worst_shard_error(model, ref_grads)
    return {"grad_err": err, "worst": name, "loss_err": abs(float(loss) - ref_loss) / abs(ref_loss),
            "clock": type(executor.timeline.clock).__name__}
