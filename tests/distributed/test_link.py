"""Link emulation: ring-collective byte counts, link sharing, and (with processes)
that a handle never completes before its link deadline.  Only lower bounds on
time are asserted -- those hold on a loaded machine too."""
import pytest

import dist_workers  # noqa: F401  (tests dir on sys.path for the rank processes)
from oases_ds.launcher import launch
from oases_ds.parallel.comm import Communicator
from oases_ds.parallel.link import LinkEmulator, LinkModel


def test_ring_volumes():
    link = LinkModel(bandwidth_gbps=8.0, latency_us=0.0)  # 1 GB/s
    assert link.wire_bytes("all_reduce", 1000, 4) == pytest.approx(1500)  # 2 (n-1)/n
    assert link.wire_bytes("all_gather", 1000, 4) == pytest.approx(750)  # (n-1)/n
    assert link.seconds("all_reduce", 10**9, 2) == pytest.approx(1.0)
    assert link.seconds("all_reduce", 10**9, 1) == 0.0


def test_messages_share_the_link():
    link = LinkModel(bandwidth_gbps=8.0, latency_us=100.0)
    emulator = LinkEmulator(link)
    seconds = link.seconds("all_reduce", 10**6, 2)
    first = emulator.reserve(seconds, now=0.0)
    second = emulator.reserve(seconds, now=0.0)  # issued together: waits for the first
    assert first == pytest.approx(1e-4 + 1e-3)
    assert second == pytest.approx(2 * first)
    late = emulator.reserve(seconds, now=10.0)  # link idle again
    assert late == pytest.approx(10.0 + first)


def link_worker() -> dict:
    import time

    import torch

    from oases_ds.parallel.context import ParallelContext

    ctx = ParallelContext.build(tensor_parallel_size=2, timeout_s=60)
    link = LinkModel(bandwidth_gbps=0.08, latency_us=0.0)  # 10 MB/s
    comm = Communicator(link)
    x = torch.full((25_000,), float(ctx.rank + 1))  # 100 kB -> 2*(1/2)*100kB / 10MB/s = 10 ms
    torch.distributed.barrier()
    if ctx.rank == 1:
        time.sleep(0.05)  # rank 1 issues 50 ms late: the transfer cannot start before that
    t0 = time.perf_counter()
    result = comm.all_reduce(x, ctx.tp_group, "forward").wait()
    done = time.perf_counter()
    return {"elapsed": done - t0, "issued": t0, "done": done, "expected": link.seconds("all_reduce", 100_000, 2),
            "value": float(result[0])}


@pytest.mark.distributed
def test_emulated_collective_completes_no_earlier_than_the_link_allows():
    early, late = launch(link_worker, 2, timeout_s=120)
    for r in (early, late):
        assert r["value"] == 3.0  # the real collective ran and its result is used
        assert r["elapsed"] >= r["expected"] * 0.999
    # The early rank's handle completes no earlier than the late rank's issue plus the
    # transfer (perf_counter is one clock for all processes of this machine).
    assert early["done"] >= late["issued"] + early["expected"] * 0.999


def _issued(emulator, seconds, start, steps=1):
    """A message as the emulator sees it once every rank has issued it."""
    import torch

    from oases_ds.parallel.link import _LinkMessage

    class Done:
        def wait(self):
            return None

    m = _LinkMessage(seconds, torch.tensor([start], dtype=torch.float64), Done(), steps)
    emulator._unresolved.append(m)
    return m


def test_fair_sharing_splits_the_link_between_messages_in_flight():
    emulator = LinkEmulator(LinkModel(bandwidth_gbps=8.0, sharing="fair"))
    a, b = _issued(emulator, 1.0, 0.0), _issued(emulator, 1.0, 0.0)
    assert emulator.deadline(a) == pytest.approx(2.0)  # both crossed at half rate
    assert b.deadline == pytest.approx(2.0)
    c, d = _issued(emulator, 1.0, 10.0), _issued(emulator, 0.5, 10.25)
    assert emulator.deadline(c) == pytest.approx(11.5)  # alone 0.25 s, then shares until d is done at 11.25
    assert d.deadline == pytest.approx(11.25)
    fifo = LinkEmulator(LinkModel(bandwidth_gbps=8.0))
    e, f = _issued(fifo, 1.0, 0.0), _issued(fifo, 1.0, 0.0)
    assert fifo.deadline(e) == pytest.approx(1.0) and fifo.deadline(f) == pytest.approx(2.0)


