"""Launch N local rank processes, collect what each *reports*, and never leave one behind.

Why judge a rank by its report and not by its exit code: with gloo a process
sometimes aborts at interpreter exit (SIGABRT) after its work finished and its
process group was destroyed.  So each rank sends its result (or its exception)
through a pipe before exiting; the launcher returns the results when every rank
reported success, raises :class:`LaunchError` for the first failing rank
otherwise, and never waits longer than ``timeout_s`` (a rank that hangs or dies
without a report makes the whole launch fail, and the others are killed).  A rank that
has reported leaves with ``os._exit`` (:func:`end_rank`), skipping the teardown where
that abort, and its "terminate called without an active exception", happen.

Why a run directory (``run_dir``): a rank that hangs in a collective is killed, and one
that gloo aborts never reports, so what each rank issued must already be on disk when
the launch fails.  With ``run_dir`` the ranks keep their flight records there
(``OASES_RUN_DIR``; :mod:`oases_ds.parallel.flight`: a ring file written as collectives are
issued, a JSON dump on a failed wait) and torch's NCCL flight recorder dumps there on a
timeout; a failed launch's summary then ends with the first divergence the records show.
When a rank fails because its wait failed -- known from the dump it left there, not from
its error's words -- its peers get a few seconds to fail and dump too (:func:`_await_peers`)
before they are ended.

Why a fork server on CPU builds of torch: a rank started with ``spawn`` imports torch,
DeepSpeed and this package afresh (about 2 s of CPU each).  A process that launches
many times (the planner's profile at every degree, ``plan=auto``, a test suite) pays that
at every launch.  So ranks fork from multiprocessing's fork server, one clean process per
launcher that has imported :data:`PRELOAD` (and :func:`preload`'s modules) and never ran a
tensor operation or a thread: the first launch costs one import, later ones a fork.  What a
spawned rank inherited, a forked one is given: the launcher's environment (``env`` on top),
working directory and ``sys.path``.  On a CUDA or ROCm build ranks are spawned as before:
a CUDA driver initialised by an import must not be forked.  ``OASES_START_METHOD=spawn``
(or ``forkserver``) overrides the choice.

Why pipes and not report files: a launcher killed with SIGKILL cannot clean up
after itself, and a rank that outlives it just long enough to clean is a rank
that outlives it.  Pipes leave nothing on disk to reap.

Why the ranks die with their launcher, however it ends:

* SIGTERM / SIGINT to the launcher are recorded while ``launch`` runs; the wait
  loop then SIGTERMs every rank (SIGKILL after a grace period) and raises
  :class:`LaunchInterrupted` (``exit_code`` 143 / 130) for the caller to report.
* Ranks ignore SIGINT: Ctrl-C in a terminal reaches the whole foreground process
  group, and a rank's ``KeyboardInterrupt`` traceback would only be noise; the
  launcher ends them instead.  SIGINT is blocked while ranks start, so one
  pressed during start-up is neither lost by the launcher nor seen by a rank.
* SIGKILL of the launcher cannot be caught, so each rank asks Linux to SIGKILL it
  when its parent dies (``prctl(PR_SET_PDEATHSIG)``; the parent is the launcher, or the
  fork server, which exits when its launcher does), and, as the portable fallback, a
  watchdog thread SIGKILLs the rank when its *lifeline* ends: a pipe whose only write end
  the launcher holds, so it reads end-of-file exactly when the launcher is gone.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import pickle
import secrets
import signal
import socket
import tempfile
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oases_ds.parallel.flight import DUMP_PREFIX, RUN_DIR_ENV, RUN_ID_ENV, explain, nccl_env, nccl_hint, read_run_dir

_PR_SET_PDEATHSIG = 1
_TERMINATE_GRACE_S = 5.0
_PEER_TIMEOUT_GRACE_S = 5.0  # after a rank's wait failed (it left its dump), how long its peers get to dump too


class LaunchError(RuntimeError):
    """A rank failed, died without reporting, or the launch timed out.

    ``summary`` is one line for a user; the fields let a caller print, log or
    match the parts separately.  ``str(err)`` is the summary followed by the
    rank's traceback, if any, so the last line is the exception as Python prints it.

    Attributes:
        summary: e.g. ``rank 1: ValueError: bad shape`` or ``timed out after 600s waiting for ranks [1]``;
            with a run directory whose flight records show a divergence, followed by
            ``| collectives diverged in group ...`` (:attr:`divergence`).
        rank: the failing rank, or None when no single rank is to blame (timeout).
        exc_type: the rank's exception class name, when it raised.
        exc_message: the rank's exception message, when it raised.
        traceback: the rank's formatted traceback, when it raised.
        divergence: the first divergence of the ranks' collectives, from their flight records.
    """

    def __init__(self, summary: str, *, rank: int | None = None, exc_type: str | None = None,
                 exc_message: str | None = None, traceback: str | None = None, divergence: str | None = None) -> None:
        if divergence:
            summary = f"{summary} | {divergence}"
        super().__init__(summary if traceback is None else f"{summary}\n{traceback.rstrip()}")
        self.summary = summary
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback = traceback
        self.divergence = divergence

    def with_divergence(self, divergence: str) -> "LaunchError":
        """This error with the flight records' line appended to its summary."""
        return LaunchError(self.summary, rank=self.rank, exc_type=self.exc_type, exc_message=self.exc_message,
                           traceback=self.traceback, divergence=divergence)


