"""Bad input gets one clear line naming the field."""
import dataclasses

import pytest
import torch

from oases_ds.models.config import ModelConfig
from oases_ds.models.ops import CommOp
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.link import LinkModel
from oases_ds.runtime.executor import Executor, split_batch
from oases_ds.schedule.generators import ScheduleSpec


@pytest.mark.parametrize(
    "cfg, tp, field",
    [
        (dict(num_heads=6, hidden_size=48), 4, "model.num_heads=6"),
        (dict(ffn_size=66, hidden_size=32, num_heads=4), 4, "model.ffn_size=66"),
        (dict(num_kv_heads=6, hidden_size=48, num_heads=12), 4, "model.num_kv_heads=6"),
    ],
)
def test_tp_degree_must_divide_model(cfg, tp, field):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} does not divide {field}"):
        ModelConfig(**cfg).check_tp(tp)


def test_every_degree_a_plan_uses_is_checked_by_what_its_block_splits():
    """A plan's blocks are checked one by one, each by what it splits (attention: query and k/v
    heads; MLP: the FFN width), and the line names the block.  Before, every block was checked
    as a whole model at its degree, so an attention block at 4 was refused for an FFN width 4
    does not divide, and the line blamed tensor_parallel_size."""
    six_heads = ModelConfig(hidden_size=48, num_heads=6, ffn_size=128)
    six_heads.check_degrees(4, [2, 2], [4, 4])  # attention at 2 (6 heads), MLP at 4 (128 wide): fine
    with pytest.raises(ValueError, match=r"^plan: layer 1's attention block at TMP degree 4 does not divide "
                                         r"model.num_heads=6; plan that block at another degree or change model.num_heads$"):
        six_heads.check_degrees(4, [2, 4], [4, 4])
    narrow = ModelConfig(hidden_size=64, num_heads=4, ffn_size=130)
    narrow.check_degrees(4, [4, 4], [2, 2])  # the attention blocks at 4 need nothing of the FFN
    with pytest.raises(ValueError, match=r"^plan: layer 0's MLP block at TMP degree 4 does not divide model.ffn_size=130;"):
        narrow.check_degrees(4, [4, 4], [4, 2])
    gqa = ModelConfig(family="llama", hidden_size=96, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"layer 0's attention block at TMP degree 2 does not divide model.num_kv_heads=3"):
        gqa.check_degrees(4, [2, 1], [4, 4])
    with pytest.raises(ValueError, match=r"layer 1's attention block at TMP degree 4 is neither a divisor nor a multiple "
                                         r"of model.num_kv_heads=3 \(k/v heads are split over the ranks or replicated\)"):
        gqa.check_degrees(4, [1, 4], [4, 4])
    ModelConfig(family="gpt", vocab_size=61).check_degrees(4)  # the vocabulary is padded: any degree shards it


def test_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="model.num_heads=3 does not divide model.hidden_size=32"):
        ModelConfig(hidden_size=32, num_heads=3)


# One value outside its range for every numeric field of ModelConfig, with the line it gets.  The
# zero head counts failed as a ZeroDivisionError in ``num_heads % kv_heads`` before the range checks
# ran; a negative ffn_size or rope factor was accepted and failed later, inside a layer.
OUT_OF_RANGE = {
    "vocab_size": (0, "model.vocab_size must be >= 1, got 0"),
    "hidden_size": (0, "model.hidden_size must be >= 1, got 0"),
    "num_heads": (0, "model.num_heads must be >= 1, got 0"),
    "num_layers": (0, "model.num_layers must be >= 1, got 0"),
    "ffn_size": (-4, "model.ffn_size must be >= 0 (0: 4 x hidden_size), got -4"),
    "seq_len": (-1, "model.seq_len must be >= 1, got -1"),
    "dropout": (1.0, "model.dropout must be in [0, 1), got 1.0"),
    "norm_eps": (float("nan"), "model.norm_eps must be > 0, got nan"),
    "num_kv_heads": (-2, "model.num_kv_heads must be >= 0 (0: num_heads), got -2"),
    "rope_theta": (0.0, "model.rope_theta must be > 0, got 0.0"),
    "rope_factor": (-1.0, "model.rope_factor must be > 0, got -1.0"),
    "rope_low_freq_factor": (0.0, "model.rope_low_freq_factor must be > 0, got 0.0"),
    "rope_high_freq_factor": (-4.0, "model.rope_high_freq_factor must be > 0, got -4.0"),
    "rope_original_max_positions": (0, "model.rope_original_max_positions must be >= 1, got 0"),
    "type_vocab_size": (-1, "model.type_vocab_size must be >= 0 (0: no token types), got -1"),
    "sliding_window": (0, "model.sliding_window must be >= 1 (null: no window), got 0"),
    "full_attention_layers": (-1, "model.full_attention_layers must be >= 0, got -1"),
    "pad_token_id": (-1, "model.pad_token_id=-1 is not a token of model.vocab_size=256; give an id below it, "
                         "or null for no padding token"),
}


