"""The one atomic writer (``oases_ds.utils.io``): old file or new file, never a torn one.

Why these cases: a crash cannot be staged in a unit test, but its two halves can --
a failure *before* the rename must leave the target and its directory exactly as
they were, and the data and the rename must each be fsynced (file, then directory)
before the writer returns.  ``os.fsync`` / ``os.replace`` are wrapped to record the
order of those calls.
"""
from __future__ import annotations

import json
import os
import stat

import pytest

from oases_ds.utils import io as atomic_io
from oases_ds.utils.io import (read_json_input, replace_marked_section, write_bytes_atomic, write_json_atomic,
                               write_text_atomic)


def test_json_round_trips_with_the_callers_layout(tmp_path) -> None:
    path = tmp_path / "deep" / "er" / "plan.json"  # missing parents are created
    write_json_atomic(path, {"b": 1, "a": [1, 2]}, indent=2, sort_keys=True)
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    write_json_atomic(path, {"b": 1, "a": 2})  # default: order kept, indent 1
    assert path.read_text() == '{\n "b": 1,\n "a": 2\n}\n'
    assert os.listdir(path.parent) == ["plan.json"]  # no temporary file left


def test_an_unserialisable_payload_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = tmp_path / "stats.json"
    write_json_atomic(path, {"step": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomic(path, {"step": object()})
    assert json.loads(path.read_text()) == {"step": 1}
    assert os.listdir(tmp_path) == ["stats.json"]


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch) -> None:
    path = tmp_path / "latest"
    write_text_atomic(path, "global_step1")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_io.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, "global_step2")
    assert path.read_text() == "global_step1"
    assert os.listdir(tmp_path) == ["latest"]


def test_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(atomic_io.os, "fsync", fsync)
    monkeypatch.setattr(atomic_io.os, "replace", replace)
    write_bytes_atomic(tmp_path / "rank0.pkl", b"\x80\x04report")
    assert (tmp_path / "rank0.pkl").read_bytes() == b"\x80\x04report"
    expected = ["fsync file", "replace", "fsync dir"] if os.name == "posix" else ["fsync file", "replace"]
    assert calls == expected


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX file modes")
def test_the_file_gets_the_mode_open_would_give_not_mkstemps_0600(tmp_path) -> None:
    """mkstemp makes owner-only files; a plan or report read by another user or node must not be."""
    umask = os.umask(0)
    os.umask(umask)
    path = tmp_path / "plan.json"
    write_json_atomic(path, {"attn": [2]})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_a_directory_that_refuses_fsync_is_not_an_error(tmp_path, monkeypatch) -> None:
    """Some filesystems answer EINVAL to fsync on a directory; the write still counts."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(atomic_io.os, "fsync", fsync)
    write_text_atomic(tmp_path / "report.md", "# ok\n")
    assert (tmp_path / "report.md").read_text() == "# ok\n"


def test_replace_marked_section_rewrites_only_between_the_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("intro\n<!-- t:begin -->\nold 1\nold 2\n<!-- t:end -->\noutro\n")
    replace_marked_section(path, "<!-- t:begin -->", "<!-- t:end -->", "new")
    assert path.read_text() == "intro\n<!-- t:begin -->\nnew\n<!-- t:end -->\noutro\n"
    replace_marked_section(path, "<!-- u:begin -->", "<!-- u:end -->", "added")  # absent: appended
    assert path.read_text().endswith("outro\n\n<!-- u:begin -->\nadded\n<!-- u:end -->\n")
    before = path.read_text()
    with pytest.raises(ValueError, match=r"markers '<!-- v:begin -->' / '<!-- v:end -->' missing"):
        replace_marked_section(path, "<!-- v:begin -->", "<!-- v:end -->", "x", append=False)
    assert path.read_text() == before  # a refused rewrite leaves the file as it was


def test_a_failed_write_names_the_target_not_the_hidden_temporary(tmp_path) -> None:
    """The user gave the target's path; ``.<name>.<random>.tmp`` is ours and means nothing to them.
    A directory where the file should go fails at the rename, ``/proc`` (no new files) at mkstemp."""
    taken = tmp_path / "plan.json"
    taken.mkdir()
    with pytest.raises(IsADirectoryError) as exc:
        write_json_atomic(taken, {"attn": [2]})
    assert str(exc.value) == f"[Errno 21] Is a directory: '{taken}'"
    assert os.listdir(tmp_path) == ["plan.json"] and os.listdir(taken) == []  # no temporary left
    with pytest.raises(FileNotFoundError) as exc:
        write_text_atomic("/proc/plan.json", "{}")
    assert str(exc.value) == "[Errno 2] No such file or directory: '/proc/plan.json'"
    assert exc.value.filename == "/proc/plan.json" and exc.value.filename2 is None


def test_read_json_input_fails_in_one_line_naming_the_setting(tmp_path) -> None:
    """A plan or cost-table file a user named: unreadable is ``key=path: reason; hint``, malformed
    is ``key=`` and the loader's line (which starts with the path); what loads is returned."""
    from oases_ds.planner.plan import Plan

    path = tmp_path / "plan.json"
    Plan((2, 1), (2, 2), devices=2).to_json(path)
    assert read_json_input("plan", str(path), Plan.from_json, "give the JSON file oases-plan wrote") == Plan.from_json(path)
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ValueError) as err:
        read_json_input("oases.plan", missing, Plan.from_json, "give the JSON file oases-plan wrote")
    assert str(err.value) == f"oases.plan={missing}: No such file or directory; give the JSON file oases-plan wrote"
    path.write_text('{"attn_degrees": [2,')
    with pytest.raises(ValueError, match=rf"^plan={path}: not valid JSON \(") as err:
        Plan.read("plan", str(path))
    assert "\n" not in str(err.value)