class LaunchInterrupted(LaunchError):
    """The launcher got SIGINT or SIGTERM; its ranks are gone by the time this is raised.

    ``exit_code`` is the shell convention (128 + signal number) for a CLI to exit with.
    """

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(text: str) -> str:
    return " ".join(text.split())


PRELOAD: tuple[str, ...] = ("__main__", "torch", "torch.distributed", "torch._dynamo", "deepspeed", "oases_ds.engine",
                             __name__)
"""What the fork server imports once for every rank it forks (``__main__``: the launching
script, which each rank would otherwise import again as ``__mp_main__``; ``torch._dynamo``: the
first optimizer a rank builds imports it, about 0.8 s of CPU per rank; this module: its import in
the fork server applies the launcher's ``sys.path`` (:func:`_adopt_launcher_sys_path`) and
arranges :func:`_remove_fork_server_socket_at_exit`)."""

_START_METHOD_ENV = "OASES_START_METHOD"
_START_METHODS = ("forkserver", "spawn")
_extra_preload: list[str] = []


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (e.g. the module of the functions a test
    suite launches), so no rank imports them itself.  Takes effect for a fork server not yet
    started in this process; importing is best effort (a module that fails to import there
    is imported by each rank as usual)."""
    _extra_preload.extend(m for m in modules if m not in _extra_preload)


def start_method() -> str:
    """``forkserver`` on a CPU build of torch, ``spawn`` on a CUDA or ROCm build (module
    docstring); ``OASES_START_METHOD`` overrides."""
    chosen = os.environ.get(_START_METHOD_ENV, "").strip()
    if chosen:
        if chosen not in _START_METHODS:
            raise ValueError(f"{_START_METHOD_ENV}={chosen!r} is not a start method; set it to forkserver or spawn, "
                             "or unset it")
        return chosen
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    return "spawn" if gpu_build or not sys.platform.startswith("linux") else "forkserver"


_UNIX_PATH_MAX = 107
"""Bytes of a Unix socket's path Linux takes (``sun_path`` is 108 with the terminating NUL)."""
_LISTENER_NAME = len("/listener-XXXXXXXX")
"""What multiprocessing adds to its temporary folder to name the fork server's socket."""


def check_fork_server_socket_path() -> None:
    """Refuse, in one line naming ``TMPDIR``, a temporary folder whose path is too long for the fork
    server's socket.

    Why: the fork server listens on a Unix socket in a ``pymp-*`` folder under ``TMPDIR``, and Linux
    takes at most 107 bytes for its path; past that the first rank fails to start with a bare
    ``OSError: AF_UNIX path too long`` from deep inside multiprocessing (a CI job's workspace or a
    scheduler's per-job TMPDIR is easily that long)."""
    from multiprocessing import util

    folder = util.get_temp_dir()  # the pymp-* folder the socket goes in (made once per process)
    length = len(os.fsencode(folder)) + _LISTENER_NAME
    if length > _UNIX_PATH_MAX:
        raise LaunchError(f"TMPDIR={tempfile.gettempdir()} is too long for the fork server's socket (its path "
                          f"{folder}/listener-XXXXXXXX would be {length} bytes, "
                          f"Linux takes {_UNIX_PATH_MAX}); set TMPDIR to a shorter folder (e.g. /tmp) or "
                          f"{_START_METHOD_ENV}=spawn")


