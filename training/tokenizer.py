"""A byte-level BPE tokenizer trained on the training split, and the token streams the models see.

Byte level: every string encodes (no unknown token) and decodes back to itself. The end-of-text
token is id 0; a stream is `[eot] file1 [eot] file2 ...`, so every file's first token is
predicted from a fresh separator and the stream's first scored token is a real one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from verifier.tokenizer import load_tokenizer

from .data import EOT

EOT_ID = 0
MIN_VOCAB = 257 + 1  # 256 byte tokens + the end-of-text token, plus at least one merge


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train on `texts` (the training split only). The vocabulary may come out smaller than
    `vocab_size` when the texts run out of pairs worth merging."""
    if not MIN_VOCAB <= vocab_size <= 65536:
        raise ValueError(f"vocab_size must be in {MIN_VOCAB}..65536 (ids are stored as uint16), got {vocab_size}")
    if not texts:
        raise ValueError("train_tokenizer: no training texts")
    tok = Tokenizer(models.BPE())
    # GPT-2's split regex keeps runs of spaces (indentation) together; no prefix space, so decode(encode(t)) == t.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(EOT) != EOT_ID:
        raise RuntimeError(f"{EOT} got id {tok.token_to_id(EOT)}, expected {EOT_ID}")
    return tok


def load_trained_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer this pipeline trained (a tokenizer.json or its directory), read by the verifier's
    loader; ValueError when its end-of-text token lacks the id the models were trained with."""
    tok = load_tokenizer(path)
    if tok.token_to_id(EOT) != EOT_ID:
        raise ValueError(f"{path}: {EOT} has id {tok.token_to_id(EOT)}, expected {EOT_ID}")
    return tok


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for: [vocab] int64. In the byte-level alphabet each
    character of a token's string is one byte; the end-of-text token stands for none."""
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.zeros(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    for token, idx in vocab.items():
        lengths[idx] = 0 if token in special else len(token)
    return lengths


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """`[eot] t1 [eot] t2 ...` as uint16 ids."""
    if tok.get_vocab_size() > 65536:
        raise ValueError(f"vocabulary of {tok.get_vocab_size()} does not fit uint16 ids")
    pieces = [np.array([EOT_ID], dtype=np.uint16)]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(enc.ids, dtype=np.uint16))
        pieces.append(np.array([EOT_ID], dtype=np.uint16))
    return np.concatenate(pieces[:-1]) if len(pieces) > 1 else pieces[0]
