"""Engine step validation and finishing: a bad request gets a clear error and changes nothing else."""

import pytest
import torch

from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepError, StepRequest
from verifier.model import PoolFullError
from verifier.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(load_target):
    return load_target("qwen3_next_moe")


def _engine(model, **kw):
    return Engine(model, kw.pop("n_slots", 2), kw.pop("max_seq_len", 32), max_k=kw.pop("max_k", 4), **kw)


@pytest.mark.parametrize(
    "make_request, code, message",
    [
        (lambda s, v: StepRequest(s, [1] * 5), "invalid_argument", "5 drafts exceed max_k 4"),
        (lambda s, v: StepRequest(s, [1, v]), "invalid_argument", rf"draft ids \[{96}\] are outside the vocabulary"),
        (lambda s, v: StepRequest(s, [-1]), "invalid_argument", r"draft ids \[-1\]"),
        (lambda s, v: StepRequest(s, [1, 2], torch.ones(3, v) / v), "invalid_argument", r"draft_probs has shape \[3, 96\], expected \[2, 96\]"),
        (lambda s, v: StepRequest(s, [1], torch.ones(1, v)), "invalid_argument", "must sum to 1"),
        (lambda s, v: StepRequest(s, [1], torch.nn.functional.one_hot(torch.tensor([2]), v).float()), "invalid_argument", "gives its own draft 1 probability 0"),
    ],
)
def test_bad_request_fails_alone(model, make_request, code, message):
    engine = _engine(model)
    good = engine.open([5, 6, 7], SamplingParams(), 10, eos_ids=())
    bad = engine.open([8, 9], SamplingParams(), 10, eos_ids=())
    before = slot_state(engine, bad.slot, bad.position)
    results = engine.step([make_request(bad, model.config.vocab_size), StepRequest(good, [4])])
    assert results[0].error is not None and results[0].error.code == code
    assert pytest.raises(StepError, engine.check, make_request(bad, model.config.vocab_size)).match(message)
    assert results[1].error is None and len(results[1].tokens) >= 1
    assert states_equal(slot_state(engine, bad.slot, bad.position), before)
    # the good sequence went on exactly as serial decode does
    serial = serial_run(_engine(model, n_slots=1), [5, 6, 7], 10)
    assert results[1].tokens == serial.tokens[1 : 1 + len(results[1].tokens)]


def test_context_full_is_out_of_range(model):
    engine = _engine(model, max_seq_len=8)
    seq = engine.open([1, 2, 3, 4, 5], SamplingParams(), 10, eos_ids=())
    (res,) = engine.step([StepRequest(seq, [1, 2, 3])])
    assert res.error.code == "out_of_range" and "pass max_seq_len 8" in str(res.error)
    (res,) = engine.step([StepRequest(seq, [1, 2])])
    assert res.error is None


def test_same_sequence_twice_in_one_step(model):
    engine = _engine(model)
    seq = engine.open([1, 2, 3], SamplingParams(), 10, eos_ids=())
    first, second = engine.step([StepRequest(seq, [4]), StepRequest(seq, [5])])
    assert first.error is None
    assert second.error.code == "invalid_argument" and "appears twice" in str(second.error)


def test_empty_draft_returns_the_bonus_only(model):
    engine = _engine(model)
    seq = engine.open([1, 2, 3], SamplingParams(), 10, eos_ids=())
    (res,) = engine.step([StepRequest(seq, [])])
    assert res.accepted == 0 and len(res.tokens) == 1 and res.position == 4


def test_eos_and_length_cut_the_emitted_tokens(model):
    serial = serial_run(_engine(model, n_slots=1), [1, 2, 3], 12)
    eos = serial.tokens[4]
    engine = _engine(model, max_k=8)
    seq = engine.open([1, 2, 3], SamplingParams(), 12, eos_ids=(eos,))
    first_eos = serial.tokens.index(eos)
    (res,) = engine.step([StepRequest(seq, serial.tokens[1:9])])
    assert res.finish_reason == "eos" and res.tokens == serial.tokens[1 : first_eos + 1]
    assert res.logits.shape[0] == len(res.tokens)
    (after,) = engine.step([StepRequest(seq, [])])
    assert after.error.code == "failed_precondition"

    seq = engine.open([1, 2, 3], SamplingParams(), 4, eos_ids=())
    (res,) = engine.step([StepRequest(seq, serial.tokens[1:9])])
    assert res.finish_reason == "length" and res.tokens == serial.tokens[1:4]


def test_open_errors(model):
    engine = _engine(model, n_slots=1, max_seq_len=8)
    with pytest.raises(StepError, match="prompt is empty"):
        engine.open([], SamplingParams(), 4)
    with pytest.raises(StepError, match=r"prompt token ids \[200\]"):
        engine.open([1, 200], SamplingParams(), 4)
    with pytest.raises(StepError, match="max_new_tokens must be at least 1"):
        engine.open([1], SamplingParams(), 0)
    with pytest.raises(StepError, match="leaves no room"):
        engine.open(list(range(8)), SamplingParams(), 4)
    assert engine.pool.n_free == 1  # failed opens hold no slot
    engine.open([1], SamplingParams(), 4)
    with pytest.raises(PoolFullError):
        engine.open([1], SamplingParams(), 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=-2), "top_k must be"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(seed=-1), "seed must be"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
