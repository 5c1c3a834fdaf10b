"""The guard-overhead summary computes its medians and ratios from the rounds it is given."""
import pytest

from oases_ds.bench.guard import VARIANTS, summarize, table


def test_ratios_are_medians_over_rounds_of_each_rounds_median_against_off():
    walls = {"off": [[1.0, 1.2], [2.0, 2.0], [1.0, 1.0]], "records": [[1.1, 1.1], [2.0, 2.2], [1.0, 1.0]],
             "guard": [[1.2, 1.4], [3.0, 3.0], [1.5, 1.5]]}
    per_rank = [{"rounds": {v: [[(w, w / 2 + rank) for w in steps] for steps in walls[v]] for v in VARIANTS},
                 "collectives_per_step": {"off": 26.0, "records": 26.0, "guard": 28.0}} for rank in (0, 1)]
    s = summarize(per_rank)
    guard = s["variants"]["guard"]
    assert guard["wall_ratio_to_off"] == pytest.approx(1.5)  # rounds: 1.3/1.1, 3/2, 1.5/1 -> median 1.5
    assert guard["median_wall_s"] == pytest.approx(1.5)  # of all six steps
    assert guard["median_cpu_s"] == pytest.approx(1.5 / 2 + 0.5)  # CPU: mean over the ranks
    assert s["variants"]["off"]["wall_ratio_to_off"] == 1.0 and s["rounds"] == 3 and s["steps_per_round"] == 2
    assert "| guard | 1.500 | 1.500 |" in table({"summary": s})
