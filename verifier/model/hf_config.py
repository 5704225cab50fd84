"""Read an HF `config.json` into a `ModelConfig`.

Supported `model_type`s: `qwen3_next`, `qwen3_5` (its `text_config`), `qwen3_5_text`,
`qwen3_5_moe` (its `text_config`), `qwen3_5_moe_text`, and `kimi_linear` (the field names
transformers saves and the original `linear_attn_config` form). Defaults are those of the
transformers configuration classes, so a config that omits a field means what it means to
transformers; a field set to a value our engine does not compute is refused (ConfigError).
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import (
    ATTENTION,
    DENSE,
    GDN,
    KDA,
    MLA,
    MOE,
    AttentionConfig,
    GDNConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear")
# Multimodal wrappers -> the model_type of their `text_config` (the text model we serve).
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Qwen3.5-MoE: transformers builds the sparse block in every layer (it reads neither
# decoder_sparse_step nor mlp_only_layers) and always renormalises the top-k weights.
_QWEN35_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_REQUIRED = object()


class ConfigError(ValueError):
    """A config.json we cannot compute from; the message names the field."""


def _get(cfg: dict, *names: str, default=_REQUIRED):
    """First present (non-None) field among `names`, else `default`."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is _REQUIRED:
        raise ConfigError(f"config.json: missing field {names[0]!r}")
    return default


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_json_object(path: str | Path) -> dict:
    """A checkpoint's JSON file (config.json, the shard index) as a dict; ConfigError naming the
    file and where it stops parsing when it is not a JSON object."""
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must hold a JSON object, holds a {type(value).__name__}")
    return value


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    return config_from_dict(read_json_object(path))


def config_from_dict(cfg: dict) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type in _WRAPPERS:
        return _qwen(_text_config(cfg, model_type), model_type)
    if model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        return _qwen(cfg, model_type)
    if model_type == "kimi_linear":
        return _kimi(cfg)
    raise ConfigError(
        f"config.json: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _text_config(cfg: dict, model_type: str) -> dict:
    """The `text_config` of a multimodal wrapper, completed with what transformers takes from the
    wrapper: its tie_word_embeddings (the wrapper's value decides when it has one, as in
    transformers' Qwen3_5(Moe)ForConditionalGeneration) and its eos_token_id when the text has none.
    The vision tower's fields are not read: its tensors are skipped."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: model_type {model_type!r} needs a 'text_config' object")
    text = dict(text)
    text.setdefault("model_type", _WRAPPERS[model_type])
    if cfg.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    if text.get("eos_token_id") is None and cfg.get("eos_token_id") is not None:
        text["eos_token_id"] = cfg["eos_token_id"]
    return text


def _require(cfg: dict, name: str, computed, why: str) -> None:
    """Refuse a field whose value our engine does not compute (absent means the computed value)."""
    value = cfg.get(name)
    if value is not None and value != computed:
        raise ConfigError(f"config.json: {name} = {value!r} is not supported ({why}; only {computed!r})")


def _rope(cfg: dict) -> tuple[float, float]:
    """(theta, partial_rotary_factor), from `rope_parameters` (newer files) or top-level fields."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"config.json: rope_type {rope_type!r} is not supported (only default rotary)")
    theta = float(_get(rope, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0)))
    factor = float(_get(rope, "partial_rotary_factor", default=_get(cfg, "partial_rotary_factor", default=0.25)))
    return theta, factor


