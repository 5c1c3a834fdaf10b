"""Build a small local Hugging Face checkpoint and tokenizer to start ``oases-train`` from.

Nothing is downloaded: a tokenizer (the ``tokenizers`` library) is trained on local text --
the Python standard library's own ``.py`` files unless ``--corpus`` names others -- and a
model with random weights is built from a config and saved with ``save_pretrained``:

- ``--kind llama`` (default): a byte-level BPE tokenizer and a ``LlamaForCausalLM``
  (grouped-query attention, Llama 3 RoPE options);
- ``--kind bert``: a BERT-style WordPiece tokenizer (``[PAD]``, ``[UNK]``, ``[CLS]``, ``[SEP]``,
  ``[MASK]``) and a ``BertForMaskedLM`` (token types, decoder tied to the embedding).
  ``oases-data`` records the tokenizer's ``[MASK]`` and special ids in the token file's
  sidecar, and the masked-LM batches of ``oases-train`` take them from there.

It stands in for a real checkpoint directory: ``oases-train model=hf model.path=OUT`` reads
it the same way.

    python examples/make_tiny_hf.py --out runs/tiny_llama
    python examples/make_tiny_hf.py --kind bert --out runs/tiny_bert

writes ``OUT/config.json``, ``OUT/model.safetensors``, ``OUT/tokenizer.json`` and
``OUT/corpus.jsonl`` (the training text, one document per source file, for ``oases-data``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def local_documents(paths: list[str], limit_bytes: int) -> list[str]:
    """About ``limit_bytes`` of local text, one document per file: ``paths`` (globs), or the
    standard library's sources."""
    files = sorted(f for p in paths for f in glob.glob(p)) if paths else \
        sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise SystemExit(f"error: --corpus {' '.join(paths)} matches no file")
    chunks, size = [], 0
    for name in files:
        text = Path(name).read_text(encoding="utf-8", errors="replace")
        chunks.append(text)
        size += len(text)
        if size >= limit_bytes:
            break
    return chunks


def build_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is a token, so any text encodes without unknowns."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(), trainer)
    return tok


def build_bert_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """BERT's uncased WordPiece; ``[PAD]`` is id 0 as in Google's vocabularies."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(text.splitlines(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIALS))
    return tok


def build_bert(tok: Tokenizer, seq_len: int, seed: int) -> transformers.BertForMaskedLM:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=seq_len, type_vocab_size=2,
        pad_token_id=tok.token_to_id("[PAD]"),
    )
    return transformers.BertForMaskedLM(config)


def build_model(vocab_size: int, seq_len: int, seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq_len, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--kind", choices=("llama", "bert"), default="llama",
                   help="llama: LlamaForCausalLM + byte-level BPE; bert: BertForMaskedLM + WordPiece")
    p.add_argument("--corpus", nargs="*", default=[], help="local .txt files or globs (default: the stdlib's .py files)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64, help="max_position_embeddings of the model")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = local_documents(args.corpus, args.corpus_bytes)
    bert = args.kind == "bert"
    tok = (build_bert_tokenizer if bert else build_tokenizer)("\n".join(docs), args.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    model = build_bert(tok, args.seq_len, args.seed) if bert else build_model(tok.get_vocab_size(), args.seq_len, args.seed)
    model.save_pretrained(str(out), safe_serialization=True)
    print(f"wrote {out}: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters, "
          f"vocabulary {tok.get_vocab_size()}), tokenizer.json, corpus.jsonl ({len(docs)} documents)")


if __name__ == "__main__":
    main()
