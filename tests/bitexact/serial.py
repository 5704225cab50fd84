"""The serial oracle: plain one-token decoding through the same engine (K = 0), with the slot's
state recorded at every committed position. It is `python -m verifier check`'s oracle
(verifier/check/reference.py); here states are compared as flat lists of tensors."""

from __future__ import annotations

import torch

from verifier.check.reference import SerialRun
from verifier.check.reference import serial_run as _serial_run
from verifier.check.reference import slot_state as _layer_states
from verifier.engine import Engine
from verifier.params import SamplingParams


def slot_state(engine: Engine, slot: int, position: int) -> list[torch.Tensor]:
    """Every state tensor that defines the slot at committed `position`: KV rows [0, position), conv windows, recurrent states."""
    return [tensor for layer in _layer_states(engine, slot, position) for tensor in layer.tensors]


def states_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def serial_run(engine: Engine, prompt: list[int], n_tokens: int, sampling: SamplingParams = SamplingParams()) -> SerialRun:
    """The stream, its logits, and the slot's state at every committed position it passes."""
    every_position = frozenset(range(len(prompt), len(prompt) + n_tokens + 1))
    run = _serial_run(engine, prompt, n_tokens, sampling, keep_states=every_position)
    run.states = {position: [t for layer in layers for t in layer.tensors] for position, layers in run.states.items()}
    return run