def test_every_numeric_model_field_has_a_range_case():
    """A new numeric field of ModelConfig needs its range checked, and a case above."""
    numeric = [f.name for f in dataclasses.fields(ModelConfig) if f.type.split(" |")[0] in ("int", "float")]
    assert sorted(numeric) == sorted(OUT_OF_RANGE)


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_model_field_is_range_checked_by_name(name, family):
    value, line = OUT_OF_RANGE[name]
    with pytest.raises(ValueError) as exc:
        ModelConfig(family=family, **{name: value})
    assert str(exc.value) == line


@pytest.mark.parametrize("fields, line", [
    (dict(num_heads=0, num_kv_heads=2), "model.num_heads must be >= 1, got 0"),
    (dict(num_heads=0, hidden_size=0), "model.hidden_size must be >= 1, got 0"),
    (dict(family="llama", num_heads=0, norm_eps=-1.0), "model.num_heads must be >= 1, got 0"),
    (dict(num_heads=0, pad_token_id=300), "model.num_heads must be >= 1, got 0"),
])
def test_ranges_are_checked_before_any_arithmetic_or_relation(fields, line):
    """The first field out of range is named, whatever else is wrong, and never as a ZeroDivisionError."""
    with pytest.raises(ValueError) as exc:
        ModelConfig(**fields)
    assert str(exc.value) == line


def test_unknown_family():
    with pytest.raises(ValueError, match="model.family='t5' unknown"):
        ModelConfig(family="t5")


def test_sub_batches_must_divide_micro_batch():
    batch = {"tokens": torch.zeros(3, 4, dtype=torch.long), "labels": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="oases.sub_batches=2 does not divide the micro-batch size 3"):
        split_batch(batch, 2)


def test_executor_reports_sub_batch_error_before_running():
    model = OperatorModel(ModelConfig(hidden_size=16, num_heads=2, num_layers=1, seq_len=4, vocab_size=16))
    ex = Executor.for_schedule(model, ScheduleSpec("oases"))
    batch = {"tokens": torch.zeros(3, 4, dtype=torch.long), "labels": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="sub_batches=2"):
        ex.run(batch)
    assert all(p.grad is None for p in model.parameters())


def test_link_model_validates():
    with pytest.raises(ValueError, match="link.bandwidth_gbps must be a finite number > 0"):
        LinkModel(bandwidth_gbps=0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("enabled", "yes", "Input should be a valid boolean"),
        ("enabled", 1, "Input should be a valid boolean"),
        ("enabled", "off", "Input should be a valid boolean"),
        ("sub_batches", True, "Input should be a valid integer"),
        ("tensor_parallel_size", "1", "Input should be a valid integer"),
        ("tensor_parallel_size", 2.0, "Input should be a valid integer"),
        ("record_timeline", "no", "Input should be a valid boolean"),
        ("process_group_timeout_s", "300", "Input should be a valid number"),
        ("link", {"bandwidth_gbps": "10"}, "Input should be a valid number"),
    ],
)
def test_oases_section_types_are_strict(field, value, message):
    """JSON from templates carries "yes"/1/"off"; pydantic's lax mode would turn "off" into True."""
    from oases_ds.config import OasesConfigError, parse_oases_section

    with pytest.raises(OasesConfigError) as err:
        parse_oases_section({"enabled": True, field: value})
    inner = value["bandwidth_gbps"] if isinstance(value, dict) else value
    path = f"{field}.bandwidth_gbps" if isinstance(value, dict) else field
    assert str(err.value) == f"oases.{path}: {message} (got {inner!r})"


