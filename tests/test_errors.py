"""Bad input gets one clear line naming the field."""
import pytest
import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.ops import CommOp
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.link import LinkModel
from oases_ds.runtime.executor import Executor, split_batch
from oases_ds.schedule.generators import build_schedule


@pytest.mark.parametrize(
    "cfg, tp, field",
    [
        (dict(num_heads=6, hidden_size=48), 4, "model.num_heads=6"),
        (dict(ffn_size=66, hidden_size=32, num_heads=4), 4, "model.ffn_size=66"),
        (dict(vocab_size=30, hidden_size=32, num_heads=4), 4, "model.vocab_size=30"),
    ],
)
def test_tp_degree_must_divide_model(cfg, tp, field):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} does not divide {field}"):
        ModelConfig(**cfg).check_tp(tp)


def test_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="model.num_heads=3 does not divide model.hidden_size=32"):
        ModelConfig(hidden_size=32, num_heads=3)


def test_unknown_family():
    with pytest.raises(ValueError, match="model.family='t5' unknown"):
        ModelConfig(family="t5")


def test_sub_batches_must_divide_micro_batch():
    batch = {"tokens": torch.zeros(3, 4, dtype=torch.long), "labels": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="oases.sub_batches=2 does not divide the micro-batch size 3"):
        split_batch(batch, 2)


def test_executor_reports_sub_batch_error_before_running():
    model = OperatorModel(ModelConfig(hidden_size=16, num_heads=2, num_layers=1, seq_len=4, vocab_size=16))
    ex = Executor(model, build_schedule("oases", model.ops))
    batch = {"tokens": torch.zeros(3, 4, dtype=torch.long), "labels": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="sub_batches=2"):
        ex.run(batch)
    assert all(p.grad is None for p in model.parameters())


def test_link_model_validates():
    with pytest.raises(ValueError, match="link.bandwidth_gbps must be > 0"):
        LinkModel(bandwidth_gbps=0)


@pytest.mark.parametrize(
    "forward, backward, message",
    [
        ("all_gather", None, "L0.x: forward all_gather needs split in the other direction .its gradient., got identity"),
        ("all_reduce", "all_reduce", "L0.x: forward all_reduce needs identity in the other direction .its gradient., "
                                     "got all_reduce"),
        (None, "split", "L0.x: backward split needs all_gather in the other direction .its gradient., got identity"),
        ("broadcast", None, "L0.x: unknown forward collective 'broadcast'; use one of all_reduce, all_gather, split"),
    ],
)
def test_comm_op_directions_must_be_each_others_gradient(forward, backward, message):
    """One autograd Function runs both directions of a CommOp eagerly; a pair that is not
    forward/gradient of each other would silently compute the wrong gradient there."""
    with pytest.raises(ValueError, match=message):
        CommOp("L0.x", 0, "attn", 0, forward, backward, None)


@pytest.mark.parametrize("forward, backward", [("all_reduce", None), (None, "all_reduce"), ("all_gather", "split"),
                                               ("split", "all_gather")])
def test_comm_op_accepts_the_four_region_patterns(forward, backward):
    op = CommOp("L0.x", 0, "attn", 0, forward, backward, None)
    x = torch.arange(4.0)
    assert torch.equal(op.apply(x), x)  # a group of one: every collective is an identity
