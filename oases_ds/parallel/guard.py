"""Guard mode: a diverging rank fails fast, with the first differing collective named.

Switched on by ``"check_collectives": true`` in the ``oases`` section, ``check_collectives=true``
on ``oases-train`` or ``OASES_CHECK_COLLECTIVES=1``.  Four checks, all through the
:class:`~oases_ds.parallel.comm.Communicator` that owns this guard:

1. **Before each collective, its signature** (group index, op, label, shape, dtype, step:
   :meth:`Record.signature <oases_ds.parallel.flight.Record.signature>`) is all-gathered over
   its group as a fixed 256-byte tensor (:meth:`CollectiveGuard.agree`), and the collective
   is issued only if every rank agrees.  Why before and not once per step: gloo matches
   collectives by their order alone, so a rank that skipped one pairs its next with its
   peers' current one, and a shape that differs does not raise -- gloo ``std::terminate``\\ s
   the rank that receives more bytes than it posted ("op.preamble.length <= op.nbytes",
   measured with torch 2.13), which no end-of-step check survives.  The exchange has a fixed
   size, so it cannot be the mismatch.  Point-to-point: the sender sends the signature
   ahead of the payload, the receiver compares it and only then posts the payload's receive.
2. **Every wait is bounded** (:meth:`CollectiveGuard.wait`): gloo's ``work.wait(timeout=)``
   returns control after :data:`GUARD_INTERVAL_S` with the collective still pending (a
   later wait completes it, tested).  Then this rank publishes what it waits on through the
   default group's TCPStore (which answers while collectives hang) and reads the other
   ranks' publications: if every rank reachable along "waits for a rank that has not
   issued that collective" waits too, no one can move, and the one line of
   :func:`~oases_ds.parallel.flight.unmet_wait` is raised -- after seeing the same verdict in
   two rounds, so that a publication a moment old cannot fake one.  If some rank computes,
   or every member has issued the collective (a slow link), it keeps waiting, up to the
   process-group timeout.
3. **Once per schedule run, the step digest**: per group, the count and rolling hash of
   the records (:meth:`~oases_ds.parallel.comm.Communicator.check_step`), exchanged over
   the world group, which no executor transfer uses, so a desynchronised group cannot pair
   a stray collective with it.  It catches what 1. does not see: a stage that sent a
   message its neighbour never receives, a rank that left a group's last collective out.
4. **The first micro-batch of each step** is hashed and compared across the TMP group
   (:meth:`~oases_ds.parallel.comm.Communicator.check_batch`): TMP ranks must see the same
   data, and a loader keyed by the wrong rank breaks that silently.

What it costs: one small synchronous all-gather per collective, which also makes the ranks
of a group meet at each issue (``benchmarks/guard_overhead.py`` measures a step with it on
and off).  Tested on gloo; on NCCL the signature exchange runs too, but ``wait(timeout=)``
does not block the host there, so use torch's NCCL flight recorder for hangs
(:func:`~oases_ds.parallel.flight.nccl_env`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from oases_ds.parallel.collectives import Group, Pending, start_recv, start_send
from oases_ds.parallel.flight import FlightRecorder, Record, describe_group, unmet_wait

GUARD_INTERVAL_S = 1.0
"""How long a guarded wait blocks before it looks for a divergence (and again after each)."""
CHECK_ENV = "OASES_CHECK_COLLECTIVES"
"""Environment switch for guard mode in scripts: ``1``/``true``/``on`` or ``0``/``false``/``off``."""
SIGNATURE_BYTES = 256
HEADER_TAG = 0x0A5E5
"""Point-to-point tag of guard mode's signatures, apart from the payloads' (tag 0), so that
gloo matches signatures with signatures and payloads with payloads, each in order.  NCCL
has no tags: guard mode's pipeline transfers need gloo."""
_DIGEST = 8
_EXPIRED = "Operation timed out"  # gloo's message when wait(timeout=) returns control, the work still pending
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (or data); the message names the first difference."""


def check_collectives_from_env(default: bool = False) -> bool:
    """``default`` unless ``$OASES_CHECK_COLLECTIVES`` says otherwise; a value that is no
    switch is a one-line error (a typo must not silently leave the guard off)."""
    value = os.environ.get(CHECK_ENV)
    if value is None:
        return default
    value = value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{CHECK_ENV}={value!r} is not a switch; set it to 1 (guard mode on) or 0 (off)")


def encode(text: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """``text`` as a fixed :data:`SIGNATURE_BYTES` tensor: an 8-byte hash of all of it, then
    as much of it as fits (the hash decides equality, the text is for the message)."""
    data = text.encode()
    packed = hashlib.blake2b(data, digest_size=_DIGEST).digest() + data[: SIGNATURE_BYTES - _DIGEST]
    out = torch.zeros(SIGNATURE_BYTES, dtype=torch.uint8)
    out[: len(packed)] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    return out.to(device)


def decode(tensor: torch.Tensor) -> tuple[bytes, str]:
    data = bytes(tensor.cpu().tolist())
    return data[:_DIGEST], data[_DIGEST:].rstrip(b"\0").decode(errors="replace")


def batch_signature(batch: Mapping[str, torch.Tensor]) -> str:
    """Keys, shapes, dtypes and a hash of the contents of ``batch``, as one line."""
    parts = []
    for key in sorted(batch):
        t = batch[key]
        data = t.detach().contiguous().cpu()
        digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"", digest_size=6)
        parts.append(f"{key}{list(t.shape)}{str(t.dtype).removeprefix('torch.')}#{digest.hexdigest()}")
    return " ".join(parts)


def default_store() -> Any | None:
    """The default group's store (private torch API, tested with 2.13); ``None`` without it,
    and guarded waits then only bound themselves by the process-group timeout."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


