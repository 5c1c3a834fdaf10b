"""The step, its timeline and the profiler on a real GPU (skipped without CUDA; see conftest.py).

Small on purpose: the tiny two-layer models of the CPU parity tests, one micro-batch, so the
whole file runs in well under a minute on one GPU.
"""
import math

import pytest
import torch

import gpu_workers as gw
from oases_ds.launcher import launch
from oases_ds.models.config import ModelConfig
from oases_ds.planner.profile import ProfileSpec, profile
from oases_ds.runtime.timeline import CudaClock
from oases_ds.schedule.generators import ScheduleSpec
from support import forbid_host_sync

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("schedule", ["oases", "megatron", "none"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tmp1_schedules_on_one_gpu_match_the_reference(family, schedule):
    ref_loss, ref_grads = gw.reference(family)
    model, _, loss = gw.run_schedule(family, schedule, CUDA)
    err, name = gw.worst_shard_error(model, ref_grads)
    assert err <= gw.GPU_TOL, f"{name}: rel err {err:.2e}"
    assert abs(float(loss) - ref_loss) <= gw.GPU_TOL * abs(ref_loss)


@pytest.mark.distributed
def test_tmp2_as_two_ranks_on_one_gpu_matches_the_reference():
    for rank, r in enumerate(launch(gw.tmp2_one_device_worker, 2, ("gpt", "oases"), timeout_s=300)):
        assert r["grad_err"] <= gw.GPU_TOL, f"rank {rank}: {r['worst']} rel err {r['grad_err']:.2e}"
        assert r["loss_err"] <= gw.GPU_TOL and r["clock"] == "CudaClock"


def test_bf16_on_gpu_tracks_fp32():
    _, _, fp32 = gw.run_schedule("llama", "oases", CUDA)
    model, _, bf16 = gw.run_schedule("llama", "oases", CUDA, dtype=torch.bfloat16)
    # bf16 keeps 8 bits of mantissa (~4e-3 relative per rounding); a few dozen roundings deep, 3e-2 is ample
    assert abs(float(bf16) - float(fp32)) <= 3e-2 * abs(float(fp32))
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()) for g in grads)


def test_the_step_records_a_cuda_event_timeline_without_syncing():
    gw.run_schedule("gpt", "oases", CUDA)  # warm-up: CUDA context, kernels
    _, executor, batch = gw.build("gpt", "oases", CUDA)  # the copies to the device happen here, not in the step
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # CUDA itself raises on any synchronising call
    try:
        with forbid_host_sync():
            loss = executor.run(batch)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    timeline = executor.timeline
    assert isinstance(timeline.clock, CudaClock)
    events = timeline.events  # the first read: resolves the events (waits for the device here, once)
    assert events and all(e.end >= e.start >= 0 for e in events)
    summary = timeline.summary()
    assert 0 < summary["compute_util"] <= 1 and summary["span_s"] > 0 and math.isfinite(float(loss))
    assert {e.lane for e in events} >= {"compute", "wait", "comm"}


def test_the_dp_reducer_times_its_wait_with_cuda_events_without_syncing():
    """One GPU, a DP group of one: the reducer's clock is the CUDA one, and arming, the run
    and finish() make no host synchronisation; the wait is read (resolved) afterwards."""
    from oases_ds.runtime.dp_overlap import DPGradReducer

    gw.run_schedule("gpt", "oases", CUDA)  # warm-up: CUDA context, kernels
    model, executor, batch = gw.build("gpt", "oases", CUDA)
    reducer = DPGradReducer(model, executor.schedule, executor.comm, None)
    assert isinstance(reducer.clock, CudaClock)
    executor.add_hook(reducer)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with forbid_host_sync():
            reducer.arm([(p, None) for p in model.parameters()], 1.0)
            executor.run(batch)
            reducer.finish()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert 0 <= reducer.wait_s < 60 and all(p.grad is not None and p.grad.is_cuda for p in model.parameters())


def test_the_profiler_measures_a_layer_on_the_gpu():
    model = ModelConfig(family="gpt", hidden_size=64, num_heads=4, num_layers=1, seq_len=32, vocab_size=128)
    table, cached = profile(ProfileSpec(model=model, devices=1, micro_batch=4, schedule=ScheduleSpec("oases"),
                                        warmup=1, repeats=2), layers=2, timeout_s=300)
    assert not cached
    for kind in ("attn", "mlp"):
        cost = table.blocks[kind][1]
        assert cost.fwd_ms > 0 and cost.bwd_ms > 0 and cost.state_bytes > 0
