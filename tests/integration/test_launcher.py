"""The launcher's fault cases: ranks die with it, a rank's error is one line, Ctrl-C is quiet.

The signal tests run the launcher in a subprocess of its own session, so a
signal meant for it never reaches pytest, and whatever a failing test leaves
running is killed with the session.  Rank processes write their pid to a file,
so the tests know them without guessing.  The worker functions live here:
rank processes import this module by name (``tests/`` is on their path).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil  # a DeepSpeed dependency, so present wherever Oases is installed
import pytest

from oases_ds.cli.common import fail_launch
from oases_ds.launcher import LaunchError, launch
from oases_ds.parallel.flight import RUN_DIR_ENV, RUN_ID_ENV, FlightRecorder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.abspath(__file__))
BOUND_S = 120.0  # generous: the machine is shared; only an unbounded wait is a failure

LAUNCHER_SCRIPT = """
import sys
import test_launcher
from oases_ds.launcher import LaunchInterrupted, launch
try:
    launch(test_launcher.write_pid_then_wait, 2, (sys.argv[1],), timeout_s=600)
except LaunchInterrupted as err:
    sys.exit(err.exit_code)
"""


# ---- functions run inside rank processes ------------------------------------------------

def write_pid_then_wait(pid_dir: str, wait_s: float = 600.0) -> None:
    rank = os.environ["RANK"]
    tmp = os.path.join(pid_dir, f"rank{rank}.pid.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(pid_dir, f"rank{rank}.pid"))
    time.sleep(wait_s)


def raise_on_rank(bad_rank: int, message: str) -> int:
    if int(os.environ["RANK"]) == bad_rank:
        raise ValueError(message)
    return int(os.environ["RANK"])


def report_then_abort(value: int) -> int:
    atexit.register(os.abort)  # runs after the report is sent, as gloo's exit-time SIGABRT does
    return value


def report_then_print_at_teardown(value: int) -> int:
    # what gloo's C++ threads do at interpreter teardown after a successful run
    atexit.register(lambda: (print("terminate called without an active exception", file=sys.stderr, flush=True),
                             os.abort()))
    return value


def quiet(value: int) -> int:
    return value


def print_both(value: int) -> int:
    rank = int(os.environ["RANK"])
    print(f"rank {rank} says {value} on stdout", flush=True)
    print(f"rank {rank} says {value} on stderr", file=sys.stderr, flush=True)
    return value


def exit_without_report(code: int) -> None:
    os._exit(code)


def fail_then_peer_dumps(marker_dir: str, message: str, peer_delay_s: float, dump: bool) -> None:
    """Rank 0 fails with ``message`` at once, after writing its flight dump when ``dump`` (as
    a rank whose collective wait failed does); rank 1, ``peer_delay_s`` after rank 0's failure,
    writes its dump (with ``dump``) and a marker file and fails too: a hang timing out on both ranks."""
    failing = os.path.join(marker_dir, "rank0-failing")
    if os.environ["RANK"] == "0":
        if dump:
            recorder = FlightRecorder(0, 0, os.environ[RUN_DIR_ENV], run_id=os.environ[RUN_ID_ENV])
            recorder.failed(None, RuntimeError(message))
        open(failing, "w").close()
        raise RuntimeError(message)
    while not os.path.exists(failing):
        time.sleep(0.01)
    time.sleep(peer_delay_s)
    if dump:  # its wait failed too: its flight dump, as rank 0's (the launcher then keeps rank 0's report)
        FlightRecorder(0, 1, os.environ[RUN_DIR_ENV], run_id=os.environ[RUN_ID_ENV]).failed(None, RuntimeError(message))
    open(os.path.join(marker_dir, "rank1-dump"), "w").close()
    raise RuntimeError(message)


# ---- helpers ---------------------------------------------------------------------------

def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition: Callable[[], bool], what: str, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.1)


def rank_pids(pid_dir: Path, nprocs: int = 2) -> list[int]:
    wait_until(lambda: len(list(pid_dir.glob("rank*.pid"))) == nprocs, "every rank wrote its pid")
    return [int((pid_dir / f"rank{r}.pid").read_text()) for r in range(nprocs)]


@pytest.fixture
def session_env() -> Iterator[dict[str, str]]:
    """The environment of a launcher run as a subprocess.  Its TMPDIR is a fresh directory:
    whatever the launcher leaves there is a leak.  In the system's temporary directory, not under
    ``tmp_path``: the fork server binds a Unix socket in it, whose path may not pass 107 bytes,
    and ``tmp_path`` under a pytest-xdist worker with a long test name is longer than that."""
    tmpdir = tempfile.mkdtemp(prefix="oases-launch-")
    yield dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([ROOT, TESTS]), TMPDIR=tmpdir)
    shutil.rmtree(tmpdir, ignore_errors=True)


def kill_session(proc: subprocess.Popen) -> None:
    """Test cleanup: whatever the test left in the launcher's session (ranks included) is killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=BOUND_S)


