import pytest

from oases_ds.parallel.topology import Coord, Topology


def test_coords_round_trip_and_groups_partition_world():
    topo = Topology(world_size=8, tp_size=2)
    assert topo.dp_size == 4
    for rank in range(8):
        assert topo.rank(topo.coord(rank)) == rank
    assert topo.coord(5) == Coord(dp=2, tp=1)
    assert topo.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.dp_group_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for groups in (topo.tp_group_ranks(), topo.dp_group_ranks()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_sub_groups_split_each_tp_group():
    topo = Topology(world_size=8, tp_size=4)
    assert topo.sub_tp_group_ranks(2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.sub_tp_group_ranks(4) == topo.tp_group_ranks()
    with pytest.raises(ValueError, match="must divide"):
        topo.sub_tp_group_ranks(3)


def test_world_not_divisible_by_tp_names_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide world size 6"):
        Topology(world_size=6, tp_size=4)


def test_rank_out_of_range():
    with pytest.raises(ValueError):
        Topology(4, 2).coord(4)


class _CountingNewGroup:
    """Stands in for ``torch.distributed.new_group``: records each call's ranks and
    keyword arguments, returns a token naming the ranks."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, ranks, **kwargs):
        self.calls.append({"ranks": list(ranks), **kwargs})
        return tuple(ranks)


class _FakeGroup:
    """What ``_RecordingNewGroup`` hands its own rank: the members, so that the model code's
    ``dist.get_world_size(group)`` / ``dist.get_rank(group)`` can be answered."""

    def __init__(self, ranks, me) -> None:
        self.ranks, self.me = list(ranks), me


class _RecordingNewGroup:
    """``new_group`` for one rank: records every call in order; a group holding the rank
    comes back as a :class:`_FakeGroup`, any other as torch's non-member marker."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.calls: list[tuple] = []

    def __call__(self, ranks, **kwargs):
        self.calls.append((tuple(ranks), kwargs["timeout"].total_seconds(), kwargs["use_local_synchronization"]))
        return _FakeGroup(ranks, self.me) if self.me in ranks else object()


@pytest.fixture
def fake_groups(monkeypatch):
    """Let ``torch.distributed`` size and rank :class:`_FakeGroup`s (the models read both)."""
    import torch.distributed as dist

    size, rank = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(group.ranks) if isinstance(group, _FakeGroup) else size(group))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: group.ranks.index(group.me) if isinstance(group, _FakeGroup) else rank(group))


def test_every_rank_creates_the_same_groups_in_one_order_for_a_mixed_plan_across_stages(fake_groups):
    # PP 2 x DP 2 x TMP 2.  Stage 0's blocks all run at degree 2, stage 1 mixes 1 and 2: before,
    # only stage 1 created the reshard and replica groups (lazily), so the two stages made a
    # different number of world-wide NCCL splits and start-up hung.  Now every rank builds its
    # stage, its executor and the engine's DP reducer groups from the same sequence of calls.
    from oases_ds.models.config import ModelConfig
    from oases_ds.models.operator_model import OperatorModel
    from oases_ds.models.stages import split_stages
    from oases_ds.parallel.context import ParallelContext
    from oases_ds.planner.plan import Plan

    topo = Topology(world_size=8, tp_size=2, pp_size=2)
    cfg = ModelConfig(family="gpt", vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, ffn_size=32,
                      seq_len=8, dropout=0.0)
    plan = Plan(attn_degrees=(2, 2, 1, 2), mlp_degrees=(2, 2, 2, 1), devices=2)
    stages = split_stages(cfg.num_layers, 2)
    sequences = {}
    for rank in range(topo.world_size):
        fake = _RecordingNewGroup(rank)
        ctx = ParallelContext.for_rank(topo, rank, timeout_s=42.0, new_group=fake)
        model = OperatorModel.for_plan(cfg, ctx, plan, stage=stages[ctx.pp_rank])
        model.sharding.replica_groups(model.layers)  # what every executor asks for at start-up
        for layout in (lay for pair in model.sharding.layouts for lay in pair):
            if layout.replicas > 1:
                assert rank in ctx.replica_dp_group(layout.degree).ranks  # what the engine's DP reducer asks for
        sequences[rank] = fake.calls
        assert all(timeout == 42.0 and not local for _, timeout, local in fake.calls)
    assert all(seq == sequences[0] for seq in sequences.values())
    # tp 4 + dp 4 + pp 4 + pp_grad 4 + model 2 + reshard(1, 2) 4 + replica_dp(1) 2
    assert len(sequences[0]) == 24
    assert [c[0] for c in sequences[0][-6:]] == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7)]


def test_a_plan_group_asked_for_after_start_up_is_an_error_not_a_hang():
    from oases_ds.parallel.context import LateGroupError, ParallelContext

    ctx = ParallelContext.for_rank(Topology(8, 4), 0, new_group=_RecordingNewGroup(0))
    ctx.create_plan_groups([4, 2, 4, 4])  # uses degree 2 only
    with pytest.raises(LateGroupError, match=r"^plan group \('reshard', 1, 4\) was not created at start-up"):
        ctx.reshard_group(1, 4)
    assert ctx.plan_groups_created == 2 + 1  # sub 2, reshard (2, 4), replica_dp 2 (DP 2)


def test_plan_group_keys_follow_the_whole_plan_in_one_order():
    topo = Topology(world_size=16, tp_size=8)  # DP 2
    assert topo.plan_group_keys([8, 8, 8, 8]) == []
    assert topo.plan_group_keys([8, 2, 4, 8], data_parallel_reduce=False) == [
        ("sub", 2), ("sub", 4), ("reshard", 2, 4), ("reshard", 2, 8), ("reshard", 4, 8)]
    assert topo.plan_group_keys([1, 1]) == [("reshard", 1, 8), ("replica_dp", 1)]
    # a 512-rank TMP-8 plan with degrees 2 and 8 creates 256 + 128 + 8... groups, not all 1,544 of every degree
    big = Topology(world_size=512, tp_size=8)
    keys = big.plan_group_keys([2, 8] * 40)
    assert keys == [("sub", 2), ("reshard", 2, 8), ("replica_dp", 2)]
    assert sum(len(big.plan_group_partition(k)) for k in keys) == 256 + 128 + 2


def test_an_unavailable_degree_names_the_allowed_ones():
    from oases_ds.parallel.context import ParallelContext

    ctx = ParallelContext.for_rank(Topology(8, 4), 0, new_group=_CountingNewGroup())
    with pytest.raises(ValueError, match=r"^TMP degree 3 not available; tensor_parallel_size=4 allows \[1, 2, 4\]$"):
        ctx.sub_group(3)
    with pytest.raises(ValueError, match=r"^no reshard group for degrees 4 -> 2; both must be in \[1, 2, 4\], small < large$"):
        ctx.reshard_group(4, 2)


def test_replica_dp_groups_join_each_shards_replicas_across_dp():
    topo = Topology(world_size=8, tp_size=4)  # DP 2 x TMP 4
    assert topo.replica_dp_group_ranks(2, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.replica_dp_group_ranks(1, 4) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert Topology(4, 2).replica_dp_group_ranks(1, 2) == [[0, 1, 2, 3]]
    for small in (1, 2):  # each is a union of reshard groups, one per DP index
        for group in topo.replica_dp_group_ranks(small, 4):
            parts = [r for r in topo.reshard_group_ranks(small, 4) if set(r) <= set(group)]
            assert sorted(x for r in parts for x in r) == group and len(parts) == topo.dp_size
