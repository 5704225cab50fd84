"""Block-FP8 checkpoints: the writer, the loader's checks, parity with the dequantized model, and
the bit-exactness contract on an FP8 checkpoint.

Checkpoints are the tiny transformers-saved specs written in block FP8 with small blocks
([16, 16] or [16, 24]), so every weight has several blocks and partial edge blocks.

Parity. The model loaded from an FP8 checkpoint and the model loaded from its dequantized form
(write_dequantized_checkpoint: every FP8 weight replaced by fp8 x scale in fp32) multiply by the
same real weights: on the CPU the loader dequantizes once to the compute dtype, which is exactly
the dequantized checkpoint's fp32 value (fp32 holds fp8 x scale exactly, one product) cast to that
dtype, and the layers then run the same code on the same tensors. So the logits are asserted
torch.equal, prefill, decode and verify, fp32 and bf16. The same holds with the FP8 weights kept
as BlockFP8Weight through the layers (keep_fp8: the plumbing CUDA uses), which the CPU dequantizes
per GEMM. On CUDA (--model-device cuda) the FP8 kernels rebuild the same real weight in registers
but are other kernels than the bf16 ones, so there the parity bound is a tolerance (below).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitexact.test_verify_vs_serial as contract  # a module: pytest collects its tests there, not here
from bitexact.serial import serial_run
from verifier.engine import Engine
from verifier.model import CheckpointError, ConfigError, load_model
from verifier.model.checkpoint import TensorSource
from verifier.model.fp8 import FP8_DTYPE, BlockFP8Format, BlockFP8Weight, OutFeatureGroups
from verifier.model.fp8_checkpoint import dequantize_block_fp8, quantize_block_fp8, write_block_fp8_checkpoint, write_dequantized_checkpoint
from verifier.model.hf_config import load_config
from verifier.model.hybrid import HybridModel
from verifier.model.rollback import ROLLBACK_MODES
from verifier.model.rows import RowBatch
from verifier.model.step import decode, verify

BLOCK = (16, 24)
FORMAT = BlockFP8Format(*BLOCK)
# CUDA: FP8 GEMM vs bf16 GEMM over the same real weights, fp32 logits of a 4-layer model; the
# kernels' summation orders differ, a few bf16 ulps through the layers (~1e-2 relative)
CUDA_PARITY = dict(rtol=3e-2, atol=3e-2)


@pytest.fixture(scope="module")
def fp8_pair(hf_checkpoint, tmp_path_factory):
    """fp8_pair(spec) -> (FP8 checkpoint dir, its dequantized twin), built once per module."""
    cache = {}

    def get(name: str, block=BLOCK):
        if (name, block) not in cache:
            root = tmp_path_factory.mktemp(f"{name}_fp8")
            fp8 = write_block_fp8_checkpoint(hf_checkpoint(name), root / "fp8", block)
            cache[name, block] = fp8, write_dequantized_checkpoint(fp8, root / "dequantized")
        return cache[name, block]

    return get


def _logits(model, prompt=(3, 4, 5, 6, 7, 8), drafts=(9, 10, 11)) -> torch.Tensor:
    """Prefill logits of every prompt token, then a decode row and a verify of 3 drafts."""
    pool = model.new_pool(1, 32)
    slot = pool.admit()
    engine_free = torch.cat([model.prefill(pool, slot, list(prompt), all_logits=True),
                             decode(model, pool, [slot], [len(prompt)], [prompt[-1]])])
    batch = RowBatch(slots=(slot,), starts=(len(prompt) + 1,), counts=(len(drafts) + 1,))
    verify_logits = verify(model, pool, torch.tensor([prompt[0], *drafts]), batch).logits
    return torch.cat([engine_free, verify_logits])


# ---- the writer -------------------------------------------------------------------------------


def test_quantize_rounds_each_block_to_fp8(tmp_path):
    """scale = amax / 448 per block (edge blocks partial, an all-zero block gets 1); the dequantized
    value is within fp8's rounding of the original: 2^-4 relative (3 mantissa bits, half a step),
    or half the smallest subnormal step (2^-10 x scale) near zero."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 37, 53, generator=g) * torch.logspace(-3, 2, 53)
    weight[0, :16, :24] = 0
    fp8, scale = quantize_block_fp8(weight, BLOCK)
    assert fp8.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (2, 3, 3)
    assert scale[0, 0, 0] == 1 and not fp8[0, :16, :24].float().any()
    assert torch.equal(scale[1, 2, 2], weight[1, 32:, 48:].abs().max() / 448)
    per_element = scale.repeat_interleave(16, dim=1)[:, :37].repeat_interleave(24, dim=2)[:, :, :53]
    real = fp8.float() * per_element
    assert ((real - weight).abs() <= weight.abs() * 2.0**-4 + per_element * 2.0**-10).all()


