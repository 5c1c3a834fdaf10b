"""Chrome trace of a real single-process schedule run: lanes are named, events are named by operator."""
import json

import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.runtime.executor import Executor
from oases_ds.runtime.timeline import LANES, Timeline, op_label
from oases_ds.schedule.generators import ScheduleSpec

CFG = ModelConfig(family="gpt", hidden_size=16, num_heads=2, num_layers=2, seq_len=8, vocab_size=32)


def test_op_label_names_layer_and_block():
    assert op_label("L1.qkv", 1, "attn") == "L1.attn.qkv"
    assert op_label("L0.mlp_reduce", 0, "mlp") == "L0.mlp.mlp_reduce"
    assert op_label("loss", 2, "head") == "head.loss"
    assert op_label("embed", -1, "embed") == "embed"


def test_chrome_trace_has_named_lanes_and_op_named_events(tmp_path):
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    tokens = torch.randint(0, 32, (4, 8))
    ex.run({"tokens": tokens, "labels": tokens})
    path = tmp_path / "t.json"
    ex.timeline.save_chrome_trace(str(path), rank=3)
    trace = json.loads(path.read_text())["traceEvents"]

    meta = [e for e in trace if e["ph"] == "M"]
    assert {(e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"} == {
        (0, "compute"), (1, "comm"), (2, "wait")}
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == ["rank 3"]

    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == len(ex.timeline.events) > 0
    labels = {op_label(op.name, op.layer, op.block) for op in model.ops}
    phases = {"fwd", "rec", "bwd"}
    for e in spans:
        op, phase, sub_batch = e["name"].split(" ")
        assert op in labels and phase in phases and sub_batch == f"sb{e['args']['sub_batch']}", e
        assert e["pid"] == 3 and LANES[e["tid"]] == e["args"]["lane"]
        assert e["args"]["token"] and e["args"]["op"] == op and e["args"]["phase"] == phase
    # the lanes hold what they say: computation of attention GEMMs, collectives of the reduce ops
    names = {LANES[e["tid"]]: set() for e in spans}
    for e in spans:
        names[LANES[e["tid"]]].add(e["name"].split(" ")[0])
    assert "L1.attn.qkv" in names["compute"] and "L1.attn.attn_reduce" in names["comm"]
    assert all(n.endswith(("_reduce", "_copy")) for n in names["comm"] | names["wait"])
    # the schedule token survives in args: the same multiset as the timeline's
    assert sorted(e["args"]["token"] for e in spans) == sorted(ev.name for ev in ex.timeline.events)


def test_event_without_an_op_is_named_by_its_token():
    tl = Timeline()
    tl.add("F3.1", "compute", 1, 0.0, 1.0)
    (span,) = [e for e in tl.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert span["name"] == "F3.1 sb1"


def test_exposed_time_is_split_by_where_the_schedule_waited():
    """Waits on the embedding's and head's collectives apart, the blocks' by pass; compute and
    in-flight communication are not exposure."""
    from oases_ds.runtime.timeline import EXPOSURE_PHASES

    tl = Timeline()
    tl.add("W1.0", "wait", 0, 0.0, 0.5, "L0.attn.attn_reduce", "fwd")
    tl.add("W1.0", "wait", 0, 1.0, 1.25, "L1.mlp.mlp_reduce", "bwd")
    tl.add("W2.0", "wait", 0, 2.0, 2.125, "embed.embed_reduce", "fwd")
    tl.add("W3.0", "wait", 1, 3.0, 3.0625, "head.head_copy", "bwd")
    tl.add("W4.0", "wait", 1, 4.0, 4.5, "L1.attn.attn_reduce", "rec")
    tl.add("F1.0", "compute", 0, 5.0, 9.0, "L0.attn.qkv", "fwd")
    tl.add("C1.0", "comm", 0, 5.0, 9.0, "L0.attn.attn_reduce", "fwd")
    assert tuple(tl.exposed_by_phase()) == EXPOSURE_PHASES
    assert tl.exposed_by_phase() == {"forward": 0.5, "recompute": 0.5, "backward": 0.25, "embedding/head": 0.1875}
    assert sum(tl.exposed_by_phase().values()) == tl.busy("wait")


def test_a_real_run_puts_its_exposure_where_its_waits_are():
    model = OperatorModel(CFG, seed=1)
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    tokens = torch.randint(0, 32, (4, 8))
    ex.run({"tokens": tokens, "labels": tokens})
    by_phase = ex.timeline.exposed_by_phase()
    assert abs(sum(by_phase.values()) - ex.timeline.busy("wait")) < 1e-12 and ex.timeline.busy("wait") > 0
