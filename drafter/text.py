"""Streaming detokenization for the drafter's command line.

The verifier tokenizes `--text` prompts itself but sends back only ids, so to print text the drafter
needs the model's `tokenizer.json` (`--tokenizer FILE_OR_DIR`); without it the CLI prints ids.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from verifier import tokenizer as shared

_INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a UTF-8 sequence cut in the middle


def load_tokenizer(path: str | Path) -> Tokenizer:
    """--tokenizer FILE_OR_DIR through the verifier's loader; every failure is a ValueError naming
    the flag and the path (the command line exits 2 with it)."""
    try:
        return shared.load_tokenizer(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"--tokenizer: {exc}") from None


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
