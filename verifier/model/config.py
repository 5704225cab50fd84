"""The model configuration our engine computes from: one dataclass per layer kind.

`ModelConfig` is family-neutral: every field says what the maths needs, not how a
checkpoint happened to name it. `hf_config.py` builds it from an HF `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_multiple(section: str, config, name: str, of: str) -> None:
    """Heads (or experts) split evenly into groups: config.<name> must be a multiple of config.<of>."""
    value, divisor = getattr(config, name), getattr(config, of)
    if value % divisor:
        raise ValueError(f"{section}: {name} {value} is not a multiple of {of} {divisor}")


def _check_conv_width(section: str, conv_width: int) -> None:
    """A short conv keeps conv_width - 1 inputs of window: at least one."""
    if conv_width < 2:
        raise ValueError(f"{section}: conv_width {conv_width} must be at least 2")


# Token mixers (per layer).
ATTENTION = "attention"  # gated full attention (Qwen3-Next / Qwen3.5)
MLA = "mla"  # multi-head latent attention without rotary (Kimi Linear)
GDN = "gdn"  # Gated DeltaNet (Qwen3-Next / Qwen3.5)
KDA = "kda"  # Kimi Delta Attention
MIXERS = (ATTENTION, MLA, GDN, KDA)
RECURRENT_MIXERS = (GDN, KDA)

# Channel mixers (per layer).
DENSE = "dense"
MOE = "moe"


@dataclass(frozen=True)
class AttentionConfig:
    """Gated full attention: q/k RMSNorm per head, partial rotary, GQA, sigmoid output gate."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor); an odd value rotates rotary_dim + 1 dims, as HF does
    rope_theta: float
    bias: bool = False

    def __post_init__(self):
        if not 0 <= self.rotary_dim + self.rotary_dim % 2 <= self.head_dim:
            raise ValueError(f"attention: rotary_dim {self.rotary_dim} does not fit in head_dim {self.head_dim}")
        _check_multiple("attention", self, "n_heads", "n_kv_heads")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention as Kimi Linear uses it: no rotary (the 'rope' part is a shared key slice)."""

    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class GDNConfig:
    """Gated DeltaNet. Value head j reads key head j // (n_v_heads // n_k_heads)."""

    n_k_heads: int
    n_v_heads: int
    d_k: int
    d_v: int
    conv_width: int
    interleaved_projection: bool  # Qwen3-Next in_proj_qkvz/in_proj_ba versus Qwen3.5 in_proj_qkv/z/b/a

    def __post_init__(self):
        _check_multiple("gdn", self, "n_v_heads", "n_k_heads")
        _check_conv_width("gdn", self.conv_width)

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_k

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.d_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention: per-channel decay; heads share one size for q, k and v."""

    n_heads: int
    head_dim: int
    conv_width: int
    # "softplus": g = -exp(A_log) * softplus(raw + dt_bias)  (Kimi Linear)
    # "bounded":  g = lower_bound * sigmoid(exp(A_log) * (raw + dt_bias))
    gate_law: str = "softplus"
    gate_lower_bound: float | None = None

    def __post_init__(self):
        _check_conv_width("kda", self.conv_width)
        if self.gate_law not in ("softplus", "bounded"):
            raise ValueError(f"kda: unknown gate_law {self.gate_law!r}")
        if self.gate_law == "bounded" and self.gate_lower_bound is None:
            raise ValueError("kda: the bounded gate law needs gate_lower_bound")

    @property
    def proj_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.proj_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts plus optional shared experts.

    router "softmax": p = softmax(x W^T); top-k; renormalise when `renormalize`;
        shared expert scaled by sigmoid(shared_gate . x)  (Qwen3-Next)
    router "sigmoid": s = sigmoid(x W^T) in fp32; choose top-k of s + correction bias within
        the best `topk_group` of `n_group` groups; weights = s renormalised, times
        `routed_scaling_factor`; shared experts unscaled  (Kimi Linear)
    """

    router: str
    n_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self):
        _check_multiple("moe", self, "n_experts", "n_group")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"moe: unknown router {self.router!r}")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"moe: top_k {self.top_k} must be within 1..n_experts {self.n_experts}")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    mixers: tuple[str, ...]  # per layer, one of MIXERS
    mlps: tuple[str, ...]  # per layer, DENSE or MOE
    rms_norm_eps: float
    zero_centred_norm: bool  # Qwen: y = norm(x) * (1 + w); Kimi: y = w * norm(x)
    tie_word_embeddings: bool
    intermediate_size: int  # the dense MLP's; 0 when every layer is MoE (Qwen3.5-MoE)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    attention: AttentionConfig | None = None
    mla: MLAConfig | None = None
    gdn: GDNConfig | None = None
    kda: KDAConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self):
        if len(self.mixers) != len(self.mlps):
            raise ValueError(f"{len(self.mixers)} mixer kinds for {len(self.mlps)} MLP kinds")
        for i, kind in enumerate(self.mixers):
            if kind not in MIXERS:
                raise ValueError(f"layer {i}: unknown mixer {kind!r}")
            sub = {ATTENTION: self.attention, MLA: self.mla, GDN: self.gdn, KDA: self.kda}[kind]
            if sub is None:
                raise ValueError(f"layer {i} is {kind} but the config has no {kind} section")
        for i, kind in enumerate(self.mlps):
            if kind not in (DENSE, MOE):
                raise ValueError(f"layer {i}: unknown MLP kind {kind!r}")
            if kind == MOE and self.moe is None:
                raise ValueError(f"layer {i} is MoE but the config has no moe section")
            if kind == DENSE and self.intermediate_size <= 0:
                raise ValueError(f"layer {i} is a dense MLP but intermediate_size is {self.intermediate_size}")

    @property
    def n_layers(self) -> int:
        return len(self.mixers)
