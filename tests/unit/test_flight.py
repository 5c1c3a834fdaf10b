"""The flight recorder and the divergence finder, as data (no process group).

The distributed tests (``tests/distributed/test_collective_guard.py``) inject real faults into
gloo ranks; here the pieces they rest on are checked one by one: records and their text
form, the ring file a killed rank leaves, the dump a failed wait writes, the line that
names a divergence, the proof of a deadlock (and that a slow rank is none), the switches.
"""
from __future__ import annotations

import json
import os

import pytest

from oases_ds.config import OasesConfigError, parse_oases_section
from oases_ds.launcher import LaunchError, _failed_in_communication, _wait_failed, flight_env
from oases_ds.parallel.flight import (DUMP_PREFIX, RUN_DIR_ENV, RUN_ID_ENV, FlightRecorder, Record, RingFile, conflict,
                                      explain, group_key, link_key, members, nccl_env, read_run_dir, unmet_wait)
from oases_ds.parallel.guard import CHECK_ENV, batch_signature, check_collectives_from_env, decode, encode

TMP = group_key([0, 1], "1")
WORLD = group_key([0, 1], "0")


def test_records_round_trip_through_their_line_and_json():
    record = Record(TMP, 17, "all_reduce.sum", "L0.attn_reduce fwd sb0", (2, 8, 32), "float32", 3)
    assert Record.from_line(record.line()) == record == Record.from_json(json.loads(json.dumps(record.to_json())))
    assert Record.from_signature(TMP, record.signature()) == record
    assert record.describe() == "all_reduce.sum L0.attn_reduce fwd sb0 [2, 8, 32] float32"
    scalar = Record(WORLD, 0, "all_reduce.sum", "step loss", (), "float32", 1)
    assert Record.from_line(scalar.line()) == scalar


def test_group_keys_name_ranks_and_process_group_and_links_their_direction():
    assert TMP == "[0, 1] pg1" and members(TMP) == [0, 1]
    assert TMP != WORLD  # same ranks, another process group: matched apart by gloo, so apart here
    assert link_key(0, 2, "5") == "0->2 pg5" and members("0->2 pg5") == [0, 2]


def test_the_recorder_counts_per_group_and_keeps_a_bounded_deque():
    rec = FlightRecorder(size=3)
    for i in range(5):
        rec.record(TMP, "all_reduce.sum", f"op{i}", (4,), "float32")
    rec.record(WORLD, "all_gather", "guard.step 1", (9,), "uint8")
    assert rec.counts == {TMP: 5, WORLD: 1}
    assert [(r.group, r.index) for r in rec.records] == [(TMP, 3), (TMP, 4), (WORLD, 0)]
    assert rec.hashes == {}  # rolling hashes only in guard mode (digest)


def test_the_ring_file_holds_the_last_records_and_the_wait_of_a_rank_that_died(tmp_path):
    rec = FlightRecorder(size=4, rank=1, run_dir=str(tmp_path))
    records = [rec.record(TMP, "all_reduce.sum", f"op{i}", (2, 3), "float32") for i in range(6)]
    rec.begin_wait(records[-1])
    # the process is not asked: the file alone, as the launcher reads it after a SIGKILL
    snap = RingFile.read(str(tmp_path / f"{DUMP_PREFIX}1.ring"))
    assert snap["rank"] == 1 and snap["counts"] == {TMP: 6}
    assert [r["label"] for r in snap["records"]] == ["op2", "op3", "op4", "op5"]
    assert Record.from_json(snap["waiting"]) == records[-1]
    rec.end_wait()
    assert RingFile.read(str(tmp_path / f"{DUMP_PREFIX}1.ring"))["waiting"] is None


def test_a_failed_wait_dumps_the_records_and_the_error_atomically(tmp_path):
    rec = FlightRecorder(size=8, rank=0, run_dir=str(tmp_path), run_id="abc")
    record = rec.record(TMP, "all_gather", "L1.reshard fwd sb0", (4, 8, 32), "float32")

    class Stuck:
        def wait(self):
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")

    with pytest.raises(RuntimeError, match="Timed out"):
        rec.wait(Stuck(), record)
    dump = json.loads((tmp_path / f"{DUMP_PREFIX}0.json").read_text())
    assert dump["run_id"] == "abc" and dump["error"].startswith("RuntimeError: Timed out waiting 5000ms")
    assert Record.from_json(dump["waiting"]) == record
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
    # the JSON dump wins over the ring file; another launch's dump is not read
    assert [s["error"] is not None for s in read_run_dir(str(tmp_path), "abc")] == [True]
    assert read_run_dir(str(tmp_path), "other")[0]["error"] is None  # only the ring file is left