def test_writer_quantizes_linears_only(fp8_pair, hf_checkpoint):
    fp8_dir, _ = fp8_pair("qwen3_next_moe")
    stored = load_file(fp8_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(BLOCK),
                                             "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate"]}
    kept = [n for n, t in stored.items() if t.dtype != FP8_DTYPE and not n.endswith("_scale_inv")]
    for name in kept:  # everything not quantized is a non-linear or a kept module
        assert (stored[name].dim() != 2 or any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate"))), name
    for leaf in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "embed_tokens.weight", "mlp.gate.weight", "shared_expert_gate.weight"):
        assert any(n.endswith(leaf) for n in kept), f"{leaf} should stay in its dtype"
    quantized = [n for n, t in stored.items() if t.dtype == FP8_DTYPE]
    for leaf in ("in_proj_qkvz.weight", "in_proj_ba.weight", "q_proj.weight", "experts.3.down_proj.weight", "shared_expert.up_proj.weight"):
        assert any(n.endswith(leaf) for n in quantized), f"{leaf} should be quantized"
    for name in quantized:
        n, k = stored[name].shape
        assert stored[name + "_scale_inv"].shape == (-(-n // BLOCK[0]), -(-k // BLOCK[1]))


def test_writer_respects_modules_to_not_convert(hf_checkpoint, tmp_path):
    out = write_block_fp8_checkpoint(hf_checkpoint("qwen3_5_text"), tmp_path / "fp8", BLOCK, modules_to_not_convert=("linear_attn.in_proj_b",))
    stored = load_file(out / "model.safetensors")
    assert stored["model.layers.1.linear_attn.in_proj_b.weight"].dtype == torch.float32
    assert stored["model.layers.1.linear_attn.in_proj_a.weight"].dtype == FP8_DTYPE


# ---- parity with the dequantized model --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next_moe", "kimi_linear", "qwen3_5_composite", "qwen3_next_sharded"])
def test_fp8_checkpoint_equals_its_dequantized_form(fp8_pair, name, dtype):
    fp8_dir, dequantized = fp8_pair(name)
    assert torch.equal(_logits(load_model(fp8_dir, dtype=dtype)), _logits(load_model(dequantized, dtype=dtype)))


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next_moe", "kimi_linear_qlora"])
def test_weights_kept_in_fp8_compute_the_same(fp8_pair, name):
    """keep_fp8 (CUDA's plumbing, run on the CPU): the layers hold BlockFP8Weight (rows permuted
    and concatenated with their scale rows, experts stacked) and give the dequantized model's bits."""
    fp8_dir, dequantized = fp8_pair(name)
    kept = HybridModel(load_config(fp8_dir), TensorSource(fp8_dir, "cpu", torch.float32, keep_fp8=True))
    assert isinstance(kept.blocks[-1].mlp.w_down, BlockFP8Weight)
    assert torch.equal(_logits(kept), _logits(load_model(dequantized)))


def test_mixed_fp8_and_kept_projections(hf_checkpoint, tmp_path):
    """in_proj_b kept in its dtype between FP8 projections: GDN's fused input weight becomes groups
    of one kind each (a GEMM per group); the logits stay within fp32 summation noise of the
    dequantized model (separate GEMMs sum each column as one GEMM does, but the CPU's GEMV may
    block its columns differently)."""
    fp8_dir = write_block_fp8_checkpoint(hf_checkpoint("qwen3_5_text"), tmp_path / "fp8", BLOCK, modules_to_not_convert=("in_proj_b",))
    dequantized = write_dequantized_checkpoint(fp8_dir, tmp_path / "dequantized")
    kept = HybridModel(load_config(fp8_dir), TensorSource(fp8_dir, "cpu", torch.float32, keep_fp8=True))
    assert isinstance(kept.blocks[1].mixer.w_in, OutFeatureGroups)
    assert [type(g) for g in kept.blocks[1].mixer.w_in.groups] == [BlockFP8Weight, torch.Tensor, BlockFP8Weight]
    want = _logits(load_model(dequantized))
    torch.testing.assert_close(_logits(kept), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(_logits(load_model(fp8_dir)), want)  # dequantized at load: one weight again


def test_fused_fp8_experts(fp8_pair, tmp_path):
    """transformers' fused expert stacks in FP8 (gate_up_proj [E, 2I, H] with gate_up_proj_scale_inv,
    I 24 off the 16-row block grid, so gate and up share a block): kept in FP8 or dequantized at
    load, the same bits."""
    fp8_dir, _ = fp8_pair("qwen3_next_moe")
    fused = tmp_path / "fused"
    shutil.copytree(fp8_dir, fused)
    tensors = load_file(fused / "model.safetensors")
    for p in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        n_experts = len([k for k in tensors if k.startswith(p + ".experts.") and k.endswith("gate_proj.weight")])
        deq = {}
        for part in ("gate_proj", "up_proj", "down_proj"):
            deq[part] = [dequantize_block_fp8(tensors.pop(f"{p}.experts.{e}.{part}.weight"),
                                              tensors.pop(f"{p}.experts.{e}.{part}.weight_scale_inv"), FORMAT, torch.float32)
                         for e in range(n_experts)]
        gate_up = torch.stack([torch.cat(pair) for pair in zip(deq["gate_proj"], deq["up_proj"])])
        for name, real in (("gate_up_proj", gate_up), ("down_proj", torch.stack(deq["down_proj"]))):
            fp8, scale = quantize_block_fp8(real, BLOCK)
            tensors[f"{p}.experts.{name}"], tensors[f"{p}.experts.{name}_scale_inv"] = fp8, scale
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    kept = HybridModel(load_config(fused), TensorSource(fused, "cpu", torch.float32, keep_fp8=True))
    assert isinstance(kept.blocks[0].mlp.w_gate, BlockFP8Weight)
    want = _logits(load_model(write_dequantized_checkpoint(fused, tmp_path / "fused_dequantized")))
    assert torch.equal(_logits(kept), want)
    assert torch.equal(_logits(load_model(fused)), want)


# ---- clear errors -----------------------------------------------------------------------------


def _edited(fp8_pair, tmp_path, *, config=None, tensors=None):
    fp8_dir, _ = fp8_pair("qwen3_5_text")
    out = tmp_path / "edited"
    shutil.copytree(fp8_dir, out)
    if config:
        data = json.loads((out / "config.json").read_text())
        config(data)
        (out / "config.json").write_text(json.dumps(data))
    if tensors:
        stored = load_file(out / "model.safetensors")
        tensors(stored)
        save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    return out


Q = "model.layers.0.self_attn.q_proj.weight"
BAD = {
    "quant_method": (dict(config=lambda c: c["quantization_config"].update(quant_method="gptq")), ConfigError, "quant_method"),
    "block_size": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[128])), ConfigError, "weight_block_size"),
    "no_block_size": (dict(config=lambda c: c["quantization_config"].pop("weight_block_size")), ConfigError, "weight_block_size"),
    "static": (dict(config=lambda c: c["quantization_config"].update(activation_scheme="static")), ConfigError, "activation_scheme"),
    "fmt": (dict(config=lambda c: c["quantization_config"].update(fmt="e5m2")), ConfigError, "fmt"),
    "not_convert_type": (dict(config=lambda c: c["quantization_config"].update(modules_to_not_convert="lm_head")), ConfigError,
                         "modules_to_not_convert"),
    "no_quantization_config": (dict(config=lambda c: c.pop("quantization_config")), CheckpointError, "no quantization_config"),
    "missing_scale": (dict(tensors=lambda t: t.pop(Q + "_scale_inv")), CheckpointError, "weight_scale_inv' is missing"),
    "scale_shape": (dict(tensors=lambda t: t.update({Q + "_scale_inv": torch.ones(1, 1)})), CheckpointError, r"expected \[6, 2\]"),
    "listed_but_fp8": (dict(config=lambda c: c["quantization_config"]["modules_to_not_convert"].append("self_attn.q_proj")),
                       CheckpointError, "modules_to_not_convert"),
    "scale_on_bf16": (dict(tensors=lambda t: t.update({Q: t[Q].float()})), CheckpointError, "has a block scale"),
    "fp8_scale": (dict(tensors=lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"].to(FP8_DTYPE)})), CheckpointError,
                  "block scales are fp32"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_fp8_checkpoints_name_the_problem(fp8_pair, tmp_path, case):
    edit, error, message = case
    with pytest.raises(error, match=message):
        load_model(_edited(fp8_pair, tmp_path, **edit))


# ---- the bit-exactness contract on FP8 checkpoints (on --model-device: cuda runs the FP8 kernels) ----


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next_moe"])
def test_fp8_verify_rows_equal_serial_decode(fp8_pair, model_device, name, mode):
    """tests/bitexact's contract, run on the FP8 checkpoint: verify rows == serial decode rows
    (torch.equal) and rolled-back state == serial state, K 1..8, drafts wrong, right and random."""
    fp8_dir, dequantized = fp8_pair(name)
    model = load_model(fp8_dir, model_device)
    if model_device == "cuda":  # the FP8 kernels serve the projections and the experts
        assert isinstance(model.blocks[0].mlp.w_down, BlockFP8Weight)
    contract.test_verify_rows_and_rolled_back_state_equal_serial(lambda _: model, f"{name} (block FP8)", mode)
    if model_device == "cuda":  # same real weights as the dequantized model, other kernels: a tolerance
        prompt = [3, 4, 5, 6, 7]
        want = serial_run(Engine(load_model(dequantized, model_device), 1, 64), prompt, 12).logits
        torch.testing.assert_close(serial_run(Engine(model, 1, 64), prompt, 12).logits, want, **CUDA_PARITY)


@pytest.mark.parametrize("walk", [False, True], ids=["dequantize", "scale_after"])
@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next_moe"])
def test_kept_real_weights_give_the_bits_of_dequantizing_each_gemm(fp8_pair, model_device, name, walk, monkeypatch):
    """On CUDA in bf16 the dense FP8 weights keep what their GEMMs of 64 or more rows multiply
    (load_model's fp8_reals: the real values, or the raw ones where the dense walk is scale-after):
    a 100-row prefill's every logit row equals, bitwise, the model's that makes them each GEMM instead."""
    if model_device != "cuda":
        pytest.skip("the real values are kept on CUDA only (the CPU reference loads the real weights themselves)")
    import hybrid_kernels.linear_fp8 as lf

    monkeypatch.setattr(lf, "SCALE_AFTER_ON", walk)
    fp8_dir, _ = fp8_pair(name)
    kept, plain = load_model(fp8_dir, "cuda", torch.bfloat16), load_model(fp8_dir, "cuda", torch.bfloat16, fp8_reals=False)
    def dense(model) -> list[BlockFP8Weight]:
        weights = [w for w in vars(model.blocks[0].mixer).values() if isinstance(w, BlockFP8Weight)]
        return weights + [g for w in vars(model.blocks[0].mixer).values() if isinstance(w, OutFeatureGroups)
                          for g in w.groups if isinstance(g, BlockFP8Weight)]

    assert dense(kept) and all(w.kept_bytes for w in dense(kept)) and not any(w.kept_bytes for w in dense(plain))
    prompt = [(7 * i) % 60 + 3 for i in range(100)]
    rows = []
    for model in (kept, plain):
        pool = model.new_pool(1, 128)
        rows.append(model.prefill(pool, pool.admit(), prompt, all_logits=True))
    assert torch.equal(*rows)
