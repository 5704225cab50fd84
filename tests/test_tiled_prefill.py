"""Prefill's attention in tiles of rows (verifier/model/layers/attend.py, TILED_PREFILL): on the
Triton backend near the row kernel's results, and what prefill promises holds with it: a cached
start equals a cold one and prompts prefilled together equal each alone, torch.equal. The CPU
reference has no tiled form, so these run with --model-device cuda and skip elsewhere."""

import pytest
import test_prefill_together
import test_prefix_cache
import torch

from hybrid_kernels import attention
from verifier.model.layers import attend

MODELS = ["qwen3_5_text", "kimi_linear"]  # gated attention (GQA) and MLA


@pytest.fixture
def tiled(monkeypatch, model_device):
    if model_device != "cuda":
        pytest.skip("the tiled prefill kernel runs on the Triton backend only (--model-device cuda)")
    monkeypatch.setattr(attend, "TILED_PREFILL", True)


@pytest.mark.parametrize("name", MODELS)
def test_tiled_prefill_runs_and_is_near_the_row_kernel(load_target, monkeypatch, tiled, name):
    model = load_target(name)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (150,), generator=gen).tolist()  # KV blocks of 64: 3 of them
    pool = model.new_pool(2, 160)
    monkeypatch.setattr(attend, "TILED_PREFILL", False)
    rows = model.prefill(pool, pool.admit(), prompt, chunk=64, all_logits=True)
    calls = []
    original = attend.attend_prefill
    monkeypatch.setattr(attend, "attend_prefill", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(attend, "TILED_PREFILL", True)
    tiles = model.prefill(pool, pool.admit(), prompt, chunk=64, all_logits=True)
    assert calls, "the tiled kernel did not run"
    # the same softmax in another association (attend_rows' tolerance, tests/kernel_tests/test_attention.py),
    # carried through the layers after it: within a few bf16 ulps of the logits' scale
    assert (rows.float() - tiles.float()).abs().max() <= 0.05 * rows.float().abs().max()
    assert attention.prefill_tile_rows(4, 1) == attention.TILE_M // 4


@pytest.mark.parametrize("name", MODELS)
def test_a_cached_start_equals_a_cold_start(load_target, tiled, name):
    test_prefix_cache.test_a_cached_start_equals_a_cold_start(load_target, name, "woa")


@pytest.mark.parametrize("name", MODELS)
def test_prompts_prefilled_together_equal_each_alone(load_target, tiled, name):
    test_prefill_together.test_prompts_prefilled_together_equal_each_alone(load_target, name)
