"""Argument types shared by the command lines of both sides (`python -m verifier`, `python -m drafter`).

No torch here: the drafter imports it.
"""

from __future__ import annotations

import argparse


def token_ids(text: str) -> list[int]:
    """--prompt-ids 1,2,3 -> [1, 2, 3]."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def at_least(low: int):
    """An integer argument type that refuses values below `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse
