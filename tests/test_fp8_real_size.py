"""bench/fp8_real_size.py at --scale tiny on the CPU, end to end: the checkpoint it writes is the
published block-FP8 form (names, dtypes, scale shapes, quantization_config), the normal loader
serves it, and the correctness gate runs (36 verify rows bitwise equal to serial decode, and the
full batch of 64 sequences equal to each alone). The
full-size plan is checked against the published model's sizes without writing it; decode_bytes
is checked exactly on FP8 weights kept as BlockFP8Weight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import fp8_real_size as bench
from bench.gpu import decode_bytes, weight_bytes
from hybrid_kernels.linear_fp8 import BlockScales, standard_scale_row
from verifier.model.checkpoint import TensorSource
from verifier.model.fp8 import FP8_DTYPE, BlockFP8Weight, OutFeatureGroups
from verifier.model.hf_config import config_from_dict, load_config
from verifier.model.hybrid import HybridModel

# tensors the published files keep in their dtype (matched on the name's end)
KEPT_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight",
                 "in_proj_b.weight", "conv1d.weight", "layernorm.weight", "norm.weight", "dt_bias")


def run_tiny(tmp_path: Path, experts: str, keep: bool) -> tuple[dict, Path | None]:
    """main() at tiny scale on the CPU -> (results, the checkpoint folder when kept)."""
    work = tmp_path / "work"
    work.mkdir()
    result = bench.main(["--out", str(tmp_path / "out"), "--scale", "tiny", "--device", "cpu", "--workdir", str(work),
                         "--experts", experts, "--shard-gb", "0.0005", "--steps", "3"] + (["--keep"] if keep else []))
    kept = list(work.glob("*/qwen3.6-35b-a3b-fp8"))
    return result, (kept[0] if kept else None)


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():
                assert index["weight_map"][name] == file, name
                tensors[name] = handle.get_tensor(name)
    assert tensors.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


@pytest.mark.parametrize("experts", ["per-expert", "fused"])
def test_tiny_checkpoint_is_published_fp8_and_gates_green(tmp_path, experts):
    result, path = run_tiny(tmp_path, experts, keep=True)
    assert result["gate"] == "green" and result["bitexact_rows"] == "36/36"
    # the full batch: 64 decodes, then 64 verifies of K = 8, then mixed K; every row and layer state equal alone
    equal, checked = map(int, result["full_batch_rows"].split("/"))
    assert equal == checked > 0 and result["full_batch_first_difference"] is None
    assert result["full_batch_step_rows"][:2] == [bench.BATCH, bench.BATCH * (bench.K + 1)]
    assert result["logits_finite"] and result["logits_sane"]
    assert all(result[key] is None for key in bench.TIMED)  # the CPU reference is not timed
    written = json.loads(next((tmp_path / "out").glob("fp8_real_size_*.json")).read_text())
    assert written == json.loads(json.dumps(result))

    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": list(bench.KEPT_MODULES)}
    published = bench.published_configs()["qwen3.6-35b-a3b"]
    assert config["text_config"].keys() == published["text_config"].keys() and config.keys() - {"quantization_config"} == published.keys()
    text = config["text_config"]

    tensors = stored_tensors(path)
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert all(n.startswith(bench.PREFIX) or n == "lm_head.weight" for n in tensors)
    scales = {n for n in tensors if n.endswith("_scale_inv")}
    for name, tensor in tensors.items():
        if name in scales:
            weight = tensors[name.removesuffix("_scale_inv")]
            assert weight.dtype == FP8_DTYPE and tensor.dtype == torch.float32, name
            *lead, n, k = weight.shape
            assert list(tensor.shape) == [*lead, math.ceil(n / 128), math.ceil(k / 128)], name
        elif name.endswith("A_log"):
            assert tensor.dtype == torch.float32
        elif name.endswith(KEPT_SUFFIXES):
            assert tensor.dtype == torch.bfloat16, name
        else:  # every other linear weight is block FP8
            assert tensor.dtype == FP8_DTYPE and name + "_scale_inv" in scales, name
    E, I, H = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
    experts_of_layer0 = {n: list(t.shape) for n, t in tensors.items() if ".layers.0.mlp.experts." in n and n not in scales}
    if experts == "fused":
        assert experts_of_layer0 == {bench.PREFIX + "layers.0.mlp.experts.gate_up_proj": [E, 2 * I, H],
                                     bench.PREFIX + "layers.0.mlp.experts.down_proj": [E, H, I]}
    else:
        assert len(experts_of_layer0) == 3 * E
        assert experts_of_layer0[bench.PREFIX + f"layers.0.mlp.experts.{E - 1}.up_proj.weight"] == [I, H]
        assert experts_of_layer0[bench.PREFIX + f"layers.0.mlp.experts.{E - 1}.down_proj.weight"] == [H, I]


def test_checkpoint_deleted_unless_kept(tmp_path):
    result, path = run_tiny(tmp_path, "per-expert", keep=False)
    assert result["gate"] == "green" and path is None
    assert not any((tmp_path / "work").iterdir())


def test_full_size_plan_is_the_published_model():
    config = config_from_dict(bench.checkpoint_config("qwen3.6-35b-a3b", "full"))
    plan = bench.plan_tensors(config, "fused")
    total, active = bench.params(plan, config)
    assert 34.5e9 < total < 35e9 and 3.3e9 < active < 3.6e9  # 35B-A3B without its vision tower and mtp layer
    by_name = {t.name: t for t in plan}
    gate_up = by_name[bench.PREFIX + "layers.39.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (256, 1024, 2048) and gate_up.fp8
    assert gate_up.nbytes == 256 * 1024 * 2048 + 4 * 256 * 8 * 16
    assert not by_name["lm_head.weight"].fp8 and not by_name[bench.PREFIX + "layers.0.linear_attn.in_proj_b.weight"].fp8
    assert by_name[bench.PREFIX + "layers.3.self_attn.q_proj.weight"].fp8
    assert 35e9 < sum(t.nbytes for t in plan) < 36.5e9  # fits the H200 machine's 64 GiB disk with room


def test_weight_bytes_of_fp8_weights():
    data = torch.zeros(300, 200, dtype=FP8_DTYPE)
    fp8 = BlockFP8Weight(data, BlockScales(torch.ones(3, 2), standard_scale_row(300, 128), 128), torch.bfloat16)
    assert weight_bytes(fp8) == 300 * 200 + 3 * 2 * 4 + 300 * 4  # fp8 values, fp32 scales, int32 scale rows
    kept = torch.zeros(7, 200, dtype=torch.bfloat16)
    assert weight_bytes(OutFeatureGroups((fp8, kept))) == weight_bytes(fp8) + 7 * 200 * 2


def test_decode_bytes_counts_fp8_weights_and_chosen_experts(tmp_path):
    """decode_bytes on a model whose FP8 weights stay BlockFP8Weight (as on CUDA) equals the sum
    over the plan: every weight but the embedding, top_k experts per layer, bf16 for kept ones."""
    config_json = bench.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    plan = bench.write_checkpoint(tmp_path, config_json, "per-expert", 0, torch.device("cpu"), 10**9)
    model = HybridModel(load_config(tmp_path), TensorSource(tmp_path, "cpu", torch.bfloat16, keep_fp8=True))
    top_k = config_json["text_config"]["num_experts_per_tok"]

    def fp8_bytes(shape) -> int:  # one weight [N, K]: values, block scales, scale rows
        return math.prod(shape) + 4 * math.prod(bench.FORMAT.scale_shape(shape)) + 4 * shape[0]

    expected = 0
    for t in plan:
        if t.name.endswith("embed_tokens.weight"):
            continue
        if t.per_expert:
            expected += top_k * fp8_bytes(t.shape[1:])
        else:
            expected += fp8_bytes(t.shape) if t.fp8 else 2 * t.params
    assert decode_bytes(model) == expected


def test_same_seed_writes_the_same_bytes(tmp_path):
    config_json = bench.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    for folder, seed in (("a", 0), ("b", 0), ("c", 1)):
        bench.write_checkpoint(tmp_path / folder, config_json, "fused", seed, torch.device("cpu"), 10**9)
    shard = "model-00001-of-00001.safetensors"
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()