class CollectiveGuard:
    """Guard mode's checks for one :class:`FlightRecorder` (module docstring).

    Args:
        recorder: the rank's records (counts and hashes are kept: ``digest``).
        store: the store peers publish their waits to (default: the default group's).
        interval_s: how long a wait blocks before looking for a divergence.
    """

    def __init__(self, recorder: FlightRecorder, store: Any | None = None, interval_s: float = GUARD_INTERVAL_S) -> None:
        self.recorder = recorder
        recorder.digest = True
        self.store = store if store is not None else default_store()
        self.interval_s = interval_s
        self._interval = datetime.timedelta(seconds=interval_s)
        self.rank = dist.get_rank() if dist.is_initialized() else recorder.rank
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._published = False
        self._receives: dict[str, list[_GuardedRecv]] = {}  # per link: started receives whose payload is not posted

    # -- 1. signatures -------------------------------------------------------------
    def exchange(self, text: str, group: Group, record: Record, device: torch.device) -> list[tuple[bytes, str]]:
        """Every rank's ``text`` of one fixed-size all-gather over ``group`` (bounded wait)."""
        mine = encode(text, device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        self.wait(dist.all_gather(parts, mine, group=group, async_op=True), record)
        return [decode(p) for p in parts]

    def agree(self, record: Record, group: Group, device: torch.device) -> None:
        """Issue nothing until every rank of ``group`` names the same next collective as ``record``."""
        seen = self.exchange(record.signature(), group, record, device)
        if any(digest != seen[0][0] for digest, _ in seen):
            raise CollectiveMismatchError(self._differ(record.group, dist.get_process_group_ranks(group), seen))

    @staticmethod
    def _differ(group: str, ranks: list[int], seen: list[tuple[bytes, str]]) -> str:
        first = next(i for i, (digest, _) in enumerate(seen) if digest != seen[0][0])
        a, b = (Record.from_signature(group, seen[i][1]) for i in (0, first))
        index = a.index if a.index == b.index else f"{a.index} (rank {ranks[first]} counts {b.index})"
        return (f"collectives diverged in {describe_group(group)} at step {a.step}, index {index}: rank {ranks[0]} "
                f"issued {a.describe()}, rank {ranks[first]} issued {b.describe()}")

    def send(self, record: Record, tensor: torch.Tensor, dst: int, group: Group) -> Pending:
        """The signature (tag :data:`HEADER_TAG`), then ``tensor``, to global rank ``dst``;
        ``wait()`` waits for both (bounded)."""
        header = dist.isend(encode(record.signature(), tensor.device), dst, group=group, tag=HEADER_TAG)
        payload = start_send(tensor, dst, group)
        return _GuardedSend(self, record, header, payload)

    def recv(self, record: Record, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int,
             group: Group) -> Pending:
        """Post the receive of ``src``'s signature now; ``wait()`` compares it with ``record`` and
        only then posts the payload's receive, so a payload of another size never reaches gloo.
        Payload receives are posted in the order the receives were started (earlier ones
        first, if waited later), since gloo matches a link's messages by order alone."""
        buf = torch.empty(SIGNATURE_BYTES, dtype=torch.uint8, device=device)
        header = dist.irecv(buf, src, group=group, tag=HEADER_TAG)
        queue = self._receives.setdefault(record.group, [])
        pending = _GuardedRecv(self, record, header, buf, lambda: start_recv(shape, dtype, device, src, group), src, queue)
        queue.append(pending)
        return pending

    # -- 2. bounded waits -------------------------------------------------------------
    def wait(self, work: Any, record: Record | None) -> None:
        """``work.wait()`` in slices of ``interval_s``; between slices, look for a divergence.

        A failure of the wait itself (gloo's process-group timeout, a peer's reset connection)
        is dumped by the recorder and re-raised; a proven divergence raises
        :class:`CollectiveMismatchError`."""
        recorder = self.recorder
        recorder.begin_wait(record)
        last: str | None = None
        try:
            while True:
                try:
                    work.wait(timeout=self._interval)
                    break
                except RuntimeError as err:
                    if _EXPIRED not in str(err):
                        recorder.failed(record, err)
                        raise
                verdict = self._diagnose()
                if verdict is not None and verdict == last:
                    recorder.failed(record, CollectiveMismatchError(verdict))
                    raise CollectiveMismatchError(verdict)
                last = verdict
        finally:
            if self._published:
                self._withdraw()
        recorder.end_wait()

    def _key(self, rank: int) -> str:
        return f"oases/guard/waiting/{rank}"

    def _diagnose(self) -> str | None:
        """Publish this rank's wait, read the others', and name a wait no one can meet."""
        if self.store is None:
            return None
        mine = self.recorder.snapshot(records=False)
        try:
            self.store.set(self._key(self.rank), json.dumps(mine))
            self._published = True
            snapshots = [mine]
            for rank in range(self.world):
                if rank != self.rank and self.store.check([self._key(rank)]):
                    snapshots.append(json.loads(self.store.get(self._key(rank))))
        except (RuntimeError, ValueError):  # the store's host is gone: nothing to learn
            return None
        return unmet_wait(snapshots, stuck_s=self.interval_s * 0.5, start=self.rank)

    def _withdraw(self) -> None:
        self._published = False
        try:
            self.store.delete_key(self._key(self.rank))
        except (RuntimeError, ValueError):
            pass


class _GuardedSend(Pending):
    def __init__(self, guard: CollectiveGuard, record: Record, header: Any, payload: Pending) -> None:
        super().__init__(None, payload.wait)
        self._guard, self._record, self._header = guard, record, header

    def wait(self) -> torch.Tensor:
        self._guard.wait(self._header, self._record)
        return super().wait()


class _GuardedRecv(Pending):
    def __init__(self, guard: CollectiveGuard, record: Record, header: Any, buf: torch.Tensor,
                 start_payload: Callable[[], Pending], src: int, queue: list["_GuardedRecv"]) -> None:
        super().__init__(None, self._receive)
        self._guard, self._record, self._header, self._buf = guard, record, header, buf
        self._start_payload, self._src, self._queue = start_payload, src, queue
        self._payload: Pending | None = None

    def _post(self) -> None:
        """Wait for the signature, compare it, then post the payload's receive."""
        guard, record = self._guard, self._record
        guard.wait(self._header, record)
        digest, text = decode(self._buf)
        if digest != decode(encode(record.signature()))[0]:
            sent = Record.from_signature(record.group, text)
            raise CollectiveMismatchError(
                f"transfers diverged on {describe_group(record.group)} at step {record.step}, index {record.index}: "
                f"rank {self._src} sent {sent.describe()} (its index {sent.index}, step {sent.step}), rank "
                f"{guard.rank} expected {record.describe()}")
        self._payload = self._start_payload().watched(guard, record)

    def _receive(self) -> torch.Tensor:
        while self._payload is None:  # earlier receives of this link first: gloo matches by order
            head = self._queue.pop(0)
            head._post()
        return self._payload.wait()
