"""The drafter command line's `--tokenizer` flag.

The verifier tokenizes `--text` prompts itself but sends back only ids, so to print text the drafter
needs the model's `tokenizer.json` (`--tokenizer FILE_OR_DIR`); without it the CLI prints ids. The
text is streamed by verifier/printing.py's TokenPrinter, as `python -m verifier generate` streams it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from verifier import tokenizer as shared


def load_tokenizer(path: str | Path) -> Tokenizer:
    """--tokenizer FILE_OR_DIR through the verifier's loader; every failure is a ValueError naming
    the flag and the path (the command line exits 2 with it)."""
    try:
        return shared.load_tokenizer(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"--tokenizer: {exc}") from None
