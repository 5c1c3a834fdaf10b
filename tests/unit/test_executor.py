"""Executor on one process: what it keeps alive, its timeline and trace."""
import json

import pytest
import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.dataflow import peak_live
from oases_ds.schedule.generators import ScheduleSpec, build_schedule
from oases_ds.schedule.instructions import Backward, Forward

CFG = ModelConfig(family="gpt", hidden_size=16, num_heads=2, num_layers=4, seq_len=8, vocab_size=32)


def test_recomputing_schedules_hold_fewer_graphs():
    ops = OperatorModel(CFG).ops
    schedules = {name: build_schedule(ScheduleSpec(name), ops) for name in ("none", "megatron_selective", "megatron", "oases")}
    peaks = {name: peak_live(s.instructions, ops, s.sub_batches) for name, s in schedules.items()}
    compute_ops = sum(1 for op in ops if op.kind == "compute")
    assert peaks["none"]["graph"] == compute_ops  # everything kept until backward
    assert peaks["megatron"]["graph"] < peaks["megatron_selective"]["graph"] < peaks["none"]["graph"]
    # Oases holds the graphs of two sub-batches' current segments, still far below no recompute,
    # plus the graphs of its kept tails (embed_out, attn_out, mlp_out), which save no tensor (bytes:
    # tests/unit/test_held_checkpoints.py)
    tails = sum(1 for op in ops if getattr(op, "saves_nothing", False))
    assert tails == 2 * CFG.num_layers + 1  # attn_out, mlp_out per layer; embed_out
    assert peaks["oases"]["graph"] - 2 * tails < peaks["none"]["graph"] // 2


def test_executor_frees_every_buffer_and_records_a_trace(tmp_path):
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    tokens = torch.randint(0, 32, (4, 8))
    loss = ex.run({"tokens": tokens, "labels": tokens})
    assert torch.isfinite(loss) and not ex.buffers  # nothing left alive
    summary = ex.timeline.summary()
    assert 0 < summary["compute_util"] <= 1 and summary["span_s"] > 0
    passes = [summary[f"compute_{p}_s"] for p in ("fwd", "rec", "bwd")]
    assert all(s > 0 for s in passes)  # oases recomputes, so each pass has compute of its own
    assert sum(passes) == pytest.approx(summary["compute_s"])
    path = tmp_path / "trace.json"
    ex.timeline.save_chrome_trace(str(path))
    trace = json.loads(path.read_text())["traceEvents"]
    assert {e["ph"] for e in trace} == {"M", "X"}
    events = [e for e in trace if e["ph"] == "X"]
    assert {e["args"]["sub_batch"] for e in events} == {0, 1}
    assert {"compute", "comm", "wait"} <= {e["args"]["lane"] for e in events}
    n_compute = sum(1 for i in ex.schedule.instructions if type(i).__name__ in ("Forward", "Recompute", "Backward"))
    assert sum(1 for e in events if e["args"]["lane"] == "compute") == n_compute


def test_hook_sees_every_instruction_before_and_after_in_schedule_order():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    calls, outputs_seen = [], []

    def hook(ins, phase):
        calls.append((ins, phase))
        if phase == "after" and type(ins) is Forward:  # its output is there before any free
            outputs_seen.append(("act", ins.op + 1, ins.sub) in ex.buffers)

    remove = ex.add_hook(hook)
    tokens = torch.randint(0, 32, (4, 8))
    ex.run({"tokens": tokens, "labels": tokens})
    expected = [(ins, phase) for ins in ex.schedule.instructions for phase in ("before", "after")]
    assert calls == expected
    assert outputs_seen and all(outputs_seen)
    remove()
    ex.run({"tokens": tokens, "labels": tokens})
    assert len(calls) == len(expected)  # removed: not called again
    remove()  # removing twice is harmless


def test_a_failing_hook_aborts_the_run():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("megatron"))

    def hook(ins, phase):
        if type(ins) is Backward:
            raise RuntimeError("probe failed")

    ex.add_hook(hook)
    tokens = torch.randint(0, 32, (2, 8))
    with pytest.raises(RuntimeError, match="probe failed"):
        ex.run({"tokens": tokens, "labels": tokens})