def _snap(rank: int, records: list[Record], waiting: Record | None = None, waiting_s: float = 5.0) -> dict:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.group] = r.index + 1
    return {"rank": rank, "counts": counts, "records": [r.to_json() for r in records],
            "waiting": waiting.to_json() if waiting else None, "waiting_s": waiting_s if waiting else 0.0}


def _ops(group: str, labels: list[str], step: int = 2, shape=(2, 8, 32)) -> list[Record]:
    return [Record(group, i, "all_reduce.sum", label, shape, "float32", step) for i, label in enumerate(labels)]


def test_the_first_conflicting_index_is_named_with_both_entries():
    a = _ops(TMP, ["x", "L0.attn_reduce fwd sb0", "y"])
    b = _ops(TMP, ["x", "L0.attn_reduce fwd sb1", "z"])
    line = conflict([_snap(0, a), _snap(1, b)])
    assert line == ("collectives diverged in group [0, 1] pg1 at step 2, index 1: rank 0 issued all_reduce.sum "
                    "L0.attn_reduce fwd sb0 [2, 8, 32] float32, rank 1 issued all_reduce.sum L0.attn_reduce fwd sb1 "
                    "[2, 8, 32] float32")
    bigger = [a[0], Record(TMP, 1, "all_reduce.sum", "L0.attn_reduce fwd sb0", (3, 8, 32), "float32", 2)]
    assert "rank 1 issued all_reduce.sum L0.attn_reduce fwd sb0 [3, 8, 32] float32" in conflict([_snap(0, a), _snap(1, bigger)])
    assert conflict([_snap(0, a[:2]), _snap(1, a)]) is None  # one is behind: no conflict


def test_a_wait_nobody_can_meet_is_a_deadlock_only_if_everyone_reachable_waits_too():
    tmp = _ops(TMP, ["a", "b", "last"])
    check = Record(WORLD, 0, "all_gather", "guard.step 2", (99,), "uint8", 2)
    stuck0 = _snap(0, tmp, waiting=tmp[-1])               # waits on index 2 of the TMP group
    stuck1 = _snap(1, tmp[:2] + [check], waiting=check)   # left index 2 out, waits at the step check
    line = unmet_wait([stuck0, stuck1], stuck_s=1.0, start=1)
    assert line == ("collectives diverged in group [0, 1] pg1 at step 2, index 2: rank 0 issued all_reduce.sum last "
                    "[2, 8, 32] float32 and waits for it; rank 1 never issued index 2 of that group: it waits on "
                    "all_gather guard.step 2 [99] uint8 (group [0, 1] pg0 index 0, step 2)")
    assert unmet_wait([stuck0, stuck1], stuck_s=1.0, start=0) == line  # the same line on every rank
    # rank 1 computes (published nothing): a slow peer, not a divergence
    assert unmet_wait([stuck0], stuck_s=1.0, start=0) is None
    # rank 1 has issued it too: the link is slow, keep waiting
    assert unmet_wait([stuck0, _snap(1, tmp, waiting=tmp[-1])], stuck_s=1.0, start=0) is None
    # rank 1 just started waiting: not yet proof
    assert unmet_wait([stuck0, _snap(1, tmp[:2] + [check], waiting=check, waiting_s=0.1)], stuck_s=1.0, start=0) is None
    # a post-mortem (every rank ended) names the blocked wait without the proof
    assert explain([stuck0, _snap(1, tmp[:2] + [check], waiting=check, waiting_s=0.0)]) == line


def test_the_chain_of_waits_is_followed_beyond_the_group():
    """Rank 0 waits on rank 1 in the TMP group, rank 1 on a pipeline receive from rank 2: only
    if rank 2 waits too (on rank 0 or 1) is it a deadlock; a rank 2 that computes is a slow stage."""
    tmp = _ops(group_key([0, 1], "1"), ["a"])
    recv = Record(link_key(2, 1, "4"), 0, "p2p", "act mb0 sb0", (2, 8, 32), "float32", 2)
    back = Record(group_key([0, 2], "3"), 0, "all_reduce.sum", "dp grad", (10,), "float32", 2)
    r0 = _snap(0, tmp, waiting=tmp[0])
    r1 = _snap(1, [recv], waiting=recv)
    assert unmet_wait([r0, r1], stuck_s=1.0, start=0) is None
    r2 = _snap(2, [back], waiting=back)
    assert unmet_wait([r0, r1, r2], stuck_s=1.0, start=0) is not None


def test_signatures_are_fixed_size_and_compare_by_a_hash_of_all_of_it():
    long = "x" * 1000
    a, b = encode(long), encode(long + "y")
    assert a.numel() == b.numel() == 256
    assert decode(a)[0] != decode(b)[0] and decode(a)[1] == decode(b)[1]  # same shown text, told apart by the hash
    import torch

    batch = {"tokens": torch.arange(8).view(2, 4), "labels": torch.zeros(2, 4, dtype=torch.long)}
    other = {**batch, "tokens": batch["tokens"].flip(0)}
    assert batch_signature(batch) != batch_signature(other)
    assert batch_signature(batch).startswith("labels[2, 4]int64#") and batch_signature(batch) == batch_signature(dict(batch))


