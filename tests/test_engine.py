"""Engine checks and finishing: a request its sequence's state refuses gets a clear error and changes
nothing else; what callers must check is asserted; the emitted tokens are cut at eos and the budget."""

import pytest
import torch

from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepRequest
from verifier.model import PoolFullError
from verifier.params import SamplingParams


@pytest.fixture(scope="module")
def model(load_target):
    return load_target("qwen3_next_moe")


def _engine(model, **kw):
    return Engine(model, kw.pop("n_slots", 2), kw.pop("max_seq_len", 32), max_k=kw.pop("max_k", 4), **kw)


def test_state_errors_fail_alone(model):
    """A request its sequence's state refuses (finished; rows past the context) gets its StepError,
    changes nothing, and the other sequence of the step runs as serial decode does."""
    engine = _engine(model, n_slots=3, max_seq_len=16)
    good = engine.open([5, 6, 7], SamplingParams(), 10, eos_ids=())
    finished = engine.open([8, 9], SamplingParams(), 1, eos_ids=())  # the first token is the whole budget
    crowded = engine.open(list(range(1, 14)), SamplingParams(), 10, eos_ids=())  # 13 of 16 positions
    before = [slot_state(engine, s.slot, s.position) for s in (finished, crowded)]
    results = engine.step([StepRequest(finished, [1]), StepRequest(crowded, [1, 2, 3]), StepRequest(good, [4])])
    assert results[0].error.code == "failed_precondition" and "has finished (length)" in str(results[0].error)
    assert results[1].error.code == "out_of_range" and "4 rows from position 13 pass max_seq_len 16" in str(results[1].error)
    assert [r.position for r in results[:2]] == [finished.position, crowded.position]  # where each still is
    assert results[2].error is None and len(results[2].tokens) >= 1
    after = [slot_state(engine, s.slot, s.position) for s in (finished, crowded)]
    assert all(states_equal(a, b) for a, b in zip(after, before))
    serial = serial_run(_engine(model, n_slots=1), [5, 6, 7], 10)
    assert results[2].tokens == serial.tokens[1 : 1 + len(results[2].tokens)]


@pytest.mark.parametrize(
    "make_request, message",
    [
        (lambda s, v: StepRequest(s, [1] * 5), "5 drafts exceed max_k 4"),
        (lambda s, v: StepRequest(s, [1, v]), "token id out of range"),
        (lambda s, v: StepRequest(s, [-1]), "token id out of range"),
        (lambda s, v: StepRequest(s, [1, 2], torch.ones(3, v) / v), r"draft_probs has shape \[3, 96\], expected \[2, 96\]"),
    ],
    ids=["k-over-max", "id-past-vocab", "negative-id", "probs-shape"],
)
def test_caller_bugs_are_assertions(model, make_request, message):
    """What the server's validation (or the in-process caller) guarantees is asserted, before any
    state changes: the engine does not check wire fields a second time."""
    engine = _engine(model)
    seq = engine.open([8, 9], SamplingParams(), 10, eos_ids=())
    before = slot_state(engine, seq.slot, seq.position)
    with pytest.raises(AssertionError, match=message):
        engine.step([make_request(seq, model.config.vocab_size)])
    assert seq.position == 2 and states_equal(slot_state(engine, seq.slot, seq.position), before)


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
    # accepted counts the drafts the target agreed with before the cut: all 8 here
    assert res.accepted == 8 and len(res.tokens) < res.accepted + 1
    assert res.logits.shape[0] == len(res.tokens)
    (after,) = engine.step([StepRequest(seq, [])])
    assert after.error.code == "failed_precondition"

    seq = engine.open([1, 2, 3], SamplingParams(), 4, eos_ids=())
    (res,) = engine.step([StepRequest(seq, serial.tokens[1:9])])
    assert res.finish_reason == "length" and res.tokens == serial.tokens[1:4] and res.accepted == 8


def test_open_asserts_its_arguments_and_holds_no_slot_after(model):
    """The caller checks a prompt (non-empty, in the vocabulary, room for a step) and the budget;
    the engine asserts them, and a failed open holds no slot."""
    engine = _engine(model, n_slots=1, max_seq_len=8)
    for prompt, budget, message in [([], 4, "needs a prompt"), ([1, 200], 4, r"token id out of range"),
                                    ([1], 0, "max_new_tokens >= 1"), (list(range(8)), 4, "fills max_seq_len 8")]:
        with pytest.raises(AssertionError, match=message):
            engine.open(prompt, SamplingParams(), budget)
        assert engine.pool.n_free == 1
    engine.open([1], SamplingParams(), 4)
    with pytest.raises(PoolFullError):
        engine.open([1], SamplingParams(), 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=-2), "top_k must be"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(seed=-1), "seed must be"),
    # below float32's reach: logits / temperature would overflow, top_p would round to nothing
    (dict(temperature=1e-310), r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"),
    (dict(top_p=1e-300), r"top_p must be in \[1e-06, 1\]"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_step_failing_midway_loses_its_sequences_clearly(model, monkeypatch):
    """A failure after the verify (a bug or a device fault, never bad input) leaves the step's
    sequences unusable with a clear error, since a decode's verify has already committed its row's
    recurrent state; a sequence outside the step keeps decoding as serial decode does."""
    engine = _engine(model, n_slots=3)
    decoding = engine.open([5, 6, 7], SamplingParams(), 10, eos_ids=())
    drafting = engine.open([8, 9], SamplingParams(), 10, eos_ids=())
    other = engine.open([5, 6, 7], SamplingParams(), 10, eos_ids=())

    def broken(*args, **kwargs):
        raise RuntimeError("acceptance broke")

    with monkeypatch.context() as patch:
        patch.setattr("verifier.engine.accept", broken)
        with pytest.raises(RuntimeError, match="acceptance broke"):
            engine.step([StepRequest(decoding, []), StepRequest(drafting, [1, 2])])
    results = engine.step([StepRequest(decoding, []), StepRequest(drafting, [1]), StepRequest(other, [])])
    for result in results[:2]:
        assert result.error.code == "failed_precondition" and "engine step failed midway" in str(result.error)
    assert results[2].error is None
    serial = serial_run(_engine(model, n_slots=1), [5, 6, 7], 10)
    assert results[2].tokens == serial.tokens[1:2]
