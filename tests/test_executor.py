"""Executor on one process: what it keeps alive, its timeline and trace."""
import json

import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.dataflow import peak_live
from oases_ds.schedule.generators import build_schedule

CFG = ModelConfig(family="gpt", hidden_size=16, num_heads=2, num_layers=4, seq_len=8, vocab_size=32)


def test_recomputing_schedules_hold_fewer_graphs():
    ops = OperatorModel(CFG).ops
    peaks = {name: peak_live(build_schedule(name, ops).instructions, ops, build_schedule(name, ops).sub_batches)
             for name in ("none", "megatron_selective", "megatron", "oases")}
    compute_ops = sum(1 for op in ops if op.kind == "compute")
    assert peaks["none"]["graph"] == compute_ops  # everything kept until backward
    assert peaks["megatron"]["graph"] < peaks["megatron_selective"]["graph"] < peaks["none"]["graph"]
    # Oases holds the graphs of two sub-batches' current segments, still far below no recompute
    assert peaks["oases"]["graph"] < peaks["none"]["graph"] // 2


def test_executor_frees_every_buffer_and_records_a_trace(tmp_path):
    model = OperatorModel(CFG, seed=1)
    ex = Executor(model, build_schedule("oases", model.ops))
    tokens = torch.randint(0, 32, (4, 8))
    loss = ex.run({"tokens": tokens, "labels": tokens})
    assert torch.isfinite(loss) and not ex._buffers  # nothing left alive
    summary = ex.timeline.summary()
    assert 0 < summary["compute_util"] <= 1 and summary["span_s"] > 0
    path = tmp_path / "trace.json"
    ex.timeline.save_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["ph"] for e in events} == {"X"}
    assert {e["args"]["sub_batch"] for e in events} == {0, 1}
    assert {"compute", "comm", "wait"} <= {e["args"]["lane"] for e in events}
    n_compute = sum(1 for i in ex.schedule.instructions if type(i).__name__ in ("Forward", "Recompute", "Backward"))
    assert sum(1 for e in events if e["args"]["lane"] == "compute") == n_compute