def test_oases_section_accepts_an_int_for_a_float():
    from oases_ds.config import parse_oases_section

    cfg = parse_oases_section({"enabled": True, "process_group_timeout_s": 30, "link": {"bandwidth_gbps": 10}})
    assert cfg.process_group_timeout_s == 30.0 and cfg.link is not None and cfg.link.bandwidth_gbps == 10.0


@pytest.mark.parametrize(
    "config, dp, expected",
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 0}, None,
         "gradient_accumulation_steps: must be an integer >= 1 (got 0)"),
        ({"train_micro_batch_size_per_gpu": 0}, None, "train_micro_batch_size_per_gpu: must be an integer >= 1 (got 0)"),
        ({"train_micro_batch_size_per_gpu": "4"}, None, "train_micro_batch_size_per_gpu: must be an integer >= 1 (got '4')"),
        ({"train_batch_size": -8}, None, "train_batch_size: must be an integer >= 1 (got -8)"),
        ({"gradient_accumulation_steps": 2}, None, "train_micro_batch_size_per_gpu: missing; set it (or train_batch_size)"),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, 1,
         "train_batch_size=8 but train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks = "
         "4 x 1 x 1 = 4; set it to 4 or drop it"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, 1,  # DeepSpeed would derive 0 accumulation steps
         "train_batch_size=2 is not a multiple of train_micro_batch_size_per_gpu=4 x 1 data-parallel rank(s); "
         "set train_micro_batch_size_per_gpu and gradient_accumulation_steps instead"),
        ({"train_batch_size": 1}, 2,  # DeepSpeed would derive a micro-batch of 0
         "train_batch_size=1 is not a multiple of 2 data-parallel rank(s); "
         "set train_micro_batch_size_per_gpu and gradient_accumulation_steps instead"),
    ],
)
def test_deepspeed_batch_keys_are_one_line_errors(config, dp, expected):
    """DeepSpeedConfig checks these with bare asserts that name no key."""
    from oases_ds.config import OasesConfigError, check_batch_section

    with pytest.raises(OasesConfigError) as err:
        check_batch_section(config, dp)
    assert str(err.value) == expected


@pytest.mark.parametrize("config, dp", [
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 2),
    ({"train_batch_size": 8}, 2),
])
def test_consistent_batch_keys_pass(config, dp):
    from oases_ds.config import check_batch_section

    check_batch_section(config, dp)


@pytest.mark.parametrize("enabled", [True, False])
def test_initialize_names_gradient_accumulation_steps_before_deepspeed_asserts(enabled):
    """Raised before any process group exists, on both the Oases and the plain DeepSpeed path."""
    import oases_ds
    from oases_ds.config import OasesConfigError

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 0, "oases": {"enabled": enabled}}
    with pytest.raises(OasesConfigError, match=r"^gradient_accumulation_steps: must be an integer >= 1 \(got 0\)$"):
        oases_ds.initialize(model=ModelConfig(hidden_size=16, num_heads=2, num_layers=1, seq_len=4, vocab_size=16), config=cfg)


def test_slow_link_message_names_both_times_and_the_fix():
    from oases_ds.config import Collective, slow_link_message

    link = LinkModel(bandwidth_gbps=1e-6)
    # one sub-batch's [2, 8, 32] fp32 activations over 2 ranks: 2 KiB on the wire -> 16.4 s at 1 kbit/s
    collectives = [Collective("TMP activation AllReduce", "all_reduce", 2 * 8 * 32 * 4, 2),
                   Collective("DP gradient AllReduce", "all_reduce", 64, 2)]
    msg = slow_link_message(link, 10.0, collectives)
    assert msg == ("oases.link: the TMP activation AllReduce (0.00195 MiB over 2 ranks) needs 16.4 s at "
                   "oases.link.bandwidth_gbps=1e-06, longer than oases.process_group_timeout_s=10: ranks waiting on it "
                   "would time out; raise oases.process_group_timeout_s above 17 or oases.link.bandwidth_gbps")
    assert slow_link_message(link, 10.0, collectives, bandwidth_key="cluster.link.bandwidth_gbps",
                             timeout_key="timeout_s").startswith("cluster.link: the TMP activation AllReduce")
    assert slow_link_message(link, 20.0, collectives) is None  # fits
    assert slow_link_message(link, 10.0, [Collective("DP gradient AllReduce", "all_reduce", 4096, 1)]) is None