def _context() -> Any:
    """The multiprocessing context ranks start from (:func:`start_method`); with a fork server, its
    socket's path checked first (:func:`check_fork_server_socket_path`)."""
    method = start_method()
    context = mp.get_context(method)
    if method == "forkserver":
        check_fork_server_socket_path()
        context.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *_extra_preload])))
    return context


def start_fork_server_early() -> None:
    """Start the fork server now, in a background thread, if this process will launch ranks
    from one (:func:`start_method`); ``launch`` then finds it running, or waits for it.

    Why: the fork server imports torch, DeepSpeed and oases_ds (seconds) before it forks
    anything.  Started by the first ``launch``, those seconds come after everything a CLI
    does first (compose and check the config, plan); started here, they overlap it, on the
    host's other core.  Best effort: on any error ``launch`` starts it as before."""
    if start_method() != "forkserver":
        return

    def start() -> None:
        from multiprocessing import forkserver

        with contextlib.suppress(Exception), _sigint_blocked():  # the fork server inherits this thread's mask
            _context()
            forkserver.ensure_running()

    starter = threading.Thread(target=start, name="oases-fork-server", daemon=True)
    starter.start()
    atexit.unregister(_end_early_fork_server)  # one server per process: end it once, after its latest start
    atexit.register(_end_early_fork_server, starter)


def _end_early_fork_server(starter: threading.Thread) -> None:
    """At this process's exit, end the fork server :func:`start_fork_server_early` started.

    Why: it holds this process's stdout and stderr from its start.  After a CLI refused its
    input (exit 2, before any launch) it would go on importing for seconds, and whatever reads
    the CLI's output through a pipe (a shell pipeline, a test) would wait for it.  At exit every
    launch is over, so nothing needs it any more."""
    from multiprocessing import forkserver

    starter.join(timeout=5.0)  # it returns as soon as the server process exists
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def _fork_server_locals() -> dict[str, Any] | None:
    """The arguments of ``multiprocessing.forkserver.main`` when this module is being imported by a
    fork server (:data:`PRELOAD`: its frame is below this import), else None."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None and frame.f_code is not forkserver.main.__code__:
        frame = frame.f_back
    return frame.f_locals if frame is not None else None


def _adopt_launcher_sys_path(server: dict[str, Any]) -> None:
    """In a fork server, put the launcher's ``sys.path`` in place before the modules of
    :func:`preload` are imported (they follow this module in the preload list).

    Why: Python 3.11's fork server receives the launcher's ``sys.path`` (``sys_path``) but does
    not apply it, so a module found through a path the launcher added (a test suite's helper
    folder, a script's own directory) failed to import there, silently; then every rank
    imported it, and what it imports, itself."""
    path = server.get("sys_path")
    if isinstance(path, list) and path:
        sys.path[:] = path


def _remove_fork_server_socket_at_exit(server: dict[str, Any]) -> None:
    """In a fork server, remove the directory of its socket when it exits; elsewhere nothing.

    Why: the socket lives in a ``pymp-*`` directory that the launcher's process removes at
    its exit, which a SIGKILL skips; the fork server outlives it by a moment (it exits when
    its launcher's end of a pipe closes) and so can remove it.  The socket is found from the
    fork server's own arguments (``listener_fd``); if that changes, the directory is left as before."""
    import shutil

    listener_fd = server.get("listener_fd")
    if not isinstance(listener_fd, int):
        return
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(listener_fd)) as listener:
        path = listener.getsockname()
        folder = os.path.dirname(path) if isinstance(path, str) else ""
        if os.path.basename(folder).startswith("pymp-"):
            atexit.register(shutil.rmtree, folder, ignore_errors=True)


def _set_up_fork_server() -> None:
    """What importing this module does in a fork server (:data:`PRELOAD`); elsewhere nothing."""
    server = _fork_server_locals()
    if server is not None:
        _adopt_launcher_sys_path(server)
        _remove_fork_server_socket_at_exit(server)


_set_up_fork_server()


def _die_with_parent(lifeline: Connection) -> None:
    """Make this rank end when the launcher ends, even by SIGKILL (see the module docstring)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:  # the launcher never writes: a read returns only at end-of-file
                lifeline.recv_bytes()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="oases-parent-watchdog", daemon=True).start()


class _LauncherFd:
    """One of the launcher's file descriptors as it is at launch, sent to a rank.

    Why: a forked rank inherits the fork server's standard output and error, which are the
    launcher's as they were when the fork server started; a launcher whose stdout was
    redirected since (pytest's per-test capture, a wrapper that tees a second run's output)
    would lose its ranks' prints into the old target.  Pickled as a ``DupFd``, it travels
    with the rank's arguments (over the fork server's socket, or inherited under spawn)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_LauncherFd._received, (DupFd(self.fd),))

    @staticmethod
    def _received(dup: Any) -> "_LauncherFd":
        return _LauncherFd(dup.detach())


