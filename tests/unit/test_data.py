"""Token sources: windows, DP shares, masked-LM batches, memory-mapped files, and the
tokenizer pipeline behind oases-data (a tokenizer trained here: nothing is downloaded)."""
import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import oases_ds.data.corpus as corpus_module
from oases_ds.cli import data as data_cli
from oases_ds.data import CorpusSpec, DataConfig, MaskedLM, TokenBatches, TokenFileMeta, check_data, tokenize_corpus


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


def test_masked_lm_batches_label_only_picked_positions():
    data = TokenBatches(DataConfig("text"), vocab_size=256, seq_len=64, masked_lm=True)
    b = data.batch(0, 1, 0, 8)
    picked = b["labels"] != -100
    assert picked.any(dim=1).all() and 0.05 < picked.float().mean() < 0.35
    assert not picked[:, 0].all()  # position 0 is no longer always picked
    unpicked = data.batch(0, 1, 0, 8)["tokens"][~picked]
    assert torch.equal(unpicked, data._rows(data.tokens, data.order, 0, 8)[:, :-1][~picked])


def test_masked_lm_never_picks_special_tokens_and_follows_80_10_10():
    """Special ids (here 0-3 as [PAD] [CLS] [SEP] [MASK]) are never labelled; of the picked
    positions ~80% are fed as [MASK], ~10% as another token, ~10% unchanged (20k picks:
    a share's standard deviation is < 0.3%, the bounds are > 10 of them)."""
    rule = MaskedLM(mask_id=3, special_ids=(0, 1, 2, 3))
    data = TokenBatches(DataConfig("synthetic"), vocab_size=64, seq_len=128, masked_lm=rule)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 64, (1024, 129), generator=gen)
    seq[:, :8] = 0  # padding-heavy starts: never picked, and still every sample gets a label
    b = data._sample(seq, first=0)
    tokens, picked = seq[:, :-1], b["labels"] != -100
    assert picked.any(dim=1).all()
    assert not torch.isin(tokens[picked], torch.tensor([0, 1, 2, 3])).any()
    assert torch.equal(b["labels"][picked], tokens[picked])
    assert 0.12 < picked.sum() / (~torch.isin(tokens, torch.tensor([0, 1, 2, 3]))).sum() < 0.18
    fed, orig = b["tokens"][picked], tokens[picked]
    masked, same = (fed == 3).float().mean(), (fed == orig).float().mean()
    assert 0.77 < masked < 0.83 and 0.09 < same < 0.13  # random replacements may draw the original (1/64)
    assert 0.07 < ((fed != 3) & (fed != orig)).float().mean() < 0.11
    assert torch.equal(b["tokens"][~picked], tokens[~picked])


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


# -- oases-data: a local tokenizer over local text -----------------------------------------------------
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the bird sang a song", "hello world again"]


