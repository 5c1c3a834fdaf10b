"""The process-group backend by device, and one GPU per rank: what ``init_distributed`` and
``oases-train`` decide on a CUDA host, checked here with CUDA's answers mocked (no GPU needed)."""
from __future__ import annotations

import os

import pytest
import torch

from oases_ds.models.config import ModelConfig
from oases_ds.parallel import context
from oases_ds.parallel.context import check_devices, rank_device, resolve_backend, uses_cuda


@pytest.fixture
def cuda_host(monkeypatch):
    """A host with one visible GPU, as torch.cuda reports it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("OASES_BACKEND", raising=False)


def test_a_cuda_host_defaults_to_gloo_for_cpu_tensors_and_nccl_for_gpu_ones(cuda_host):
    # before: "nccl" for everything, so a CPU tensor's collective had no backend
    assert resolve_backend() == "cpu:gloo,cuda:nccl"
    assert uses_cuda(resolve_backend())


def test_a_cpu_host_defaults_to_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("OASES_BACKEND", raising=False)
    assert resolve_backend() == "gloo"
    assert rank_device(resolve_backend()) == torch.device("cpu")


def test_the_setting_wins_and_gloo_makes_every_rank_a_cpu_rank(cuda_host, monkeypatch):
    monkeypatch.setenv("OASES_BACKEND", "gloo")
    assert resolve_backend() == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "3")  # more ranks than GPUs is fine on CPU ranks
    assert rank_device(resolve_backend()) == torch.device("cpu")
    assert resolve_backend(" CPU:gloo,CUDA:nccl ") == "cpu:gloo,cuda:nccl"
    assert resolve_backend("nccl") == "nccl"


@pytest.mark.parametrize("value", ["mpi", "cpu:nccl", "cuda:nccl,cuda:gloo", "cpu=gloo", "tpu:xla"])
def test_a_bad_backend_setting_is_one_line_naming_it(monkeypatch, value):
    monkeypatch.setenv("OASES_BACKEND", value)
    with pytest.raises(ValueError, match=rf"^OASES_BACKEND='{value.lower()}' is not a backend; use gloo, nccl or "
                                         r"cpu:gloo,cuda:nccl$"):
        resolve_backend()


def test_a_rank_beyond_the_gpus_is_refused_not_wrapped_onto_one(cuda_host, monkeypatch):
    # before: LOCAL_RANK % device_count put ranks 0 and 1 on cuda:0, which NCCL refuses later
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_device("cpu:gloo,cuda:nccl") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"^2 ranks on this host need 2 GPUs \(NCCL takes one per rank\) but it has 1: "
                                         r"start at most 1 per host .*CUDA_VISIBLE_DEVICES= \(gloo\)$"):
        context.default_device()


def test_check_devices_counts_ranks_per_host():
    check_devices(8, 8)
    with pytest.raises(ValueError, match="^9 ranks on this host need 9 GPUs"):
        check_devices(9, 8)


def test_oases_train_with_more_ranks_than_gpus_is_one_line_before_launch(cuda_host, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from oases_ds.cli.common import CONFIG_DIR
    from oases_ds.cli.train import validate

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_container(compose("train"), resolve=True)  # defaults: nprocs=2, tensor_parallel_size=2
    with pytest.raises(ValueError, match=r"^2 ranks on this host need 2 GPUs .*\(oases-train nprocs=1,"):
        validate(cfg)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed on its CPU accelerator: CPU ranks, any number
    validate(cfg)


@pytest.mark.parametrize("accelerator, preset, inside", [
    ("cpu", None, "gloo"),  # told to train on the CPU: the plan is profiled there too
    ("cuda", None, "cpu:gloo,cuda:nccl"),  # GPU training: GPU profiling
    ("cpu", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),  # the user's backend is kept
])
def test_plan_auto_profiles_on_the_device_the_training_ranks_use(cuda_host, monkeypatch, accelerator, preset, inside):
    """The training ranks follow ``DS_ACCELERATOR``; the profiling ranks' backend did not, so on a
    GPU host a run told to train on the CPU priced its plan on the GPU.  ``auto_plan`` profiles
    inside :func:`_profiling_on_the_training_device`; the launcher hands ranks its environment."""
    from oases_ds.cli import train
    from oases_ds.planner import planning
    from oases_ds.planner.plan import PlanInfeasibleError

    monkeypatch.setenv("DS_ACCELERATOR", accelerator)
    if preset is not None:
        monkeypatch.setenv("OASES_BACKEND", preset)
    seen = []

    def make_plan(request):  # what a profiling rank would resolve, then no plan (nothing launched)
        seen.append(resolve_backend())
        raise PlanInfeasibleError("stop here")

    monkeypatch.setattr(planning, "make_plan", make_plan)
    cfg = {"tensor_parallel_size": 2, "micro_batch": 4, "schedule": {"name": "oases"}, "cluster": {"name": "local"},
           "sequence_parallel": False, "memory_limit": "1GiB", "zero_stage": 0, "offload": False, "bf16": False,
           "fp16": False, "nprocs": 2, "pipeline_stages": 1, "timeout_s": 60.0}
    monkeypatch.setattr(train, "precision", lambda cfg: "fp32")
    monkeypatch.setattr(train, "run_topology", lambda cfg: type("T", (), {"dp_size": 1})())
    with pytest.raises(ValueError, match="stop here"):
        train.auto_plan(cfg, ModelConfig(family="gpt", vocab_size=8, hidden_size=8, num_heads=2, num_layers=1,
                                         seq_len=4), 2**30, "unused.json")
    assert seen == [inside]
    assert os.environ.get("OASES_BACKEND") == preset  # restored