def _use_launcher_stdio(stdio: tuple[_LauncherFd, _LauncherFd]) -> None:
    """Point this rank's fds 1 and 2 at the launcher's (:class:`_LauncherFd`).

    A spawned rank is passed the launcher's fds under their own numbers, so it may already hold
    them as 1 and 2: those it keeps (closing the "copy" would close its stdout and stderr, and
    its first ``print`` would fail with ``OSError: [Errno 22]``)."""
    for stream, target, held in ((sys.stdout, 1, stdio[0]), (sys.stderr, 2, stdio[1])):
        with contextlib.suppress(Exception):
            stream.flush()
        if held.fd != target:
            os.dup2(held.fd, target)
            os.close(held.fd)


def _child(rank: int, world: int, port: int, threads: int, env: dict[str, str], fn, args,
           report: Connection, lifeline: Connection, stdio: tuple[_LauncherFd, _LauncherFd]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the launcher while starting us
    _use_launcher_stdio(stdio)
    _die_with_parent(lifeline)
    os.environ.clear()  # the launcher's environment as it is now (a forked rank has the fork server's)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(threads)
    # What the rank was given (torch, DeepSpeed, the preloaded modules: some 300 thousand objects)
    # lives as long as the rank: out of the collector's reach, a full collection scans only what
    # the rank made since (measured: 0.21 s -> 0.003 s of collection per oases-train rank).
    gc.freeze()
    try:
        payload: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as err:  # reported to the parent, which raises it
        payload = ("error", (type(err).__name__, str(err), traceback.format_exc()))
    try:
        data = pickle.dumps(payload)
    except Exception as err:  # unpicklable result: report that instead
        data = pickle.dumps(("error", (type(err).__name__, f"rank result cannot be pickled: {err}", traceback.format_exc())))
    report.send_bytes(data)
    report.close()
    end_rank(0 if payload[0] == "ok" else 1)


def end_rank(code: int) -> None:
    """End a rank whose work is done (and reported) without the interpreter's teardown.

    At a normal exit, C++ objects of torch's (gloo's worker threads among them) are
    destroyed while their threads may still be joinable: the process aborts with
    "terminate called without an active exception" on stderr, which after a run that
    succeeded reads as a crash.  So destroy the process group, flush what Python holds
    (standard streams, logging handlers) and leave.  Used by this launcher's ranks and by
    ``oases-train`` ranks that torchrun or DeepSpeed's launcher started: those launchers
    wait on exit codes, and a teardown that does not end would keep them waiting (a CI
    run once timed out on a torchrun rank after its steps had run)."""
    import logging

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def _signals_recorded() -> Iterator[list[int]]:
    """Record SIGINT/SIGTERM instead of dying on them, so the wait loop can end the ranks first.

    Signal handlers can only be set from the main thread; elsewhere the caller's own
    handling applies and the ranks still die with the process (PDEATHSIG).
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def record(signum: int, frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Started ranks inherit the blocked mask, so they never see a SIGINT before they ignore it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _end(procs: list, gently: bool) -> None:
    """Wait for finished ranks (``gently``) or SIGTERM them; SIGKILL whatever is left after the grace period."""
    if not gently:
        for p in procs:
            if p.is_alive():
                p.terminate()
    deadline = time.monotonic() + (10.0 if gently else _TERMINATE_GRACE_S)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _wait_failed(err: LaunchError, run_dir: str | None) -> bool:
    """Whether the rank ``err`` names failed in a collective's wait (the process-group timeout,
    a peer's reset connection): it left its flight dump, ``<run_dir>/collectives-rank<r>.json``.

    Why the dump and not the error's text: a rank writes the dump exactly when a wait fails
    (:meth:`~oases_ds.parallel.flight.FlightRecorder.failed`), before it reports, so it is on
    disk when the report is read; the text is gloo's or NCCL's, changes with their versions,
    and a rank's own error may say "timeout" too.  Guard mode's verdict
    (``CollectiveMismatchError``) also leaves a dump but already names the divergence.  Without
    a run directory no rank dumps: nothing says the wait failed, and nothing would be lost by
    ending the peers at once (there are no records to wait for)."""
    return (bool(run_dir) and err.rank is not None and err.exc_type != "CollectiveMismatchError"
            and os.path.exists(os.path.join(run_dir, f"{DUMP_PREFIX}{err.rank}.json")))


def _await_peers(procs: list, readers: list[Connection], done: set[int], grace_s: float) -> None:
    """Wait up to ``grace_s`` for every rank not in ``done`` to report or exit, reading nothing.

    Why: a hang times out on every rank of the group, each within about the time between
    the starts of their waits, and each rank writes its flight-record dump before it
    reports.  Ending the peers as soon as the first rank reports would kill them before
    their dumps, and the divergence is read from all of them."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if all(readers[r].poll() or not procs[r].is_alive() for r in range(len(procs)) if r not in done):
            return
        time.sleep(0.02)


def _cause_among_peers(procs: list, readers: list[Connection], done: set[int], run_dir: str | None) -> LaunchError | None:
    """The first peer's error that is its own (guard mode's ``CollectiveMismatchError``, an exception
    in its code) rather than a failed wait, among the reports the peers have sent, or ``None``.

    Why: a rank that raises exits, and its peers' pending collectives then fail on the closed
    connection.  Which report the launcher reads first is a race (it polls the ranks in order),
    and on a busy host the consequence -- rank 0's "connection closed by peer" -- was read before
    the cause rank 1 had already reported (a CI red: guard mode's verdict lost to gloo's words)."""
    for rank in range(len(procs)):
        if rank in done or not readers[rank].poll():
            continue
        try:
            _receive(rank, readers[rank], procs[rank])
        except LaunchError as err:
            if err.exc_type is not None and not _wait_failed(err, run_dir):
                return err
    return None


def _receive(rank: int, reader: Connection, proc) -> tuple[str, Any]:
    """The report of a rank whose pipe is readable; raises if it died before sending one."""
    try:
        status, value = pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        proc.join(timeout=5)
        raise LaunchError(f"rank {rank} exited with code {proc.exitcode} without reporting a result", rank=rank) from None
    if status == "error":
        exc_type, message, tb = value
        raise LaunchError(f"rank {rank}: {exc_type}: {_one_line(message)}" if message.strip() else f"rank {rank}: {exc_type}",
                          rank=rank, exc_type=exc_type, exc_message=message, traceback=tb)
    return status, value


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    threads_per_rank: int | None = None,
    run_dir: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes with torchrun-style env vars.

    ``fn`` must be importable by module path (spawn).  Returns the per-rank results;
    raises :class:`LaunchError` (a rank failed, died or the launch timed out) or
    :class:`LaunchInterrupted` (SIGINT/SIGTERM), in both cases with every rank ended.
    ``run_dir``: where the ranks keep their flight records (module docstring).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    env = dict(env or {})
    run_id = None
    if run_dir:
        run_id = flight_env(run_dir, env)
    try:
        return _launch(fn, nprocs, args, timeout_s, env, threads_per_rank, run_dir)
    except LaunchInterrupted:
        raise
    except LaunchError as err:
        if not run_dir or not _failed_in_communication(err, run_dir):
            raise
        line = explain(read_run_dir(run_dir, run_id))
        if line is None and any(name.startswith("nccl_trace_rank_") for name in os.listdir(run_dir)):
            line = nccl_hint(run_dir)
        if line is None:
            raise
        raise err.with_divergence(line) from None


def _failed_in_communication(err: LaunchError, run_dir: str) -> bool:
    """Whether the flight records can explain ``err``: the launch timed out (ranks hung), the
    rank died without a report (gloo aborts a rank that receives too much), or its failed
    wait left a dump (:func:`_wait_failed`).  Not for an error of the rank's own (its peers
    then wait on it, which the records would misname as the cause) nor one guard mode named
    already."""
    return err.rank is None or err.exc_type is None or _wait_failed(err, run_dir)


def flight_env(run_dir: str, env: dict[str, str]) -> str:
    """Prepare ``run_dir`` for one launch's flight records and add their settings to ``env``:
    the directory, a fresh run id (dumps of an earlier launch there are not read), torch's
    NCCL flight recorder (:func:`~oases_ds.parallel.flight.nccl_env`; gloo ignores it).
    Returns the run id."""
    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):
        if name.startswith(DUMP_PREFIX):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(run_dir, name))
    run_id = secrets.token_hex(6)
    env.update({RUN_DIR_ENV: os.path.abspath(run_dir), RUN_ID_ENV: run_id, **nccl_env(run_dir)})
    return run_id