def word_tokenizer(path, eos="</s>"):
    """A WordLevel tokenizer trained on SENTENCES (no download), saved as tokenizer.json."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", eos]))
    tok.save(str(path))
    return tok


def wide_tokenizer(path):
    """A vocabulary of 70,000 words: ids above 65,535 need uint32."""
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(69_999)}, "</s>": 69_999}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text("the cat sat\non the mat\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": s, "id": i}) for i, s in enumerate(SENTENCES)) + "\n")
    return tmp_path


def expected_ids(tok, docs, eos):
    return [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]]


def test_tokenize_txt_and_jsonl_round_trips_the_ids_as_uint16(corpus):
    tok = word_tokenizer(corpus / "tok.json")
    eos = tok.token_to_id("</s>")
    out = corpus / "out" / "tokens.bin"
    report = tokenize_corpus(CorpusSpec((str(corpus / "a.txt"), str(corpus / "*.jsonl")), str(corpus / "tok.json"),
                                        str(out), text_field="body"))
    ids = np.fromfile(out, dtype=np.uint16)
    assert ids.tolist() == expected_ids(tok, ["the cat sat\non the mat\n", *SENTENCES], eos)
    meta = TokenFileMeta.read(str(out))
    assert (meta.dtype, meta.vocab_size, meta.tokens, meta.eos_id) == ("uint16", tok.get_vocab_size(), len(ids), eos)
    assert meta.sources == (str(corpus / "a.txt"), str(corpus / "b.jsonl")) and meta.held_out is None
    assert report.documents == 5 and os.path.getsize(out) == 2 * len(ids)
    assert sorted(os.listdir(out.parent)) == ["tokens.bin", "tokens.bin.json"]  # no temporary file left


@pytest.mark.parametrize("wide", [True, False])
def test_uint32_files_round_trip_and_data_mmap_reads_them(tmp_path, wide):
    """A vocabulary over 65,535 ids is written as uint32 (auto); a small one when --dtype uint32 forces it."""
    tok = wide_tokenizer(tmp_path / "tok.json") if wide else word_tokenizer(tmp_path / "tok.json")
    words = "w1 w65535 w65536 w69998 w7" if wide else "the cat sat on the mat"
    (tmp_path / "c.txt").write_text(" ".join([words] * 30))
    out = tmp_path / "tokens.bin"
    tokenize_corpus(CorpusSpec((str(tmp_path / "c.txt"),), str(tmp_path / "tok.json"), str(out),
                               dtype="auto" if wide else "uint32"))
    want = expected_ids(tok, [" ".join([words] * 30)], tok.token_to_id("</s>"))
    assert np.fromfile(out, dtype=np.uint32).tolist() == want and TokenFileMeta.read(str(out)).dtype == "uint32"
    if wide:
        assert max(want) > 65_535
    data = TokenBatches(DataConfig("mmap", str(out), eval_fraction=0.1), vocab_size=tok.get_vocab_size(), seq_len=8)
    assert data.tokens.dtype == np.uint32
    row = data.batch(0, 1, 0, 1)["tokens"][0].tolist()
    assert any(want[i:i + 8] == row for i in range(len(want)))  # a window of the ids, read in the right dtype


def test_held_out_documents_go_to_their_own_file_and_train_reads_only_the_rest(corpus):
    tok = word_tokenizer(corpus / "tok.json")
    eos = tok.token_to_id("</s>")
    out = corpus / "tokens.bin"
    report = tokenize_corpus(CorpusSpec((str(corpus / "b.jsonl"),), str(corpus / "tok.json"), str(out),
                                        text_field="body", eval_fraction=0.5))
    assert (report.documents, report.eval_documents) == (2, 2)  # every second document, deterministic
    assert np.fromfile(out, np.uint16).tolist() == expected_ids(tok, SENTENCES[0::2], eos)
    assert np.fromfile(corpus / "tokens.eval.bin", np.uint16).tolist() == expected_ids(tok, SENTENCES[1::2], eos)
    assert TokenFileMeta.read(str(out)).held_out == "tokens.eval.bin"
    data = TokenBatches(DataConfig("mmap", str(out)), vocab_size=tok.get_vocab_size(), seq_len=3)
    held = np.fromfile(corpus / "tokens.eval.bin", np.uint16).tolist()
    row = data.eval_batch(0, 1, 0, 1)["tokens"][0].tolist()
    assert any(held[i:i + 3] == row for i in range(len(held)))  # evaluation reads the held-out file


def test_without_a_held_out_file_training_never_reads_the_eval_windows(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(2001, dtype=np.uint16).tofile(path)  # window w starts with id w * 10: rows name their window
    data = TokenBatches(DataConfig("mmap", str(path), eval_fraction=0.1), vocab_size=2001, seq_len=10)
    trained = {int(r[0]) // 10 for step in range(40) for r in data.batch(step, 1, 0, 8)["tokens"]}
    evaluated = {int(r[0]) // 10 for i in range(5) for r in data.eval_batch(i, 1, 0, 8)["tokens"]}
    assert len(evaluated) == 20 and len(trained) == 180  # 10% of 200 windows held out; 320 samples cover the rest
    assert not trained & evaluated


@pytest.mark.parametrize("make, spec, message", [
    (None, dict(tokenizer="missing.json"), "--tokenizer .*missing.json: no such file; give a local tokenizer.json"),
    ("bad_tokenizer", {}, "--tokenizer .*tok.json: not a tokenizers tokenizer.json"),
    ("empty", dict(inputs=("empty.txt", "blank.jsonl")), "no text to train on in .*empty.txt, .*blank.jsonl"),
    (None, dict(inputs=("nothing/*.txt",)), "input 'nothing/\\*.txt' matches no file"),
    (None, dict(inputs=("tok.json",)), "input 'tok.json' is neither .txt nor .jsonl"),
    (None, dict(inputs=("b.jsonl",), text_field="text"), "b.jsonl:1: no field 'text' \\(has: body, id\\); pass --text-field"),
    ("bad_json", dict(inputs=("bad.jsonl",)), "bad.jsonl:2: not a JSON line"),
    ("latin1", dict(inputs=("latin.txt",)), "latin.txt: not UTF-8 text"),
    (None, dict(eos_token="<eos>"), "--eos-token '<eos>' is not in the tokenizer's vocabulary"),
    ("no_eos", {}, "the tokenizer has none of the separator tokens .*; pass --eos-token TOKEN"),
    ("wide", dict(dtype="uint16"), "--dtype uint16 cannot hold the tokenizer's vocabulary of 70000 ids"),
    (None, dict(eval_fraction=0.1), "--eval-fraction 0.1 held out no document of 1"),
])
def test_bad_corpus_input_is_one_line_and_keeps_the_previous_output(corpus, monkeypatch, make, spec, message):
    monkeypatch.chdir(corpus)
    word_tokenizer(corpus / "tok.json", eos="<pad>" if make == "no_eos" else "</s>")
    previous = np.arange(5, dtype=np.uint16)
    previous.tofile(corpus / "tokens.bin")
    if make == "bad_tokenizer":
        (corpus / "tok.json").write_text('{"version": "1.0", "model": 3}')
    if make == "empty":
        (corpus / "empty.txt").write_text("")
        (corpus / "blank.jsonl").write_text('{"text": ""}\n\n')
    if make == "bad_json":
        (corpus / "bad.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    if make == "latin1":
        (corpus / "latin.txt").write_bytes("café".encode("latin-1"))
    if make == "wide":
        wide_tokenizer(corpus / "tok.json")
    kwargs = {"inputs": ("a.txt",), "tokenizer": "tok.json", "out": "tokens.bin", **spec}
    with pytest.raises(ValueError, match=message) as err:
        tokenize_corpus(CorpusSpec(**kwargs))
    assert "\n" not in str(err.value)
    assert np.fromfile(corpus / "tokens.bin", np.uint16).tolist() == previous.tolist()
    assert not [f for f in os.listdir(corpus) if f.endswith(".tmp")]


def test_oases_data_cli_writes_and_refuses_in_one_line(corpus, capsys):
    word_tokenizer(corpus / "tok.json")
    out = corpus / "t.bin"
    data_cli.main(["--tokenizer", str(corpus / "tok.json"), "--out", str(out), "--text-field", "body",
                   "--eval-fraction", "0.25", str(corpus / "*.jsonl")])
    said = capsys.readouterr().out
    assert f"1 files, 3 docs, {TokenFileMeta.read(str(out)).tokens:,} tokens -> {out} (uint16" in said
    assert "held out 1 docs" in said and (corpus / "t.eval.bin").exists()
    with pytest.raises(SystemExit) as exc:
        data_cli.main(["--tokenizer", str(corpus / "tok.json"), "--out", str(out), str(corpus / "b.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: ") and "b.jsonl:1: no field 'text'" in err[0]


def test_data_mmap_checks_the_sidecar(corpus):
    tok = word_tokenizer(corpus / "tok.json")
    out = corpus / "tokens.bin"
    (corpus / "c.txt").write_text(" ".join(SENTENCES * 10))
    tokenize_corpus(CorpusSpec((str(corpus / "c.txt"),), str(corpus / "tok.json"), str(out)))
    vocab = tok.get_vocab_size()
    with pytest.raises(ValueError, match=f"data.path='{out}' was tokenized with a vocabulary of {vocab} .* but "
                                         f"model.vocab_size={vocab - 1}; set model.vocab_size={vocab} or more"):
        check_data(DataConfig("mmap", str(out)), vocab_size=vocab - 1, seq_len=4)
    check_data(DataConfig("mmap", str(out)), vocab_size=vocab, seq_len=4)
    with open(out, "ab") as f:  # a torn or foreign file: its size disagrees with the sidecar
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="holds .* tokens but its sidecar .*tokens.bin.json says"):
        DataConfig("mmap", str(out))
    (corpus / "tokens.bin.json").write_text('{"dtype": "int8"')
    with pytest.raises(ValueError, match="tokens.bin.json is not a token-file sidecar"):
        DataConfig("mmap", str(out))


def test_a_long_txt_is_streamed_in_pieces_and_stays_one_document(corpus, monkeypatch):
    """Pieces of ~12 characters (the real size is 1 MiB): the ids are the whole text's, with one EOS at its end."""
    monkeypatch.setattr(corpus_module, "TXT_CHUNK_CHARS", 12)
    tok = word_tokenizer(corpus / "tok.json")
    text = "".join(s + "\n" for s in SENTENCES * 5)
    (corpus / "long.txt").write_text(text)
    assert len(list(corpus_module.iter_documents(str(corpus / "long.txt")))) > 10
    out = corpus / "tokens.bin"
    report = tokenize_corpus(CorpusSpec((str(corpus / "long.txt"),), str(corpus / "tok.json"), str(out), batch_docs=3))
    assert report.documents == 1
    assert np.fromfile(out, np.uint16).tolist() == expected_ids(tok, [text], tok.token_to_id("</s>"))


