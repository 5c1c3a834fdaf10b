"""The flight recorder: what each rank issued on each group, so that a hang can name its cause.

A distributed job whose ranks issue collectives in different orders, with different
shapes, or not at all, does not fail: it waits out the process-group timeout and then
reports *a* timeout.  Every collective and transfer a :class:`~oases_ds.parallel.comm.Communicator`
issues (TMP, reshard, DP buckets, replica sums, pipeline send/recv, the loss and metrics
reductions) therefore first appends a :class:`Record` -- group, per-group index, op, label,
shape, dtype, step -- to its rank's :class:`FlightRecorder`.  Two ranks' records of one
group must agree index by index; the first index where they do not is the first
divergence, and :func:`explain` names it in one line.

Why a group is named by its global ranks *and* its process-group name: two process
groups can hold the same ranks (the pipeline's activation and gradient groups; the TMP
group and the world when the world is one TMP group), and their collectives are matched
separately.  A point-to-point link is named by its direction (``0->2``), so the sender's
and the receiver's records of one message carry the same group and index.

Where the records go:

* in memory, a bounded deque (:data:`DEFAULT_RECORDS` entries, on by default: one small
  object per collective);
* with a run directory (``OASES_RUN_DIR``, set by :func:`oases_ds.launcher.launch`), also
  a ring file per rank (:class:`RingFile`, memory-mapped): written as the collectives are
  issued, so it survives a rank that gloo aborts (it ``std::terminate``\\ s a rank that
  receives more bytes than it posted) or that the launcher kills while it hangs;
* on a failed wait (the process-group timeout, a peer's reset connection), an atomic JSON
  dump of the deque and the error (:meth:`FlightRecorder.failed`).

The launcher reads the dumps and ring files of a failed launch (:func:`read_run_dir`) and
prints :func:`explain`'s line.  On NCCL, torch has its own flight recorder; :func:`nccl_env`
turns it on (it dumps on a timeout) instead of this one writing files.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from oases_ds.utils.io import write_json_atomic

DEFAULT_RECORDS = 512
"""Records a rank keeps in memory and in its ring file: a few steps of a small model, the
last step of a large one -- enough to hold the collectives since the last agreed one."""
RUN_DIR_ENV = "OASES_RUN_DIR"
"""Where ranks write their ring files and dumps (the launcher sets it; scripts may)."""
RUN_ID_ENV = "OASES_RUN_ID"
"""Names one launch, so that files a previous launch left in the run directory are not read."""
DUMP_PREFIX = "collectives-rank"
RING_SLOT = 256
_RING_HEADER = struct.Struct("<8sqqqqq")  # magic, slot size, slots, records written, waiting (0/1), rank
_RING_MAGIC = b"OASESFR1"
_SEP = "\t"


@dataclass(frozen=True, slots=True)
class Record:
    """One collective or transfer as its rank issued it.

    Attributes:
        group: :func:`group_key` of its process group (or link).
        index: its position among the group's records on this rank, from 0 at the run's first.
        op: ``all_reduce.sum``, ``all_gather``, ``broadcast``, ``p2p`` (both ends of a
            transfer record ``p2p``, so that they compare equal).
        label: what issued it, the same on every rank (``L0.attn_reduce fwd sb0``).
        shape / dtype: of this rank's tensor (a receive: of the buffer it posted).
        step: the caller's step number (:attr:`FlightRecorder.step`).
    """

    group: str
    index: int
    op: str
    label: str
    shape: tuple[int, ...]
    dtype: str
    step: int

    def describe(self) -> str:
        return f"{self.op} {self.label} {list(self.shape)} {self.dtype}"

    def signature(self) -> str:
        """Everything that must be equal on every rank of the group, as one line."""
        return _SEP.join((str(self.index), self.op, self.label, ",".join(map(str, self.shape)), self.dtype,
                          str(self.step)))

    def line(self) -> str:
        return _SEP.join((self.group, self.signature()))

    @classmethod
    def from_line(cls, line: str) -> "Record":
        group, index, op, label, shape, dtype, step = line.split(_SEP)
        return cls(group, int(index), op, label, tuple(int(s) for s in shape.split(",") if s), dtype, int(step))

    @classmethod
    def from_signature(cls, group: str, signature: str) -> "Record":
        return cls.from_line(_SEP.join((group, signature)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Record":
        return cls(**{**data, "shape": tuple(data["shape"])})


def group_key(ranks: Sequence[int], name: str) -> str:
    """A process group as records name it: its global ranks and its process-group name."""
    return f"[{', '.join(map(str, ranks))}] pg{name}"


def link_key(src: int, dst: int, name: str) -> str:
    """One direction of a point-to-point link, the same on its sender and its receiver."""
    return f"{src}->{dst} pg{name}"


_LINK = re.compile(r"^(\d+)->(\d+) ")


def members(key: str) -> list[int]:
    """The global ranks of the group (or link) ``key`` names."""
    link = _LINK.match(key)
    if link:
        return [int(link.group(1)), int(link.group(2))]
    return json.loads(key[: key.index("]") + 1])


def describe_group(key: str) -> str:
    return f"link {key}" if _LINK.match(key) else f"group {key}"


_DTYPES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``float32`` (cached: it runs once per collective)."""
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).removeprefix("torch.")
    return name