def _launch(fn: Callable[..., Any], nprocs: int, args: tuple, timeout_s: float, env: dict[str, str],
            threads_per_rank: int | None, run_dir: str | None) -> list[Any]:
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    context = _context()
    env = {**os.environ, **env}
    port = free_port()
    for stream in (sys.stdout, sys.stderr):  # what this process printed comes before its ranks' lines
        with contextlib.suppress(Exception):
            stream.flush()
    procs, readers, lifelines = [], [], []
    results: dict[int, tuple[str, Any]] = {}
    with _signals_recorded() as received:
        try:
            with _sigint_blocked():  # the fork server, started by the first launch, inherits the mask too
                for r in range(nprocs):
                    reader, writer = context.Pipe(duplex=False)
                    lifeline, keep_alive = context.Pipe(duplex=False)
                    p = context.Process(target=_child, daemon=False,
                                        args=(r, nprocs, port, threads, env, fn, args, writer, lifeline,
                                              (_LauncherFd(1), _LauncherFd(2))))
                    readers.append(reader)
                    lifelines.append(keep_alive)
                    p.start()
                    procs.append(p)
                    writer.close()  # the rank holds the only write end: its death reads as EOF
                    lifeline.close()  # ... and the only read end of its lifeline: our death reads as EOF there
            deadline = time.monotonic() + timeout_s
            while len(results) < nprocs:
                if received:
                    raise LaunchInterrupted(received[0])
                for r in range(nprocs):
                    if r in results:
                        continue
                    if readers[r].poll():
                        try:
                            results[r] = _receive(r, readers[r], procs[r])
                        except LaunchError as err:
                            if _wait_failed(err, run_dir):  # its peers' waits are likely failing too: let them dump
                                _await_peers(procs, readers, set(results) | {r}, _PEER_TIMEOUT_GRACE_S)
                                cause = _cause_among_peers(procs, readers, set(results) | {r}, run_dir)
                                if cause is not None:
                                    raise cause from None
                            raise
                    elif not procs[r].is_alive() and not readers[r].poll():
                        raise LaunchError(f"rank {r} exited with code {procs[r].exitcode} without reporting a result",
                                          rank=r)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(nprocs)) - set(results))
                    raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for ranks {missing}")
                time.sleep(0.02)
        finally:
            _end(procs, gently=len(results) == nprocs)
            for pipe in readers + lifelines:
                pipe.close()
    return [results[r][1] for r in range(nprocs)]
