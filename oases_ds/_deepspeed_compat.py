"""Keep DeepSpeed from JIT-compiling C++ ops on CPU machines (~90 s on a first run).

On its CPU accelerator DeepSpeed 0.19.8 builds (a) a shared-memory all-reduce op
whenever its comm backend starts -- used only by inference all-reduce, never by
training -- and (b) a fused Adam unless the config says ``torch_adam``.  Neither
helps a CPU training run, so on CPU we skip the first (by replacing the private
``deepspeed.comm.torch.build_shm_op`` with "not available", the same answer
DeepSpeed gives on platforms without the op) and select torch's Adam for the
second.  GPUs are untouched.
"""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger("oases_ds")


def on_cpu() -> bool:
    # local: ``oases_ds/__init__`` and the Lightning strategy import this module, and
    # importing them must not load DeepSpeed (seconds; it fixes the accelerator)
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def avoid_cpu_jit_builds(config: dict) -> None:
    if not on_cpu():
        return
    # importlib, not ``import deepspeed.comm.torch``: the package re-exports the name
    # ``torch`` (the PyTorch module), which shadows its submodule of the same name.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None
    opt = config.get("optimizer") or {}
    if str(opt.get("type", "")).lower() in ("adam", "adamw"):
        params = opt.setdefault("params", {})
        if not params.get("torch_adam", False):
            log.info("oases: CPU run, using torch's Adam (DeepSpeed's fused Adam would need a JIT build)")
            params["torch_adam"] = True
