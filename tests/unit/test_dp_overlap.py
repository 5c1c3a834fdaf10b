"""DPGradReducer on one process (a DP group of one): which Backward releases which
block, and that the accumulation fold reproduces ``accumulated + g / gas`` exactly.
The gloo tests against DeepSpeed are in tests/distributed/test_engine.py."""
import pytest
import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.runtime.dp_overlap import DPGradReducer, block_of
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec

CFG = ModelConfig(family="gpt", hidden_size=16, num_heads=2, num_layers=2, seq_len=8, vocab_size=32)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "labels": tokens}


def test_every_parameter_belongs_to_one_block_released_by_its_last_backward():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    reducer = DPGradReducer(model, ex.schedule, ex.comm, None)
    keys = [b.key for b in reducer.buckets]
    assert sorted(keys) == sorted([(-1, "embed"), (0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp"), (2, "head")])
    assert sum(len(b.params) for b in reducer.buckets) == len(list(model.parameters()))
    position = {ins: i for i, ins in enumerate(ex.schedule.instructions)}
    for b in reducer.buckets:  # no Backward of the block's operators comes after its trigger
        later = [ins for ins in ex.schedule.instructions[position[b.trigger] + 1:]
                 if type(ins).__name__ == "Backward" and (model.ops[ins.op].layer, model.ops[ins.op].block) == b.key]
        assert not later, (b.key, later)
    assert block_of("layers.1.attn_norm.weight", 2) == (1, "attn") and block_of("rope", 2) is None


@pytest.mark.parametrize("schedule, max_in_flight", [("oases", 2), ("megatron", 1), ("none", 6)])
def test_boundary_fold_is_accumulated_plus_scaled_micro_batch_gradient(schedule, max_in_flight):
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec(schedule))
    ex.run(_batch(0))
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ex.run(_batch(1))
    micro = [p.grad.clone() for p in model.parameters()]
    # the engine's boundary step: stash the accumulated gradient, run, fold with 1/gas
    reducer = DPGradReducer(model, ex.schedule, ex.comm, None, max_in_flight)
    ex.add_hook(reducer)
    stash = [a.clone() for a in accumulated]
    for p in model.parameters():
        p.grad = None
    reducer.arm(list(zip(model.parameters(), stash)), 0.5)
    ex.run(_batch(1))
    reducer.finish()
    for p, a, g, s in zip(model.parameters(), accumulated, micro, stash):
        assert p.grad is s  # folded into the accumulated buffer: no second gradient-sized tensor kept
        torch.testing.assert_close(p.grad, a + 0.5 * g, rtol=0, atol=0)
    assert not reducer.armed and reducer.log and any(e.startswith("dp:") for e in reducer.log)


def test_finish_without_arm_is_one_line():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    with pytest.raises(RuntimeError, match=r"^DPGradReducer.finish without arm: no boundary micro-batch ran$"):
        DPGradReducer(model, ex.schedule, ex.comm, None).finish()


def test_max_in_flight_below_one_is_one_line():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    with pytest.raises(ValueError, match=r"^max_in_flight must be >= 1 \(buckets reducing at once\), got 0$"):
        DPGradReducer(model, ex.schedule, ex.comm, None, max_in_flight=0)


def test_a_failed_run_is_abandoned_and_the_next_boundary_reduces_normally():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    reducer = DPGradReducer(model, ex.schedule, ex.comm, None)
    ex.add_hook(reducer)
    reducer.arm([(p, None) for p in model.parameters()], 1.0)
    bad = {k: v[:3] for k, v in _batch(0).items()}  # 3 samples do not split into 2 sub-batches
    with pytest.raises(ValueError, match="does not divide the micro-batch size 3"):
        ex.run(bad)
    reducer.abandon()  # what OasesEngine does when the run raises
    assert not reducer.armed
    ex.run(_batch(0))  # a disarmed reducer stays out of the way
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    reducer.arm([(p, None) for p in model.parameters()], 1.0)
    ex.run(_batch(0))
    reducer.finish()
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


def test_a_replica_group_for_the_full_degree_is_refused_in_one_line():
    from oases_ds.parallel.context import ParallelContext
    from oases_ds.parallel.topology import Topology

    ctx = ParallelContext.for_rank(Topology(8, 4), 0, new_group=lambda ranks, **kw: tuple(ranks))
    assert ctx.replica_dp_group(2) == (0, 2, 4, 6)
    with pytest.raises(ValueError, match=r"^no replica group for TMP degree 4; it must be in \[1, 2\]$"):
        ctx.replica_dp_group(4)


class _ScriptedClock:
    """Marks are counters, resolved to a quarter second each only when asked: shows which
    clock the reducer times its wait with, and that it reads the clock lazily."""

    def __init__(self) -> None:
        self.marks = 0
        self.resolved: list[list[int]] = []

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def resolve(self, marks: list[int]) -> list[float]:
        self.resolved.append(list(marks))
        return [0.25 * m for m in marks]


def test_the_wait_is_timed_by_the_clock_of_the_parameters_device(monkeypatch):
    import oases_ds.runtime.dp_overlap as dp_overlap
    from oases_ds.runtime.timeline import HostClock

    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"), record=False)
    assert isinstance(DPGradReducer(model, ex.schedule, ex.comm, None).clock, HostClock)  # CPU parameters
    asked, clock = [], _ScriptedClock()
    monkeypatch.setattr(dp_overlap, "clock_for", lambda device: asked.append(torch.device(device)) or clock)
    reducer = DPGradReducer(model, ex.schedule, ex.comm, None)
    assert asked == [torch.device("cpu")] and reducer.clock is clock
    ex.add_hook(reducer)
    reducer.arm([(p, None) for p in model.parameters()], 1.0)
    ex.run(_batch(0))
    assert clock.marks == 0  # only finish() waits
    reducer.finish()
    assert clock.marks == 2 and clock.resolved == []  # a mark before and after the wait, not read yet
    assert reducer.wait_s == 0.25 and clock.resolved == [[1, 2]]  # read once, on demand
    assert reducer.wait_s == 0.25 and len(clock.resolved) == 1
    reducer.arm([(p, None) for p in model.parameters()], 1.0)
    assert reducer.wait_s == 0.0  # a new window forgets the last one's wait

