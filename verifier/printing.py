"""A generation's tokens on stdout as they come: both command lines' `generate` stream with it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tokenizers is imported only where text is wanted
    from .tokenizer import TextStream


class TokenPrinter:
    """Streams each step's tokens to stdout: text through a TextStream, else comma-separated ids.
    quiet (--json): nothing is printed, the text stream is still fed (the JSON reports its text)."""

    def __init__(self, text_stream: TextStream | None, quiet: bool):
        self.text_stream, self.quiet = text_stream, quiet
        self.started = False

    def push(self, ids: list[int]) -> None:
        if self.text_stream is not None:
            chunk = self.text_stream.push(ids)
        else:
            chunk = ("," if self.started else "") + ",".join(map(str, ids))
        self.started = True
        if not self.quiet and chunk:
            sys.stdout.write(chunk)
            sys.stdout.flush()

    def end(self) -> None:
        """The text held back (an incomplete character at the very end), and the line's end."""
        if self.quiet or not self.started:
            return
        if self.text_stream is not None:
            sys.stdout.write(self.text_stream.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()
