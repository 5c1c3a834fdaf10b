"""Which Adam and which bf16 optimizer wrapper DeepSpeed ends up with, per accelerator.

On CUDA, DeepSpeed 0.19.8 turns an Adam config into FusedAdam (a JIT build needing nvcc) and,
for bf16 ZeRO 0, wraps it in its fused FP16_Optimizer -- not the FP16_UnfusedOptimizer whose
TMP clipping norm the engine fixes and the CPU tests check.  The CUDA accelerator class is
instantiated here on a CPU machine (it needs no device to say its name) and DeepSpeed's own
selection code is run against it."""
from __future__ import annotations

import copy
import logging

import pytest

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture(params=["cuda", "cpu"])
def accelerator(request, monkeypatch):
    """DeepSpeed's accelerator, replaced by its CUDA or CPU class for this test."""
    import deepspeed.accelerator as ds_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    accel = CUDA_Accelerator() if request.param == "cuda" else CPU_Accelerator()
    monkeypatch.setattr(ds_accelerator, "get_accelerator", lambda: accel)
    return accel


def _deepspeeds_adam_class(params: dict):
    """The optimizer class ``DeepSpeedEngine.get_optimizer_configuration`` picks for these params
    (no CPU offload), run unbound on a stand-in for the engine."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    class NoOffload:
        def zero_use_cpu_optimizer(self) -> bool:
            return False

    cls, _ = DeepSpeedEngine.get_optimizer_configuration(NoOffload(), dict(params), adam_w_mode=True)
    return cls


def test_torch_adam_is_chosen_on_every_accelerator_so_the_tested_wrapper_runs(accelerator):
    import torch
    from deepspeed.ops.adam import FusedAdam

    from oases_ds._deepspeed_compat import choose_deepspeed_defaults

    untouched = copy.deepcopy(ADAMW)
    assert _deepspeeds_adam_class(untouched["optimizer"]["params"]) is FusedAdam  # DeepSpeed's own choice
    cfg = copy.deepcopy(ADAMW)
    choose_deepspeed_defaults(cfg)
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert _deepspeeds_adam_class(cfg["optimizer"]["params"]) is torch.optim.AdamW
    # DeepSpeedEngine._configure_fp16_optimizer (bf16, ZeRO 0) fuses only for a FusedAdam instance:
    # torch's AdamW gets FP16_UnfusedOptimizer, the wrapper the engine's clipping-norm fix is for.
    assert not issubclass(torch.optim.AdamW, FusedAdam)


def test_an_explicit_choice_is_kept_on_cuda_and_logged(accelerator, caplog):
    from deepspeed.ops.adam import FusedAdam

    from oases_ds._deepspeed_compat import choose_deepspeed_defaults

    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": False}}}
    with caplog.at_level(logging.INFO, logger="oases_ds"):
        choose_deepspeed_defaults(cfg)
    if accelerator.device_name() == "cuda":
        assert cfg["optimizer"]["params"]["torch_adam"] is False
        assert _deepspeeds_adam_class(cfg["optimizer"]["params"]) is FusedAdam
        assert "a path no Oases test covers" in caplog.text
    else:  # no fused Adam to run on a CPU: torch's, as before
        assert cfg["optimizer"]["params"]["torch_adam"] is True


def test_other_optimizers_are_left_alone(accelerator):
    from oases_ds._deepspeed_compat import choose_deepspeed_defaults

    cfg = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    choose_deepspeed_defaults(cfg)
    assert cfg == {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}


def test_an_offloaded_adam_steps_with_deepspeeds_cpu_adam_unless_torch_adam_is_set(accelerator):
    from oases_ds._deepspeed_compat import choose_deepspeed_defaults

    offloaded = {**copy.deepcopy(ADAMW), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    choose_deepspeed_defaults(offloaded)
    assert offloaded["optimizer"]["params"]["torch_adam"] is False  # DeepSpeed then builds its CPU Adam
    chosen = copy.deepcopy(offloaded)
    chosen["optimizer"]["params"]["torch_adam"] = True
    choose_deepspeed_defaults(chosen)
    assert chosen["optimizer"]["params"]["torch_adam"] is True


def test_deepspeeds_cpu_adam_is_built_without_debug_information(accelerator, monkeypatch):
    """The offloaded step's op compiles with DeepSpeed's flags less ``-g`` (a third of its build
    time); a second configuration does not wrap the builder again."""
    import deepspeed.ops.adam.cpu_adam as cpu_adam

    monkeypatch.setattr(cpu_adam, "CPUAdamBuilder", cpu_adam.CPUAdamBuilder)  # DeepSpeed's again after the test
    from oases_ds._deepspeed_compat import choose_deepspeed_defaults

    offloaded = {**copy.deepcopy(ADAMW), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    choose_deepspeed_defaults(offloaded)
    wrapped = cpu_adam.CPUAdamBuilder
    choose_deepspeed_defaults(copy.deepcopy(offloaded))
    assert cpu_adam.CPUAdamBuilder is wrapped
    builder = wrapped.__mro__[1]
    # DeepSpeed's probes of the host's CPU flags compile test programs (seconds): fixed answers here
    monkeypatch.setattr(builder, "cpu_arch", lambda self: "-march=native")
    monkeypatch.setattr(builder, "simd_width", lambda self: "-D__AVX512__")
    stock = builder().cxx_args()
    assert "-g" in stock  # what DeepSpeed 0.19.8 asks for; without it this test checks nothing
    assert wrapped().cxx_args() == [arg for arg in stock if arg != "-g"] and "-O3" in wrapped().cxx_args()
