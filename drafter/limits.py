"""The server's limits, checked on the command line before any work: a request past them exits 2
with a line naming the limit, rather than being cut silently.

The generation loop itself (drafter/loop.py) still cuts each step's drafts to what fits (the
rule of verifier.generation.draft_room): a library caller asking for more gets what the server
takes; a person typing --k 100 is told the server takes 8.
"""

from __future__ import annotations

from .messages import ModelInfo


class OverLimit(ValueError):
    """A flag asks for more than the server allows; the message names the flag and the limit."""


def check_k(k: int, info: ModelInfo, flag: str = "--k") -> None:
    if k > info.max_k:
        raise OverLimit(f"{flag} {k} exceeds the server's max_k {info.max_k} (the most drafts a step may carry)")


def check_budget(max_new_tokens: int, info: ModelInfo, prompt_tokens: int | None, where: str = "") -> None:
    """prompt + max_new_tokens must fit the server's max_context. `prompt_tokens` None: not known yet
    (a --text prompt before the server tokenizes it), so only the shortest prompt, 1 token, is assumed."""
    prompt = 1 if prompt_tokens is None else prompt_tokens
    if prompt + max_new_tokens > info.max_context:
        counted = "at least 1 prompt token" if prompt_tokens is None else f"{prompt_tokens} prompt tokens"
        raise OverLimit(f"{where}--max-new-tokens {max_new_tokens}: {counted} + {max_new_tokens} new tokens exceed "
                        f"the server's max_context {info.max_context}")