# ---- ranks die with their launcher ----------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_ranks_and_temp_files_die_with_the_launcher(tmp_path, session_env, signum):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = session_env
    # Output to a file, not a pipe: a surviving rank would hold a pipe open and hang the test's read.
    with open(tmp_path / "stderr.txt", "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER_SCRIPT, str(pid_dir)], cwd=ROOT, env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        ranks = rank_pids(pid_dir)
        assert all(alive(pid) for pid in ranks)
        os.kill(proc.pid, signum)
        proc.wait(timeout=BOUND_S)
        stderr = (tmp_path / "stderr.txt").read_text()
        wait_until(lambda: not any(alive(pid) for pid in ranks), f"ranks {ranks} ended after the launcher's {signum.name}")
        # the fork server removes its socket's directory as it exits, a moment after the launcher: wait for it.
        # (torch's compile cache, torchinductor_<user>, is torch's own: `import torch._dynamo` makes it in
        # TMPDIR unless TORCHINDUCTOR_CACHE_DIR is set, which a process that used inductor has.)
        wait_until(lambda: [name for name in os.listdir(env["TMPDIR"]) if not name.startswith("torchinductor_")] == [],
                   f"the launcher's TMPDIR {env['TMPDIR']} emptied after its {signum.name}")
        if signum == signal.SIGTERM:  # it ended its ranks itself and said so with the shell's exit code
            assert proc.returncode == 128 + signal.SIGTERM, stderr
            assert "Traceback" not in stderr, stderr
    finally:
        kill_session(proc)


# ---- a rank's exception, as the library reports it ------------------------------------------------

@pytest.mark.distributed
def test_rank_exception_carries_rank_type_message_and_traceback():
    with pytest.raises(LaunchError) as caught:
        launch(raise_on_rank, 2, (1, "bad shape:\n  expected 4"), timeout_s=300)
    err = caught.value
    assert (err.rank, err.exc_type, err.exc_message) == (1, "ValueError", "bad shape:\n  expected 4")
    assert err.summary == "rank 1: ValueError: bad shape: expected 4"
    assert "raise ValueError(message)" in err.traceback and err.traceback.startswith("Traceback")
    assert str(err).splitlines()[0] == err.summary  # callers that print str(err) still get the traceback
    assert str(err).splitlines()[-1] == "  expected 4"


@pytest.mark.distributed
def test_ranks_print_to_the_launchers_stdout_and_stderr_as_they_are_at_launch(capfd):
    """A forked rank would inherit the fork server's fds, the launcher's as they were when the
    fork server started (in this suite: an earlier test's capture file).  Each launch hands
    the ranks the launcher's current ones.  The first launch runs with capture off, so the
    fork server (where it starts here) holds other fds than the captured launches below."""
    with capfd.disabled():
        assert launch(quiet, 2, (1,), timeout_s=300) == [1, 1]
    for value in (3, 4):
        assert launch(print_both, 2, (value,), timeout_s=300) == [value, value]
        out, err = capfd.readouterr()
        for rank in (0, 1):
            assert f"rank {rank} says {value} on stdout" in out and f"rank {rank} says {value} on stderr" in err


SPAWN_PRINT_SCRIPT = """
import test_launcher
from oases_ds.launcher import launch

if __name__ == "__main__":
    print(launch(test_launcher.print_both, 2, (5,), timeout_s=120))
"""


@pytest.mark.distributed
def test_spawned_ranks_print_to_the_launchers_stdout_and_stderr(tmp_path, session_env):
    """A spawned rank (the default on CUDA builds) is passed the launcher's fds 1 and 2 as 1 and 2.
    It used to close them as it "moved" them into place, so its first ``print`` failed with
    ``OSError: [Errno 22]`` and every ``oases-train`` on a GPU build failed at its first line."""
    (tmp_path / "launch_spawned.py").write_text(SPAWN_PRINT_SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "launch_spawned.py")], cwd=tmp_path,
                          env=dict(session_env, OASES_START_METHOD="spawn"), capture_output=True, text=True,
                          timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[5, 5]", done.stdout
    for rank in (0, 1):
        assert f"rank {rank} says 5 on stdout" in done.stdout and f"rank {rank} says 5 on stderr" in done.stderr


