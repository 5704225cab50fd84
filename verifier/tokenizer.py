"""Text in and out, where a model directory ships an HF `tokenizer.json`."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "TextTokenizer | None":
        path = Path(model_dir) / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path))) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def byte_level_tokenizer(eos: str = "<|endoftext|>") -> Tokenizer:
    """256 byte tokens (ids 0..255) plus `eos` (id 256): text round-trips with no training."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab[eos] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    return tok


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable remapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
