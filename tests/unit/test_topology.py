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


def test_eager_plan_groups_at_512_ranks_were_about_1500_per_rank():
    # tp 64 + dp 8 + sub-TMP 256 + 128 + reshard 256+128+64 + 256+128 + 256
    assert Topology(world_size=512, tp_size=8).eager_group_count() == 1544


def test_lazy_groups_at_512_ranks_create_only_what_a_rank_uses_each_with_a_timeout():
    from oases_ds.parallel.context import ParallelContext

    topo = Topology(world_size=512, tp_size=8)
    totals = []
    for rank in (0, 13, 511):
        fake = _CountingNewGroup()
        ctx = ParallelContext.for_rank(topo, rank, timeout_s=42.0, new_group=fake)
        assert [c["ranks"] for c in fake.calls] == [list(range(rank // 8 * 8, rank // 8 * 8 + 8)),
                                                     list(range(rank % 8, 512, 8))]
        assert ctx.plan_groups_created == 0  # a homogeneous plan needs nothing more
        assert ctx.layout(8).group == ctx.tp_group and ctx.layout(1).group is None
        # every group a rank could ever need: sub-TMP 2, 4 and all 6 reshard pairs
        for degree in (2, 4, 2, 4):
            assert rank in ctx.sub_group(degree)
        for small, large in [(1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (2, 4)]:
            assert rank in ctx.reshard_group(small, large)
        assert ctx.plan_groups_created == 8  # repeats come from the cache
        assert all(c["timeout"].total_seconds() == 42.0 and c["use_local_synchronization"] for c in fake.calls)
        assert all(rank in c["ranks"] for c in fake.calls)  # never a group this rank is not in
        totals.append(len(fake.calls))
    assert totals == [10, 10, 10]  # vs 1544 eagerly


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
