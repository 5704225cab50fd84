"""GDN's prefill in chunked form (verifier/model/layers/linear_attention.py, CHUNKED_PREFILL): near
the serial walk's results, and what prefill promises holds with it: a cached start equals a cold
one and prompts prefilled together equal each alone, torch.equal."""

import pytest
import test_prefill_together
import test_prefix_cache
import torch

import hybrid_kernels.delta_rule_chunked as delta_rule_chunked
from verifier.model.layers import linear_attention

GDN_MODELS = ["qwen3_5_text", "qwen3_next_moe"]  # KDA (kimi_linear) walks rows either way


@pytest.fixture
def chunked(monkeypatch):
    monkeypatch.setattr(linear_attention, "CHUNKED_PREFILL", True)


def test_chunked_prefill_runs_and_is_near_the_serial_walk(load_target, monkeypatch):
    model = load_target("qwen3_next_moe")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (150,), generator=gen).tolist()  # sub-chunks of 64: 3 of them
    pool = model.new_pool(2, 160)
    serial = model.prefill(pool, pool.admit(), prompt, chunk=160, all_logits=True)
    calls = []
    for name in ("delta_rule_chunked", "delta_rule_chunked_ref"):
        original = getattr(delta_rule_chunked, name)
        monkeypatch.setattr(delta_rule_chunked, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    monkeypatch.setattr(linear_attention, "CHUNKED_PREFILL", True)
    chunked = model.prefill(pool, pool.admit(), prompt, chunk=160, all_logits=True)
    assert calls, "the chunked form did not run"
    # one recurrence in two fp32 orders: as test_slots_and_decode's chunked prefill, a tolerance check
    assert (serial - chunked).abs().max() <= 1e-5 * serial.abs().max()


@pytest.mark.parametrize("name", GDN_MODELS)
def test_a_cached_start_equals_a_cold_start(load_target, chunked, name):
    test_prefix_cache.test_a_cached_start_equals_a_cold_start(load_target, name, "woa")


@pytest.mark.parametrize("name", GDN_MODELS)
def test_prompts_prefilled_together_equal_each_alone(load_target, chunked, name):
    test_prefill_together.test_prompts_prefilled_together_equal_each_alone(load_target, name)
