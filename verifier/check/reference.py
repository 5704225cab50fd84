"""The serial oracle of `python -m verifier check`: plain decoding through the engine, one row per
step (K = 0), the path every verify row is compared against (DESIGN.md section 5).

The test suite's oracle is this one too (tests/bitexact/serial.py adapts it: flat state lists,
every position kept); the per-layer attribution is the command's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine import Engine, StepRequest
from ..params import SamplingParams
from .layers import LayerOutputs


@dataclass
class LayerState:
    kind: str  # the layer's mixer kind: "attention", "mla", "gdn", "kda"
    tensors: list[torch.Tensor]  # attention: keys, values [position, heads, d]; recurrent: conv window, state


def slot_state(engine: Engine, slot: int, position: int) -> list[LayerState]:
    """Per layer, every state tensor that defines `slot` at committed `position` (copies): KV rows
    [0, position), or the conv window and the fp32 recurrent state (Engine.slot_tensors)."""
    return [LayerState(kind, tensors) for kind, tensors in zip(engine.model.config.mixers, engine.slot_tensors(slot, position))]


@dataclass
class SerialRun:
    prompt: list[int]
    tokens: list[int]  # the emitted stream, the first token (chosen from the prompt) included
    logits: torch.Tensor  # [len(tokens), vocab] fp32: row j is what tokens[j] was chosen from
    states: dict[int, list[LayerState]]  # committed position -> slot state, at the positions asked for
    # stream row j >= 1 -> each recorded layer part's output row [hidden] (LayerOutputs.parts order)
    layer_rows: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def serial_run(engine: Engine, prompt: list[int], n_tokens: int, sampling: SamplingParams = SamplingParams(),
               keep_states: frozenset[int] = frozenset(), recorder: LayerOutputs | None = None) -> SerialRun:
    """Decode `n_tokens` (the first included) one row per step; keep the slot's state at the
    committed positions in `keep_states`, and with a recorder (active, on an eager engine) every
    layer's output row of every decode step."""
    seq = engine.open(prompt, sampling, n_tokens, eos_ids=())
    try:
        if recorder is not None:
            recorder.take()  # prefill's rows are not decode rows
        tokens, rows, layer_rows = [seq.pending], [seq.first_logits[None]], {}
        states = {}
        while True:
            if seq.position in keep_states:
                states[seq.position] = slot_state(engine, seq.slot, seq.position)
            if seq.finished:
                break
            (res,) = engine.step([StepRequest(seq, [])])
            if res.error is not None:
                raise res.error
            if recorder is not None:
                layer_rows[len(tokens)] = [part[0] for part in recorder.take()]
            tokens += res.tokens
            rows.append(res.logits)
        return SerialRun(list(prompt), tokens, torch.cat(rows), states, layer_rows)
    finally:
        engine.close(seq)
