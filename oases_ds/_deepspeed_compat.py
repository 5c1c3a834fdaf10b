"""DeepSpeed defaults that keep every accelerator on the code path the tests run.

Two of DeepSpeed 0.19.8's choices differ by accelerator:

* **Adam.** Unless the config says ``"torch_adam": true``, an ``Adam``/``AdamW`` optimizer
  becomes DeepSpeed's FusedAdam: a JIT build on first use (~90 s on CPU; on CUDA it needs
  nvcc matching torch's CUDA and ninja, and fails with "CUDA_HOME does not exist" on a
  pip-only host).  And for bf16 with ZeRO 0 a FusedAdam makes DeepSpeed wrap it in its
  *fused* ``FP16_Optimizer`` -- another clipping-norm computation (a flat-buffer mask built
  on the first step), an fp32 copy of every gradient the planner does not count, and a
  host sync per parameter -- where torch's Adam gets ``FP16_UnfusedOptimizer``, the class
  whose TMP clipping norm the engine fixes and the tests check
  (``OasesEngine._mark_sharded_grads``).  So Oases selects torch's Adam on every
  accelerator; on a GPU a config that sets ``torch_adam`` itself keeps its choice (``false``
  then runs DeepSpeed's fused path, which no Oases test covers, and says so in the log).
  With ``zero_optimization.offload_optimizer`` the step runs on the host, and there the
  default is DeepSpeed's CPU Adam (the op ZeRO-Offload is built around: a C++ build of
  about a minute on first use, cached under ``~/.cache/torch_extensions``), unless the
  config sets ``torch_adam``.  Oases builds that op without debug information
  (:func:`build_cpu_adam_without_debug_info`): the same ``-O3`` code, a third less build time.
* **A warning at every start.**  DeepSpeed's ``WarmupLR`` (and its other warm-up
  schedulers) set the optimizer's first learning rate in their constructor by calling
  their own ``get_lr`` before their first step, which logs "Attempting to get learning
  rate from scheduler before it has started" -- once per rank, on every run, about
  nothing the user did.  :func:`quiet_scheduler_start` drops that one message while the
  engine is built; a later call before the scheduler started still warns.
* **The shared-memory all-reduce op**, built whenever DeepSpeed's comm starts on its CPU
  accelerator, is used only by inference all-reduce; on CPU we skip the build by replacing
  the private ``deepspeed.comm.torch.build_shm_op`` with "not available", the answer
  DeepSpeed gives on platforms without the op.  GPUs do not build it.
* **A deprecation addressed to DeepSpeed.**  torch 2.13 deprecates
  ``torch.distributed.all_gather_into_tensor``, which DeepSpeed's ZeRO-2 gathers call: each rank
  printed a ``FutureWarning`` about code the user cannot change.  :func:`quiet_deepspeed_deprecations`
  drops that one message.
* **fp16 on a CPU** without oneDNN fp16 kernels is refused by DeepSpeed; torch computes
  it (slowly), so :func:`allow_cpu_fp16` lets the engine start and logs the cost.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from typing import Iterator

from oases_ds.config import offload_device

log = logging.getLogger("oases_ds")


def accelerator_name() -> str:
    """DeepSpeed's accelerator (``cpu``, ``cuda``, ...)."""
    # local: ``oases_ds/__init__`` and the Lightning strategy import this module, and
    # importing them must not load DeepSpeed (seconds; it fixes the accelerator)
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def on_cpu() -> bool:
    return accelerator_name() == "cpu"


