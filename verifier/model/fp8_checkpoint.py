"""Write a saved HF checkpoint directory in block FP8, as published `-FP8` checkpoints are, and
back: its dequantized form (the parity oracle of the FP8 tests).

Quantization (per [block_n, block_k] block of a weight [..., N, K], edge blocks partial):
    scale = amax(|W_block|) / 448 in fp32 (1 for an all-zero block)
    fp8   = float8_e4m3fn(W_block / scale), clamped to +-448
    `<name>.weight_scale_inv` = scale, fp32 [..., ceil(N / block_n), ceil(K / block_k)]
Quantized: every linear weight (2-D `.weight`, and transformers' fused 3-D expert stacks). Kept
in their dtype: embeddings, norms, the LM head, routers (`mlp.gate`), `shared_expert_gate`,
conv1d, A_log, dt_bias, biases, and whatever modules_to_not_convert names. config.json gains
the quantization_config; other files are copied. Shards are converted one at a time (the same
file names and index), so a large checkpoint never sits in memory whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_kernels.linear_fp8 import dequantize_ref

from .checkpoint import canonical_name, checkpoint_files
from .fp8 import FP8_DTYPE, FP8_MAX, BlockFP8Format

# modules every FP8 checkpoint keeps in its dtype (transformers' matching: a suffix or a prefix)
ALWAYS_KEPT = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate")
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
INDEX = "model.safetensors.index.json"


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (float8_e4m3fn [..., N, K], fp32 scale [..., ceil(N / bn), ceil(K / bk)])."""
    bn, bk = block
    *lead, n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, rows * bn, cols * bk, dtype=torch.float32, device=weight.device)  # zeros never raise an amax
    padded[..., :n, :k] = weight.float()
    blocks = padded.view(*lead, rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., rows, cols]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_element = scale[..., :, None, :, None]  # broadcast over each block's bn x bk values
    fp8 = (blocks / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(*lead, rows * bn, cols * bk)[..., :n, :k]
    return fp8.contiguous(), scale.contiguous()


def dequantize_block_fp8(fp8: torch.Tensor, scale: torch.Tensor, fmt: BlockFP8Format, dtype: torch.dtype) -> torch.Tensor:
    """The real weight [..., N, K] of a stored pair: fp32(fp8) * its block's scale in fp32, cast
    once to dtype (kernels/linear_fp8.dequantize_ref, as the loader computes it)."""
    return dequantize_ref(fp8, fmt.scales(scale.float(), fp8.shape[-2]), dtype)


def is_quantized(stored: str, tensor: torch.Tensor, fmt: BlockFP8Format) -> bool:
    """Whether the writer quantizes this tensor: a linear weight no kept pattern names."""
    name = canonical_name(stored)
    linear = (tensor.dim() == 2 and name.endswith(".weight")) or (tensor.dim() == 3 and name.endswith(_FUSED_EXPERTS))
    if not linear or not tensor.dtype.is_floating_point:
        return False
    modules = {stored.removesuffix(".weight"), name.removesuffix(".weight")}
    return not any(fmt.keeps(m) for m in modules)


def write_block_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, block: tuple[int, int] = (128, 128),
                               modules_to_not_convert: tuple[str, ...] = (), device: torch.device | str = "cpu") -> Path:
    """src_dir: a bf16/fp16/fp32 HF checkpoint directory -> out_dir in block FP8 (module docstring).
    device: where each weight is quantized (a GPU quantizes a published-width expert stack in
    milliseconds where the CPU takes seconds)."""
    fmt = BlockFP8Format(block[0], block[1], ALWAYS_KEPT + tuple(m for m in modules_to_not_convert if m not in ALWAYS_KEPT))

    def convert(stored: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_quantized(stored, tensor, fmt):
            return {stored: tensor}
        fp8, scale = quantize_block_fp8(tensor.to(device), block)
        return {stored: fp8.cpu(), stored + "_scale_inv": scale.cpu()}

    def edit_config(config: dict) -> dict:
        return {**config, "quantization_config": fmt.to_config()}

    return _rewrite(Path(src_dir), Path(out_dir), convert, edit_config)


def write_dequantized_checkpoint(fp8_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A block-FP8 checkpoint -> out_dir with every FP8 weight replaced by its real value in dtype
    (fp32 holds fp8 x scale exactly, so loading it in fp32 or bf16 gives what loading the FP8
    checkpoint gives) and no quantization_config. Other tensors are copied as stored."""
    fp8_dir = Path(fp8_dir)
    with open(fp8_dir / "config.json") as f:
        fmt = BlockFP8Format.from_config(json.load(f)["quantization_config"])
    pending: dict[str, torch.Tensor] = {}  # an fp8 weight or a scale until its partner is read (any shard)

    def convert(stored: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        weight_name = stored.removesuffix("_scale_inv")
        partner = stored + "_scale_inv" if weight_name == stored else weight_name
        if tensor.dtype != FP8_DTYPE and weight_name == stored:
            return {stored: tensor}
        if partner not in pending:
            pending[stored] = tensor
            return {}
        other = pending.pop(partner)
        fp8, scale = (tensor, other) if weight_name == stored else (other, tensor)
        return {weight_name: dequantize_block_fp8(fp8, scale, fmt, dtype)}

    def edit_config(config: dict) -> dict:
        return {k: v for k, v in config.items() if k != "quantization_config"}

    out = _rewrite(fp8_dir, Path(out_dir), convert, edit_config)
    if pending:
        raise ValueError(f"{fp8_dir}: FP8 weight(s) without a scale, or scales without a weight: {sorted(pending)[:4]}")
    return out


def _rewrite(src: Path, out: Path, convert, edit_config) -> Path:
    """Copy a checkpoint directory, each shard's tensors through convert(stored name, tensor) ->
    {name: tensor}, config.json through edit_config; other files as they are."""
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for path in checkpoint_files(src):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {"format": "pt"}
            for stored in handle.keys():
                tensors.update(convert(stored, handle.get_tensor(stored)))
        save_file(tensors, str(out / path.name), metadata=metadata)
        weight_map.update({name: path.name for name in tensors})
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if (src / INDEX).is_file():
        with open(src / INDEX) as f:
            index = json.load(f)
        with open(out / INDEX, "w") as f:
            json.dump({**index, "metadata": {**index.get("metadata", {}), "total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    with open(src / "config.json") as f:
        config = json.load(f)
    with open(out / "config.json", "w") as f:
        json.dump(edit_config(config), f, indent=2)
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and path.name != INDEX and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    return out