@pytest.mark.distributed
def test_a_temp_folder_too_long_for_the_fork_servers_socket_is_refused_in_one_line(tmp_path, session_env):
    """The fork server's socket lives under TMPDIR and Linux takes 107 bytes of its path.  A longer
    TMPDIR (a CI workspace, a scheduler's per-job folder) gave a bare ``OSError: AF_UNIX path too
    long`` from inside multiprocessing; now one line names TMPDIR and both ways out, before any rank."""
    long_dir = Path(session_env["TMPDIR"]) / ("t" * 80)
    long_dir.mkdir()
    (tmp_path / "launch_spawned.py").write_text(SPAWN_PRINT_SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "launch_spawned.py")], cwd=tmp_path,
                          env=dict(session_env, OASES_START_METHOD="forkserver", TMPDIR=str(long_dir)),
                          capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"oases_ds.launcher.LaunchError: TMPDIR={long_dir} is too long for the fork server's socket")
    assert "set TMPDIR to a shorter folder (e.g. /tmp) or OASES_START_METHOD=spawn" in last
    assert "AF_UNIX" not in done.stderr and "rank 0 says" not in done.stdout


FORK_SERVER_ENV = dict(os.environ, OASES_START_METHOD="forkserver")
PRELOAD_SCRIPT = """
import sys
from oases_ds.launcher import launch, preload

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # after start-up: only the launcher's sys.path holds this folder
    preload("preloaded_helper")
    import preloaded_helper
    print(launch(preloaded_helper.where_imported, 2, (), timeout_s=120))
"""
PRELOADED_HELPER = """
import os
import sys

IMPORTED_BY = os.getpid()


def where_imported():
    return IMPORTED_BY != os.getpid(), "torch._dynamo" in sys.modules
"""


@pytest.mark.distributed
def test_the_fork_server_imports_preloaded_modules_from_the_launchers_path(tmp_path):
    """A module :func:`preload` names, found through a folder the launcher added to ``sys.path``,
    and ``torch._dynamo`` (the first optimizer imports it) are imported once by the fork server,
    not by each rank.  Python 3.11's fork server did not apply the launcher's ``sys.path``, so
    such a module failed to import there, silently, and every rank imported it itself (this
    suite's workers: 0.8 s of CPU per rank for ``torch._dynamo`` alone).  A fresh interpreter,
    so the fork server is its own, chosen on every build (CUDA builds spawn ranks by default)."""
    helper = tmp_path / "helpers"
    helper.mkdir()
    (helper / "preloaded_helper.py").write_text(PRELOADED_HELPER)
    (tmp_path / "launch_preloaded.py").write_text(PRELOAD_SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "launch_preloaded.py"), str(helper)], cwd=tmp_path,
                          env=FORK_SERVER_ENV, capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[(True, True), (True, True)]", done.stdout


