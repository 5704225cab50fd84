"""Reading HF config.json files into ModelConfig."""

import dataclasses
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


_QWEN35_MOE_TEXT = {"model_type": "qwen3_5_moe_text", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
                    "num_attention_heads": 2, "num_key_value_heads": 1}


def test_qwen3_5_moe_text_defaults_follow_transformers():
    """Qwen3_5MoeTextConfig's defaults: 256 experts, top 8, expert and shared sizes 512, every
    layer sparse, always renormalised; no dense MLP, so no intermediate_size is needed."""
    cfg = config_from_dict(_QWEN35_MOE_TEXT)
    assert cfg.mixers == (GDN, GDN, GDN, ATTENTION) and cfg.mlps == (MOE,) * 4 and cfg.intermediate_size == 0
    assert cfg.attention.head_dim == 256 and cfg.attention.rotary_dim == 64 and not cfg.gdn.interleaved_projection
    m = cfg.moe
    assert (m.router, m.n_experts, m.top_k, m.expert_intermediate_size, m.shared_intermediate_size) == ("softmax", 256, 8, 512, 512)
    assert m.renormalize and m.shared_gate and cfg.zero_centred_norm and not cfg.tie_word_embeddings


def test_qwen3_5_moe_wrapper_reads_its_text_config(hf_checkpoint):
    wrapped = json.loads((hf_checkpoint("qwen3_5_moe") / "config.json").read_text())
    bare = {**wrapped["text_config"], "model_type": "qwen3_5_moe_text", "tie_word_embeddings": wrapped["tie_word_embeddings"]}
    a, b = config_from_dict(wrapped), config_from_dict(bare)
    assert a.model_type == "qwen3_5_moe" and b.model_type == "qwen3_5_moe_text"
    assert a == dataclasses.replace(b, model_type="qwen3_5_moe")
    assert a.mixers == (GDN, ATTENTION, GDN, ATTENTION) and a.mlps == (MOE,) * 4 and a.moe.top_k == 2


@pytest.mark.parametrize("wrapper", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("outer, inner", [(True, None), (False, True), (True, False), (None, True), (None, None)])
def test_wrapper_tie_word_embeddings_means_what_it_means_to_transformers(wrapper, outer, inner):
    """transformers ties the head by the wrapper's field (default false) and ignores the text
    config's; only where the wrapper has none do we read the text config's (a file saved tied,
    without lm_head, then still loads)."""
    import transformers as tf

    from presets.tiny import SPECS

    text = dict(SPECS["qwen3_5_composite" if wrapper == "qwen3_5" else "qwen3_5_moe"][1])
    text.pop("tie_word_embeddings")
    if inner is not None:
        text["tie_word_embeddings"] = inner
    cfg = {"model_type": wrapper, "text_config": text, **({} if outer is None else {"tie_word_embeddings": outer})}
    hf_class = tf.Qwen3_5Config if wrapper == "qwen3_5" else tf.Qwen3_5MoeConfig
    hf_ties = hf_class(text_config=text, **({} if outer is None else {"tie_word_embeddings": outer})).tie_word_embeddings
    ours = config_from_dict(cfg).tie_word_embeddings
    if outer is not None or inner is None:
        assert ours == hf_ties
    else:
        assert ours == inner


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_topk_prob": False}, r"norm_topk_prob = False is not supported \(qwen3_5_moe always renormalises"),
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2 is not supported \(qwen3_5_moe has the sparse block in every layer"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\] is not supported"),
        ({"num_experts": 0}, "num_experts = 0"),
        ({"num_experts_per_tok": 300}, "top_k 300 must be within 1..n_experts 256"),
        ({"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not supported"),
        ({"attn_output_gate": False}, r"attn_output_gate = False is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type 'yarn'"),
    ],
)
def test_qwen3_5_moe_values_we_do_not_compute_are_refused(change, message):
    for cfg in ({**_QWEN35_MOE_TEXT, **change}, {"model_type": "qwen3_5_moe", "text_config": {**_QWEN35_MOE_TEXT, **change}}):
        with pytest.raises(ValueError, match=message):
            config_from_dict(cfg)


def test_qwen3_5_moe_fields_that_change_nothing_are_accepted():
    """Fields at the value transformers computes anyway, and training-only router fields."""
    plain = config_from_dict(_QWEN35_MOE_TEXT)
    extra = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "attn_output_gate": True,
             "router_aux_loss_coef": 0.5, "output_router_logits": True, "mamba_ssm_dtype": "float32",
             "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "intermediate_size": 77,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    assert config_from_dict({**_QWEN35_MOE_TEXT, **extra}) == plain


def test_a_dense_layer_needs_an_intermediate_size():
    cfg = config_from_dict(_QWEN35_MOE_TEXT)
    with pytest.raises(ValueError, match="layer 0 is a dense MLP but intermediate_size is 0"):
        dataclasses.replace(cfg, mlps=(DENSE, MOE, MOE, MOE))
