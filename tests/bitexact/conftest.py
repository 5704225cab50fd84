import pytest
import torch


FAMILIES = ["qwen3_next_moe", "qwen3_5_text", "qwen3_5_moe", "kimi_linear", "kimi_linear_qlora"]


@pytest.fixture(scope="session")
def model_of(load_target):
    return load_target


def prompt_for(model, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (length,), generator=gen).tolist()
