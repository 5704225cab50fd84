"""Held-out prompts for the acceptance bench: code from the validation split, cut at a function header.

    python -m training prompts --out bench/prompts/stdlib_validation.jsonl [--count 16]

For each validation file in path order (the split of data.py, so no prompt was trained on): the
text up to and including the first function header (`def ...:` at any indent) found after at
least MIN_LINES lines, keeping at most the MAX_CHARS characters before the header, so the model
continues a function body it has never seen. One JSON line per prompt: {"text", "source"}.
"""

from __future__ import annotations

import json
from pathlib import Path

from .data import VALIDATION, load_corpus

MIN_LINES = 12
MAX_CHARS = 1200


def function_prompt(text: str) -> str | None:
    """The prompt cut from one file's text, or None when it has no function header to stop at."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if i >= MIN_LINES and line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
            head = "".join(lines[: i + 1])
            return head[-MAX_CHARS:] if len(head) > MAX_CHARS else head
    return None


def write_prompts(out: Path, count: int, data_root: Path | None = None) -> int:
    corpus = load_corpus(data_root)
    rows = []
    for source in corpus.splits[VALIDATION]:
        prompt = function_prompt(source.text)
        if prompt is not None:
            rows.append({"text": prompt, "source": source.path})
        if len(rows) == count:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)
