"""Building the default pair's models with transformers, and counting their parameters; their
shapes are presets/training.py's.
"""

from __future__ import annotations

import torch

from presets.training import ModelShape

SIZE_LIMIT_BYTES = 64 << 20  # both checkpoints together, weights and tokenizers


def build_model(shape: ModelShape, vocab_size: int, eos_id: int, seed: int):
    """A freshly initialised transformers Qwen3_5ForCausalLM (fp32, train mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**shape.hf_fields(vocab_size, eos_id)))
    return model.train()


def count_parameters(model) -> dict:
    """Unique parameters (a tied head counted once), and those outside the embedding."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return {"parameters": total, "non_embedding_parameters": total - embedding}


def shape_parameters(shape: ModelShape, vocab_size: int) -> int:
    """Parameter count of a shape without allocating it (meta device)."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**shape.hf_fields(vocab_size, 0)))
    return count_parameters(model)["parameters"]