def test_guard_mode_switches_are_strict(monkeypatch):
    assert parse_oases_section({"check_collectives": True}).check_collectives
    assert not parse_oases_section({}).check_collectives
    with pytest.raises(OasesConfigError, match=r"^oases.check_collectives: Input should be a valid boolean \(got 'yes'\)"):
        parse_oases_section({"check_collectives": "yes"})
    with pytest.raises(OasesConfigError, match=r"^oases.flight_records: Input should be greater than or equal to 0"):
        parse_oases_section({"flight_records": -1})
    monkeypatch.delenv(CHECK_ENV, raising=False)
    assert check_collectives_from_env(True) and not check_collectives_from_env(False)
    for value, expected in (("1", True), ("on", True), ("0", False), ("off", False)):
        monkeypatch.setenv(CHECK_ENV, value)
        assert check_collectives_from_env(not expected) is expected
    monkeypatch.setenv(CHECK_ENV, "maybe")
    with pytest.raises(ValueError, match=r"^OASES_CHECK_COLLECTIVES='maybe' is not a switch; set it to 1"):
        check_collectives_from_env()


def test_the_launcher_prepares_the_run_dir_and_turns_on_nccls_flight_recorder(tmp_path, monkeypatch):
    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / f"{DUMP_PREFIX}0.json").write_text("{}")  # a previous launch's
    env: dict[str, str] = {}
    run_id = flight_env(str(tmp_path), env)
    assert not (tmp_path / f"{DUMP_PREFIX}0.json").exists()
    assert env[RUN_DIR_ENV] == str(tmp_path) and env[RUN_ID_ENV] == run_id
    # torch 2.13's names: the older ones print a deprecation warning in every rank, gloo runs too
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # a user's setting, under the old name, is kept
    assert "TORCH_FR_BUFFER_SIZE" not in nccl_env(str(tmp_path))


def test_the_records_explain_a_hang_or_an_abort_not_a_ranks_own_error(tmp_path):
    (tmp_path / f"{DUMP_PREFIX}1.json").write_text("{}")
    assert _failed_in_communication(LaunchError("timed out after 9s waiting for ranks [0, 1]"), str(tmp_path))
    assert _failed_in_communication(LaunchError("rank 0 exited with code -6 without reporting a result", rank=0),
                                    str(tmp_path))
    assert _failed_in_communication(LaunchError("rank 1: RuntimeError: ...", rank=1, exc_type="RuntimeError"),
                                    str(tmp_path))
    assert not _failed_in_communication(LaunchError("rank 0: ValueError: bad", rank=0, exc_type="ValueError"),
                                        str(tmp_path))
    assert not _failed_in_communication(LaunchError("rank 1: ...", rank=1, exc_type="CollectiveMismatchError"),
                                        str(tmp_path))
    err = LaunchError("rank 1: RuntimeError: timed out", rank=1).with_divergence("collectives diverged in group ...")
    assert err.summary == "rank 1: RuntimeError: timed out | collectives diverged in group ..." and err.rank == 1


def test_a_failed_wait_is_known_from_the_ranks_dump_not_from_its_words(tmp_path):
    """What gives the peers their grace period (:func:`oases_ds.launcher._await_peers`): the
    failing rank's own dump in the run directory, whatever its error says."""
    timed_out = LaunchError("rank 1: RuntimeError: Timed out waiting 5000ms", rank=1, exc_type="RuntimeError",
                            exc_message="Timed out waiting 5000ms for recv operation to complete")
    assert not _wait_failed(timed_out, None)  # no run directory: no rank dumps
    assert not _wait_failed(timed_out, str(tmp_path))  # the words alone
    (tmp_path / f"{DUMP_PREFIX}1.json").write_text("{}")
    assert _wait_failed(timed_out, str(tmp_path))
    reset = LaunchError("rank 1: RuntimeError: Connection reset by peer", rank=1, exc_type="RuntimeError",
                        exc_message="Connection reset by peer")
    assert _wait_failed(reset, str(tmp_path))  # any failed wait, not only a timeout
    assert not _wait_failed(LaunchError("rank 0: RuntimeError: Timed out", rank=0, exc_type="RuntimeError"),
                            str(tmp_path))  # another rank's dump says nothing of rank 0
    assert not _wait_failed(LaunchError("rank 1: ...", rank=1, exc_type="CollectiveMismatchError"), str(tmp_path))
    assert _wait_failed(LaunchError("rank 1 exited with code -6 without reporting a result", rank=1),
                        str(tmp_path))  # it dumped, then died before its report: its wait failed all the same
