"""Text in and out, where a model directory ships an HF `tokenizer.json`.

The one loader of tokenizer files: the verifier, the drafter's command line and the training
pipeline all read them through `load_tokenizer`. No torch here: the drafter imports it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json file, or a model directory holding one. FileNotFoundError when there is
    none, ValueError when it does not parse; both name the path."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"cannot read {path}: {exc}") from None


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._longest: int | None = None

    @property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes a vocabulary entry takes (added tokens included), as its string is
        written: no token covers more input bytes than this (a byte-level entry writes each byte as
        one character of at most two bytes, so the bound is loose, never short). So a text of C
        characters, at least C bytes, encodes to at least C / longest_token_bytes tokens."""
        if self._longest is None:
            self._longest = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._longest

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "TextTokenizer | None":
        """The model's tokenizer, or None when the directory ships none."""
        path = Path(model_dir) / TOKENIZER_FILE
        return cls(load_tokenizer(path)) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream(self) -> "TextStream":
        """A TextStream over this tokenizer: ids in as they come, text out."""
        return TextStream(self._tok)


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


_INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a UTF-8 sequence cut in the middle


class TextStream:
    """Feeds ids in, gives back the text they add. Text that ends inside a multi-byte character is
    held back until the character completes, so no replacement characters are printed mid-stream."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._shown = ""

    def push(self, ids: list[int]) -> str:
        self._ids += ids
        text = self._tok.decode(self._ids, skip_special_tokens=False).rstrip(_INCOMPLETE)
        if not text.startswith(self._shown):  # a decoder that rewrote earlier text: wait for it to settle
            return ""
        new, self._shown = text[len(self._shown):], text
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self._tok.decode(self._ids, skip_special_tokens=False)
        new = text[len(self._shown):] if text.startswith(self._shown) else ""
        self._shown = text
        return new

    @property
    def text(self) -> str:
        return self._tok.decode(self._ids, skip_special_tokens=False)
