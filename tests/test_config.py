"""Reading HF config.json files into ModelConfig."""

import json

import pytest

from verifier.model import ConfigError, load_config
from verifier.model.config import ATTENTION, DENSE, GDN, KDA, MLA, MOE
from verifier.model.hf_config import config_from_dict


def test_qwen3_next_defaults_follow_transformers():
    cfg = config_from_dict({"model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert cfg.mixers == (GDN, GDN, GDN, ATTENTION) * 2  # full_attention_interval 4
    assert cfg.mlps == (DENSE, MOE, DENSE, MOE, DENSE, DENSE, DENSE, MOE)
    assert cfg.attention.head_dim == 256 and cfg.attention.rotary_dim == 64 and cfg.gdn.interleaved_projection
    assert cfg.moe.n_experts == 512 and cfg.moe.top_k == 10 and cfg.moe.shared_gate
    assert cfg.zero_centred_norm


def test_qwen3_5_text_config_inside_composite(hf_checkpoint):
    cfg = load_config(hf_checkpoint("qwen3_5_composite"))
    assert cfg.model_type == "qwen3_5" and not cfg.gdn.interleaved_projection
    assert cfg.mixers == (GDN, ATTENTION, GDN, ATTENTION) and cfg.mlps == (DENSE,) * 4


def test_rope_fields_top_level_or_rope_parameters():
    base = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    old = config_from_dict({**base, "rope_theta": 500.0, "partial_rotary_factor": 0.5})
    new = config_from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}})
    assert old.attention == new.attention and old.attention.rotary_dim == 8
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        config_from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


def test_kimi_original_form_equals_port_form(hf_checkpoint):
    """linear_attn_config (1-indexed layers) + first_k_dense_replace mean what the port's fields mean."""
    port = json.loads((hf_checkpoint("kimi_linear") / "config.json").read_text())
    original = {k: v for k, v in port.items() if k not in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")}
    original["linear_attn_config"] = {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 3, "head_dim": 10, "short_conv_kernel_size": 4}
    original["first_k_dense_replace"] = 1
    original["moe_layer_freq"] = 1
    a, b = config_from_dict(port), config_from_dict(original)
    assert a == b
    assert a.mixers == (KDA, MLA, KDA, MLA) and a.mlps == (DENSE, MOE, MOE, MOE)
    assert a.kda.gate_law == "softplus" and not a.zero_centred_norm
    assert a.moe.router == "sigmoid" and a.moe.n_group == 2 and a.moe.shared_intermediate_size == 32


def test_kimi_bounded_gate_law_is_read_from_the_config(hf_checkpoint):
    cfg = json.loads((hf_checkpoint("kimi_linear") / "config.json").read_text())
    cfg["linear_attn_config"] = {"gate_lower_bound": -5.0}
    parsed = config_from_dict(cfg)
    assert parsed.kda.gate_law == "bounded" and parsed.kda.gate_lower_bound == -5.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mamba"}, "unsupported model_type 'mamba'"),
        ({"num_hidden_layers": None}, "missing field 'num_hidden_layers'"),
        ({"layer_types": ["linear_attention", "sliding"]}, r"layer_types\[1\] = 'sliding'"),
        ({"layer_types": ["linear_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"num_key_value_heads": 3}, "not a multiple of n_kv_heads 3"),
    ],
)
def test_config_errors_name_the_field(change, message):
    cfg = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        config_from_dict(cfg)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
