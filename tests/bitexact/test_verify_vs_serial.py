"""DESIGN.md section 5: verify rows and rolled-back state are bit-identical to serial decode.

For every family and both rollback modes, K from 1 to 8, drafts all wrong, all right and
random: every emitted token's logit row equals the serial row (torch.equal), and after every
rollback every state tensor of the slot equals the state serial decode reaches at that position.
"""

import pytest
import torch

from bitexact.conftest import FAMILIES, prompt_for
from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepRequest
from verifier.model.rollback import ROLLBACK_MODES
from verifier.params import SamplingParams

N_TOKENS = 14


def _drafts(kind: str, serial, emitted: int, k: int, vocab: int, gen: torch.Generator) -> list[int]:
    truth = serial.tokens[emitted : emitted + k]
    if kind == "right":
        return truth
    if kind == "wrong":  # never the serial token: rejected at row 0
        return [(t + 1 + int(torch.randint(0, vocab - 1, (1,), generator=gen))) % vocab for t in truth] if truth else []
    return [int(t) for t in torch.randint(0, vocab, (k,), generator=gen)]


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("name", FAMILIES)
def test_verify_rows_and_rolled_back_state_equal_serial(model_of, name, mode):
    model = model_of(name)
    vocab = model.config.vocab_size
    prompt = prompt_for(model, 7, seed=11)
    serial = serial_run(Engine(model, 1, 64), prompt, N_TOKENS)
    engine = Engine(model, 1, 64, max_k=8, rollback_mode=mode)
    gen = torch.Generator().manual_seed(5)
    for k in range(1, 9):
        for kind in ("wrong", "right", "random"):
            seq = engine.open(prompt, SamplingParams(), N_TOKENS, eos_ids=())
            tokens, rows = [seq.pending], [seq.first_logits[None]]
            while not seq.finished:
                drafts = _drafts(kind, serial, len(tokens), k, vocab, gen)
                (res,) = engine.step([StepRequest(seq, drafts)])
                assert res.error is None
                if kind == "right" and len(drafts) == k:
                    assert res.accepted == k, f"K={k}: all-right drafts were not all accepted"
                if kind == "wrong":
                    assert res.accepted == 0
                tokens += res.tokens
                rows.append(res.logits)
                assert states_equal(slot_state(engine, seq.slot, seq.position), serial.states[seq.position]), \
                    f"{name} {mode} K={k} {kind}: state after rollback to position {seq.position} differs from serial"
            engine.close(seq)
            assert tokens == serial.tokens, f"{name} {mode} K={k} {kind}: stream differs"
            assert torch.equal(torch.cat(rows), serial.logits), f"{name} {mode} K={k} {kind}: a logit row differs"


@pytest.mark.parametrize("name", FAMILIES)
def test_all_k_plus_one_rows_of_right_drafts_equal_serial(model_of, name):
    """With every draft right, all K+1 verify rows of one forward are serial rows."""
    model = model_of(name)
    prompt = prompt_for(model, 5, seed=2)
    serial = serial_run(Engine(model, 1, 64), prompt, 10)
    engine = Engine(model, 1, 64, max_k=8)
    seq = engine.open(prompt, SamplingParams(), 10, eos_ids=())
    (res,) = engine.step([StepRequest(seq, serial.tokens[1:9])])
    assert res.accepted == 8 and res.tokens == serial.tokens[1:10]
    assert torch.equal(res.logits, serial.logits[1:10])