def allow_cpu_fp16() -> None:
    """Let DeepSpeed's engine start in fp16 on a CPU without oneDNN fp16 kernels.

    DeepSpeed 0.19.8 refuses fp16 there ("Type fp16 is not supported on your device"),
    although torch computes fp16 on any CPU, in a slow fallback (measured here: a
    512x1024x1024 fp16 matmul 98x the fp32 one).  fp16 is for GPUs without bf16; on a CPU it
    serves tests and small checks, so it runs and says what it costs."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        log.warning("oases: fp16 on this CPU runs in torch's slow fallback (no oneDNN fp16 kernels; matmuls about "
                    "100x fp32's): fine for tests and small checks, use bf16 or fp32 to train on a CPU")
        accelerator.is_fp16_supported = lambda: True


def choose_deepspeed_defaults(config: dict) -> None:
    """Set, in ``config`` (a DeepSpeed config dict), the choices the module docstring gives."""
    name = accelerator_name()
    if name == "cpu":
        # importlib, not ``import deepspeed.comm.torch``: the package re-exports the name
        # ``torch`` (the PyTorch module), which shadows its submodule of the same name.
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
        ds_torch_comm.build_shm_op = lambda: None
        if (config.get("fp16") or {}).get("enabled", False):
            allow_cpu_fp16()
    opt = config.get("optimizer") or {}
    if str(opt.get("type", "")).lower() not in ("adam", "adamw"):
        return
    params = opt.setdefault("params", {})
    if offload_device(config) is not None:
        if "torch_adam" not in params:  # the offloaded step runs on the host: DeepSpeed's CPU Adam is made for it
            log.info("oases: optimizer offload steps with DeepSpeed's CPU Adam (a C++ op built at first use, about a "
                     "minute, then cached); set optimizer.params.torch_adam=true for torch's Adam on the host instead")
            params["torch_adam"] = False
        if not params["torch_adam"]:
            build_cpu_adam_without_debug_info()
        return
    if name == "cpu" and not params.get("torch_adam", True):
        log.info("oases: CPU run, optimizer.params.torch_adam=false overridden (the fused Adam is a CUDA kernel)")
        params["torch_adam"] = True
    if "torch_adam" not in params:
        log.info("oases: using torch's Adam (DeepSpeed's fused Adam needs a JIT build and, with bf16, another "
                 "optimizer wrapper); set optimizer.params.torch_adam=false to choose it")
        params["torch_adam"] = True
    elif not params["torch_adam"] and name != "cpu":
        log.warning("oases: optimizer.params.torch_adam=false on %s runs DeepSpeed's FusedAdam (a JIT build) and, with "
                    "bf16, its fused FP16_Optimizer, a path no Oases test covers", name)


def build_cpu_adam_without_debug_info() -> None:
    """Make DeepSpeed's CPU Adam, when it is first built, compile without ``-g``.

    DeepSpeed compiles the op's two C++ files with ``-O3 -g`` at its first use on a host (and again
    in every new environment, since the include paths are part of the build).  Nobody debugs the
    op from an Oases run, and the debug information is a third of the build: measured here, each
    file 28-29 s with ``-g``, 20 s without, with identical optimisation flags.  The optimizer
    module looks its builder up by name at construction, so a subclass dropping the flag is put
    in that name; an op installed ahead of time (``DS_BUILD_CPU_ADAM=1``) is used as before,
    since the builder's ``load`` imports an installed op without compiling."""
    cpu_adam = importlib.import_module("deepspeed.ops.adam.cpu_adam")
    builder = cpu_adam.CPUAdamBuilder
    if getattr(builder, "oases_without_debug_info", False):
        return

    class CPUAdamBuilderWithoutDebugInfo(builder):
        oases_without_debug_info = True

        def cxx_args(self) -> list[str]:
            return [arg for arg in super().cxx_args() if arg != "-g"]

    cpu_adam.CPUAdamBuilder = CPUAdamBuilderWithoutDebugInfo


_SCHEDULER_NOT_STARTED = "Attempting to get learning rate from scheduler before it has started"


class _DropSchedulerStart(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_SCHEDULER_NOT_STARTED)


@contextlib.contextmanager
def quiet_scheduler_start() -> Iterator[None]:
    """DeepSpeed's logger without the scheduler-construction warning (module docstring)."""
    ds_logger = logging.getLogger("DeepSpeed")
    drop = _DropSchedulerStart()
    ds_logger.addFilter(drop)
    try:
        yield
    finally:
        ds_logger.removeFilter(drop)


_ALL_GATHER_DEPRECATED = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"


def quiet_deepspeed_deprecations() -> None:
    """Drop torch's deprecation of the collective DeepSpeed's ZeRO gathers call (module docstring).

    A process-wide filter, since the warning comes at the first training step, not while the
    engine is built; it matches that one message only."""
    warnings.filterwarnings("ignore", message=_ALL_GATHER_DEPRECATED, category=FutureWarning)
