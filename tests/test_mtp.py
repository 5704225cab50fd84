"""The checkpoint's MTP head (verifier/model/mtp.py): loading per family and storage, its forward
against a plain torch reference of the same math, and the default load left as it was.

The reference reads the weights from the safetensors file itself and writes every step out
(norms, concat, fc, gated attention with partial rotary over the layer's own keys, MLP or MoE,
final norm, head); only the hyperparameters (heads, rotary width, eps, top-k) come from our
parsed config, which tests/test_config.py and the parity tests check against transformers.
Tolerance: fp32 on the CPU, rtol = atol = 1e-5. The two compute the same real-number function
in other orders (q | k | v and gate | up as one GEMM, experts summed in fp32 in id order, attention
row by row), so they agree to a few fp32 ulps, not bitwise; a wrong tensor, order or cast is
off by orders of magnitude more.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from verifier.model import CheckpointError, RowBatch, load_model
from verifier.model.fp8_checkpoint import write_block_fp8_checkpoint, write_dequantized_checkpoint
from verifier.model.fp8 import FP8_DTYPE
from verifier.model.mtp import load_mtp_head
from verifier.model.ops import head_logits

# Qwen3.5 dense (tied head), Qwen3.5-MoE bare (experts per expert, odd rotary width), Qwen3-Next
# (untied, no count field in config.json), Qwen3.5-MoE published wrapper (fused experts).
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next_moe", "qwen3_5_moe"]
TOKENS = [5, 9, 2, 7, 11, 3, 8]
TOL = dict(rtol=1e-5, atol=1e-5)


def _edited_copy(model_dir, out_dir, edit):
    """A copy of checkpoint model_dir at out_dir whose tensors edit(tensors) changed in place."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def _run(head, tokens, hidden, chunks, slot=1):
    """The rows through head.forward in consecutive chunks of one sequence -> (out, logits)."""
    pool = head.new_pool(2, 16)
    outs, logits, start = [], [], 0
    for n in chunks:
        batch = RowBatch(slots=(slot,), starts=(start,), counts=(n,))
        out, lg = head.forward(torch.tensor(tokens[start:start + n]), hidden[start:start + n], batch, pool, row_invariant=True)
        outs.append(out)
        logits.append(lg)
        start += n
    return torch.cat(outs), torch.cat(logits)


