import pytest
import torch

from verifier.model import load_model

FAMILIES = ["qwen3_next_moe", "qwen3_5_text", "kimi_linear", "kimi_linear_qlora"]


@pytest.fixture(scope="session")
def model_of(hf_checkpoint):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_model(hf_checkpoint(name))
        return cache[name]

    return get


def prompt_for(model, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (length,), generator=gen).tolist()