EARLY_SERVER_SCRIPT = """
import sys
from oases_ds import launcher

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    launcher.preload("marks_its_import")  # imported last by the fork server
    launcher.start_fork_server_early()
    print("error: refused before any launch", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.distributed
def test_a_refusal_before_any_launch_ends_the_fork_server_started_early(tmp_path):
    """``oases-train`` starts its fork server before it checks its input.  When the check refuses
    it, the process exits at once, and the fork server, which holds its stdout and stderr, is
    ended with it rather than left importing for seconds (a pipe reading the CLI's output waited
    for those seconds).  The marker module, the fork server's last import, is never imported.
    The fork server is chosen on every build (CUDA builds spawn ranks by default)."""
    helper = tmp_path / "helpers"
    helper.mkdir()
    marker = tmp_path / "fork-server-finished-importing"
    (helper / "marks_its_import.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "refuse.py").write_text(EARLY_SERVER_SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "refuse.py"), str(helper)], cwd=tmp_path,
                          env=FORK_SERVER_ENV, capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 2 and done.stderr.strip() == "error: refused before any launch", done.stderr
    assert not marker.exists()


def frozen_and_tracked() -> tuple[int, int]:
    return gc.get_freeze_count(), len(gc.get_objects())


@pytest.mark.distributed
def test_what_a_rank_starts_with_is_out_of_the_collectors_reach():
    """The objects a rank is given (torch, DeepSpeed, the preloaded modules) are frozen at its
    start, so a full collection scans only what the rank made: before, each one scanned some
    300 thousand objects (0.2 s an oases-train rank)."""
    for frozen, tracked in launch(frozen_and_tracked, 2, (), timeout_s=120):
        assert frozen > 10 * tracked, (frozen, tracked)


def test_a_rank_that_reported_then_aborted_still_succeeded():
    assert launch(report_then_abort, 2, (7,), timeout_s=300) == [7, 7]


@pytest.mark.distributed
def test_a_rank_that_reported_ends_without_the_interpreters_teardown():
    # "terminate called without an active exception" after a run that succeeded reads as a
    # crash: a reported rank leaves with os._exit, so nothing of the teardown runs or prints
    code = ("import sys; sys.path.insert(0, 'tests/integration'); sys.path.insert(0, 'tests');"
            "import test_launcher as t; from oases_ds.launcher import launch;"
            "print(launch(t.report_then_print_at_teardown, 2, (5,), timeout_s=120))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0 and done.stdout.strip() == "[5, 5]", done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]


@pytest.mark.distributed
def test_a_rank_that_died_without_reporting_fails_the_launch():
    with pytest.raises(LaunchError, match=r"^rank 0 exited with code 3 without reporting a result$") as caught:
        launch(exit_without_report, 1, (3,), timeout_s=300)
    assert caught.value.rank == 0 and caught.value.traceback is None


@pytest.mark.distributed
@pytest.mark.parametrize("message, dumped, peer_dumps", [
    ("Timed out waiting 5000ms for recv operation to complete", True, True),  # its wait failed: the peer gets time
    ("bad shape", False, False),  # a rank's own error: its peers are ended at once
    ("Timed out waiting 5000ms for recv operation to complete", False, False),  # words alone, no dump: ended at once
])
def test_after_a_failed_wait_the_peers_get_time_to_dump(tmp_path, message, dumped, peer_dumps):
    """A hang times out on every rank, each within about the time between their waits, and
    each writes its flight-record dump before reporting: ending the peers as soon as the
    first rank reports loses their dumps (a CI run lost rank 1's that way).  The launcher
    knows a wait failed from the dump the rank left in the run directory, not from the
    error's words."""
    with pytest.raises(LaunchError) as caught:
        launch(fail_then_peer_dumps, 2, (str(tmp_path), message, 1.5, dumped), timeout_s=120,
               run_dir=str(tmp_path / "run"))
    assert caught.value.rank == 0 and caught.value.exc_message == message
    assert (tmp_path / "rank1-dump").exists() == peer_dumps
    assert spawned_children() == []


def spawned_children(parent: int | None = None) -> list[psutil.Process]:
    """The live rank processes of the launcher in process ``parent`` (default: this one): its
    spawned children, or the children of its fork server (``oases_ds.launcher.start_method``);
    multiprocessing's resource tracker and the fork server itself are not ranks."""
    ranks = []
    for child in psutil.Process(parent).children():
        command = " ".join(child.cmdline())
        if "spawn_main" in command:
            ranks.append(child)
        elif "forkserver" in command:
            ranks.extend(child.children())
    return [c for c in ranks if alive(c.pid)]


@pytest.mark.distributed
def test_timeout_bounds_the_launch_and_ends_the_ranks(tmp_path):
    with pytest.raises(LaunchError, match=r"^timed out after 10s waiting for ranks \[0, 1\]$") as caught:
        launch(write_pid_then_wait, 2, (str(tmp_path),), timeout_s=10)
    assert caught.value.rank is None
    assert spawned_children() == []


# ---- what the CLI prints ----------------------------------------------------------------

class _FakeFailure(LaunchError):
    def __init__(self) -> None:
        super().__init__("rank 1: ValueError: bad shape", rank=1, exc_type="ValueError", exc_message="bad shape",
                         traceback='Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad shape\n')


@pytest.mark.parametrize("verbose", [False, True])
def test_fail_launch_prints_one_line_and_keeps_the_traceback(tmp_path, capsys, monkeypatch, verbose):
    monkeypatch.setenv("OASES_VERBOSE", "1" if verbose else "0")
    with pytest.raises(SystemExit) as exited:
        fail_launch(_FakeFailure(), str(tmp_path / "run"))
    assert exited.value.code == 1
    log = tmp_path / "run" / "rank1-traceback.log"
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"error: rank 1: ValueError: bad shape  (full traceback in {log})"
    assert log.read_text().startswith("Traceback")
    assert ("Traceback" in err) == verbose


def run_train(tmp_path: Path, env: dict[str, str], *overrides: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "oases_ds.cli.train", "model=gpt_tiny", f"hydra.run.dir={tmp_path / 'run'}",
                             *overrides], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


@pytest.mark.distributed
def test_train_rank_exception_is_one_line_with_the_traceback_in_a_file(tmp_path, session_env):
    (tmp_path / "afile").write_text("")  # stats_out under a regular file: rank 0 fails after training
    proc = run_train(tmp_path, session_env, "steps=1", f"stats_out={tmp_path / 'afile' / 'stats.json'}")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"error: rank 0: FileExistsError: .*  \(full traceback in (\S+rank0-traceback\.log)\)", last)
    assert found, last
    assert "Traceback" not in stderr
    assert "write_json_atomic" in Path(found.group(1)).read_text()


@pytest.mark.distributed
def test_ctrl_c_ends_train_and_its_ranks_quietly(tmp_path, session_env):
    proc = run_train(tmp_path, session_env, "steps=100000", "log_every=100000", start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read_stdout() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # the end of its output: a run that ended early fails here, not at the deadline

    threading.Thread(target=read_stdout, daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while True:  # rank 0's header: both ranks joined the process group and are training
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            assert line is not None, f"oases-train ended before training: {proc.stderr.read()[-3000:]}"
            if line.startswith("oases-train:"):
                break
        ranks = [c.pid for c in spawned_children(proc.pid)]
        assert len(ranks) == 2
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        stderr = proc.stderr.read()
        proc.wait(timeout=BOUND_S)
        wait_until(lambda: not any(alive(pid) for pid in ranks), f"ranks {ranks} ended after Ctrl-C")
        assert proc.returncode == 130, stderr[-3000:]
        assert stderr.strip().splitlines()[-1] == "interrupted"
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    finally:
        kill_session(proc)
