"""Hangs that explain themselves: real gloo ranks, one injected fault each (``tests/fault_workers.py``).

With guard mode every fault fails in under 10 s, counted from the start of the faulty step,
while the process-group timeout is 60 s -- so a pass cannot be the timeout -- with one line
naming the first differing collective.  Without it, a fault that hangs waits out a 5 s
process-group timeout, every rank's records reach the run directory (a JSON dump from a
failed wait, the ring file from a rank gloo aborted), and the launcher's line names the
divergence; a fault that does not hang (another batch, sends out of order) trains on
silently, which is why guard mode exists.
"""
from __future__ import annotations

import os
import time

import pytest

from oases_ds.launcher import LaunchError, launch
from oases_ds.parallel.flight import DUMP_PREFIX
from fault_workers import pipeline_fault_worker, tmp_fault_worker

pytestmark = pytest.mark.distributed

GUARD_TIMEOUT_S = 60.0  # far above the 10 s a guarded fault may take
PLAIN_TIMEOUT_S = 5.0


def _fails(worker, fault: str, check: bool, tmp_path) -> tuple[LaunchError, float]:
    stamp = tmp_path / "fault-step-start"
    timeout = GUARD_TIMEOUT_S if check else PLAIN_TIMEOUT_S
    with pytest.raises(LaunchError) as info:
        launch(worker, 2, (fault, check, timeout, str(stamp)), timeout_s=120, run_dir=str(tmp_path / "run"))
    return info.value, time.time() - float(stamp.read_text())


TMP_GROUP = "group [0, 1] pg1"
FIRST_REDUCE = "all_reduce.sum L0.attn_reduce fwd sb0 [2, 8, 32] float32"


@pytest.mark.parametrize("fault, expected", [
    ("skip", f"collectives diverged in {TMP_GROUP} at step 2, index 30: rank 0 issued {FIRST_REDUCE}, rank 1 issued "
             "all_reduce.sum L0.attn_reduce fwd sb1 [2, 8, 32] float32"),
    ("skip_last", f"collectives diverged in {TMP_GROUP} at step 2, index 53: rank 0 issued all_reduce.sum L0.attn_copy "
                  "bwd sb1 [2, 8, 32] float32 and waits for it; rank 1 never issued index 53 of that group: it waits on "
                  "all_gather guard.step 2"),
    ("shape", f"collectives diverged in {TMP_GROUP} at step 2, index 30: rank 0 issued {FIRST_REDUCE}, rank 1 issued "
              "all_reduce.sum L0.attn_reduce fwd sb0 [3, 8, 32] float32"),
    ("batch", "the batch differs across the TMP group [0, 1] pg1 at step 2: rank 0 holds labels[4, 8]int64#"),
])
def test_guard_mode_names_a_tmp_fault_in_seconds(tmp_path, fault, expected):
    err, elapsed = _fails(tmp_fault_worker, fault, True, tmp_path)
    assert err.exc_type == "CollectiveMismatchError", err
    assert expected in err.exc_message and "\n" not in err.exc_message
    assert elapsed < 10.0, f"{fault}: {elapsed:.1f}s"


def test_guard_mode_names_a_pipeline_stage_sending_out_of_order(tmp_path):
    err, elapsed = _fails(pipeline_fault_worker, "reorder", True, tmp_path)
    assert err.exc_type == "CollectiveMismatchError", err
    assert err.exc_message == ("transfers diverged on link 0->1 pg5 at step 2, index 4: rank 0 sent p2p act mb0 sb1 "
                               "[2, 8, 32] float32 (its index 4, step 2), rank 1 expected p2p act mb0 sb0 [2, 8, 32] float32")
    assert elapsed < 10.0


def test_guard_mode_changes_no_result_and_waits_for_a_slow_peer(tmp_path):
    """No fault: guard on and off give the same losses (TMP and pipeline), and a rank that
    computes 2.5 s longer (past the 1 s guard interval, twice) is waited for, not blamed."""
    stamp = str(tmp_path / "stamp")
    plain = launch(tmp_fault_worker, 2, ("", False, 60.0, stamp), timeout_s=120)
    guarded = launch(tmp_fault_worker, 2, ("", True, 60.0, stamp, 3, 2.5), timeout_s=120, run_dir=str(tmp_path / "r"))
    assert guarded == plain
    assert launch(pipeline_fault_worker, 2, ("", True, 60.0, stamp), timeout_s=120) == \
        launch(pipeline_fault_worker, 2, ("", False, 60.0, stamp), timeout_s=120)


def test_without_guard_a_hang_times_out_and_the_launcher_names_it_from_the_dumps(tmp_path):
    err, _ = _fails(tmp_fault_worker, "skip_last", False, tmp_path)
    run = tmp_path / "run"
    assert {f"{DUMP_PREFIX}0.json", f"{DUMP_PREFIX}1.json"} <= set(os.listdir(run))  # both ranks' waits failed
    assert "Timed out waiting 5000ms" in err.summary
    assert err.divergence == (f"collectives diverged in {TMP_GROUP} at step 2, index 51: rank 0 issued all_reduce.sum "
                              "L0.attn_copy bwd sb1 [2, 8, 32] float32 and waits for it; rank 1 never issued index 51 of "
                              "that group: it waits on all_reduce.sum step loss [] float32 (group [0, 1] pg0 index 1, step 2)")
    assert err.summary.endswith(err.divergence) and "\n" not in err.summary


@pytest.mark.parametrize("fault, expected", [
    ("shape", f"rank 0 issued {FIRST_REDUCE}, rank 1 issued all_reduce.sum L0.attn_reduce fwd sb0 [3, 8, 32] float32"),
    ("skip", f"rank 0 issued {FIRST_REDUCE}, rank 1 issued all_reduce.sum L0.attn_reduce fwd sb1 [2, 8, 32] float32"),
])
def test_without_guard_a_rank_gloo_aborts_is_still_explained_by_its_ring_file(tmp_path, fault, expected):
    """gloo ``std::terminate``s the rank that receives more bytes than it posted: no report, no
    dump -- but its ring file holds what it issued."""
    err, _ = _fails(tmp_fault_worker, fault, False, tmp_path)
    assert err.divergence == f"collectives diverged in {TMP_GROUP} at step 2, index 28: {expected}"


@pytest.mark.parametrize("worker, fault", [(tmp_fault_worker, "batch"), (pipeline_fault_worker, "reorder")])
def test_without_guard_silent_faults_train_on_with_other_numbers(tmp_path, worker, fault):
    stamp = str(tmp_path / "stamp")
    clean = launch(worker, 2, ("", False, 60.0, stamp), timeout_s=120)
    faulty = launch(worker, 2, (fault, False, 60.0, stamp), timeout_s=120)
    assert faulty[0][0] == clean[0][0] and faulty[0][1] != clean[0][1]  # step 1 alike, step 2 silently other


def test_the_launcher_reports_a_peers_own_error_over_the_failed_wait_it_caused(tmp_path):
    """Rank 1 raises (guard mode's verdict) and exits; rank 0's pending collective then fails on
    the closed connection, and its report may be read first (the launcher polls in rank order): it
    waits for the peers anyway, and the cause -- rank 1's own error -- is what it raises.  Was a CI
    red of ``[skip_last]`` above on a busy host: ``rank 0: RuntimeError: ... Connection closed``."""
    from fault_workers import consequence_first_worker

    with pytest.raises(LaunchError) as info:
        launch(consequence_first_worker, 2, timeout_s=60, run_dir=str(tmp_path / "run"))
    assert (info.value.rank, info.value.exc_type) == (1, "CollectiveMismatchError"), info.value
