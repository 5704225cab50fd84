"""bench/gemm.py: the weights bench.gpu's `gemm` section times, and its gates.

`linear_weights` is checked three ways on the tiny checkpoints of every family, loaded in bf16 on
the CPU: its distinct [N, K] and their counts equal those computed here from the HF config's fields
(hidden size, heads, projections, LM head); each returned tensor is the layer attribute its name
names (the same tensor, the same data_ptr); and they are exactly the weights a forward hands to
hybrid_kernels.linear, recorded with ops.linear dispatching as on CUDA. An FP8 checkpoint kept in FP8
(as on CUDA) checks the FP8 weights and the bf16 groups beside them. The row-invariance check and
the gates run on the CPU (the kernel under TRITON_INTERPRET=1); timing needs CUDA and skips without it.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import bench.gemm as gemm
from hybrid_kernels.linear_fp8 import dequantize_ref
from presets.tiny import SPECS
from verifier.model import RowBatch, load_model
from verifier.model import ops
from verifier.model.checkpoint import TensorSource
from verifier.model.config import DENSE, GDN, MIXERS, MOE
from verifier.model.hf_config import load_config
from verifier.model.hybrid import HybridModel

FAMILY_SPECS = ["qwen3_5_text", "qwen3_next_moe", "qwen3_next_odd", "qwen3_5_moe_text", "qwen3_5_moe", "kimi_linear", "kimi_linear_qlora"]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="timing against cuBLAS needs a CUDA device")


def expected_shapes(fields: dict, mixers: tuple[str, ...], mlps: tuple[str, ...]) -> Counter:
    """{(N, K): weights} multiplied through hybrid_kernels.linear in bf16, from the HF config's fields (the
    layer schedule from our parsed config). Not counted: routed experts, Kimi's fp32 router."""
    f = fields
    H, kimi = f["hidden_size"], "kv_lora_rank" in f
    shapes = Counter()
    for mixer, mlp in zip(mixers, mlps):
        if mixer == "gdn":  # q | k | v | z | b | a, then out_proj
            key_dim = f["linear_num_key_heads"] * f["linear_key_head_dim"]
            value_dim = f["linear_num_value_heads"] * f["linear_value_head_dim"]
            shapes.update([(2 * key_dim + 2 * value_dim + 2 * f["linear_num_value_heads"], H), (H, value_dim)])
        elif mixer == "attention":  # q (with its gate) | k | v, then o_proj
            hd = f["head_dim"]
            shapes.update([(2 * f["num_attention_heads"] * hd + 2 * f["num_key_value_heads"] * hd, H), (H, f["num_attention_heads"] * hd)])
        elif mixer == "kda":  # q | k | v | b | f_a | g_a, f_b, g_b, o_proj
            D = f["linear_head_dim"]
            P = f["linear_num_heads"] * D
            shapes.update([(3 * P + f["linear_num_heads"] + 2 * D, H), (P, D), (P, D), (H, P)])
        else:  # mla
            heads, qk = f["num_attention_heads"], f["qk_nope_head_dim"] + f["qk_rope_head_dim"]
            if f.get("q_lora_rank"):
                shapes.update([(f["q_lora_rank"], H), (heads * qk, f["q_lora_rank"])])
            else:
                shapes.update([(heads * qk, H)])
            shapes.update([(f["kv_lora_rank"] + f["qk_rope_head_dim"], H), (heads * (f["qk_nope_head_dim"] + f["v_head_dim"]), f["kv_lora_rank"]),
                           (H, heads * f["v_head_dim"])])
        if mlp == DENSE:
            shapes.update([(2 * f["intermediate_size"], H), (H, f["intermediate_size"])])
        elif kimi:  # shared experts as one MLP, unless folded into the experts (their width); the router is fp32
            shared = f["moe_intermediate_size"] * f["num_shared_experts"]
            if shared != f["moe_intermediate_size"]:
                shapes.update([(2 * shared, H), (H, shared)])
        else:  # softmax router, shared expert, its sigmoid gate
            shared = f["shared_expert_intermediate_size"]
            if shared == f["moe_intermediate_size"]:  # folded into the experts, its gate a row of the router
                shapes.update([(f["num_experts"] + 1, H)])
            else:
                shapes.update([(f["num_experts"], H), (2 * shared, H), (H, shared), (1, H)])
    shapes[(f["vocab_size"], H)] += 1  # the LM head
    return shapes