# -- masked-LM ids come from the tokenizer, through the sidecar ---------------------------------------
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_word_tokenizer(path):
    """A WordLevel tokenizer with BERT's special tokens (ids 0-4; [MASK] = 4)."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=BERT_SPECIALS))
    tok.save(str(path))
    return tok


def test_sidecar_records_the_tokenizers_mask_and_special_ids_and_masked_lm_batches_use_them(corpus):
    tok = bert_word_tokenizer(corpus / "tok.json")
    (corpus / "c.txt").write_text(" ".join(SENTENCES * 40))
    out = corpus / "tokens.bin"
    tokenize_corpus(CorpusSpec((str(corpus / "c.txt"),), str(corpus / "tok.json"), str(out)))
    meta = TokenFileMeta.read(str(out))
    mask, pad = tok.token_to_id("[MASK]"), tok.token_to_id("[PAD]")
    assert (meta.mask_id, meta.pad_id, meta.eos_id) == (mask, pad, tok.token_to_id("[SEP]")) and mask != 0
    assert meta.special_ids == tuple(sorted(tok.token_to_id(t) for t in BERT_SPECIALS))
    # a model vocabulary far above the tokenizer's: random replacements still come from the tokenizer's
    vocab = tok.get_vocab_size()
    data = TokenBatches(DataConfig("mmap", str(out)), vocab_size=4 * vocab, seq_len=16, masked_lm=True)
    assert data.masked_lm == MaskedLM(mask, meta.special_ids, vocab_size=vocab)
    fed, picked = [], []
    for step in range(40):
        b = data.batch(step, 1, 0, 8)
        fed.append(b["tokens"])
        picked.append(b["labels"] != -100)
        assert not torch.isin(b["labels"][picked[-1]], torch.tensor(meta.special_ids)).any()
    fed, picked = torch.cat(fed), torch.cat(picked)
    assert 0.7 < (fed[picked] == mask).float().mean() < 0.9  # [MASK] is the tokenizer's, not id 0
    assert int(fed.max()) < vocab


def test_a_masked_lm_run_without_a_mask_id_is_one_line(corpus):
    tok = word_tokenizer(corpus / "tok.json")  # no [MASK]
    (corpus / "c.txt").write_text(" ".join(SENTENCES * 10))
    out = corpus / "tokens.bin"
    tokenize_corpus(CorpusSpec((str(corpus / "c.txt"),), str(corpus / "tok.json"), str(out)))
    vocab = tok.get_vocab_size()
    check_data(DataConfig("mmap", str(out)), vocab, 4)  # a causal model needs no [MASK]
    with pytest.raises(ValueError, match=r"has no \[MASK\] id: its tokenizer .*tok.json has none of \[MASK\], <mask>.*"
                                         r"rerun oases-data with --mask-token TOKEN") as err:
        check_data(DataConfig("mmap", str(out)), vocab, 4, masked_lm=True)
    assert "\n" not in str(err.value)
    tokenize_corpus(CorpusSpec((str(corpus / "c.txt"),), str(corpus / "tok.json"), str(out), mask_token="[UNK]"))
    assert TokenFileMeta.read(str(out)).mask_id == tok.token_to_id("[UNK]")
    check_data(DataConfig("mmap", str(out)), vocab, 4, masked_lm=True)
    with pytest.raises(ValueError, match="--mask-token '<m>' is not in the tokenizer's vocabulary"):
        tokenize_corpus(CorpusSpec((str(corpus / "c.txt"),), str(corpus / "tok.json"), str(out), mask_token="<m>"))
    os.remove(corpus / "tokens.bin.json")  # a plain uint16 file: nothing says which id is [MASK]
    with pytest.raises(ValueError, match=r"has no sidecar .*tokens.bin.json, so its \[MASK\] id is unknown"):
        check_data(DataConfig("mmap", str(out)), vocab, 4, masked_lm=True)