def test_unread_recomputes_are_the_ops_feeding_a_collective_that_is_not_rerun():
    """Oases' fine-grained recomputation stops before each forward AllReduce, so the op
    feeding it (embedding lookup, attention projection, MLP) is recomputed for its graph
    only.  Megatron re-runs the AllReduces, so it reads those outputs; only each layer's
    last op (whose output, the next layer's input, is a checkpoint already) goes unread."""
    model = OperatorModel(CFG, seed=1)
    oases = Executor.for_schedule(model, ScheduleSpec("oases"))
    names = {model.ops[ins.op].name for ins in oases.unread_recomputes}
    assert names == {"embed"} | {f"L{i}.{op}" for i in range(CFG.num_layers) for op in ("proj", "mlp")}
    assert {ins.sub for ins in oases.unread_recomputes} == {0, 1}
    megatron = Executor.for_schedule(model, ScheduleSpec("megatron")).unread_recomputes
    assert {model.ops[ins.op].name for ins in megatron} == {f"L{i}.mlp_out" for i in range(CFG.num_layers)}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_graph_only_recompute_gives_the_gradients_of_no_recompute(family):
    """Same weights, batch and dropout keys: the fine-grained schedule (row-parallel GEMMs
    skipped in recompute) and ``none`` give the same loss and gradients, to 1e-5 relative
    (fp32; only the order of a few float sums differs)."""
    cfg = ModelConfig(family=family, hidden_size=32, num_heads=4, num_layers=2, seq_len=8, vocab_size=64, dropout=0.1)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    grads, losses = {}, {}
    for name in ("none", "oases"):
        model = OperatorModel(cfg, seed=3)
        losses[name] = Executor.for_schedule(model, ScheduleSpec(name)).run({"tokens": tokens, "labels": tokens})
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.allclose(losses["oases"], losses["none"], rtol=1e-5, atol=0)
    for n, g in grads["none"].items():
        err = (grads["oases"][n] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{n}: rel err {err:.2e}"


def test_graph_only_linear_backpropagates_like_f_linear():
    """``RowParallelLinear.partial(values=False)`` computes no product but its gradients
    equal ``F.linear``'s (fp32, 1e-6 relative: the same GEMMs)."""
    from oases_ds.parallel.layers import RowParallelLinear

    layer = RowParallelLinear(6, 5, None, bias=False)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(2, 3, 6, requires_grad=True)
    grad = torch.randn(2, 3, 5)
    out = layer.partial(x, values=False)
    assert out.shape == (2, 3, 5) and out.untyped_storage().nbytes() <= 4  # a placeholder, no product
    out.backward(grad)
    gx, gw = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    torch.nn.functional.linear(x, layer.weight).backward(grad)
    assert torch.allclose(gx, x.grad, rtol=1e-6, atol=1e-6) and torch.allclose(gw, layer.weight.grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # without a graph to build, the values are computed
        assert torch.equal(layer.partial(x, values=False), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("schedule", ["none", "oases"])
def test_released_output_values_change_no_gradient_and_free_memory(schedule, monkeypatch):
    """The graph buffer's copies of an op's new outputs give up their values after the forward
    (``executor._release_values``): the same loss and gradients, bit for bit, as keeping them,
    and a lower measured peak (under ``none`` every row-parallel product is no longer held from
    its forward to its backward: one ``[b, s, h]`` tensor per block)."""
    from oases_ds.bench.measure import ActivationProbe
    from oases_ds.runtime import executor as executor_module

    cfg = ModelConfig(family="llama", hidden_size=32, num_heads=4, num_layers=2, seq_len=8, vocab_size=64)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    runs = {}
    for release in (True, False):
        if not release:
            monkeypatch.setattr(executor_module, "_release_values", lambda outputs, empties: None)
        model = OperatorModel(cfg, seed=3)
        ex = Executor.for_schedule(model, ScheduleSpec(schedule))
        peak = ActivationProbe(ex, model).run({"tokens": tokens, "labels": tokens})
        runs[release] = (peak, {n: p.grad.clone() for n, p in model.named_parameters()})
    (released, grads), (kept, reference) = runs[True], runs[False]
    assert all(torch.equal(grads[n], g) for n, g in reference.items())
    assert released < kept
    if schedule == "none":
        b, s, h, fp32 = 4, 8, 32, 4
        assert kept - released >= 2 * cfg.num_layers * b * s * h * fp32  # proj's and mlp's products
