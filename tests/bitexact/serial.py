"""The serial oracle: plain one-token decoding through the same engine (K = 0), with the slot's
state recorded at every committed position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier.engine import Engine, StepRequest
from verifier.model.state import AttentionState
from verifier.params import SamplingParams


def slot_state(engine: Engine, slot: int, position: int) -> list[torch.Tensor]:
    """Every state tensor that defines the slot at committed `position`: KV rows [0, position), conv windows, recurrent states."""
    out = []
    for layer in engine.pool.layers:
        if isinstance(layer, AttentionState):
            out += [layer.keys[slot, :position].clone(), layer.values[slot, :position].clone()]
        else:
            out += [layer.conv[slot].clone(), layer.recurrent[slot].clone()]
    return out


def states_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@dataclass
class SerialRun:
    prompt: list[int]
    tokens: list[int]  # emitted stream
    logits: torch.Tensor  # [len(tokens), vocab]
    states: dict[int, list[torch.Tensor]]  # committed position -> slot state


def serial_run(engine: Engine, prompt: list[int], n_tokens: int, sampling: SamplingParams = SamplingParams()) -> SerialRun:
    seq = engine.open(prompt, sampling, n_tokens, eos_ids=())
    tokens, rows = [seq.pending], [seq.first_logits[None]]
    states = {seq.position: slot_state(engine, seq.slot, seq.position)}
    while not seq.finished:
        (res,) = engine.step([StepRequest(seq, [])])
        assert res.error is None, res.error
        tokens += res.tokens
        rows.append(res.logits)
        states[seq.position] = slot_state(engine, seq.slot, seq.position)
    engine.close(seq)
    return SerialRun(prompt, tokens, torch.cat(rows), states)
