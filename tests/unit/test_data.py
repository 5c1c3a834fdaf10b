"""Token sources: windows, DP shares, masked-LM batches, memory-mapped files."""
import numpy as np
import pytest
import torch

from oases_ds.data import DataConfig, TokenBatches, check_data


def test_embedded_text_is_bytes_and_labels_are_shifted():
    data = TokenBatches(DataConfig("text"), vocab_size=256, seq_len=16)
    b = data.batch(step=0, slots=2, slot=0, size=4)
    assert b["tokens"].shape == (4, 16) and int(b["tokens"].max()) < 256
    assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])


def test_slots_give_disjoint_windows_and_resume_reads_the_same():
    data = TokenBatches(DataConfig("text", seed=3), vocab_size=256, seq_len=32)
    a, b = data.batch(5, 2, 0, 4), data.batch(5, 2, 1, 4)
    assert not any(torch.equal(x, y) for x in a["tokens"] for y in b["tokens"])
    again = TokenBatches(DataConfig("text", seed=3), vocab_size=256, seq_len=32).batch(5, 2, 0, 4)
    assert torch.equal(a["tokens"], again["tokens"])


def test_mmap_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    data = TokenBatches(DataConfig("mmap", str(path)), vocab_size=1000, seq_len=10)
    b = data.batch(0, 1, 0, 3)
    for row_t, row_l in zip(b["tokens"], b["labels"]):
        assert torch.equal(row_l, row_t + 1)  # consecutive ids: a window of the file
    with pytest.raises(ValueError, match="model.vocab_size=500 is smaller than token id 999"):
        TokenBatches(DataConfig("mmap", str(path)), vocab_size=500, seq_len=10)


def test_masked_lm_batches_label_only_masked_positions():
    data = TokenBatches(DataConfig("text"), vocab_size=256, seq_len=64, masked_lm=True)
    b = data.batch(0, 1, 0, 8)
    picked = b["labels"] != -100
    assert picked[:, 0].all() and 0.05 < picked.float().mean() < 0.35
    assert (b["tokens"][picked] == 0).all()


def test_bad_data_config():
    with pytest.raises(ValueError, match="data.source='csv' unknown"):
        DataConfig("csv")
    with pytest.raises(ValueError, match="data.path is not set; data.source=mmap needs a token file"):
        DataConfig("mmap")


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"\x01\x00\x02", "has 3 bytes, not a whole number of 2-byte uint16 tokens"),
])
def test_token_file_of_no_whole_tokens_is_refused(tmp_path, content, message):
    path = tmp_path / "tokens.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        DataConfig("mmap", str(path))
    with pytest.raises(ValueError, match="is not a file"):
        DataConfig("mmap", str(tmp_path))


def test_check_data_is_what_token_batches_checks(tmp_path):
    """The launcher's up-front check and the library's loader refuse the same files alike."""
    path = tmp_path / "tokens.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    cfg = DataConfig("mmap", str(path))
    for vocab, seq, message in ((1000, 32, "has 20 tokens, fewer than one window of model.seq_len\\+1=33"),
                                (10, 8, "model.vocab_size=10 is smaller than token id 19 .*set model.vocab_size=20")):
        with pytest.raises(ValueError, match=message):
            check_data(cfg, vocab, seq)
        with pytest.raises(ValueError, match=message):
            TokenBatches(cfg, vocab, seq)
    with pytest.raises(ValueError, match="has 1 window.*leaves none to train on"):
        check_data(cfg, vocab_size=20, seq_len=19)  # one window: nothing left once one is held out
    check_data(cfg, vocab_size=20, seq_len=9)  # two windows: one trains, one is held out
    assert TokenBatches(cfg, 20, 9).windows == 1
