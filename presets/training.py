"""Shapes of the default pair's target and draft model (ModelShape), as `python -m training run
--preset` names them in PRESETS.

Both are `qwen3_5_text` (Gated DeltaNet + gated attention, tied embeddings, same tokenizer), the
family the verifier serves. The target keeps the 3 : 1 GDN : attention rhythm of the ~2B model of
presets/bench_models.py at ~1 % of its width; the draft is one such group of four layers, narrower.
Sizes are chosen so the pair, stored in bf16, stays under the 64 MiB the repository allows
(training/configs.py SIZE_LIMIT_BYTES). The tiny pair is the one the training test runs on the CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MAX_POSITIONS = 4096


@dataclass(frozen=True)
class ModelShape:
    """A model's shape. Fields other than `attention_every` and `linear_head_dim` carry the names of
    transformers' Qwen3_5TextConfig, so `hf_fields` passes them through unchanged."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    attention_every: int  # layer i is full attention when (i + 1) % attention_every == 0, else GDN
    num_attention_heads: int  # gated attention
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_head_dim: int  # GDN key and value head size (FLA's chunked kernels like 64)
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"ModelShape.{name} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelShape.num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"ModelShape.linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.attention_every == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)]

    def hf_fields(self, vocab_size: int, eos_id: int) -> dict:
        """Keyword arguments of transformers' Qwen3_5TextConfig."""
        shape = asdict(self)
        del shape["attention_every"]
        head_dim = shape.pop("linear_head_dim")
        return dict(
            vocab_size=vocab_size,
            **shape,
            layer_types=self.layer_types,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            tie_word_embeddings=True,
            max_position_embeddings=MAX_POSITIONS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            rms_norm_eps=1e-6,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )


# ~24M parameters at vocabulary 8192 (3.7M of them the tied embedding): 8 layers, GDN GDN GDN attention x 2.
TARGET = ModelShape(hidden_size=448, intermediate_size=1216, num_hidden_layers=8, attention_every=4, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_head_dim=64)
# ~5M parameters at vocabulary 8192 (2.1M of them the tied embedding): GDN GDN GDN attention.
DRAFT = ModelShape(hidden_size=256, intermediate_size=640, num_hidden_layers=4, attention_every=4, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64)
# Two layers each (GDN, attention): for the CPU end-to-end test.
TINY_TARGET = ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, attention_every=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_head_dim=16)
TINY_DRAFT = ModelShape(hidden_size=16, intermediate_size=32, num_hidden_layers=2, attention_every=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=1, linear_head_dim=8)

PRESETS = {"default": (TARGET, DRAFT), "tiny": (TINY_TARGET, TINY_DRAFT)}
