"""Profiler: a real T=2 profile of a tiny GPT, and reuse of the cached table."""
from __future__ import annotations

import os
import time

import pytest

from oases_ds.models.config import ModelConfig
from oases_ds.planner.profile import ProfileSpec, cache_path, profile

TINY = ModelConfig(family="gpt", vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, seq_len=8)


@pytest.mark.distributed
def test_profile_tiny_gpt_on_two_ranks_and_reuse_the_cache(tmp_path):
    spec = ProfileSpec(model=TINY, devices=2, micro_batch=4, warmup=1, repeats=2)
    table, reused = profile(spec, layers=6, cache_dir=tmp_path, timeout_s=300)
    assert not reused
    assert table.key() == spec.key() and table.layers == 6 and table.degrees == (1, 2)
    for kind in ("attn", "mlp"):
        costs = table.blocks[kind]
        assert all(c.fwd_ms > 0 and c.bwd_ms > 0 for c in costs.values())
        assert costs[2].state_bytes < costs[1].state_bytes  # shards shrink with the degree
        assert costs[1].grad_sync_ms > 0 and costs[2].grad_sync_ms == 0  # 2 replicas vs 1
        assert costs[2].act_bytes == 2 * costs[1].act_bytes  # the degree-2 replica runs twice the samples
    assert table.fixed_bytes > 0  # embedding, head, logits, working set: the memory no block row holds
    evidence = table.measurements["degrees"]
    assert evidence["2"]["allreduce_ms"] > 0 and evidence["1"]["allreduce_ms"] == 0
    assert evidence["2"]["blocks"]["attn"]["comm_fwd_ms"] > 0  # one forward AllReduce per sub-batch
    # every rank's every timed step is kept (2 ranks x 2 repeats per degree), each at least its own op times
    for degree in ("1", "2"):
        walls = evidence[degree]["step_ms_per_rank"]
        assert [len(w) for w in walls] == [2, 2] and all(ms > 0 for w in walls for ms in w)
    # in ms, as the op times: a step runs both sub-batches' ops, twice their per-sub-batch sum (once: noise margin)
    times = table.op_profile[1].op_ms
    assert min(evidence["1"]["step_ms_per_rank"][0]) >= sum(sum(times.of_pass(p).values()) for p in "FRB")

    path = cache_path(tmp_path, spec.key())
    stamp = table.measurements["profiled_at"], os.path.getmtime(path)
    started = time.perf_counter()
    again, reused = profile(spec, layers=12, cache_dir=tmp_path)
    assert reused and time.perf_counter() - started < 2.0  # no ranks launched
    assert (again.measurements["profiled_at"], os.path.getmtime(path)) == stamp
    assert again.layers == 12 and again.blocks == table.blocks

    # What if the link were slower: same measured compute, replayed on a 10 GbE and a 10 Mb/s link.
    from oases_ds.parallel.link import LinkModel
    from oases_ds.planner.replay import simulate_profiled_layer

    fast = simulate_profiled_layer(table, 2, LinkModel(10.0, 50.0))
    slow = simulate_profiled_layer(table, 2, LinkModel(0.01, 50.0))
    # Same messages on both links (50 us each): the transfer part scales with 1/bandwidth, 1000x.
    messages = len(slow.lane("comm"))
    assert messages == len(fast.lane("comm")) > 0
    assert slow.comm_ms - messages * 0.05 == pytest.approx(1000 * (fast.comm_ms - messages * 0.05), rel=1e-9)
    assert fast.compute_ms > 0
    # One compute lane and one link: the step ends after both have done all their work.
    assert slow.step_ms >= max(slow.comm_ms, slow.compute_ms)
    assert slow.exposed_comm_ms > fast.exposed_comm_ms


@pytest.mark.distributed
def test_profiled_collectives_are_priced_at_the_link_time(tmp_path):
    """Cost model 6: on an emulated 0.2 Gbit/s, 50 us link a block's collectives cost the link's time,
    by hand: a 2-rank ring AllReduce puts its payload P once on the wire, 50 us + P * 8 / 0.2e9 s, and
    the attention block has one forward AllReduce per sub-batch (2).  The measured blocking AllReduce
    (kept as evidence) takes at least that: the emulator holds it to the link."""
    from oases_ds.parallel.link import LinkModel

    spec = ProfileSpec(model=TINY, devices=2, micro_batch=4, warmup=1, repeats=2, link=LinkModel(0.2, 50.0, sharing="ring"))
    table, _ = profile(spec, layers=2, cache_dir=None, timeout_s=300)
    evidence = table.measurements["degrees"]["2"]
    payload = 4 // 2 * TINY.seq_len * TINY.hidden_size * 4  # one sub-batch's (b, s, h) fp32 activation
    assert table.op_profile[2].payload_bytes == payload
    link_ms = 0.05 + payload * 8 / 0.2e9 * 1e3
    assert evidence["allreduce_link_ms"] == pytest.approx(link_ms)
    assert evidence["blocks"]["attn"]["comm_fwd_ms"] == pytest.approx(2 * link_ms)
    assert evidence["allreduce_ms"] >= link_ms


