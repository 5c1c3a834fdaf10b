"""Bytes each schedule holds per transformer layer between forward and backward.

Measured, not modelled: :class:`~oases_ds.bench.measure.ActivationProbe` counts the
executor's live buffers plus every tensor autograd saved, by storage.  The peak of
a step is ``layers * per_layer + constant`` (head, embedding, one segment's
transient working set), so the difference of the peaks of a 4- and a 2-layer
model, halved, is what one layer holds.  Units: one ``[b, s, h]`` tensor of the
micro-batch (TMP 1, so nothing is sharded).

Expected values, derived by hand from the paper, not from the code under test:

* megatron / split_overlap / oases without fine-grained recomputation: one
  checkpoint per layer, the layer input ``x`` -> 1.
* oases (fine-grained, with or without cross-pass): one checkpoint per block --
  the input of the attention block and the input of the MLP block (the
  attention block's residual output) -> 2.  The ``*_out`` op after each forward
  AllReduce keeps its graph from forward, and that graph saves nothing (bias add,
  regenerable dropout, residual add).
* megatron_selective and none keep most activations: more than 2.
"""
import pytest
import torch

from oases_ds.bench.measure import ActivationProbe
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.random import RNGTracker
from oases_ds.runtime.executor import Executor
from oases_ds.schedule.generators import ScheduleSpec

BATCH, SEQ, HIDDEN = 4, 16, 32
VARIANTS = {
    "megatron": (ScheduleSpec("megatron"), 1.0),
    "split_overlap": (ScheduleSpec("split_overlap"), 1.0),
    "oases-no-fine-grained": (ScheduleSpec("oases", fine_grained_recompute=False), 1.0),
    "oases": (ScheduleSpec("oases"), 2.0),
    "oases-no-cross-pass": (ScheduleSpec("oases", cross_pass=False), 2.0),
}


def peak_bytes(family: str, layers: int, spec: ScheduleSpec) -> int:
    cfg = ModelConfig(family=family, vocab_size=64, hidden_size=HIDDEN, num_heads=4, num_layers=layers,
                      seq_len=SEQ, dropout=0.1)
    model = OperatorModel(cfg, seed=3)
    executor = Executor.for_schedule(model, spec, rng=RNGTracker(seed=5), record=False)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return ActivationProbe(executor, model).run({"tokens": tokens, "labels": tokens})


def per_layer(family: str, spec: ScheduleSpec) -> float:
    unit = BATCH * SEQ * HIDDEN * 4  # one fp32 [b, s, h] tensor
    return (peak_bytes(family, 4, spec) - peak_bytes(family, 2, spec)) / (2 * unit)


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_bytes_per_layer(family, variant):
    spec, expected = VARIANTS[variant]
    assert per_layer(family, spec) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_schedules_keeping_activations_hold_more_than_oases(family):
    oases = per_layer(family, ScheduleSpec("oases"))
    selective = per_layer(family, ScheduleSpec("megatron_selective"))
    assert oases < selective < per_layer(family, ScheduleSpec("none"))
