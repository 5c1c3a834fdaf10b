"""Metric sinks of oases-train: the CSV rows, resume, and the optional TensorBoard check."""
import csv
import sys

import pytest

from oases_ds.utils.metrics import COLUMNS, MetricsLog, check_csv, check_tensorboard


def rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_has_a_header_and_one_row_per_step_with_eval_only_where_evaluated(tmp_path):
    path = tmp_path / "runs" / "metrics.csv"
    log = MetricsLog(str(path), None, start_step=0)
    for step in (1, 2, 3):
        log.log(step, 5.0 - step, 4.5 if step == 2 else None, 1e-3 * step, 100.0 * step)
        assert len(rows(path)) == step + 1  # each row is on disk when log() returns (flushed)
    log.close()
    assert rows(path) == [list(COLUMNS), ["1", "4.0", "", "0.001", "100.0"], ["2", "3.0", "4.5", "0.002", "200.0"],
                          ["3", "2.0", "", "0.003", "300.0"]]
    check_csv(str(path))  # its own file is accepted for a resume


def test_resume_keeps_rows_up_to_its_step_and_a_fresh_run_starts_over(tmp_path):
    path = tmp_path / "metrics.csv"
    log = MetricsLog(str(path), None, 0)
    for step in (1, 2, 3, 4):
        log.log(step, float(step), None, 0.1, 1.0)
    log.close()
    resumed = MetricsLog(str(path), None, start_step=2)  # the crashed run's steps 3, 4 are dropped
    resumed.log(3, 30.0, 3.5, 0.1, 1.0)
    resumed.close()
    assert [r[:3] for r in rows(path)[1:]] == [["1", "1.0", ""], ["2", "2.0", ""], ["3", "30.0", "3.5"]]
    MetricsLog(str(path), None, start_step=0).close()
    assert rows(path) == [list(COLUMNS)]


def test_a_foreign_csv_or_a_directory_is_refused(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="metrics.csv=.*other.csv exists and is not an oases-train metrics file"):
        check_csv(str(other))
    with pytest.raises(ValueError, match="is a directory; give a file path"):
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "x").write_text("")
        check_csv(str(tmp_path / "d"))
    check_csv(str(tmp_path / "new.csv"))  # not there yet: fine
    check_csv(None)


def test_tensorboard_without_the_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an absent package looks like to import
    with pytest.raises(ValueError, match=r"^metrics.tensorboard=runs/tb needs the tensorboard package, which is not "
                                         r"installed; pip install 'oases-ds\[tensorboard\]'") as err:
        check_tensorboard("runs/tb")
    assert "\n" not in str(err.value)
    check_tensorboard(None)
