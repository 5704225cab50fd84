"""Checkpoint loading: layouts, storage dtypes, and errors that name the tensor and the problem."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from presets.hf_reference import build_hf_model, fuse_experts
from presets.tiny import SPECS
from verifier.model import CheckpointError, ConfigError, load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_and_single_file_load_the_same_weights(hf_checkpoint):
    sharded, single = hf_checkpoint("qwen3_next_sharded"), hf_checkpoint("qwen3_next_moe")
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_model(sharded), load_model(single)
    assert torch.equal(a.embed, b.embed)
    assert torch.equal(a.blocks[0].mixer.w_in, b.blocks[0].mixer.w_in)
    assert all(torch.equal(getattr(a.blocks[1].mlp, w), getattr(b.blocks[1].mlp, w)) for w in ("w_gate", "w_up", "w_down"))


def test_bf16_storage_loads_into_fp32_and_bf16(hf_checkpoint):
    path = hf_checkpoint("qwen3_5_text_bf16")
    stored = load_file(path / "model.safetensors")
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    fp32 = load_model(path, dtype=torch.float32)
    bf16 = load_model(path, dtype=torch.bfloat16)
    assert fp32.embed.dtype == torch.float32 and bf16.embed.dtype == torch.bfloat16
    assert torch.equal(fp32.embed, stored["model.embed_tokens.weight"].float())
    pool = bf16.new_pool(1, 16)
    logits = bf16.prefill(pool, pool.admit(), [3, 4, 5])
    assert torch.isfinite(logits).all()


def test_fp16_storage(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({k: v.half() for k, v in t.items()}))
    model = load_model(path)
    assert model.embed.dtype == torch.float32


def test_fused_and_per_expert_moe_weights_agree(hf_checkpoint, tmp_path):
    """Experts stored fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]) load to the same weights."""
    per_expert = hf_checkpoint("qwen3_next_moe")
    fused = _copy(per_expert, tmp_path / "fused")
    _rewrite(fused, fuse_experts)
    a, b = load_model(per_expert), load_model(fused)
    for w in ("w_gate", "w_up", "w_down"):
        assert torch.equal(getattr(a.blocks[0].mlp, w), getattr(b.blocks[0].mlp, w))


def test_qwen3_5_moe_per_expert_and_published_fused_files_load_alike(hf_checkpoint, tmp_path):
    """The same transformers model saved per expert (as transformers saves it) and in the published
    layout (fused experts, `mtp.*` beside the text model): the same weights, the same logits bitwise."""
    family, fields, _ = SPECS["qwen3_5_moe"]
    per_expert = tmp_path / "per_expert"
    build_hf_model(family, fields).save_pretrained(per_expert)
    stored = load_file(per_expert / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in stored
    assert any(k.startswith("model.visual.") for k in stored)
    published = hf_checkpoint("qwen3_5_moe")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(published / "model.safetensors")
    a, b = load_model(per_expert), load_model(published)
    for i in range(a.config.n_layers):
        for w in ("w_router", "w_gate", "w_up", "w_down", "w_shared_gate"):
            assert torch.equal(getattr(a.blocks[i].mlp, w), getattr(b.blocks[i].mlp, w)), f"layer {i} {w}"
    pa, pb = a.new_pool(1, 16), b.new_pool(1, 16)
    assert torch.equal(a.prefill(pa, pa.admit(), [5, 6, 7, 8]), b.prefill(pb, pb.admit(), [5, 6, 7, 8]))


@pytest.mark.parametrize("name", ["qwen3_5_composite", "qwen3_5_moe"])
def test_mtp_and_vision_tensors_are_skipped_with_one_log_line(hf_checkpoint, tmp_path, caplog, name):
    path = _copy(hf_checkpoint(name), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"mtp.fc.weight": torch.zeros(4, 4), "mtp.norm.weight": torch.zeros(4)}))
    with caplog.at_level(logging.INFO, logger="verifier.model.checkpoint"):
        load_model(path)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "mtp" in lines[0]


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    _rewrite(path, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.linear_attn\.A_log'"):
        load_model(path)


def test_unexpected_tensor_is_named(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("kimi_linear"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.bogus\.weight"):
        load_model(path)


def test_wrong_shape_names_tensor_and_both_shapes(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("kimi_linear"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(5, 12)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.kv_b_proj\.weight' has shape \[5, 12\], expected \[72, 12\]"):
        load_model(path)


def test_unsupported_model_type(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported model_type 'llama'"):
        load_model(path)


def test_no_weights_and_missing_shard(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_model(path)
    sharded = _copy(hf_checkpoint("qwen3_next_sharded"), tmp_path / "s")
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names shard {shard.name}, which is missing"):
        load_model(sharded)


def test_integer_tensor_is_rejected(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.zeros(40, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is stored as torch\.int32"):
        load_model(path)


def test_kimi_original_tensor_names_load(hf_checkpoint, tmp_path):
    """The port's names (forget_gate.*, fused conv1d, mlp.*) and the original ones load to the same weights."""
    original = hf_checkpoint("kimi_linear")
    port = _copy(original, tmp_path / "port")

    def to_port(t):
        for k in list(t):
            if ".self_attn.f_a_proj." in k or ".self_attn.f_b_proj." in k or k.endswith(("self_attn.dt_bias", "self_attn.A_log")):
                t[k.replace(".self_attn.", ".self_attn.forget_gate.")] = t.pop(k)
        for i in (0, 2):
            p = f"model.layers.{i}.self_attn."
            t[p + "conv1d.weight"] = torch.cat([t.pop(p + f"{n}_conv1d.weight") for n in "qkv"])
        for k in list(t):
            if ".block_sparse_moe." in k:
                t[k.replace(".block_sparse_moe.", ".mlp.")] = t.pop(k)

    _rewrite(port, to_port)
    a, b = load_model(original), load_model(port)
    pa, pb = a.new_pool(1, 16), b.new_pool(1, 16)
    assert torch.equal(a.prefill(pa, pa.admit(), [5, 6, 7]), b.prefill(pb, pb.admit(), [5, 6, 7]))
