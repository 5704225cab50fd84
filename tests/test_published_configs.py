"""Published Qwen3.5-MoE config.json files, as a user brings them.

The configs themselves live in presets/published.py (how they were reconstructed).

The full-size files must parse; shrunk copies (sizes reduced, nothing else) get random weights
saved by transformers and one greedy decode step that matches transformers.
"""

import copy

import pytest
import torch

from presets.hf_reference import load_hf, save_random_hf_checkpoint
from presets.published import PUBLISHED, PUBLISHED_SIZES, QWEN35_35B_A3B, QWEN36_35B_A3B
from test_hf_parity import assert_close_to_hf  # its docstring says the tolerance and why
from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.config import ATTENTION, GDN, MOE
from verifier.model.hf_config import config_from_dict



# Sizes only: every other value (token ids, theta, context length, flags) stays as published.
_TEXT_SIZES = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
    shared_expert_intermediate_size=12,
)
_MROPE_SECTION = [2, 1, 1]  # sums to the rotary half-width: int(32 * 0.25) / 2, as [11, 11, 10] does at head_dim 256
_VISION_SIZES = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, num_position_embeddings=16, out_hidden_size=32, patch_size=4)


def shrunk(published: dict) -> dict:
    cfg = copy.deepcopy(published)
    cfg["text_config"].update(copy.deepcopy(_TEXT_SIZES))
    cfg["text_config"]["rope_parameters"]["mrope_section"] = list(_MROPE_SECTION)
    cfg["vision_config"].update(_VISION_SIZES)
    return cfg


def test_shrunk_copies_keep_every_field():
    for published in PUBLISHED.values():
        small = shrunk(published)
        assert small.keys() == published.keys()
        for section in ("text_config", "vision_config"):
            assert small[section].keys() == published[section].keys(), section
        assert small["text_config"]["rope_parameters"].keys() == published["text_config"]["rope_parameters"].keys()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_size_published_config_parses(name):
    cfg = config_from_dict(PUBLISHED[name])
    assert cfg.model_type == "qwen3_5_moe" and cfg.n_layers == 40
    assert cfg.mixers == (GDN, GDN, GDN, ATTENTION) * 10 and cfg.mlps == (MOE,) * 40
    assert (cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings) == (248320, 2048, 262144)
    assert cfg.eos_token_ids == (248044,) and not cfg.tie_word_embeddings and cfg.zero_centred_norm
    a = cfg.attention
    assert (a.n_heads, a.n_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (16, 2, 256, 64, 1e7)
    g = cfg.gdn
    assert (g.n_k_heads, g.n_v_heads, g.d_k, g.d_v, g.conv_width, g.interleaved_projection) == (16, 32, 128, 128, 4, False)
    m = cfg.moe
    assert (m.router, m.n_experts, m.top_k, m.expert_intermediate_size, m.shared_intermediate_size) == ("softmax", 256, 8, 512, 512)
    assert m.renormalize and m.shared_gate


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shrunk_published_checkpoint_decodes_like_transformers(name, tmp_path):
    path = save_random_hf_checkpoint(shrunk(PUBLISHED[name]), tmp_path / name)
    hf, ours = load_hf(path), load_model(path)
    assert ours.config.mlps == (MOE,) * 4 and ours.config.eos_token_ids == (248044,)
    prompt = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    result = generate(Engine(ours, 1, 16), prompt, 2, eos_ids=())  # prefill's token, then one decode step
    with torch.no_grad():
        ref_prefill = hf(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        ref_decode = hf(input_ids=torch.tensor([prompt + result.tokens[:1]])).logits[0, -1].float()
    assert result.tokens == [int(ref_prefill.argmax()), int(ref_decode.argmax())]
    assert_close_to_hf(result.logits[0], ref_prefill, f"{name} prefill")
    assert_close_to_hf(result.logits[1], ref_decode, f"{name} decode step")


# (model_type, layers, hidden, vocab, experts, top-k, expert width, mixers of the first four layers)
SIZES = {
    "Qwen3-Next-80B-A3B": ("qwen3_next", 48, 2048, 151936, 512, 10, 512, (GDN, GDN, GDN, ATTENTION)),
    "Qwen3.5-122B-A10B": ("qwen3_5_moe", 48, 3072, 248320, 256, 8, 1024, (GDN, GDN, GDN, ATTENTION)),
    "Qwen3.5-397B-A17B": ("qwen3_5_moe", 60, 4096, 248320, 512, 10, 1024, (GDN, GDN, GDN, ATTENTION)),
    "Kimi-Linear-48B-A3B": ("kimi_linear", 27, 2304, 163840, 256, 8, 1024, ("kda", "kda", "kda", "mla")),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_published_sizes_parse_at_their_sizes(name):
    """The other published checkpoints at their sizes (what the row-invariance sweep and the
    real-width GPU tests build) parse into the model the engine serves."""
    cfg = config_from_dict(PUBLISHED_SIZES[name])
    model_type, layers, hidden, vocab, experts, top_k, width, first_mixers = SIZES[name]
    assert (cfg.model_type, cfg.n_layers, cfg.hidden_size, cfg.vocab_size) == (model_type, layers, hidden, vocab)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_intermediate_size) == (experts, top_k, width)
    assert cfg.mixers[:4] == first_mixers and not cfg.tie_word_embeddings