def resolve(model, name: str):
    """The attribute a GemmWeight's name names: 'lm_head' or 'layer i <mixer|mlp> [shared] w_x [group j]'."""
    if name == "lm_head":
        return model.lm_head
    words = name.split()
    assert words[0] == "layer", name
    block = model.blocks[int(words[1])]
    kinds = (model.config.mixers[int(words[1])], model.config.mlps[int(words[1])])
    assert words[2] in kinds, f"{name}: layer kinds are {kinds}"
    part, rest = (block.mixer if words[2] in MIXERS else block.mlp), words[3:]
    if rest[0] == "shared":
        part, rest = part.shared, rest[1:]
    value = getattr(part, rest[0])
    if len(rest) > 1:
        assert rest[1] == "group", name
        value = value.groups[int(rest[2])]
    return value


def traced_forward(model, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A 3-row forward with ops.linear dispatching as on CUDA -> (weights it handed to
    hybrid_kernels.linear, FP8 weights' data it handed to kernels/linear_fp8.py), each once."""
    plain, fp8 = {}, {}

    def record(store, weight):
        store.setdefault((weight.data_ptr(), tuple(weight.shape)), weight)

    def kernel_linear(x, weight, bias=None, out=None, defer_split=False):  # finished: what an unsplit weight returns
        record(plain, weight)
        result = F.linear(x, weight, bias)
        return result if out is None else out.copy_(result)  # the LM head's fp32 logits (ops.head_logits)

    def kernel_linear_fp8(x, data, scales, bias=None, out=None, defer_split=False, real=None, raw=None):
        record(fp8, data)
        result = F.linear(x, dequantize_ref(data, scales, x.dtype), bias)
        return result if out is None else out.copy_(result)  # a group of an OutFeatureGroups' output

    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    monkeypatch.setattr(ops, "linear_kernel", SimpleNamespace(linear=kernel_linear))
    monkeypatch.setattr(ops, "linear_fp8", SimpleNamespace(linear_fp8=kernel_linear_fp8))
    pool = model.new_pool(1, 8)
    model.forward(torch.tensor([1, 2, 3]), RowBatch((0,), (0,), (3,)), pool, row_invariant=True)
    return list(plain.values()), list(fp8.values())


def check_against_forward(model, monkeypatch) -> tuple[list[gemm.GemmWeight], dict]:
    """linear_weights against the model's own attributes and a traced forward; returns them."""
    weights, skipped = gemm.linear_weights(model)
    names = [gw.name for gw in weights]
    assert len(set(names)) == len(names), names
    for gw in weights:
        assert gw.weight.dtype == model.dtype and gw.weight.dim() == 2, gw.name
        attr = resolve(model, gw.name)
        assert attr is gw.weight and attr.data_ptr() == gw.weight.data_ptr(), gw.name
    plain, fp8 = traced_forward(model, monkeypatch)
    in_dtype = [w for w in plain if w.dtype == model.dtype]
    by_shape = Counter(tuple(w.shape) for w in in_dtype)
    assert {tuple(gw.weight.shape): gw.count for gw in weights} == dict(by_shape)
    traced = {(w.data_ptr(), tuple(w.shape)) for w in in_dtype}
    for gw in weights:
        assert (gw.weight.data_ptr(), tuple(gw.weight.shape)) in traced, f"{gw.name}: not a weight the forward hands to hybrid_kernels.linear"
    other_dtype = sum(n for why, n in skipped.items() if "not the model's dtype" in why)
    assert other_dtype == len(plain) - len(in_dtype)
    assert skipped.get(gemm.FP8_WEIGHTS, 0) == len(fp8)
    n_moe = sum(kind == MOE for kind in model.config.mlps)
    assert skipped.get(gemm.ROUTED_EXPERTS, 0) == 3 * n_moe  # gate, up and down stacks per MoE layer
    return weights, skipped


@pytest.mark.parametrize("spec", FAMILY_SPECS)
def test_linear_weights_are_the_configs_shapes_and_the_forwards_weights(spec, hf_checkpoint, monkeypatch):
    model = load_model(hf_checkpoint(spec), "cpu", torch.bfloat16)
    weights, skipped = check_against_forward(model, monkeypatch)
    _, fields, _ = SPECS[spec]
    want = expected_shapes(fields, model.config.mixers, model.config.mlps)
    got = {tuple(gw.weight.shape): gw.count for gw in weights}
    print(spec, {gw.name: (tuple(gw.weight.shape), gw.count) for gw in weights}, skipped)
    assert got == dict(want)
    if "kv_lora_rank" in fields:  # Kimi's sigmoid router is an fp32 GEMM, one per MoE layer
        assert sum(skipped.values()) - skipped.get(gemm.ROUTED_EXPERTS, 0) == sum(kind == MOE for kind in model.config.mlps)


def test_fp8_weights_are_skipped_and_their_bf16_groups_kept(tmp_path, monkeypatch):
    """The tiny Qwen3.6-FP8 checkpoint kept in FP8 (as the loader keeps it on CUDA): only the modules
    the published files keep in bf16 go through hybrid_kernels.linear: GDN's b | a (the bf16 group of its
    fused input projection), the routers, the shared experts' gates and the LM head."""
    from bench import fp8_real_size

    config = fp8_real_size.checkpoint_config("qwen3.6-35b-a3b", "tiny")
    fp8_real_size.write_checkpoint(tmp_path, config, "per-expert", 0, torch.device("cpu"), 10**9)
    model = HybridModel(load_config(tmp_path), TensorSource(tmp_path, "cpu", torch.bfloat16, keep_fp8=True))
    weights, skipped = check_against_forward(model, monkeypatch)
    t = config["text_config"]
    H, n_gdn = t["hidden_size"], sum(kind == GDN for kind in model.config.mixers)
    want = Counter({(2 * t["linear_num_value_heads"], H): n_gdn})
    # routers, each with its shared expert's gate as a last row (the shared expert folded into the experts)
    assert t["shared_expert_intermediate_size"] == t["moe_intermediate_size"]
    want[(t["num_experts"] + 1, H)] += model.config.n_layers
    want[(t["vocab_size"], H)] += 1
    assert {tuple(gw.weight.shape): gw.count for gw in weights} == dict(want)
    assert weights[0].name == "layer 0 gdn w_in group 1"
    n_attention = model.config.n_layers - n_gdn
    # FP8: GDN's q|k|v|z and out_proj, attention's q|k|v and o_proj (the shared experts are experts)
    assert skipped[gemm.FP8_WEIGHTS] == 2 * n_gdn + 2 * n_attention


def test_row_invariance_checked_and_no_timing_without_a_green_gate(hf_checkpoint):
    """model_gemm (the kernel on the GPU, or through the interpreter on the CPU): every shape's rows
    are checked, and a red model gate leaves every shape untimed."""
    model = load_model(hf_checkpoint("qwen3_5_text"), "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16)
    section = gemm.model_gemm(model, untimed="the model's bitexact gate is red")
    assert section["all_row_invariant"] is True
    assert section["rows"] == [1, 9, 72, 576] and section["skipped"] == {}
    for name, shape in section["shapes"].items():
        assert shape["row_invariant"] is True and shape["ok"] is True, name
        assert shape["rows"] is None and shape["untimed"] == "the model's bitexact gate is red", name
    assert list(section["shapes"]) == [gw.name for gw in gemm.linear_weights(model)[0]]


def test_a_shape_not_row_invariant_is_not_timed(monkeypatch):
    """A GEMM whose rows depend on the batch's row count: row_invariant says so and measure times
    nothing, with no reason given from outside (no CUDA is touched)."""

    def batch_dependent(x, w, out=None, **kwargs):
        return (F.linear(x.float(), w.float()) + 1e-2 * (x.shape[0] > 1)).to(x.dtype)

    monkeypatch.setattr(gemm, "linear", batch_dependent)
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)).bfloat16()
    figures = gemm.measure("batch-dependent", w, repeats=3)
    assert figures["row_invariant"] is False and figures["ok"] is False
    assert figures["rows"] is None and figures["untimed"] == "row_invariant is False"


@requires_cuda
def test_measure_times_ours_and_cublas_on_cuda():
    w = (torch.randn(384, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 256**-0.5).bfloat16()
    figures = gemm.measure("random [384, 256]", w, repeats=3, sweep=True)
    assert figures["row_invariant"] is True and figures["ok"] is True, figures
    assert list(figures["rows"]) == ["1", "9", "72", "576"]
    for m, r in figures["rows"].items():
        assert r["ours_ms"] > 0 and r["cublas_ms"] > 0 and r["ours_tflops"] > 0 and r["cublas_tflops"] > 0, (m, r)
        assert len(r["tile"]) == 5 and r["ours_over_cublas"] > 0, (m, r)
    assert figures["rows"]["576"]["tile"][0] == 128 and figures["rows"]["1"]["tile"][0] == 16


@requires_cuda
def test_model_gemm_times_a_models_own_weights_on_cuda(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen3_next_moe"), "cuda", torch.bfloat16)
    section = gemm.model_gemm(model, repeats=3)
    assert section["all_row_invariant"] is True
    for name, shape in section["shapes"].items():
        assert set(shape["rows"]) == {"1", "9", "72", "576"} and "untimed" not in shape, name
