"""Plain serial generation: prefill the prompt, then decode one token per step (greedy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import HybridModel


@dataclass
class Generation:
    tokens: list[int]  # generated ids (the eos that ended it included)
    logits: torch.Tensor  # [len(tokens), vocab] fp32: row i holds the logits tokens[i] was chosen from
    finish_reason: str  # "eos" or "length"


def greedy_token(logits: torch.Tensor) -> int:
    """argmax over the vocabulary; ties pick the lowest id (torch.argmax returns the first maximum)."""
    return int(torch.argmax(logits))


def generate_greedy(model: HybridModel, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] | None = None) -> Generation:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    eos = set(model.config.eos_token_ids if eos_ids is None else eos_ids)
    pool = model.new_pool(1, len(prompt) + max_new_tokens)
    slot = pool.admit()
    logits = model.prefill(pool, slot, prompt)
    tokens, rows, reason = [], [], "length"
    position = len(prompt)
    while True:
        token = greedy_token(logits)
        tokens.append(token)
        rows.append(logits)
        if token in eos:
            reason = "eos"
            break
        if len(tokens) == max_new_tokens:
            break
        logits = model.decode(pool, [slot], [position], [token])[0]
        position += 1
    return Generation(tokens, torch.stack(rows), reason)
