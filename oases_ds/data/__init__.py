"""Token data, in two jobs that share one file format (:mod:`~oases_ds.data.token_file`).

* :mod:`~oases_ds.data.batches`: what a training step eats -- fixed-length windows of the
  embedded stdlib text, synthetic tokens or a memory-mapped token file, drawn alike on every TMP
  rank of a group, with held-out windows no step trains on, and BERT's masked-LM rule.
* :mod:`~oases_ds.data.corpus`: what ``oases-data`` does offline -- a local tokenizer over local
  text, streamed into a token file and its sidecar.

The names below are re-exported so that ``from oases_ds.data import TokenBatches`` keeps working.
"""
from oases_ds.data.batches import (
    EMBEDDED_FILES,
    DataConfig,
    MaskedLM,
    TokenBatches,
    check_data,
    check_tokens,
    embedded_text_tokens,
    lm_batch,
    load_tokens,
    synthetic_batch,
)
from oases_ds.data.corpus import CorpusReport, CorpusSpec, SpecialIds, iter_documents, tokenize_corpus
from oases_ds.data.token_file import TOKEN_BYTES, TOKEN_DTYPES, TokenFileMeta, read_token_file

__all__ = [
    "EMBEDDED_FILES",
    "TOKEN_BYTES",
    "TOKEN_DTYPES",
    "CorpusReport",
    "CorpusSpec",
    "DataConfig",
    "MaskedLM",
    "SpecialIds",
    "TokenBatches",
    "TokenFileMeta",
    "check_data",
    "check_tokens",
    "embedded_text_tokens",
    "iter_documents",
    "lm_batch",
    "load_tokens",
    "read_token_file",
    "synthetic_batch",
    "tokenize_corpus",
]