def _qwen(cfg: dict, model_type: str) -> ModelConfig:
    _require(cfg, "hidden_act", "silu", "the MLPs and experts compute SwiGLU")
    _require(cfg, "attn_output_gate", True, "full attention is always sigmoid-gated, as in transformers")
    n_layers = int(_get(cfg, "num_hidden_layers"))
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(_get(cfg, "full_attention_interval", default=4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    mixers = _mixers(layer_types, n_layers, GDN)

    head_dim = int(_get(cfg, "head_dim", default=256))
    theta, factor = _rope(cfg)
    attention = AttentionConfig(
        n_heads=int(_get(cfg, "num_attention_heads")),
        n_kv_heads=int(_get(cfg, "num_key_value_heads")),
        head_dim=head_dim,
        rotary_dim=int(head_dim * factor),
        rope_theta=theta,
        bias=bool(_get(cfg, "attention_bias", default=False)),
    )
    gdn = GDNConfig(
        n_k_heads=int(_get(cfg, "linear_num_key_heads", default=16)),
        n_v_heads=int(_get(cfg, "linear_num_value_heads", default=32)),
        d_k=int(_get(cfg, "linear_key_head_dim", default=128)),
        d_v=int(_get(cfg, "linear_value_head_dim", default=128)),
        conv_width=int(_get(cfg, "linear_conv_kernel_dim", default=4)),
        interleaved_projection=model_type == "qwen3_next",
    )

    if model_type in _QWEN35_MOE_TYPES:
        moe, mlps = _qwen35_moe(cfg, n_layers)
        intermediate_size = 0  # no dense MLP; transformers' text model never reads intermediate_size
    else:
        moe, mlps = _qwen_next_moe(cfg, n_layers) if model_type == "qwen3_next" else (None, (DENSE,) * n_layers)
        intermediate_size = int(_get(cfg, "intermediate_size"))

    return _model_config(
        cfg, model_type, mixers, mlps,
        eps_default=1e-6, zero_centred_norm=True, max_positions=(("max_position_embeddings",), 32768),
        intermediate_size=intermediate_size,
        attention=attention if ATTENTION in mixers else None,
        gdn=gdn if GDN in mixers else None,
        moe=moe,
    )


def _qwen_sparse_block(cfg: dict, *, n_experts: int, top_k: int, renormalize: bool) -> MoEConfig:
    """The Qwen sparse block: softmax top-k router, sigmoid-gated shared expert. The expert counts'
    defaults differ by family; the expert sizes' do not."""
    return MoEConfig(
        router="softmax",
        n_experts=n_experts,
        top_k=top_k,
        expert_intermediate_size=int(_get(cfg, "moe_intermediate_size", default=512)),
        renormalize=renormalize,
        shared_intermediate_size=int(_get(cfg, "shared_expert_intermediate_size", default=512)),
        shared_gate=True,
    )


def _qwen_next_moe(cfg: dict, n_layers: int) -> tuple[MoEConfig | None, tuple[str, ...]]:
    """Qwen3-Next: MoE at layer i unless i is in mlp_only_layers, num_experts is 0, or
    (i + 1) % decoder_sparse_step != 0."""
    n_experts = int(_get(cfg, "num_experts", default=512))
    if n_experts <= 0:
        return None, (DENSE,) * n_layers
    moe = _qwen_sparse_block(cfg, n_experts=n_experts, top_k=int(_get(cfg, "num_experts_per_tok", default=10)),
                             renormalize=bool(_get(cfg, "norm_topk_prob", default=True)))
    mlp_only = set(_get(cfg, "mlp_only_layers", default=[]))
    step = int(_get(cfg, "decoder_sparse_step", default=1))
    return moe, tuple(MOE if i not in mlp_only and (i + 1) % step == 0 else DENSE for i in range(n_layers))


def _qwen35_moe(cfg: dict, n_layers: int) -> tuple[MoEConfig, tuple[str, ...]]:
    """Qwen3.5-MoE: the sparse block in every layer, top-k weights always renormalised. Fields of
    Qwen3-Next's layout that transformers does not read for this family are accepted only at the
    value it computes anyway. Ignored, as transformers ignores them: the router's training fields
    (router_aux_loss_coef, output_router_logits), mtp_* (the MTP head's tensors are skipped) and
    mamba_ssm_dtype (a hint to other engines; our recurrent state is fp32 always)."""
    _require(cfg, "norm_topk_prob", True, "qwen3_5_moe always renormalises the top-k router weights")
    _require(cfg, "decoder_sparse_step", 1, "qwen3_5_moe has the sparse block in every layer")
    if cfg.get("mlp_only_layers"):
        raise ConfigError(f"config.json: mlp_only_layers = {cfg['mlp_only_layers']!r} is not supported "
                          "(qwen3_5_moe has the sparse block in every layer; only [])")
    n_experts = int(_get(cfg, "num_experts", default=256))
    if n_experts <= 0:
        raise ConfigError(f"config.json: num_experts = {n_experts} (qwen3_5_moe needs at least one expert)")
    moe = _qwen_sparse_block(cfg, n_experts=n_experts, top_k=int(_get(cfg, "num_experts_per_tok", default=8)), renormalize=True)
    return moe, (MOE,) * n_layers


def _model_config(cfg: dict, model_type: str, mixers: tuple[str, ...], mlps: tuple[str, ...], *, eps_default: float,
                  zero_centred_norm: bool, max_positions: tuple[tuple[str, ...], int], intermediate_size: int,
                  **sections) -> ModelConfig:
    """The ModelConfig of a family: the fields every family reads alike, those it reads its own way
    (the norm epsilon's default, the norm's form, the context length's names and default, the dense
    MLP's size), and its layer sections (attention, mla, gdn, kda, moe)."""
    max_position_names, max_position_default = max_positions
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=int(_get(cfg, "hidden_size")),
        mixers=mixers,
        mlps=mlps,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", default=eps_default)),
        zero_centred_norm=zero_centred_norm,
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
        intermediate_size=intermediate_size,
        max_position_embeddings=int(_get(cfg, *max_position_names, default=max_position_default)),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        **sections,
    )


def _mixers(layer_types: list, n_layers: int, linear_kind: str) -> tuple[str, ...]:
    """layer_types ("full_attention" / "linear_attention" per layer) -> our mixer kinds, one per layer."""
    mixers = tuple(_mixer(t, i, linear_kind) for i, t in enumerate(layer_types))
    if len(mixers) != n_layers:
        raise ConfigError(f"config.json: layer_types has {len(mixers)} entries for {n_layers} layers")
    return mixers


def _mixer(layer_type: str, index: int, linear_kind: str) -> str:
    if layer_type == "full_attention":
        return MLA if linear_kind == KDA else ATTENTION
    if layer_type == "linear_attention":
        return linear_kind
    raise ConfigError(f"config.json: layer_types[{index}] = {layer_type!r} is neither full_attention nor linear_attention")


def _kimi(cfg: dict) -> ModelConfig:
    n_layers = int(_get(cfg, "num_hidden_layers"))
    lac = cfg.get("linear_attn_config") or {}
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if "full_attn_layers" in lac and "kda_layers" in lac:
            layer_types = [None] * n_layers
            for i in lac["full_attn_layers"]:  # 1-indexed in the original config
                layer_types[i - 1] = "full_attention"
            for i in lac["kda_layers"]:
                layer_types[i - 1] = "linear_attention"
            missing = [i for i, t in enumerate(layer_types) if t is None]
            if missing:
                raise ConfigError(f"config.json: linear_attn_config leaves layers {missing} (0-indexed) unassigned")
        else:  # the transformers default
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    mixers = _mixers(layer_types, n_layers, KDA)

    if cfg.get("mla_use_nope") is False:
        raise ConfigError("config.json: mla_use_nope false (rotary MLA) is not supported")
    mla = MLAConfig(
        n_heads=int(_get(cfg, "num_attention_heads")),
        kv_lora_rank=int(_get(cfg, "kv_lora_rank", default=512)),
        qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim", default=128)),
        qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim", default=64)),
        v_head_dim=int(_get(cfg, "v_head_dim", default=128)),
        q_lora_rank=cfg.get("q_lora_rank"),
    )
    lower_bound = lac.get("gate_lower_bound", cfg.get("gate_lower_bound"))
    kda = KDAConfig(
        n_heads=int(_get(lac, "num_heads", default=_get(cfg, "linear_num_heads", default=32))),
        head_dim=int(_get(lac, "head_dim", default=_get(cfg, "linear_head_dim", default=128))),
        conv_width=int(_get(lac, "short_conv_kernel_size", default=_get(cfg, "linear_conv_kernel_dim", default=4))),
        gate_law="bounded" if lower_bound is not None else "softplus",
        gate_lower_bound=None if lower_bound is None else float(lower_bound),
    )

    n_experts = int(_get(cfg, "num_experts", "num_local_experts", default=0))
    moe = None
    mlps = (DENSE,) * n_layers
    if n_experts > 0:
        activation = _get(cfg, "moe_router_activation_func", default="sigmoid")
        if activation != "sigmoid":
            raise ConfigError(f"config.json: moe_router_activation_func {activation!r} is not supported (sigmoid only)")
        grouped = bool(_get(cfg, "use_grouped_topk", default=True))
        moe = MoEConfig(
            router="sigmoid",
            n_experts=n_experts,
            top_k=int(_get(cfg, "num_experts_per_token", "num_experts_per_tok", default=8)),
            expert_intermediate_size=int(_get(cfg, "moe_intermediate_size", default=1024)),
            renormalize=bool(_get(cfg, "moe_renormalize", "norm_topk_prob", default=True)),
            shared_intermediate_size=int(_get(cfg, "moe_intermediate_size", default=1024))
            * int(_get(cfg, "num_shared_experts", "n_shared_experts", default=1)),
            routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", default=2.446)),
            n_group=int(_get(cfg, "num_expert_group", "n_group", default=1)) if grouped else 1,
            topk_group=int(_get(cfg, "topk_group", default=1)) if grouped else 1,
        )
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            first_dense = int(_get(cfg, "first_k_dense_replace", default=1))
            freq = int(_get(cfg, "moe_layer_freq", default=1))
            mlp_types = ["sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(n_layers)]
        if len(mlp_types) != n_layers:
            raise ConfigError(f"config.json: mlp_layer_types has {len(mlp_types)} entries for {n_layers} layers")
        for i, t in enumerate(mlp_types):
            if t not in ("dense", "sparse"):
                raise ConfigError(f"config.json: mlp_layer_types[{i}] = {t!r} is neither dense nor sparse")
        mlps = tuple(MOE if t == "sparse" else DENSE for t in mlp_types)

    return _model_config(
        cfg, "kimi_linear", mixers, mlps,
        eps_default=1e-5, zero_centred_norm=False, max_positions=(("model_max_length", "max_position_embeddings"), 1048576),
        intermediate_size=int(_get(cfg, "intermediate_size")),
        mla=mla if MLA in mixers else None,
        kda=kda if KDA in mixers else None,
        moe=moe,
    )
