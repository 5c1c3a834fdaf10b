"""A training step never waits for the device: no Tensor -> Python conversion in the hot path.

The guard (``support.forbid_host_sync``) makes ``item``, ``int()``, ``float()``, ``bool()``
and ``tolist`` raise; the executor runs a whole micro-batch under it.  The engine's hot
path, with real gloo ranks, is in ``distributed/test_engine.py``.
"""
import pytest
import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import IGNORE_INDEX, OperatorModel, check_labelled_tokens
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.timeline import CudaClock, HostClock, Timeline, clock_for
from oases_ds.schedule.generators import ScheduleSpec
from support import HostSyncError, forbid_host_sync

CFG = ModelConfig(family="gpt", hidden_size=16, num_heads=2, num_layers=2, seq_len=8, vocab_size=32)


def test_the_guard_catches_every_conversion_and_restores_them():
    t = torch.tensor(3.0)
    for convert in (int, float, bool, lambda x: x.item(), lambda x: x.tolist()):
        with forbid_host_sync(), pytest.raises(HostSyncError):
            convert(t)
    assert int(t) == 3 and bool(t) and t.item() == 3.0 and t.tolist() == 3.0  # restored after the block


@pytest.mark.parametrize("schedule", ["oases", "megatron", "none"])
def test_executor_run_has_no_host_sync(schedule):
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec(schedule))
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = tokens.masked_fill(torch.arange(8) % 3 == 0, IGNORE_INDEX)  # the mean must count labelled tokens only
    with forbid_host_sync():
        loss = ex.run({"tokens": tokens, "labels": labels})
    assert torch.isfinite(loss) and loss.dim() == 0
    assert all(p.grad is not None for p in model.parameters())
    assert ex.timeline.busy("compute") > 0  # still recorded, and readable after the run


def test_forward_has_no_host_sync_and_matches_the_executor():
    cfg = ModelConfig(family="llama", hidden_size=16, num_heads=2, num_layers=1, seq_len=8, vocab_size=32, dropout=0.0)
    model = OperatorModel(cfg, seed=3)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = tokens.masked_fill(torch.arange(8) < 2, IGNORE_INDEX)
    with forbid_host_sync():
        eager = model({"tokens": tokens, "labels": labels})
        scheduled = Executor.for_schedule(model, ScheduleSpec("oases")).run({"tokens": tokens, "labels": labels})
    torch.testing.assert_close(scheduled, eager.detach(), rtol=1e-6, atol=1e-6)


def test_a_micro_batch_without_labelled_tokens_is_named():
    ok = {"labels": torch.tensor([[1, IGNORE_INDEX]])}
    empty = {"labels": torch.full((1, 2), IGNORE_INDEX)}
    check_labelled_tokens([ok, ok])
    with pytest.raises(ValueError, match=r"^micro-batch 1 of this step has no labelled tokens .*-100"):
        check_labelled_tokens([ok, empty, empty])


def test_clock_follows_the_device():
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for("cuda:0"), CudaClock)  # chosen by device type; building it needs no GPU


class CountingClock:
    """Marks are integers; resolving doubles them and counts the calls."""

    def __init__(self) -> None:
        self.next, self.resolves = 0, 0

    def mark(self) -> int:
        self.next += 1
        return self.next

    def resolve(self, marks):
        self.resolves += 1
        return [2.0 * m for m in marks]


def test_timeline_reads_its_clock_once_and_only_when_read():
    clock = CountingClock()
    tl = Timeline(clock)
    for lane in ("compute", "wait", "compute"):
        tl.add("F0.0", lane, 0, clock.mark(), clock.mark())
    assert clock.resolves == 0  # recording never reads the clock: on CUDA that read waits for the device
    assert [(e.start, e.end) for e in tl.events] == [(2.0, 4.0), (6.0, 8.0), (10.0, 12.0)]
    assert tl.busy("compute") == 4.0 and tl.span == 10.0
    assert clock.resolves == 1
    tl.add("B0.0", "compute", 0, clock.mark(), clock.mark())
    assert tl.busy("compute") == 6.0 and clock.resolves == 2  # only the new marks
