"""Property: under any schedule of steps (which sequences share a step, their K, right and wrong
drafts, closes and reopens into reused slots), every emitted token and logit row is the serial one."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitexact.conftest import prompt_for
from bitexact.serial import serial_run, slot_state, states_equal
from verifier.engine import Engine, StepRequest
from verifier.params import SamplingParams

N_TOKENS = 12
N_PROMPTS = 3

step_plan = st.lists(  # one engine step: (prompt index, K, number of right drafts) per sequence taking part
    st.tuples(st.integers(0, N_PROMPTS - 1), st.integers(0, 6), st.integers(0, 6)),
    min_size=1, max_size=3, unique_by=lambda t: t[0],
)


def _check_schedule(model, serials, prompts, mode, schedule):
    vocab = model.config.vocab_size
    engine = Engine(model, 2, 48, max_k=6, rollback_mode=mode)  # 2 slots for 3 prompts: slots get reused
    open_seqs, streams, rows = {}, {}, {}
    for plan in schedule:
        requests, owners = [], []
        for idx, k, right in plan:
            if idx not in open_seqs:
                if engine.pool.n_free == 0:  # close the oldest sequence not in this step to make room
                    victims = [i for i in open_seqs if i not in owners]
                    if not victims:
                        continue
                    engine.close(open_seqs.pop(victims[0]))
                seq = engine.open(prompts[idx], SamplingParams(), N_TOKENS, eos_ids=())
                open_seqs[idx], streams[idx], rows[idx] = seq, [seq.pending], [seq.first_logits[None]]
            seq = open_seqs[idx]
            if seq.finished:
                continue
            truth = serials[idx].tokens[len(streams[idx]) : len(streams[idx]) + k]
            drafts = [t if i < right else (t + 1) % vocab for i, t in enumerate(truth)]
            requests.append(StepRequest(seq, drafts))
            owners.append(idx)
        for idx, res in zip(owners, engine.step(requests)):
            assert res.error is None
            streams[idx] += res.tokens
            rows[idx].append(res.logits)
            seq = open_seqs[idx]
            assert states_equal(slot_state(engine, seq.slot, seq.position), serials[idx].states[seq.position])
        for idx in list(open_seqs):
            n = len(streams[idx])
            assert streams[idx] == serials[idx].tokens[:n]
            assert torch.equal(torch.cat(rows[idx]), serials[idx].logits[:n])
            if open_seqs[idx].finished:  # a finished sequence is closed; the prompt may open again later
                engine.close(open_seqs.pop(idx))


def _property(family):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(schedule=st.lists(step_plan, min_size=1, max_size=8), mode=st.sampled_from(["woa", "snapshot"]))
    def check(model_of, schedule, mode):
        model = model_of(family)
        prompts = [prompt_for(model, 3 + 4 * i, seed=20 + i) for i in range(N_PROMPTS)]
        serials = _serials(model, family, prompts)
        _check_schedule(model, serials, prompts, mode, schedule)

    return check


_SERIAL_CACHE = {}


def _serials(model, family, prompts):
    if family not in _SERIAL_CACHE:
        _SERIAL_CACHE[family] = [serial_run(Engine(model, 1, 48), p, N_TOKENS) for p in prompts]
    return _SERIAL_CACHE[family]


test_random_schedules_qwen3_next = _property("qwen3_next_moe")
test_random_schedules_kimi_linear = _property("kimi_linear")