def _norm(x, w, eps):
    """The family's zero-centred RMSNorm in fp32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, positions, rotary_dim, theta):
    """Rotate-half rotary over the first 2 * ceil(rotary_dim / 2) dims of x [T, heads, hd]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
    n = cos.shape[-1]
    rot, rest = x[..., :n], x[..., n:]
    half = torch.cat((-rot[..., n // 2:], rot[..., : n // 2]), -1)
    return torch.cat((rot * cos + half * sin, rest), -1)


def _swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _mlp(t, p, x, config):
    if p + "gate.weight" not in t:
        return _swiglu(x, t[p + "gate_proj.weight"], t[p + "up_proj.weight"], t[p + "down_proj.weight"])
    m = config.moe
    probs = torch.softmax(x @ t[p + "gate.weight"].T, -1)
    weights, ids = torch.topk(probs, m.top_k, -1)
    if m.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for w, e in zip(weights[row], ids[row].tolist()):
            if p + "experts.gate_up_proj" in t:
                gate_up, I = t[p + "experts.gate_up_proj"][e], m.expert_intermediate_size
                gate, up, down = gate_up[:I], gate_up[I:], t[p + "experts.down_proj"][e]
            else:
                gate, up, down = (t[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            out[row] += w * _swiglu(x[row:row + 1], gate, up, down)[0]
    shared = _swiglu(x, t[p + "shared_expert.gate_proj.weight"], t[p + "shared_expert.up_proj.weight"],
                     t[p + "shared_expert.down_proj.weight"])
    return out + torch.sigmoid(x @ t[p + "shared_expert_gate.weight"].T) * shared


def _reference(model_dir, config, tokens, hidden):
    """The MTP head on one sequence at positions 0 .. T-1, every tensor from the file -> (out, logits)."""
    t = {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}
    text = "model.language_model." if "model.language_model.embed_tokens.weight" in t else "model."
    embed = t[text + "embed_tokens.weight"]
    head = t.get("lm_head.weight", embed)
    a, eps, T = config.attention, config.rms_norm_eps, len(tokens)
    positions = torch.arange(T)
    x = torch.cat((_norm(embed[torch.tensor(tokens)], t["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)), -1) @ t["mtp.fc.weight"].T
    p = "mtp.layers.0."
    y = _norm(x, t[p + "input_layernorm.weight"], eps)
    q_and_gate = (y @ t[p + "self_attn.q_proj.weight"].T).view(T, a.n_heads, 2 * a.head_dim)
    q, gate = q_and_gate[..., : a.head_dim], q_and_gate[..., a.head_dim:].reshape(T, -1)
    k = (y @ t[p + "self_attn.k_proj.weight"].T).view(T, a.n_kv_heads, a.head_dim)
    v = (y @ t[p + "self_attn.v_proj.weight"].T).view(T, a.n_kv_heads, a.head_dim)
    q = _rope(_norm(q, t[p + "self_attn.q_norm.weight"], eps), positions, a.rotary_dim, a.rope_theta)
    k = _rope(_norm(k, t[p + "self_attn.k_norm.weight"], eps), positions, a.rotary_dim, a.rope_theta)
    group = a.n_heads // a.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * a.head_dim**-0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(T, -1)
    x = x + (attended * torch.sigmoid(gate)) @ t[p + "self_attn.o_proj.weight"].T
    x = x + _mlp(t, p + "mlp.", _norm(x, t[p + "post_attention_layernorm.weight"], eps), config)
    out = _norm(x, t["mtp.norm.weight"], eps)
    return out, out @ head.T


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_matches_a_plain_torch_reference(mtp_checkpoint, name):
    path = mtp_checkpoint(name)
    model = load_model(path)
    head = load_mtp_head(path, model)
    assert head is not None and head.n_layers == 1
    hidden = torch.randn(len(TOKENS), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    out, logits = _run(head, TOKENS, hidden, chunks=(4, 3))  # the second chunk attends to the first's KV rows
    ref_out, ref_logits = _reference(path, model.config, TOKENS, hidden)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(logits, ref_logits, **TOL)


def test_many_rows_in_one_call_equal_one_row_calls(mtp_checkpoint):
    """The verify-vs-decode contract for the head itself: K rows at once give the bits of K one-row calls."""
    path = mtp_checkpoint("qwen3_5_moe")
    model = load_model(path)
    head = load_mtp_head(path, model)
    hidden = torch.randn(len(TOKENS), model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    whole, serial = _run(head, TOKENS, hidden, chunks=(len(TOKENS),)), _run(head, TOKENS, hidden, chunks=(1,) * len(TOKENS))
    assert torch.equal(whole[0], serial[0]) and torch.equal(whole[1], serial[1])


def test_head_reads_the_main_models_hidden_rows(mtp_checkpoint):
    """compute's hidden_out is the LM head's input: the head of it gives the model's logits bitwise."""
    model = load_model(mtp_checkpoint("qwen3_next_moe"))
    pool, batch = model.new_pool(1, 16), RowBatch(slots=(0,), starts=(0,), counts=(len(TOKENS),))
    hidden = torch.empty(len(TOKENS), model.config.hidden_size)
    logits = model.compute(torch.tensor(TOKENS), batch, pool, row_invariant=True, last_only=False, record=None,
                           hidden_out=hidden)
    assert torch.equal(head_logits(hidden, model.lm_head, row_invariant=True), logits)


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next_moe"])
def test_default_load_skips_the_head_and_decodes_the_same_bits(hf_checkpoint, mtp_checkpoint, name):
    plain, with_mtp = load_model(hf_checkpoint(name)), load_model(mtp_checkpoint(name))
    pools = plain.new_pool(1, 16), with_mtp.new_pool(1, 16)
    a, b = (m.prefill(pool, pool.admit(), TOKENS, all_logits=True) for m, pool in zip((plain, with_mtp), pools))
    assert torch.equal(a, b)


def test_a_checkpoint_without_mtp_tensors_has_no_head(hf_checkpoint, tmp_path):
    """Even where config.json counts MTP layers (a converter dropped the tensors, as our full-size
    FP8 writer does): no head, no error."""
    path = shutil.copytree(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    assert load_mtp_head(path, load_model(path)) is None


def test_a_missing_mtp_tensor_is_named(mtp_checkpoint, tmp_path):
    path = _edited_copy(mtp_checkpoint("qwen3_5_moe_text"), tmp_path / "m", lambda t: t.pop("mtp.layers.0.self_attn.k_proj.weight"))
    model = load_model(path)  # the default load never reads them
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.layers\.0\.self_attn\.k_proj\.weight'"):
        load_mtp_head(path, model)


def test_a_partial_head_is_an_error(hf_checkpoint):
    """presets/tiny.py's published-layout Qwen3.5-MoE carries only mtp.fc and mtp.norm."""
    path = hf_checkpoint("qwen3_5_moe")
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.pre_fc_norm_embedding\.weight'"):
        load_mtp_head(path, load_model(path))


def test_extra_mtp_layers_beyond_the_config_count_are_named(mtp_checkpoint, tmp_path):
    extra = {"mtp.layers.1.input_layernorm.weight": torch.zeros(40)}
    path = _edited_copy(mtp_checkpoint("qwen3_5_text"), tmp_path / "m", lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"unexpected MTP tensor.*'mtp\.layers\.1\.input_layernorm\.weight'"):
        load_mtp_head(path, load_model(path))


def test_block_fp8_head_equals_its_dequantized_checkpoint(mtp_checkpoint, tmp_path):
    """The MTP linears quantized by the FP8 writer as the main ones: the head loads them (dequantized
    on the CPU) to the bits of the same head saved with the dequantized weights."""
    fp8 = write_block_fp8_checkpoint(mtp_checkpoint("qwen3_next_moe"), tmp_path / "fp8", (16, 24))
    stored = load_file(fp8 / "model.safetensors")
    assert stored["mtp.fc.weight"].dtype == FP8_DTYPE and "mtp.fc.weight_scale_inv" in stored
    assert stored["mtp.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    dequantized = write_dequantized_checkpoint(fp8, tmp_path / "dequantized")
    hidden = torch.randn(len(TOKENS), 48, generator=torch.Generator().manual_seed(3))
    results = []
    for path in (fp8, dequantized):
        model = load_model(path)
        results.append(_run(load_mtp_head(path, model), TOKENS, hidden, chunks=(4, 3)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
