"""The contract at the published widths, on the GPU: a few layers of each published MoE family at
their real sizes (hidden size, heads, 256-512 experts and their widths, the vocabulary), in bf16
and in block FP8, with a full batch of 64 sequences stepped together against each sequence alone
(`python -m verifier check`'s full_batch_vs_alone: a step of 64 decodes, one of 64 K = 8 verifies,
mixed K after; every logit row and layer state bitwise).

Why real widths: a kernel whose launch follows the row count can keep a row's bits at tiny shapes
and lose them at the published ones (the FP8 GEMM did: kernels/linear_fp8.py says how), and tiny
batches never reach the row counts where tiles change. Without a GPU these tests skip: the CPU
reference computes rows one at a time, and the interpreter's dot never mixes rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from bench import fp8_real_size
from presets.published import KIMI_LINEAR_48B_A3B, QWEN3_NEXT_80B_A3B
from verifier.check.checks import CheckSettings, full_batch_vs_alone
from verifier.model import load_model
from verifier.model.fp8_checkpoint import write_block_fp8_checkpoint
from verifier.model.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the published widths on the Triton kernels")

FULL_BATCH = CheckSettings(max_k=8, prompt_len=8, new_tokens=6, sequences=64, seed=0)


def _assert_full_batch_equal(model, what: str) -> None:
    result = full_batch_vs_alone(model, FULL_BATCH, lambda message: None)
    assert result.batch_rows[:2] == [64, 64 * 9], result.batch_rows
    first = result.first_difference.describe() if result.first_difference else None
    assert result.passed and result.states.equal == result.states.checked > 0, \
        f"{what}: {result.rows.equal}/{result.rows.checked} rows, {result.states.equal}/{result.states.checked} states equal; {first}"


def _two_layers_of_qwen3_next() -> dict:
    config = copy.deepcopy(QWEN3_NEXT_80B_A3B)
    config.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return config


def _two_layers_of_kimi() -> dict:
    config = copy.deepcopy(KIMI_LINEAR_48B_A3B)
    config["num_hidden_layers"] = 2  # layer 1: KDA with the dense MLP (first_k_dense_replace), layer 2: MLA with the MoE
    config["linear_attn_config"] = {**config["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]}
    return config


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """written(name, config, fp8) -> a checkpoint of config's published widths with random weights
    drawn on the GPU (bf16), or its block-FP8 form (128 x 128 blocks, quantized on the GPU)."""
    cache = {}

    def get(name: str, config: dict, fp8: bool):
        if (name, fp8) not in cache:
            if (name, False) not in cache:
                cache[name, False] = write_random_checkpoint(config, tmp_path_factory.mktemp(name), device="cuda", dtype=torch.bfloat16)
            if fp8:
                cache[name, True] = write_block_fp8_checkpoint(cache[name, False], tmp_path_factory.mktemp(f"{name}_fp8"), device="cuda")
        return cache[name, fp8]

    return get


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", ["qwen3_next_80b_a3b", "kimi_linear_48b_a3b"])
def test_full_batch_equals_alone_at_published_widths(written, name, fp8):
    config = {"qwen3_next_80b_a3b": _two_layers_of_qwen3_next, "kimi_linear_48b_a3b": _two_layers_of_kimi}[name]()
    model = load_model(written(name, config, fp8), "cuda", torch.bfloat16)
    _assert_full_batch_equal(model, f"{name} {'fp8' if fp8 else 'bf16'}")


@pytest.mark.parametrize("scale, layers", [("full", 4), ("tiny", None)])
def test_published_fp8_checkpoint_full_batch_equals_alone(tmp_path, scale, layers):
    """Qwen3.6-35B-A3B as its published -FP8 files store it (bench/fp8_real_size.py's writer: experts
    per expert, the GDN gates and routers in bf16): four layers at full width, and the whole model
    at the bench's tiny scale."""
    config = fp8_real_size.checkpoint_config("qwen3.6-35b-a3b", scale)
    if layers:
        config["text_config"].update(num_hidden_layers=layers, layer_types=config["text_config"]["layer_types"][:layers])
    path = tmp_path / "ckpt"
    fp8_real_size.write_checkpoint(path, config, "per-expert", 0, torch.device("cuda"), int(4e9))
    _assert_full_batch_equal(load_model(path, "cuda", torch.bfloat16), f"qwen3.6-35b-a3b fp8 {scale}")


def test_gate_columns_handed_over_unfinished(tmp_path, monkeypatch):
    """Qwen3.6-35B-A3B's GDN gates b | a are bf16 beside the FP8 input projection: their GEMM splits
    K (2048) and hands its unfinished sums to the head split (ops.linear_columns), which finishes
    them as the reduce would. Every logit row of a prefill and of the next decode equals, bitwise,
    the model's that finishes them first (the plain split of one output)."""
    from hybrid_kernels.linear import SplitSums
    from verifier.model import ops
    from verifier.model.fp8 import OutFeatureGroups
    from verifier.model.layers import gdn

    config = fp8_real_size.checkpoint_config("qwen3.6-35b-a3b", "full")
    config["text_config"].update(num_hidden_layers=1, layer_types=config["text_config"]["layer_types"][:1])
    fp8_real_size.write_checkpoint(tmp_path / "ckpt", config, "per-expert", 0, torch.device("cuda"), int(4e9))
    model = load_model(tmp_path / "ckpt", "cuda", torch.bfloat16)
    mixer = model.blocks[0].mixer
    assert isinstance(mixer.w_in, OutFeatureGroups) and isinstance(mixer.w_in.groups[-1], torch.Tensor)
    x = torch.randn(3, mixer.w_in.shape[1], device="cuda").bfloat16()
    assert isinstance(ops.linear_columns(x, mixer.w_in, 2 * mixer.cfg.n_v_heads)[1], SplitSums)

    def run() -> torch.Tensor:
        pool = model.new_pool(1, 32)
        slot = pool.admit()
        prompt = [5, 17, 29, 41, 53, 65, 77, 89]
        rows = model.prefill(pool, slot, prompt, all_logits=True)
        from verifier.model.step import decode
        return torch.cat([rows, decode(model, pool, [slot], [len(prompt)], [prompt[-1]])])

    handed_over = run()

    def finished_first(x, weight, tail):
        out = ops.linear(x, weight)
        return out[:, : out.shape[1] - tail], out[:, out.shape[1] - tail :]

    monkeypatch.setattr(gdn, "linear_columns", finished_first)
    assert torch.equal(handed_over, run())
