"""Parity with HF transformers, the oracle, on checkpoints transformers itself saved.

This is a tolerance check, not a bit check: transformers prefills the linear-attention layers
with the chunked delta rule (another association of the same sums) and convolves with
F.conv1d, so fp32 rounding differs; in MoE layers it also adds the routed experts' outputs in
another order (expert by expert with index_add) and sums the top-k weights with torch.sum, where
we sum per row in ascending expert order. Tolerance: max |ours - hf| <= 1e-4 * max |hf| on every
logit row (we measure ~1e-7 to ~1e-6 relative, MoE families included; 1e-4 leaves room for other
BLAS builds while still catching any wrong cast, norm form, gate or routing rule (a missing
renormalisation, a wrong expert half), which move logits by 1e-3 or more).

Every spec of SPECS runs here: for Qwen3.5-MoE, the bare text model with per-expert tensors and the
multimodal wrapper with fused experts, vision and `mtp.*` tensors.
"""

import pytest
import torch

from conftest import ALL_SPECS
from presets.hf_reference import load_hf
from verifier.engine import Engine
from verifier.generate import generate

REL_TOL = 1e-4
PROMPT_LEN = 11
NEW_TOKENS = 24


def assert_close_to_hf(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    ours, ref = ours.cpu(), ref.cpu()  # with --model-device cuda our logits stay on the GPU
    assert not torch.isnan(ours).any(), f"{what}: NaN in our logits"
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= REL_TOL * scale, f"{what}: max abs error {err:.3e} over logit scale {scale:.3e} (tolerance {REL_TOL:g} relative)"


def _prompt(vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()


@pytest.mark.parametrize("name", ALL_SPECS)
def test_prefill_logits_match_hf(hf_checkpoint, load_target, name):
    path = hf_checkpoint(name)
    hf, ours = load_hf(path), load_target(name)
    prompt = _prompt(ours.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    pool = ours.new_pool(1, 64)
    logits = ours.prefill(pool, pool.admit(), prompt, all_logits=True).cpu()
    assert logits.shape == ref.shape
    assert_close_to_hf(logits, ref, f"{name} prefill")


@pytest.mark.parametrize("name", ALL_SPECS)
def test_greedy_continuation_and_decode_logits_match_hf(hf_checkpoint, load_target, name):
    path = hf_checkpoint(name)
    hf, ours = load_hf(path), load_target(name)
    prompt = _prompt(ours.config.vocab_size)
    ids = torch.tensor([prompt])
    out = hf.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
    )
    hf_tokens = out.sequences[0, PROMPT_LEN:].tolist()
    result = generate(Engine(ours, 1, PROMPT_LEN + NEW_TOKENS), prompt, NEW_TOKENS, eos_ids=())
    assert result.tokens == hf_tokens, f"{name}: greedy continuation differs from HF generate"
    for step, hf_logits in enumerate(out.logits):
        assert_close_to_hf(result.logits[step], hf_logits[0].float(), f"{name} decode step {step}")
