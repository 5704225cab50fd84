"""Carried rows at the engine level (verifier/model/rollback.py): a write-on-accept engine's rollback
leaves a multi-row step's kept rows in the slot's carry, not in its recurrent state; the slot's
next verify commits them; a slot's state read from outside (the serial oracle's committed_state)
applies them and is bitwise the serial decode's at every step; a reused slot carries nothing;
who carries and who folds."""

import pytest
import torch

from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepRequest
from verifier.model.rollback import SNAPSHOT, committed_state
from verifier.model.rows import RowBatch
from verifier.model.state import RecurrentState
from verifier.params import SamplingParams


@pytest.fixture(scope="module")
def model(load_target):
    return load_target("qwen3_next_moe")


def _recurrent(engine):
    return [(i, layer) for i, layer in enumerate(engine.pool.layers) if isinstance(layer, RecurrentState)]


def test_kept_rows_are_carried_then_committed_by_the_next_verify(model):
    serial = serial_run(Engine(model, 1, 48, max_k=0), [5, 6, 7], 20)
    engine = Engine(model, 2, 48, max_k=4)
    seq = engine.open([5, 6, 7], SamplingParams(), 20, eos_ids=())
    layers = _recurrent(engine)
    before = [layer.recurrent[seq.slot].clone() for _, layer in layers]

    # the serial continuation's first three tokens as drafts, then a wrong one: 3 accepted, 4 rows kept
    (res,) = engine.step([StepRequest(seq, serial.tokens[1:4] + [(serial.tokens[4] + 1) % 90])])
    assert res.accepted == 3 and engine.pool.carried[seq.slot] == 4
    assert all(torch.equal(layer.recurrent[seq.slot], b) for (_, layer), b in zip(layers, before)), \
        "the rollback folded its rows into the state (a carrying pool copies them)"
    assert states_equal(slot_state(engine, seq.slot, seq.position), serial.states[seq.position])

    (res,) = engine.step([StepRequest(seq, serial.tokens[6:8])])  # a verify of 3 rows commits the 4 carried
    assert engine.pool.carried[seq.slot] == res.accepted + 1
    committed = [committed_state(engine.pool, layer, seq.slot) for _, layer in layers]
    (res,) = engine.step([StepRequest(seq, [])])  # a decode: commits the carried rows and its own
    assert engine.pool.carried[seq.slot] == 0 and res.tokens == serial.tokens[seq.position - 3 : seq.position - 2]
    assert not all(torch.equal(layer.recurrent[seq.slot], c) for (_, layer), c in zip(layers, committed))
    assert states_equal(slot_state(engine, seq.slot, seq.position), serial.states[seq.position])


def test_a_reused_slot_carries_nothing(model):
    engine = Engine(model, 1, 48, max_k=4)
    seq = engine.open([5, 6, 7], SamplingParams(), 20, eos_ids=())
    engine.step([StepRequest(seq, [1, 2, 3])])
    assert engine.pool.carried[seq.slot] >= 1
    engine.close(seq)
    again = engine.open([5, 6, 7], SamplingParams(), 20, eos_ids=())
    assert again.slot == seq.slot and engine.pool.carried[again.slot] == 0
    serial = serial_run(Engine(model, 1, 48, max_k=0), [5, 6, 7], 6)
    (res,) = engine.step([StepRequest(again, serial.tokens[1:4])])
    assert res.tokens == serial.tokens[1:5]


@pytest.mark.parametrize("kwargs, carries", [(dict(max_k=4), 5), (dict(max_k=0), 0), (dict(max_k=4, rollback_mode=SNAPSHOT), 0)],
                         ids=["woa", "decode-only", "snapshot"])
def test_who_carries(model, kwargs, carries):
    engine = Engine(model, 1, 32, **kwargs)
    assert engine.pool.carry_rows == carries
    assert all((layer.carry is not None) == bool(carries) for _, layer in _recurrent(engine))


def test_a_verify_longer_than_the_carry_is_refused_before_it_runs(model):
    engine = Engine(model, 1, 48, max_k=2)
    seq = engine.open([5, 6, 7], SamplingParams(), 20, eos_ids=())
    before = slot_state(engine, seq.slot, seq.position)
    batch = RowBatch((seq.slot,), (seq.position,), (5,))
    with pytest.raises(ValueError, match="a verify of 5 rows in a pool that carries at most 3"):
        engine.runner.step(torch.tensor([seq.pending, 1, 2, 3, 4]), batch)
    assert states_equal(slot_state(engine, seq.slot, seq.position), before)


def test_the_model_api_applies_the_carry_too(model):
    """A Step outside an engine (verifier.model.step.verify and its rollback, which bench.rollback
    calls) on a carrying pool: two verifies with rollbacks in a row land on serial decode."""
    from verifier.model.step import verify

    serial = serial_run(Engine(model, 1, 48, max_k=0), [5, 6, 7], 20)
    engine = Engine(model, 1, 48, max_k=4)
    seq = engine.open([5, 6, 7], SamplingParams(), 20, eos_ids=())
    position, pending = seq.position, seq.pending
    for kept in (3, 2):  # rows kept: the pending token and kept - 1 drafts of the serial stream
        index = position - 3  # serial.tokens[index] is the pending token at this position
        drafts = serial.tokens[index + 1 : index + kept] + [(serial.tokens[index + kept] + 1) % 90]
        batch = RowBatch((seq.slot,), (position,), (len(drafts) + 1,))
        step = verify(model, engine.pool, torch.tensor([pending, *drafts]), batch)
        step.rollback([kept])
        assert engine.pool.carried[seq.slot] == kept
        position, pending = position + kept, serial.tokens[index + kept]
        assert states_equal(slot_state(engine, seq.slot, position), serial.states[position]), kept