@pytest.mark.distributed
def test_a_sequence_parallel_profile_prices_halves_and_the_regather_and_plans_its_policies(tmp_path):
    """The profiler runs the layer with sequence parallelism (degree 2 only) on an emulated link: each
    block collective is a ReduceScatter or an AllGather, half an AllReduce's wire time, two per block
    forward and two backward, and the recomputation's re-gather one more per sub-batch, recorded apart;
    ``planner.recompute=auto`` then prices store and oases_gathered from it."""
    from oases_ds.parallel.link import LinkModel
    from oases_ds.planner.policies import with_store_costs
    from oases_ds.planner.profile import PROFILE_DTYPE_BYTES

    link = LinkModel(0.2, 50.0, sharing="ring")
    spec = ProfileSpec(model=TINY, devices=2, micro_batch=4, warmup=1, repeats=2, link=link, sequence_parallel=True)
    table, _ = profile(spec, layers=2, cache_dir=None, timeout_s=300)
    assert table.sequence_parallel and table.degrees == (2,) and table.key().startswith(spec.model_label())
    assert spec.model_label().endswith("-sp2")
    payload = 4 // 2 * TINY.seq_len * TINY.hidden_size * 4
    half_ms = 0.05 + payload / 2 * 8 / 0.2e9 * 1e3  # (t-1)/t of the payload on a 2-rank ring
    attn = table.measurements["degrees"]["2"]["blocks"]["attn"]
    assert attn["comm_fwd_ms"] == pytest.approx(2 * 2 * half_ms)  # AllGather + ReduceScatter, 2 sub-batches
    assert attn["regather_ms"] == pytest.approx(2 * half_ms)
    assert attn["comm_bwd_ms"] == pytest.approx(2 * 2 * half_ms + attn["regather_ms"])
    priced = with_store_costs(table, TINY, 4, PROFILE_DTYPE_BYTES)
    assert priced.policies == ("oases", "store", "oases_gathered")
    for kind in ("attn", "mlp"):
        oases, gathered = priced.blocks[kind][2], priced.gathered_blocks[kind][2]
        assert gathered.bwd_ms == oases.bwd_ms and gathered.act_bytes > oases.act_bytes
        assert priced.store_blocks[kind][2].bwd_ms < oases.bwd_ms


def test_profile_spec_names_the_field():
    with pytest.raises(ValueError, match="micro_batch=6: the degree-1 share"):
        ProfileSpec(model=TINY, devices=2, micro_batch=6)
    with pytest.raises(ValueError, match="planner.devices must be a power of two"):
        ProfileSpec(model=TINY, devices=3, micro_batch=12)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide model.num_heads=4"):
        ProfileSpec(model=TINY, devices=8, micro_batch=16)
    with pytest.raises(TypeError, match=r"ProfileSpec.schedule must be a ScheduleSpec, e.g. ScheduleSpec\('oases'\)"):
        ProfileSpec(model=TINY, devices=2, micro_batch=4, schedule="oases")


def test_profile_spec_splits_only_sub_batched_schedules():
    from oases_ds.schedule.generators import ScheduleSpec

    whole = ProfileSpec(model=TINY, devices=2, micro_batch=2, schedule=ScheduleSpec("megatron", sub_batches=4))
    assert whole.sub_batches == 1  # megatron runs the micro-batch whole: a 1-sample share is fine
    with pytest.raises(ValueError, match="must be a whole multiple of the schedule's 4 sub-batches; use a multiple of 8"):
        ProfileSpec(model=TINY, devices=2, micro_batch=4, schedule=ScheduleSpec("oases", sub_batches=4))


def test_key_separates_links_and_schedule_ablations():
    from oases_ds.parallel.link import LinkModel
    from oases_ds.schedule.generators import ScheduleSpec

    base = ProfileSpec(model=TINY, devices=2, micro_batch=4)
    slow = ProfileSpec(model=TINY, devices=2, micro_batch=4, link=LinkModel(10.0, 50.0))
    ablated = ProfileSpec(model=TINY, devices=2, micro_batch=4, schedule=ScheduleSpec("oases", cross_pass=False))
    ring = ProfileSpec(model=TINY, devices=2, micro_batch=4, link=LinkModel(10.0, 50.0, sharing="ring"))
    assert len({base.key(), slow.key(), ablated.key(), ring.key()}) == 4  # the sharing model changes every wait
    assert "@10Gbps+50us,fifo" in slow.key() and "@10Gbps+50us,ring" in ring.key()
    assert base.key() == ProfileSpec(model=TINY.__class__(**{**TINY.to_dict(), "num_layers": 9}), devices=2, micro_batch=4).key()