def test_ring_sharing_interleaves_collectives_step_by_step():
    """Two concurrent AllReduces on 2 ranks (2 ring steps each) finish at 1.5x and 2x one's
    time -- the shaped-veth measurement that neither fifo (1x, 2x) nor fair (2x, 2x) gives."""
    link = LinkModel(bandwidth_gbps=8.0, sharing="ring")
    assert link.ring_steps("all_reduce", 2) == 2 and link.ring_steps("all_reduce", 4) == 6
    assert link.ring_steps("all_gather", 4) == 3
    emulator = LinkEmulator(link)
    a, b = _issued(emulator, 1.0, 0.0, steps=2), _issued(emulator, 1.0, 0.0, steps=2)
    assert emulator.deadline(b) == pytest.approx(2.0) and a.deadline == pytest.approx(1.5)
    # a later collective joins between the steps of one already on the link
    c, d = _issued(emulator, 1.0, 10.0, steps=2), _issued(emulator, 0.5, 10.25, steps=2)
    assert emulator.deadline(c) == pytest.approx(11.25)  # c1 10-10.5, d1 10.5-10.75, c2 10.75-11.25
    assert emulator.deadline(d) == pytest.approx(11.5)
    # latency is paid once, by the first step
    lat = LinkEmulator(LinkModel(bandwidth_gbps=8.0, latency_us=100_000, sharing="ring"))
    e = _issued(lat, 1.1, 0.0, steps=2)
    assert lat.deadline(e) == pytest.approx(1.1)


def test_a_settled_deadline_waits_for_no_later_collective():
    """Once a simulation has settled a message, waiting for it must not block on the issue-time
    exchange of collectives issued after it (peers may not have issued those yet)."""
    import torch

    from oases_ds.parallel.link import _LinkMessage

    class Unissued:
        def wait(self):
            raise AssertionError("blocked on a later collective's issue-time exchange")

    for sharing in ("fair", "ring"):
        emulator = LinkEmulator(LinkModel(bandwidth_gbps=8.0, sharing=sharing))
        a, b = _issued(emulator, 1.0, 0.0, steps=2), _issued(emulator, 1.0, 0.0, steps=2)
        emulator.deadline(b)  # settles a as well
        emulator._unresolved.append(_LinkMessage(1.0, torch.tensor([5.0], dtype=torch.float64), Unissued(), 2))
        assert emulator.deadline(a) == a.deadline


def test_p2p_messages_of_one_direction_cross_its_link_one_after_the_other():
    """The stage-boundary link: each direction FIFO from the *sender's* issue time, whatever
    order the waits come in; another direction is another link."""
    import torch

    from oases_ds.parallel.link import P2PEmulator, _P2PMessage

    link = LinkModel(bandwidth_gbps=8.0, latency_us=100_000)  # 1 GB/s, 0.1 s latency
    assert link.wire_bytes("p2p", 1000, 2) == 1000 and link.ring_steps("p2p", 2) == 1
    emulator = P2PEmulator(link)

    def message(direction, sent_at, nbytes):
        m = _P2PMessage(link.seconds("p2p", nbytes, 2), torch.tensor([sent_at], dtype=torch.float64), None)
        emulator._queued.setdefault(direction, []).append(m)
        return m

    a, b = message((0, 1), 0.0, 10**9), message((0, 1), 0.5, 10**9)
    back = message((1, 0), 0.0, 10**9)
    assert emulator.arrival((0, 1), b) == pytest.approx(2.2)  # waits behind a (0 -> 1.1), then 1.1 s
    assert a.arrival == pytest.approx(1.1)
    assert emulator.arrival((1, 0), back) == pytest.approx(1.1)  # the other direction was idle
    late = message((0, 1), 10.0, 10**9)
    assert emulator.arrival((0, 1), late) == pytest.approx(11.1)


@pytest.mark.distributed
def test_pipeline_messages_are_held_to_the_emulated_link_without_changing_results():
    """PP 2 x TMP 1, 1F1B with the Oases schedule inside, 4 micro-batches: on a link slow
    enough that a step's activations need ~0.5 s to cross it, each stage's step lasts at
    least (bytes it received per step) / bandwidth (5% slack for the barrier's skew between
    the stages' clocks starts), while the same run without a link is faster than that;
    losses and trained parameters are bit-identical (the emulator only delays)."""
    import torch

    import pipeline_workers

    bandwidth_gbps = 0.001
    per_rank = launch(pipeline_workers.pipeline_link_worker, 2, (bandwidth_gbps, 2, 4, 4), timeout_s=300)
    for res in per_rank:
        bound = res["link"]["recv_bytes"] * 8 / (bandwidth_gbps * 1e9)
        assert bound > 0.4, f"stage {res['stage']}: the test's link is too fast to tell ({bound:.3f} s)"
        assert min(res["link"]["times"]) >= 0.95 * bound, (res["stage"], res["link"]["times"], bound)
        assert max(res["plain"]["times"]) < bound, (res["stage"], res["plain"]["times"], bound)
        assert res["link"]["losses"] == res["plain"]["losses"]
        for name, value in res["plain"]["params"].items():
            assert torch.equal(value, res["link"]["params"][name]), name
