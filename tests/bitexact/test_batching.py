"""Bits do not depend on the batch: many sequences at different positions with different K in one
step give exactly what each gives alone; a reused slot behaves like a fresh one."""

import pytest
import torch

from bitexact.conftest import FAMILIES, prompt_for
from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepRequest
from verifier.model.rollback import ROLLBACK_MODES
from verifier.params import SamplingParams

PLAN = [  # per step, per sequence: (K, how many of the K drafts are right)
    [(3, 3), (0, 0), (5, 2), (1, 0)],
    [(8, 1), (2, 2), (0, 0), (4, 4)],
    [(1, 1), (6, 0), (3, 1), (2, 1)],
]


def _drafts(serial, emitted, k, right, vocab):
    truth = serial.tokens[emitted : emitted + k]
    return [t if i < right else (t + 7) % vocab for i, t in enumerate(truth)]


def _run(model, prompts, serials, mode, together):
    engine = Engine(model, len(prompts), 64, max_k=8, rollback_mode=mode)
    seqs = [engine.open(p, SamplingParams(), 40, eos_ids=()) for p in prompts]
    emitted = [1] * len(seqs)
    rows = [[s.first_logits[None]] for s in seqs]
    states = [[] for _ in seqs]
    for plan in PLAN:
        requests = [StepRequest(s, _drafts(serials[i], emitted[i], k, right, model.config.vocab_size)) for i, (s, (k, right)) in enumerate(zip(seqs, plan))]
        results = engine.step(requests) if together else [engine.step([r])[0] for r in requests]
        for i, res in enumerate(results):
            assert res.error is None
            emitted[i] += len(res.tokens)
            rows[i].append(res.logits)
            states[i].append(slot_state(engine, seqs[i].slot, seqs[i].position))
    return [torch.cat(r) for r in rows], states, [s.position for s in seqs]


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_batch_equals_each_sequence_alone_and_serial(model_of, name, mode):
    model = model_of(name)
    prompts = [prompt_for(model, n, seed=n) for n in (4, 9, 6, 13)]
    serials = [serial_run(Engine(model, 1, 64), p, 30) for p in prompts]
    rows_t, states_t, pos_t = _run(model, prompts, serials, mode, together=True)
    rows_a, states_a, pos_a = _run(model, prompts, serials, mode, together=False)
    assert pos_t == pos_a
    for i in range(len(prompts)):
        assert torch.equal(rows_t[i], rows_a[i]), f"sequence {i}: rows differ between batched and alone"
        assert all(states_equal(x, y) for x, y in zip(states_t[i], states_a[i]))
        n = rows_t[i].shape[0]
        assert torch.equal(rows_t[i], serials[i].logits[:n]), f"sequence {i}: rows differ from serial"
        assert states_equal(states_t[i][-1], serials[i].states[pos_t[i]])


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_reused_slot_behaves_like_a_fresh_one(model_of, mode):
    model = model_of("kimi_linear")
    prompt = prompt_for(model, 6, seed=4)
    fresh = serial_run(Engine(model, 1, 64), prompt, 8)
    engine = Engine(model, 1, 64, max_k=4, rollback_mode=mode)
    other = engine.open(prompt_for(model, 11, seed=9), SamplingParams(), 20, eos_ids=())
    for _ in range(3):
        engine.step([StepRequest(other, [1, 2, 3])])
    engine.close(other)
    reused = serial_run(engine, prompt, 8)
    assert reused.tokens == fresh.tokens and torch.equal(reused.logits, fresh.logits)
    assert all(states_equal(reused.states[p], fresh.states[p]) for p in fresh.states)
