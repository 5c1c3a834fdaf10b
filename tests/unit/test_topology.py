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