class RingFile:
    """A rank's records in a memory-mapped file of fixed slots, the newest overwriting the oldest.

    Why a mapped file and not a dump at the end: the end may never come.  Pages written
    here belong to the kernel's page cache as soon as they are written, so the file holds
    the rank's last records whether the rank raised, was SIGKILLed by the launcher or
    aborted inside gloo.  A slot is written before the header counts it, so a reader never
    counts a half-written slot (one overwritten while being read fails to parse and is
    skipped).  One extra slot holds the record the rank waits on now."""

    def __init__(self, path: str, slots: int, rank: int) -> None:
        self.path = path
        self.slots = max(1, slots)
        size = _RING_HEADER.size + (self.slots + 1) * RING_SLOT
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w+b") as f:
            f.truncate(size)
            self._map = mmap.mmap(f.fileno(), size)
        self._seq = 0
        self._rank = rank
        self._waiting = 0
        self._header()

    def _header(self) -> None:
        _RING_HEADER.pack_into(self._map, 0, _RING_MAGIC, RING_SLOT, self.slots, self._seq, self._waiting, self._rank)

    def _put(self, slot: int, record: Record) -> None:
        offset = _RING_HEADER.size + slot * RING_SLOT
        self._map[offset: offset + RING_SLOT] = record.line().encode()[: RING_SLOT - 1].ljust(RING_SLOT, b"\0")

    def write(self, record: Record) -> None:
        self._put(1 + self._seq % self.slots, record)
        self._seq += 1
        self._header()

    def waiting(self, record: Record | None) -> None:
        """Mark ``record`` as the one this rank waits on now (``None``: none)."""
        if record is not None:
            self._put(0, record)
        self._waiting = int(record is not None)
        self._header()

    def close(self) -> None:
        self._map.close()

    @staticmethod
    def read(path: str) -> dict[str, Any] | None:
        """The snapshot a ring file holds (:meth:`FlightRecorder.snapshot`'s form), or ``None``."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) < _RING_HEADER.size:
            return None
        magic, slot, slots, seq, waiting, rank = _RING_HEADER.unpack_from(data, 0)
        if magic != _RING_MAGIC:
            return None

        def at(index: int) -> Record | None:
            offset = _RING_HEADER.size + index * slot
            try:
                return Record.from_line(data[offset: offset + slot].rstrip(b"\0").decode())
            except (ValueError, UnicodeDecodeError):
                return None

        records = [r for s in range(max(0, seq - slots), seq) if (r := at(1 + s % slots)) is not None]
        waited = at(0) if waiting else None
        counts: dict[str, int] = {}
        for record in records:
            counts[record.group] = max(counts.get(record.group, 0), record.index + 1)
        return {"rank": rank, "error": None, "waiting": waited.to_json() if waited else None,
                "counts": counts, "records": [r.to_json() for r in records], "source": path}


class FlightRecorder:
    """One rank's records: a bounded deque, per-group counts, and (in guard mode) rolling hashes.

    Args:
        size: records kept (0: none are kept, but counts still advance).
        rank: this rank's global rank (named in dumps).
        run_dir: where the ring file and a failure dump go (``None``: memory only).
        digest: keep a rolling hash per group (:class:`~oases_ds.parallel.guard.CollectiveGuard`
            compares them once per step).
        run_id: written into the dump, so a reader can skip files of another launch.
    """

    def __init__(self, size: int = DEFAULT_RECORDS, rank: int = 0, run_dir: str | None = None,
                 digest: bool = False, run_id: str = "") -> None:
        self.size = size
        self.rank = rank
        self.run_dir = run_dir
        self.run_id = run_id
        self.records: deque[Record] = deque(maxlen=max(size, 1))
        self.counts: dict[str, int] = {}
        self.hashes: dict[str, bytes] = {}
        self.digest = digest
        self.step = 0
        self.waiting: Record | None = None
        self.waiting_since = 0.0
        self._ring = RingFile(os.path.join(run_dir, f"{DUMP_PREFIX}{rank}.ring"), size, rank) if run_dir and size else None

    def record(self, group: str, op: str, label: str, shape: tuple[int, ...], dtype: str) -> Record:
        """Append the next collective of ``group`` and return it."""
        index = self.counts.get(group, 0)
        self.counts[group] = index + 1
        rec = Record(group, index, op, label, shape, dtype, self.step)
        if self.size:
            self.records.append(rec)
        if self._ring is not None:
            self._ring.write(rec)
        if self.digest:
            self.hashes[group] = hashlib.blake2b(self.hashes.get(group, b"") + rec.signature().encode(),
                                                 digest_size=8).digest()
        return rec

    # -- waiting ------------------------------------------------------------------
    def begin_wait(self, record: Record | None) -> None:
        self.waiting = record
        self.waiting_since = time.monotonic()
        if self._ring is not None:
            self._ring.waiting(record)

    def end_wait(self) -> None:
        self.waiting = None
        if self._ring is not None:
            self._ring.waiting(None)

    def wait(self, work: Any, record: Record | None) -> None:
        """``work.wait()``; a failure (the process-group timeout, a reset connection) is
        dumped (:meth:`failed`) and re-raised."""
        self.begin_wait(record)
        try:
            work.wait()
        except Exception as err:
            self.failed(record, err)
            raise
        self.end_wait()

    def failed(self, record: Record | None, err: BaseException) -> None:
        """Write this rank's records and the error to ``<run_dir>/collectives-rank<r>.json``
        (atomically); without a run directory, nothing.  The wait stays marked in the ring."""
        if not self.run_dir:
            return
        snap = self.snapshot()
        snap["error"] = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        if record is not None:
            snap["waiting"] = record.to_json()
        try:
            write_json_atomic(os.path.join(self.run_dir, f"{DUMP_PREFIX}{self.rank}.json"), snap)
        except OSError:
            pass  # the error being raised matters more than its dump; the ring file still holds the records

    # -- what others read ------------------------------------------------------------
    def snapshot(self, records: bool = True) -> dict[str, Any]:
        """This rank's state as plain JSON: counts, the record waited on and for how long,
        and (``records``) the records kept."""
        waiting = self.waiting
        return {
            "rank": self.rank, "run_id": self.run_id, "step": self.step, "error": None,
            "counts": dict(self.counts),
            "waiting": waiting.to_json() if waiting is not None else None,
            "waiting_s": time.monotonic() - self.waiting_since if waiting is not None else 0.0,
            "records": [r.to_json() for r in self.records] if records and self.size else [],
        }

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None


# -- reading a failed run ---------------------------------------------------------------
def read_run_dir(run_dir: str, run_id: str | None = None) -> list[dict[str, Any]]:
    """Every rank's snapshot a run directory holds: its JSON dump where it wrote one (a
    failed wait), else its ring file (a rank that aborted, or was killed while it hung)."""
    found: dict[int, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return []
    for name in names:
        if name.startswith(DUMP_PREFIX) and name.endswith(".ring"):
            snap = RingFile.read(os.path.join(run_dir, name))
            if snap is not None:
                found[snap["rank"]] = snap
    for name in names:
        if name.startswith(DUMP_PREFIX) and name.endswith(".json"):
            try:
                with open(os.path.join(run_dir, name)) as f:
                    snap = json.load(f)
            except (OSError, ValueError):
                continue
            if run_id is None or snap.get("run_id") == run_id:
                found[snap["rank"]] = snap
    return [found[r] for r in sorted(found)]


def _records(snap: dict[str, Any]) -> list[Record]:
    return [Record.from_json(r) for r in snap.get("records", [])]


def _waiting(snap: dict[str, Any]) -> Record | None:
    return Record.from_json(snap["waiting"]) if snap.get("waiting") else None


def _is_guard(record: Record) -> bool:
    return record.label.startswith("guard.")


def conflict(snapshots: Iterable[dict[str, Any]]) -> str | None:
    """The first (lowest step, then index) group index at which two ranks recorded different
    collectives, as one line; ``None`` if the records agree wherever they overlap."""
    seen: dict[tuple[str, int], tuple[int, Record]] = {}
    found: list[tuple[int, int, str, tuple[int, Record], tuple[int, Record]]] = []
    for snap in snapshots:
        for record in _records(snap) + ([w] if (w := _waiting(snap)) else []):
            key = (record.group, record.index)
            first = seen.setdefault(key, (snap["rank"], record))
            if first[0] != snap["rank"] and first[1].signature() != record.signature():
                found.append((min(first[1].step, record.step), record.index, record.group, first, (snap["rank"], record)))
    if not found:
        return None
    step, index, group, (rank_a, a), (rank_b, b) = min(found, key=lambda f: (f[0], f[1], f[2], f[3][0], f[4][0]))
    ranks = sorted(((rank_a, a), (rank_b, b)), key=lambda p: p[0])
    return (f"collectives diverged in {describe_group(group)} at step {step}, index {index}: "
            f"rank {ranks[0][0]} issued {ranks[0][1].describe()}, rank {ranks[1][0]} issued {ranks[1][1].describe()}")


def blockers(snap: dict[str, Any], by_rank: dict[int, dict[str, Any]]) -> list[int] | None:
    """The ranks that keep ``snap``'s rank in its wait: members of the group it waits on that
    have not issued that index (by their snapshots).  ``None``: a member left no snapshot."""
    record = _waiting(snap)
    if record is None:
        return []
    out = []
    for member in members(record.group):
        if member == snap["rank"]:
            continue
        other = by_rank.get(member)
        if other is None:
            return None
        if other.get("counts", {}).get(record.group, 0) <= record.index:
            out.append(member)
    return out


def unmet_wait(snapshots: Sequence[dict[str, Any]], stuck_s: float = 0.0, start: int | None = None) -> str | None:
    """One line naming a wait no rank can meet, or ``None``.

    A rank waiting on index ``k`` of a group is blocked by each member that has not issued
    ``k``.  With ``start``, a verdict needs proof of a deadlock: every rank reachable from
    ``start`` along blocked-by edges waits (for at least ``stuck_s``) and is blocked by
    someone, so none of them can ever move -- a rank that computes, or whose wait only
    needs the link to finish, means no verdict (a slow peer is not a bug).  Without
    ``start`` (a post-mortem: every rank has ended) any blocked wait is named.  Of the
    blocked waits, the one on an executor collective (not the guard's own check) of the
    lowest step and rank is named."""
    by_rank = {s["rank"]: s for s in snapshots}
    if start is not None:
        todo, seen = [start], set()
        while todo:
            rank = todo.pop()
            if rank in seen:
                continue
            seen.add(rank)
            snap = by_rank.get(rank)
            if snap is None or _waiting(snap) is None or snap.get("waiting_s", 0.0) < stuck_s:
                return None
            blocked = blockers(snap, by_rank)
            if not blocked:
                return None
            todo.extend(blocked)
        candidates = [by_rank[r] for r in seen]
    else:
        candidates = list(snapshots)
    edges = []
    for snap in candidates:
        record = _waiting(snap)
        blocked = blockers(snap, by_rank) if record is not None else None
        if record is not None and blocked:
            edges.append((_is_guard(record), record.step, snap["rank"], record, blocked[0]))
    if not edges:
        return None
    _, _, rank, record, other = min(edges, key=lambda e: e[:3])
    there = by_rank[other]
    theirs = _waiting(there)
    last = [r for r in _records(there) if r.group == record.group]
    where = (f"it waits on {theirs.describe()} ({describe_group(theirs.group)} index {theirs.index}, step {theirs.step})"
             if theirs is not None else
             f"its last there is index {last[-1].index} ({last[-1].describe()})" if last else "it issued none there")
    return (f"collectives diverged in {describe_group(record.group)} at step {record.step}, index {record.index}: "
            f"rank {rank} issued {record.describe()} and waits for it; rank {other} never issued index "
            f"{record.index} of that group: {where}")


def explain(snapshots: Sequence[dict[str, Any]]) -> str | None:
    """The first divergence a failed run's snapshots show, as one line (``None``: none found
    in the records kept)."""
    return conflict(snapshots) or unmet_wait(snapshots)


def nccl_env(run_dir: str, records: int = 2000) -> dict[str, str]:
    """PyTorch's own NCCL flight recorder, dumping on a timeout into ``run_dir``.

    On NCCL a collective's ``wait`` returns before the transfer ends and a stuck one is
    ended by torch's watchdog, which can dump its own record of every rank's NCCL calls
    (``torchfrtrace <run_dir> -p nccl_trace_rank_`` reads them); so Oases sets that up
    rather than writing its own files for NCCL.  The variables are torch 2.13's names
    (``TORCH_FR_*``: the older ``TORCH_NCCL_TRACE_BUFFER_SIZE`` / ``..._DEBUG_INFO_TEMP_FILE``
    print a deprecation warning in every rank, gloo runs included); a setting the user made
    under either name is kept."""
    wanted = {
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(records),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): os.path.join(os.path.abspath(run_dir),
                                                                                   "nccl_trace_rank_"),
    }
    return {names[0]: value for names, value in wanted.items() if not any(n in os.environ for n in names)}


def nccl_hint(run_dir: str) -> str:
    """Where :func:`nccl_env`'s dumps are and how to read them, for the launcher's line."""
    return f"NCCL flight recorder dumps (on a timeout): {os.path.abspath(run_dir)}/nccl_trace_rank_<r>; read them " \
           f"with torchfrtrace {os.path.abspath(run_dir)} -p nccl_trace_rank_"