def test_the_activation_all_reduce_is_one_sub_batch_of_hidden_states():
    from oases_ds.config import Collective, activation_all_reduce

    cfg = ModelConfig(hidden_size=32, seq_len=8)
    assert activation_all_reduce(cfg, 4, 2, 2, 4) == Collective("TMP activation AllReduce", "all_reduce", 2 * 8 * 32 * 4, 2)
    assert activation_all_reduce(cfg, 1, 2, 4, 2).nbytes == 8 * 32 * 2  # a micro-batch smaller than the split: one row


@pytest.mark.parametrize(
    "forward, backward, message",
    [
        ("all_gather", None, "L0.x: forward all_gather needs split or reduce_scatter in the other direction .its "
                             "gradient., got identity"),
        ("reduce_scatter", "split", "L0.x: forward reduce_scatter needs all_gather in the other direction .its "
                                    "gradient., got split"),
        ("all_reduce", "all_reduce", "L0.x: forward all_reduce needs identity in the other direction .its gradient., "
                                     "got all_reduce"),
        (None, "split", "L0.x: backward split needs all_gather in the other direction .its gradient., got identity"),
        ("broadcast", None, "L0.x: unknown forward collective 'broadcast'; use one of all_reduce, all_gather, "
                            "reduce_scatter, split"),
    ],
)
def test_comm_op_directions_must_be_each_others_gradient(forward, backward, message):
    """One autograd Function runs both directions of a CommOp eagerly; a pair that is not
    forward/gradient of each other would silently compute the wrong gradient there."""
    with pytest.raises(ValueError, match=message):
        CommOp("L0.x", 0, "attn", 0, forward, backward, None)


@pytest.mark.parametrize("forward, backward", [("all_reduce", None), (None, "all_reduce"), ("all_gather", "split"),
                                               ("split", "all_gather"), ("all_gather", "reduce_scatter"),
                                               ("reduce_scatter", "all_gather")])
def test_comm_op_accepts_the_six_region_patterns(forward, backward):
    op = CommOp("L0.x", 0, "attn", 0, forward, backward, None)
    x = torch.arange(4.0)
    assert torch.equal(op.apply(x), x)  # a group of one: every collective is an identity



@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "nan", "1e400", "1e400GiB"])
def test_a_size_that_is_nan_or_infinite_is_one_line_naming_the_field(bad):
    """``memory_limit=nan`` ended in a Hydra ``IndexError`` traceback and ``memory_limit=1e400``
    was read as infinity (no limit) and trained; both are typos, refused by name."""
    from oases_ds.cli.schema import parse_bytes

    with pytest.raises(ValueError, match=r"^memory_limit( must be a finite size > 0|=.* is not a size)"):
        parse_bytes("memory_limit", bad)
    assert parse_bytes("memory_limit", "2GiB") == 2 * 2**30


@pytest.mark.parametrize("key, value", [("lr", float("nan")), ("timeout_s", float("inf")), ("steps", float("nan")),
                                        ("warmup_steps", float("inf"))])
def test_range_checks_refuse_nan_and_infinity(key, value):
    """``nan < 1`` is False, so a bare lower-bound check let nan through."""
    from oases_ds.cli.schema import check_ranges

    cfg = {"lr": 0.1, "timeout_s": 10.0, "steps": 3, "warmup_steps": 0, key: value}
    with pytest.raises(ValueError, match=rf"^{key} must be "):
        check_ranges(cfg, {"steps": 1, "warmup_steps": 0}, positive=("lr", "timeout_s"))


@pytest.mark.parametrize("field, value", [("bandwidth_gbps", float("nan")), ("bandwidth_gbps", float("inf")),
                                          ("latency_us", float("nan")), ("latency_us", float("inf"))])
def test_a_link_of_nan_or_infinite_speed_is_refused_by_name(field, value):
    from oases_ds.config import parse_oases_section

    kwargs = {"bandwidth_gbps": 1.0, field: value}
    with pytest.raises(ValueError, match=rf"link.{field}"):
        LinkModel(**kwargs)
    with pytest.raises(ValueError, match=rf"^oases.link.{field}: Input should be a finite number"):
        parse_oases_section({"enabled": True, "link": kwargs})
